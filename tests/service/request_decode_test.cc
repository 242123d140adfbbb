// The edge's validation, without an executor: every stateless bad-input case is rejected
// with INVALID_ARGUMENT naming the field; valid requests decode into views of the request's
// bytes; random corruptions never crash.
#include "server/service/request_decode.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/tensor.h"
#include "server/config/profile.h"
#include "tests/service/columnar.h"
#include "tests/test_seed.h"

namespace decode_indexer::service {
namespace {

using client::Bf16Tensor;
using client::CodesTensor;
using client::F32Tensor;
using client::I32Tensor;
using client::I64Tensor;

class RequestDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto v32 = config::BuiltinProfile("v32");
    ASSERT_TRUE(v32.ok()) << v32.status();
    v32_ = *v32;
    auto v41 = config::BuiltinProfile("v41");
    ASSERT_TRUE(v41.ok()) << v41.status();
    v41_ = *v41;
    rng_.seed(::decode_indexer::testing::TestSeed());
  }

  std::vector<float> Random(size_t n) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  std::vector<uint8_t> RandomBytes(size_t n, uint8_t mask = 0xFF) {
    std::vector<uint8_t> v(n);
    for (uint8_t& b : v) b = static_cast<uint8_t>(rng_() & mask);
    return v;
  }
  // Valid FP8 codes: never the NaN pattern S.1111.111.
  std::vector<uint8_t> RandomFp8(size_t n) {
    std::vector<uint8_t> v = RandomBytes(n);
    for (uint8_t& b : v) {
      if ((b & 0x7F) == 0x7F) b &= 0xFE;
    }
    return v;
  }
  // Valid ue8m0 scales around 2^0.
  std::vector<uint8_t> RandomUe8m0(size_t n) {
    std::vector<uint8_t> v(n);
    for (uint8_t& b : v) b = static_cast<uint8_t>(120 + rng_() % 12);
    return v;
  }

  // A valid step at `layer`: sequences with rows_per_seq rows each, fp32 q and keys where the
  // layer owns a cache, fp32 weights, int64 positions.
  v1::DecodeStepRequest ValidStep(const config::Profile& p, int layer,
                                  const std::vector<int>& rows_per_seq) {
    v1::DecodeStepRequest req;
    req.set_layer(layer);
    const config::LayerSpec& spec = p.layers[layer];
    const bool owns = spec.role != config::LayerRole::kCandidateConsumer;
    int rows = 0;
    for (size_t i = 0; i < rows_per_seq.size(); ++i) {
      v1::SequenceStep* s = req.add_sequences();
      s->set_sequence_id(1000 + rng_() % 1000 * 10 + i);
      s->set_num_rows(rows_per_seq[i]);
      if (owns) {
        *s->mutable_new_keys() =
            F32Tensor(Random(rows_per_seq[i] * p.head_dim), {rows_per_seq[i], p.head_dim});
      }
      rows += rows_per_seq[i];
    }
    *req.mutable_q() = F32Tensor(Random(size_t{1} * rows * p.num_heads * p.head_dim),
                                 {rows, p.num_heads, p.head_dim});
    *req.mutable_weights() = F32Tensor(Random(size_t{1} * rows * p.num_heads), {rows, p.num_heads});
    std::vector<int64_t> pos(rows);
    for (int64_t& x : pos) x = rng_() % 5000;
    *req.mutable_positions() = I64Tensor(pos, {rows});
    return req;
  }

  // Expects INVALID_ARGUMENT whose message starts with `field` + ":".
  void ExpectRejected(const v1::DecodeStepRequest& req, const config::Profile& p,
                      const std::string& field) {
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, p);
    ASSERT_FALSE(d.ok()) << "accepted; expected a complaint about " << field;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    EXPECT_EQ(std::string(d.status().message()).rfind(field + ":", 0), 0u)
        << "message does not start with \"" << field << ":\": " << d.status().message();
  }

  config::Profile v32_, v41_;
  std::mt19937_64 rng_;
};

TEST_F(RequestDecodeTest, ValidStepDecodesIntoViews) {
  v1::DecodeStepRequest req = ValidStep(v32_, 5, {1, 2, 1});
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v32_);
  ASSERT_TRUE(d.ok()) << d.status();
  const exec::StepInput& s = d->step();
  EXPECT_EQ(s.layer, 5);
  EXPECT_EQ(s.num_rows, 4);
  ASSERT_EQ(s.sequences.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.sequences[i].sequence_id, req.sequences(i).sequence_id());
    EXPECT_EQ(s.sequences[i].num_rows, req.sequences(i).num_rows());
    EXPECT_EQ(s.sequences[i].new_keys.type, kernels::ElemType::kF32);
    EXPECT_EQ(s.sequences[i].new_keys.count, req.sequences(i).num_rows());
    EXPECT_EQ(std::memcmp(s.sequences[i].new_keys.keys, req.sequences(i).new_keys().data().data(),
                          req.sequences(i).new_keys().data().size()),
              0);
  }
  EXPECT_EQ(s.q.type, kernels::ElemType::kF32);
  EXPECT_EQ(std::memcmp(s.q.q, req.q().data().data(), req.q().data().size()), 0);
  EXPECT_EQ(std::memcmp(s.q.weights, req.weights().data().data(), req.weights().data().size()), 0);
  ASSERT_NE(s.q.positions, nullptr);
  for (int r = 0; r < 4; ++r) {
    int64_t want;
    std::memcpy(&want, req.positions().data().data() + 8 * r, 8);
    EXPECT_EQ(s.q.positions[r], want);
  }
  // Aligned request bytes are used in place (zero copy).
  if (reinterpret_cast<uintptr_t>(req.q().data().data()) % 4 == 0) {
    EXPECT_EQ(s.q.q, req.q().data().data());
  }
  // A move keeps every pointer valid.
  DecodedStep moved = std::move(*d);
  EXPECT_EQ(moved.step().q.positions, moved.positions.data());
}

TEST_F(RequestDecodeTest, Bf16WeightsAndInt32PositionsAreConverted) {
  v1::DecodeStepRequest req = ValidStep(v41_, 1, {2, 1});
  std::vector<float> w = Random(3 * v41_.num_heads);
  *req.mutable_weights() = Bf16Tensor(w, {3, v41_.num_heads});
  std::vector<int32_t> pos = {static_cast<int32_t>(rng_() % 100), 7,
                              static_cast<int32_t>(v41_.max_context - 1)};
  *req.mutable_positions() = I32Tensor(pos, {3});
  *req.mutable_q() =
      Bf16Tensor(Random(3 * v41_.num_heads * v41_.head_dim), {3, v41_.num_heads, v41_.head_dim});
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v41_);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step().q.type, kernels::ElemType::kBF16);
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(d->step().q.weights[i], client::Bf16ToFloat(client::FloatToBf16(w[i])));
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(d->step().q.positions[r], pos[r]);
}

TEST_F(RequestDecodeTest, PreQuantizedForms) {
  // FP8 q and keys at a v32 layer.
  const int H = v32_.num_heads, D = v32_.head_dim;
  v1::DecodeStepRequest req = ValidStep(v32_, 0, {2});
  req.clear_positions();
  *req.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(2 * H * D), {2, H, D});
  *req.mutable_sequences(0)->mutable_new_keys() =
      CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(2 * D), {2, D});
  std::vector<float> ks = {std::ldexp(1.0f, -3), std::ldexp(1.0f, -5)};
  *req.mutable_sequences(0)->mutable_new_key_scales() = F32Tensor(ks, {2});
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v32_);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step().q.type, kernels::ElemType::kFp8E4M3);
  EXPECT_EQ(d->step().q.q, req.q().data().data());
  const exec::KeysInput& k = d->step().sequences[0].new_keys;
  EXPECT_EQ(k.type, kernels::ElemType::kFp8E4M3);
  EXPECT_EQ(static_cast<const float*>(k.scales)[1], ks[1]);

  // FP4 q (+ q_scales) and keys (+ ue8m0 scales) at a v41 (FP4) layer.
  const int H4 = v41_.num_heads;
  int fp4_layer = -1;
  for (const auto& l : v41_.layers) {
    if (l.role != config::LayerRole::kCandidateConsumer &&
        l.cache_format == kernels::CacheFormat::kFp4) {
      fp4_layer = l.layer;
      break;
    }
  }
  ASSERT_GE(fp4_layer, 0) << "v41 has no FP4 cache layer";
  v1::DecodeStepRequest r4 = ValidStep(v41_, fp4_layer, {1, 3});
  r4.clear_positions();
  *r4.mutable_q() = CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(4 * H4 * D / 2), {4, H4, D});
  *r4.mutable_q_scales() =
      CodesTensor(v1::DTYPE_UE8M0, RandomUe8m0(4 * H4 * D / 32), {4, H4, D / 32});
  *r4.mutable_sequences(1)->mutable_new_keys() =
      CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(3 * D / 2), {3, D});
  *r4.mutable_sequences(1)->mutable_new_key_scales() =
      CodesTensor(v1::DTYPE_UE8M0, RandomUe8m0(3 * D / 32), {3, D / 32});
  absl::StatusOr<DecodedStep> d4 = DecodeStepRequest(r4, v41_);
  ASSERT_TRUE(d4.ok()) << d4.status();
  EXPECT_EQ(d4->step().q.type, kernels::ElemType::kFp4E2M1);
  EXPECT_EQ(d4->step().q.scales, reinterpret_cast<const uint8_t*>(r4.q_scales().data().data()));
  EXPECT_EQ(d4->step().sequences[1].new_keys.count, 3);
  EXPECT_EQ(d4->step().sequences[0].new_keys.type, kernels::ElemType::kF32);
}

TEST_F(RequestDecodeTest, ShapeMessageNamesTheField) {
  v1::DecodeStepRequest req = ValidStep(v32_, 3, {1, 1});
  *req.mutable_sequences(1)->mutable_new_keys() = F32Tensor(Random(3 * 64), {3, 64});
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v32_);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(), "sequences[1].new_keys.shape: expected [n, 128], got [3, 64]");
}

TEST_F(RequestDecodeTest, RejectsBadSequences) {
  auto req = ValidStep(v32_, 0, {1, 2, 1});
  req.set_layer(static_cast<int>(v32_.layers.size()));
  ExpectRejected(req, v32_, "layer");
  req.set_layer(-1);
  ExpectRejected(req, v32_, "layer");

  req = ValidStep(v32_, 0, {1});
  req.clear_sequences();
  ExpectRejected(req, v32_, "sequences");

  req = ValidStep(v32_, 0, {1, 2, 1});
  req.mutable_sequences(2)->set_sequence_id(req.sequences(0).sequence_id());
  ExpectRejected(req, v32_, "sequences[2].sequence_id");

  req = ValidStep(v32_, 0, {2, 1});
  req.mutable_sequences(0)->add_row_lengths(5);  // one entry for num_rows 2
  ExpectRejected(req, v32_, "sequences[0].row_lengths");

  req = ValidStep(v32_, 0, {2, 1});
  req.mutable_sequences(0)->add_row_lengths(5);
  req.mutable_sequences(0)->add_row_lengths(0);
  ExpectRejected(req, v32_, "sequences[0].row_lengths[1]");

  req = ValidStep(v32_, 0, {1, 1});
  req.mutable_sequences(1)->set_num_rows(0);  // and no row_lengths
  ExpectRejected(req, v32_, "sequences[1].num_rows");
  req.mutable_sequences(1)->set_num_rows(-3);
  ExpectRejected(req, v32_, "sequences[1].num_rows");

  const int too_many = v32_.max_rows_per_sequence + 1;
  req = ValidStep(v32_, 0, {1, too_many});
  ExpectRejected(req, v32_, "sequences[1].num_rows");

  // num_rows 0 with row_lengths: the row count comes from row_lengths.
  req = ValidStep(v32_, 0, {1, 2});
  req.mutable_sequences(1)->set_num_rows(0);
  req.mutable_sequences(1)->add_row_lengths(3);
  req.mutable_sequences(1)->add_row_lengths(4);
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok());

  // Sum of rows must match q.
  req = ValidStep(v32_, 0, {1, 2});
  req.mutable_sequences(1)->set_num_rows(1);
  *req.mutable_sequences(1)->mutable_new_keys() = F32Tensor(Random(128), {1, 128});
  ExpectRejected(req, v32_, "q.shape");
}

TEST_F(RequestDecodeTest, RejectsBadKeys) {
  const int D = v32_.head_dim;
  auto req = ValidStep(v32_, 2, {2});
  auto* s = req.mutable_sequences(0);
  *s->mutable_new_keys() = I32Tensor(std::vector<int32_t>(2 * D, 1), {2, D});
  ExpectRejected(req, v32_, "sequences[0].new_keys.dtype");

  *s->mutable_new_keys() = F32Tensor(Random(2 * D), {2, D});
  s->mutable_new_keys()->mutable_data()->pop_back();
  ExpectRejected(req, v32_, "sequences[0].new_keys.data");

  std::vector<float> k = Random(2 * D);
  k[rng_() % k.size()] = std::numeric_limits<float>::quiet_NaN();
  *s->mutable_new_keys() = F32Tensor(k, {2, D});
  ExpectRejected(req, v32_, "sequences[0].new_keys.data");
  k = Random(2 * D);
  k[rng_() % k.size()] = -std::numeric_limits<float>::infinity();
  *s->mutable_new_keys() = Bf16Tensor(k, {2, D});
  ExpectRejected(req, v32_, "sequences[0].new_keys.data");

  // FP4 keys at an FP8 cache; FP8 keys without / with bad scales.
  *s->mutable_new_keys() = CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(D), {2, D});
  ExpectRejected(req, v32_, "sequences[0].new_keys.dtype");
  *s->mutable_new_keys() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(2 * D), {2, D});
  ExpectRejected(req, v32_, "sequences[0].new_key_scales");
  for (float bad : {0.0f, -0.25f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> sc = {0.5f, bad};
    if (rng_() & 1) std::swap(sc[0], sc[1]);
    *s->mutable_new_key_scales() = F32Tensor(sc, {2});
    ExpectRejected(req, v32_, "sequences[0].new_key_scales.data");
  }
  *s->mutable_new_key_scales() = F32Tensor(std::vector<float>{0.5f, 0.25f, 1.0f}, {3});
  ExpectRejected(req, v32_, "sequences[0].new_key_scales.shape");
  // NaN code in FP8 keys.
  std::vector<uint8_t> codes = RandomFp8(2 * D);
  codes[rng_() % codes.size()] = 0xFF;
  *s->mutable_new_keys() = CodesTensor(v1::DTYPE_FP8_E4M3, codes, {2, D});
  *s->mutable_new_key_scales() = F32Tensor(std::vector<float>{0.5f, 0.25f}, {2});
  ExpectRejected(req, v32_, "sequences[0].new_keys.data");
  // Scales with unquantized keys.
  *s->mutable_new_keys() = F32Tensor(Random(2 * D), {2, D});
  ExpectRejected(req, v32_, "sequences[0].new_key_scales");

  // Keys at a consumer layer (v41).
  int consumer = -1;
  for (const auto& l : v41_.layers) {
    if (l.role == config::LayerRole::kCandidateConsumer) consumer = l.layer;
  }
  ASSERT_GE(consumer, 0);
  auto creq = ValidStep(v41_, consumer, {1, 1});
  EXPECT_TRUE(DecodeStepRequest(creq, v41_).ok());
  *creq.mutable_sequences(1)->mutable_new_keys() = F32Tensor(Random(D), {1, D});
  ExpectRejected(creq, v41_, "sequences[1].new_keys");
}

TEST_F(RequestDecodeTest, RejectsBadQWeightsPositions) {
  const int H = v32_.num_heads, D = v32_.head_dim;
  auto base = ValidStep(v32_, 1, {1, 1});
  auto req = base;
  req.clear_q();
  ExpectRejected(req, v32_, "q");
  req = base;
  *req.mutable_q() = F32Tensor(Random(2 * H * 64), {2, H, 64});
  ExpectRejected(req, v32_, "q.shape");
  req = base;
  std::vector<float> q = Random(2 * H * D);
  q[rng_() % q.size()] = std::numeric_limits<float>::infinity();
  *req.mutable_q() = F32Tensor(q, {2, H, D});
  ExpectRejected(req, v32_, "q.data");
  req = base;
  req.mutable_q()->mutable_data()->append("xx");
  ExpectRejected(req, v32_, "q.data");
  req = base;
  req.mutable_q()->set_dtype(v1::DTYPE_INT64);
  ExpectRejected(req, v32_, "q.dtype");
  req = base;
  req.clear_positions();
  *req.mutable_q() = CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(2 * H * D / 2), {2, H, D});
  ExpectRejected(req, v32_, "q.dtype");  // FP4 q at an FP8 layer
  req = base;
  *req.mutable_q_scales() = CodesTensor(v1::DTYPE_UE8M0, RandomUe8m0(2 * H * 4), {2, H, 4});
  ExpectRejected(req, v32_, "q_scales");  // q_scales only with FP4
  req = base;
  *req.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(2 * H * D), {2, H, D});
  ExpectRejected(req, v32_, "positions");  // RoPE needs unquantized q

  req = base;
  req.clear_weights();
  ExpectRejected(req, v32_, "weights");
  req = base;
  *req.mutable_weights() = F32Tensor(Random(2 * (H + 1)), {2, H + 1});
  ExpectRejected(req, v32_, "weights.shape");
  req = base;
  std::vector<float> w = Random(2 * H);
  w[rng_() % w.size()] = std::numeric_limits<float>::quiet_NaN();
  *req.mutable_weights() = Bf16Tensor(w, {2, H});
  ExpectRejected(req, v32_, "weights.data");

  req = base;
  *req.mutable_positions() = I64Tensor(std::vector<int64_t>{4, -1}, {2});
  ExpectRejected(req, v32_, "positions[1]");
  req = base;
  *req.mutable_positions() =
      I32Tensor(std::vector<int32_t>{static_cast<int32_t>(v32_.max_context), 2}, {2});
  ExpectRejected(req, v32_, "positions[0]");
  req = base;
  *req.mutable_positions() = F32Tensor(std::vector<float>{1, 2}, {2});
  ExpectRejected(req, v32_, "positions.dtype");
  req = base;
  *req.mutable_positions() = I64Tensor(std::vector<int64_t>{1, 2, 3}, {3});
  ExpectRejected(req, v32_, "positions.shape");

  req = base;
  req.set_return_candidates(true);
  ExpectRejected(req, v32_, "return_candidates");

  // FP4 q at an FP4 layer needs valid q_scales.
  int fp4_layer = -1;
  for (const auto& l : v41_.layers) {
    if (l.cache_format == kernels::CacheFormat::kFp4) fp4_layer = l.layer;
  }
  ASSERT_GE(fp4_layer, 0);
  const int H4 = v41_.num_heads;
  auto r4 = ValidStep(v41_, fp4_layer, {1});
  r4.clear_positions();
  *r4.mutable_q() = CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(H4 * D / 2), {1, H4, D});
  ExpectRejected(r4, v41_, "q_scales");
  std::vector<uint8_t> qs = RandomUe8m0(H4 * D / 32);
  *r4.mutable_q_scales() = CodesTensor(v1::DTYPE_UE8M0, qs, {1, H4, D / 16});
  ExpectRejected(r4, v41_, "q_scales.shape");
  qs[rng_() % qs.size()] = 0xFF;
  *r4.mutable_q_scales() = CodesTensor(v1::DTYPE_UE8M0, qs, {1, H4, D / 32});
  ExpectRejected(r4, v41_, "q_scales.data");
  *r4.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(H4 * D), {1, H4, D});
  r4.clear_q_scales();
  ExpectRejected(r4, v41_, "q.dtype");  // FP8 q at an FP4 layer
}

TEST_F(RequestDecodeTest, HugeShapesAreRejectedNotOverflowed) {
  auto req = ValidStep(v32_, 0, {1});
  req.mutable_sequences(0)->mutable_new_keys()->set_shape(0, int64_t{1} << 62);
  ExpectRejected(req, v32_, "sequences[0].new_keys.shape[0]");
  req = ValidStep(v32_, 0, {1});
  req.mutable_q()->set_shape(0, std::numeric_limits<int64_t>::max());
  ExpectRejected(req, v32_, "q.shape");
}

TEST_F(RequestDecodeTest, AppendKeys) {
  const int D = v41_.head_dim;
  v1::AppendKeysRequest req;
  req.set_sequence_id(rng_());
  req.set_layer(0);
  const int n = 1 + rng_() % 50;
  *req.mutable_keys() = F32Tensor(Random(n * D), {n, D});
  absl::StatusOr<DecodedAppend> d = DecodeAppendKeys(req, v41_);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->keys().count, n);
  EXPECT_EQ(d->sequence_id(), req.sequence_id());

  auto expect = [&](const v1::AppendKeysRequest& r, const std::string& field) {
    absl::StatusOr<DecodedAppend> x = DecodeAppendKeys(r, v41_);
    ASSERT_FALSE(x.ok()) << field;
    EXPECT_EQ(x.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(x.status().message()).rfind(field + ":", 0), 0u) << x.status();
  };
  auto bad = req;
  bad.set_layer(static_cast<int>(v41_.layers.size()) + 3);
  expect(bad, "layer");
  for (const auto& l : v41_.layers) {
    if (l.role == config::LayerRole::kCandidateConsumer) {
      bad = req;
      bad.set_layer(l.layer);
      expect(bad, "layer");
      break;
    }
  }
  bad = req;
  bad.clear_keys();
  expect(bad, "keys");
  bad = req;
  *bad.mutable_keys() = F32Tensor({}, {0, D});
  expect(bad, "keys.shape");
  bad = req;
  *bad.mutable_key_scales() = F32Tensor(std::vector<float>(n, 1.0f), {n});
  expect(bad, "key_scales");
}

// Random corruptions of valid requests: decoding answers OK or INVALID_ARGUMENT, never
// crashes (ASan/UBSan builds check the memory side).
TEST_F(RequestDecodeTest, RandomCorruptionsNeverCrash) {
  for (int iter = 0; iter < 400; ++iter) {
    const config::Profile& p = (iter & 1) ? v41_ : v32_;
    auto req = ValidStep(p, static_cast<int>(rng_() % p.layers.size()), {1, 2});
    v1::Tensor* targets[] = {req.mutable_q(),
                             req.mutable_weights(),
                             req.mutable_positions(),
                             req.mutable_q_scales(),
                             req.mutable_sequences(0)->mutable_new_keys(),
                             req.mutable_sequences(1)->mutable_new_key_scales()};
    v1::Tensor* t = targets[rng_() % 6];
    switch (rng_() % 5) {
      case 0:
        t->set_dtype(static_cast<v1::DType>(rng_() % 9));
        break;
      case 1:
        if (t->shape_size() > 0) {
          t->set_shape(rng_() % t->shape_size(), static_cast<int64_t>(rng_()) >> (rng_() % 64));
        }
        break;
      case 2:
        t->add_shape(rng_() % 4);
        break;
      case 3:
        t->mutable_data()->resize(rng_() % (t->data().size() + 64), static_cast<char>(rng_()));
        break;
      default:
        req.mutable_sequences(rng_() % 2)->set_num_rows(static_cast<int32_t>(rng_() % 20) - 4);
        break;
    }
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, p);
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    }
  }
}

// The NaN scans run eight bytes at a time: a code planted anywhere (first byte, last byte,
// the unaligned tail, either sign) is found and named by its element; valid codes next to
// the NaN pattern (0x7E, 0xFE, 0x80) pass.
TEST_F(RequestDecodeTest, NanScansFindEveryPlantedValue) {
  const int H = v32_.num_heads, D = v32_.head_dim;
  for (int trial = 0; trial < 24; ++trial) {
    const int rows = 1 + int(rng_() % 3);
    std::vector<int> per_seq(rows, 1);
    auto req = ValidStep(v32_, 1, per_seq);
    req.clear_positions();
    std::vector<uint8_t> codes = RandomFp8(size_t(rows) * H * D);
    for (int i = 0; i < 8; ++i) codes[rng_() % codes.size()] = (rng_() & 1) ? 0x7E : 0xFE;
    *req.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, codes, {rows, H, D});
    ASSERT_TRUE(DecodeStepRequest(req, v32_).ok()) << "valid codes rejected";
    const size_t where = trial == 0 ? 0 : trial == 1 ? codes.size() - 1 : rng_() % codes.size();
    codes[where] = (rng_() & 1) ? 0x7F : 0xFF;
    *req.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, codes, {rows, H, D});
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v32_);
    ASSERT_FALSE(d.ok()) << "NaN code at " << where << " accepted";
    EXPECT_NE(d.status().message().find("at element " + std::to_string(where) + " "),
              std::string::npos)
        << d.status();

    // fp32 / bf16 q: Inf or NaN anywhere.
    auto fq = ValidStep(v32_, 1, per_seq);
    std::vector<float> q = Random(size_t(rows) * H * D);
    const size_t at = rng_() % q.size();
    q[at] = (rng_() & 1) ? std::numeric_limits<float>::infinity()
                         : -std::numeric_limits<float>::quiet_NaN();
    *fq.mutable_q() = (trial & 1) ? F32Tensor(q, {rows, H, D}) : Bf16Tensor(q, {rows, H, D});
    d = DecodeStepRequest(fq, v32_);
    ASSERT_FALSE(d.ok());
    EXPECT_NE(d.status().message().find("at element " + std::to_string(at) + " "),
              std::string::npos)
        << d.status();
  }
}

// q / weights given outside the request (a shared-memory region) are checked and viewed in
// place: the decoded step points into them, with the same checks as in-request bytes.
TEST_F(RequestDecodeTest, ExternalBytesAreReadInPlace) {
  const int H = v32_.num_heads, D = v32_.head_dim;
  auto req = ValidStep(v32_, 1, {1, 2});
  req.clear_positions();
  const std::vector<uint8_t> codes = RandomFp8(size_t(3) * H * D);
  const std::vector<float> w = Random(size_t(3) * H);
  *req.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, codes, {3, H, D});
  *req.mutable_weights() = F32Tensor(w, {3, H});
  ExternalStepBytes ext;
  ext.q = std::string_view(reinterpret_cast<const char*>(codes.data()), codes.size());
  ext.weights = std::string_view(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  v1::DecodeStepRequest shaped = req;
  shaped.mutable_q()->clear_data();
  shaped.mutable_weights()->clear_data();
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(shaped, v32_, ext);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->step().q.q, static_cast<const void*>(codes.data()));
  EXPECT_EQ(d->step().q.weights, w.data());
  EXPECT_EQ(d->step().num_rows, 3);
  // Short external bytes: the same message as short request bytes.
  ext.q = ext.q->substr(0, codes.size() - 1 - rng_() % 100);
  ExternalStepBytes short_ext = ext;
  absl::StatusOr<DecodedStep> bad = DecodeStepRequest(shaped, v32_, short_ext);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(std::string(bad.status().message()).rfind("q.data:", 0), 0u) << bad.status();
}

// ---- The columnar form (sequence_ids, num_rows, one stacked new_keys, ...) ----

class ColumnarDecodeTest : public RequestDecodeTest {
 protected:
  enum class Keys { kF32, kBF16, kCodes };

  // A columnar step's skeleton: sequences 11, 12, 13, one row each, with 2, 0 and 3 new keys
  // (five in all; their tensors and q are the caller's).
  static v1::DecodeStepRequest ThreeSequencesFiveKeys(int layer) {
    v1::DecodeStepRequest col;
    col.set_layer(layer);
    for (uint64_t id : {11u, 12u, 13u}) col.add_sequence_ids(id);
    col.set_rows_per_sequence(1);
    for (int32_t c : {2, 0, 3}) col.add_new_key_counts(c);
    return col;
  }

  // A random step in the `sequences` form: `rows` rows per request (0: 1..3 at random), keys
  // in one form for all requests where the layer owns a cache (some requests without), and
  // optionally positions and explicit row lengths on some requests; fp32 q with positions.
  v1::DecodeStepRequest RandomStep(const config::Profile& p, int layer, int requests, int rows,
                                   Keys form, bool lengths, bool positions) {
    const config::LayerSpec& spec = p.layers[layer];
    const bool owns = spec.role != config::LayerRole::kCandidateConsumer;
    const int D = p.head_dim;
    v1::DecodeStepRequest req;
    req.set_layer(layer);
    req.set_step_id(rng_());
    int total = 0;
    for (int i = 0; i < requests; ++i) {
      v1::SequenceStep* s = req.add_sequences();
      s->set_sequence_id(rng_());
      const int n = rows > 0 ? rows : 1 + static_cast<int>(rng_() % 3);
      s->set_num_rows(n);
      total += n;
      if (lengths && rng_() % 2 == 0) {
        for (int j = 0; j < n; ++j) s->add_row_lengths(1 + static_cast<int32_t>(rng_() % 9000));
        if (rng_() % 2 == 0) s->set_num_rows(0);  // the count from row_lengths
      }
      if (positions && owns && rng_() % 2 == 0) s->set_new_keys_position(rng_() % 5000);
      if (!owns || rng_() % 4 == 0) continue;  // this request brings no keys
      const int k = rng_() % 3 == 0 ? 1 + static_cast<int>(rng_() % 4) : n;
      switch (form) {
        case Keys::kF32:
          *s->mutable_new_keys() = F32Tensor(Random(size_t(k) * D), {k, D});
          break;
        case Keys::kBF16:
          *s->mutable_new_keys() = Bf16Tensor(Random(size_t(k) * D), {k, D});
          break;
        case Keys::kCodes:
          if (spec.cache_format == kernels::CacheFormat::kFp8) {
            *s->mutable_new_keys() =
                CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(size_t(k) * D), {k, D});
            std::vector<float> sc(k);
            for (float& x : sc) x = std::ldexp(1.0f, -static_cast<int>(rng_() % 9));
            *s->mutable_new_key_scales() = F32Tensor(sc, {k});
          } else {
            *s->mutable_new_keys() =
                CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(size_t(k) * D / 2), {k, D});
            *s->mutable_new_key_scales() =
                CodesTensor(v1::DTYPE_UE8M0, RandomUe8m0(size_t(k) * D / 32), {k, D / 32});
          }
          break;
      }
    }
    *req.mutable_q() =
        F32Tensor(Random(size_t{1} * total * p.num_heads * D), {total, p.num_heads, D});
    *req.mutable_weights() =
        F32Tensor(Random(size_t{1} * total * p.num_heads), {total, p.num_heads});
    std::vector<int64_t> pos(total);
    for (int64_t& x : pos) x = rng_() % 5000;
    *req.mutable_positions() = I64Tensor(pos, {total});
    return req;
  }

  // Field by field, the bytes behind the pointers included.
  static void ExpectSameStep(const exec::StepInput& a, const exec::StepInput& b,
                             const config::Profile& p, const std::string& what) {
    ASSERT_EQ(a.sequences.size(), b.sequences.size()) << what;
    EXPECT_EQ(a.layer, b.layer) << what;
    EXPECT_EQ(a.step_id, b.step_id) << what;
    EXPECT_EQ(a.num_rows, b.num_rows) << what;
    EXPECT_EQ(a.return_candidates, b.return_candidates) << what;
    const int D = p.head_dim;
    for (size_t i = 0; i < a.sequences.size(); ++i) {
      const exec::SequenceStepInput& x = a.sequences[i];
      const exec::SequenceStepInput& y = b.sequences[i];
      const std::string at = what + ", request " + std::to_string(i);
      EXPECT_EQ(x.sequence_id, y.sequence_id) << at;
      EXPECT_EQ(x.num_rows, y.num_rows) << at;
      EXPECT_EQ(x.row_lengths, y.row_lengths) << at;
      EXPECT_EQ(x.new_keys.count, y.new_keys.count) << at;
      EXPECT_EQ(x.new_keys.position, y.new_keys.position) << at;
      if (x.new_keys.count == 0 || x.new_keys.count != y.new_keys.count) continue;
      ASSERT_EQ(x.new_keys.type, y.new_keys.type) << at;
      const size_t n = size_t(x.new_keys.count);
      size_t key_bytes = n * D, scale_bytes = 0;
      switch (x.new_keys.type) {
        case kernels::ElemType::kF32:
          key_bytes *= 4;
          break;
        case kernels::ElemType::kBF16:
          key_bytes *= 2;
          break;
        case kernels::ElemType::kFp8E4M3:
          scale_bytes = n * 4;
          break;
        default:  // FP4
          key_bytes /= 2;
          scale_bytes = n * D / 32;
          break;
      }
      EXPECT_EQ(std::memcmp(x.new_keys.keys, y.new_keys.keys, key_bytes), 0) << at << ": keys";
      ASSERT_EQ(x.new_keys.scales == nullptr, y.new_keys.scales == nullptr) << at;
      if (scale_bytes > 0) {
        EXPECT_EQ(std::memcmp(x.new_keys.scales, y.new_keys.scales, scale_bytes), 0)
            << at << ": key scales";
      }
    }
    const size_t rows = size_t(a.num_rows);
    EXPECT_EQ(a.q.type, b.q.type) << what;
    EXPECT_EQ(std::memcmp(a.q.q, b.q.q, rows * p.num_heads * D * 4), 0) << what << ": q";
    EXPECT_EQ(std::memcmp(a.q.weights, b.q.weights, rows * p.num_heads * 4), 0) << what;
    ASSERT_EQ(a.q.positions == nullptr, b.q.positions == nullptr) << what;
    if (a.q.positions != nullptr) {
      EXPECT_EQ(std::memcmp(a.q.positions, b.q.positions, rows * 8), 0) << what << ": positions";
    }
  }

  int Fp4Layer() const {
    for (const auto& l : v41_.layers) {
      if (l.role != config::LayerRole::kCandidateConsumer &&
          l.cache_format == kernels::CacheFormat::kFp4) {
        return l.layer;
      }
    }
    return -1;
  }
  int ConsumerLayer() const {
    for (const auto& l : v41_.layers) {
      if (l.role == config::LayerRole::kCandidateConsumer) return l.layer;
    }
    return -1;
  }
};

TEST_F(ColumnarDecodeTest, DecodesIntoTheSameStepInputAsSequences) {
  ASSERT_GE(Fp4Layer(), 0);
  ASSERT_GE(ConsumerLayer(), 0);
  struct Case {
    const config::Profile* p;
    int layer;
  };
  const Case cases[] = {{&v32_, 0}, {&v32_, 7}, {&v41_, Fp4Layer()}, {&v41_, ConsumerLayer()}};
  for (int iter = 0; iter < 60; ++iter) {
    const Case& c = cases[iter % 4];
    const int requests = 1 + static_cast<int>(rng_() % 12);
    const int rows = static_cast<int>(rng_() % 3);  // 0: mixed
    const Keys form = static_cast<Keys>(rng_() % 3);
    const bool lengths = rng_() % 2, positions = rng_() % 2;
    v1::DecodeStepRequest seq = RandomStep(*c.p, c.layer, requests, rows, form, lengths, positions);
    ::decode_indexer::testing::ColumnarOptions o;
    o.uniform_rows = rng_() % 2;
    o.explicit_counts = rng_() % 2;
    o.explicit_positions = rng_() % 2;
    v1::DecodeStepRequest col = ::decode_indexer::testing::ToColumnar(seq, o);
    const std::string what =
        absl::StrCat("case ", iter, " (profile ", c.p->name, " layer ", c.layer, ", ", requests,
                     " requests, keys form ", static_cast<int>(form), ", uniform ", o.uniform_rows,
                     ", counts ", o.explicit_counts, ")");
    ASSERT_EQ(col.sequences_size(), 0) << what;
    absl::StatusOr<DecodedStep> a = DecodeStepRequest(seq, *c.p);
    ASSERT_TRUE(a.ok()) << what << ": " << a.status();
    absl::StatusOr<DecodedStep> b = DecodeStepRequest(col, *c.p);
    ASSERT_TRUE(b.ok()) << what << ": " << b.status() << "\n"
                        << col.ShortDebugString().substr(0, 600);
    ExpectSameStep(a->step(), b->step(), *c.p, what);
  }
}

TEST_F(ColumnarDecodeTest, KeysAreViewsOfTheOneTensor) {
  // FP8 codes and scales: each request's keys point into new_keys' bytes, in order.
  const int D = v32_.head_dim;
  v1::DecodeStepRequest col;
  col.set_layer(3);
  for (uint64_t id : {11u, 12u, 13u}) col.add_sequence_ids(id);
  col.set_rows_per_sequence(2);
  for (int32_t c : {2, 0, 3}) col.add_new_key_counts(c);
  *col.mutable_new_keys() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(5 * D), {5, D});
  *col.mutable_new_key_scales() = F32Tensor(std::vector<float>{1, 0.5f, 0.25f, 2, 4}, {5});
  for (int64_t p : {-1, 7, 100}) col.add_new_keys_positions(p);
  *col.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(6 * 64 * D), {6, 64, D});
  *col.mutable_weights() = F32Tensor(Random(6 * 64), {6, 64});
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(col, v32_);
  ASSERT_TRUE(d.ok()) << d.status();
  const auto& s = d->step().sequences;
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(d->step().num_rows, 6);
  const char* keys = col.new_keys().data().data();
  EXPECT_EQ(s[0].new_keys.keys, keys);
  EXPECT_EQ(s[0].new_keys.count, 2);
  EXPECT_FALSE(s[0].new_keys.position.has_value());
  EXPECT_EQ(s[1].new_keys.count, 0);  // a cut back to 7 with no keys
  EXPECT_EQ(s[1].new_keys.position, 7);
  EXPECT_EQ(s[2].new_keys.keys, keys + 2 * D);
  EXPECT_EQ(s[2].new_keys.count, 3);
  EXPECT_EQ(s[2].new_keys.position, 100);
  EXPECT_EQ(static_cast<const float*>(s[2].new_keys.scales)[0], 0.25f);
  for (const auto& x : s) EXPECT_EQ(x.num_rows, 2);
}

// Keys in device memory (ExternalStepBytes::keys_on_device, cuda_ipc.new_keys_offset): their
// form is checked (dtype, shape, byte counts) but never their values, which the host cannot
// read (NaN codes and negative scales pass here: the device check finds them), the views are
// the device addresses themselves (never realigned, even at an odd address), each request's
// keys are marked on_device, and unquantized keys are refused naming new_keys.dtype.
TEST_F(ColumnarDecodeTest, DeviceKeysAreViewedNeverRead) {
  for (const bool fp4 : {false, true}) {
    const config::Profile& p = fp4 ? v41_ : v32_;
    const int layer = fp4 ? Fp4Layer() : 3;
    const int D = p.head_dim, H = p.num_heads;
    v1::DecodeStepRequest col = ThreeSequencesFiveKeys(layer);
    const size_t kb = 5 * size_t(fp4 ? D / 2 : D), sb = 5 * size_t(fp4 ? D / 32 : 4);
    // "Device memory": bytes the decoder must not judge (all NaN codes / negative scales), at
    // an odd address.
    std::vector<uint8_t> device(1 + kb + sb, 0xFF);
    const char* keys_at = reinterpret_cast<const char*>(device.data()) + 1;
    const char* scales_at = keys_at + kb;
    for (v1::Tensor* t : {col.mutable_new_keys(), col.mutable_new_key_scales()}) t->Clear();
    col.mutable_new_keys()->set_dtype(fp4 ? v1::DTYPE_FP4_E2M1 : v1::DTYPE_FP8_E4M3);
    col.mutable_new_keys()->add_shape(5);
    col.mutable_new_keys()->add_shape(D);
    col.mutable_new_key_scales()->set_dtype(fp4 ? v1::DTYPE_UE8M0 : v1::DTYPE_FP32);
    col.mutable_new_key_scales()->add_shape(5);
    if (fp4) col.mutable_new_key_scales()->add_shape(D / 32);
    if (fp4) {
      *col.mutable_q() =
          CodesTensor(v1::DTYPE_FP4_E2M1, RandomFp8(size_t(3) * H * D / 2), {3, H, D});
      std::vector<uint8_t> qs(size_t(3) * H * D / 32, 127);
      *col.mutable_q_scales() = CodesTensor(v1::DTYPE_UE8M0, qs, {3, H, D / 32});
    } else {
      *col.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(size_t(3) * H * D), {3, H, D});
    }
    *col.mutable_weights() = F32Tensor(Random(size_t(3) * H), {3, H});
    ExternalStepBytes ext;
    ext.new_keys = std::string_view(keys_at, kb);
    ext.new_key_scales = std::string_view(scales_at, sb);
    ext.keys_on_device = true;
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(col, p, ext);
    ASSERT_TRUE(d.ok()) << d.status();
    const auto& s = d->step().sequences;
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0].new_keys.keys, keys_at);
    EXPECT_EQ(s[0].new_keys.scales, scales_at);
    EXPECT_TRUE(s[0].new_keys.on_device);
    EXPECT_EQ(s[1].new_keys.count, 0);
    EXPECT_EQ(s[2].new_keys.keys, keys_at + 2 * (fp4 ? D / 2 : D));
    EXPECT_EQ(s[2].new_keys.scales, scales_at + 2 * (fp4 ? D / 32 : 4));
    EXPECT_TRUE(s[2].new_keys.on_device);
    EXPECT_TRUE(d->realigned.empty());
    // The same bytes from the host are judged (and refused).
    ExternalStepBytes host = ext;
    host.keys_on_device = false;
    absl::StatusOr<DecodedStep> judged = DecodeStepRequest(col, p, host);
    ASSERT_FALSE(judged.ok());
    EXPECT_TRUE(absl::StartsWith(judged.status().message(), "new_key")) << judged.status();
    // Sizes still count; unquantized keys are refused; the sequences form is not taken.
    ExternalStepBytes short_ext = ext;
    short_ext.new_keys = std::string_view(keys_at, kb - 1);
    absl::StatusOr<DecodedStep> bad = DecodeStepRequest(col, p, short_ext);
    ASSERT_FALSE(bad.ok());
    EXPECT_TRUE(absl::StartsWith(bad.status().message(), "new_keys.data:")) << bad.status();
    v1::DecodeStepRequest f32 = col;
    f32.mutable_new_keys()->set_dtype(v1::DTYPE_FP32);
    f32.clear_new_key_scales();
    ExternalStepBytes f32_ext = ext;
    f32_ext.new_key_scales.reset();
    std::vector<uint8_t> big(5 * size_t(D) * 4 + 1);
    f32_ext.new_keys =
        std::string_view(reinterpret_cast<const char*>(big.data()) + 1, 5 * size_t(D) * 4);
    bad = DecodeStepRequest(f32, p, f32_ext);
    ASSERT_FALSE(bad.ok());
    EXPECT_TRUE(absl::StartsWith(bad.status().message(), "new_keys.dtype:")) << bad.status();
  }
}

// Keys in a client's shared-memory region (ExternalStepBytes in host memory): the client may
// rewrite them at any moment, so the decoder copies them into storage the decoded step owns
// before it checks their values, and the step's keys point at the copy. Rewriting the region
// after the decode (here: all 0xFF, FP8 NaN codes and NaN scales, UE8M0 NaN scales) changes
// nothing the executor would store. Checked in place and read later, those bytes would reach
// the sequence's cache past every check (and a snapshot holding it is refused whole).
TEST_F(ColumnarDecodeTest, SharedMemoryKeysAreCopiedBeforeTheyAreChecked) {
  for (const int form : {0, 1, 2}) {  // FP8 codes + fp32 scales, FP4 codes + UE8M0, fp32
    const bool fp4 = form == 1;
    const bool f32 = form == 2;
    const config::Profile& p = fp4 ? v41_ : v32_;
    const int layer = fp4 ? Fp4Layer() : 3;
    const int D = p.head_dim, H = p.num_heads;
    v1::DecodeStepRequest col = ThreeSequencesFiveKeys(layer);
    std::vector<uint8_t> keys, scales;
    if (f32) {
      const std::vector<float> k = Random(size_t(5) * D);
      keys.resize(k.size() * 4);
      std::memcpy(keys.data(), k.data(), keys.size());
    } else if (fp4) {
      keys = RandomBytes(size_t(5) * D / 2);
      scales = RandomUe8m0(size_t(5) * D / 32);
    } else {
      keys = RandomFp8(size_t(5) * D);
      std::vector<float> sc(5);
      for (float& x : sc) x = std::ldexp(1.0f, -static_cast<int>(rng_() % 9));
      scales.resize(sc.size() * 4);
      std::memcpy(scales.data(), sc.data(), scales.size());
    }
    // "The region": keys then scales, 8-byte aligned (no realigning copy would hide a view).
    std::vector<uint64_t> region((keys.size() + scales.size()) / 8 + 2);
    auto* base = reinterpret_cast<uint8_t*>(region.data());
    std::memcpy(base, keys.data(), keys.size());
    if (!scales.empty()) std::memcpy(base + keys.size(), scales.data(), scales.size());
    col.mutable_new_keys()->set_dtype(f32   ? v1::DTYPE_FP32
                                      : fp4 ? v1::DTYPE_FP4_E2M1
                                            : v1::DTYPE_FP8_E4M3);
    col.mutable_new_keys()->add_shape(5);
    col.mutable_new_keys()->add_shape(D);
    ExternalStepBytes ext;
    ext.new_keys = std::string_view(reinterpret_cast<const char*>(base), keys.size());
    if (!f32) {
      col.mutable_new_key_scales()->set_dtype(fp4 ? v1::DTYPE_UE8M0 : v1::DTYPE_FP32);
      col.mutable_new_key_scales()->add_shape(5);
      if (fp4) col.mutable_new_key_scales()->add_shape(D / 32);
      ext.new_key_scales =
          std::string_view(reinterpret_cast<const char*>(base) + keys.size(), scales.size());
    }
    if (fp4) {
      *col.mutable_q() =
          CodesTensor(v1::DTYPE_FP4_E2M1, RandomFp8(size_t(3) * H * D / 2), {3, H, D});
      std::vector<uint8_t> qs(size_t(3) * H * D / 32, 127);
      *col.mutable_q_scales() = CodesTensor(v1::DTYPE_UE8M0, qs, {3, H, D / 32});
    } else {
      *col.mutable_q() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(size_t(3) * H * D), {3, H, D});
    }
    *col.mutable_weights() = F32Tensor(Random(size_t(3) * H), {3, H});
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(col, p, ext);
    ASSERT_TRUE(d.ok()) << "form " << form << ": " << d.status();
    // The client rewrites its region once the checks passed.
    std::memset(base, 0xFF, region.size() * 8);
    const auto& s = d->step().sequences;
    ASSERT_EQ(s.size(), 3u);
    const size_t row = f32 ? size_t(D) * 4 : fp4 ? size_t(D) / 2 : size_t(D);
    const size_t srow = fp4 ? size_t(D) / 32 : 4;
    int64_t at = 0;
    for (const exec::SequenceStepInput& in : s) {
      const int32_t c = in.new_keys.count;
      if (c == 0) continue;
      const auto* k = static_cast<const uint8_t*>(in.new_keys.keys);
      EXPECT_TRUE(k < base || k >= base + region.size() * 8)
          << "form " << form << ": the keys are a view of the client's region";
      EXPECT_EQ(std::memcmp(k, keys.data() + at * row, c * row), 0)
          << "form " << form << ": the keys changed after they were checked";
      if (!f32) {
        const auto* sc = static_cast<const uint8_t*>(in.new_keys.scales);
        EXPECT_TRUE(sc < base || sc >= base + region.size() * 8)
            << "form " << form << ": the scales are a view of the client's region";
        EXPECT_EQ(std::memcmp(sc, scales.data() + at * srow, c * srow), 0)
            << "form " << form << ": the scales changed after they were checked";
      }
      at += c;
    }
  }
}

TEST_F(ColumnarDecodeTest, RefusesMixedForms) {
  const v1::DecodeStepRequest seq = ValidStep(v32_, 0, {1, 1});
  v1::DecodeStepRequest req = seq;
  req.add_sequence_ids(5);
  ExpectRejected(req, v32_, "sequence_ids");
  struct Field {
    const char* name;
    std::function<void(v1::DecodeStepRequest&)> set;
  };
  const Field fields[] = {
      {"num_rows", [](auto& r) { r.add_num_rows(1); }},
      {"rows_per_sequence", [](auto& r) { r.set_rows_per_sequence(1); }},
      {"new_keys",
       [&](auto& r) {
         *r.mutable_new_keys() = F32Tensor(Random(128), {1, 128});
       }},
      {"new_key_scales",
       [](auto& r) { *r.mutable_new_key_scales() = F32Tensor(std::vector<float>{1}, {1}); }},
      {"new_key_counts", [](auto& r) { r.add_new_key_counts(1); }},
      {"new_keys_positions", [](auto& r) { r.add_new_keys_positions(0); }},
      {"row_lengths", [](auto& r) { r.add_row_lengths(1); }},
  };
  for (const Field& f : fields) {
    req = seq;
    f.set(req);
    ExpectRejected(req, v32_, f.name);  // with `sequences`
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v32_);
    EXPECT_NE(d.status().message().find("cannot be mixed"), absl::string_view::npos) << d.status();
    req.clear_sequences();
    ExpectRejected(req, v32_, "sequence_ids");  // a columnar field without sequence_ids
  }
  req = seq;
  req.clear_sequences();
  ExpectRejected(req, v32_, "sequences");  // neither form
}

TEST_F(ColumnarDecodeTest, RejectsBadColumns) {
  const int D = v32_.head_dim;
  // Three requests of 1, 2, 1 rows, one fp32 key a row, at a dense v32 layer.
  const v1::DecodeStepRequest base =
      ::decode_indexer::testing::ToColumnar(ValidStep(v32_, 0, {1, 2, 1}));
  ASSERT_TRUE(DecodeStepRequest(base, v32_).ok()) << DecodeStepRequest(base, v32_).status();
  ASSERT_EQ(base.num_rows_size(), 3);
  ASSERT_EQ(base.new_key_counts_size(), 0);
  auto req = base;

  // sequence_ids: duplicates; the rows' sum must still match q.
  req.set_sequence_ids(2, req.sequence_ids(0));
  ExpectRejected(req, v32_, "sequence_ids[2]");

  // num_rows / rows_per_sequence.
  req = base;
  req.add_num_rows(1);
  ExpectRejected(req, v32_, "num_rows");
  req = base;
  req.set_num_rows(1, 0);
  ExpectRejected(req, v32_, "num_rows[1]");
  req.set_num_rows(1, -2);
  ExpectRejected(req, v32_, "num_rows[1]");
  req.set_num_rows(1, v32_.max_rows_per_sequence + 1);
  ExpectRejected(req, v32_, "num_rows[1]");
  req = base;
  req.set_rows_per_sequence(2);
  ExpectRejected(req, v32_, "rows_per_sequence");  // with num_rows
  req.clear_num_rows();
  req.set_rows_per_sequence(0);
  ExpectRejected(req, v32_, "rows_per_sequence");  // neither
  req.set_rows_per_sequence(-1);
  ExpectRejected(req, v32_, "rows_per_sequence");
  req.set_rows_per_sequence(v32_.max_rows_per_sequence + 1);
  ExpectRejected(req, v32_, "rows_per_sequence");
  req.set_rows_per_sequence(1);  // 3 rows where q has 4
  req.clear_new_keys();
  ExpectRejected(req, v32_, "q.shape");

  // new_key_counts.
  req = base;
  for (int32_t c : {1, 2}) req.add_new_key_counts(c);
  ExpectRejected(req, v32_, "new_key_counts");  // 2 entries for 3 requests
  req.add_new_key_counts(-1);
  ExpectRejected(req, v32_, "new_key_counts[2]");
  req.set_new_key_counts(2, static_cast<int32_t>(v32_.max_context) + 1);
  ExpectRejected(req, v32_, "new_key_counts[2]");
  req.set_new_key_counts(2, 2);  // 5 keys where new_keys has 4
  ExpectRejected(req, v32_, "new_keys.shape");
  req.set_new_key_counts(2, 1);
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok());
  req.clear_new_keys();  // counts say 4 keys, none sent
  ExpectRejected(req, v32_, "new_keys");
  for (int i = 0; i < 3; ++i) req.set_new_key_counts(i, 0);
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok()) << "all-zero counts and no keys are valid";

  // new_keys_positions.
  req = base;
  req.add_new_keys_positions(3);
  ExpectRejected(req, v32_, "new_keys_positions");
  req.add_new_keys_positions(-1);
  req.add_new_keys_positions(-2);
  ExpectRejected(req, v32_, "new_keys_positions[2]");
  req.set_new_keys_positions(2, 0);
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok());

  // row_lengths: one per row (4), all or none of a request's rows.
  req = base;
  for (int32_t l : {5, 6, 7}) req.add_row_lengths(l);
  ExpectRejected(req, v32_, "row_lengths");
  req.add_row_lengths(8);
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok());
  req.set_row_lengths(2, 0);  // request 1's rows are 1 and 2
  ExpectRejected(req, v32_, "row_lengths[2]");
  req.set_row_lengths(1, 0);
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok()) << "request 1 causal, the others explicit";
  req.set_row_lengths(3, -4);
  ExpectRejected(req, v32_, "row_lengths[3]");
  req.set_row_lengths(3, static_cast<int32_t>(v32_.max_context) + 1);
  ExpectRejected(req, v32_, "row_lengths[3]");

  // new_keys and new_key_scales.
  req = base;
  req.mutable_new_keys()->set_shape(0, 3);
  ExpectRejected(req, v32_, "new_keys.shape");
  req = base;
  req.mutable_new_keys()->set_shape(1, 64);
  ExpectRejected(req, v32_, "new_keys.shape");
  req = base;
  req.mutable_new_keys()->mutable_data()->pop_back();
  ExpectRejected(req, v32_, "new_keys.data");
  req = base;
  req.mutable_new_keys()->set_dtype(v1::DTYPE_INT32);
  ExpectRejected(req, v32_, "new_keys.dtype");
  req = base;
  std::vector<float> k = Random(4 * D);
  k[rng_() % k.size()] = std::numeric_limits<float>::quiet_NaN();
  *req.mutable_new_keys() = F32Tensor(k, {4, D});
  ExpectRejected(req, v32_, "new_keys.data");
  req = base;
  *req.mutable_new_keys() = CodesTensor(v1::DTYPE_FP4_E2M1, RandomBytes(4 * D / 2), {4, D});
  ExpectRejected(req, v32_, "new_keys.dtype");  // FP4 keys at an FP8 cache
  *req.mutable_new_keys() = CodesTensor(v1::DTYPE_FP8_E4M3, RandomFp8(4 * D), {4, D});
  ExpectRejected(req, v32_, "new_key_scales");  // required
  *req.mutable_new_key_scales() = F32Tensor(std::vector<float>{1, 2, 0, 4}, {4});
  ExpectRejected(req, v32_, "new_key_scales.data");  // non-positive
  *req.mutable_new_key_scales() = F32Tensor(std::vector<float>{1, 2, 4}, {3});
  ExpectRejected(req, v32_, "new_key_scales.shape");
  *req.mutable_new_key_scales() = F32Tensor(std::vector<float>{1, 2, 4, 8}, {4});
  EXPECT_TRUE(DecodeStepRequest(req, v32_).ok());
  *req.mutable_new_keys() = F32Tensor(Random(4 * D), {4, D});
  ExpectRejected(req, v32_, "new_key_scales");  // scales with unquantized keys
  req = base;
  *req.mutable_new_keys() = F32Tensor(std::vector<float>{}, {0, D});
  req.add_new_key_counts(0);
  req.add_new_key_counts(0);
  req.add_new_key_counts(0);
  ExpectRejected(req, v32_, "new_keys.shape");  // present with no keys

  // At a consumer (v41): no keys, no positions, no counts above 0.
  const int consumer = ConsumerLayer();
  ASSERT_GE(consumer, 0);
  const v1::DecodeStepRequest cbase =
      ::decode_indexer::testing::ToColumnar(ValidStep(v41_, consumer, {1, 1}));
  ASSERT_TRUE(DecodeStepRequest(cbase, v41_).ok());
  req = cbase;
  *req.mutable_new_keys() = F32Tensor(Random(2 * D), {2, D});
  ExpectRejected(req, v41_, "new_keys");
  req = cbase;
  req.add_new_key_counts(0);
  req.add_new_key_counts(0);
  EXPECT_TRUE(DecodeStepRequest(req, v41_).ok());
  req.set_new_key_counts(1, 1);
  ExpectRejected(req, v41_, "new_key_counts[1]");
  req = cbase;
  req.add_new_keys_positions(-1);
  req.add_new_keys_positions(-1);
  EXPECT_TRUE(DecodeStepRequest(req, v41_).ok());
  req.set_new_keys_positions(0, 4);
  ExpectRejected(req, v41_, "new_keys_positions[0]");
}

TEST_F(ColumnarDecodeTest, MessagesNameTheColumnarFields) {
  auto req = ::decode_indexer::testing::ToColumnar(ValidStep(v32_, 0, {1, 1, 1, 1}));
  req.set_sequence_ids(3, req.sequence_ids(1));
  absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, v32_);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(),
            absl::StrCat("sequence_ids[3]: ", req.sequence_ids(1),
                         " appears twice in one step (also sequence_ids[1])"));
  req = ::decode_indexer::testing::ToColumnar(ValidStep(v32_, 0, {1, 1}));
  req.mutable_new_keys()->set_shape(0, 3);
  d = DecodeStepRequest(req, v32_);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(),
            "new_keys.shape: expected [2, 128] (one key per row: new_key_counts is empty), got "
            "[3, 128]");
}

TEST_F(ColumnarDecodeTest, ExecutorMessagesAreRenamedForColumnarSteps) {
  // Three requests of 2, 1 and 3 rows: request 2's row 1 is row_lengths[4].
  v1::DecodeStepRequest col;
  for (uint64_t id : {5u, 6u, 7u}) col.add_sequence_ids(id);
  for (int32_t n : {2, 1, 3}) col.add_num_rows(n);
  auto renamed = [&](absl::StatusCode code, const std::string& message) {
    return NameColumnarFields(absl::Status(code, message), col);
  };
  EXPECT_EQ(renamed(absl::StatusCode::kNotFound, "sequences[2].sequence_id: no sequence 7"),
            absl::NotFoundError("sequence_ids[2]: no sequence 7"));
  EXPECT_EQ(renamed(absl::StatusCode::kInvalidArgument,
                    "sequences[2].row_lengths[1]: must be in [1, 9], got 12"),
            absl::InvalidArgumentError("row_lengths[4]: must be in [1, 9], got 12"));
  EXPECT_EQ(
      renamed(absl::StatusCode::kInvalidArgument,
              "sequences[1].new_keys_position: 40 is past the sequence's length 30"),
      absl::InvalidArgumentError("new_keys_positions[1]: 40 is past the sequence's length 30"));
  EXPECT_EQ(renamed(absl::StatusCode::kInvalidArgument,
                    "sequences[0].num_rows: more rows than context (2 rows, length 1)"),
            absl::InvalidArgumentError("num_rows[0]: more rows than context (2 rows, length 1)"));
  EXPECT_EQ(
      renamed(absl::StatusCode::kFailedPrecondition,
              "sequences[1]: no candidates for sequence 6 at length 3"),
      absl::FailedPreconditionError("sequence_ids[1]: no candidates for sequence 6 at length 3"));
  EXPECT_EQ(renamed(absl::StatusCode::kOutOfRange, "sequences[0].new_keys: length 5 + 3 > 7"),
            absl::OutOfRangeError("new_keys (sequence_ids[0]'s keys): length 5 + 3 > 7"));
  // One count for all: row_lengths offsets by it, num_rows becomes rows_per_sequence.
  col.clear_num_rows();
  col.set_rows_per_sequence(2);
  EXPECT_EQ(renamed(absl::StatusCode::kInvalidArgument, "sequences[2].row_lengths[1]: x"),
            absl::InvalidArgumentError("row_lengths[5]: x"));
  EXPECT_EQ(renamed(absl::StatusCode::kInvalidArgument, "sequences[1].num_rows: x"),
            absl::InvalidArgumentError("rows_per_sequence (sequence_ids[1]): x"));
  // Not about a request, or a step in the sequences form: unchanged.
  EXPECT_EQ(renamed(absl::StatusCode::kInternal, "num_rows: 3 vs 4"),
            absl::InternalError("num_rows: 3 vs 4"));
  EXPECT_EQ(renamed(absl::StatusCode::kInvalidArgument, "sequences[9].num_rows: x"),
            absl::InvalidArgumentError("sequences[9].num_rows: x"));  // no such request
  v1::DecodeStepRequest seq;
  seq.add_sequences()->set_sequence_id(5);
  EXPECT_EQ(NameColumnarFields(absl::NotFoundError("sequences[0].sequence_id: no sequence 5"), seq),
            absl::NotFoundError("sequences[0].sequence_id: no sequence 5"));
  EXPECT_TRUE(NameColumnarFields(absl::OkStatus(), col).ok());
}

// Random corruptions of a columnar step's columns and keys: refused with INVALID_ARGUMENT, or
// decoded into requests whose keys lie inside the one keys tensor (and rows that add up).
TEST_F(ColumnarDecodeTest, RandomCorruptionsNeverReadOutside) {
  for (int iter = 0; iter < 400; ++iter) {
    const config::Profile& p = (iter & 1) ? v41_ : v32_;
    const int layer = static_cast<int>(rng_() % p.layers.size());
    v1::DecodeStepRequest req = ::decode_indexer::testing::ToColumnar(
        RandomStep(p, layer, 1 + static_cast<int>(rng_() % 4), 0, static_cast<Keys>(rng_() % 3),
                   true, true),
        {rng_() % 2 == 0, rng_() % 2 == 0, rng_() % 2 == 0});
    const auto small = [&] { return static_cast<int32_t>(rng_() % 12) - 3; };
    switch (rng_() % 8) {
      case 0:
        if (req.num_rows_size() > 0)
          req.set_num_rows(rng_() % req.num_rows_size(), small());
        else
          req.set_rows_per_sequence(small());
        break;
      case 1:
        if (req.new_key_counts_size() > 0) {
          req.set_new_key_counts(rng_() % req.new_key_counts_size(), small());
        } else {
          req.add_new_key_counts(small());
        }
        break;
      case 2:
        req.add_new_keys_positions(static_cast<int64_t>(rng_() % 9) - 4);
        break;
      case 3:
        if (req.row_lengths_size() > 0)
          req.set_row_lengths(rng_() % req.row_lengths_size(), small());
        else
          req.add_row_lengths(small());
        break;
      case 4:
        if (req.new_keys().shape_size() > 0) req.mutable_new_keys()->set_shape(0, small());
        break;
      case 5:
        req.mutable_new_keys()->mutable_data()->resize(rng_() %
                                                       (req.new_keys().data().size() + 64));
        break;
      case 6:
        req.mutable_new_key_scales()->set_dtype(static_cast<v1::DType>(rng_() % 9));
        break;
      default:
        req.add_sequence_ids(req.sequence_ids(0) + (rng_() % 2));
        break;
    }
    absl::StatusOr<DecodedStep> d = DecodeStepRequest(req, p);
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
      continue;
    }
    const char* lo = req.new_keys().data().data();
    const char* hi = lo + req.new_keys().data().size();
    int64_t rows = 0;
    for (const exec::SequenceStepInput& s : d->step().sequences) {
      rows += s.num_rows;
      if (s.new_keys.count == 0) continue;
      const char* k = static_cast<const char*>(s.new_keys.keys);
      const size_t bytes = size_t(s.new_keys.count) * p.head_dim *
                           (s.new_keys.type == kernels::ElemType::kF32    ? 4
                            : s.new_keys.type == kernels::ElemType::kBF16 ? 2
                                                                          : 1) /
                           (s.new_keys.type == kernels::ElemType::kFp4E2M1 ? 2 : 1);
      // In place, or in the decoded step's own realigned copy.
      bool inside = k >= lo && k + bytes <= hi;
      for (const std::vector<uint8_t>& r : d->realigned) {
        const char* b = reinterpret_cast<const char*>(r.data());
        inside = inside || (k >= b && k + bytes <= b + r.size());
      }
      EXPECT_TRUE(inside) << "request keys outside the keys tensor at iteration " << iter;
    }
    EXPECT_EQ(rows, d->step().num_rows);
  }
}

}  // namespace
}  // namespace decode_indexer::service
