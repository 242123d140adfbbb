// The data plane's alternative paths answer exactly as the plain gRPC path: the delta-varint
// answer encoding, the shared-memory path (q, q_scales, weights read from and the answer
// written into a client's sealed memfd) and the CUDA IPC path's plumbing (on a CPU backend
// that plays a device: its "IPC handle" names a host buffer; q, weights and new keys read
// from it, the answer written there, over unary, stream and the step ring), checked against
// the CPU reference oracle and bit for bit against the same steps with their tensors inline;
// plus the rejections (bad region, out-of-bounds offsets, wrong device, the CPU backend's
// refusal, bad values found on the device) and the per-step timeout, none of which changes
// anything.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/fast_path.h"
#include "common/step_ring.h"
#include "decode_indexer/kernels/backend.h"
#include "server/exec/executor_internal.h"
#include "server/service/data_plane.h"
#include "server/service/indexer_service.h"
#include "tests/service/columnar.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

// The test's seed (tests/test_seed.h): printed when the test fails; DI_TEST_SEED replays it.
uint64_t Seed() { return TestSeed(); }

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

// The delta codec written plainly, varint by varint (the proto's definition), to hold the
// product's blocked encoder and decoder to.
void PlainPutVarint(uint32_t v, std::string& out) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>((v & 0x7F) | 0x80));
  out.push_back(static_cast<char>(v));
}
std::string PlainEncode(const std::vector<int32_t>& topk, int rows, int k) {
  std::string out;
  for (int r = 0; r < rows; ++r) {
    int valid = 0;
    while (valid < k && topk[size_t(r) * k + valid] >= 0) ++valid;
    PlainPutVarint(uint32_t(valid), out);
    int64_t prev = -1;
    for (int i = 0; i < valid; ++i) {
      PlainPutVarint(uint32_t(topk[size_t(r) * k + i] - prev - 1), out);
      prev = topk[size_t(r) * k + i];
    }
  }
  return out;
}
std::optional<std::vector<int32_t>> PlainDecode(const std::string& bytes, int rows, int k) {
  std::vector<int32_t> out(size_t(rows) * k, -1);
  size_t at = 0;
  auto next = [&](uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 35; shift += 7) {
      if (at >= bytes.size()) return false;
      const auto b = uint8_t(bytes[at++]);
      v |= uint64_t(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  for (int r = 0; r < rows; ++r) {
    uint64_t valid = 0;
    if (!next(valid) || valid > uint64_t(k)) return std::nullopt;
    int64_t prev = -1;
    for (uint64_t i = 0; i < valid; ++i) {
      uint64_t gap = 0;
      if (!next(gap)) return std::nullopt;
      prev += int64_t(gap) + 1;
      if (prev > INT32_MAX) return std::nullopt;
      out[size_t(r) * k + i] = int32_t(prev);
    }
  }
  if (at != bytes.size()) return std::nullopt;
  return out;
}

// The blocked codec (16 gaps at a time out, 8 in) against the plain one: rows full, short and
// empty, gaps of one to five bytes placed anywhere in a block (first, last, alone), positions
// up to 2^31 - 1; then the decoder on damaged bytes (cut, extended, bytes flipped): accepted
// and refused alike, and what it accepts equal.
TEST(DeltaEncodingTest, BlockedCodecEqualsThePlainOne) {
  Gen gen(Seed());
  std::mt19937_64& rng = gen.rng();
  for (int trial = 0; trial < 300; ++trial) {
    const int k = trial % 3 == 0 ? 2048 : 1 + int(rng() % 80);
    const int rows = 1 + int(rng() % 6);
    const int long_gap_every = 1 + int(rng() % 64);  // 1: every gap may be long
    std::vector<int32_t> topk(size_t(rows) * k, -1);
    for (int r = 0; r < rows; ++r) {
      const int valid = rng() % 3 == 0 ? int(rng() % (k + 1)) : k;
      int64_t pos = -1;
      for (int i = 0; i < valid; ++i) {
        const bool long_gap = rng() % long_gap_every == 0;
        const uint64_t width = long_gap ? uint64_t{1} << (7 * (1 + rng() % 4)) : 127;
        pos += 1 + int64_t(rng() % width);
        if (pos > INT32_MAX - (valid - i)) pos = INT32_MAX - (valid - i);  // room for the rest
        topk[size_t(r) * k + i] = int32_t(pos);
      }
    }
    SCOPED_TRACE(absl::StrCat("trial ", trial, " rows ", rows, " k ", k));
    std::string bytes;
    service::EncodeTopkDelta(topk, rows, k, bytes);
    ASSERT_EQ(bytes, PlainEncode(topk, rows, k));
    absl::StatusOr<std::vector<int32_t>> back = client::DecodeTopkDelta(bytes, rows, k);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_EQ(*back, topk);
    for (int damage = 0; damage < 8; ++damage) {
      std::string bad = bytes;
      if (damage == 0) {
        bad.resize(rng() % bad.size());
      } else if (damage == 1) {
        bad.push_back(char(rng()));
      } else {
        for (int f = 0; f < 1 + damage / 3; ++f) bad[rng() % bad.size()] ^= char(1 << (rng() % 8));
      }
      const std::optional<std::vector<int32_t>> want = PlainDecode(bad, rows, k);
      absl::StatusOr<std::vector<int32_t>> got = client::DecodeTopkDelta(bad, rows, k);
      ASSERT_EQ(got.ok(), want.has_value()) << "damage " << damage << ": " << got.status();
      if (want) {
        ASSERT_EQ(*got, *want) << "damage " << damage;
      }
    }
  }
}

class DataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    s_ = StartSession(LoadOrDie(TinyProfilePath()), CpuOptions(2, 64),
                      [](service::ServerOptions& o) {
                        o.shm_socket = "/tmp/di-dp-" + std::to_string(getpid()) + "-" +
                                       std::to_string(Seed() % 1000000) + ".sock";
                      });
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
  EXPECT_TRUE(want->Matches(got->topk));
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
  absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm =
      client::SharedMemory::Create("di-test", 1 << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  absl::StatusOr<uint64_t> region = s_->client->RegisterSharedMemory(**shm);
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
    EXPECT_TRUE(want->Matches(answer)) << "layer " << layer;
    if (plain.return_candidates()) {
      std::vector<int32_t> cand(want->candidates.size());
      std::memcpy(cand.data(), (*shm)->data() + o.candidates, cand.size() * 4);
      EXPECT_TRUE(want->Matches(answer, cand));
      oracle_->AdoptCandidates(plain, cand);
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
  bad.mutable_shared_memory()->set_region_id(*region ^ 0x100);
  EXPECT_EQ(s_->client->DecodeStep(bad).status().code(), absl::StatusCode::kNotFound);
  StepAndCompare(*s_, *oracle_, retry, "after rejected shared-memory steps");

  ASSERT_TRUE(s_->client->UnregisterSharedMemory(*region).ok());
  EXPECT_EQ(s_->client->UnregisterSharedMemory(*region).code(), absl::StatusCode::kNotFound);
}

TEST_F(DataPlaneTest, RegistrationAndCudaIpcRejections) {
  v1::DecodeStepRequest req = Step(0, QForm::kF32Rope);
  const v1::DecodeStepRequest retry = req;
  req.set_answer_cuda_ipc(true);
  EXPECT_EQ(s_->client->DecodeStep(req).status().code(), absl::StatusCode::kUnimplemented);

  // RegisterCudaIpcMemory: the edge's checks name the field; a well-formed request reaches
  // the CPU backend, which has no device memory.
  const std::string handle(64, '\x11');
  auto expect_invalid = [](const absl::StatusOr<uint64_t>& r, const char* field) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
  };
  expect_invalid(s_->client->RegisterCudaIpcMemory(handle.substr(0, 63), 4096, 0), "handle");
  expect_invalid(s_->client->RegisterCudaIpcMemory(handle, 0, 0), "size");
  expect_invalid(s_->client->RegisterCudaIpcMemory(handle, 4096, -1), "device");
  absl::StatusOr<uint64_t> cpu = s_->client->RegisterCudaIpcMemory(handle, 4096, 0);
  EXPECT_EQ(cpu.status().code(), absl::StatusCode::kFailedPrecondition) << cpu.status();
  EXPECT_NE(cpu.status().message().find("cpu"), std::string::npos) << cpu.status();
  EXPECT_EQ(s_->client->UnregisterCudaIpcMemory(1).code(), absl::StatusCode::kNotFound);
  // A step naming a region that does not exist.
  v1::DecodeStepRequest ipc = Step(0, QForm::kF32Rope);
  ipc.mutable_cuda_ipc()->set_region_id(1 + Seed() % 1000);
  absl::StatusOr<client::StepAnswer> r = s_->client->DecodeStep(ipc);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("cuda_ipc.region_id"), std::string::npos) << r.status();
  StepAndCompare(*s_, *oracle_, retry, "after the CUDA IPC requests");

  // The per-rank device-memory gauge: one entry per rank, 0 on the CPU backend.
  absl::StatusOr<v1::Statistics> stats = s_->client->GetStatistics();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->device_memory_bytes_size(), 2);
  EXPECT_EQ(stats->device_memory_bytes(0), 0);
  EXPECT_EQ(stats->device_memory_bytes(1), 0);
}

// timeout_us: counted from when the server read the step; one that expires while waiting for
// admission answers DEADLINE_EXCEEDED and changes nothing (its keys are not inserted).
TEST_F(DataPlaneTest, StepTimeoutExpiresBeforeTheStepRuns) {
  v1::DecodeStepRequest late = Step(0, QForm::kF32Rope);
  const v1::DecodeStepRequest retry = late;
  late.set_timeout_us(1);
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = s_->client->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  {
    // Held admission: released only once the step is queued behind it (a count, not a
    // sleep), so it is admitted after it was read, later than its 1 us allows.
    std::unique_lock<std::mutex> hold = s_->server->service().HoldStepAdmissionForTesting();
    ASSERT_TRUE((*stream)->Write(late).ok());
    while (s_->server->service().StepsWaitingForAdmissionForTesting() == 0) {
      std::this_thread::yield();
    }
  }
  absl::StatusOr<client::StepAnswer> got = (*stream)->Read();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_NE(got.status().message().find("timeout_us"), std::string::npos) << got.status();
  v1::DecodeStepRequest negative = retry;
  negative.set_timeout_us(-5);
  EXPECT_EQ(s_->client->DecodeStep(negative).status().code(), absl::StatusCode::kInvalidArgument);
  // Same keys again with a generous timeout: the lengths show the late step inserted nothing.
  v1::DecodeStepRequest generous = retry;
  generous.set_timeout_us(int64_t{600} * 1000 * 1000);
  StepAndCompare(*s_, *oracle_, generous, "after the expired step");
}

// A CPU backend playing a GPU for the CUDA IPC plumbing: its "handle" carries the address and
// size of a host buffer of the test (the "device buffer"), which the backend "opens" by
// answering that address; CopyDeviceToDevice is a memcpy. Everything else is the CPU backend.
// What the fake ranks did with the "device buffer" and the "events", in order: (rank, what)
// with what "read" (a device-to-device copy out of an opened buffer), "write" (into one),
// "kernel read" / "kernel write" (FakeIpcOps: a kernel reading q, or writing its top-k, in
// place there), "wait:<event>", "record:<event>". An event's "handle" carries its number in its
// first byte; `events` counts the opened ones.
struct FakeIpcLog {
  std::mutex mu;
  std::vector<std::pair<int, std::string>> entries;
  std::vector<std::pair<uintptr_t, uintptr_t>> buffers;  // opened [begin, end)
  // Every read's (rank, source address, bytes), for which bytes a step read on the device.
  struct Read {
    int rank;
    uintptr_t at;
    size_t bytes;
  };
  std::vector<Read> reads;
  std::atomic<int> events{0};
  void Add(int rank, std::string what) {
    std::lock_guard lock(mu);
    entries.emplace_back(rank, std::move(what));
  }
  void AddRead(int rank, const void* at, size_t bytes) {
    std::lock_guard lock(mu);
    entries.emplace_back(rank, "read");
    reads.push_back({rank, reinterpret_cast<uintptr_t>(at), bytes});
  }
  std::vector<Read> TakeReads() {
    std::lock_guard lock(mu);
    return std::exchange(reads, {});
  }
  bool InBuffer(const void* p) {
    std::lock_guard lock(mu);
    const auto a = reinterpret_cast<uintptr_t>(p);
    for (const auto& [b, e] : buffers) {
      if (a >= b && a < e) return true;
    }
    return false;
  }
  std::vector<std::pair<int, std::string>> Take() {
    std::lock_guard lock(mu);
    return std::exchange(entries, {});
  }
};

// The CPU backend's device playing a GPU for CUDA IPC (a Device decorator; the operations are
// the CPU's own).
class FakeIpcDevice final : public kernels::DeviceWrapper {
 public:
  FakeIpcDevice(kernels::Device& cpu, std::atomic<int>* open, FakeIpcLog* log = nullptr,
                int rank = 0)
      : DeviceWrapper(cpu), open_(open), log_(log), rank_(rank) {}
  std::string_view name() const override { return "fake-ipc"; }
  std::string description() const override { return "cpu playing a device for CUDA IPC"; }
  absl::Status CopyDeviceToDevice(void* d, const void* s, size_t n) override {
    if (log_ != nullptr && log_->InBuffer(s)) log_->AddRead(rank_, s, n);
    if (log_ != nullptr && log_->InBuffer(d)) log_->Add(rank_, "write");
    return target().CopyDeviceToDevice(d, s, n);
  }

  absl::StatusOr<void*> OpenIpcMemory(std::string_view handle, size_t bytes, int device) override {
    if (device != 0) return absl::InvalidArgumentError("device: the answering rank is on 0");
    uint64_t address = 0, size = 0;
    std::memcpy(&address, handle.data(), 8);
    std::memcpy(&size, handle.data() + 8, 8);
    if (bytes > size) return absl::InvalidArgumentError("size: exceeds the allocation");
    ++*open_;
    if (log_ != nullptr) {
      std::lock_guard lock(log_->mu);
      log_->buffers.emplace_back(address, address + size);
    }
    return reinterpret_cast<void*>(address);
  }
  absl::Status CloseIpcMemory(void*) override {
    --*open_;
    return absl::OkStatus();
  }
  // An "event" is its number (the handle's first byte, 1-255), as a pointer.
  absl::StatusOr<void*> OpenIpcEvent(std::string_view handle, int device) override {
    if (device != 0) return absl::InvalidArgumentError("the answering rank is on 0");
    if (handle.size() != 64 || handle[0] == 0) return absl::InvalidArgumentError("a bad event");
    if (log_ != nullptr) ++log_->events;
    return reinterpret_cast<void*>(uintptr_t(uint8_t(handle[0])));
  }
  absl::Status CloseIpcEvent(void*) override {
    if (log_ != nullptr) --log_->events;
    return absl::OkStatus();
  }
  absl::Status WaitEvent(void* event) override {
    if (log_ != nullptr)
      log_->Add(rank_, absl::StrCat("wait:", reinterpret_cast<uintptr_t>(event)));
    return absl::OkStatus();
  }
  absl::Status RecordEvent(void* event) override {
    if (log_ != nullptr) {
      log_->Add(rank_, absl::StrCat("record:", reinterpret_cast<uintptr_t>(event)));
    }
    return absl::OkStatus();
  }

 private:
  std::atomic<int>* open_;
  FakeIpcLog* log_;
  int rank_;
};

// The CPU's operations, logging (rank, "kernel read") when a kernel reads an opened buffer in
// place: the answering rank's scoring and value check of device q (step_io.h UploadQ); and
// (rank, "kernel write") when its scoring writes the top-k in place there (decode_schedule.h
// TopKInPlace).
class FakeIpcOps final : public kernels::IndexerOpsWrapper {
 public:
  FakeIpcOps(kernels::IndexerOps& cpu, FakeIpcLog* log, int rank)
      : IndexerOpsWrapper(cpu), log_(log), rank_(rank) {}
  absl::Status DenseTopK(const kernels::DenseArgs& a) override {
    Note(a.q, a.topk_out);
    return target().DenseTopK(a);
  }
  absl::Status SparseTopK(const kernels::SparseArgs& a) override {
    Note(a.q, a.topk_out);
    return target().SparseTopK(a);
  }
  absl::Status MaskedTopK(const kernels::MaskedArgs& a) override {
    Note(a.q, a.topk_out);
    return target().MaskedTopK(a);
  }
  absl::Status CheckValues(const kernels::ValueCheckArgs& a) override {
    for (int32_t c = 0; c < a.num_checks; ++c) {
      if (log_->InBuffer(a.checks[c].data)) {
        log_->Add(rank_, "kernel read");
        break;
      }
    }
    return target().CheckValues(a);
  }

 private:
  void Note(const kernels::QView& q, const int32_t* topk_out) {
    if (log_->InBuffer(q.codes) || log_->InBuffer(q.weights) ||
        (q.scales != nullptr && log_->InBuffer(q.scales))) {
      log_->Add(rank_, "kernel read");
    }
    if (log_->InBuffer(topk_out)) log_->Add(rank_, "kernel write");
  }
  FakeIpcLog* log_;
  int rank_;
};

// A server on FakeIpcDevice ranks (CPU underneath) with a client, for the CUDA IPC tests.
class FakeIpcTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    profile_ = LoadOrDie(TinyProfilePath());
    exec::ExecutorOptions options = CpuOptions(GetParam(), 64);
    absl::StatusOr<std::unique_ptr<exec::Executor>> executor = exec::CreateExecutorWithBackends(
        profile_, options,
        [this](int32_t rank, const kernels::BackendLimits& limits)
            -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
          std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(limits, 1);
          auto device = std::make_unique<FakeIpcDevice>(cpu->device(), &open_, &log_, rank);
          auto ops = std::make_unique<FakeIpcOps>(cpu->ops(), &log_, rank);
          return kernels::ComposeBackend(std::move(cpu), std::move(device), std::move(ops));
        });
    ASSERT_TRUE(executor.ok()) << executor.status();
    executor_ = *std::move(executor);
    service_ = std::make_unique<service::IndexerService>(*executor_, "test");
    // The shm socket, for the step ring (FastPathRing) over these fake devices.
    socket_path_ =
        absl::StrCat("/tmp/di-ipc-", getpid(), "-", TestSeed() % 1000000, "-", GetParam(), ".sock");
    ASSERT_TRUE(service_->StartShmSocket(socket_path_).ok());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    if (TestEdge() == service::ServerOptions::GrpcEdge::kCallback) {
      edge_ = std::make_unique<service::CallbackEdge>(*service_, 2);
      builder.RegisterService(edge_->methods());
      builder.RegisterCallbackGenericService(edge_.get());
    } else {
      builder.RegisterService(service_.get());
    }
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    s_.profile = profile_;
    absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
        client::IndexerClient::Connect("127.0.0.1:" + std::to_string(port));
    ASSERT_TRUE(c.ok()) << c.status();
    s_.client = std::move(*c);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
    if (service_) service_->StopStepRings();
    if (executor_) executor_->Shutdown();
  }
  // Registers `device` (the test's "device buffer") and answers its region id; events
  // numbered `inputs_event` / `answer_event` (0: none) with it.
  uint64_t Register(std::vector<int32_t>& device, std::string* handle_out = nullptr,
                    int inputs_event = 0, int answer_event = 0) {
    const uint64_t bytes = device.size() * 4;
    std::string handle(64, '\0');
    const uint64_t address = reinterpret_cast<uint64_t>(device.data());
    std::memcpy(handle.data(), &address, 8);
    std::memcpy(handle.data() + 8, &bytes, 8);
    auto event = [](int number) {
      return number == 0 ? std::string() : std::string(1, char(number)) + std::string(63, '\0');
    };
    absl::StatusOr<uint64_t> region = s_.client->RegisterCudaIpcMemory(
        handle, bytes, 0, event(inputs_event), event(answer_event));
    EXPECT_TRUE(region.ok()) << region.status();
    if (handle_out != nullptr) *handle_out = handle;
    return region.ok() ? *region : 0;
  }

  config::Profile profile_;
  std::string socket_path_;
  std::atomic<int> open_{0};
  FakeIpcLog log_;
  std::unique_ptr<exec::Executor> executor_;
  std::unique_ptr<service::IndexerService> service_;
  std::unique_ptr<service::CallbackEdge> edge_;  // outlives the server
  std::unique_ptr<grpc::Server> server_;
  Session s_;
};

using CudaIpcPlumbingTest = FakeIpcTest;
INSTANTIATE_TEST_SUITE_P(Ranks, CudaIpcPlumbingTest, ::testing::Values(1, 2));

TEST_P(CudaIpcPlumbingTest, AnswersInTheRegisteredBufferExactlyAsGrpc) {
  const config::Profile& profile = profile_;
  std::atomic<int>& open = open_;
  Session& s = s_;
  Gen gen(Seed());
  ServiceOracle oracle(profile, 64, Seed());
  const std::vector<uint64_t> ids = {5, 6, 7, 8};
  std::vector<int64_t> lengths = {40 + int64_t(gen.rng()() % 30), 33, 70, 12};
  Prefill(s, oracle, gen, ids, lengths, {0, 1, 2});

  // The "device buffer": stale bytes everywhere, so a missing write shows.
  std::vector<int32_t> device(1 << 15, 0x5A5A5A5A);
  const uint64_t bytes = device.size() * 4;
  std::string handle;
  absl::StatusOr<uint64_t> region = Register(device, &handle);
  ASSERT_TRUE(region.ok());
  EXPECT_EQ(open.load(), 1);  // opened by the answering rank's backend

  uint64_t step_id = 1;
  for (int layer : {0, 1, 2, 3}) {
    const v1::DecodeStepRequest plain =
        MakeStep(gen, profile, layer, ids, lengths, 2, QForm::kF32Rope, KeyForm::kF32, step_id++);
    v1::DecodeStepRequest req = plain;
    const uint64_t answer_offset = 4 * (gen.rng()() % 64);
    const uint64_t cand_offset = bytes / 2 + 4 * (gen.rng()() % 64);
    req.mutable_cuda_ipc()->set_region_id(*region);
    req.mutable_cuda_ipc()->set_answer_offset(answer_offset);
    req.mutable_cuda_ipc()->set_candidates_offset(cand_offset);
    absl::StatusOr<client::StepAnswer> got = s.client->DecodeStep(req);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<OracleAnswer> want = oracle.Step(plain);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_TRUE(got->in_shared_memory);
    EXPECT_TRUE(got->topk.empty());
    EXPECT_EQ(got->lengths, want->lengths);
    const int32_t* at = device.data() + answer_offset / 4;
    const std::vector<int32_t> answer(at, at + want->topk.size());
    EXPECT_TRUE(want->Matches(answer)) << "layer " << layer;
    if (plain.return_candidates()) {
      const int32_t* cat = device.data() + cand_offset / 4;
      const std::vector<int32_t> cand(cat, cat + want->candidates.size());
      EXPECT_TRUE(want->Matches(answer, cand)) << "layer " << layer;
      oracle.AdoptCandidates(plain, cand);
    }
  }

  // Out of bounds, misaligned, unknown region: named, and nothing changes.
  v1::DecodeStepRequest bad =
      MakeStep(gen, profile, 0, ids, lengths, 1, QForm::kF32Rope, KeyForm::kF32, step_id++);
  const v1::DecodeStepRequest retry = bad;
  bad.mutable_cuda_ipc()->set_region_id(*region);
  bad.mutable_cuda_ipc()->set_answer_offset(bytes - 4);
  absl::StatusOr<client::StepAnswer> r = s.client->DecodeStep(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("cuda_ipc.answer_offset"), std::string::npos) << r.status();
  bad.mutable_cuda_ipc()->set_answer_offset(2);
  r = s.client->DecodeStep(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("multiple of 4"), std::string::npos) << r.status();
  bad.mutable_cuda_ipc()->set_region_id(*region + 1);
  EXPECT_EQ(s.client->DecodeStep(bad).status().code(), absl::StatusCode::kNotFound);
  // Registration the backend refuses: another device, more than the allocation.
  EXPECT_EQ(s.client->RegisterCudaIpcMemory(handle, bytes, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.client->RegisterCudaIpcMemory(handle, bytes + 4, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  StepAndCompare(s, oracle, retry, "after the rejected CUDA IPC steps");

  ASSERT_TRUE(s.client->UnregisterCudaIpcMemory(*region).ok());
  EXPECT_EQ(open.load(), 0);  // closed by the answering rank's backend
  EXPECT_EQ(s.client->UnregisterCudaIpcMemory(*region).code(), absl::StatusCode::kNotFound);
}

// Moves q, q_scales and weights of `req` into `device` at 16-byte aligned offsets from
// `at` (bytes) and points cuda_ipc at them: the Tensors keep dtype and shape only.
void MoveQToDevice(v1::DecodeStepRequest& req, std::vector<int32_t>& device, uint64_t region,
                   uint64_t at) {
  auto* base = reinterpret_cast<uint8_t*>(device.data());
  auto put = [&](v1::Tensor* t) {
    const uint64_t offset = at;
    std::memcpy(base + offset, t->data().data(), t->data().size());
    at = (at + t->data().size() + 15) / 16 * 16;
    t->clear_data();
    return offset;
  };
  v1::CudaIpcStep* ci = req.mutable_cuda_ipc();
  ci->set_region_id(region);
  ci->set_q_offset(put(req.mutable_q()));
  if (req.q_scales().dtype() != v1::DTYPE_UNSPECIFIED) {
    ci->set_q_scales_offset(put(req.mutable_q_scales()));
  }
  ci->set_weights_offset(put(req.mutable_weights()));
  ci->set_answer_offset(at);
  ci->set_candidates_offset((at + 4 * uint64_t(req.q().shape(0)) * 4096 + 15) / 16 * 16);
}

// The answer `req` left in `device` (and its candidate blocks, adopted by the oracle) against
// the oracle's answer to `plain`, the same step with q inline.
void ExpectBufferAnswer(const std::vector<int32_t>& device, const v1::DecodeStepRequest& req,
                        const v1::DecodeStepRequest& plain, const OracleAnswer& want,
                        ServiceOracle& oracle, const std::string& what) {
  const int32_t* at = device.data() + req.cuda_ipc().answer_offset() / 4;
  const std::vector<int32_t> answer(at, at + want.topk.size());
  if (plain.return_candidates()) {
    const int32_t* c = device.data() + req.cuda_ipc().candidates_offset() / 4;
    const std::vector<int32_t> cand(c, c + want.candidates.size());
    EXPECT_TRUE(want.Matches(answer, cand)) << what;
    oracle.AdoptCandidates(plain, cand);
  } else {
    EXPECT_TRUE(want.Matches(answer)) << what;
  }
}

// q read from the client's device buffer (cuda_ipc.q_offset): the answers the same step gets
// with q inline; a NaN / Inf there (checked on the device) fails the step naming the field and
// commits nothing; wrong offsets and forms are named before anything runs.
TEST_P(CudaIpcPlumbingTest, QFromTheRegisteredBufferAnswersAsInline) {
  Gen gen(Seed());
  ServiceOracle oracle(profile_, 64, Seed());
  const std::vector<uint64_t> ids = {5, 6, 7, 8};
  std::vector<int64_t> lengths = {40 + int64_t(gen.rng()() % 30), 33, 70, 12};
  Prefill(s_, oracle, gen, ids, lengths, {0, 1, 2});
  std::vector<int32_t> device(1 << 18, 0x5A5A5A5A);
  const uint64_t region = Register(device);
  ASSERT_NE(region, 0u);

  uint64_t step_id = 1;
  // Every layer (FP8 and FP4 caches, dense, source, consumer), quantized and fp32 q, 1-2 rows.
  // A consumer reads its source's rows of the same step shape: one next_n per pass.
  int pass = 0;
  for (const QForm form : {QForm::kQuantized, QForm::kF32Rope, QForm::kF32NoRope}) {
    const int next_n = 1 + pass++ % 2;
    for (int layer : {0, 1, 2, 3}) {
      const v1::DecodeStepRequest plain =
          MakeStep(gen, profile_, layer, ids, lengths, next_n, form, KeyForm::kF32, step_id++);
      v1::DecodeStepRequest req = plain;
      MoveQToDevice(req, device, region, 16 * (gen.rng()() % 64));
      absl::StatusOr<client::StepAnswer> got = s_.client->DecodeStep(req);
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<OracleAnswer> want = oracle.Step(plain);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got->lengths, want->lengths);
      ExpectBufferAnswer(device, req, plain, *want, oracle,
                         absl::StrCat("layer ", layer, " form ", int(form)));
    }
  }

  // A NaN in the device bytes of q (fp32 and FP8), its FP4 scales, or the weights: the step
  // ran but committed nothing (the retry after it answers as the oracle, at the old lengths).
  struct Poison {
    int layer;
    QForm form;
    const char* field;
  };
  for (const Poison& p :
       {Poison{0, QForm::kQuantized, "q.data"}, Poison{0, QForm::kF32NoRope, "q.data"},
        Poison{1, QForm::kQuantized, "q.data"}, Poison{0, QForm::kQuantized, "weights.data"}}) {
    const kernels::CacheFormat format = profile_.layers.at(p.layer).cache_format;
    const v1::DecodeStepRequest plain =
        MakeStep(gen, profile_, p.layer, ids, lengths, 1, p.form, KeyForm::kF32, step_id++);
    v1::DecodeStepRequest bad = plain;
    MoveQToDevice(bad, device, region, 0);
    auto* base = reinterpret_cast<uint8_t*>(device.data());
    const bool fp4 = format == kernels::CacheFormat::kFp4 && p.form == QForm::kQuantized;
    std::string field = p.field;
    if (field == "weights.data") {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::memcpy(base + bad.cuda_ipc().weights_offset() + 4 * 5, &nan, 4);
    } else if (fp4) {
      field = "q_scales.data";
      base[bad.cuda_ipc().q_scales_offset() + 3] = 0xFF;
    } else if (p.form == QForm::kQuantized) {
      base[bad.cuda_ipc().q_offset() + 77] = 0x7F;
    } else {
      const float inf = std::numeric_limits<float>::infinity();
      std::memcpy(base + bad.cuda_ipc().q_offset() + 4 * 123, &inf, 4);
    }
    absl::StatusOr<client::StepAnswer> r = s_.client->DecodeStep(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("committed nothing"), std::string::npos) << r.status();
    v1::DecodeStepRequest retry = plain;
    retry.set_step_id(step_id++);
    // The oracle never saw the failed step: equal lengths and answers mean nothing committed.
    StepAndCompare(s_, oracle, retry, "after " + field);
  }

  // Named before anything runs: the offsets' alignment and room, the forms the device path
  // takes, and the fields that must go together.
  const v1::DecodeStepRequest plain =
      MakeStep(gen, profile_, 0, ids, lengths, 1, QForm::kQuantized, KeyForm::kF32, step_id++);
  auto expect_named = [&](v1::DecodeStepRequest req, const std::string& field) {
    absl::StatusOr<client::StepAnswer> r = s_.client->DecodeStep(req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << field << ": " << r.status();
  };
  v1::DecodeStepRequest good = plain;
  MoveQToDevice(good, device, region, 64);
  v1::DecodeStepRequest bad = good;
  bad.mutable_cuda_ipc()->set_q_offset(good.cuda_ipc().q_offset() + 4);
  expect_named(bad, "cuda_ipc.q_offset");
  bad = good;
  bad.mutable_cuda_ipc()->set_q_offset(device.size() * 4 - 16);
  expect_named(bad, "cuda_ipc.q_offset");
  bad = good;
  bad.mutable_cuda_ipc()->clear_weights_offset();
  expect_named(bad, "cuda_ipc.weights_offset");
  bad = good;
  bad.mutable_cuda_ipc()->clear_q_offset();
  expect_named(bad, "cuda_ipc.q_offset");
  bad = good;
  bad.mutable_q()->set_data(plain.q().data());
  expect_named(bad, "q.data");
  bad = MakeStep(gen, profile_, 0, ids, lengths, 1, QForm::kBF16Rope, KeyForm::kF32, step_id++);
  MoveQToDevice(bad, device, region, 0);
  expect_named(bad, "weights.dtype");
  v1::DecodeStepRequest retry = plain;
  retry.set_step_id(step_id++);
  StepAndCompare(s_, oracle, retry, "after the rejected device-q steps");
  ASSERT_TRUE(s_.client->UnregisterCudaIpcMemory(region).ok());
}

// GPU-side ordering (cuda_ipc.wait_inputs_event / record_answer_event): every rank waits on the
// inputs event before it reads anything of the buffer (a copy out of it, or, on the answering
// rank, its kernels reading q in place: it copies none), the answering rank records the answer
// event after it wrote the answer there, and neither happens unless asked; the answers stay
// the oracle's. A step asking for an event the buffer was not registered with, or for the
// inputs event without device q, is named and changes nothing; a bad event handle registers
// nothing; the events close with the region.
TEST_P(CudaIpcPlumbingTest, EventsOrderTheBufferOnTheDevice) {
  Gen gen(Seed());
  ServiceOracle oracle(profile_, 64, Seed());
  const std::vector<uint64_t> ids = {5, 6, 7, 8};
  std::vector<int64_t> lengths = {40 + int64_t(gen.rng()() % 30), 33, 70, 12};
  Prefill(s_, oracle, gen, ids, lengths, {0, 1, 2});
  std::vector<int32_t> device(1 << 18, 0x5A5A5A5A);
  const uint64_t region = Register(device, nullptr, /*inputs_event=*/7, /*answer_event=*/9);
  ASSERT_NE(region, 0u);
  EXPECT_EQ(log_.events.load(), 2);
  const int ranks = GetParam();

  uint64_t step_id = 1;
  for (const bool ordered : {true, false, true}) {
    for (int layer : {0, 1, 2, 3}) {
      const v1::DecodeStepRequest plain = MakeStep(gen, profile_, layer, ids, lengths, 1,
                                                   QForm::kQuantized, KeyForm::kF32, step_id++);
      v1::DecodeStepRequest req = plain;
      MoveQToDevice(req, device, region, 16 * (gen.rng()() % 64));
      req.mutable_cuda_ipc()->set_wait_inputs_event(ordered);
      req.mutable_cuda_ipc()->set_record_answer_event(ordered);
      log_.Take();
      absl::StatusOr<client::StepAnswer> got = s_.client->DecodeStep(req);
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<std::pair<int, std::string>> entries = log_.Take();
      absl::StatusOr<OracleAnswer> want = oracle.Step(plain);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectBufferAnswer(device, req, plain, *want, oracle, absl::StrCat("layer ", layer));
      for (int r = 0; r < ranks; ++r) {
        int waits = 0, records = 0, reads = 0, kernel_reads = 0, writes = 0, kernel_writes = 0;
        for (const auto& [rank, what] : entries) {
          if (rank != r) continue;
          if (what == "wait:7") {
            EXPECT_EQ(reads + kernel_reads, 0)
                << "rank " << r << " read the buffer before the inputs event";
            ++waits;
          } else if (what == "record:9") {
            ++records;
          } else if (what == "read") {
            ++reads;
          } else if (what == "kernel read") {
            ++kernel_reads;
          } else if (what == "write" || what == "kernel write") {
            EXPECT_EQ(records, 0) << "rank " << r << " recorded the answer event too early";
            ++(what == "write" ? writes : kernel_writes);
          } else {
            ADD_FAILURE() << "rank " << r << ": " << what;
          }
        }
        // The answering rank (0) reads the quantized q in place, with its kernels (the check
        // and the scoring); the others copy their rows device to device.
        if (r == 0) {
          EXPECT_EQ(reads, 0) << "the answering rank copied q, layer " << layer;
          EXPECT_GE(kernel_reads, 2) << "layer " << layer;
        } else {
          EXPECT_GT(reads, 0) << "rank " << r << " layer " << layer;
          EXPECT_EQ(kernel_reads, 0) << "rank " << r << " layer " << layer;
        }
        EXPECT_EQ(waits, ordered ? 1 : 0) << "rank " << r << " layer " << layer;
        // The answering rank (0) writes the answer and then records the event: at one rank
        // (unsharded) its scoring writes the top-k in place, with no copy of it (a source's
        // candidates are still copied); a sharded step's gathered rows are copied.
        EXPECT_EQ(writes + kernel_writes > 0, r == 0) << "rank " << r << " layer " << layer;
        if (r == 0) {
          const bool source =
              profile_.layers[size_t(layer)].role == config::LayerRole::kCandidateSource;
          EXPECT_EQ(kernel_writes, ranks == 1 ? 1 : 0) << "layer " << layer;
          EXPECT_EQ(writes, ranks == 1 ? int(source) : 1 + int(source)) << "layer " << layer;
        }
        EXPECT_EQ(records, ordered && r == 0 ? 1 : 0) << "rank " << r << " layer " << layer;
      }
    }
  }

  // Named before anything runs, nothing committed.
  const v1::DecodeStepRequest plain =
      MakeStep(gen, profile_, 0, ids, lengths, 1, QForm::kQuantized, KeyForm::kF32, step_id++);
  auto expect_named = [&](v1::DecodeStepRequest req, const std::string& field) {
    log_.Take();
    absl::StatusOr<client::StepAnswer> r = s_.client->DecodeStep(req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << field << ": " << r.status();
    EXPECT_TRUE(log_.Take().empty()) << field << ": the rejected step ran";
  };
  v1::DecodeStepRequest bad = plain;
  MoveQToDevice(bad, device, region, 0);
  bad.mutable_cuda_ipc()->clear_q_offset();
  bad.mutable_cuda_ipc()->clear_weights_offset();
  bad.mutable_q()->set_data(plain.q().data());
  bad.mutable_weights()->set_data(plain.weights().data());
  bad.mutable_cuda_ipc()->set_wait_inputs_event(true);
  expect_named(bad, "cuda_ipc.wait_inputs_event");
  std::vector<int32_t> other(1 << 16, 0);
  const uint64_t bare = Register(other, nullptr, 0, 0);
  ASSERT_NE(bare, 0u);
  for (const bool inputs : {true, false}) {
    bad = plain;
    MoveQToDevice(bad, other, bare, 0);
    if (inputs) {
      bad.mutable_cuda_ipc()->set_wait_inputs_event(true);
    } else {
      bad.mutable_cuda_ipc()->set_record_answer_event(true);
    }
    expect_named(bad, inputs ? "cuda_ipc.wait_inputs_event" : "cuda_ipc.record_answer_event");
  }
  // A bad event handle: named, nothing registered (the buffer is closed again).
  const int open_before = open_.load();
  std::string handle(64, '\0');
  const uint64_t address = reinterpret_cast<uint64_t>(other.data()), bytes = other.size() * 4;
  std::memcpy(handle.data(), &address, 8);
  std::memcpy(handle.data() + 8, &bytes, 8);
  absl::StatusOr<uint64_t> r = s_.client->RegisterCudaIpcMemory(handle, bytes, 0, "short");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("inputs_event"), std::string::npos) << r.status();
  r = s_.client->RegisterCudaIpcMemory(handle, bytes, 0, "", std::string(64, '\0'));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("answer_event"), std::string::npos) << r.status();
  EXPECT_EQ(open_.load(), open_before);
  EXPECT_EQ(log_.events.load(), 2);
  v1::DecodeStepRequest retry = plain;
  retry.set_step_id(step_id++);
  StepAndCompare(s_, oracle, retry, "after the rejected event steps");

  ASSERT_TRUE(s_.client->UnregisterCudaIpcMemory(bare).ok());
  ASSERT_TRUE(s_.client->UnregisterCudaIpcMemory(region).ok());
  EXPECT_EQ(log_.events.load(), 0);  // closed with the region
  EXPECT_EQ(open_.load(), 0);
}

// ---- New keys from the device buffer (cuda_ipc.new_keys_offset) ----------------------------

// `ids` and their twins get the same prefill (every cache-owning layer, keys of every form);
// the oracle follows `ids`. A twin then answers bit for bit what its original answers to the
// same step, whichever way the step's tensors travel.
void PrefillTwins(Session& s, ServiceOracle& oracle, Gen& gen, const std::vector<uint64_t>& ids,
                  const std::vector<uint64_t>& twins, const std::vector<int64_t>& lengths) {
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(s.client->CreateSequence(ids[i]).ok());
    ASSERT_TRUE(s.client->CreateSequence(twins[i]).ok());
    oracle.Create(ids[i]);
  }
  int form = 0;
  for (const config::LayerSpec& spec : s.profile.layers) {
    if (spec.role == config::LayerRole::kCandidateConsumer) continue;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto [k, ks] = gen.Keys(static_cast<KeyForm>(form++ % 3), static_cast<int>(lengths[i]),
                              spec.cache_format, s.profile.head_dim);
      ASSERT_TRUE(s.client->AppendKeys(ids[i], spec.layer, k, ks).ok());
      ASSERT_TRUE(s.client->AppendKeys(twins[i], spec.layer, k, ks).ok());
      ASSERT_TRUE(oracle.Append(ids[i], spec.layer, k, ks).ok());
    }
  }
}

// A columnar step for `ids` (the `sequences` form's `plain` with its ids replaced).
v1::DecodeStepRequest ColumnarFor(const v1::DecodeStepRequest& plain,
                                  const std::vector<uint64_t>& ids) {
  v1::DecodeStepRequest out = ToColumnar(plain);
  for (size_t i = 0; i < ids.size(); ++i) out.set_sequence_ids(int(i), ids[i]);
  return out;
}

uint64_t Align16(uint64_t v) { return (v + 15) / 16 * 16; }

// Moves a columnar step's new_keys (and new_key_scales) into `device` at 16-byte aligned
// offsets from `at` and points cuda_ipc at them (the Tensors keep dtype and shape only);
// answers the first free offset after them.
uint64_t MoveKeysToDevice(v1::DecodeStepRequest& req, std::vector<int32_t>& device, uint64_t region,
                          uint64_t at) {
  auto* base = reinterpret_cast<uint8_t*>(device.data());
  v1::CudaIpcStep* ci = req.mutable_cuda_ipc();
  ci->set_region_id(region);
  auto put = [&](v1::Tensor* t) {
    const uint64_t offset = Align16(at);
    std::memcpy(base + offset, t->data().data(), t->data().size());
    at = offset + t->data().size();
    t->clear_data();
    return offset;
  };
  ci->set_new_keys_offset(put(req.mutable_new_keys()));
  if (req.new_key_scales().dtype() != v1::DTYPE_UNSPECIFIED) {
    ci->set_new_key_scales_offset(put(req.mutable_new_key_scales()));
  }
  return Align16(at);
}

// Points the answer (and candidate blocks) of `req` into the buffer at `at`.
void AnswerToDevice(v1::DecodeStepRequest& req, uint64_t region, uint64_t at, int64_t rows,
                    const config::Profile& p) {
  v1::CudaIpcStep* ci = req.mutable_cuda_ipc();
  ci->set_region_id(region);
  ci->set_answer_offset(Align16(at));
  ci->set_candidates_offset(Align16(at + uint64_t(rows) * p.topk * 4));
}

// The ring descriptor of device step `dev` (its inline twin `inline_req` staged into the
// ring's region for what is not on the device): the CUDA IPC flags and offsets of `dev`.
absl::StatusOr<client::StagedStep> RingStepFor(client::FastPathRing& ring,
                                               const v1::DecodeStepRequest& inline_req,
                                               const v1::DecodeStepRequest& dev,
                                               const config::Profile& p, bool wait_inputs) {
  absl::StatusOr<client::StagedStep> staged =
      client::StageRequest(inline_req, std::span<uint8_t>(ring.region(), ring.region_bytes()),
                           ring.data_offset(), p.topk, p.num_candidate_blocks);
  if (!staged.ok()) return staged.status();
  ring::StepDescriptor& d = staged->step.descriptor;
  const v1::CudaIpcStep& ci = dev.cuda_ipc();
  d.flags |= ring::kAnswerCudaIpc;
  d.cuda_ipc_region_id = ci.region_id();
  d.answer_offset = ci.answer_offset();
  d.candidates_offset = ci.candidates_offset();
  if (ci.has_new_keys_offset()) {
    d.flags |= ring::kKeysCudaIpc;
    d.new_keys_offset = ci.new_keys_offset();
    d.new_key_scales_offset = ci.new_key_scales_offset();
  }
  if (ci.has_q_offset()) {
    d.flags |= ring::kInputsCudaIpc;
    d.q_offset = ci.q_offset();
    d.q_scales_offset = ci.q_scales_offset();
    d.weights_offset = ci.weights_offset();
  }
  if (wait_inputs) d.flags |= ring::kWaitInputsEvent;
  return staged;
}

// The new keys read from the client's device buffer (cuda_ipc.new_keys_offset; the ring's
// kKeysCudaIpc): every step, over unary, a stream and the step ring in turn, with q inline or
// on the device as well, at every layer of the tiny v41 profile (FP8 keys and fp32 scales at
// layer 0, FP4 keys and UE8M0 scales at layers 1 and 2, consumers after their source), answers
// bit for bit what its twin sequences answer to the same step with everything inline (which
// the oracle checks): the same top-k, candidate blocks and lengths. Every rank reads the keys
// and their scales with one device-to-device copy each, exactly their bytes, after waiting on
// the inputs event where the step asks for it.
TEST_P(CudaIpcPlumbingTest, KeysFromTheRegisteredBufferAnswerAsInline) {
  Gen gen(Seed());
  ServiceOracle oracle(profile_, 64, Seed());
  const std::vector<uint64_t> ids = {5, 6, 7, 8}, twins = {105, 106, 107, 108};
  const std::vector<int64_t> lengths = {20 + int64_t(gen.rng()() % 30), 33, 51, 12};
  PrefillTwins(s_, oracle, gen, ids, twins, lengths);
  std::vector<int32_t> device(1 << 18, 0x5A5A5A5A);
  const uint64_t region = Register(device, nullptr, /*inputs_event=*/7, /*answer_event=*/0);
  ASSERT_NE(region, 0u);
  client::FastPathOptions fo;
  fo.socket_path = socket_path_;
  fo.data_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring =
      client::FastPathRing::Create(*s_.client, fo);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = s_.client->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  const uintptr_t base = reinterpret_cast<uintptr_t>(device.data());
  const int ranks = GetParam();

  uint64_t step_id = 1;
  int transport = 0;  // 0 unary, 1 stream, 2 ring
  int pass = 0;
  for (const bool q_on_device : {false, true, false}) {
    const QForm form = q_on_device || pass == 2 ? QForm::kQuantized : QForm::kF32Rope;
    const int next_n = 1 + pass++ % 2;
    for (int layer = 0; layer < int(profile_.layers.size()); ++layer) {
      const bool owns = profile_.layers[layer].role != config::LayerRole::kCandidateConsumer;
      const std::string what =
          absl::StrCat("layer ", layer, " q on device ", q_on_device, " transport ", transport % 3);
      SCOPED_TRACE(what);
      const v1::DecodeStepRequest plain = MakeStep(gen, profile_, layer, ids, lengths, next_n, form,
                                                   KeyForm::kQuantized, step_id++);
      absl::StatusOr<OracleAnswer> want = oracle.Step(plain);
      ASSERT_TRUE(want.ok()) << want.status();
      // The originals, everything inline.
      absl::StatusOr<client::StepAnswer> inline_answer =
          s_.client->DecodeStep(ColumnarFor(plain, ids));
      ASSERT_TRUE(inline_answer.ok()) << inline_answer.status();
      EXPECT_TRUE(want->Matches(inline_answer->topk, plain.return_candidates()
                                                         ? inline_answer->candidates
                                                         : std::vector<int32_t>{}));
      if (plain.return_candidates()) oracle.AdoptCandidates(plain, inline_answer->candidates);
      EXPECT_EQ(inline_answer->lengths, want->lengths);

      // The twins: keys (and q) from the device buffer, the answer into it.
      const v1::DecodeStepRequest twin_inline = ColumnarFor(plain, twins);
      v1::DecodeStepRequest dev = twin_inline;
      const uint64_t keys_at = 16 * (gen.rng()() % 64);
      uint64_t at = owns ? MoveKeysToDevice(dev, device, region, keys_at) : keys_at;
      if (q_on_device) {
        MoveQToDevice(dev, device, region, at);
      } else {
        AnswerToDevice(dev, region, at, plain.q().shape(0), profile_);
      }
      // Without q on the device the inputs event orders the keys alone.
      const bool wait = owns && !q_on_device && layer % 2 == 0;
      dev.mutable_cuda_ipc()->set_wait_inputs_event(wait);
      std::fill(device.begin() + dev.cuda_ipc().answer_offset() / 4, device.end(), 0x5A5A5A5A);
      log_.Take();
      log_.TakeReads();
      std::vector<int64_t> got_lengths;
      switch (transport++ % 3) {
        case 0: {
          absl::StatusOr<client::StepAnswer> got = s_.client->DecodeStep(dev);
          ASSERT_TRUE(got.ok()) << got.status();
          got_lengths = got->lengths;
          break;
        }
        case 1: {
          absl::StatusOr<client::StepAnswer> got = (*stream)->Step(dev);
          ASSERT_TRUE(got.ok()) << got.status();
          got_lengths = got->lengths;
          break;
        }
        default: {
          absl::StatusOr<client::StagedStep> st =
              RingStepFor(**ring, twin_inline, dev, profile_, wait);
          ASSERT_TRUE(st.ok()) << st.status();
          absl::StatusOr<client::RingCompletion> done = (*ring)->Step(st->step);
          ASSERT_TRUE(done.ok()) << done.status();
          ASSERT_TRUE(done->status.ok()) << done->status;
          got_lengths = done->lengths;
          break;
        }
      }
      EXPECT_EQ(got_lengths, inline_answer->lengths);
      const int32_t* a = device.data() + dev.cuda_ipc().answer_offset() / 4;
      EXPECT_EQ(std::vector<int32_t>(a, a + inline_answer->topk.size()), inline_answer->topk);
      if (plain.return_candidates()) {
        const int32_t* c = device.data() + dev.cuda_ipc().candidates_offset() / 4;
        EXPECT_EQ(std::vector<int32_t>(c, c + inline_answer->candidates.size()),
                  inline_answer->candidates);
      }
      // What each rank read of the buffer: the keys and their scales, one copy each, exactly
      // their bytes; the inputs event waited on first where asked.
      const std::vector<FakeIpcLog::Read> reads = log_.TakeReads();
      const std::vector<std::pair<int, std::string>> entries = log_.Take();
      if (!owns) continue;
      const uint64_t kb = uint64_t(plain.sequences(0).new_keys().data().size()) * ids.size();
      const uint64_t sb = uint64_t(plain.sequences(0).new_key_scales().data().size()) * ids.size();
      for (int r = 0; r < ranks; ++r) {
        int key_reads = 0, scale_reads = 0;
        for (const FakeIpcLog::Read& read : reads) {
          if (read.rank != r) continue;
          const uint64_t off = read.at - base;
          if (off >= dev.cuda_ipc().new_keys_offset() &&
              off < dev.cuda_ipc().new_keys_offset() + kb) {
            ++key_reads;
            EXPECT_EQ(off, dev.cuda_ipc().new_keys_offset()) << "rank " << r;
            EXPECT_EQ(read.bytes, kb) << "rank " << r;
          } else if (off >= dev.cuda_ipc().new_key_scales_offset() &&
                     off < dev.cuda_ipc().new_key_scales_offset() + sb) {
            ++scale_reads;
            EXPECT_EQ(off, dev.cuda_ipc().new_key_scales_offset()) << "rank " << r;
            EXPECT_EQ(read.bytes, sb) << "rank " << r;
          }
        }
        EXPECT_EQ(key_reads, 1) << "rank " << r;
        EXPECT_EQ(scale_reads, 1) << "rank " << r;
        int waits = 0, before_wait = 0;
        for (const auto& [rank, entry] : entries) {
          if (rank != r) continue;
          if (entry == "wait:7") ++waits;
          if (entry == "read" && waits == 0) ++before_wait;
        }
        EXPECT_EQ(waits, wait ? 1 : 0) << "rank " << r;
        if (wait) {
          EXPECT_EQ(before_wait, 0) << "rank " << r << " read before the inputs event";
        }
      }
    }
  }
  ASSERT_TRUE((*stream)->Finish().ok());
  ASSERT_TRUE((*ring)->Unregister().ok());
  ASSERT_TRUE(s_.client->UnregisterCudaIpcMemory(region).ok());
}

// Every sequence's caches (length, pages, shared pages) and candidates, and the pages in use.
std::string StateOf(Session& s, const std::vector<uint64_t>& ids) {
  std::string out;
  for (uint64_t id : ids) {
    absl::StatusOr<v1::GetSequenceResponse> got = s.client->GetSequence(id);
    EXPECT_TRUE(got.ok()) << got.status();
    if (got.ok()) absl::StrAppend(&out, id, ": ", got->ShortDebugString(), "\n");
  }
  absl::StatusOr<v1::Statistics> stats = s.client->GetStatistics();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (stats.ok()) absl::StrAppend(&out, "pages in use ", stats->pages_in_use());
  return out;
}

// Bad new keys from the device buffer, each named as the host edge names the field and
// changing nothing (every sequence's caches and the pages in use as before; a later valid step
// answers as the oracle, and as the twins that never saw the bad step, bit for bit): before
// anything runs, a misaligned or out-of-region offset, a dtype the device path or the cache
// does not take, a wrong shape, host bytes beside the offset, a missing or lone scales
// offset, the `sequences` form, keys from two places, and the same through the ring; after the
// step ran on the device, an FP8 NaN code, a NaN / Inf / negative / zero / -0 fp32 scale, a
// 0xFF UE8M0 scale (FP4 dense and source layers), also where the keys roll a forked sequence
// back into its shared page (the copy-on-write page and the rewritten page are released).
TEST_P(CudaIpcPlumbingTest, BadDeviceKeysAreNamedAndChangeNothing) {
  Gen gen(Seed());
  ServiceOracle oracle(profile_, 64, Seed());
  const std::vector<uint64_t> ids = {5, 6, 7, 8}, twins = {105, 106, 107, 108};
  const std::vector<int64_t> lengths = {20 + int64_t(gen.rng()() % 30), 33, 51, 12};
  PrefillTwins(s_, oracle, gen, ids, twins, lengths);
  std::vector<uint64_t> all = ids;
  all.insert(all.end(), twins.begin(), twins.end());
  std::vector<int32_t> device(1 << 18, 0x5A5A5A5A);
  const uint64_t region = Register(device);
  ASSERT_NE(region, 0u);
  uint64_t step_id = 1;
  // A valid step for `ids` at `layer` (the oracle's and the twins' too: both must still answer
  // alike, so nothing of a refused step stayed).
  auto valid_step = [&](int layer, const std::string& what) {
    const v1::DecodeStepRequest plain = MakeStep(gen, profile_, layer, ids, lengths, 1,
                                                 QForm::kQuantized, KeyForm::kQuantized, step_id++);
    const client::StepAnswer a = StepAndCompare(s_, oracle, plain, what);
    v1::DecodeStepRequest dev = ColumnarFor(plain, twins);
    const bool owns = profile_.layers[layer].role != config::LayerRole::kCandidateConsumer;
    const uint64_t at = owns ? MoveKeysToDevice(dev, device, region, 0) : 0;
    AnswerToDevice(dev, region, at, plain.q().shape(0), profile_);
    absl::StatusOr<client::StepAnswer> b = s_.client->DecodeStep(dev);
    ASSERT_TRUE(b.ok()) << what << ": " << b.status();
    EXPECT_EQ(b->lengths, a.lengths) << what;
    const int32_t* t = device.data() + dev.cuda_ipc().answer_offset() / 4;
    EXPECT_EQ(std::vector<int32_t>(t, t + a.topk.size()), a.topk) << what;
  };
  // A step at `layer` with the keys (FP8 or FP4, the layer's format) on the device.
  auto device_step = [&](int layer, const std::vector<uint64_t>& seqs, uint64_t at) {
    v1::DecodeStepRequest plain = MakeStep(gen, profile_, layer, seqs, lengths, 1,
                                           QForm::kQuantized, KeyForm::kQuantized, step_id++);
    v1::DecodeStepRequest dev = ColumnarFor(plain, seqs);
    at = MoveKeysToDevice(dev, device, region, at);
    AnswerToDevice(dev, region, at, plain.q().shape(0), profile_);
    return dev;
  };
  auto expect_named = [&](const v1::DecodeStepRequest& req, const std::string& field) {
    const std::string before = StateOf(s_, all);
    absl::StatusOr<client::StepAnswer> r = s_.client->DecodeStep(req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << r.status();
    EXPECT_TRUE(absl::StartsWith(r.status().message(), field)) << field << ": " << r.status();
    EXPECT_EQ(StateOf(s_, all), before) << field;
  };

  // Refused before anything runs.
  const v1::DecodeStepRequest good = device_step(0, ids, 64);
  const v1::CudaIpcStep& ci = good.cuda_ipc();
  v1::DecodeStepRequest bad = good;
  bad.mutable_cuda_ipc()->set_new_keys_offset(ci.new_keys_offset() + 4);
  expect_named(bad, "cuda_ipc.new_keys_offset");
  bad = good;
  bad.mutable_cuda_ipc()->set_new_key_scales_offset(ci.new_key_scales_offset() + 8);
  expect_named(bad, "cuda_ipc.new_key_scales_offset");
  bad = good;
  bad.mutable_cuda_ipc()->set_new_keys_offset(device.size() * 4 - 16);
  expect_named(bad, "cuda_ipc.new_keys_offset");
  bad = good;
  bad.mutable_cuda_ipc()->set_new_key_scales_offset(device.size() * 4);
  expect_named(bad, "cuda_ipc.new_key_scales_offset");
  bad = good;
  bad.mutable_new_keys()->set_dtype(v1::DTYPE_FP32);  // unquantized: not from device memory
  expect_named(bad, "new_keys.dtype");
  bad = good;
  bad.mutable_new_keys()->set_dtype(v1::DTYPE_BF16);
  expect_named(bad, "new_keys.dtype");
  bad = good;
  bad.mutable_new_key_scales()->set_dtype(v1::DTYPE_UE8M0);
  expect_named(bad, "new_key_scales.dtype");
  bad = good;
  bad.mutable_new_keys()->set_shape(0, good.new_keys().shape(0) + 1);
  expect_named(bad, "new_keys.shape");
  bad = good;
  bad.mutable_new_keys()->set_shape(1, profile_.head_dim / 2);
  expect_named(bad, "new_keys.shape");
  bad = good;
  bad.mutable_new_key_scales()->set_shape(0, good.new_key_scales().shape(0) - 1);
  expect_named(bad, "new_key_scales.shape");
  bad = good;
  bad.mutable_new_keys()->set_data(std::string(good.new_keys().shape(0) * profile_.head_dim, 1));
  expect_named(bad, "new_keys.data");
  bad = good;
  bad.mutable_new_key_scales()->set_data(std::string(good.new_key_scales().shape(0) * 4, 0));
  expect_named(bad, "new_key_scales.data");
  bad = good;
  bad.mutable_cuda_ipc()->clear_new_key_scales_offset();
  expect_named(bad, "cuda_ipc.new_key_scales_offset");
  bad = good;
  bad.mutable_cuda_ipc()->clear_new_keys_offset();
  expect_named(bad, "cuda_ipc.new_keys_offset");
  bad = good;
  bad.clear_new_key_scales();
  expect_named(bad, "new_key_scales.dtype");
  bad = good;
  bad.mutable_shared_memory()->set_region_id(1);
  bad.mutable_shared_memory()->set_new_keys_offset(0);
  expect_named(bad, "shared_memory.new_keys_offset");
  bad = good;  // FP8 keys at the FP4 layer 1
  bad.set_layer(1);
  {
    const v1::DecodeStepRequest fp4 = device_step(1, ids, 1 << 16);
    *bad.mutable_q() = fp4.q();
    *bad.mutable_q_scales() = fp4.q_scales();
    *bad.mutable_weights() = fp4.weights();
  }
  expect_named(bad, "new_keys.dtype");
  bad = MakeStep(gen, profile_, 0, ids, lengths, 1, QForm::kQuantized, KeyForm::kQuantized,
                 step_id++);  // the `sequences` form
  bad.mutable_cuda_ipc()->set_region_id(region);
  bad.mutable_cuda_ipc()->set_new_keys_offset(0);
  expect_named(bad, "cuda_ipc.new_keys_offset");
  bad = good;  // the buffer has no inputs event
  bad.mutable_cuda_ipc()->set_wait_inputs_event(true);
  expect_named(bad, "cuda_ipc.wait_inputs_event");
  valid_step(0, "after the refused device-key steps");

  // The ring: the same field-naming errors in the completion, nothing changed.
  client::FastPathOptions fo;
  fo.socket_path = socket_path_;
  fo.data_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring =
      client::FastPathRing::Create(*s_.client, fo);
  ASSERT_TRUE(ring.ok()) << ring.status();
  {
    v1::DecodeStepRequest inline_req = good;
    inline_req.clear_cuda_ipc();
    struct RingCase {
      std::string field;
      std::function<void(ring::StepDescriptor&)> spoil;
    };
    const std::vector<RingCase> cases = {
        {"flags", [](ring::StepDescriptor& d) { d.flags &= ~uint32_t{ring::kAnswerCudaIpc}; }},
        {"cuda_ipc.new_keys_offset", [](ring::StepDescriptor& d) { d.new_keys_offset += 4; }},
        {"cuda_ipc.new_key_scales_offset",
         [&](ring::StepDescriptor& d) { d.new_key_scales_offset = device.size() * 4; }},
        {"new_keys.dtype", [](ring::StepDescriptor& d) { d.new_keys_dtype = v1::DTYPE_FP32; }},
        {"new_keys.dtype", [](ring::StepDescriptor& d) { d.new_keys_dtype = 0; }},
        {"cuda_ipc.wait_inputs_event",
         [](ring::StepDescriptor& d) { d.flags |= ring::kWaitInputsEvent; }},
    };
    for (const RingCase& c : cases) {
      absl::StatusOr<client::StagedStep> st =
          RingStepFor(**ring, inline_req, good, profile_, false);
      ASSERT_TRUE(st.ok()) << st.status();
      c.spoil(st->step.descriptor);
      const std::string before = StateOf(s_, all);
      absl::StatusOr<client::RingCompletion> done = (*ring)->Step(st->step);
      ASSERT_TRUE(done.ok()) << done.status();
      EXPECT_EQ(done->status.code(), absl::StatusCode::kInvalidArgument) << c.field;
      EXPECT_TRUE(absl::StartsWith(done->status.message(), c.field))
          << c.field << ": " << done->status;
      EXPECT_EQ(StateOf(s_, all), before) << c.field;
    }
    // And a valid ring step still answers as the inline step does.
    absl::StatusOr<client::StagedStep> st = RingStepFor(**ring, inline_req, good, profile_, false);
    ASSERT_TRUE(st.ok()) << st.status();
    st->step.descriptor.flags &= ~uint32_t{ring::kKeysCudaIpc};  // the keys in the region
    st->step.descriptor.new_keys_offset = 0;                     // inside the ring: named
    absl::StatusOr<client::RingCompletion> done = (*ring)->Step(st->step);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_TRUE(absl::StartsWith(done->status.message(), "shared_memory.new_keys_offset"))
        << done->status;
  }
  ASSERT_TRUE((*ring)->Unregister().ok());
  valid_step(0, "after the refused ring descriptors");

  // Found on the device after the step ran: nothing committed.
  struct Poison {
    int layer;
    bool scales;
    uint32_t bits;  // an FP8 / UE8M0 code byte, or fp32 scale bits
  };
  const std::vector<Poison> poisons = {{0, false, 0x7F},       {0, false, 0xFF},
                                       {0, true, 0x7FC00000u}, {0, true, 0x7F800000u},
                                       {0, true, 0xFF800000u}, {0, true, 0xBF800000u},
                                       {0, true, 0x00000000u}, {0, true, 0x80000000u},
                                       {1, true, 0xFF},        {2, true, 0xFF}};
  for (const Poison& p : poisons) {
    const bool fp8 = profile_.layers[p.layer].cache_format == kernels::CacheFormat::kFp8;
    const std::string field = p.scales ? "new_key_scales.data" : "new_keys.data";
    const std::string what = absl::StrCat(field, " layer ", p.layer, " bits 0x", absl::Hex(p.bits));
    SCOPED_TRACE(what);
    bad = device_step(p.layer, ids, 64);
    auto* bytes = reinterpret_cast<uint8_t*>(device.data());
    const uint64_t off =
        p.scales ? bad.cuda_ipc().new_key_scales_offset() : bad.cuda_ipc().new_keys_offset();
    const uint64_t n = p.scales ? (fp8 ? bad.new_key_scales().shape(0)
                                       : bad.new_key_scales().shape(0) * profile_.head_dim / 32)
                                : bad.new_keys().shape(0) * profile_.head_dim;
    const uint64_t elem = gen.rng()() % n;
    if (p.scales && fp8) {
      std::memcpy(bytes + off + 4 * elem, &p.bits, 4);
    } else {
      bytes[off + elem] = uint8_t(p.bits);
    }
    const std::string before = StateOf(s_, all);
    absl::StatusOr<client::StepAnswer> r = s_.client->DecodeStep(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    // A rank's error ("rank 0: new_keys.data: ..."), as for q checked on the device.
    EXPECT_NE(r.status().message().find(field + ": "), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("committed nothing"), std::string::npos) << r.status();
    EXPECT_EQ(StateOf(s_, all), before);
    valid_step(p.layer, "after " + what);
    if (p.layer == 2) valid_step(3, "a consumer after " + what);  // the source's candidates
  }

  // A fork sharing its parent's pages, its keys rolled back into the shared last page (a
  // copy-on-write page and the pages after it written, then released), a bad scale found on
  // the device: the fork, its parent and the pages in use are as before; the fork then answers
  // bit for bit as a fork of the twin that never saw the bad step.
  ASSERT_TRUE(s_.client->ForkSequence(ids[2], 50, lengths[2]).ok());
  ASSERT_TRUE(s_.client->ForkSequence(twins[2], 150, lengths[2]).ok());
  all.push_back(50);
  all.push_back(150);
  for (const int layer : {0, 1}) {
    const bool fp8 = profile_.layers[layer].cache_format == kernels::CacheFormat::kFp8;
    bad = device_step(layer, {50}, 64);
    bad.add_new_keys_positions(lengths[2] - 1);
    auto* bytes = reinterpret_cast<uint8_t*>(device.data());
    const uint32_t nan = fp8 ? 0x7FC00000u : 0xFFu;
    std::memcpy(bytes + bad.cuda_ipc().new_key_scales_offset(), &nan, fp8 ? 4 : 1);
    const std::string before = StateOf(s_, all);
    absl::StatusOr<client::StepAnswer> r = s_.client->DecodeStep(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("new_key_scales.data: "), std::string::npos) << r.status();
    EXPECT_EQ(StateOf(s_, all), before) << "layer " << layer;
    // The same rollback, valid, on the fork and on the twin's fork: the same answers.
    std::memcpy(bytes + bad.cuda_ipc().new_key_scales_offset(),
                fp8 ? static_cast<const void*>("\0\0\x80\x3F") : "\x7F", fp8 ? 4 : 1);
    absl::StatusOr<client::StepAnswer> a = s_.client->DecodeStep(bad);
    ASSERT_TRUE(a.ok()) << a.status();
    const int32_t* t = device.data() + bad.cuda_ipc().answer_offset() / 4;
    const std::vector<int32_t> fork_answer(t, t + a->rows * a->k);
    v1::DecodeStepRequest twin = bad;
    twin.set_sequence_ids(0, 150);
    absl::StatusOr<client::StepAnswer> b = s_.client->DecodeStep(twin);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(std::vector<int32_t>(t, t + b->rows * b->k), fork_answer) << "layer " << layer;
    EXPECT_EQ(a->lengths, b->lengths);
    EXPECT_EQ(a->lengths[0], lengths[2]);
  }
  ASSERT_TRUE(s_.client->UnregisterCudaIpcMemory(region).ok());
}

}  // namespace
}  // namespace decode_indexer::testing
