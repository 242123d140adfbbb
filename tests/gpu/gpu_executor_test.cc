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
#include <cstdint>
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

// The CUDA backend's near-tie tolerance in fp32 ulps of a row's largest logit.
constexpr double kCudaUlps = 16.0;

std::unique_ptr<Executor> Make(const config::Profile& p, const std::string& backend) {
  ExecutorOptions o;
  o.backend = backend;
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

TEST(GpuExecutorTest, GraphReplaysAnswerAsEagerStepsBitForBit) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "no CUDA GPU visible: the CUDA graph test is skipped here";
  }
  struct Variant {
    const char* name;
    config::Profile profile;
    bool masked;
  };
  for (const Variant& v : {Variant{"v32", GraphV32(), false}, Variant{"v41", GraphV41(), false},
                           Variant{"v41 masked", GraphV41(), true}}) {
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
    o.cuda_graphs = false;
    auto off = Executor::Create(v.profile, o);
    ASSERT_TRUE(on.ok() && off.ok()) << on.status() << " / " << off.status();

    // Sequence 0 starts 7 below the 4096 bucket edge and grows 2 a round: its rows' longest
    // length is 4091, 4093, 4095 (one bucket), then 4097 and on (the next). The others stay
    // longer than K (a real top-k) and inside the first bucket.
    const std::vector<uint64_t> ids = {21, 22, 23, 24};
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE((*on)->CreateSequence(ids[i]).ok());
      ASSERT_TRUE((*off)->CreateSequence(ids[i]).ok());
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
        ASSERT_TRUE(a.ok()) << a.status();
        ASSERT_TRUE(b.ok()) << b.status();
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
    EXPECT_TRUE(st_on.healthy) << st_on.health_detail;
    EXPECT_TRUE((*on)
                    ->WithAnswerDevice([&](kernels::Device& be) {
                      return be.UnregisterHostMemory(region_mem.data());
                    })
                    .ok());
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
