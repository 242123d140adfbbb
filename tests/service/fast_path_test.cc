// The same-host fast path (a step ring in a registered memfd, common/step_ring.h) through a
// real in-process server on the CPU backend:
//  - two servers given the same prefill and the same random steps, one over gRPC (the
//    columnar form) and one through a step ring, answer bit for bit alike (topk, candidate
//    blocks, lengths), v32 and the tiny v41 profile, next_n 1 and 2, sharded over 2 ranks;
//  - every kind of bad descriptor gets a completion with the error naming its field, changes
//    no length, and the ring and the server keep serving;
//  - a worker process killed with a step taken and another half-written leaves exactly the
//    taken step committed, the ring and its region released, and the server serving.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/fast_path.h"
#include "common/step_ring.h"
#include "server/service/indexer_service.h"
#include "tests/service/columnar.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

std::string SocketPath(const char* tag) {
  return absl::StrCat("/tmp/di-fp-", tag, "-", getpid(), "-", TestSeed() % 1000000, ".sock");
}

std::unique_ptr<Session> StartWithSocket(const config::Profile& p, int ranks, const char* tag,
                                         int64_t pages = 320) {
  return StartSession(p, CpuOptions(ranks, pages),
                      [tag](service::ServerOptions& o) { o.shm_socket = SocketPath(tag); });
}

// Every cache-owning layer of `layers` gets the same keys on each server.
void PrefillAll(const std::vector<Session*>& servers, Gen& gen, const std::vector<uint64_t>& ids,
                const std::vector<int64_t>& lengths, const std::vector<int>& layers) {
  const config::Profile& p = servers[0]->profile;
  for (uint64_t id : ids) {
    for (Session* s : servers) ASSERT_TRUE(s->client->CreateSequence(id).ok());
  }
  int form = 0;
  for (int layer : layers) {
    const config::LayerSpec& spec = p.layers.at(layer);
    if (spec.role == config::LayerRole::kCandidateConsumer || spec.cache_layer != spec.layer) {
      continue;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      auto [k, ks] = gen.Keys(static_cast<KeyForm>(form++ % 3), static_cast<int>(lengths[i]),
                              spec.cache_format, p.head_dim);
      for (Session* s : servers) {
        absl::StatusOr<int64_t> got = s->client->AppendKeys(ids[i], spec.layer, k, ks);
        ASSERT_TRUE(got.ok()) << got.status();
      }
    }
  }
}

std::vector<int64_t> Lengths(Session& s, const std::vector<uint64_t>& ids) {
  std::vector<int64_t> out;
  for (uint64_t id : ids) {
    absl::StatusOr<v1::GetSequenceResponse> got = s.client->GetSequence(id);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) continue;
    for (const v1::SequenceCacheLength& c : got->caches()) out.push_back(c.length());
  }
  return out;
}

struct Shape {
  const char* profile;  // "v32" or "v41-tiny"
  int ranks;
  int requests;
  int next_n;
};

class FastPathTest : public ::testing::TestWithParam<Shape> {};

TEST_P(FastPathTest, AnswersAsGrpcBitForBit) {
  const Shape shape = GetParam();
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  const bool v32 = std::string(shape.profile) == "v32";
  const config::Profile p = LoadOrDie(v32 ? std::string("v32") : TinyProfilePath());
  // Room for the longest draws of RandomSequences (a fixed 320 pages is short for some seeds).
  const int64_t pages = RandomSequencesPages(p, shape.requests, 3, shape.next_n);
  std::unique_ptr<Session> grpc = StartSession(p, CpuOptions(shape.ranks, pages));
  std::unique_ptr<Session> fast = StartWithSocket(p, shape.ranks, "eq", pages);
  ASSERT_NE(grpc, nullptr);
  ASSERT_NE(fast, nullptr);
  Gen gen(TestSeed());
  auto& rng = gen.rng();
  std::vector<uint64_t> ids;
  std::vector<int64_t> lengths;
  RandomSequences(gen, p, shape.requests, 5000, ids, lengths);
  const std::vector<int> layers = ComparedLayers(p);
  PrefillAll({grpc.get(), fast.get()}, gen, ids, lengths, layers);
  client::FastPathOptions fo;
  fo.data_bytes = 8 << 20;
  absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring =
      client::FastPathRing::Create(*fast->client, fo);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_GE((*ring)->max_sequences(), 1u);

  uint64_t step_id = 1;
  int compared = 0, sharded = 0;
  for (int round = 0; round < 3; ++round) {
    for (int layer : layers) {
      const QForm qf = static_cast<QForm>(rng() % 4);
      const KeyForm kf = static_cast<KeyForm>(rng() % 3);
      ColumnarOptions o;
      o.uniform_rows = rng() % 2;
      o.explicit_counts = rng() % 3 == 0;
      o.explicit_positions = rng() % 3 == 0;
      const v1::DecodeStepRequest req =
          ToColumnar(MakeStep(gen, p, layer, ids, lengths, shape.next_n, qf, kf, step_id++), o);
      const std::string what =
          absl::StrCat("round ", round, " layer ", layer, " q ", Name(qf), " keys ", int(kf));
      absl::StatusOr<client::StepAnswer> a = grpc->client->DecodeStep(req);
      ASSERT_TRUE(a.ok()) << what << ": " << a.status();
      absl::StatusOr<v1::DecodeStepResponse> b = (*ring)->StepRequest(req);
      ASSERT_TRUE(b.ok()) << what << ": " << b.status();
      absl::StatusOr<client::StepAnswer> bb = client::ParseStepResponse(*b);
      ASSERT_TRUE(bb.ok()) << what << ": " << bb.status();
      EXPECT_EQ(a->step_id, bb->step_id) << what;
      EXPECT_EQ(a->rows, bb->rows) << what;
      EXPECT_EQ(a->topk, bb->topk) << what << ": topk differs";
      EXPECT_EQ(a->candidates, bb->candidates) << what << ": candidate blocks differ";
      EXPECT_EQ(a->lengths, bb->lengths) << what << ": lengths differ";
      EXPECT_EQ(a->sharded, bb->sharded) << what;
      sharded += bb->sharded;
      ++compared;
      if (p.layers.at(layer).cache_layer == layers.front()) {
        for (size_t i = 0; i < ids.size(); ++i) lengths[i] = a->lengths[i];
      }
    }
  }
  EXPECT_GT(compared, 0);
  if (shape.ranks > 1) {
    EXPECT_GT(sharded, 0) << "no step was row-sharded";
  }
  EXPECT_EQ(Lengths(*grpc, ids), Lengths(*fast, ids));
  // The steps counted under their path.
  absl::StatusOr<v1::Statistics> stats = fast->client->GetStatistics();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->step_rings(), 1);
  for (const v1::RpcStatistics& r : stats->rpcs()) {
    if (r.method() == "RingStep") {
      EXPECT_EQ(r.count(), uint64_t(compared));
    } else if (r.method() == "DecodeStep") {
      EXPECT_EQ(r.count(), 0u);
    }
  }
  ASSERT_TRUE((*ring)->Unregister().ok());
  stats = fast->client->GetStatistics();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->step_rings(), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, FastPathTest,
                         ::testing::Values(Shape{"v32", 1, 3, 1}, Shape{"v32", 2, 4, 2},
                                           Shape{"v41-tiny", 1, 4, 1}, Shape{"v41-tiny", 2, 4, 2}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return absl::StrCat(info.param.profile[1] == '3' ? "v32" : "v41tiny",
                                               "_ranks", info.param.ranks, "_next",
                                               info.param.next_n);
                         });

// A good step at layer 0 (a dense FP8 layer owning its cache in both profiles), staged into
// the ring's data area: the base the bad descriptors are made from.
struct Staged {
  v1::DecodeStepRequest request;
  client::StagedStep staged;
};

class FastPathBadDescriptorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_ = LoadOrDie(TinyProfilePath());
    s_ = StartWithSocket(p_, 2, "bad");
    ASSERT_NE(s_, nullptr);
    gen_ = std::make_unique<Gen>(TestSeed());
    lengths_ = {40, 70};
    PrefillAll({s_.get()}, *gen_, ids_, lengths_, {0});
    absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring =
        client::FastPathRing::Create(*s_->client);
    ASSERT_TRUE(ring.ok()) << ring.status();
    ring_ = *std::move(ring);
  }

  std::unique_ptr<Staged> Good(QForm qform = QForm::kQuantized) {
    auto out = std::make_unique<Staged>();
    out->request = ToColumnar(
        MakeStep(*gen_, p_, 0, ids_, lengths_, 1, qform, KeyForm::kQuantized, step_id_++));
    absl::StatusOr<client::StagedStep> staged = client::StageRequest(
        out->request, std::span<uint8_t>(ring_->region(), ring_->region_bytes()),
        ring_->data_offset(), p_.topk, p_.num_candidate_blocks);
    EXPECT_TRUE(staged.ok()) << staged.status();
    if (staged.ok()) out->staged = *staged;
    return out;
  }

  // Runs `step` and expects `code` with a message starting with `field`, nothing changed.
  void ExpectRefused(const client::RingStep& step, const std::string& field,
                     absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
    const std::vector<int64_t> before = Lengths(*s_, ids_);
    absl::StatusOr<client::RingCompletion> done = ring_->Step(step);
    ASSERT_TRUE(done.ok()) << field << ": " << done.status();
    EXPECT_EQ(done->status.code(), code) << field << ": " << done->status;
    EXPECT_TRUE(absl::StartsWith(done->status.message(), field))
        << "expected the error to name " << field << ", got: " << done->status.message();
    EXPECT_TRUE(done->lengths.empty()) << field;
    EXPECT_EQ(Lengths(*s_, ids_), before) << field << " changed a length";
  }
  void ExpectRefusedRaw(const std::vector<uint8_t>& slot, const std::string& field) {
    const std::vector<int64_t> before = Lengths(*s_, ids_);
    absl::StatusOr<uint64_t> n = ring_->SubmitRawForTesting(slot);
    ASSERT_TRUE(n.ok()) << n.status();
    absl::StatusOr<client::RingCompletion> done = ring_->Wait(*n);
    ASSERT_TRUE(done.ok()) << field << ": " << done.status();
    EXPECT_EQ(done->status.code(), absl::StatusCode::kInvalidArgument) << done->status;
    EXPECT_TRUE(absl::StartsWith(done->status.message(), field))
        << "expected the error to name " << field << ", got: " << done->status.message();
    EXPECT_EQ(Lengths(*s_, ids_), before) << field << " changed a length";
  }
  uint64_t NextNumberOf() {
    const auto* h = reinterpret_cast<const ring::RingHeader*>(ring_->region());
    return h->produced.load() + 1;
  }

  config::Profile p_;
  std::unique_ptr<Session> s_;
  std::unique_ptr<Gen> gen_;
  const std::vector<uint64_t> ids_ = {31, 32};
  std::vector<int64_t> lengths_;
  std::unique_ptr<client::FastPathRing> ring_;
  uint64_t step_id_ = 1;
};

TEST_F(FastPathBadDescriptorTest, EachBadFieldIsNamedAndChangesNothing) {
  using Mutate = std::function<void(Staged&, client::RingStep&)>;
  struct Case {
    std::string field;
    Mutate mutate;
    absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  };
  const uint64_t end = ring_->region_bytes();
  const uint64_t unknown_id = 999999;
  const std::vector<uint64_t> twice = {31, 31};
  const std::vector<uint64_t> unknown = {31, unknown_id};
  const std::vector<int32_t> zero_rows = {1, 0};
  const std::vector<int64_t> bad_positions = {-5, -1};
  const std::vector<int32_t> short_lengths = {5};
  const std::vector<Case> cases = {
      {"layer", [](Staged&, client::RingStep& s) { s.descriptor.layer = 99; }},
      {"flags", [](Staged&, client::RingStep& s) { s.descriptor.flags |= 1u << 20; }},
      {"answer_encoding", [](Staged&, client::RingStep& s) { s.descriptor.answer_encoding = 1; }},
      {"shared_memory.q_offset",  // inside the ring
       [](Staged&, client::RingStep& s) { s.descriptor.q_offset = 64; }},
      {"shared_memory.q_offset",
       [end](Staged&, client::RingStep& s) { s.descriptor.q_offset = end - 8; }},
      {"shared_memory.weights_offset",
       [end](Staged&, client::RingStep& s) { s.descriptor.weights_offset = end; }},
      {"shared_memory.new_keys_offset",
       [end](Staged&, client::RingStep& s) { s.descriptor.new_keys_offset = end - 1; }},
      {"shared_memory.new_key_scales_offset",
       [](Staged&, client::RingStep& s) { s.descriptor.new_key_scales_offset = 0; }},
      {"shared_memory.answer_offset",
       [end](Staged&, client::RingStep& s) { s.descriptor.answer_offset = end - 4; }},
      {"shared_memory.answer_offset",
       [](Staged&, client::RingStep& s) { s.descriptor.answer_offset = 8; }},
      {"q.dtype", [](Staged&, client::RingStep& s) { s.descriptor.q_dtype = v1::DTYPE_INT32; }},
      {"q.dtype", [](Staged&, client::RingStep& s) { s.descriptor.q_dtype = 0; }},
      {"weights.dtype",
       [](Staged&, client::RingStep& s) { s.descriptor.weights_dtype = v1::DTYPE_INT64; }},
      {"new_keys.shape", [](Staged&, client::RingStep& s) { s.descriptor.new_keys_rows = 1; }},
      {"new_key_scales.dtype",
       [](Staged&, client::RingStep& s) { s.descriptor.new_key_scales_dtype = v1::DTYPE_UE8M0; }},
      {"q.data",  // a NaN code in q, read in the region
       [this](Staged&, client::RingStep& s) { ring_->region()[s.descriptor.q_offset + 7] = 0x7F; }},
      {"positions",
       [](Staged&, client::RingStep& s) {
         s.descriptor.positions_dtype = v1::DTYPE_INT64;  // with FP8 (rotated) q
         s.descriptor.positions_offset = s.descriptor.answer_offset;
       }},
      {"sequence_ids[1]", [&twice](Staged&, client::RingStep& s) { s.sequence_ids = twice; }},
      {"sequence_ids[1]", [&unknown](Staged&, client::RingStep& s) { s.sequence_ids = unknown; },
       absl::StatusCode::kNotFound},
      {"num_rows[1]", [&zero_rows](Staged&, client::RingStep& s) { s.num_rows = zero_rows; }},
      {"rows_per_sequence",
       [](Staged&, client::RingStep& s) {
         s.num_rows = {};
         s.descriptor.rows_per_sequence = 0;
       }},
      {"new_keys_positions[0]",
       [&bad_positions](Staged&, client::RingStep& s) { s.new_keys_positions = bad_positions; }},
      {"row_lengths",
       [&short_lengths](Staged&, client::RingStep& s) { s.row_lengths = short_lengths; }},
      {"timeout_us", [](Staged&, client::RingStep& s) { s.descriptor.timeout_us = -1; }},
      {"cuda_ipc.region_id",
       [](Staged&, client::RingStep& s) { s.descriptor.flags |= ring::kAnswerCudaIpc; },
       absl::StatusCode::kNotFound},
      // q in a CUDA IPC buffer needs the answer there too; with it, the buffer is looked up.
      {"flags", [](Staged&, client::RingStep& s) { s.descriptor.flags |= ring::kInputsCudaIpc; }},
      {"cuda_ipc.region_id",
       [](Staged&, client::RingStep& s) {
         s.descriptor.flags |= ring::kInputsCudaIpc | ring::kAnswerCudaIpc;
         s.descriptor.q_offset = 0;  // an offset into the device buffer, not the region
       },
       absl::StatusCode::kNotFound},
      // GPU-side ordering needs the inputs / the answer in the CUDA IPC buffer.
      {"flags",
       [](Staged&, client::RingStep& s) {
         s.descriptor.flags |= ring::kWaitInputsEvent | ring::kAnswerCudaIpc;
       }},
      {"flags",
       [](Staged&, client::RingStep& s) { s.descriptor.flags |= ring::kRecordAnswerEvent; }},
      // New keys in a CUDA IPC buffer need the answer there too (not q); with it, their offsets
      // are the buffer's (one inside the ring is no error) and the buffer is looked up.
      {"flags", [](Staged&, client::RingStep& s) { s.descriptor.flags |= ring::kKeysCudaIpc; }},
      {"cuda_ipc.region_id",
       [](Staged&, client::RingStep& s) {
         s.descriptor.flags |= ring::kKeysCudaIpc | ring::kAnswerCudaIpc;
         s.descriptor.new_keys_offset = 0;
         s.descriptor.new_key_scales_offset = 16;
       },
       absl::StatusCode::kNotFound},
      {"flags",  // the first bit past the known ones
       [](Staged&, client::RingStep& s) { s.descriptor.flags |= ring::kKnownFlags + 1; }},
  };
  for (const Case& c : cases) {
    std::unique_ptr<Staged> good = Good();
    client::RingStep step = good->staged.step;
    c.mutate(*good, step);
    ExpectRefused(step, c.field, c.code);
  }

  // What only raw slot bytes can get wrong: the descriptor's number, its counts past the slot.
  std::unique_ptr<Staged> good = Good();
  std::vector<uint8_t> slot(16384);
  ASSERT_TRUE(client::WriteDescriptor(good->staged.step, NextNumberOf() + 5, slot).ok());
  ExpectRefusedRaw(slot, "sequence");
  ASSERT_TRUE(client::WriteDescriptor(good->staged.step, NextNumberOf(), slot).ok());
  reinterpret_cast<ring::StepDescriptor*>(slot.data())->sequence_count = 1u << 30;
  ExpectRefusedRaw(slot, "sequence_count");
  ASSERT_TRUE(client::WriteDescriptor(good->staged.step, NextNumberOf(), slot).ok());
  reinterpret_cast<ring::StepDescriptor*>(slot.data())->row_lengths_count = 4090;
  ExpectRefusedRaw(slot, "row_lengths_count");  // the columns would run past the slot
  ASSERT_TRUE(client::WriteDescriptor(good->staged.step, NextNumberOf(), slot).ok());
  reinterpret_cast<ring::StepDescriptor*>(slot.data())->row_lengths_count = 1u << 30;
  ExpectRefusedRaw(slot, "row_lengths_count");

  // The ring and the server still serve: a good step through each path.
  good = Good();
  absl::StatusOr<client::RingCompletion> done = ring_->Step(good->staged.step);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(done->status.ok()) << done->status;
  ASSERT_EQ(done->lengths.size(), ids_.size());
  EXPECT_EQ(done->lengths[0], lengths_[0] + 1);
  good = Good();
  absl::StatusOr<client::StepAnswer> grpc_step = s_->client->DecodeStep(good->request);
  ASSERT_TRUE(grpc_step.ok()) << grpc_step.status();
  EXPECT_EQ(grpc_step->lengths[0], lengths_[0] + 2);
}

TEST_F(FastPathBadDescriptorTest, RegistrationChecksTheRing) {
  // A region without a ring header, a slot count unlike the header's, a slot too small.
  absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm =
      client::SharedMemory::Create("di-fp-bare", 1 << 20);
  ASSERT_TRUE(shm.ok());
  absl::StatusOr<uint64_t> region = s_->client->RegisterSharedMemory(**shm);
  ASSERT_TRUE(region.ok()) << region.status();
  v1::RegisterStepRingRequest r;
  r.set_region_id(*region);
  r.set_slots(4);
  r.set_slot_bytes(16384);
  absl::StatusOr<v1::RegisterStepRingResponse> got = s_->client->RegisterStepRing(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(got.status().message(), "region_id")) << got.status();
  r.set_slots(0);
  got = s_->client->RegisterStepRing(r);
  EXPECT_TRUE(absl::StartsWith(got.status().message(), "slots")) << got.status();
  r.set_slots(4);
  r.set_slot_bytes(100);
  got = s_->client->RegisterStepRing(r);
  EXPECT_TRUE(absl::StartsWith(got.status().message(), "slot_bytes")) << got.status();
  r.set_region_id(12345);
  got = s_->client->RegisterStepRing(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  // The ring's own region holds one ring only.
  r.set_region_id(ring_->region_id());
  r.set_slots(4);
  r.set_slot_bytes(16384);
  got = s_->client->RegisterStepRing(r);
  EXPECT_TRUE(absl::StartsWith(got.status().message(), "region_id")) << got.status();
  EXPECT_EQ(s_->client->UnregisterStepRing(424242).status().code(), absl::StatusCode::kNotFound);
}

template <typename F>
bool WaitFor(F&& done) {
  for (int i = 0; i < 2000; ++i) {  // up to 20 s: an event, not a timing
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(FastPathWorkerDeathTest, KilledMidStepCommitsExactlyTheTakenStep) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  const config::Profile p = LoadOrDie(TinyProfilePath());
  std::unique_ptr<Session> s = StartWithSocket(p, 1, "kill");
  ASSERT_NE(s, nullptr);
  Gen gen(TestSeed());
  const std::vector<uint64_t> ids = {41, 42};
  std::vector<int64_t> lengths = {50, 33};
  PrefillAll({s.get()}, gen, ids, lengths, {0});
  const std::vector<int64_t> before = Lengths(*s, ids);

  // The worker's ring, laid out here before the fork (the child shares the mapping).
  constexpr uint32_t kSlots = 4, kSlotBytes = 16384;
  const uint64_t ring_bytes = ring::RingBytes(kSlots, kSlotBytes);
  absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm =
      client::SharedMemory::Create("di-fp-worker", ring_bytes + (4 << 20));
  ASSERT_TRUE(shm.ok()) << shm.status();
  uint8_t* base = (*shm)->data();
  auto* h = reinterpret_cast<ring::RingHeader*>(base);
  h->magic = ring::kMagic;
  h->version = ring::kVersion;
  h->slots = kSlots;
  h->slot_bytes = kSlotBytes;
  // Step 1 (published, then the worker dies) and step 2 (written, never published).
  const v1::DecodeStepRequest req =
      ToColumnar(MakeStep(gen, p, 0, ids, lengths, 1, QForm::kQuantized, KeyForm::kQuantized, 7));
  absl::StatusOr<client::StagedStep> staged = client::StageRequest(
      req, std::span<uint8_t>(base, (*shm)->size()), ring_bytes, p.topk, p.num_candidate_blocks);
  ASSERT_TRUE(staged.ok()) << staged.status();
  std::vector<uint8_t> slot1(kSlotBytes), slot2(kSlotBytes);
  ASSERT_TRUE(client::WriteDescriptor(staged->step, 1, slot1).ok());
  ASSERT_TRUE(client::WriteDescriptor(staged->step, 2, slot2).ok());
  const std::string socket_path = SocketPath("kill");

  // Admission held: the poller takes step 1 and waits, so the kill lands mid-step.
  std::unique_lock<std::mutex> admission = s->server->service().HoldStepAdmissionForTesting();
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The worker: registers the memfd (it owns the region), waits for the ring, submits.
    // RegisterMemfd allocates nothing on success (socket_path is built before the fork): the
    // parent's other threads may hold the allocator's locks.
    const absl::StatusOr<uint64_t> got =
        client::RegisterMemfd(socket_path, (*shm)->fd(), (*shm)->size());
    const uint64_t region = got.ok() ? *got : 0;
    if (write(to_parent[1], &region, 8) != 8 || region == 0) _exit(1);
    char go;
    if (read(to_child[0], &go, 1) != 1) _exit(1);
    std::memcpy(base + ring::DescriptorSlot(kSlots, kSlotBytes, 1), slot1.data(), kSlotBytes);
    h->produced.store(1);
    h->doorbell.fetch_add(1);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), 1 /*FUTEX_WAKE*/, 1, nullptr,
            nullptr, 0);
    std::memcpy(base + ring::DescriptorSlot(kSlots, kSlotBytes, 2), slot2.data(), kSlotBytes / 2);
    const char done = 1;
    if (write(to_parent[1], &done, 1) != 1) _exit(1);
    for (;;) pause();
  }
  uint64_t region = 0;
  ASSERT_EQ(read(to_parent[0], &region, 8), 8);
  ASSERT_NE(region, 0u);
  v1::RegisterStepRingRequest r;
  r.set_region_id(region);
  r.set_slots(kSlots);
  r.set_slot_bytes(kSlotBytes);
  absl::StatusOr<v1::RegisterStepRingResponse> ring = s->client->RegisterStepRing(r);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const char go = 1;
  ASSERT_EQ(write(to_child[1], &go, 1), 1);
  char submitted = 0;
  ASSERT_EQ(read(to_parent[0], &submitted, 1), 1);
  // The poller has taken step 1 once it waits for admission.
  EXPECT_TRUE(
      WaitFor([&] { return s->server->service().StepsWaitingForAdmissionForTesting() == 1; }));
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  admission.unlock();

  // The ring is released (and its region): the server saw the worker go.
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::Statistics> st = s->client->GetStatistics();
    return st.ok() && st->step_rings() == 0;
  }));
  EXPECT_EQ(h->server_state.load(), ring::kStateStopped);
  EXPECT_EQ(s->client->UnregisterStepRing(ring->ring_id()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(s->client->UnregisterSharedMemory(region).code(), absl::StatusCode::kNotFound);
  // Exactly the taken step committed, with its completion; the unpublished one never ran.
  EXPECT_EQ(h->completed.load(), 1u);
  const auto* c = reinterpret_cast<const ring::StepCompletion*>(
      base + ring::CompletionSlot(kSlots, kSlotBytes, 1));
  EXPECT_EQ(c->code, 0) << std::string(c->message, c->message_bytes);
  const std::vector<int64_t> after = Lengths(*s, ids);
  ASSERT_EQ(after.size(), before.size());
  const size_t pools = before.size() / ids.size();
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(after[i * pools], before[i * pools] + 1) << "sequence " << ids[i];
    for (size_t j = 1; j < pools; ++j) EXPECT_EQ(after[i * pools + j], before[i * pools + j]);
  }
  // The server keeps serving: gRPC and a new ring of this process.
  lengths = {after[0], after[pools]};
  const v1::DecodeStepRequest next =
      ToColumnar(MakeStep(gen, p, 0, ids, lengths, 1, QForm::kQuantized, KeyForm::kQuantized, 8));
  absl::StatusOr<client::StepAnswer> a = s->client->DecodeStep(next);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::unique_ptr<client::FastPathRing>> again =
      client::FastPathRing::Create(*s->client);
  ASSERT_TRUE(again.ok()) << again.status();
  lengths = {a->lengths[0], a->lengths[1]};
  absl::StatusOr<v1::DecodeStepResponse> b = (*again)->StepRequest(
      ToColumnar(MakeStep(gen, p, 0, ids, lengths, 1, QForm::kQuantized, KeyForm::kQuantized, 9)));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->lengths(0), lengths[0] + 1);
}

// The client owns the slot and may rewrite it while the poller reads it: ReadDescriptor must
// read every field it checks and uses once, from its own copy. A thread rewrites the slot
// without pause (descriptors whose counts alternate between fitting and overrunning the slot,
// random flags and offsets) while descriptor after descriptor is read; every accepted one
// must be self-consistent (its columns as long as the counts that were checked say, its
// offsets past the ring), and under ASan no read may leave the slot (a heap buffer of exactly
// slot_bytes) or the column buffer. A poller that re-read a count from the slot after checking
// it would copy or parse a column of the new count: out of bounds, or a request whose column
// lengths disagree with the descriptor it was checked as. The race is not deterministic: a
// regression guard (a second of reads, millions, against a writer on another core).
TEST(StepRingReadOnceTest, RewritingTheSlotMidReadNeverLeavesItOrMixesDescriptors) {
  const absl::StatusOr<config::Profile> profile = config::BuiltinProfile("v32");
  ASSERT_TRUE(profile.ok()) << profile.status();
  service::StepRingConfig config;
  config.region_id = 0x5eed;
  config.slots = 4;
  config.slot_bytes = 4096;
  const uint64_t ring_bytes = ring::RingBytes(config.slots, config.slot_bytes);
  std::vector<uint8_t> slot(config.slot_bytes, 0);
  std::vector<uint8_t> columns(config.slot_bytes);
  constexpr uint64_t kN = 5;
  std::atomic<bool> stop{false}, started{false};
  std::thread writer([&] {
    std::mt19937_64 rng(TestSeed());
    uint8_t* base = slot.data();
    for (uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      ring::StepDescriptor d{};
      d.sequence = kN;
      d.step_id = i;
      d.layer = 1;
      d.flags =
          static_cast<uint32_t>(rng()) & (ring::kNumRowsColumn | ring::kNewKeyCountsColumn |
                                          ring::kNewKeysPositionsColumn | ring::kReturnCandidates);
      // Fits, then overruns the slot (each alone or with the other count).
      d.sequence_count = i % 2 == 0 ? 1 + rng() % 8 : 100 + rng() % 100000;
      d.row_lengths_count = i % 3 == 0 ? rng() % 16 : static_cast<uint32_t>(rng());
      d.rows_per_sequence = 1;
      d.q_dtype = v1::DTYPE_FP8_E4M3;
      d.weights_dtype = v1::DTYPE_FP32;
      d.q_offset = i % 5 == 0 ? rng() % ring_bytes : ring_bytes + rng() % 4096;
      d.weights_offset = ring_bytes + rng() % 4096;
      d.answer_offset = i % 7 == 0 ? rng() % ring_bytes : ring_bytes + rng() % 4096;
      d.candidates_offset = ring_bytes;
      // Field by field, so that a reader sees every mixture of two descriptors.
      std::memcpy(base + offsetof(ring::StepDescriptor, flags), &d.flags, 4);
      std::memcpy(base + offsetof(ring::StepDescriptor, sequence_count), &d.sequence_count, 4);
      std::memcpy(base + offsetof(ring::StepDescriptor, row_lengths_count), &d.row_lengths_count,
                  4);
      std::memcpy(base, &d, sizeof(d));
      for (size_t at = sizeof(d); at + 8 <= slot.size(); at += 8) {
        const uint64_t v = rng();
        std::memcpy(base + at, &v, 8);
      }
      started.store(true, std::memory_order_release);
    }
  });
  while (!started.load(std::memory_order_acquire)) std::this_thread::yield();
  int accepted = 0, refused = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (int i = 0; (i & 1023) != 0 || std::chrono::steady_clock::now() < until; ++i) {
    ring::StepDescriptor d;
    v1::DecodeStepRequest out;
    const absl::Status s =
        service::ReadDescriptor(slot.data(), kN, config, ring_bytes, *profile, d, columns, out);
    if (!s.ok()) {
      ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      ++refused;
      continue;
    }
    ++accepted;
    const ring::ColumnOffsets c = ring::ColumnsOf(d.flags, d.sequence_count, d.row_lengths_count);
    ASSERT_LE(c.end, config.slot_bytes);
    ASSERT_EQ(out.sequence_ids_size(), static_cast<int>(d.sequence_count));
    ASSERT_EQ(out.row_lengths_size(), static_cast<int>(d.row_lengths_count));
    ASSERT_EQ(out.num_rows_size(),
              (d.flags & ring::kNumRowsColumn) ? static_cast<int>(d.sequence_count) : 0);
    ASSERT_EQ(out.new_key_counts_size(),
              (d.flags & ring::kNewKeyCountsColumn) ? static_cast<int>(d.sequence_count) : 0);
    ASSERT_EQ(out.new_keys_positions_size(),
              (d.flags & ring::kNewKeysPositionsColumn) ? static_cast<int>(d.sequence_count) : 0);
    ASSERT_EQ(out.step_id(), d.step_id);
    ASSERT_GE(out.shared_memory().q_offset(), ring_bytes);
    ASSERT_GE(out.shared_memory().answer_offset(), ring_bytes);
    ASSERT_EQ(out.shared_memory().answer_offset(), d.answer_offset);
  }
  stop.store(true);
  writer.join();
  // Both outcomes were exercised (a run where one never happened proves little).
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace decode_indexer::testing
