// di_client without a server: Tensor helpers and proto round trips, bf16 rounding, response
// parsing and status conversion.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "client/indexer_client.h"
#include "client/tensor.h"
#include "tests/test_seed.h"

namespace decode_indexer::client {
namespace {

// Seeded per test (tests/test_seed.h): a failing test prints its seed; DI_TEST_SEED replays.
std::mt19937_64& Rng() { return ::decode_indexer::testing::PerTestRng(); }

std::vector<float> Normal(size_t n) {
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(Rng());
  return v;
}

template <typename T>
T RoundTrip(const T& msg) {
  std::string wire;
  EXPECT_TRUE(msg.SerializeToString(&wire));
  T back;
  EXPECT_TRUE(back.ParseFromString(wire));
  return back;
}

TEST(TensorTest, F32I32I64RoundTrip) {
  const int rows = 1 + Rng()() % 7, cols = 1 + Rng()() % 9;
  std::vector<float> f = Normal(rows * cols);
  v1::Tensor t = RoundTrip(F32Tensor(f, {rows, cols}));
  EXPECT_EQ(t.dtype(), v1::DTYPE_FP32);
  ASSERT_EQ(t.shape_size(), 2);
  EXPECT_EQ(t.shape(0), rows);
  EXPECT_EQ(t.shape(1), cols);
  EXPECT_EQ(*ParseF32(t), f);

  std::vector<int32_t> i32(rows);
  for (int32_t& x : i32) x = static_cast<int32_t>(Rng()());
  EXPECT_EQ(*ParseI32(RoundTrip(I32Tensor(i32, {rows}))), i32);
  std::vector<int64_t> i64(cols);
  for (int64_t& x : i64) x = static_cast<int64_t>(Rng()());
  EXPECT_EQ(*ParseI64(RoundTrip(I64Tensor(i64, {cols}))), i64);
  // Little-endian bytes, row-major.
  int32_t first;
  std::memcpy(&first, I32Tensor(i32, {rows}).data().data(), 4);
  EXPECT_EQ(first, i32[0]);
}

TEST(TensorTest, Bf16RoundsToNearestEven) {
  std::vector<float> f = Normal(257);
  v1::Tensor t = RoundTrip(Bf16Tensor(f, {257}));
  EXPECT_EQ(t.dtype(), v1::DTYPE_BF16);
  ASSERT_EQ(t.data().size(), 257u * 2);
  for (size_t i = 0; i < f.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, t.data().data() + 2 * i, 2);
    const float back = Bf16ToFloat(b);
    // Nearest: no other bf16 value is closer (ties go to the even mantissa).
    const float up = Bf16ToFloat(static_cast<uint16_t>(b + 1));
    const float down = Bf16ToFloat(static_cast<uint16_t>(b - 1));
    EXPECT_LE(std::fabs(back - f[i]), std::fabs(up - f[i])) << f[i];
    EXPECT_LE(std::fabs(back - f[i]), std::fabs(down - f[i])) << f[i];
  }
  // An exact tie: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7; even mantissa is 1.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(TensorTest, CodesAndRejections) {
  std::vector<uint8_t> bytes(64);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(Rng()());
  v1::Tensor t = RoundTrip(CodesTensor(v1::DTYPE_FP4_E2M1, bytes, {1, 128}));
  EXPECT_EQ(t.dtype(), v1::DTYPE_FP4_E2M1);
  EXPECT_EQ(t.data(), std::string(bytes.begin(), bytes.end()));
  EXPECT_EQ(NumElements(t), 128);
  // Wrong dtype, wrong byte count, absurd shapes: errors, never a crash.
  EXPECT_FALSE(ParseI32(t).ok());
  v1::Tensor bad = I32Tensor(std::vector<int32_t>{1, 2, 3}, {4});
  EXPECT_FALSE(ParseI32(bad).ok());
  bad.set_shape(0, std::numeric_limits<int64_t>::max());
  EXPECT_FALSE(ParseI32(bad).ok());
  bad.set_shape(0, -3);
  EXPECT_FALSE(ParseI32(bad).ok());
}

TEST(TensorTest, RequestRoundTrip) {
  v1::DecodeStepRequest req;
  req.set_layer(static_cast<int32_t>(Rng()() % 61));
  req.set_step_id(Rng()());
  req.set_return_candidates(true);
  for (int i = 0; i < 3; ++i) {
    v1::SequenceStep* s = req.add_sequences();
    s->set_sequence_id(Rng()());
    s->set_num_rows(1 + i);
    *s->mutable_new_keys() = F32Tensor(Normal(128 * (1 + i)), {1 + i, 128});
    s->add_row_lengths(static_cast<int32_t>(Rng()() % 1000 + 1));
  }
  *req.mutable_q() = Bf16Tensor(Normal(6 * 4 * 128), {6, 4, 128});
  *req.mutable_weights() = F32Tensor(Normal(24), {6, 4});
  *req.mutable_positions() = I64Tensor(std::vector<int64_t>{5, 6, 7, 8, 9, 10}, {6});
  v1::DecodeStepRequest back = RoundTrip(req);
  EXPECT_EQ(back.SerializeAsString(), req.SerializeAsString());
  EXPECT_EQ(back.sequences(2).new_keys().data(), req.sequences(2).new_keys().data());
  EXPECT_EQ(*ParseI64(back.positions()), (std::vector<int64_t>{5, 6, 7, 8, 9, 10}));
}

TEST(ResponseTest, ParseStepResponse) {
  const int rows = 1 + Rng()() % 5, k = 4 + Rng()() % 8, nb = 3;
  std::vector<int32_t> topk(rows * k), cand(rows * nb);
  for (int32_t& x : topk) x = static_cast<int32_t>(Rng()() % 1000);
  for (int32_t& x : cand) x = static_cast<int32_t>(Rng()() % 100);
  v1::DecodeStepResponse res;
  res.set_step_id(Rng()());
  *res.mutable_topk() = I32Tensor(topk, {rows, k});
  *res.mutable_candidate_blocks() = I32Tensor(cand, {rows, nb});
  res.mutable_timing()->set_queue_us(17);
  res.mutable_timing()->set_compute_us(23);
  res.set_sharded(true);
  res.add_lengths(99);
  absl::StatusOr<StepAnswer> a = ParseStepResponse(RoundTrip(res));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->step_id, res.step_id());
  EXPECT_EQ(a->rows, rows);
  EXPECT_EQ(a->k, k);
  EXPECT_EQ(a->topk, topk);
  EXPECT_EQ(a->candidates, cand);
  EXPECT_EQ(a->num_candidate_blocks, nb);
  EXPECT_TRUE(a->sharded);
  EXPECT_EQ(a->queue_us, 17);
  EXPECT_EQ(a->compute_us, 23);
  EXPECT_EQ(a->lengths, std::vector<int64_t>{99});
  const int r = rows - 1;
  EXPECT_EQ(a->Row(r)[k - 1], topk[r * k + k - 1]);
  EXPECT_EQ(a->CandidateRow(r)[0], cand[r * nb]);

  res.mutable_topk()->mutable_data()->pop_back();
  EXPECT_FALSE(ParseStepResponse(res).ok());
  *res.mutable_topk() = I32Tensor(topk, {rows * k});
  EXPECT_FALSE(ParseStepResponse(res).ok());
}

TEST(StatusTest, GrpcCodesCarryOver) {
  for (int code = 1; code <= 16; ++code) {
    const std::string msg = "field: what " + std::to_string(Rng()());
    absl::Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(code), msg));
    EXPECT_EQ(static_cast<int>(s.code()), code);
    EXPECT_EQ(s.message(), msg);
  }
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(ConnectTest, UnreachableTargetFailsFast) {
  ClientOptions o;
  o.connect_timeout = std::chrono::milliseconds(200);
  // Port 1 on loopback: nothing listens there.
  absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect("127.0.0.1:1", o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace decode_indexer::client
