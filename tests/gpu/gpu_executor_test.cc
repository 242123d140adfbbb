// The executor on the CUDA backend and on the CPU backend, through the executor's API (the
// layer below the gRPC edge), each checked against the independent reference (di_reference,
// through the harness's oracle) by the spec's section-6 rule: the exact top-k up to near-ties
// within 4 fp32 ulps of the row's largest logit for the CPU, kCudaUlps for CUDA (whose fp32
// sums in another order differ from the exact logits by up to ~5 ulps of the row's max, as
// gpu_test measures), nothing more (no count of wrong positions allowed). The built-in v32
// profile's dense layers and the v41 profile's dense, candidate-source and consumer layers, with
// prefill appends, decode steps of next_n 1-2 with unquantized q (rope_quant_q on the device) and
// new keys. Every other round the CUDA executor answers into caller buffers poisoned with -7
// beforehand, so a row or entry it fails to write cannot pass.
//
// Skipped (visibly) where no GPU is visible, as in CI.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"
#include "gtest/gtest.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "tests/server/exec_harness.h"

namespace decode_indexer::testing {
namespace {

using config::LayerRole;
using exec::Executor;
using exec::ExecutorOptions;
using exec::StepResult;

// The CUDA backend's near-tie tolerance in fp32 ulps of a row's largest logit.
constexpr double kCudaUlps = 16.0;

std::unique_ptr<Executor> Make(const config::Profile& p, const std::string& backend) {
  ExecutorOptions o;
  o.backend = backend;
  // The CUDA answers are held to the CPU's at the exact mode's tolerance (kCudaUlps): the exact
  // kernel by name, whatever DI_LOGITS_PRECISION says.
  o.logits_precision = "exact";
  o.ranks = 1;
  o.cache_pages = 1024;
  o.max_requests_per_step = 8;
  o.max_sequences = 16;
  auto e = Executor::Create(p, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

TEST(GpuExecutorTest, CudaAndCpuBackendsAnswerAsTheReference) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "no CUDA GPU visible: the CUDA executor test is skipped here";
  }
  for (const char* name : {"v32", "v41"}) {
    SCOPED_TRACE(name);
    absl::StatusOr<config::Profile> profile = config::BuiltinProfile(name);
    ASSERT_TRUE(profile.ok()) << profile.status();
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    Harness h(*profile, seed);
    std::unique_ptr<Executor> cpu = Make(*profile, "cpu");
    std::unique_ptr<Executor> gpu = Make(*profile, "cuda");
    ASSERT_TRUE(cpu && gpu);
    EXPECT_EQ(gpu->Status().backend, "cuda");

    // The layers to run, in order: the first dense layer, then (v41) a source and one of its
    // consumers, whose candidates come from the source step just before.
    std::vector<int32_t> layers;
    for (const auto& l : profile->layers) {
      if (l.role == LayerRole::kDense) {
        layers.push_back(l.layer);
        break;
      }
    }
    for (const auto& l : profile->layers) {
      if (l.role == LayerRole::kCandidateConsumer) {
        layers.push_back(profile->SourceLayerOf(l.layer));
        layers.push_back(l.layer);
        break;
      }
    }
    const std::vector<uint64_t> ids = {11, 12, 13, 14};
    for (uint64_t id : ids) {
      ASSERT_TRUE(cpu->CreateSequence(id).ok());
      ASSERT_TRUE(gpu->CreateSequence(id).ok());
      for (int32_t layer : profile->CacheLayers()) {
        if (std::find(layers.begin(), layers.end(), layer) == layers.end()) continue;
        std::vector<uint8_t> keys, scales;
        exec::KeysInput in;
        const int32_t count = 1500 + static_cast<int32_t>(h.rng()() % 6000);
        h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
        in.count = count;
        in.keys = keys.data();
        in.scales = scales.empty() ? nullptr : scales.data();
        auto a = cpu->AppendKeys(id, layer, in);
        auto b = gpu->AppendKeys(id, layer, in);
        ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " / " << b.status();
        EXPECT_EQ(*a, *b);
        h.RecordAppend(id, layer, in);
      }
    }
    std::unique_ptr<StepData> last_source;  // the source step the consumers read
    std::vector<int32_t> cpu_blocks, gpu_blocks;
    for (int round = 0; round < 2; ++round) {
      for (int32_t layer : layers) {
        const LayerRole role = profile->layers[layer].role;
        SCOPED_TRACE(
            absl::StrCat("round ", round, " layer ", layer, " role ", static_cast<int>(role)));
        std::vector<SeqPlan> plan;
        for (uint64_t id : ids) {
          SeqPlan s;
          s.id = id;
          s.rows = 1 + static_cast<int32_t>((id + round) % 2);
          s.new_keys = role == LayerRole::kCandidateConsumer ? 0 : s.rows;
          plan.push_back(s);
        }
        std::unique_ptr<StepData> step = h.MakeStep(layer, plan, QForm::kF32, KeyForm::kF32);
        step->input.return_candidates = role == LayerRole::kCandidateSource;
        auto a = cpu->DecodeStep(step->input);
        ASSERT_TRUE(a.ok()) << a.status();
        // Odd rounds: the CUDA executor answers into poisoned caller buffers.
        const bool poisoned = round % 2 == 1;
        std::vector<int32_t> answer_buf, candidates_buf;
        exec::StepInput gin = step->input;
        exec::AnswerSink sink;
        if (poisoned) {
          answer_buf.assign(size_t(gin.num_rows) * profile->topk, -7);
          if (gin.return_candidates) {
            candidates_buf.assign(size_t(gin.num_rows) * profile->num_candidate_blocks, -7);
          }
          sink = exec::AnswerSink::Host(answer_buf.data(),
                                        gin.return_candidates ? candidates_buf.data() : nullptr,
                                        /*page_locked=*/false);
          gin.answer = &sink;
        }
        auto b = gpu->DecodeStep(gin);
        ASSERT_TRUE(b.ok()) << b.status();
        if (poisoned) {
          EXPECT_TRUE(b->topk_indices.empty() && b->candidate_blocks.empty());
          b->topk_indices = answer_buf;
          b->candidate_blocks = candidates_buf;
        }
        h.RecordStep(*step);
        const bool source = role == LayerRole::kCandidateSource;
        const bool consumer = role == LayerRole::kCandidateConsumer;
        // A consumer scores the blocks its own executor chose at the source (each checked
        // there): the reference answers each executor with that executor's blocks.
        if (consumer) h.AdoptCandidates(*last_source, cpu_blocks);
        const Harness::Answer want = h.Oracle(*step);
        if (consumer) h.AdoptCandidates(*last_source, gpu_blocks);
        const Harness::Answer want_gpu = consumer ? h.Oracle(*step) : want;
        EXPECT_TRUE(
            want.Matches(a->topk_indices, source ? a->candidate_blocks : std::vector<int32_t>{}))
            << "cpu executor vs reference";
        EXPECT_TRUE(want_gpu.Matches(
            b->topk_indices, source ? b->candidate_blocks : std::vector<int32_t>{}, kCudaUlps))
            << "cuda executor vs reference" << (poisoned ? " (poisoned caller buffers)" : "");
        EXPECT_EQ(a->lengths, b->lengths);
        if (source) {
          // Both block choices passed the section-7 check; they may differ only at near-ties.
          cpu_blocks = a->candidate_blocks;
          gpu_blocks = b->candidate_blocks;
          if (cpu_blocks != gpu_blocks) std::cout << "candidate blocks differ at a near-tie\n";
          last_source = std::move(step);
        }
      }
    }
  }
}

// CUDA graphs (seed: warm): an executor with graphs on answers bit for bit as one with graphs
// off, over steps that repeat their shapes (eager at a shape's first sighting, captured at
// its second, replayed after). Covered: unquantized q (rope_quant_q inside the graph) and
// pre-quantized q; a v32 dense profile and a v41-like source + four consumers (sparse, and the
// masked fallback whose expansion runs inside the graph); a longest row that moves inside one
// length bucket (4091 .. 4095) and then into the next (4097 ..). The replay counter must grow,
// so the test fails if graphs silently never replay.
config::Profile GraphV32() { return FullWidthV32(16384); }
config::Profile GraphV41() { return FullWidthV41(16384); }

// The profiles a graph test steps: v32, v41, and v41 with a masked (consumer) layer's steps.
struct ProfileVariant {
  const char* name;
  config::Profile profile;
  bool masked;
};
std::vector<ProfileVariant> GraphVariants() {
  return {{"v32", GraphV32(), false}, {"v41", GraphV41(), false}, {"v41 masked", GraphV41(), true}};
}

TEST(GpuExecutorTest, GraphReplaysAnswerAsEagerStepsBitForBit) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "no CUDA GPU visible: the CUDA graph test is skipped here";
  }
  for (const ProfileVariant& v : GraphVariants()) {
    SCOPED_TRACE(v.name);
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    Harness h(v.profile, seed);
    ExecutorOptions o;
    o.backend = "cuda";
    o.ranks = 1;
    o.cache_pages = 2048;
    o.max_requests_per_step = 8;
    o.max_sequences = 16;
    o.masked_consumer = v.masked;
    o.cuda_graphs = true;
    auto on = Executor::Create(v.profile, o);
    o.max_step_graphs = 2;  // a two-shape table: most new shapes evict (and drop) one
    auto tiny = Executor::Create(v.profile, o);
    o.max_step_graphs = 1024;
    o.cuda_graphs = false;
    auto off = Executor::Create(v.profile, o);
    ASSERT_TRUE(on.ok() && off.ok()) << on.status() << " / " << off.status();
    ASSERT_TRUE(tiny.ok()) << tiny.status();

    // Sequence 0 starts 7 below the 4096 bucket edge and grows 2 a round: its rows' longest
    // length is 4091, 4093, 4095 (one bucket), then 4097 and on (the next). The others stay
    // longer than K (a real top-k) and inside the first bucket.
    const std::vector<uint64_t> ids = {21, 22, 23, 24};
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE((*on)->CreateSequence(ids[i]).ok());
      ASSERT_TRUE((*off)->CreateSequence(ids[i]).ok());
      ASSERT_TRUE((*tiny)->CreateSequence(ids[i]).ok());
      for (int32_t layer : v.profile.CacheLayers()) {
        const int32_t count = i == 0 ? 4089 : 2600 + static_cast<int32_t>(h.rng()() % 1400);
        std::vector<uint8_t> keys, scales;
        exec::KeysInput in;
        h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
        in.count = count;
        in.keys = keys.data();
        in.scales = scales.empty() ? nullptr : scales.data();
        auto a = (*on)->AppendKeys(ids[i], layer, in);
        auto b = (*off)->AppendKeys(ids[i], layer, in);
        ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " / " << b.status();
        ASSERT_TRUE((*tiny)->AppendKeys(ids[i], layer, in).ok());
      }
    }
    // From round 3 on (with the bucket change), the graphs-on executor answers into one reused
    // caller region, registered (page-locked) with its answering backend, as a serving frontend's:
    // the answer's device-to-host copy lands straight in it after the replayed graph.
    const size_t max_rows = 2 * ids.size();
    const size_t topk_elems = max_rows * v.profile.topk;
    std::vector<int32_t> region_mem(topk_elems + max_rows * v.profile.num_candidate_blocks + 1, -7);
    ASSERT_TRUE((*on)
                    ->WithAnswerDevice([&](kernels::Device& be) {
                      return be.RegisterHostMemory(region_mem.data(),
                                                   region_mem.size() * sizeof(int32_t));
                    })
                    .ok());
    const auto region_topk = region_mem.begin();
    const auto region_cand = region_mem.begin() + topk_elems;
    const exec::AnswerSink region = exec::AnswerSink::Host(
        region_mem.data(), region_mem.data() + topk_elems, /*page_locked=*/true);
    const int32_t rounds = 8;
    for (int32_t round = 0; round < rounds; ++round) {
      for (const config::LayerSpec& l : v.profile.layers) {
        SCOPED_TRACE(absl::StrCat("round ", round, " layer ", l.layer));
        const bool consumer = l.role == LayerRole::kCandidateConsumer;
        std::vector<SeqPlan> plan;
        for (uint64_t id : ids) plan.push_back({id, 2, consumer ? 0 : 2, {}});
        // Even layers send fp32 q (rope_quant_q in the graph), odd ones pre-quantized q.
        const QForm form = l.layer % 2 == 0 ? QForm::kF32 : QForm::kQuantized;
        std::unique_ptr<StepData> step = h.MakeStep(l.layer, plan, form, KeyForm::kF32);
        step->input.return_candidates = l.role == LayerRole::kCandidateSource;
        exec::StepInput in_on = step->input;
        if (round >= 3) in_on.answer = &region;
        auto a = (*on)->DecodeStep(in_on);
        auto b = (*off)->DecodeStep(step->input);
        auto t = (*tiny)->DecodeStep(step->input);
        ASSERT_TRUE(a.ok()) << a.status();
        ASSERT_TRUE(b.ok()) << b.status();
        ASSERT_TRUE(t.ok()) << t.status();
        EXPECT_TRUE(t->topk_indices == b->topk_indices) << "top-k differs with graphs evicted";
        EXPECT_TRUE(t->candidate_blocks == b->candidate_blocks);
        if (round >= 3) {
          const size_t rows = size_t(a->num_rows);
          EXPECT_TRUE(a->topk_indices.empty());
          a->topk_indices.assign(region_topk, region_topk + rows * a->topk);
          if (step->input.return_candidates) {
            EXPECT_TRUE(a->candidate_blocks.empty());
            a->candidate_blocks.assign(region_cand,
                                       region_cand + rows * v.profile.num_candidate_blocks);
          }
        }
        EXPECT_EQ(a->lengths, b->lengths);
        EXPECT_TRUE(a->topk_indices == b->topk_indices) << "top-k differs with graphs on";
        EXPECT_TRUE(a->candidate_blocks == b->candidate_blocks) << "candidates differ";
        // A real answer: more positions than the trivial 0..L-1 of a short row would give.
        EXPECT_GT(std::count_if(a->topk_indices.begin(), a->topk_indices.end(),
                                [](int32_t x) { return x >= 0; }),
                  int64_t{a->topk} * 4);
      }
    }
    const exec::ExecutorStatus st_on = (*on)->Status();
    const exec::ExecutorStatus st_off = (*off)->Status();
    // Every layer's shape is seen `rounds` times (the four consumers share one shape), with at
    // most one bucket change: at most two eager and two capturing sightings per shape.
    EXPECT_GT(st_on.graph_captures, 0u);
    EXPECT_GE(st_on.graph_replays, uint64_t{4} * v.profile.layers.size());
    EXPECT_EQ(st_off.graph_captures, 0u);
    EXPECT_EQ(st_off.graph_replays, 0u);
    EXPECT_EQ(st_on.graph_evictions, 0u);
    // The two-shape table: v41's four consumer layers alternate two shapes (fp32 and quantized
    // q), held long enough to be captured; the next round's dense and source steps evict them,
    // dropping real graphs (Device::DropGraph). The answers above stayed the eager ones.
    const exec::ExecutorStatus st_tiny = (*tiny)->Status();
    EXPECT_GT(st_tiny.graph_evictions, 0u);
    if (std::string(v.name) != "v32") {
      EXPECT_GT(st_tiny.graph_captures, 0u);
    }
    EXPECT_TRUE(st_tiny.healthy) << st_tiny.health_detail;
    EXPECT_TRUE(st_on.healthy) << st_on.health_detail;
    EXPECT_TRUE((*on)
                    ->WithAnswerDevice([&](kernels::Device& be) {
                      return be.UnregisterHostMemory(region_mem.data());
                    })
                    .ok());
  }
}

// An allocation of an executor's answering backend (an attention worker's CUDA IPC buffer, in
// process), filled and read back through Executor::WithAnswerDevice between steps.
class AnswerDeviceMemory {
 public:
  AnswerDeviceMemory(Executor& e, size_t bytes) : e_(e), bytes_(bytes) {
    const absl::Status s = e_.WithAnswerDevice([&](kernels::Device& be) {
      absl::StatusOr<void*> p = be.Allocate(bytes_);
      if (!p.ok()) return p.status();
      base_ = static_cast<uint8_t*>(*p);
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
  }
  ~AnswerDeviceMemory() {
    if (base_ == nullptr) return;
    (void)e_.WithAnswerDevice([&](kernels::Device& be) {
      be.Free(base_);
      return absl::OkStatus();
    });
  }
  bool ok() const { return base_ != nullptr; }
  uint8_t* at(size_t offset) const { return base_ + offset; }
  // `n` bytes of `src` at `offset`.
  void Put(size_t offset, const void* src, size_t n) {
    ASSERT_LE(offset + n, bytes_);
    const absl::Status s = e_.WithAnswerDevice([&](kernels::Device& be) {
      absl::Status st = be.CopyToDevice(base_ + offset, src, n);
      return st.ok() ? be.Synchronize() : st;
    });
    ASSERT_TRUE(s.ok()) << s;
  }
  void Fill(uint8_t byte) {
    const std::vector<uint8_t> host(bytes_, byte);
    Put(0, host.data(), bytes_);
  }
  std::vector<uint8_t> Read() {
    std::vector<uint8_t> host(bytes_);
    const absl::Status s = e_.WithAnswerDevice([&](kernels::Device& be) {
      absl::Status st = be.CopyToHost(host.data(), base_, bytes_);
      return st.ok() ? be.Synchronize() : st;
    });
    EXPECT_TRUE(s.ok()) << s;
    return host;
  }

 private:
  Executor& e_;
  size_t bytes_;
  uint8_t* base_ = nullptr;
};

// The answer's top-k written in place (server/exec/decode_schedule.h TopKInPlace): executors
// answering into a device span of their answering backend, graphs on and off, answer bit for
// bit as one answering into the result's vectors (its top-k kernels writing the rank's own
// buffer, copied to the host), over steps that repeat their shapes (eager, captured,
// replayed), on the dense top-k, the source (top-k and candidates, which are still copied) and
// the sparse and masked consumers; an answer that moves to another offset is another graph
// (the first step there does not replay; the old offset stays poisoned: a stale replay would
// write it); a span 2 bytes off int32 alignment takes the device-to-device copy and answers
// the same; no byte of the allocation outside the answer's spans is written. Then a NaN weight
// in device q (in the same allocation) fails a step whose kernel section replays: INVALID_ARGUMENT
// naming weights.data, lengths unchanged, nothing written outside the answer's span; the same
// step clean answers as the reference.
TEST(GpuExecutorTest, DeviceAnswerWrittenInPlaceAnswersAsTheVectors) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "no CUDA GPU visible: the in-place device answer test is skipped here";
  }
  for (const ProfileVariant& v : GraphVariants()) {
    SCOPED_TRACE(v.name);
    const config::Profile& p = v.profile;
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    Harness h(p, seed);
    ExecutorOptions o;
    o.backend = "cuda";
    o.ranks = 1;
    o.cache_pages = 2048;
    o.max_requests_per_step = 8;
    o.max_sequences = 16;
    o.masked_consumer = v.masked;
    o.cuda_graphs = false;
    auto ref = Executor::Create(p, o);  // the vectors
    auto off = Executor::Create(p, o);
    o.cuda_graphs = true;
    auto on = Executor::Create(p, o);
    ASSERT_TRUE(ref.ok() && off.ok() && on.ok())
        << ref.status() << " / " << off.status() << " / " << on.status();
    const std::vector<uint64_t> ids = {21, 22, 23, 24};
    for (uint64_t id : ids) {
      for (auto* e : {&*ref, &*off, &*on}) ASSERT_TRUE((*e)->CreateSequence(id).ok());
      for (int32_t layer : p.CacheLayers()) {
        const int32_t count = 2600 + static_cast<int32_t>(h.rng()() % 1400);
        std::vector<uint8_t> keys, scales;
        exec::KeysInput in;
        h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
        in.count = count;
        in.keys = keys.data();
        in.scales = scales.empty() ? nullptr : scales.data();
        for (auto* e : {&*ref, &*off, &*on}) ASSERT_TRUE((*e)->AppendKeys(id, layer, in).ok());
        h.RecordAppend(id, layer, in);
      }
    }
    auto lengths = [&](Executor& e) {
      std::vector<int64_t> out;
      for (uint64_t id : ids) {
        absl::StatusOr<exec::SequenceInfo> info = e.GetSequence(id);
        EXPECT_TRUE(info.ok()) << info.status();
        if (!info.ok()) continue;
        for (const exec::SequenceCacheInfo& c : info->caches) out.push_back(c.length);
      }
      return out;
    };

    // Each executor's allocation: answers in [0, kAnswers) (A, B and M = B + 2), candidates
    // at kCandidates, device q from kQ; poisoned before every step.
    const size_t max_rows = 2 * ids.size();
    const size_t topk_bytes = max_rows * size_t(p.topk) * sizeof(int32_t);
    const size_t cand_bytes = max_rows * size_t(p.num_candidate_blocks) * sizeof(int32_t);
    const size_t A = 0, B = (topk_bytes + 4095) / 4096 * 4096 + 4096, M = B + 2;
    const size_t kCandidates = (M + topk_bytes + 4095) / 4096 * 4096;
    const size_t kQ = (kCandidates + cand_bytes + 4095) / 4096 * 4096;
    const size_t kBytes = kQ + (size_t{1} << 20);
    constexpr uint8_t kPoison = 0xA7;
    struct Under {
      const char* name;
      Executor* e;
      std::unique_ptr<AnswerDeviceMemory> mem;
    };
    std::vector<Under> unders;
    unders.push_back(
        {"graphs off", off->get(), std::make_unique<AnswerDeviceMemory>(**off, kBytes)});
    unders.push_back({"graphs on", on->get(), std::make_unique<AnswerDeviceMemory>(**on, kBytes)});
    for (const Under& u : unders) ASSERT_TRUE(u.mem->ok()) << u.name;

    // Runs `in` on `u` answering at `at` of its allocation (q there too where `device_q`):
    // the step's status; with `want`, the answer checked against it. Every byte of the
    // allocation before kQ outside the answer's spans must still be poison.
    auto run = [&](Under& u, const StepData& step, size_t at, bool device_q, bool nan,
                   const StepResult* want) -> absl::Status {
      const size_t rows = size_t(step.input.num_rows);
      const size_t tk = rows * size_t(p.topk) * sizeof(int32_t);
      const size_t cb = rows * size_t(p.num_candidate_blocks) * sizeof(int32_t);
      u.mem->Fill(kPoison);
      exec::StepInput in = step.input;
      const exec::AnswerSink sink = exec::AnswerSink::Device(
          reinterpret_cast<int32_t*>(u.mem->at(at)),
          in.return_candidates ? reinterpret_cast<int32_t*>(u.mem->at(kCandidates)) : nullptr);
      in.answer = &sink;
      if (device_q) {
        size_t next = kQ;
        u.mem->Put(next, step.q.data(), step.q.size());
        in.q.q = u.mem->at(next);
        next = (next + step.q.size() + 15) / 16 * 16;
        if (!step.q_scales.empty()) {
          u.mem->Put(next, step.q_scales.data(), step.q_scales.size());
          in.q.scales = u.mem->at(next);
          next = (next + step.q_scales.size() + 15) / 16 * 16;
        }
        std::vector<float> weights = step.weights;
        if (nan) weights[(rows - 1) * size_t(p.num_heads) + 1] = std::nanf("");
        u.mem->Put(next, weights.data(), weights.size() * sizeof(float));
        in.q.weights = reinterpret_cast<const float*>(u.mem->at(next));
        in.q.on_device = true;
      }
      absl::StatusOr<StepResult> got = u.e->DecodeStep(in);
      const std::vector<uint8_t> mem = u.mem->Read();
      size_t outside = 0;
      for (size_t i = 0; i < kQ; ++i) {
        const bool in_answer = i >= at && i < at + tk;
        const bool in_candidates = in.return_candidates && i >= kCandidates && i < kCandidates + cb;
        outside += !in_answer && !in_candidates && mem[i] != kPoison;
      }
      EXPECT_EQ(outside, 0u) << u.name << ": bytes outside the answer written";
      if (!got.ok()) return got.status();
      EXPECT_TRUE(got->topk_indices.empty() && got->candidate_blocks.empty()) << u.name;
      if (want != nullptr) {
        std::vector<int32_t> topk(tk / sizeof(int32_t));
        std::memcpy(topk.data(), mem.data() + at, tk);
        EXPECT_TRUE(topk == want->topk_indices) << u.name << ": top-k differs from the vectors'";
        if (in.return_candidates) {
          std::vector<int32_t> cand(cb / sizeof(int32_t));
          std::memcpy(cand.data(), mem.data() + kCandidates, cb);
          EXPECT_TRUE(cand == want->candidate_blocks) << u.name << ": candidates differ";
        }
        EXPECT_EQ(got->lengths, want->lengths) << u.name;
      }
      return absl::OkStatus();
    };
    auto make_step = [&](const config::LayerSpec& l) {
      const bool consumer = l.role == LayerRole::kCandidateConsumer;
      std::vector<SeqPlan> plan;
      for (uint64_t id : ids) plan.push_back({id, 2, consumer ? 0 : 2, {}});
      std::unique_ptr<StepData> step =
          h.MakeStep(l.layer, plan, QForm::kQuantized, KeyForm::kF32, /*with_positions=*/false);
      step->input.return_candidates = l.role == LayerRole::kCandidateSource;
      return step;
    };

    const std::vector<size_t> rounds = {A, A, A, B, B, B, M, M, A, A};
    for (size_t ri = 0; ri < rounds.size(); ++ri) {
      const size_t at = rounds[ri];
      const bool same_as_two_before = ri >= 2 && rounds[ri - 1] == at && rounds[ri - 2] == at;
      // The first step at an offset not answered at before (A: the first step of all).
      const bool first_at =
          std::find(rounds.begin(), rounds.begin() + ri, at) == rounds.begin() + ri;
      for (size_t li = 0; li < p.layers.size(); ++li) {
        const config::LayerSpec& l = p.layers[li];
        SCOPED_TRACE(absl::StrCat("round ", ri, " layer ", l.layer, " offset ", at));
        std::unique_ptr<StepData> step = make_step(l);
        absl::StatusOr<StepResult> want = (*ref)->DecodeStep(step->input);
        ASSERT_TRUE(want.ok()) << want.status();
        for (Under& u : unders) {
          const uint64_t replays = u.e->Status().graph_replays;
          const absl::Status s = run(u, *step, at, false, false, &*want);
          ASSERT_TRUE(s.ok()) << u.name << ": " << s;
          const uint64_t replayed = u.e->Status().graph_replays - replays;
          if (u.e == on->get() && at % sizeof(int32_t) == 0) {
            if (same_as_two_before) {
              EXPECT_EQ(replayed, 1u) << "no replay at a shape seen twice";
            }
            if (first_at && li == 0) {
              EXPECT_EQ(replayed, 0u) << "a moved answer replayed an earlier graph";
            }
          }
        }
        h.RecordStep(*step);
      }
    }

    // Device q with a NaN weight, the section replayed (two clean steps of the shape first).
    for (const config::LayerSpec& l : p.layers) {
      for (int attempt = 0; attempt < 3; ++attempt) {
        SCOPED_TRACE(absl::StrCat("device q, layer ", l.layer, " attempt ", attempt));
        std::unique_ptr<StepData> step = make_step(l);
        if (attempt == 2) {
          for (Under& u : unders) {
            const std::vector<int64_t> before = lengths(*u.e);
            const uint64_t replays = u.e->Status().graph_replays;
            const absl::Status s = run(u, *step, A, true, /*nan=*/true, nullptr);
            EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << u.name << ": " << s;
            EXPECT_NE(s.message().find("weights.data"), std::string::npos) << s;
            EXPECT_NE(s.message().find("committed nothing"), std::string::npos) << s;
            EXPECT_EQ(lengths(*u.e), before) << u.name << ": the failed step moved a length";
            if (u.e == on->get()) {
              EXPECT_EQ(u.e->Status().graph_replays - replays, 1u) << "the section did not replay";
            }
          }
        }
        absl::StatusOr<StepResult> want = (*ref)->DecodeStep(step->input);
        ASSERT_TRUE(want.ok()) << want.status();
        for (Under& u : unders) {
          const absl::Status s = run(u, *step, A, true, false, &*want);
          ASSERT_TRUE(s.ok()) << u.name << ": " << s;
        }
        h.RecordStep(*step);
      }
    }
    EXPECT_EQ(lengths(**on), lengths(**ref));
    EXPECT_EQ(lengths(**off), lengths(**ref));
    EXPECT_GT((*on)->Status().graph_replays, 0u);
    EXPECT_EQ((*off)->Status().graph_replays, 0u);
    for (const Under& u : unders) EXPECT_TRUE(u.e->Status().healthy) << u.name;
  }
}

// tests/service/profiles/<name>: this file's tree, else the working directory or up to three
// above it (the GPU machine runs the bundled binary from a copy of the repository root; ctest
// runs it in <build>/tests/gpu).
std::string ServiceProfilePath(const std::string& name) {
  const std::string rel = "tests/service/profiles/" + name;
  std::string here = __FILE__;
  here = here.substr(0, here.rfind("tests/gpu/"));
  for (const std::string& dir :
       {here, std::string(), std::string("../"), std::string("../../"), std::string("../../../")}) {
    if (std::ifstream(dir + rel).good()) return dir + rel;
  }
  return rel;
}

TEST(GpuExecutorTest, RefusesAtStartUpWhatTheKernelsDoNotTake) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "no CUDA GPU visible: the CUDA start-up geometry test is skipped here";
  }
  ExecutorOptions o;
  o.ranks = 1;
  o.cache_pages = 64;
  o.max_requests_per_step = 4;
  o.max_sequences = 4;
  // v41-tiny has 16-entry pages: refused at creation, naming the field, on cuda and on auto
  // (which must not fall back to the CPU backend silently).
  absl::StatusOr<config::Profile> tiny = config::LoadProfile(ServiceProfilePath("v41-tiny.toml"));
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  for (const char* backend : {"cuda", "auto"}) {
    SCOPED_TRACE(backend);
    o.backend = backend;
    auto e = Executor::Create(*tiny, o);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
    EXPECT_NE(e.status().message().find("cache[0].page_size: 16 (the CUDA backend takes 64)"),
              std::string::npos)
        << e.status();
    if (std::string(backend) == "auto") {
      EXPECT_NE(e.status().message().find("does not fall back to cpu"), std::string::npos)
          << e.status();
    }
  }
  // The same plan at the kernels' geometry starts, on the CUDA backend.
  absl::StatusOr<config::Profile> tiny_cuda =
      config::LoadProfile(ServiceProfilePath("v41-tiny-cuda.toml"));
  ASSERT_TRUE(tiny_cuda.ok()) << tiny_cuda.status();
  for (const char* backend : {"cuda", "auto"}) {
    SCOPED_TRACE(backend);
    o.backend = backend;
    auto e = Executor::Create(*tiny_cuda, o);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->Status().backend, "cuda");
  }
}

}  // namespace
}  // namespace decode_indexer::testing
