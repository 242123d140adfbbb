// decode-indexer-bench-multigpu: the executor's per-layer decode step time at --ranks 1 vs 2
// (or any list), driven directly (no gRPC), so the numbers are the executor's own: host
// planning, uploads, the kernels on every rank, the all-gather and the answer's copy back.
//
//   v32 dense: requests x context x next_n, step time, steps/s, the collectives' share.
//   v41: one round of the candidate source and four consumers, overlap on vs off; then the
//   expansion alone (CUDA builds: the expansion kernel timed with events on an otherwise idle
//   stream, over the source's real candidates) and the share of it the overlap hides:
//   (round us overlap off - round us overlap on) / expansion us.
//   Both: CUDA graphs on vs off (--graphs), page-locked staging on vs off (--pinned); v32:
//   direct answer copies vs rank 0's all-gather (--direct; v41 uses the first value).
//   v32 also prints where a step goes (executor planning, fan-out, commit; the slowest rank's
//   uploads, kernel issue, answer copies and final wait), and v41 the overlap measured with
//   the backend's own fork/join events (BenchClocks::LastOverlapTiming).
//
// Keys and q are pre-quantized random codes (FP8 e4m3 / FP4 e2m1, never NaN), appended once
// per executor; the timed steps score explicit causal row lengths, so one prefill at the
// longest context serves every shorter one. By default they carry no new keys; with
// --new-keys N (v32) each step also appends N keys to every sequence, as a decode step that
// carries its token's index key does (the append's planning, staging and insert kernel in the
// step's time; the rows still score the first `context` keys, so the kernels' work does not
// grow, and max_context and the pool leave room for every step's keys). Prints markdown
// tables.
//
// --backend host: the executor's host side alone (planning, staging, hand-offs, commit) on
// a backend whose kernels do nothing and whose "device" memory is host memory (copies are
// memcpy): what a step costs outside the device, measurable on any machine at full shape.
//
// Usage: decode-indexer-bench-multigpu [--backend cuda|cpu|host] [--ranks 1,2] [--requests 64,128]
//        [--contexts 32768,65536] [--next-n 1,2] [--steps 20] [--v41-requests 64]
//        [--v41-context 32768] [--skip-v32] [--skip-v41] [--graphs on,off] [--pinned on]
//        [--direct on,off] [--packed on|off] [--answer vector,host,pinned,pinned-q,device-q]
//        [--answer-in-place on|off] [--new-keys N]
//
// --answer (v32; v41 uses the first value): where the timed steps' answers go. vector:
// StepResult's vectors (the executor's fallback, the path before AnswerSink); host: a
// caller-owned, reused pageable span (AnswerSink::Host, like a gRPC response's bytes); pinned:
// a caller-owned, reused span in a registered (page-locked) region, as a serving frontend
// with a registered shared-memory region passes it; pinned-q: that region holds q and the
// weights too (StepInput::host_memory_page_locked: q is not staged); device-q: q, the weights
// and the answer in the answering backend's device memory (QInput::on_device, a device
// AnswerSink): an attention worker's CUDA IPC buffer, in process.
// --packed (default on): ExecutorOptions::packed_uploads, a step's small arrays in one upload
// into the rank's device staging ring; off: one copy per array (the path before the ring).
// --answer-in-place (default on): ExecutorOptions::answer_in_place, a device answer (device-q)
// written by the answering rank's top-k itself; off: its device-to-device copy (the path
// before), for a before / after in one run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#ifdef DI_BENCH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/sm90_launchers.h"
#endif
#include <map>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/version_line.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/executor_internal.h"
#include "server/exec/validated_step.h"
#include "server/testing/step_timer.h"

namespace di = decode_indexer;
using di::config::LayerRole;
using di::exec::Executor;
using di::exec::ExecutorOptions;
using di::kernels::CacheFormat;
using di::kernels::ElemType;

namespace {

// --backend host: see the header. Allocations are left untouched (a cache pool at 64 x 64K is
// hundreds of MB of address space, never written: the kernels and key inserts do nothing).
class HostOnlyBackend final : public di::kernels::Backend {
 public:
  std::string_view name() const override { return "host"; }
  std::string description() const override { return "host-only (no kernels)"; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (p == nullptr) return absl::ResourceExhaustedError("malloc");
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status InsertKeys(const di::kernels::KeyInsertArgs&) override { return absl::OkStatus(); }
  absl::Status RopeQuantQ(const di::kernels::QPrepArgs&) override { return absl::OkStatus(); }
  absl::Status DenseTopK(const di::kernels::DenseArgs&) override { return absl::OkStatus(); }
  absl::Status SparseTopK(const di::kernels::SparseArgs&) override { return absl::OkStatus(); }
  absl::Status MaskedTopK(const di::kernels::MaskedArgs&) override { return absl::OkStatus(); }
  absl::Status CopyRows(const di::kernels::CopyRowsArgs&) override { return absl::OkStatus(); }
  absl::Status ForkExpand(const di::kernels::ExpandArgs&) override { return absl::OkStatus(); }
  absl::Status JoinExpand() override { return absl::OkStatus(); }
};

struct Args {
  std::string backend = "cuda";
  std::vector<int> ranks = {1, 2};
  std::vector<int> requests = {64, 128};
  std::vector<int> contexts = {32768, 65536};
  std::vector<int> next_n = {1, 2};
  int steps = 20;
  int warmup = 3;
  int v41_requests = 64;
  int v41_context = 32768;
  bool v32 = true;
  bool v41 = true;
  std::vector<bool> graphs = {true, false};
  std::vector<bool> pinned = {true};
  bool packed = true;           // ExecutorOptions::packed_uploads (--packed on|off)
  bool answer_in_place = true;  // ExecutorOptions::answer_in_place (--answer-in-place on|off)
  int new_keys = 0;             // v32: keys appended to every sequence by each step
  std::vector<bool> direct = {true};
  std::vector<std::string> answers = {"pinned"};
};

std::vector<bool> OnOffList(const char* s) {
  std::vector<bool> out;
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    if (part == "on") out.push_back(true);
    if (part == "off") out.push_back(false);
  }
  return out;
}

std::vector<int> IntList(const char* s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    int v = 0;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", f.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (f == "--help" || f == "-h") {
      std::printf(
          "usage: decode-indexer-bench-multigpu [--backend cuda|cpu|host] [--ranks 1,2] "
          "[--requests 64,128]\n  [--contexts 32768,65536] [--next-n 1,2] [--steps 20] "
          "[--v41-requests 64] [--v41-context 32768]\n  [--skip-v32] [--skip-v41] "
          "[--graphs on,off] [--pinned on] [--direct on,off] [--packed on|off]\n  [--answer "
          "vector,host,pinned,pinned-q,device-q] [--answer-in-place on|off] "
          "[--new-keys N] [--version]\n");
      std::exit(0);
    } else if (f == "--version") {
      std::printf("%s\n", decode_indexer::cli::VersionLine().c_str());
      std::exit(0);
    } else if (f == "--backend")
      a.backend = next();
    else if (f == "--ranks")
      a.ranks = IntList(next());
    else if (f == "--requests")
      a.requests = IntList(next());
    else if (f == "--contexts")
      a.contexts = IntList(next());
    else if (f == "--next-n")
      a.next_n = IntList(next());
    else if (f == "--steps")
      a.steps = std::atoi(next());
    else if (f == "--v41-requests")
      a.v41_requests = std::atoi(next());
    else if (f == "--v41-context")
      a.v41_context = std::atoi(next());
    else if (f == "--skip-v32")
      a.v32 = false;
    else if (f == "--skip-v41")
      a.v41 = false;
    else if (f == "--graphs")
      a.graphs = OnOffList(next());
    else if (f == "--pinned")
      a.pinned = OnOffList(next());
    else if (f == "--packed")
      a.packed = std::string(next()) != "off";
    else if (f == "--answer-in-place")
      a.answer_in_place = std::string(next()) != "off";
    else if (f == "--direct")
      a.direct = OnOffList(next());
    else if (f == "--answer")
      a.answers = absl::StrSplit(next(), ',');
    else if (f == "--new-keys")
      a.new_keys = std::max(0, std::atoi(next()));
    else {
      std::fprintf(stderr, "unknown flag %s (see the source's header)\n", f.c_str());
      std::exit(2);
    }
  }
  return a;
}

// Random bytes that are never an e4m3 NaN (S.1111.111).
void FillFp8(std::mt19937_64& rng, std::vector<uint8_t>& v) {
  for (uint8_t& b : v) {
    b = static_cast<uint8_t>(rng());
    if ((b & 0x7F) == 0x7F) b ^= 1;
  }
}
// ue8m0 scales near 1 (2^-6 .. 2^3), so products stay finite.
void FillScales(std::mt19937_64& rng, std::vector<uint8_t>& v) {
  for (uint8_t& b : v) b = static_cast<uint8_t>(121 + rng() % 10);
}

struct Data {
  std::vector<uint8_t> keys, key_scales;  // one sequence's worth, reused by every sequence
  std::vector<uint8_t> q, q_scales;
  std::vector<float> weights;
};

// Appends `length` keys to every sequence's cache `layer`, in calls of up to 64K keys.
bool Prefill(Executor& e, const di::config::Profile& p, int32_t layer, int requests, int64_t length,
             const Data& d) {
  const bool fp8 = p.layers[layer].cache_format == CacheFormat::kFp8;
  const int64_t vb = fp8 ? p.head_dim : p.head_dim / 2;
  const int64_t sb = fp8 ? 4 : p.head_dim / 32;
  for (int i = 0; i < requests; ++i) {
    for (int64_t done = 0; done < length;) {
      const int64_t n = std::min<int64_t>(65536, length - done);
      di::exec::KeysInput in;
      in.type = fp8 ? ElemType::kFp8E4M3 : ElemType::kFp4E2M1;
      in.count = static_cast<int32_t>(n);
      in.keys = d.keys.data();
      in.scales = d.key_scales.data();
      absl::StatusOr<int64_t> r = e.AppendKeys(i + 1, layer, in);
      if (!r.ok()) {
        std::fprintf(stderr, "append: %s\n", r.status().ToString().c_str());
        return false;
      }
      done += n;
    }
    (void)vb;
    (void)sb;
  }
  return true;
}

Data MakeData(const di::config::Profile& p, CacheFormat format, int64_t keys, int rows,
              uint64_t seed) {
  std::mt19937_64 rng(seed);
  Data d;
  const bool fp8 = format == CacheFormat::kFp8;
  const int64_t H = p.num_heads, D = p.head_dim;
  d.keys.resize(keys * (fp8 ? D : D / 2));
  if (fp8) {
    FillFp8(rng, d.keys);
    std::vector<float> s(keys);
    std::uniform_real_distribution<float> u(0.001f, 0.01f);
    for (float& x : s) x = u(rng);
    d.key_scales.resize(keys * 4);
    std::memcpy(d.key_scales.data(), s.data(), keys * 4);
  } else {
    for (uint8_t& b : d.keys) b = static_cast<uint8_t>(rng());
    d.key_scales.resize(keys * D / 32);
    FillScales(rng, d.key_scales);
  }
  d.q.resize(int64_t(rows) * H * (fp8 ? D : D / 2));
  if (fp8) {
    FillFp8(rng, d.q);
  } else {
    for (uint8_t& b : d.q) b = static_cast<uint8_t>(rng());
    d.q_scales.resize(int64_t(rows) * H * D / 32);
    FillScales(rng, d.q_scales);
  }
  d.weights.resize(int64_t(rows) * H);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (float& w : d.weights) w = n(rng);
  return d;
}

// A step of `requests` sequences x next_n rows over context `context` (explicit causal row
// lengths), each sequence appending `new_keys` keys at its end (FP8 caches; 0: none).
di::exec::StepInput MakeStep(int32_t layer, int requests, int next_n, int context, const Data& d,
                             bool fp4, uint64_t step_id, int new_keys = 0) {
  di::exec::StepInput in;
  in.layer = layer;
  in.step_id = step_id;
  for (int i = 0; i < requests; ++i) {
    di::exec::SequenceStepInput s;
    s.sequence_id = i + 1;
    s.num_rows = next_n;
    for (int j = 0; j < next_n; ++j) s.row_lengths.push_back(context - next_n + 1 + j);
    if (new_keys > 0) {
      s.new_keys.type = ElemType::kFp8E4M3;
      s.new_keys.count = new_keys;
      s.new_keys.keys = d.keys.data();
      s.new_keys.scales = d.key_scales.data();
    }
    in.sequences.push_back(std::move(s));
  }
  in.num_rows = requests * next_n;
  in.q.type = fp4 ? ElemType::kFp4E2M1 : ElemType::kFp8E4M3;
  in.q.q = d.q.data();
  in.q.scales = fp4 ? d.q_scales.data() : nullptr;
  in.q.weights = d.weights.data();
  return in;
}

// A caller's region, reused by every timed step: the answer's span (and with pinned-q the
// step's q and weights), registered with the executor's answering backend where the mode says
// so. Unregistered before the executor goes.
class CallerRegion {
 public:
  CallerRegion(Executor& e, const std::string& mode, size_t answer_bytes, size_t q_bytes)
      : e_(e), mode_(mode) {
    bytes_ = (answer_bytes + q_bytes + 4095) / 4096 * 4096;
    base_ = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes_));
    std::memset(base_, 0, bytes_);  // touched once, like a long-lived region
    answer_ = reinterpret_cast<int32_t*>(base_);
    q_ = base_ + (answer_bytes + 255) / 256 * 256;
    if (mode == "pinned" || mode == "pinned-q") {
      const absl::Status st = e_.WithAnswerDevice(
          [&](di::kernels::Device& be) { return be.RegisterHostMemory(base_, bytes_); });
      registered_ = st.ok();
      if (!st.ok()) std::fprintf(stderr, "register: %s\n", st.ToString().c_str());
    }
    if (mode == "host" || mode == "pinned" || mode == "pinned-q") {
      sink_ = di::exec::AnswerSink::Host(answer_, nullptr, registered_);
    }
    if (mode == "device-q") {
      // The answering backend's own memory standing in for a worker's CUDA IPC buffer.
      const absl::Status st = e_.WithAnswerDevice([&](di::kernels::Device& be) {
        absl::StatusOr<void*> p = be.Allocate(bytes_);
        if (!p.ok()) return p.status();
        device_ = static_cast<uint8_t*>(*p);
        return absl::OkStatus();
      });
      if (!st.ok()) std::fprintf(stderr, "device-q: %s\n", st.ToString().c_str());
      if (device_ != nullptr) {
        sink_ = di::exec::AnswerSink::Device(reinterpret_cast<int32_t*>(device_), nullptr);
      }
    }
  }
  ~CallerRegion() {
    if (device_ != nullptr) {
      (void)e_.WithAnswerDevice([&](di::kernels::Device& be) {
        be.Free(device_);
        return absl::OkStatus();
      });
    }
    if (registered_) {
      (void)e_.WithAnswerDevice(
          [&](di::kernels::Device& be) { return be.UnregisterHostMemory(base_); });
    }
    std::free(base_);
  }
  // Points `in` at the sink (and, pinned-q, at q and weights copied into the region).
  void Use(di::exec::StepInput& in, size_t q_bytes, size_t w_bytes) {
    if (mode_ == "vector") return;
    in.answer = &sink_;
    if (mode_ == "pinned-q") {
      std::memcpy(q_, in.q.q, q_bytes);
      std::memcpy(q_ + q_bytes, in.q.weights, w_bytes);
      in.q.q = q_;
      in.q.weights = reinterpret_cast<const float*>(q_ + q_bytes);
      in.host_memory_page_locked = registered_;
    }
    if (mode_ == "device-q" && device_ != nullptr) {
      uint8_t* q = device_ + (q_ - base_);
      (void)e_.WithAnswerDevice([&](di::kernels::Device& be) {
        absl::Status st = be.CopyToDevice(q, in.q.q, q_bytes);
        if (st.ok()) st = be.CopyToDevice(q + q_bytes, in.q.weights, w_bytes);
        if (st.ok()) st = be.Synchronize();
        return st;
      });
      in.q.q = q;
      in.q.weights = reinterpret_cast<const float*>(q + q_bytes);
      in.q.on_device = true;
    }
  }

 private:
  Executor& e_;
  std::string mode_;
  size_t bytes_ = 0;
  uint8_t* base_ = nullptr;
  int32_t* answer_ = nullptr;
  uint8_t* q_ = nullptr;
  uint8_t* device_ = nullptr;  // device-q: [answer | q | weights] in device memory
  bool registered_ = false;
  di::exec::AnswerSink sink_;
};

struct Timing {
  double step_us = 0;        // mean executor compute time per step
  double collective_us = 0;  // of which the collectives
  double score_us = 0;       // of which the slowest rank's own work, before the collectives
  double replays = 0;        // graph replays per step, summed over the ranks
  // Where a step goes (means, us): the executor's planning, fan-out to the ranks and back,
  // commit; the slowest rank's phases (uploads issued, kernels issued, copies issued, wait).
  double plan_us = 0, ranks_us = 0, commit_us = 0;
  double uploads_us = 0, launch_us = 0, copies_us = 0, wait_us = 0;
  // The slowest rank's scoring kernels (BenchClocks::LastScoringUs, eager steps only; -1: none).
  double kernels_us = -1;
  int kernel_samples = 0;
  // CandidateOverlap, read after each round that had a fork/join pair (means over rounds and
  // ranks): the side stream's expansion span from the fork, the main stream's span until it
  // reached the join, and the hidden share min(1, main / side).
  int overlap_samples = 0;
  double side_us = 0, main_us = 0, hidden = 0;
  bool sharded = false;
  bool ok = false;
};

Timing TimeSteps(Executor& e, const std::vector<di::exec::StepInput>& inputs, int warmup,
                 int steps) {
  Timing t;
  // Validated once before the clocks, as the service's edge does before a step reaches the
  // executor.
  std::vector<di::exec::ValidatedStep> round;
  for (const di::exec::StepInput& in : inputs) {
    absl::StatusOr<di::exec::ValidatedStep> v = di::exec::ValidateStep(e.profile(), in);
    if (!v.ok()) {
      std::fprintf(stderr, "step: %s\n", v.status().ToString().c_str());
      return t;
    }
    round.push_back(*std::move(v));
  }
  // The phase tables' clocks (server/testing/step_timer.h): the executor's StepObserver.
  const std::shared_ptr<di::testing::StepTimer> timer = di::testing::InstallStepTimer(e);
  for (int i = 0; i < warmup; ++i) {
    for (const auto& s : round) {
      absl::StatusOr<di::exec::StepResult> r = e.DecodeStep(s);
      if (!r.ok()) {
        std::fprintf(stderr, "step: %s\n", r.status().ToString().c_str());
        return t;
      }
    }
  }
  const di::exec::ExecutorStatus before = e.Status();
  for (int i = 0; i < steps; ++i) {
    for (const auto& s : round) {
      absl::StatusOr<di::exec::StepResult> r = e.DecodeStep(s);
      if (!r.ok()) {
        std::fprintf(stderr, "step: %s\n", r.status().ToString().c_str());
        return t;
      }
      t.sharded = r->sharded;
      int64_t slowest = 0;
      const di::testing::RankStepTimes* slow_rank = nullptr;
      size_t slow_index = 0;
      const std::vector<di::testing::RankStepTimes> ranks = timer->LastRankStepTimes();
      for (size_t i = 0; i < ranks.size(); ++i) {
        const auto& rt = ranks[i];
        if (slow_rank == nullptr || rt.score_ns >= slowest) {
          slow_rank = &rt;
          slow_index = i;
        }
        slowest = std::max(slowest, rt.score_ns);
      }
      t.score_us += slowest / 1000.0;
      if (slow_rank != nullptr) {
        t.uploads_us += slow_rank->uploads_ns / 1000.0;
        t.launch_us += slow_rank->launch_ns / 1000.0;
        t.copies_us += slow_rank->copies_ns / 1000.0;
        t.wait_us += slow_rank->wait_ns / 1000.0;
        const double scoring_us = di::exec::LastScoringUs(e)[slow_index];
        if (scoring_us >= 0) {
          t.kernels_us = (t.kernel_samples == 0 ? 0 : t.kernels_us) + scoring_us;
          ++t.kernel_samples;
        }
      }
      const di::testing::StepPhases ph = timer->LastStepPhases();
      t.plan_us += ph.plan_ns / 1000.0;
      t.ranks_us += ph.ranks_ns / 1000.0;
      t.commit_us += ph.commit_ns / 1000.0;
    }
    if (round.size() > 1) {
      for (const auto& o : di::exec::LastOverlapTimings(e)) {
        if (!o.ok() || o->side_us <= 0) continue;
        ++t.overlap_samples;
        t.side_us += o->side_us;
        t.main_us += o->main_us;
        t.hidden += std::min(1.0, o->main_us / o->side_us);
      }
    }
  }
  const double n_steps = double(steps) * round.size();
  for (double* v : {&t.plan_us, &t.ranks_us, &t.commit_us, &t.uploads_us, &t.launch_us,
                    &t.copies_us, &t.wait_us}) {
    *v /= n_steps;
  }
  if (t.kernel_samples > 0) t.kernels_us /= t.kernel_samples;
  if (t.overlap_samples > 0) {
    t.side_us /= t.overlap_samples;
    t.main_us /= t.overlap_samples;
    t.hidden /= t.overlap_samples;
  }
  const di::exec::ExecutorStatus after = e.Status();
  t.step_us = (after.compute_us_total - before.compute_us_total) / steps;
  t.replays = double(after.graph_replays - before.graph_replays) / (steps * round.size());
  t.collective_us = (after.collective_us_total - before.collective_us_total) / steps;
  t.score_us /= steps;
  t.ok = true;
  return t;
}

std::unique_ptr<Executor> MakeExecutor(const di::config::Profile& p, const Args& a, int ranks,
                                       int requests, int64_t pages, bool overlap, bool graphs,
                                       bool pinned, bool direct) {
  ExecutorOptions o;
  o.backend = a.backend;
  o.ranks = ranks;
  o.cache_pages = pages;
  o.max_sequences = requests;
  o.max_requests_per_step = requests;
  o.row_shard_min_requests = 2;
  o.candidate_overlap = overlap;
  o.cuda_graphs = graphs;
  o.pinned_staging = pinned;
  o.direct_answers = direct;
  o.packed_uploads = a.packed;
  o.answer_in_place = a.answer_in_place;
  absl::StatusOr<std::unique_ptr<Executor>> e;
  if (a.backend == "host") {
    o.backend = "cpu";  // the in-process collective; the backends are the factory's
    e = di::exec::CreateExecutorWithBackends(
        p, o,
        [](int32_t, const di::kernels::BackendLimits&)
            -> absl::StatusOr<std::unique_ptr<di::kernels::Backend>> {
          return std::make_unique<HostOnlyBackend>();
        });
  } else {
    e = Executor::Create(p, o);
  }
  if (!e.ok()) {
    std::fprintf(stderr, "executor: %s\n", e.status().ToString().c_str());
    return nullptr;
  }
  for (int i = 0; i < requests; ++i) (void)(*e)->CreateSequence(i + 1);
  di::exec::SetScoringTiming(**e, true);  // the phase tables' `kernels` column
  return *std::move(e);
}

void BenchV32(const Args& a) {
  di::config::Profile p = *di::config::BuiltinProfile("v32");
  const int max_ctx = *std::max_element(a.contexts.begin(), a.contexts.end());
  const int max_req = *std::max_element(a.requests.begin(), a.requests.end());
  const int max_n = *std::max_element(a.next_n.begin(), a.next_n.end());
  p.layers.resize(1);
  // Room for every timed step's new keys: one executor runs every (requests, context, next_n,
  // answer) point, warm-up steps included.
  const int64_t points =
      int64_t(a.requests.size()) * a.contexts.size() * a.next_n.size() * a.answers.size();
  const int64_t grown = int64_t(a.new_keys) * (a.warmup + a.steps) * points;
  p.max_context = static_cast<int32_t>(max_ctx + grown);
  p.max_rows_per_sequence = max_n;
  const int64_t pages = int64_t(max_req) * ((max_ctx + grown + p.page_size - 1) / p.page_size) + 16;
  const Data d = MakeData(p, CacheFormat::kFp8, 65536, max_req * max_n, 7);
  std::printf(
      "\n## v32 dense layer (H %d, D %d, K %d, FP8), %s backend, %d new keys a sequence "
      "a step\n\n",
      p.num_heads, p.head_dim, p.topk, a.backend.c_str(), a.new_keys);
  std::printf(
      "| ranks | graphs | pinned | direct | answer | requests | context | next_n | rows | sharded "
      "| step us | steps/s | collective us | collective share | slowest rank's scoring us | "
      "replays/step |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> phase_rows;
  for (int ranks : a.ranks) {
    for (bool graphs : a.graphs) {
      for (bool pinned : a.pinned) {
        for (bool direct : a.direct) {
          std::unique_ptr<Executor> e =
              MakeExecutor(p, a, ranks, max_req, pages, true, graphs, pinned, direct);
          if (e == nullptr) continue;
          const auto t0 = std::chrono::steady_clock::now();
          if (!Prefill(*e, p, 0, max_req, max_ctx, d)) continue;
          std::fprintf(
              stderr, "ranks %d: prefill of %d x %d keys took %.2f s\n", ranks, max_req, max_ctx,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          for (int req : a.requests) {
            for (int ctx : a.contexts) {
              for (int n : a.next_n) {
                for (const std::string& answer : a.answers) {
                  const size_t q_bytes = size_t(req) * n * p.num_heads * p.head_dim;
                  const size_t w_bytes = size_t(req) * n * p.num_heads * sizeof(float);
                  CallerRegion region(*e, answer, size_t(req) * n * p.topk * sizeof(int32_t),
                                      q_bytes + w_bytes);
                  di::exec::StepInput step = MakeStep(0, req, n, ctx, d, false, 1, a.new_keys);
                  region.Use(step, q_bytes, w_bytes);
                  const Timing t = TimeSteps(*e, {step}, a.warmup, a.steps);
                  if (!t.ok) continue;
                  std::printf(
                      "| %d | %s | %s | %s | %s | %d | %d | %d | %d | %s | %.1f | %.0f | %.1f | "
                      "%.1f%% | %.1f | %.2f |\n",
                      ranks, graphs ? "on" : "off", pinned ? "on" : "off", direct ? "on" : "off",
                      answer.c_str(), req, ctx, n, req * n, t.sharded ? "yes" : "no", t.step_us,
                      1e6 / t.step_us, t.collective_us, 100.0 * t.collective_us / t.step_us,
                      t.score_us, t.replays);
                  std::fflush(stdout);
                  char line[512];
                  std::snprintf(
                      line, sizeof line,
                      "| %d | %s | %s | %s | %s | %d | %d | %d | %.1f | %.1f | %.1f | %.1f | "
                      "%.1f | %.1f | %.1f | %.1f | %.1f | %s |\n",
                      ranks, graphs ? "on" : "off", pinned ? "on" : "off", direct ? "on" : "off",
                      answer.c_str(), req, ctx, n, t.step_us, t.plan_us, t.ranks_us, t.commit_us,
                      t.uploads_us, t.launch_us, t.copies_us, t.wait_us,
                      t.ranks_us - (t.uploads_us + t.launch_us + t.copies_us + t.wait_us),
                      t.kernel_samples > 0 ? absl::StrFormat("%.1f", t.kernels_us).c_str() : "-");
                  phase_rows.push_back(line);
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf(
      "\n### Where a v32 step goes (means, us)\n\nstep: as above; plan: the executor's checks, "
      "page reservation and plan under the turn; ranks: fan-out to the rank threads and back; "
      "commit: after the join. The slowest rank's phases: uploads (staging copies and async "
      "uploads issued, keys inserted), launch (kernel section issued: eager or a graph "
      "replay), copies (answer copies issued, after any collective), wait (the final "
      "synchronize: the device's remaining work); rest = ranks - the four (hand-offs, "
      "collectives, the other rank); kernels = the slowest rank's scoring kernels alone "
      "(events around them on its stream; eager steps only, `-` with graphs on).\n\n");
  std::printf(
      "| ranks | graphs | pinned | direct | answer | requests | context | next_n | step | plan | "
      "ranks | commit | uploads | launch | copies | wait | rest | kernels |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& row : phase_rows) std::fputs(row.c_str(), stdout);
  std::fflush(stdout);
}

#ifdef DI_BENCH_CUDA
// The expansion alone: the candidates of `rows` rows expanded into positions, timed with
// events around `iters` back-to-back launches on an otherwise idle stream of device 0.
double TimeExpansionUs(const std::vector<int32_t>& candidates, const std::vector<int32_t>& lengths,
                       int32_t num_blocks, int32_t block_size) {
  const int32_t rows = static_cast<int32_t>(lengths.size());
  const int32_t max_positions = num_blocks * block_size;
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess)
      std::fprintf(stderr, "expansion timing: %s: %s\n", what, cudaGetErrorString(e));
    return e == cudaSuccess;
  };
  int32_t *cand = nullptr, *len = nullptr, *pos = nullptr, *cnt = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  double us = -1;
  if (check(cudaSetDevice(0), "set device") &&
      check(cudaMalloc(&cand, sizeof(int32_t) * candidates.size()), "malloc") &&
      check(cudaMalloc(&len, sizeof(int32_t) * rows), "malloc") &&
      check(cudaMalloc(&pos, sizeof(int32_t) * int64_t(rows) * max_positions), "malloc") &&
      check(cudaMalloc(&cnt, sizeof(int32_t) * rows), "malloc") &&
      check(cudaMemcpy(cand, candidates.data(), sizeof(int32_t) * candidates.size(),
                       cudaMemcpyHostToDevice),
            "copy") &&
      check(cudaMemcpy(len, lengths.data(), sizeof(int32_t) * rows, cudaMemcpyHostToDevice),
            "copy") &&
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream") &&
      check(cudaEventCreate(&start), "event") && check(cudaEventCreate(&stop), "event")) {
    di::kernels::ExpandArgs args;
    args.num_rows = rows;
    args.candidates = cand;
    args.row_length = len;
    args.num_candidate_blocks = num_blocks;
    args.candidate_block_size = block_size;
    args.out.positions = pos;
    args.out.counts = cnt;
    args.out.max_positions = max_positions;
    const int iters = 50;
    bool ok = true;
    for (int i = 0; i < 5 && ok; ++i)
      ok = di::kernels::cuda::LaunchExpandCandidates(args, stream).ok();
    ok = ok && check(cudaStreamSynchronize(stream), "warm-up");
    ok = ok && check(cudaEventRecord(start, stream), "record");
    for (int i = 0; i < iters && ok; ++i) {
      ok = di::kernels::cuda::LaunchExpandCandidates(args, stream).ok();
    }
    ok = ok && check(cudaEventRecord(stop, stream), "record") &&
         check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    if (ok && check(cudaEventElapsedTime(&ms, start, stop), "elapsed")) us = 1000.0 * ms / iters;
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (stream) cudaStreamDestroy(stream);
  for (int32_t* p : {cand, len, pos, cnt}) {
    if (p) cudaFree(p);
  }
  return us;
}
#endif

void BenchV41(const Args& a) {
  di::config::Profile p = *di::config::BuiltinProfile("v41");
  p.max_context = a.v41_context;
  p.max_rows_per_sequence = 2;
  p.layers.resize(5);
  p.layers[0] = {0, LayerRole::kCandidateSource, 0, CacheFormat::kFp4};
  for (int i = 1; i < 5; ++i)
    p.layers[i] = {i, LayerRole::kCandidateConsumer, 0, CacheFormat::kFp4};
  const int req = a.v41_requests;
  const int ctx = a.v41_context;
  const int64_t pages = int64_t(req) * ((ctx + p.page_size - 1) / p.page_size) + 16;
  const Data d = MakeData(p, CacheFormat::kFp4, 65536, req * 2, 11);
  std::printf(
      "\n## v41 round: candidate source + 4 consumers (H %d, D %d, K %d, FP4, %d x %d "
      "candidate blocks), %d requests x %d, %s backend\n\n",
      p.num_heads, p.head_dim, p.topk, p.num_candidate_blocks, p.candidate_block_size, req, ctx,
      a.backend.c_str());
  std::printf(
      "| ranks | graphs | next_n | overlap | source us | consumer us (mean of 4) | round us | "
      "rounds/s | collective us | replays/step | expansion span us | main until join us | "
      "hidden (events) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  // (ranks, graphs, next_n, overlap) -> round us; next_n -> the source's candidates.
  std::map<std::tuple<int, bool, int, bool>, double> round_us;
  std::map<int, std::vector<int32_t>> candidates;
  std::vector<std::string> phase_rows;
  for (int ranks : a.ranks) {
    for (bool graphs : a.graphs) {
      for (bool overlap : {true, false}) {
        std::unique_ptr<Executor> e =
            MakeExecutor(p, a, ranks, req, pages, overlap, graphs, true, a.direct.front());
        if (e == nullptr) continue;
        if (!Prefill(*e, p, 0, req, ctx, d)) continue;
        for (int n : a.next_n) {
          std::vector<di::exec::StepInput> round;
          for (int layer = 0; layer < 5; ++layer) {
            round.push_back(MakeStep(layer, req, n, ctx, d, true, layer));
          }
          round[0].return_candidates = false;
          // The answers into the first --answer's sink (q stays where it is: FP4 q has scales).
          const std::string mode =
              a.answers.front() == "pinned-q" || a.answers.front() == "device-q"
                  ? "pinned"
                  : a.answers.front();
          CallerRegion region(*e, mode, size_t(req) * n * p.topk * sizeof(int32_t), 0);
          for (di::exec::StepInput& st : round) region.Use(st, 0, 0);
          // The source alone, then the whole round: the consumers' mean is the difference.
          const Timing src = TimeSteps(*e, {round[0]}, a.warmup, a.steps);
          const Timing all = TimeSteps(*e, round, a.warmup, a.steps);
          if (!src.ok || !all.ok) continue;
          char ov[128] = "| - | - | - |";
          if (all.overlap_samples > 0) {
            std::snprintf(ov, sizeof ov, "| %.1f | %.1f | %.0f%% |", all.side_us, all.main_us,
                          100.0 * all.hidden);
          }
          std::printf("| %d | %s | %d | %s | %.1f | %.1f | %.1f | %.0f | %.1f | %.2f %s\n", ranks,
                      graphs ? "on" : "off", n, overlap ? "on" : "off", src.step_us,
                      (all.step_us - src.step_us) / 4, all.step_us, 1e6 / all.step_us,
                      all.collective_us, all.replays, ov);
          std::fflush(stdout);
          round_us[{ranks, graphs, n, overlap}] = all.step_us;
          // Where the source's and a consumer's steps go (a consumer: the round's means
          // less the source's share, over the four consumers).
          auto consumer = [&](double round_mean, double source) {
            return (5 * round_mean - source) / 4;
          };
          // The scoring kernels (eager steps only), and the whole round's time beyond them.
          std::string src_k = "-", con_k = "-", over_k = "-";
          if (src.kernel_samples > 0 && all.kernel_samples > 0) {
            src_k = absl::StrFormat("%.1f", src.kernels_us);
            con_k = absl::StrFormat("%.1f", consumer(all.kernels_us, src.kernels_us));
            over_k = absl::StrFormat("%.1f", 5 * (all.step_us - all.kernels_us));
          }
          char line[640];
          std::snprintf(
              line, sizeof line,
              "| %d | %s | %d | %s | source | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s "
              "| "
              "%s |\n"
              "| %d | %s | %d | %s | consumer | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
              "%s "
              "| %s |\n",
              ranks, graphs ? "on" : "off", n, overlap ? "on" : "off", src.step_us, src.plan_us,
              src.uploads_us, src.launch_us, src.copies_us, src.wait_us,
              src.ranks_us - (src.uploads_us + src.launch_us + src.copies_us + src.wait_us),
              src_k.c_str(), over_k.c_str(), ranks, graphs ? "on" : "off", n,
              overlap ? "on" : "off", (all.step_us - src.step_us) / 4,
              consumer(all.plan_us, src.plan_us), consumer(all.uploads_us, src.uploads_us),
              consumer(all.launch_us, src.launch_us), consumer(all.copies_us, src.copies_us),
              consumer(all.wait_us, src.wait_us),
              consumer(
                  all.ranks_us - (all.uploads_us + all.launch_us + all.copies_us + all.wait_us),
                  src.ranks_us - (src.uploads_us + src.launch_us + src.copies_us + src.wait_us)),
              con_k.c_str(), over_k.c_str());
          phase_rows.push_back(line);
          if (candidates.count(n) == 0) {
            di::exec::StepInput s = round[0];
            s.return_candidates = true;
            absl::StatusOr<di::exec::StepResult> r = e->DecodeStep(s);
            if (r.ok()) candidates[n] = r->candidate_blocks;
          }
        }
      }
    }
  }
  std::printf(
      "\n### Where a v41 step goes (means, us; columns as in the v32 table)\n\nround - kernels: "
      "the whole round (source + 4 consumers) less its layers' scoring kernels (eager steps "
      "only, `-` with graphs on)\n\n| ranks | graphs | next_n | overlap | layer | step | plan | "
      "uploads | launch | copies | wait | rest | kernels | round - kernels |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& row : phase_rows) std::fputs(row.c_str(), stdout);
  std::fflush(stdout);
#ifdef DI_BENCH_CUDA
  if (a.backend != "cuda") return;
  std::printf(
      "\n### v41 expansion alone and the share the overlap hides\n\nexpansion us: the "
      "expansion kernel of all %d x next_n rows (%d x %d candidate blocks), events around 50 "
      "launches on an idle stream of GPU 0; hidden share = (round us overlap off - round us "
      "overlap on) / expansion us (over 100%%: overlap off also pays the consumer's candidate "
      "gather and a kernel boundary)\n\n",
      req, p.num_candidate_blocks, p.candidate_block_size);
  std::printf(
      "| ranks | graphs | next_n | expansion us | round us off | round us on | hidden share |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const auto& [n, cand] : candidates) {
    std::vector<int32_t> lengths;
    for (int i = 0; i < req; ++i) {
      for (int j = 0; j < n; ++j) lengths.push_back(ctx - n + 1 + j);
    }
    if (cand.size() != lengths.size() * size_t(p.num_candidate_blocks)) continue;
    const double exp_us =
        TimeExpansionUs(cand, lengths, p.num_candidate_blocks, p.candidate_block_size);
    for (int ranks : a.ranks) {
      for (bool graphs : a.graphs) {
        auto off = round_us.find({ranks, graphs, n, false});
        auto on = round_us.find({ranks, graphs, n, true});
        if (off == round_us.end() || on == round_us.end()) continue;
        std::printf("| %d | %s | %d | %.1f | %.1f | %.1f | %.0f%% |\n", ranks,
                    graphs ? "on" : "off", n, exp_us, off->second, on->second,
                    100.0 * (off->second - on->second) / exp_us);
      }
    }
  }
  std::fflush(stdout);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  std::printf(
      "# decode-indexer-bench-multigpu\n\nmean over %d steps after %d warm-up steps; "
      "executor compute time per step (host planning, uploads, kernels on every rank, "
      "all-gather, answer copy-back); packed uploads %s, answer in place %s\n",
      a.steps, a.warmup, a.packed ? "on" : "off", a.answer_in_place ? "on" : "off");
  if (a.v32) BenchV32(a);
  if (a.v41) BenchV41(a);
  return 0;
}
