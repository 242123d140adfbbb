// The data plane's alternative paths answer exactly as the plain gRPC path: the delta-varint
// answer encoding and the POSIX shared-memory path (q, q_scales, weights read from and the
// answer written into a client region), checked against the CPU reference oracle; plus the
// rejections (bad region, out-of-bounds offsets, CUDA IPC unimplemented) that change nothing.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "server/service/data_plane.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

uint64_t Seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

TEST(DeltaEncodingTest, RoundTripsRandomRows) {
  Gen gen(Seed());
  const int rows = 1 + int(gen.rng()() % 20), k = 1 + int(gen.rng()() % 300);
  std::vector<int32_t> topk(size_t(rows) * k, -1);
  for (int r = 0; r < rows; ++r) {
    // Row r: `valid` distinct ascending positions (gaps up to ~70000), then -1s.
    const int valid = r == 0 ? k : int(gen.rng()() % (k + 1));
    int64_t pos = -1;
    for (int i = 0; i < valid; ++i) {
      pos += 1 + int64_t(gen.rng()() % (i % 7 == 0 ? 70000 : 40));
      topk[size_t(r) * k + i] = int32_t(pos);
    }
  }
  std::string bytes;
  service::EncodeTopkDelta(topk, rows, k, bytes);
  absl::StatusOr<std::vector<int32_t>> back = client::DecodeTopkDelta(bytes, rows, k);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, topk);
  EXPECT_LT(bytes.size(), topk.size() * 4);
  // A cut or padded stream is refused, never silently misread.
  EXPECT_FALSE(client::DecodeTopkDelta(bytes.substr(0, bytes.size() - 1), rows, k).ok());
  EXPECT_FALSE(client::DecodeTopkDelta(bytes + '\x01', rows, k).ok());
}

class DataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    s_ = StartSession(LoadOrDie(TinyProfilePath()), CpuOptions(2, 64));
    ASSERT_NE(s_, nullptr);
    oracle_ = std::make_unique<ServiceOracle>(s_->profile, 64, Seed());
    gen_ = std::make_unique<Gen>(Seed());
    lengths_ = {30 + int64_t(gen_->rng()() % 40), 60, 17 + int64_t(gen_->rng()() % 5)};
    Prefill(*s_, *oracle_, *gen_, ids_, lengths_, {0, 1, 2});
  }

  v1::DecodeStepRequest Step(int layer, QForm qform, int next_n = 1) {
    return MakeStep(*gen_, s_->profile, layer, ids_, lengths_, next_n, qform, KeyForm::kF32,
                    step_id_++);
  }

  std::unique_ptr<Session> s_;
  std::unique_ptr<ServiceOracle> oracle_;
  std::unique_ptr<Gen> gen_;
  const std::vector<uint64_t> ids_ = {21, 22, 23};
  std::vector<int64_t> lengths_;
  uint64_t step_id_ = 1;
};

TEST_F(DataPlaneTest, DeltaEncodedAnswersMatchTheOracle) {
  for (int layer : {0, 1, 2, 3}) {
    v1::DecodeStepRequest req = Step(layer, layer % 2 ? QForm::kQuantized : QForm::kF32Rope, 2);
    req.set_answer_encoding(v1::ANSWER_ENCODING_DELTA_VARINT);
    StepAndCompare(*s_, *oracle_, req, "delta layer " + std::to_string(layer));
  }
  // On the wire: shape-only topk plus topk_delta, smaller than the raw int32 answer.
  v1::DecodeStepRequest req = Step(0, QForm::kF32Rope, 2);
  req.set_answer_encoding(v1::ANSWER_ENCODING_DELTA_VARINT);
  auto stub = v1::DecodeIndexer::NewStub(s_->client->channel().shared_from_this());
  grpc::ClientContext ctx;
  v1::DecodeStepResponse resp;
  ASSERT_TRUE(stub->DecodeStep(&ctx, req, &resp).ok());
  EXPECT_TRUE(resp.topk().data().empty());
  EXPECT_FALSE(resp.topk_delta().empty());
  EXPECT_LT(resp.topk_delta().size(), size_t(resp.topk().shape(0) * resp.topk().shape(1) * 4));
  absl::StatusOr<client::StepAnswer> got = client::ParseStepResponse(resp);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<OracleAnswer> want = oracle_->Step(req);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->topk, want->topk);
}

// Moves q / q_scales / weights of `req` into `shm` at fresh offsets and points the request
// there; the answer and candidates go after them.
struct Offsets {
  uint64_t answer = 0, candidates = 0;
};
Offsets MoveToShared(v1::DecodeStepRequest& req, client::SharedMemory& shm, uint64_t region) {
  uint64_t at = 64;
  auto place = [&](v1::Tensor* t) {
    const uint64_t off = at;
    std::memcpy(shm.data() + off, t->data().data(), t->data().size());
    at += (t->data().size() + 63) / 64 * 64;
    t->clear_data();
    return off;
  };
  v1::SharedMemoryStep* sm = req.mutable_shared_memory();
  sm->set_region_id(region);
  sm->set_q_offset(place(req.mutable_q()));
  if (req.has_q_scales()) sm->set_q_scales_offset(place(req.mutable_q_scales()));
  sm->set_weights_offset(place(req.mutable_weights()));
  Offsets o;
  o.answer = at;
  o.candidates = at + (1 << 16);
  sm->set_answer_offset(o.answer);
  sm->set_candidates_offset(o.candidates);
  // Stale bytes where the answer goes, so a missing write shows.
  std::memset(shm.data() + o.answer, 0x5A, 1 << 17);
  return o;
}

TEST_F(DataPlaneTest, SharedMemoryAnswersExactlyAsGrpc) {
  const std::string name =
      "/di-test-" + std::to_string(getpid()) + "-" + std::to_string(Seed() % 1000000);
  absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm =
      client::SharedMemory::Create(name, 1 << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  absl::StatusOr<uint64_t> region = s_->client->RegisterSharedMemory(name, 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();

  for (int layer : {0, 1, 2, 3}) {
    const QForm form = layer == 1 ? QForm::kQuantized : QForm::kBF16Rope;
    const v1::DecodeStepRequest plain = Step(layer, form, 2);
    v1::DecodeStepRequest shared = plain;
    const Offsets o = MoveToShared(shared, **shm, *region);
    absl::StatusOr<client::StepAnswer> got = s_->client->DecodeStep(shared);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<OracleAnswer> want = oracle_->Step(plain);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_TRUE(got->in_shared_memory);
    EXPECT_TRUE(got->topk.empty());
    ASSERT_EQ(got->rows, want->rows);
    ASSERT_EQ(got->k, want->k);
    EXPECT_EQ(got->lengths, want->lengths);
    std::vector<int32_t> answer(want->topk.size());
    std::memcpy(answer.data(), (*shm)->data() + o.answer, answer.size() * 4);
    EXPECT_EQ(answer, want->topk) << "layer " << layer;
    if (plain.return_candidates()) {
      std::vector<int32_t> cand(want->candidates.size());
      std::memcpy(cand.data(), (*shm)->data() + o.candidates, cand.size() * 4);
      EXPECT_EQ(cand, want->candidates);
    }
  }

  // Out of the region: rejected before anything runs (the next plain step still agrees).
  v1::DecodeStepRequest bad = Step(0, QForm::kF32Rope);
  const v1::DecodeStepRequest retry = bad;
  MoveToShared(bad, **shm, *region);
  bad.mutable_shared_memory()->set_answer_offset((1 << 20) - 8);
  absl::StatusOr<client::StepAnswer> r = s_->client->DecodeStep(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("answer_offset"), std::string::npos) << r.status();
  bad.mutable_shared_memory()->set_answer_offset(0);
  bad.mutable_shared_memory()->set_q_offset(uint64_t{1} << 40);
  EXPECT_EQ(s_->client->DecodeStep(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.mutable_shared_memory()->set_region_id(*region + 100);
  EXPECT_EQ(s_->client->DecodeStep(bad).status().code(), absl::StatusCode::kNotFound);
  StepAndCompare(*s_, *oracle_, retry, "after rejected shared-memory steps");

  ASSERT_TRUE(s_->client->UnregisterSharedMemory(*region).ok());
  EXPECT_EQ(s_->client->UnregisterSharedMemory(*region).code(), absl::StatusCode::kNotFound);
}

TEST_F(DataPlaneTest, RegistrationAndCudaIpcRejections) {
  EXPECT_EQ(s_->client->RegisterSharedMemory("/not-ours", 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s_->client->RegisterSharedMemory("/di-absent-" + std::to_string(Seed()), 4096)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  v1::DecodeStepRequest req = Step(0, QForm::kF32Rope);
  const v1::DecodeStepRequest retry = req;
  req.set_answer_cuda_ipc(true);
  EXPECT_EQ(s_->client->DecodeStep(req).status().code(), absl::StatusCode::kUnimplemented);
  StepAndCompare(*s_, *oracle_, retry, "after the CUDA IPC request");
}

}  // namespace
}  // namespace decode_indexer::testing
