// One rank per device: the executor's row sharding and collectives at several rank counts.
//
// CPU (runs everywhere, CI included): the CPU backend at 1, 2, 4 and 8 ranks answers
// bit-identically on batches that shard at every one of those counts, answers all-gathered
// or copied directly by each rank (direct answers: no collective in a dense step); an
// injected rank error fails a sharded step with INTERNAL (on every rank where the step has a
// collective) and leaves the executor usable (a CPU failure is an ordinary step failure); an
// injected hang (a rank that never joins the all-gather) is ended by the collective timeout
// with INTERNAL on every rank and turns the executor unhealthy. CUDA graphs' plumbing: a recording
// CPU backend with graph semantics (arguments baked in at capture, replayed later) answers as the
// plain CPU backend at 1 and 2 ranks; the length buckets that key the graphs are bounds, few and
// stable.
//
// CUDA (two GPUs and NCCL, else skipped visibly): the same executor with backend cuda at
// --ranks 2 (NCCL) against --ranks 1, bit-identical on a v32 and a v41-like profile (dense,
// candidate source and four consumers), overlap on and off alike; fault injection (error and
// hang) on one rank: INTERNAL on every rank, no hang, unhealthy, later calls UNAVAILABLE;
// --ranks 2 with CUDA graphs replaying bit-identical to --ranks 1 eager.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"
#include "gtest/gtest.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/executor_internal.h"
#include "server/exec/rank.h"
#include "server/testing/fault_injection.h"
#include "tests/server/exec_harness.h"

namespace decode_indexer::testing {
namespace {

using config::LayerRole;
using exec::Executor;
using exec::ExecutorOptions;
using exec::StepResult;

struct Script {
  config::Profile profile;
  int32_t requests = 16;
  std::vector<int32_t> next_ns = {1, 2};
  int32_t min_length = 1;  // prefill lengths per cache layer, uniform in [min, max]
  int32_t max_length = 100;
  int32_t rounds = 1;  // passes through the layers per next_n (shapes repeat: graphs replay)
  bool page_locked_inputs = false;  // StepInput::host_memory_page_locked on every step
  // Where the answers go (StepInput::answer): the result's vectors, or a caller's AnswerSink
  // of one kind (spans poisoned first; the encoder's rows collected in order).
  enum class Sink { kVector, kHost, kHostPageLocked, kDevice, kEncoder };
  Sink sink = Sink::kVector;
};

const char* SinkName(Script::Sink s) {
  switch (s) {
    case Script::Sink::kVector:
      return "vector";
    case Script::Sink::kHost:
      return "host span";
    case Script::Sink::kHostPageLocked:
      return "page-locked host span";
    case Script::Sink::kDevice:
      return "device span";
    case Script::Sink::kEncoder:
      return "encoder";
  }
  return "?";
}

constexpr Script::Sink kAllSinks[] = {Script::Sink::kVector, Script::Sink::kHost,
                                      Script::Sink::kHostPageLocked, Script::Sink::kDevice,
                                      Script::Sink::kEncoder};

// The caller's side of a sink: poisoned spans (the CPU backend's device memory is host memory,
// so a device span is a host vector too) and the encoder's rows.
struct CallerSink {
  std::vector<int32_t> answer, candidates, encoded;
  int32_t encoded_rows = 0;
  int32_t encoder_calls = 0;
  exec::AnswerSink sink;

  CallerSink(Script::Sink kind, const exec::StepInput& in, const config::Profile& p) {
    answer.assign(size_t(in.num_rows) * p.topk, -7);
    int32_t* cand = nullptr;
    if (in.return_candidates) {
      candidates.assign(size_t(in.num_rows) * p.num_candidate_blocks, -7);
      cand = candidates.data();
    }
    const int32_t k = p.topk;
    switch (kind) {
      case Script::Sink::kVector:
        break;
      case Script::Sink::kHost:
      case Script::Sink::kHostPageLocked:
        sink = exec::AnswerSink::Host(answer.data(), cand, kind == Script::Sink::kHostPageLocked);
        break;
      case Script::Sink::kDevice:
        sink = exec::AnswerSink::Device(answer.data(), cand);
        break;
      case Script::Sink::kEncoder:
        sink = exec::AnswerSink::Encoded(
            [this, k](std::span<const int32_t> topk, int32_t rows) {
              EXPECT_EQ(topk.size(), size_t(rows) * k);
              encoded.insert(encoded.end(), topk.begin(), topk.end());
              encoded_rows += rows;
              ++encoder_calls;
            },
            cand, /*page_locked=*/false);
        break;
    }
  }
  const std::vector<int32_t>& TopK() const {
    return sink.kind() == exec::AnswerSink::Kind::kEncoder ? encoded : answer;
  }
};

struct RunResult {
  std::vector<std::vector<int32_t>> answers;  // every step's top-k, and candidates at a source
  int32_t steps = 0;
  int32_t sharded = 0;
  int32_t dense_or_consumer_steps = 0;  // steps with no candidates to all-gather
  uint64_t collectives = 0;             // ExecutorStatus::collectives_total at the end
  int64_t answered = 0;                 // answer entries that are positions (not -1 padding)
  uint64_t graph_captures = 0;
  uint64_t graph_replays = 0;
};

void AppendRandom(Harness& h, Executor& e, uint64_t id, int32_t layer, int32_t count) {
  std::vector<uint8_t> keys, scales;
  exec::KeysInput in;
  h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
  in.count = count;
  in.keys = keys.data();
  in.scales = scales.empty() ? nullptr : scales.data();
  absl::StatusOr<int64_t> len = e.AppendKeys(id, layer, in);
  ASSERT_TRUE(len.ok()) << len.status();
  h.RecordAppend(id, layer, in);
}

// Prefill, then for each next_n one step through every layer with every request (uniform,
// so the gate shards it where the world size divides the request count). Everything random
// comes from the seed, so runs with the same seed send the same calls.
RunResult RunScript(const Script& s, Executor& e, uint64_t seed) {
  RunResult out;
  Harness h(s.profile, seed);
  std::mt19937_64& rng = h.rng();
  std::vector<uint64_t> ids;
  for (int32_t i = 0; i < s.requests; ++i) {
    const uint64_t id = 100 + i;
    EXPECT_TRUE(e.CreateSequence(id).ok());
    ids.push_back(id);
    for (int32_t layer : s.profile.CacheLayers()) {
      AppendRandom(h, e, id, layer,
                   s.min_length + int32_t(rng() % (s.max_length - s.min_length + 1)));
    }
  }
  for (int32_t n : s.next_ns) {
    std::vector<SeqPlan> plans;
    for (uint64_t id : ids) plans.push_back({id, n, n, {}});
    for (int32_t round = 0; round < s.rounds; ++round) {
      for (const config::LayerSpec& l : s.profile.layers) {
        std::vector<SeqPlan> step_plans = plans;
        if (l.role == LayerRole::kCandidateConsumer) {
          for (SeqPlan& p : step_plans) p.new_keys = 0;
        }
        std::unique_ptr<StepData> step = h.MakeStep(l.layer, step_plans);
        step->input.return_candidates = l.role == LayerRole::kCandidateSource;
        step->input.host_memory_page_locked = s.page_locked_inputs;
        CallerSink caller(s.sink, step->input, s.profile);
        if (s.sink != Script::Sink::kVector) step->input.answer = &caller.sink;
        SCOPED_TRACE(absl::StrCat("next_n ", n, " round ", round, " layer ", l.layer, ", sink ",
                                  SinkName(s.sink)));
        absl::StatusOr<StepResult> r = e.DecodeStep(step->input);
        EXPECT_TRUE(r.ok()) << r.status();
        if (!r.ok()) return out;
        if (s.sink != Script::Sink::kVector) {
          // The answers are in the sink, written once; the vectors stay empty.
          EXPECT_TRUE(r->topk_indices.empty() && r->candidate_blocks.empty());
          if (s.sink == Script::Sink::kEncoder) {
            EXPECT_EQ(caller.encoded_rows, step->input.num_rows);
            EXPECT_GE(caller.encoder_calls, 1);
          }
          r->topk_indices = caller.TopK();
          r->candidate_blocks = caller.candidates;
        }
        h.RecordStep(*step);
        ++out.steps;
        out.sharded += r->sharded;
        out.dense_or_consumer_steps += l.role != LayerRole::kCandidateSource;
        for (int32_t v : r->topk_indices) out.answered += v >= 0;
        out.answers.push_back(r->topk_indices);
        if (l.role == LayerRole::kCandidateSource) out.answers.push_back(r->candidate_blocks);
      }
    }
  }
  EXPECT_TRUE(e.Status().healthy);
  out.collectives = e.Status().collectives_total;
  out.graph_captures = e.Status().graph_captures;
  out.graph_replays = e.Status().graph_replays;
  return out;
}

RunResult RunScript(const Script& s, const ExecutorOptions& options, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<Executor>> made = Executor::Create(s.profile, options);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return RunResult{};
  return RunScript(s, **made, seed);
}

// Runs `s` at every rank count and expects the answers of the first, and sharding elsewhere.
void ExpectRanksAgree(const Script& s, ExecutorOptions options, const std::vector<int32_t>& ranks,
                      uint64_t seed) {
  options.ranks = ranks[0];
  const RunResult base = RunScript(s, options, seed);
  ASSERT_GT(base.steps, 0);
  // Real answers, not padding: the comparison below means something.
  EXPECT_GT(base.answered, base.steps * s.requests);
  for (size_t i = 1; i < ranks.size(); ++i) {
    SCOPED_TRACE(absl::StrCat(ranks[i], " ranks"));
    options.ranks = ranks[i];
    const RunResult r = RunScript(s, options, seed);
    EXPECT_EQ(r.steps, base.steps);
    EXPECT_EQ(r.sharded, r.steps) << "every step of the script should shard";
    EXPECT_TRUE(r.answers == base.answers) << "answers differ from " << ranks[0] << " rank(s)";
  }
}

// ---------------------------------------------------------------------------------------
// CPU backend: issue 6's "what the CPUs allow".

TEST(MultiRankCpu, RanksOneTwoFourEightAreBitIdentical) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    SCOPED_TRACE(p.name);
    Script s{p, 16, {1, 2}, 1, 3 * p.topk};
    for (bool direct : {true, false}) {
      SCOPED_TRACE(direct ? "direct answers" : "answers all-gathered");
      ExecutorOptions o = CpuOptions(1);
      o.direct_answers = direct;
      ExpectRanksAgree(s, o, direct ? std::vector<int32_t>{1, 2, 4, 8} : std::vector<int32_t>{1, 4},
                       seed);
    }
  }
}

// Direct answers: a sharded dense step copies each rank's rows to the host answer and runs no
// collective at all (no agreement, no all-gather); the all-gathering path does run one. The
// v41 profile's source still all-gathers its candidates either way.
TEST(MultiRankCpu, DirectAnswersSkipTheCollectiveOfDenseSteps) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const config::Profile p = SmallV32();
  for (const config::LayerSpec& l : p.layers) ASSERT_EQ(l.role, LayerRole::kDense);
  Script s{p, 8, {1, 2}, 1, 3 * p.topk};
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct answers" : "answers all-gathered");
    ExecutorOptions o = CpuOptions(2);
    o.direct_answers = direct;
    const RunResult r = RunScript(s, o, seed);
    ASSERT_GT(r.steps, 0);
    EXPECT_EQ(r.sharded, r.steps);
    // Counted, not timed: an agreement and an all-gather per gathered step, none direct.
    EXPECT_EQ(r.collectives, direct ? 0u : 2u * uint64_t(r.steps));
  }
}

// A CPU backend with graph semantics, so the executor's graph plumbing runs in CI: between
// BeginCapture and EndCapture the scoring entry points are recorded with their arguments (as
// a CUDA graph bakes them in) instead of run, and Replay runs the recording. Any other call
// while capturing (a copy, an insert, a synchronize, a fork) is a violation: CUDA would
// reject it or bake a host copy into the graph. If the executor replayed a key whose
// arguments (pointers, sizes, lengths bound) differ from the step's, the answers would differ
// from an eager run's. A RecordingDevice captures and replays; RecordingOps are what gets
// recorded; the Recorder is their shared graph state.
struct Recorder {
  std::atomic<int64_t>* violations = nullptr;
  bool capturing = false;
  std::vector<std::function<absl::Status()>> recording;
  std::map<uint64_t, std::vector<std::function<absl::Status()>>> graphs;
  // A client's "device buffer" [client_begin, client_end) (device q, and an answer there):
  // the device-to-device copies out of it and into it, and the q codes every scoring call read
  // and the top-k it wrote as it ran (eager or replayed).
  uintptr_t client_begin = 0, client_end = 0;
  int64_t client_copies = 0;
  int64_t client_writes = 0;
  std::vector<const uint8_t*> scored_q;
  std::vector<const int32_t*> scored_topk;
  int64_t checks_run = 0;  // CheckValues calls that ran (eager or replayed)
  int64_t replays = 0;     // graphs replayed
  bool replaying = false;
  bool replay_inserted = false;      // the replay running now ran an InsertKeys
  int64_t replays_with_inserts = 0;  // replays that ran at least one
  int64_t drops = 0;                 // graphs dropped (DropGraph of a key that held one)

  bool InClient(const void* p) const {
    const auto at = reinterpret_cast<uintptr_t>(p);
    return at >= client_begin && at < client_end;
  }

  void Forbidden() {
    if (capturing) ++*violations;
  }
  absl::Status Call(std::function<absl::Status()> call) {
    if (!capturing) return call();
    recording.push_back(std::move(call));
    return absl::OkStatus();
  }
};

class RecordingDevice final : public kernels::DeviceWrapper {
 public:
  RecordingDevice(kernels::Device& inner, std::atomic<int64_t>* violations) : DeviceWrapper(inner) {
    recorder_.violations = violations;
  }
  Recorder& recorder() { return recorder_; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    recorder_.Forbidden();
    return target().Allocate(bytes);
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    recorder_.Forbidden();
    return target().CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    recorder_.Forbidden();
    return target().CopyToHost(dst, src, bytes);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    recorder_.Forbidden();
    if (recorder_.InClient(src)) ++recorder_.client_copies;
    if (recorder_.InClient(dst)) ++recorder_.client_writes;
    return target().CopyDeviceToDevice(dst, src, bytes);
  }
  absl::Status Synchronize() override {
    recorder_.Forbidden();
    return target().Synchronize();
  }

  bool SupportsGraphs() const override { return true; }
  absl::Status BeginCapture() override {
    if (recorder_.capturing) ++*recorder_.violations;
    recorder_.capturing = true;
    recorder_.recording.clear();
    return absl::OkStatus();
  }
  absl::Status EndCapture(uint64_t key) override {
    if (!recorder_.capturing) ++*recorder_.violations;
    recorder_.capturing = false;
    recorder_.graphs[key] = std::move(recorder_.recording);
    recorder_.recording.clear();
    return absl::OkStatus();
  }
  void AbortCapture() override {
    recorder_.capturing = false;
    recorder_.recording.clear();
  }
  absl::StatusOr<bool> Replay(uint64_t key) override {
    if (recorder_.capturing) ++*recorder_.violations;
    auto it = recorder_.graphs.find(key);
    if (it == recorder_.graphs.end()) return false;
    ++recorder_.replays;
    recorder_.replaying = true;
    recorder_.replay_inserted = false;
    for (const auto& call : it->second) {
      if (absl::Status s = call(); !s.ok()) {
        recorder_.replaying = false;
        return s;
      }
    }
    recorder_.replaying = false;
    recorder_.replays_with_inserts += recorder_.replay_inserted;
    return true;
  }
  void DropGraph(uint64_t key) override {
    if (recorder_.capturing) ++*recorder_.violations;
    recorder_.drops += static_cast<int64_t>(recorder_.graphs.erase(key));
  }

 private:
  Recorder recorder_;
};

class RecordingOps final : public kernels::IndexerOpsWrapper {
 public:
  RecordingOps(kernels::IndexerOps& inner, Recorder& recorder)
      : IndexerOpsWrapper(inner), r_(recorder) {}

  // A step's packed keys are inserted in the kernel section (captured too); other inserts
  // never run while capturing.
  absl::Status InsertKeys(const kernels::KeyInsertArgs& a) override {
    return r_.Call([this, a] {
      if (r_.replaying) r_.replay_inserted = true;
      return target().InsertKeys(a);
    });
  }
  absl::Status RopeQuantQ(const kernels::QPrepArgs& a) override {
    return r_.Call([this, a] { return target().RopeQuantQ(a); });
  }
  absl::Status DenseTopK(const kernels::DenseArgs& a) override {
    return r_.Call([this, a] {
      r_.scored_q.push_back(a.q.codes);
      r_.scored_topk.push_back(a.topk_out);
      return target().DenseTopK(a);
    });
  }
  absl::Status SparseTopK(const kernels::SparseArgs& a) override {
    return r_.Call([this, a] {
      r_.scored_q.push_back(a.q.codes);
      r_.scored_topk.push_back(a.topk_out);
      return target().SparseTopK(a);
    });
  }
  absl::Status MaskedTopK(const kernels::MaskedArgs& a) override {
    return r_.Call([this, a] {
      r_.scored_q.push_back(a.q.codes);
      r_.scored_topk.push_back(a.topk_out);
      return target().MaskedTopK(a);
    });
  }
  // A device input's value check: in the kernel section (device q's) it is captured too.
  absl::Status CheckValues(const kernels::ValueCheckArgs& a) override {
    return r_.Call([this, a] {
      ++r_.checks_run;
      return target().CheckValues(a);
    });
  }
  absl::Status CopyRows(const kernels::CopyRowsArgs& a) override {
    return r_.Call([this, a] { return target().CopyRows(a); });
  }
  absl::Status ForkExpand(const kernels::ExpandArgs& a) override {
    r_.Forbidden();
    return target().ForkExpand(a);
  }
  absl::Status JoinExpand() override {
    r_.Forbidden();
    return target().JoinExpand();
  }

 private:
  Recorder& r_;
};

std::unique_ptr<kernels::Backend> MakeRecordingBackend(std::unique_ptr<kernels::Backend> inner,
                                                       std::atomic<int64_t>* violations,
                                                       RecordingDevice** device_out = nullptr) {
  auto device = std::make_unique<RecordingDevice>(inner->device(), violations);
  if (device_out != nullptr) *device_out = device.get();
  auto ops = std::make_unique<RecordingOps>(inner->ops(), device->recorder());
  return kernels::ComposeBackend(std::move(inner), std::move(device), std::move(ops));
}

// Graph plumbing on the CPU (runs in CI): recorded "graphs" at 1 and 2 ranks answer bit for
// bit as the plain CPU backend, over rounds that repeat every layer's shape; replays happen,
// nothing but the kernel section's calls is ever recorded, and a key-carrying step's replay
// inserts its keys (with the step's page-table edits: a step that crosses into a new page
// answers from it).
TEST(MultiRankCpu, RecordedGraphsAnswerAsEagerSteps) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    SCOPED_TRACE(p.name);
    for (bool masked : {false, true}) {
      SCOPED_TRACE(masked ? "masked consumer" : "sparse consumer");
      Script s{p, 16, {1, 2}, 1, 3 * p.topk};
      s.rounds = 3;
      ExecutorOptions eager = CpuOptions(1);
      eager.masked_consumer = masked;
      const RunResult base = RunScript(s, eager, seed);
      ASSERT_GT(base.steps, 0);
      EXPECT_GT(base.answered, base.steps * s.requests);
      EXPECT_EQ(base.graph_replays, 0u);  // the CPU backend has no graphs
      for (int32_t ranks : {1, 2}) {
        SCOPED_TRACE(absl::StrCat(ranks, " ranks with recorded graphs"));
        std::atomic<int64_t> violations{0};
        ExecutorOptions o = CpuOptions(ranks);
        o.masked_consumer = masked;
        o.cuda_graphs = true;
        std::vector<RecordingDevice*> devices;  // owned by the executor's backends
        auto factory = [&violations, &devices](int32_t, const kernels::BackendLimits& limits)
            -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
          RecordingDevice* device = nullptr;
          auto backend =
              MakeRecordingBackend(kernels::MakeCpuBackend(limits, 1), &violations, &device);
          devices.push_back(device);
          return backend;
        };
        absl::StatusOr<std::unique_ptr<Executor>> made =
            exec::CreateExecutorWithBackends(p, o, factory);
        ASSERT_TRUE(made.ok()) << made.status();
        const RunResult r = RunScript(s, **made, seed);
        EXPECT_EQ(r.steps, base.steps);
        EXPECT_TRUE(r.answers == base.answers) << "recorded graphs change the answers";
        EXPECT_GT(r.graph_captures, 0u);
        // A shape (cache, role) is seen rounds x (layers sharing it) times per next_n on every
        // rank (a max_context of 1024 puts every length in one bucket): once eager, once
        // captured, replayed every other time.
        std::map<std::pair<int32_t, int32_t>, int32_t> sharing;
        for (const config::LayerSpec& l : p.layers) {
          ++sharing[{l.cache_layer, static_cast<int32_t>(l.role)}];
        }
        uint64_t replays_per_n = 0;
        // The device replays each graph also right after capturing it.
        int64_t key_device_replays_per_n = 0;  // of the shapes whose steps carry keys
        for (const auto& [shape, layers] : sharing) {
          replays_per_n += s.rounds * layers - 2;
          if (shape.second != static_cast<int32_t>(LayerRole::kCandidateConsumer)) {
            key_device_replays_per_n += s.rounds * layers - 1;
          }
        }
        EXPECT_EQ(r.graph_replays, uint64_t(ranks) * s.next_ns.size() * replays_per_n);
        // Every key-carrying step's keys are inserted inside its section, so every replay of
        // such a shape inserts them (one call a run of keys), on every rank, and no other
        // replay does.
        int64_t with_inserts = 0;
        for (RecordingDevice* d : devices) with_inserts += d->recorder().replays_with_inserts;
        EXPECT_EQ(with_inserts,
                  int64_t{ranks} * int64_t(s.next_ns.size()) * key_device_replays_per_n);
        EXPECT_EQ(violations.load(), 0);
      }
    }
  }
}

// A full graph table (ExecutorOptions::max_step_graphs) evicts the least recently seen shape
// and drops its graph: with room for exactly one next_n's shapes, next_n 2's steps evict every
// next_n 1 shape (each had a captured graph) and still capture and replay their own as an
// unbounded table does; the answers stay the eager run's, and no rank keeps more graphs than
// the bound.
TEST(MultiRankCpu, AFullGraphTableEvictsTheLeastRecentShape) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const config::Profile p = SmallV32();
  Script s{p, 16, {1, 2}, 1, 3 * p.topk};
  s.rounds = 3;
  const RunResult base = RunScript(s, CpuOptions(1), seed);
  ASSERT_GT(base.steps, 0);
  std::set<std::pair<int32_t, int32_t>> shapes;  // per next_n: (cache layer, role)
  for (const config::LayerSpec& l : p.layers) {
    shapes.insert({l.cache_layer, static_cast<int32_t>(l.role)});
  }
  const int32_t per_n = static_cast<int32_t>(shapes.size());
  for (int32_t ranks : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks"));
    struct Run {
      RunResult result;
      uint64_t evictions = 0;
      std::vector<int64_t> drops;       // per rank
      std::vector<size_t> graphs_kept;  // per rank, at the end
    };
    auto run = [&](int32_t max_graphs) {
      Run out;
      std::atomic<int64_t> violations{0};
      ExecutorOptions o = CpuOptions(ranks);
      o.cuda_graphs = true;
      o.max_step_graphs = max_graphs;
      std::mutex mu;
      std::vector<RecordingDevice*> devices;  // owned by the executor's backends
      auto factory = [&](int32_t, const kernels::BackendLimits& limits)
          -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
        RecordingDevice* device = nullptr;
        auto backend =
            MakeRecordingBackend(kernels::MakeCpuBackend(limits, 1), &violations, &device);
        std::lock_guard<std::mutex> lock(mu);
        devices.push_back(device);
        return backend;
      };
      absl::StatusOr<std::unique_ptr<Executor>> made =
          exec::CreateExecutorWithBackends(p, o, factory);
      EXPECT_TRUE(made.ok()) << made.status();
      if (!made.ok()) return out;
      out.result = RunScript(s, **made, seed);
      out.evictions = (*made)->Status().graph_evictions;
      for (RecordingDevice* d : devices) {
        out.drops.push_back(d->recorder().drops);
        out.graphs_kept.push_back(d->recorder().graphs.size());
      }
      EXPECT_EQ(violations.load(), 0);
      return out;
    };
    const Run unbounded = run(1024);
    const Run bounded = run(per_n);
    EXPECT_TRUE(unbounded.result.answers == base.answers);
    EXPECT_TRUE(bounded.result.answers == base.answers) << "evicting graphs changes the answers";
    EXPECT_EQ(unbounded.evictions, 0u);
    EXPECT_EQ(bounded.evictions, uint64_t(ranks) * per_n);
    EXPECT_EQ(bounded.result.graph_captures, unbounded.result.graph_captures);
    EXPECT_EQ(bounded.result.graph_replays, unbounded.result.graph_replays);
    EXPECT_GT(bounded.result.graph_replays, 0u);
    ASSERT_EQ(bounded.drops.size(), size_t(ranks));
    for (int32_t r = 0; r < ranks; ++r) {
      EXPECT_EQ(bounded.drops[r], per_n);  // every next_n 1 shape had a graph
      EXPECT_LE(bounded.graphs_kept[r], size_t(per_n));
      EXPECT_EQ(unbounded.drops[r], 0);
    }
  }
}

// ---- Device q read in place (QInput::on_device on the answering rank) ----------------------

// A client's "device buffer" (the CPU backend's device memory is host memory, as a client's
// CUDA IPC buffer is the answering rank's device memory): a step's q codes, FP4 q scales and
// weights copied in from an offset, and the step's QInput pointed there.
class ClientBuffer {
 public:
  static constexpr size_t kBytes = size_t{1} << 20;
  ClientBuffer() : storage_(kBytes + 64, 0) {
    const auto raw = reinterpret_cast<uintptr_t>(storage_.data());
    base_ = storage_.data() + ((64 - raw % 64) % 64);  // a 64-byte aligned base
  }
  uintptr_t begin() const { return reinterpret_cast<uintptr_t>(base_); }
  uintptr_t end() const { return begin() + kBytes; }
  uint8_t* at(size_t offset) { return base_ + offset; }

  struct Placed {
    size_t q = 0, scales = 0, weights = 0, end = 0;
  };
  // q's codes at `at`, its scales and the weights after them at 16-byte aligned offsets (the
  // weights `weights_skew` bytes further); `in.q` points there, on the device.
  Placed Place(const StepData& step, size_t at, exec::StepInput& in, size_t weights_skew = 0) {
    Placed p;
    auto put = [&](const void* src, size_t bytes, size_t offset) {
      EXPECT_LE(offset + bytes, kBytes);
      std::memcpy(base_ + offset, src, bytes);
      return offset + bytes;
    };
    auto align16 = [](size_t v) { return (v + 15) / 16 * 16; };
    p.q = at;
    size_t next = put(step.q.data(), step.q.size(), p.q);
    if (!step.q_scales.empty()) {
      p.scales = align16(next);
      next = put(step.q_scales.data(), step.q_scales.size(), p.scales);
    }
    p.weights = align16(next) + weights_skew;
    p.end = put(step.weights.data(), step.weights.size() * sizeof(float), p.weights);
    in.q.q = base_ + p.q;
    in.q.scales = step.q_scales.empty() ? nullptr : base_ + p.scales;
    in.q.weights = reinterpret_cast<const float*>(base_ + p.weights);
    in.q.on_device = true;
    return p;
  }

 private:
  std::vector<uint8_t> storage_;
  uint8_t* base_ = nullptr;
};

// The step's new keys marked as lying in the client's device buffer (or not).
void MarkKeysOnDevice(exec::StepInput& in, bool on_device) {
  for (exec::SequenceStepInput& seq : in.sequences) {
    seq.new_keys.on_device = on_device && seq.new_keys.count > 0;
  }
}

// A recording executor (graphs captured and replayed on the CPU) for device-q steps, its
// ranks' recorders watching `buffer`, and its host-q twin (the plain CPU backend), both with
// the same sequences `ids` prefilled in every cache layer.
struct DeviceQRig {
  std::atomic<int64_t> violations{0};
  std::vector<RecordingDevice*> devices;
  std::unique_ptr<Executor> device;
  std::unique_ptr<Executor> host;
  ClientBuffer buffer;

  DeviceQRig(Harness& h, const std::vector<uint64_t>& ids, int32_t ranks, bool graphs = true,
             bool answer_in_place = true)
      : devices(ranks) {
    const config::Profile& p = h.profile();
    ExecutorOptions o = CpuOptions(ranks);
    o.cuda_graphs = graphs;
    o.answer_in_place = answer_in_place;
    auto factory = [this](int32_t rank, const kernels::BackendLimits& limits)
        -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
      return MakeRecordingBackend(kernels::MakeCpuBackend(limits, 1), &violations,
                                  &devices[size_t(rank)]);
    };
    absl::StatusOr<std::unique_ptr<Executor>> made =
        exec::CreateExecutorWithBackends(p, o, factory);
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) device = *std::move(made);
    made = Executor::Create(p, CpuOptions(ranks));
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) host = *std::move(made);
    if (device == nullptr || host == nullptr) return;
    for (RecordingDevice* d : devices) {
      d->recorder().client_begin = buffer.begin();
      d->recorder().client_end = buffer.end();
    }
    for (uint64_t id : ids) {
      EXPECT_TRUE(device->CreateSequence(id).ok());
      EXPECT_TRUE(host->CreateSequence(id).ok());
      for (int32_t layer : p.CacheLayers()) {
        std::vector<uint8_t> keys, scales;
        exec::KeysInput in;
        in.count = 2 * p.topk + int32_t(h.rng()() % p.topk);
        h.RandomKeys(layer, in.count, KeyForm::kF32, &keys, &scales, &in.type);
        in.keys = keys.data();
        in.scales = scales.empty() ? nullptr : scales.data();
        EXPECT_TRUE(device->AppendKeys(id, layer, in).ok());
        EXPECT_TRUE(host->AppendKeys(id, layer, in).ok());
        h.RecordAppend(id, layer, in);
      }
    }
  }
  bool ok() const { return device != nullptr && host != nullptr; }
  // Clears what the recorders saw.
  void Reset() {
    for (RecordingDevice* d : devices) {
      d->recorder().client_copies = 0;
      d->recorder().client_writes = 0;
      d->recorder().scored_q.clear();
      d->recorder().scored_topk.clear();
      d->recorder().checks_run = 0;
      d->recorder().replays = 0;
    }
  }
  // The sequences' lengths and pages in `e`, as text.
  static std::string Infos(Executor& e, const std::vector<uint64_t>& ids) {
    std::string text;
    for (uint64_t id : ids) {
      absl::StatusOr<exec::SequenceInfo> info = e.GetSequence(id);
      EXPECT_TRUE(info.ok()) << info.status();
      if (!info.ok()) continue;
      for (const exec::SequenceCacheInfo& c : info->caches) {
        absl::StrAppend(&text, id, "@", c.cache_layer, ":", c.length, "/", c.pages, " ");
      }
    }
    return text;
  }
};

// The step of `layer` for every sequence of `ids` (n rows each, new keys but at a consumer),
// quantized q in the layer's cache format; keys of `key_form`.
std::unique_ptr<StepData> DeviceQStep(Harness& h, const config::LayerSpec& layer,
                                      const std::vector<uint64_t>& ids, int32_t n,
                                      KeyForm key_form) {
  std::vector<SeqPlan> plans;
  const bool consumer = layer.role == LayerRole::kCandidateConsumer;
  for (uint64_t id : ids) plans.push_back({id, n, consumer ? 0 : n, {}});
  std::unique_ptr<StepData> step =
      h.MakeStep(layer.layer, plans, QForm::kQuantized, key_form, /*with_positions=*/false);
  step->input.return_candidates = layer.role == LayerRole::kCandidateSource;
  return step;
}

// Quantized q (FP8; FP4 and its scales) in a client's device buffer is read in place by the
// answering rank: its kernels read q at the step's offset in the buffer, it makes no
// device-to-device copy out of the buffer, its device q check runs (eager, captured and
// replayed with the scoring); the other rank copies its rows as before. Every step answers
// bit for bit what the same step answers with q on the host, at 1 and 2 ranks, over rounds
// that repeat every layer's shape (eager, captured, replayed), when q moves to another offset
// of the buffer (a new graph, never a stale replay: the old offset is zeroed), when its codes
// or weights are not aligned for the kernels (then copied, as on the other ranks), and with
// device keys in the step (q's check then adds to the keys').
TEST(MultiRankCpu, DeviceQIsReadInPlaceOnTheAnsweringRank) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  struct Round {
    size_t at;            // q's offset in the buffer
    size_t weights_skew;  // bytes past the weights' 16-byte aligned offset
    bool device_keys;
    bool in_place;  // what rank 0 should do
  };
  const size_t A = 0, B = 256 * 1024;
  const std::vector<Round> rounds = {
      {A, 0, false, true},      {A, 0, false, true},      {A, 0, false, true},
      {A, 0, false, true},      {B, 0, false, true},      {B, 0, false, true},
      {B, 0, false, true},      {B + 4, 0, false, false}, {B + 4, 0, false, false},
      {B + 4, 0, false, false}, {B, 2, false, false},     {B, 2, false, false},
      {A, 0, true, true},       {A, 0, true, true},       {A, 0, true, true}};
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    for (int32_t ranks : {1, 2}) {
      SCOPED_TRACE(absl::StrCat(p.name, " ranks ", ranks));
      Harness h(p, seed);
      const std::vector<uint64_t> ids = {1, 2, 3, 4};
      DeviceQRig rig(h, ids, ranks);
      ASSERT_TRUE(rig.ok());
      size_t last_at = A;
      for (size_t ri = 0; ri < rounds.size(); ++ri) {
        const Round& round = rounds[ri];
        for (const config::LayerSpec& layer : p.layers) {
          SCOPED_TRACE(absl::StrCat("round ", ri, " layer ", layer.layer));
          std::unique_ptr<StepData> step = DeviceQStep(
              h, layer, ids, 1, round.device_keys ? KeyForm::kQuantized : KeyForm::kF32);
          exec::StepInput on = step->input;
          if (round.at != last_at) {  // q moved: what a stale replay would read is zeros
            std::memset(rig.buffer.at(last_at), 0, 64 * 1024);
            last_at = round.at;
          }
          const ClientBuffer::Placed placed =
              rig.buffer.Place(*step, round.at, on, round.weights_skew);
          MarkKeysOnDevice(on, round.device_keys);
          rig.Reset();
          absl::StatusOr<StepResult> got = rig.device->DecodeStep(on);
          ASSERT_TRUE(got.ok()) << got.status();
          absl::StatusOr<StepResult> want = rig.host->DecodeStep(step->input);
          ASSERT_TRUE(want.ok()) << want.status();
          h.RecordStep(*step);
          EXPECT_EQ(got->topk_indices, want->topk_indices);
          EXPECT_EQ(got->candidate_blocks, want->candidate_blocks);
          EXPECT_EQ(got->lengths, want->lengths);
          for (int32_t r = 0; r < ranks; ++r) {
            const Recorder& rec = rig.devices[size_t(r)]->recorder();
            // The check of device q ran on every rank, replayed or not.
            EXPECT_GT(rec.checks_run, 0) << "rank " << r;
            ASSERT_FALSE(rec.scored_q.empty()) << "rank " << r;
            if (r == 0 && round.in_place) {
              EXPECT_EQ(rec.client_copies, 0) << "the answering rank copied device q";
              // Rank 0's rows start at row 0: its kernels read q where this step put it.
              for (const uint8_t* q : rec.scored_q) EXPECT_EQ(q, rig.buffer.at(placed.q));
            } else {
              EXPECT_GT(rec.client_copies, 0) << "rank " << r << " read device q in place";
              for (const uint8_t* q : rec.scored_q) {
                const auto a = reinterpret_cast<uintptr_t>(q);
                EXPECT_FALSE(a >= rig.buffer.begin() && a < rig.buffer.end()) << "rank " << r;
              }
            }
          }
        }
      }
      const exec::ExecutorStatus status = rig.device->Status();
      EXPECT_GT(status.graph_captures, 0u);
      EXPECT_GT(status.graph_replays, 0u);
      EXPECT_EQ(rig.violations.load(), 0);
    }
  }
}

// A NaN / Inf in device q read in place (an FP8 NaN code in q, a 0xFF UE8M0 FP4 q scale, a NaN
// weight), in the answering rank's rows or another rank's, fails the step with
// INVALID_ARGUMENT naming the field, commits nothing (lengths and pages as before), though the
// step's kernel section replays a captured graph, with or without device keys checked before
// it; a bad device key in such a step is still named (q's replayed check adds to the keys'
// flags, never clears them); the clean retry answers as the host twin.
TEST(MultiRankCpu, BadDeviceQReadInPlaceFailsNamingTheFieldAndCommitsNothing) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    for (int32_t ranks : {1, 2}) {
      SCOPED_TRACE(absl::StrCat(p.name, " ranks ", ranks));
      Harness h(p, seed);
      const std::vector<uint64_t> ids = {1, 2, 3, 4};
      DeviceQRig rig(h, ids, ranks);
      ASSERT_TRUE(rig.ok());
      const int32_t H = p.num_heads;
      // Runs `step` clean on both executors at offset 0 of the buffer.
      auto run_clean = [&](StepData& step, bool device_keys) {
        exec::StepInput on = step.input;
        rig.buffer.Place(step, 0, on);
        MarkKeysOnDevice(on, device_keys);
        absl::StatusOr<StepResult> got = rig.device->DecodeStep(on);
        ASSERT_TRUE(got.ok()) << got.status();
        absl::StatusOr<StepResult> want = rig.host->DecodeStep(step.input);
        ASSERT_TRUE(want.ok()) << want.status();
        h.RecordStep(step);
        EXPECT_EQ(got->topk_indices, want->topk_indices);
        EXPECT_EQ(got->candidate_blocks, want->candidate_blocks);
        EXPECT_EQ(got->lengths, want->lengths);
      };
      for (const bool device_keys : {false, true}) {
        const KeyForm key_form = device_keys ? KeyForm::kQuantized : KeyForm::kF32;
        // Every layer's shape seen twice: captured; the steps below replay it.
        for (int warm = 0; warm < 2; ++warm) {
          for (const config::LayerSpec& layer : p.layers) {
            std::unique_ptr<StepData> step = DeviceQStep(h, layer, ids, 1, key_form);
            run_clean(*step, device_keys);
          }
        }
        for (const config::LayerSpec& layer : p.layers) {
          const bool fp4 = layer.cache_format == kernels::CacheFormat::kFp4;
          enum class Bad { kQ, kWeights, kKeys };
          for (const Bad what : {Bad::kQ, Bad::kWeights, Bad::kKeys}) {
            const bool weights = what == Bad::kWeights;
            const bool consumer = layer.role == LayerRole::kCandidateConsumer;
            if (what == Bad::kKeys && (!device_keys || consumer)) continue;
            for (const bool last_row : {false, true}) {
              SCOPED_TRACE(absl::StrCat("layer ", layer.layer, " device keys ", device_keys,
                                        " bad ", int(what), last_row ? " last" : " first", " row"));
              std::unique_ptr<StepData> step = DeviceQStep(h, layer, ids, 1, key_form);
              exec::StepInput bad = step->input;
              const ClientBuffer::Placed at = rig.buffer.Place(*step, 0, bad);
              MarkKeysOnDevice(bad, device_keys);
              const int32_t row = last_row ? step->input.num_rows - 1 : 0;
              std::string field;
              std::vector<uint8_t>* victim = nullptr;  // a sequence's keys, restored below
              std::vector<uint8_t> clean;
              if (what == Bad::kKeys) {
                // A device key of the first or last sequence: checked eagerly before the
                // section, whose replayed q check must add to the flag word, not clear it.
                const size_t seq = last_row ? ids.size() - 1 : 0;
                victim = fp4 ? &step->scales[seq] : &step->keys[seq];
                clean = *victim;
                field = fp4 ? "new_key_scales.data" : "new_keys.data";
                (*victim)[fp4 ? 1 : 5] = fp4 ? 0xFF : 0x7F;
              } else if (weights) {
                field = "weights.data";
                const float nan = std::numeric_limits<float>::quiet_NaN();
                std::memcpy(rig.buffer.at(at.weights + (size_t(row) * H + 1) * sizeof(float)), &nan,
                            sizeof(float));
              } else if (fp4) {
                field = "q_scales.data";
                const size_t per_row = step->q_scales.size() / size_t(step->input.num_rows);
                *rig.buffer.at(at.scales + size_t(row) * per_row + 3) = 0xFF;
              } else {
                field = "q.data";
                const size_t per_row = step->q.size() / size_t(step->input.num_rows);
                *rig.buffer.at(at.q + size_t(row) * per_row + 77) = 0x7F;
              }
              const std::string before = DeviceQRig::Infos(*rig.device, ids);
              const uint64_t replays = rig.device->Status().graph_replays;
              absl::StatusOr<StepResult> r = rig.device->DecodeStep(bad);
              EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
              const std::string message(r.status().message());
              EXPECT_NE(message.find(field), std::string::npos) << message;
              EXPECT_NE(message.find("committed nothing"), std::string::npos) << message;
              EXPECT_EQ(DeviceQRig::Infos(*rig.device, ids), before);
              if (victim != nullptr) *victim = clean;
              run_clean(*step, device_keys);
              // The failed step and its retry replayed the captured section.
              EXPECT_GT(rig.device->Status().graph_replays, replays);
            }
          }
        }
      }
      EXPECT_EQ(DeviceQRig::Infos(*rig.device, ids), DeviceQRig::Infos(*rig.host, ids));
      EXPECT_EQ(rig.violations.load(), 0);
    }
  }
}

// ---- The answer's top-k written in place into a client's device buffer --------------------

// Where the answering rank scores every row (one rank, or an unsharded step: 3 requests do not
// shard over 2 ranks) and the answer's device span is int32-aligned, its scoring writes the
// top-k straight into the span (decode_schedule.h TopKInPlace): the scoring's top-k pointer is
// the span and nothing copies into it; otherwise (a sharded step, whose rows are all-gathered
// first; a misaligned span) the top-k is copied device to device as before. Either way the
// span holds, bit for bit, what the same step answers in the result's vectors (the plain CPU
// twin), with graphs off and on (eager, captured, replayed), and no other byte of the buffer
// is written. An answer that moves to another offset makes another graph shape: the first step
// there does not replay on the answering rank, and the old offset stays as it was poisoned (a
// stale replay would write there).
TEST(MultiRankCpu, DeviceAnswerIsWrittenInPlaceByTheAnsweringRank) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  struct Round {
    size_t at;        // the answer's offset in the client's buffer
    size_t requests;  // of the 4 sequences: 4 shard over 2 ranks, 3 do not
  };
  const size_t A = 0, B = 64 * 1024, M = B + 2;  // M: not int32-aligned (the copy, then)
  const std::vector<Round> rounds = {{A, 4}, {A, 4}, {A, 4}, {B, 4}, {B, 4}, {B, 4},
                                     {M, 4}, {M, 4}, {M, 4}, {A, 3}, {A, 3}, {A, 3},
                                     {B, 3}, {B, 3}, {B, 3}, {M, 3}};
  constexpr size_t kAnswerArea = 128 * 1024;  // poisoned before every step
  constexpr uint8_t kPoison = 0xA7;
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    for (int32_t ranks : {1, 2}) {
      for (const auto& [graphs, option] : {std::pair{false, true}, std::pair{true, true},
                                           std::pair{false, false}, std::pair{true, false}}) {
        // option: ExecutorOptions::answer_in_place (off: the benchmarks' same-run baseline,
        // the answering rank's own buffer and one device-to-device copy, as before the path).
        SCOPED_TRACE(
            absl::StrCat(p.name, " ranks ", ranks, " graphs ", graphs, " in place ", option));
        Harness h(p, seed);
        const std::vector<uint64_t> all_ids = {1, 2, 3, 4};
        DeviceQRig rig(h, all_ids, ranks, graphs, option);
        ASSERT_TRUE(rig.ok());
        const size_t K = size_t(p.topk);
        int32_t same_place = 0;  // rounds in a row with this round's offset and requests
        for (size_t ri = 0; ri < rounds.size(); ++ri) {
          const Round& round = rounds[ri];
          const bool repeated =
              ri > 0 && rounds[ri - 1].at == round.at && rounds[ri - 1].requests == round.requests;
          same_place = repeated ? same_place + 1 : 1;
          const std::vector<uint64_t> ids(all_ids.begin(), all_ids.begin() + round.requests);
          const bool sharded = ranks > 1 && round.requests % size_t(ranks) == 0;
          const bool in_place = option && !sharded && round.at % sizeof(int32_t) == 0;
          for (size_t li = 0; li < p.layers.size(); ++li) {
            const config::LayerSpec& layer = p.layers[li];
            SCOPED_TRACE(absl::StrCat("round ", ri, " layer ", layer.layer));
            std::unique_ptr<StepData> step = DeviceQStep(h, layer, ids, 1, KeyForm::kF32);
            const size_t rows = size_t(step->input.num_rows);
            const size_t bytes = rows * K * sizeof(int32_t);
            std::vector<int32_t> candidates;
            if (step->input.return_candidates) {
              candidates.assign(rows * size_t(p.num_candidate_blocks), -7);
            }
            std::memset(rig.buffer.at(0), kPoison, kAnswerArea);
            const exec::AnswerSink sink =
                exec::AnswerSink::Device(reinterpret_cast<int32_t*>(rig.buffer.at(round.at)),
                                         candidates.empty() ? nullptr : candidates.data());
            exec::StepInput on = step->input;
            on.answer = &sink;
            rig.Reset();
            absl::StatusOr<StepResult> got = rig.device->DecodeStep(on);
            ASSERT_TRUE(got.ok()) << got.status();
            absl::StatusOr<StepResult> want = rig.host->DecodeStep(step->input);
            ASSERT_TRUE(want.ok()) << want.status();
            h.RecordStep(*step);
            EXPECT_TRUE(got->topk_indices.empty() && got->candidate_blocks.empty());
            std::vector<int32_t> answer(rows * K);
            std::memcpy(answer.data(), rig.buffer.at(round.at), bytes);
            EXPECT_EQ(answer, want->topk_indices);
            EXPECT_EQ(candidates, want->candidate_blocks);
            EXPECT_EQ(got->lengths, want->lengths);
            size_t written_outside = 0;
            for (size_t i = 0; i < kAnswerArea; ++i) {
              if ((i < round.at || i >= round.at + bytes) && *rig.buffer.at(i) != kPoison) {
                ++written_outside;
              }
            }
            EXPECT_EQ(written_outside, 0u) << "bytes of the buffer outside the answer written";
            for (int32_t r = 0; r < ranks; ++r) {
              const Recorder& rec = rig.devices[size_t(r)]->recorder();
              ASSERT_FALSE(rec.scored_topk.empty()) << "rank " << r;
              for (const int32_t* t : rec.scored_topk) {
                if (r == 0 && in_place) {
                  EXPECT_EQ(static_cast<const void*>(t), rig.buffer.at(round.at))
                      << "the answering rank's top-k went elsewhere";
                } else {
                  EXPECT_FALSE(rec.InClient(t)) << "rank " << r << " wrote its top-k in place";
                }
              }
              // Into the client's buffer: the answering rank's one copy, unless in place.
              EXPECT_EQ(rec.client_writes, r == 0 && !in_place ? 1 : 0) << "rank " << r;
            }
            const Recorder& answering = rig.devices[0]->recorder();
            if (!graphs) {
              EXPECT_EQ(answering.replays, 0);
            } else if (in_place && same_place >= 3) {
              EXPECT_EQ(answering.replays, 1) << "the in-place answer's graph did not replay";
            } else if (in_place && same_place == 1 && li == 0) {
              EXPECT_EQ(answering.replays, 0) << "a moved answer replayed an earlier graph";
            }
          }
        }

        // A NaN weight in device q (in the buffer past the answers) with the answer in place
        // (or copied, sharded): INVALID_ARGUMENT naming the field, nothing committed, nothing
        // written outside the answer's span (which may hold rows of the uncommitted answer:
        // answer_sink.h), though the kernel section replays its graph; the same step clean then
        // answers as the twin that never saw it.
        const size_t Q = 512 * 1024;
        for (const size_t requests : {size_t{4}, size_t{3}}) {
          const std::vector<uint64_t> ids(all_ids.begin(), all_ids.begin() + requests);
          for (size_t li = 0; li < p.layers.size(); ++li) {
            const config::LayerSpec& layer = p.layers[li];
            // Two clean steps (eager and captured with graphs on), then the bad one (replayed).
            for (int attempt = 0; attempt < 3; ++attempt) {
              SCOPED_TRACE(absl::StrCat("NaN steps: ", requests, " requests, layer ", layer.layer,
                                        " attempt ", attempt));
              const bool bad = attempt == 2;
              std::unique_ptr<StepData> step = DeviceQStep(h, layer, ids, 1, KeyForm::kF32);
              const size_t rows = size_t(step->input.num_rows);
              const size_t bytes = rows * K * sizeof(int32_t);
              std::vector<int32_t> candidates;
              if (step->input.return_candidates) {
                candidates.assign(rows * size_t(p.num_candidate_blocks), -7);
              }
              const exec::AnswerSink sink =
                  exec::AnswerSink::Device(reinterpret_cast<int32_t*>(rig.buffer.at(A)),
                                           candidates.empty() ? nullptr : candidates.data());
              exec::StepInput on = step->input;
              const ClientBuffer::Placed placed = rig.buffer.Place(*step, Q, on);
              on.answer = &sink;
              std::memset(rig.buffer.at(0), kPoison, kAnswerArea);
              if (bad) {
                const float nan = std::numeric_limits<float>::quiet_NaN();
                std::memcpy(rig.buffer.at(placed.weights +
                                          ((rows - 1) * size_t(p.num_heads) + 1) * sizeof(float)),
                            &nan, sizeof(float));
                const std::string before = DeviceQRig::Infos(*rig.device, all_ids);
                rig.Reset();
                absl::StatusOr<StepResult> r = rig.device->DecodeStep(on);
                EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
                const std::string message(r.status().message());
                EXPECT_NE(message.find("weights.data"), std::string::npos) << message;
                EXPECT_NE(message.find("committed nothing"), std::string::npos) << message;
                EXPECT_EQ(DeviceQRig::Infos(*rig.device, all_ids), before);
                if (graphs) {
                  EXPECT_EQ(rig.devices[0]->recorder().replays, 1);
                }
                for (size_t i = bytes; i < kAnswerArea; ++i) {
                  ASSERT_EQ(*rig.buffer.at(i), kPoison) << "byte " << i << " past the answer";
                }
                // The same step, clean.
                on = step->input;
                rig.buffer.Place(*step, Q, on);
                on.answer = &sink;
              }
              absl::StatusOr<StepResult> got = rig.device->DecodeStep(on);
              ASSERT_TRUE(got.ok()) << got.status();
              absl::StatusOr<StepResult> want = rig.host->DecodeStep(step->input);
              ASSERT_TRUE(want.ok()) << want.status();
              h.RecordStep(*step);
              std::vector<int32_t> answer(rows * K);
              std::memcpy(answer.data(), rig.buffer.at(A), bytes);
              EXPECT_EQ(answer, want->topk_indices);
              EXPECT_EQ(candidates, want->candidate_blocks);
              EXPECT_EQ(got->lengths, want->lengths);
            }
          }
        }
        EXPECT_EQ(DeviceQRig::Infos(*rig.device, all_ids), DeviceQRig::Infos(*rig.host, all_ids));
        EXPECT_EQ(rig.violations.load(), 0);
        if (graphs) {
          EXPECT_GT(rig.device->Status().graph_captures, 0u);
          EXPECT_GT(rig.device->Status().graph_replays, 0u);
        }
      }
    }
  }
}

// A CPU backend that passes for a device backend (its name is not "cpu"), so the ranks take
// the GPU's host paths in CI: uploads through the page-locked staging arena, answers through
// the readback space (copied on after the Synchronize), each rank's slice of the page table.
// Host memory it hands out is filled with a poison byte, so a path that read staging or
// readback bytes it never wrote would change the answers.
class StagedCpuDevice final : public kernels::DeviceWrapper {
 public:
  explicit StagedCpuDevice(kernels::Device& inner) : DeviceWrapper(inner) {}
  std::string_view name() const override { return "staged-cpu"; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::StatusOr<void*> p = target().Allocate(bytes);
    if (p.ok()) std::memset(*p, 0xA5, bytes);  // "device" memory starts as garbage too
    return p;
  }
  absl::StatusOr<void*> AllocateHost(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (p == nullptr) return absl::ResourceExhaustedError("malloc");
    std::memset(p, 0x5A, bytes);
    ++host_allocations;
    return p;
  }
  void FreeHost(void* ptr) override { std::free(ptr); }

  std::atomic<int32_t> host_allocations{0};
};

// The CPU backend with a StagedCpuDevice; `device_out`, where given, receives the device.
std::unique_ptr<kernels::Backend> MakeStagedCpuBackend(const kernels::BackendLimits& limits,
                                                       StagedCpuDevice** device_out = nullptr) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(limits, 1);
  auto device = std::make_unique<StagedCpuDevice>(cpu->device());
  if (device_out != nullptr) *device_out = device.get();
  return kernels::ComposeBackend(std::move(cpu), std::move(device), nullptr);
}

// The device backends' host paths (staging, readback, resident page tables, inputs
// already page-locked, answers deferred into the result's vectors or copied on into the
// caller's buffers) answer bit for bit as the plain CPU backend, at 1, 2 and 4 ranks,
// sharded with direct answers and all-gathered.
TEST(MultiRankCpu, StagedCopiesAnswerAsPlainCopies) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    SCOPED_TRACE(p.name);
    Script s{p, 16, {1, 2}, 1, 3 * p.topk};
    s.rounds = 2;
    const RunResult base = RunScript(s, CpuOptions(1), seed);
    ASSERT_GT(base.steps, 0);
    EXPECT_GT(base.answered, base.steps * s.requests);
    for (bool page_locked : {false, true}) {
      for (bool direct : {true, false}) {
        for (Script::Sink sink : {Script::Sink::kVector, Script::Sink::kHost}) {
          for (int32_t ranks : {1, 2, 4}) {
            SCOPED_TRACE(absl::StrCat(ranks, " staged ranks, direct ", direct, ", page-locked ",
                                      page_locked, ", sink ", SinkName(sink)));
            ExecutorOptions o = CpuOptions(ranks);
            o.direct_answers = direct;
            o.pinned_staging = true;
            std::vector<StagedCpuDevice*> made_backends;
            auto factory = [&made_backends](int32_t, const kernels::BackendLimits& limits)
                -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
              StagedCpuDevice* device = nullptr;
              std::unique_ptr<kernels::Backend> b = MakeStagedCpuBackend(limits, &device);
              made_backends.push_back(device);
              return b;
            };
            absl::StatusOr<std::unique_ptr<Executor>> made =
                exec::CreateExecutorWithBackends(p, o, factory);
            ASSERT_TRUE(made.ok()) << made.status();
            Script staged = s;
            staged.page_locked_inputs = page_locked;
            staged.sink = sink;
            const RunResult r = RunScript(staged, **made, seed);
            EXPECT_EQ(r.steps, base.steps);
            EXPECT_EQ(r.sharded, ranks > 1 ? r.steps : 0);
            EXPECT_TRUE(r.answers == base.answers) << "staged copies change the answers";
            // Every rank took the page-locked paths: a staging arena and a readback space, and
            // nothing else (the page tables are resident in each rank's backend memory).
            ASSERT_EQ(made_backends.size(), size_t(ranks));
            for (size_t b = 0; b < made_backends.size(); ++b) {
              EXPECT_EQ(made_backends[b]->host_allocations.load(), 2) << "rank " << b;
            }
          }
        }
      }
    }
  }
}

// An executor over StagedCpuDevices (page-locked staging and readback, so answers are
// deferred into the readback space) or plain CPU backends (no readback space).
std::unique_ptr<Executor> MakeCpuExecutor(const config::Profile& p, const ExecutorOptions& o,
                                          bool staged) {
  absl::StatusOr<std::unique_ptr<Executor>> made;
  if (staged) {
    ExecutorOptions so = o;
    so.pinned_staging = true;
    made =
        exec::CreateExecutorWithBackends(p, so,
                                         [](int32_t, const kernels::BackendLimits& limits)
                                             -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
                                           return MakeStagedCpuBackend(limits);
                                         });
  } else {
    made = Executor::Create(p, o);
  }
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? *std::move(made) : nullptr;
}

// Item 4 of issue 12: every kind of AnswerSink (a host span, page-locked or not, a device
// span, the encoder) answers bit for bit as the result's vectors, on backends with and
// without readback space, at 1, 2, 4 and 8 ranks (sharded, each rank writing its own rows, or
// all-gathered for a device span).
TEST(MultiRankCpu, EverySinkAnswersAsTheVectors) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& p : {SmallV32(), SmallV41()}) {
    SCOPED_TRACE(p.name);
    Script s{p, 16, {1, 2}, 1, 3 * p.topk};
    const RunResult base = RunScript(s, CpuOptions(1), seed);
    ASSERT_GT(base.steps, 0);
    EXPECT_GT(base.answered, base.steps * s.requests);
    for (bool staged : {false, true}) {
      for (Script::Sink sink : kAllSinks) {
        for (int32_t ranks : {1, 2, 4, 8}) {
          SCOPED_TRACE(absl::StrCat(ranks, " ranks, ", staged ? "staged" : "plain", ", sink ",
                                    SinkName(sink)));
          std::unique_ptr<Executor> e = MakeCpuExecutor(p, CpuOptions(ranks), staged);
          ASSERT_NE(e, nullptr);
          Script with = s;
          with.sink = sink;
          const RunResult r = RunScript(with, *e, seed);
          EXPECT_EQ(r.steps, base.steps);
          EXPECT_EQ(r.sharded, ranks > 1 ? r.steps : 0);
          EXPECT_TRUE(r.answers == base.answers) << "the sink changes the answers";
        }
      }
    }
  }
}

// A failed step commits nothing and leaves a caller's sink as AnswerSink documents: the
// encoder is never called; a span holds, row by row, either what it held before or that row
// of the uncommitted answer (here the answer the same step gives when it runs again), and a
// step that failed before any rank copied (one rank, failing before scoring) leaves it
// untouched. Failures: the caller's check refusing right before the commit (all rows were
// copied), and an injected rank error (at 2 ranks the other rank may have copied its rows).
TEST(MultiRankCpu, AFailedStepCommitsNothingAndLeavesTheSinkAsDocumented) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const config::Profile p = SmallV32();
  const int32_t layer = p.layers[0].layer;
  for (bool staged : {false, true}) {
    for (Script::Sink sink : kAllSinks) {
      for (int32_t ranks : {1, 2}) {
        for (bool refused : {true, false}) {
          SCOPED_TRACE(absl::StrCat(ranks, " ranks, ", staged ? "staged" : "plain", ", sink ",
                                    SinkName(sink),
                                    refused ? ", refused by the caller" : ", rank error"));
          std::unique_ptr<Executor> e = MakeCpuExecutor(p, CpuOptions(ranks), staged);
          std::unique_ptr<Executor> ref = MakeCpuExecutor(p, CpuOptions(1), false);
          ASSERT_TRUE(e != nullptr && ref != nullptr);
          Harness h(p, seed);
          std::vector<SeqPlan> plans;
          for (uint64_t id = 1; id <= 8; ++id) {
            ASSERT_TRUE(e->CreateSequence(id).ok());
            ASSERT_TRUE(ref->CreateSequence(id).ok());
            std::vector<uint8_t> keys, scales;
            exec::KeysInput in;
            const int32_t count = 2 * p.topk + int32_t(id) * 5;
            h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
            in.count = count;
            in.keys = keys.data();
            in.scales = scales.empty() ? nullptr : scales.data();
            ASSERT_TRUE(e->AppendKeys(id, layer, in).ok());
            ASSERT_TRUE(ref->AppendKeys(id, layer, in).ok());
            h.RecordAppend(id, layer, in);
            plans.push_back({id, 2, 2, {}});
          }
          auto lengths = [&](Executor& x) {
            std::vector<int64_t> out;
            for (const SeqPlan& sp : plans) {
              absl::StatusOr<exec::SequenceInfo> info = x.GetSequence(sp.id);
              EXPECT_TRUE(info.ok());
              if (info.ok()) out.push_back(info->caches.at(0).length);
            }
            return out;
          };
          const std::vector<int64_t> before = lengths(*e);
          std::unique_ptr<StepData> step = h.MakeStep(layer, plans);
          CallerSink failed(sink, step->input, p);
          step->input.answer = sink == Script::Sink::kVector ? nullptr : &failed.sink;
          if (refused) {
            step->input.call_check = [] { return absl::DeadlineExceededError("gave up"); };
          } else {
            InjectFault(*e, {ranks - 1, false, 0, false});
          }
          absl::StatusOr<StepResult> r = e->DecodeStep(step->input);
          ASSERT_FALSE(r.ok());
          EXPECT_EQ(r.status().code(),
                    refused ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kInternal)
              << r.status();
          EXPECT_EQ(lengths(*e), before) << "a failed step moved the lengths";
          EXPECT_EQ(failed.encoder_calls, 0) << "a failed step called the encoder";
          EXPECT_TRUE(failed.encoded.empty());

          // The same step again, through a fresh sink: it answers as an executor that never
          // saw the failure (nothing of it was committed).
          step->input.call_check = nullptr;
          exec::StepInput plain = step->input;
          plain.answer = nullptr;
          absl::StatusOr<StepResult> want = ref->DecodeStep(plain);
          ASSERT_TRUE(want.ok()) << want.status();
          CallerSink again(sink, step->input, p);
          step->input.answer = sink == Script::Sink::kVector ? nullptr : &again.sink;
          absl::StatusOr<StepResult> got = e->DecodeStep(step->input);
          ASSERT_TRUE(got.ok()) << got.status();
          const std::vector<int32_t>& answer =
              sink == Script::Sink::kVector ? got->topk_indices : again.TopK();
          EXPECT_TRUE(answer == want->topk_indices) << "the failed step left state behind";
          EXPECT_EQ(lengths(*e), lengths(*ref));

          // What the failed step left in a span.
          if (sink == Script::Sink::kVector || sink == Script::Sink::kEncoder) continue;
          const size_t k = size_t(p.topk);
          int32_t rows_written = 0;
          for (size_t row = 0; row * k < failed.answer.size(); ++row) {
            const auto first = failed.answer.begin() + row * k;
            const bool untouched = std::all_of(first, first + k, [](int32_t v) { return v == -7; });
            const bool whole = std::equal(first, first + k, want->topk_indices.begin() + row * k);
            EXPECT_TRUE(untouched || whole) << "row " << row << " holds neither";
            rows_written += !untouched;
          }
          if (!refused && ranks == 1) {
            EXPECT_EQ(rows_written, 0) << "a step that failed before scoring wrote rows";
          }
        }
      }
    }
  }
}

// The length buckets that key the graphs: an upper bound on the length (so the kernels'
// grids and workspaces cover every row), never past the cap unless the length is, at most 25%
// over the length past the first bucket (bounded wasted work), monotone and idempotent (a
// length inside a bucket keeps it), and few (a decode growing from 1 to 160K tokens
// captures a graph for a handful of buckets only).
TEST(MultiRankCpu, LengthBucketsBoundTheLengthAndAreFew) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (int64_t cap : {int64_t{1024}, int64_t{163840}, int64_t{1048576}}) {
    SCOPED_TRACE(absl::StrCat("cap ", cap));
    std::vector<int32_t> lengths;
    for (int i = 0; i < 2000; ++i) lengths.push_back(1 + static_cast<int32_t>(rng() % cap));
    std::sort(lengths.begin(), lengths.end());
    int32_t previous = 0;
    for (int32_t length : lengths) {
      const int32_t b = exec::BucketRowLength(length, cap);
      ASSERT_GE(b, length);
      ASSERT_LE(b, std::max<int64_t>(cap, length));
      ASSERT_LE(b, std::max<double>(4096, 1.25 * length));
      ASSERT_GE(b, previous) << "buckets must not shrink as lengths grow";
      ASSERT_EQ(exec::BucketRowLength(b, cap), b);
      previous = b;
    }
  }
  std::set<int32_t> buckets;
  for (int32_t length = 1; length <= 163840; ++length) {
    buckets.insert(exec::BucketRowLength(length, 163840));
  }
  EXPECT_LT(buckets.size(), 30u);
  EXPECT_GT(buckets.size(), 5u);  // it does bucket: not one bound for everything
}

// A sharded step with one rank failing: INTERNAL for the step, naming the failing rank. With a
// collective in the step (answers all-gathered), every rank fails (the others with the
// agreement's copy); with direct answers (no collective in a dense step) the others finish
// their rows and only the failing rank's status is an error.
void ExpectFaultOnEveryRank(Executor& e, Harness& h, const std::vector<uint64_t>& ids,
                            int32_t failing, bool hang, absl::StatusCode later, bool direct = false,
                            bool device = false) {
  std::vector<SeqPlan> plans;
  for (uint64_t id : ids) plans.push_back({id, 2, 2, {}});
  std::unique_ptr<StepData> step = h.MakeStep(0, plans);
  InjectFault(e, {failing, hang, 0, device});
  absl::StatusOr<StepResult> r = e.DecodeStep(step->input);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_NE(r.status().message().find(absl::StrCat("rank ", failing)), std::string::npos)
      << r.status();
  const std::vector<absl::Status> per_rank = exec::LastRankStatuses(e);
  ASSERT_EQ(per_rank.size(), size_t(e.Status().num_ranks));
  for (size_t rank = 0; rank < per_rank.size(); ++rank) {
    const bool fails = !direct || int32_t(rank) == failing;
    EXPECT_EQ(per_rank[rank].code(), fails ? absl::StatusCode::kInternal : absl::StatusCode::kOk)
        << "rank " << rank << ": " << per_rank[rank];
  }
  // How it ended, from the ranks' statuses rather than a clock: a hang ends at the
  // collective timeout (some rank reports having waited it out), anything else at once (the
  // agreement or the abort told every rank; none waited for the timeout).
  bool timed_out = false;
  for (const absl::Status& st : per_rank) {
    timed_out |= st.message().find("ms for the other ranks") != std::string::npos ||  // host
                 st.message().find("did not finish within") != std::string::npos;     // NCCL
  }
  EXPECT_EQ(timed_out, hang) << r.status();
  // What comes next.
  std::unique_ptr<StepData> again = h.MakeStep(0, plans);
  absl::StatusOr<StepResult> next = e.DecodeStep(again->input);
  if (later == absl::StatusCode::kOk) {
    EXPECT_TRUE(next.ok()) << next.status();
    EXPECT_TRUE(e.Status().healthy);
  } else {
    EXPECT_EQ(next.status().code(), later) << next.status();
    EXPECT_FALSE(e.Status().healthy);
    EXPECT_FALSE(e.Status().health_detail.empty());
    std::vector<uint8_t> keys, scales;
    exec::KeysInput in;
    h.RandomKeys(0, 4, KeyForm::kF32, &keys, &scales, &in.type);
    in.count = 4;
    in.keys = keys.data();
    EXPECT_EQ(e.AppendKeys(ids[0], 0, in).status().code(), later);
  }
}

std::unique_ptr<Executor> Prefilled(const config::Profile& p, const ExecutorOptions& o, Harness& h,
                                    std::vector<uint64_t>* ids, int32_t requests, int32_t length) {
  absl::StatusOr<std::unique_ptr<Executor>> made = Executor::Create(p, o);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return nullptr;
  for (int32_t i = 0; i < requests; ++i) {
    EXPECT_TRUE((*made)->CreateSequence(i + 1).ok());
    ids->push_back(i + 1);
    for (int32_t layer : p.CacheLayers()) {
      AppendRandom(h, **made, i + 1, layer, length + int32_t(h.rng()() % length));
    }
  }
  return *std::move(made);
}

TEST(MultiRankCpu, InjectedErrorFailsEveryRankAndIsRecoverable) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Harness h(SmallV32(), seed);
  for (bool direct : {true, false}) {
    for (int32_t failing : {1, 0}) {
      SCOPED_TRACE(absl::StrCat("failing rank ", failing, direct ? " direct" : " gathered"));
      ExecutorOptions o = CpuOptions(2);
      o.direct_answers = direct;
      std::vector<uint64_t> ids;
      std::unique_ptr<Executor> e = Prefilled(h.profile(), o, h, &ids, 8, 40);
      ASSERT_NE(e, nullptr);
      ExpectFaultOnEveryRank(*e, h, ids, failing, /*hang=*/false, absl::StatusCode::kOk, direct);
    }
  }
}

TEST(MultiRankCpu, InjectedHangEndsAtTheTimeoutAndTurnsUnhealthy) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Harness h(SmallV32(), seed);
  ExecutorOptions o = CpuOptions(4);
  // Long enough that a slow (sanitized, loaded) rank still reaches the agreement in time.
  o.collective_timeout_ms = 1500;
  // A hang is a rank that never joins the all-gather: a dense step has one only when its
  // answer is all-gathered (with direct answers it has no collective to hang in).
  o.direct_answers = false;
  std::vector<uint64_t> ids;
  std::unique_ptr<Executor> e = Prefilled(h.profile(), o, h, &ids, 8, 40);
  ASSERT_NE(e, nullptr);
  ExpectFaultOnEveryRank(*e, h, ids, 2, /*hang=*/true, absl::StatusCode::kUnavailable);
}

// A device fault found after the ranks agreed (the synchronize that waits for a rank's own
// kernels fails while the others may already wait in the all-gather): the failing rank aborts
// the collective, so every rank returns INTERNAL at once, not at the collective timeout (20 s
// here), and the executor turns unhealthy.
TEST(MultiRankCpu, InjectedDeviceFaultAfterTheAgreementAbortsAtOnce) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Harness h(SmallV32(), seed);
  for (int32_t failing : {1, 0}) {
    SCOPED_TRACE(absl::StrCat("failing rank ", failing));
    ExecutorOptions o = CpuOptions(2);
    o.collective_timeout_ms = 20000;
    o.direct_answers = false;  // the answer's all-gather is the collective to wait in
    std::vector<uint64_t> ids;
    std::unique_ptr<Executor> e = Prefilled(h.profile(), o, h, &ids, 8, 40);
    ASSERT_NE(e, nullptr);
    ExpectFaultOnEveryRank(*e, h, ids, failing, /*hang=*/false, absl::StatusCode::kUnavailable,
                           /*direct=*/false, /*device=*/true);
  }
}

// DI_INJECT_FAULT (server/testing/fault_injection.h, read when a test asks): RANK:KIND:STEP
// fails the STEP-th decode step from then on RANK, and only that step; a malformed value
// injects nothing.
TEST(MultiRankCpu, FaultFromTheEnvironmentFailsTheStepItNames) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  EXPECT_FALSE(FaultFromSpec("1:crash").has_value());
  EXPECT_FALSE(FaultFromSpec("").has_value());
  Harness h(SmallV32(), seed);
  std::vector<uint64_t> ids;
  std::unique_ptr<Executor> e = Prefilled(h.profile(), CpuOptions(2), h, &ids, 4, 40);
  ASSERT_NE(e, nullptr);
  ASSERT_EQ(setenv("DI_INJECT_FAULT", "1:error:1", 1), 0);
  const bool injected = InjectFaultFromEnv(*e);
  unsetenv("DI_INJECT_FAULT");
  ASSERT_TRUE(injected);
  std::vector<SeqPlan> plans;
  for (uint64_t id : ids) plans.push_back({id, 1, 1, {}});
  for (int32_t step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::unique_ptr<StepData> data = h.MakeStep(0, plans);
    absl::StatusOr<StepResult> r = e->DecodeStep(data->input);
    if (step != 1) {
      EXPECT_TRUE(r.ok()) << r.status();
      continue;
    }
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
    EXPECT_NE(r.status().message().find("injected fault on rank 1"), std::string::npos)
        << r.status();
  }
}

// The seam's observer (server/exec/step_hooks.h): every rank of a decode step passes its
// marks in order, the executor its step marks, and a failed step never reaches kCommitted;
// with no observer set nothing is told. Counts and order only: no clock.
class RecordingObserver final : public exec::StepObserver {
 public:
  explicit RecordingObserver(int32_t ranks) : ranks_(size_t(ranks)) {}
  void OnStep(StepMark mark) override {
    std::lock_guard lock(mu_);
    steps_.push_back(mark);
  }
  void OnRank(int32_t rank, RankMark mark) override {
    std::lock_guard lock(mu_);
    ranks_[size_t(rank)].push_back(mark);
  }
  std::vector<StepMark> steps_;
  std::vector<std::vector<RankMark>> ranks_;
  std::mutex mu_;
};

TEST(MultiRankCpu, StepObserverSeesEveryMarkInOrder) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  using StepMark = exec::StepObserver::StepMark;
  using RankMark = exec::StepObserver::RankMark;
  Harness h(SmallV32(), seed);
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct answers" : "answers all-gathered");
    ExecutorOptions o = CpuOptions(2);
    o.direct_answers = direct;
    std::vector<uint64_t> ids;
    std::unique_ptr<Executor> e = Prefilled(h.profile(), o, h, &ids, 8, 40);
    ASSERT_NE(e, nullptr);
    std::vector<SeqPlan> plans;
    for (uint64_t id : ids) plans.push_back({id, 2, 2, {}});
    auto observer = std::make_shared<RecordingObserver>(2);
    exec::SetStepObserver(*e, observer);
    std::unique_ptr<StepData> step = h.MakeStep(0, plans);
    absl::StatusOr<StepResult> r = e->DecodeStep(step->input);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(observer->steps_, (std::vector<StepMark>{StepMark::kPlan, StepMark::kFanOut,
                                                       StepMark::kJoined, StepMark::kCommitted}));
    // Scored before the collectives where the step has one, else at the rank's end.
    const bool gathered = r->sharded && !direct;
    std::vector<RankMark> want = {RankMark::kStepBegin, RankMark::kUploadsBegin,
                                  RankMark::kLaunchBegin, RankMark::kLaunchEnd};
    if (gathered) want.push_back(RankMark::kScored);
    for (RankMark m : {RankMark::kCopiesBegin, RankMark::kWaitBegin, RankMark::kWaitEnd}) {
      want.push_back(m);
    }
    if (!gathered) want.push_back(RankMark::kScored);
    for (int32_t rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(observer->ranks_[size_t(rank)], want) << "rank " << rank;
    }
    // A failed step: marks up to the join, never the commit.
    observer->steps_.clear();
    InjectFault(*e, {.rank = 1});
    std::unique_ptr<StepData> failing = h.MakeStep(0, plans);
    EXPECT_FALSE(e->DecodeStep(failing->input).ok());
    EXPECT_EQ(observer->steps_,
              (std::vector<StepMark>{StepMark::kPlan, StepMark::kFanOut, StepMark::kJoined}));
    // Unset: nothing is told.
    exec::SetStepObserver(*e, nullptr);
    observer->steps_.clear();
    observer->ranks_.assign(2, {});
    std::unique_ptr<StepData> quiet = h.MakeStep(0, plans);
    EXPECT_TRUE(e->DecodeStep(quiet->input).ok());
    EXPECT_TRUE(observer->steps_.empty());
    EXPECT_TRUE(observer->ranks_[0].empty() && observer->ranks_[1].empty());
  }
}

// ---------------------------------------------------------------------------------------
// CUDA backend with NCCL, two GPUs.

#define SKIP_WITHOUT_TWO_GPUS()                                                            \
  do {                                                                                     \
    if (!kHaveNccl) GTEST_SKIP() << "built without NCCL: the multi-GPU tests are skipped"; \
    if (kernels::CudaDeviceCount() < 2) {                                                  \
      GTEST_SKIP() << "fewer than 2 GPUs visible (" << kernels::CudaDeviceCount()          \
                   << "): the multi-GPU tests are skipped";                                \
    }                                                                                      \
  } while (0)

#ifdef DI_HAVE_NCCL
constexpr bool kHaveNccl = true;
#else
constexpr bool kHaveNccl = false;
#endif

ExecutorOptions GpuOptions(int32_t ranks) {
  ExecutorOptions o;
  o.backend = "cuda";
  o.ranks = ranks;
  o.cache_pages = 4096;
  o.row_shard_min_requests = 2;
  o.max_sequences = 64;
  o.max_requests_per_step = 32;
  o.collective_timeout_ms = 5000;
  return o;
}

config::Profile GpuV32() { return FullWidthV32(8192); }
config::Profile GpuV41() { return FullWidthV41(8192); }

TEST(MultiGpu, ShardedTwoRanksMatchOneRankV32) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Script s{GpuV32(), 16, {1, 2}, 2500, 5000};
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct answers" : "answers all-gathered");
    ExecutorOptions o = GpuOptions(1);
    o.direct_answers = direct;
    ExpectRanksAgree(s, o, {1, 2}, seed);
  }
}

TEST(MultiGpu, ShardedTwoRanksMatchOneRankV41AndOverlapOnOffAgree) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Script s{GpuV41(), 16, {1, 2}, 2500, 5000};
  ExecutorOptions o = GpuOptions(1);
  o.candidate_overlap = true;
  ExpectRanksAgree(s, o, {1, 2}, seed);
  // Overlap off, on one and two ranks, against overlap on at one rank.
  o.ranks = 1;
  const RunResult on = RunScript(s, o, seed);
  for (int32_t ranks : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("overlap off, ", ranks, " ranks"));
    ExecutorOptions off = GpuOptions(ranks);
    off.candidate_overlap = false;
    EXPECT_TRUE(RunScript(s, off, seed).answers == on.answers);
  }
}

// CUDA graphs across ranks: --ranks 2 with graphs on (every step sharded, each rank replaying
// its own slice's graphs) answers bit for bit as --ranks 1 with graphs off, over rounds that
// repeat every layer's shape; the replay counter must grow.
TEST(MultiGpu, TwoRanksWithGraphsMatchOneRankEager) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& p : {GpuV32(), GpuV41()}) {
    SCOPED_TRACE(p.name);
    Script s{p, 16, {1, 2}, 2500, 5000};
    s.rounds = 4;
    ExecutorOptions eager = GpuOptions(1);
    eager.cuda_graphs = false;
    const RunResult base = RunScript(s, eager, seed);
    ASSERT_GT(base.steps, 0);
    EXPECT_EQ(base.graph_replays, 0u);
    EXPECT_GT(base.answered, base.steps * s.requests);
    ExecutorOptions graphs = GpuOptions(2);
    graphs.cuda_graphs = true;
    const RunResult r = RunScript(s, graphs, seed);
    EXPECT_EQ(r.steps, base.steps);
    EXPECT_EQ(r.sharded, r.steps) << "every step of the script should shard";
    EXPECT_GT(r.graph_captures, 0u);
    // Each layer's shape is seen 4 times per next_n on each rank: at least one replay per
    // rank unless a length bucket changed in between, which cannot happen for every shape.
    EXPECT_GE(r.graph_replays, uint64_t{2} * p.layers.size());
    EXPECT_TRUE(r.answers == base.answers) << "2 ranks with graphs differ from 1 rank eager";
  }
}

TEST(MultiGpu, InjectedErrorFailsEveryRankAndTurnsUnhealthy) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Harness h(GpuV32(), seed);
  std::vector<uint64_t> ids;
  std::unique_ptr<Executor> e = Prefilled(h.profile(), GpuOptions(2), h, &ids, 8, 600);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Status().collective, "nccl");
  // Direct answers (the default): rank 0 finishes its rows, the step fails with rank 1's
  // INTERNAL and a CUDA INTERNAL turns the executor unhealthy.
  ExpectFaultOnEveryRank(*e, h, ids, 1, /*hang=*/false, absl::StatusCode::kUnavailable,
                         /*direct=*/true);
}

// A device fault after the agreement on NCCL ranks: the failing rank's abort (ncclCommAbort)
// wakes the rank waiting inside ncclAllGather at once, long before the 20 s watchdog bound.
TEST(MultiGpu, InjectedDeviceFaultAfterTheAgreementAbortsAtOnce) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Harness h(GpuV32(), seed);
  ExecutorOptions o = GpuOptions(2);
  o.collective_timeout_ms = 20000;
  o.direct_answers = false;
  std::vector<uint64_t> ids;
  std::unique_ptr<Executor> e = Prefilled(h.profile(), o, h, &ids, 8, 600);
  ASSERT_NE(e, nullptr);
  ExpectFaultOnEveryRank(*e, h, ids, 1, /*hang=*/false, absl::StatusCode::kUnavailable,
                         /*direct=*/false, /*device=*/true);
}

TEST(MultiGpu, InjectedHangIsAbortedByTheWatchdog) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  Harness h(GpuV32(), seed);
  ExecutorOptions o = GpuOptions(2);
  o.collective_timeout_ms = 1000;
  o.direct_answers = false;  // the all-gather to hang in (see the CPU test)
  std::vector<uint64_t> ids;
  std::unique_ptr<Executor> e = Prefilled(h.profile(), o, h, &ids, 8, 600);
  ASSERT_NE(e, nullptr);
  ExpectFaultOnEveryRank(*e, h, ids, 0, /*hang=*/true, absl::StatusCode::kUnavailable);
  // Rank 1 waited inside ncclAllGather for rank 0: only the watchdog's abort can end that.
  const std::vector<absl::Status> per_rank = exec::LastRankStatuses(*e);
  ASSERT_EQ(per_rank.size(), 2u);
  EXPECT_NE(per_rank[1].message().find("did not finish within 1000 ms"), std::string::npos)
      << per_rank[1];
}

}  // namespace
}  // namespace decode_indexer::testing
