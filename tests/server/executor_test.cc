// The executor on the CPU backend: every answer against the oracle (the kernels' CPU free
// functions on contiguous caches), bit-identity across rank counts, sharded and unsharded,
// batch composition, and the candidate paths (overlap on/off, sparse/masked).
#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/exec/executor.h"
#include "server/exec/executor_internal.h"
#include "server/exec/rank.h"
#include "server/exec/step_io.h"
#include "server/exec/step_types.h"
#include "tests/server/checking_backend.h"
#include "tests/server/exec_harness.h"

namespace decode_indexer::testing {
namespace {

using config::LayerRole;
using exec::Executor;
using exec::ExecutorOptions;
using exec::KeysInput;
using exec::StepResult;

std::unique_ptr<Executor> MakeExecutor(const config::Profile& profile,
                                       const ExecutorOptions& options) {
  absl::StatusOr<std::unique_ptr<Executor>> e = Executor::Create(profile, options);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

// Appends `count` random keys to `layer` for `id` and records them in the oracle.
void Append(Harness& h, Executor& e, uint64_t id, int32_t layer, int32_t count, KeyForm form) {
  std::vector<uint8_t> keys, scales;
  KeysInput in;
  h.RandomKeys(layer, count, form, &keys, &scales, &in.type);
  in.count = count;
  in.keys = keys.data();
  in.scales = scales.empty() ? nullptr : scales.data();
  absl::StatusOr<int64_t> len = e.AppendKeys(id, layer, in);
  ASSERT_TRUE(len.ok()) << len.status();
  h.RecordAppend(id, layer, in);
  EXPECT_EQ(*len, h.Length(id, layer));
}

KeyForm RandomKeyForm(std::mt19937_64& rng) { return static_cast<KeyForm>(rng() % 3); }
QForm RandomQForm(std::mt19937_64& rng) { return static_cast<QForm>(rng() % 3); }

// Scatters the free lists: sequences come and go before the real ones, so page lists are
// not 0, 1, 2, ...
void ScatterPages(Harness& h, Executor& e) {
  for (uint64_t id = 1000; id < 1006; ++id) {
    ASSERT_TRUE(e.CreateSequence(id).ok());
    for (int32_t layer : h.profile().CacheLayers()) {
      Append(h, e, id, layer, 1 + int32_t(h.rng()() % 60), KeyForm::kF32);
    }
  }
  for (uint64_t id : {1001, 1003, 1004}) {
    ASSERT_TRUE(e.ReleaseSequence(id).ok());
    h.Release(id);
  }
}

struct ScenarioResult {
  std::vector<std::vector<int32_t>> answers;  // every step's topk, then candidates
  int32_t steps = 0;
  int32_t sharded = 0;
};

// A scripted run with random content: prefill (lengths below and above K), then rounds of
// steps through every layer with next_n 1, 2 and 4, uniform and mixed, with causal and
// explicit row lengths. Everything random comes from the harness' seed, so two runs with
// the same seed send the same calls whatever the executor options.
ScenarioResult RunScenario(const config::Profile& profile, const ExecutorOptions& options,
                           uint64_t seed, bool check_oracle,
                           exec::BackendFactory factory = nullptr) {
  ScenarioResult out;
  Harness h(profile, seed);
  std::unique_ptr<Executor> e;
  if (factory) {
    absl::StatusOr<std::unique_ptr<Executor>> made =
        exec::CreateExecutorWithBackends(profile, options, factory);
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) e = *std::move(made);
  } else {
    e = MakeExecutor(profile, options);
  }
  if (e == nullptr) return out;
  std::mt19937_64& rng = h.rng();
  ScatterPages(h, *e);
  const int32_t K = profile.topk;
  std::vector<uint64_t> ids;
  for (uint64_t id = 1; id <= 8; ++id) {
    EXPECT_TRUE(e->CreateSequence(id).ok());
    ids.push_back(id);
    for (int32_t layer : profile.CacheLayers()) {
      // Lengths around K: some rows below it (answer 0..L-1), most above.
      const int32_t total = 4 + int32_t(rng() % (3 * K));
      const int32_t first = 1 + int32_t(rng() % total);
      Append(h, *e, id, layer, first, RandomKeyForm(rng));
      if (total > first) Append(h, *e, id, layer, total - first, RandomKeyForm(rng));
    }
  }
  const int32_t next_ns[] = {1, 2, 4, 2, 1, 4};
  for (int round = 0; round < 6; ++round) {
    const int32_t n = next_ns[round];
    // Even rounds: all 8 sequences, uniform (shardable); odd rounds: a shuffled subset with
    // mixed row counts (unsharded).
    std::vector<uint64_t> chosen = ids;
    std::shuffle(chosen.begin(), chosen.end(), rng);
    if (round % 2 == 1) chosen.resize(3 + rng() % 5);
    std::vector<SeqPlan> plans;
    for (uint64_t id : chosen) {
      SeqPlan p;
      p.id = id;
      p.rows = round % 2 == 1 ? 1 + int32_t(rng() % 4) : n;
      p.new_keys = p.rows + (rng() % 4 == 0 ? int32_t(rng() % 3) : 0);
      plans.push_back(p);
    }
    const bool explicit_lengths = round == 3;
    std::vector<SeqPlan> source_plans;
    for (const config::LayerSpec& layer : profile.layers) {
      std::vector<SeqPlan> step_plans = plans;
      if (layer.role == LayerRole::kCandidateConsumer) {
        step_plans = source_plans;
        for (SeqPlan& p : step_plans) p.new_keys = 0;
      } else if (explicit_lengths) {
        for (SeqPlan& p : step_plans) {
          const int64_t L = h.Length(p.id, layer.layer) + p.new_keys;
          p.row_lengths.clear();
          for (int32_t j = 0; j < p.rows; ++j) {
            p.row_lengths.push_back(1 + int32_t(rng() % L));
          }
        }
      }
      if (layer.role == LayerRole::kCandidateSource) source_plans = step_plans;
      std::unique_ptr<StepData> step =
          h.MakeStep(layer.layer, step_plans, RandomQForm(rng), RandomKeyForm(rng), rng() % 4 != 0);
      step->input.return_candidates = layer.role == LayerRole::kCandidateSource;
      SCOPED_TRACE(absl::StrCat("round ", round, " layer ", layer.layer));
      absl::StatusOr<StepResult> r = e->DecodeStep(step->input);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return out;
      h.RecordStep(*step);
      ++out.steps;
      out.sharded += r->sharded;
      EXPECT_EQ(r->step_id, step->input.step_id);
      EXPECT_EQ(r->num_rows, step->input.num_rows);
      EXPECT_EQ(r->topk, K);
      for (size_t i = 0; i < step_plans.size(); ++i) {
        EXPECT_EQ(r->lengths[i], h.Length(step_plans[i].id, layer.cache_layer));
      }
      if (check_oracle) {
        EXPECT_TRUE(h.Check(*step, *r));
        if (layer.role == LayerRole::kCandidateSource) {
          EXPECT_EQ(r->num_candidate_blocks, profile.num_candidate_blocks);
        }
      }
      out.answers.push_back(r->topk_indices);
      if (layer.role == LayerRole::kCandidateSource) out.answers.push_back(r->candidate_blocks);
    }
  }
  return out;
}

TEST(Executor, DenseLayersMatchOracle) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  ScenarioResult r = RunScenario(SmallV32(), CpuOptions(1), seed, /*check_oracle=*/true);
  EXPECT_EQ(r.steps, 12);
}

TEST(Executor, CandidateLayersMatchOracle) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  ScenarioResult r = RunScenario(SmallV41(), CpuOptions(1), seed, /*check_oracle=*/true);
  EXPECT_EQ(r.steps, 24);
}

// 1, 2 and 4 ranks, sharded where the gate allows and with the gate closed, answer
// bit-identically; and the sharded runs do shard.
TEST(Executor, RanksAreBitIdentical) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& profile : {SmallV41(), SmallV32()}) {
    SCOPED_TRACE(profile.name);
    ScenarioResult base = RunScenario(profile, CpuOptions(1), seed, /*check_oracle=*/true);
    EXPECT_EQ(base.sharded, 0);
    for (int32_t ranks : {2, 4}) {
      for (int32_t min_requests : {2, 1000}) {
        SCOPED_TRACE(absl::StrCat(ranks, " ranks, min requests ", min_requests));
        ExecutorOptions o = CpuOptions(ranks);
        o.row_shard_min_requests = min_requests;
        ScenarioResult r = RunScenario(profile, o, seed, /*check_oracle=*/false);
        EXPECT_EQ(r.answers, base.answers);
        if (min_requests == 2) {
          EXPECT_GT(r.sharded, 0);
          EXPECT_LT(r.sharded, r.steps);  // the mixed rounds stay unsharded
        } else {
          EXPECT_EQ(r.sharded, 0);
        }
      }
    }
  }
}

// CandidateOverlap on or off, sparse or masked consumers: the same answers.
TEST(Executor, CandidateVariantsAgree) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  ScenarioResult base = RunScenario(SmallV41(), CpuOptions(1), seed, /*check_oracle=*/false);
  ASSERT_EQ(base.steps, 24);
  struct Variant {
    bool overlap, masked;
    int32_t ranks;
  };
  for (const Variant& v :
       {Variant{false, false, 1}, Variant{true, true, 1}, Variant{false, true, 1},
        Variant{false, false, 2}, Variant{true, true, 2}}) {
    SCOPED_TRACE(absl::StrCat("overlap ", v.overlap, " masked ", v.masked, " ranks ", v.ranks));
    ExecutorOptions o = CpuOptions(v.ranks);
    o.candidate_overlap = v.overlap;
    o.masked_consumer = v.masked;
    EXPECT_EQ(RunScenario(SmallV41(), o, seed, /*check_oracle=*/false).answers, base.answers);
  }
}

// Every pointer the kernels receive is the backend's own memory and copies go the stated
// way, for every layer role, q form, key form, and sharded and unsharded steps; the answers
// are the plain backend's.
TEST(Executor, KernelsOnlySeeBackendMemory) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::atomic<int64_t> violations{0};
  exec::BackendFactory checked = [&](int32_t, const kernels::BackendLimits& limits)
      -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
    return MakeCheckingBackend(kernels::MakeCpuBackend(limits, 1), &violations);
  };
  for (bool masked : {false, true}) {
    ExecutorOptions o = CpuOptions(2);
    o.masked_consumer = masked;
    ScenarioResult plain = RunScenario(SmallV41(), o, seed, /*check_oracle=*/false);
    ScenarioResult r = RunScenario(SmallV41(), o, seed, /*check_oracle=*/false, checked);
    EXPECT_EQ(r.answers, plain.answers);
    EXPECT_GT(r.sharded, 0);
  }
  ScenarioResult plain = RunScenario(SmallV32(), CpuOptions(1), seed, /*check_oracle=*/false);
  ScenarioResult r = RunScenario(SmallV32(), CpuOptions(1), seed, /*check_oracle=*/false, checked);
  EXPECT_EQ(r.answers, plain.answers);
  EXPECT_EQ(violations.load(), 0);
}

// One packed upload per step (ExecutorOptions::packed_uploads, step_io.h PackStepUploads):
// each rank's step makes exactly two host-to-device copy calls, the ring slot holding every
// small array (row tables, request slots, page-table edits, store rows, positions, weights,
// q scales, keys) and q itself, for every layer role, q form, key form, rank count, sharded
// or not; with the option off (one copy per array, as before the ring) it makes more. The
// answers are the same either way. Counted by the device itself (CheckingDevice), so a copy
// the executor makes outside its staging is counted too.
TEST(Executor, OnePackedUploadPerStep) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& profile : {SmallV41(), SmallV32()}) {
    for (int32_t ranks : {1, 2}) {
      std::vector<std::vector<int32_t>> answers[2];
      for (bool packed : {true, false}) {
        SCOPED_TRACE(absl::StrCat(profile.name, " ranks ", ranks, " packed ", packed));
        std::atomic<int64_t> violations{0};
        std::vector<std::atomic<int64_t>> copies(ranks);
        std::vector<CheckingDevice*> backends(ranks, nullptr);
        exec::BackendFactory factory = [&](int32_t rank, const kernels::BackendLimits& limits)
            -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
          return MakeCheckingBackend(kernels::MakeCpuBackend(limits, 1), &violations, rank, nullptr,
                                     nullptr, &backends[rank]);
        };
        ExecutorOptions o = CpuOptions(ranks);
        o.packed_uploads = packed;
        absl::StatusOr<std::unique_ptr<Executor>> made =
            exec::CreateExecutorWithBackends(profile, o, factory);
        ASSERT_TRUE(made.ok()) << made.status();
        Executor& e = **made;
        Harness h(profile, seed);
        std::mt19937_64& rng = h.rng();
        ScatterPages(h, e);
        std::vector<uint64_t> ids;
        for (uint64_t id = 1; id <= 6; ++id) {
          ASSERT_TRUE(e.CreateSequence(id).ok());
          ids.push_back(id);
          for (int32_t layer : profile.CacheLayers()) {
            Append(h, e, id, layer, 8 + int32_t(rng() % 80), KeyForm::kF32);
          }
        }
        for (int32_t r = 0; r < ranks; ++r) backends[r]->CountCopiesToDevice(&copies[r]);
        int64_t most = 0;
        // Every q form and key form at every layer, next_n 1 and 2 (sharded on 2 ranks), and
        // a step with mixed row counts (unsharded).
        for (int round = 0; round < 6; ++round) {
          std::vector<SeqPlan> plans;
          for (size_t i = 0; i < ids.size(); ++i) {
            SeqPlan p;
            p.id = ids[i];
            p.rows = round == 5 ? 1 + int32_t(i % 3) : 1 + round % 2;
            p.new_keys = p.rows;
            plans.push_back(p);
          }
          std::vector<SeqPlan> source_plans;
          for (const config::LayerSpec& layer : profile.layers) {
            std::vector<SeqPlan> step_plans = plans;
            if (layer.role == LayerRole::kCandidateConsumer) {
              step_plans = source_plans;
              for (SeqPlan& p : step_plans) p.new_keys = 0;
            }
            if (layer.role == LayerRole::kCandidateSource) source_plans = step_plans;
            std::unique_ptr<StepData> step =
                h.MakeStep(layer.layer, step_plans, static_cast<QForm>(round % 3),
                           static_cast<KeyForm>((round + layer.layer) % 3), round != 4);
            step->input.return_candidates = layer.role == LayerRole::kCandidateSource;
            SCOPED_TRACE(absl::StrCat("round ", round, " layer ", layer.layer));
            for (std::atomic<int64_t>& c : copies) c = 0;
            const uint64_t collectives = e.Status().collectives_total;
            absl::StatusOr<StepResult> res = e.DecodeStep(step->input);
            ASSERT_TRUE(res.ok()) << res.status();
            h.RecordStep(*step);
            // The in-process collective's all-gathers (a source's candidates) copy through
            // the host, one CopyToDevice each; the step's own uploads are the rest. A step's
            // collectives are its agreement and its all-gathers.
            const uint64_t step_collectives = e.Status().collectives_total - collectives;
            const int64_t gathers = step_collectives > 0 ? int64_t(step_collectives) - 1 : 0;
            for (int32_t r = 0; r < ranks; ++r) {
              const int64_t uploads = copies[r].load() - gathers;
              // The slot and q.
              if (packed) {
                EXPECT_EQ(uploads, 2) << "rank " << r;
              }
              most = std::max(most, uploads);
            }
            answers[packed].push_back(res->topk_indices);
            answers[packed].push_back(res->candidate_blocks);
          }
        }
        for (CheckingDevice* b : backends) b->CountCopiesToDevice(nullptr);
        // Without the ring: row tables, request slots, edits, keys, weights, ... one by one.
        if (!packed) {
          EXPECT_GT(most, 4);
        }
        std::printf("%s ranks %d packed %d: at most %lld host-to-device copies a step\n",
                    profile.name.c_str(), ranks, int(packed), static_cast<long long>(most));
        EXPECT_EQ(violations.load(), 0);
      }
      EXPECT_EQ(answers[0], answers[1]);
    }
  }
}

// The small rank (8 rows, 4 requests, 4 heads of 128, one FP8 pool of 16-entry pages) the
// staging ring tests pack for, and the CPU backend's limits for it.
exec::RankSizes StagingTestSizes() {
  exec::RankSizes sizes;
  sizes.max_rows = 8;
  sizes.max_requests = 4;
  sizes.max_pages_per_sequence = 4;
  sizes.max_sequences = 4;
  sizes.table_edit_chunk = 16;
  sizes.num_heads = 4;
  sizes.head_dim = 128;
  sizes.topk = 8;
  sizes.key_chunk = 16;
  sizes.pools = {kernels::CacheGeometry{kernels::CacheFormat::kFp8, 128, 16}};
  sizes.pages_per_pool = 8;
  return sizes;
}
kernels::BackendLimits StagingTestLimits(const exec::RankSizes& sizes) {
  kernels::BackendLimits limits;
  limits.max_rows = sizes.max_rows;
  limits.max_requests = sizes.max_requests;
  limits.max_context = 64;
  limits.num_heads = sizes.num_heads;
  limits.head_dim = sizes.head_dim;
  limits.max_topk = sizes.topk;
  return limits;
}

// The staging ring (rank.h StagingRing, step_io.h PackStepUploads) on one rank: a step's
// arrays land in its slot at 64-byte aligned offsets with the very bytes of the plan; a slot
// is handed out again only once the step that filled it settled (its closing Synchronize): a
// step after an unsettled one takes the next slot, and with every slot busy the pack waits
// for the stream and starts over at slot 0. One copy per pack. Without a ring nothing is
// packed and the kernels read the rank's own buffers.
TEST(StagingRing, PacksTheStepAndReusesASlotOnlyOnceSettled) {
  exec::RankSizes sizes = StagingTestSizes();
  const kernels::BackendLimits limits = StagingTestLimits(sizes);
  // A dense step of 3 rows (2 requests), an edit, f32 q with positions, 5 F32 keys in 2 writes.
  exec::StepPlan plan;
  plan.num_rows = 3;
  plan.num_requests = 2;
  plan.row_request = {0, 0, 1};
  plan.row_length = {5, 6, 7};
  plan.request_slot = {2, 3};
  plan.table_edits.push_back(9, 4);
  const std::vector<float> weights = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<int64_t> positions = {4, 5, 6};
  plan.q.type = kernels::ElemType::kF32;
  plan.q.weights = weights.data();
  plan.q.positions = positions.data();
  std::vector<float> keys(5 * 128);
  std::iota(keys.begin(), keys.end(), 0.5f);
  const std::vector<int64_t> slots = {10, 11, 12, 13, 14};
  plan.key_writes.push_back({kernels::ElemType::kF32, 2, keys.data(), nullptr, slots.data()});
  plan.key_writes.push_back(
      {kernels::ElemType::kF32, 3, keys.data() + 2 * 128, nullptr, slots.data() + 2});
  const exec::RowRange range{0, 3};
  std::atomic<int64_t> violations{0};
  std::atomic<int64_t> copies{0};
  for (int32_t ring_slots : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("slots ", ring_slots));
    sizes.staging_slots = ring_slots;
    CheckingDevice* device = nullptr;
    std::unique_ptr<kernels::Backend> backend = MakeCheckingBackend(
        kernels::MakeCpuBackend(limits, 1), &violations, 0, nullptr, nullptr, &device);
    device->CountCopiesToDevice(&copies);
    absl::StatusOr<std::unique_ptr<exec::Rank>> made =
        exec::Rank::Create(0, std::move(backend), sizes);
    ASSERT_TRUE(made.ok()) << made.status();
    exec::Rank& rank = **made;
    exec::Staging staging(rank);
    auto pack = [&]() {
      copies = 0;
      absl::StatusOr<exec::StepUploads> up = exec::PackStepUploads(rank, staging, plan, range);
      EXPECT_TRUE(up.ok()) << up.status();
      return up.ok() ? *std::move(up) : exec::StepUploads{};
    };
    if (ring_slots == 0) {
      const exec::StepUploads up = pack();
      EXPECT_EQ(up.slot, -1);
      EXPECT_EQ(up.row_request, rank.buffers().row_request);
      EXPECT_EQ(up.row_length, rank.buffers().row_length);
      EXPECT_FALSE(up.edits);
      EXPECT_FALSE(up.keys);
      EXPECT_EQ(up.weights, nullptr);
      EXPECT_EQ(copies.load(), 0);
      continue;
    }
    const exec::StepUploads first = pack();
    EXPECT_EQ(copies.load(), 1);
    ASSERT_EQ(first.slot, 0);
    // On the CPU backend the slot is host memory: its bytes are the plan's.
    const uint8_t* base = rank.staging_ring().slot(0);
    auto aligned = [&](const void* p) { return (static_cast<const uint8_t*>(p) - base) % 64 == 0; };
    EXPECT_EQ(std::vector<int32_t>(first.row_request, first.row_request + 3), plan.row_request);
    EXPECT_EQ(std::vector<int32_t>(first.row_length, first.row_length + 3), plan.row_length);
    EXPECT_EQ(std::vector<int32_t>(first.request_slot, first.request_slot + 2), plan.request_slot);
    ASSERT_NE(first.positions, nullptr);
    EXPECT_EQ(std::vector<int64_t>(first.positions, first.positions + 3), positions);
    ASSERT_NE(first.weights, nullptr);
    EXPECT_EQ(std::vector<float>(first.weights, first.weights + 12), weights);
    // With the keys packed, the edit goes in the section's fixed area (the rest padding).
    EXPECT_FALSE(first.edits);
    ASSERT_TRUE(first.section_edits);
    EXPECT_EQ(first.section_edit_index[0], 9);
    EXPECT_EQ(first.section_edit_pages[0], 4);
    for (int32_t i = 1; i < exec::kSectionEdits; ++i) EXPECT_EQ(first.section_edit_index[i], -1);
    ASSERT_TRUE(first.keys);
    ASSERT_EQ(first.key_runs.size(), 1u);  // one type, within a chunk: one run
    const exec::KeyRun& run = first.key_runs[0];
    EXPECT_EQ(run.count, 5);
    const float* packed_keys = reinterpret_cast<const float*>(first.key_base + run.keys_offset);
    EXPECT_EQ(std::vector<float>(packed_keys, packed_keys + keys.size()), keys);
    const int64_t* packed_slots =
        reinterpret_cast<const int64_t*>(first.key_base + run.slots_offset);
    EXPECT_EQ(std::vector<int64_t>(packed_slots, packed_slots + 5), slots);
    const std::vector<const void*> arrays = {first.row_length,
                                             first.request_slot,
                                             first.positions,
                                             first.weights,
                                             first.section_edit_index,
                                             first.section_edit_pages,
                                             first.key_base + run.keys_offset,
                                             first.key_base + run.slots_offset};
    for (const void* p : arrays) EXPECT_TRUE(aligned(p));
    // Slot 0 is busy until settled: the next pack takes slot 1, the one after finds both busy,
    // waits and takes slot 0 again; once settled, slot 0 is free again.
    EXPECT_EQ(pack().slot, 1);
    EXPECT_TRUE(aligned(rank.staging_ring().slot(1)));
    EXPECT_EQ(pack().slot, 0);
    EXPECT_FALSE(rank.staging_ring().busy[1]);
    rank.staging_ring().Settle();
    EXPECT_EQ(pack().slot, 0);
    EXPECT_EQ(copies.load(), 1);
    rank.staging_ring().Settle();

    // Pending edits and the step's own merge into the area, one entry an index, the later
    // edit's page winning.
    exec::TableEdits pending;
    pending.push_back(9, 1);
    pending.push_back(5, 2);
    plan.pending_edits = &pending;
    {
      const exec::StepUploads merged = pack();
      ASSERT_TRUE(merged.section_edits);
      std::map<int32_t, int32_t> area;
      for (int32_t i = 0; i < exec::kSectionEdits; ++i) {
        if (merged.section_edit_index[i] >= 0) {
          EXPECT_TRUE(
              area.emplace(merged.section_edit_index[i], merged.section_edit_pages[i]).second)
              << "index " << merged.section_edit_index[i] << " twice";
        }
      }
      EXPECT_EQ(area, (std::map<int32_t, int32_t>{{5, 2}, {9, 4}}));
      rank.staging_ring().Settle();
    }
    // More edits than the area holds: the area is all padding and the edits are packed
    // after the keys, for UploadStepRows to make before the section.
    for (int32_t i = 0; i < exec::kSectionEdits; ++i) pending.push_back(100 + i, i);
    {
      const exec::StepUploads many = pack();
      ASSERT_TRUE(many.keys);
      EXPECT_FALSE(many.section_edits);
      for (int32_t i = 0; i < exec::kSectionEdits; ++i) {
        EXPECT_EQ(many.section_edit_index[i], -1);
      }
      ASSERT_TRUE(many.edits);
      EXPECT_EQ(many.pending_index[2], 100);
      EXPECT_GT(many.pending_index, reinterpret_cast<const int32_t*>(many.key_base));
      rank.staging_ring().Settle();
    }
    // No keys: no area, the edits packed as arrays.
    const std::vector<exec::KeyWrite> key_writes = std::move(plan.key_writes);
    plan.key_writes.clear();
    {
      const exec::StepUploads keyless = pack();
      EXPECT_FALSE(keyless.keys);
      EXPECT_FALSE(keyless.section_edits);
      EXPECT_EQ(keyless.section_edit_index, nullptr);
      ASSERT_TRUE(keyless.edits);
      EXPECT_EQ(keyless.edit_index[0], 9);
      rank.staging_ring().Settle();
    }
    plan.key_writes = key_writes;
    plan.pending_edits = nullptr;
  }
  EXPECT_EQ(violations.load(), 0);
}

// A step at the limits the slot was sized for packs whole: max rows with staged f32 q, weights
// and positions, a full chunk of keys of the widest form (f32), and either edits that the
// kernel section's area holds or a full chunk of each kind (pending, own) that it does not.
TEST(StagingRing, AStepAtTheLimitsPacksWhole) {
  exec::RankSizes sizes = StagingTestSizes();
  sizes.max_pages_per_sequence = 64;
  sizes.table_edit_chunk = 2 * exec::kSectionEdits;
  sizes.staging_slots = 2;
  const kernels::BackendLimits limits = StagingTestLimits(sizes);
  std::atomic<int64_t> violations{0};
  absl::StatusOr<std::unique_ptr<exec::Rank>> made = exec::Rank::Create(
      0, MakeCheckingBackend(kernels::MakeCpuBackend(limits, 1), &violations), sizes);
  ASSERT_TRUE(made.ok()) << made.status();
  exec::Rank& rank = **made;
  exec::Staging staging(rank);

  exec::StepPlan plan;
  plan.num_rows = 8;
  plan.num_requests = 4;
  plan.row_request = {0, 0, 1, 1, 2, 2, 3, 3};
  plan.row_length = {5, 6, 7, 8, 5, 6, 7, 8};
  plan.request_slot = {0, 1, 2, 3};
  const std::vector<float> weights(8 * 4, 1.0f);
  const std::vector<int64_t> positions = {4, 5, 6, 7, 4, 5, 6, 7};
  plan.q.type = kernels::ElemType::kF32;
  plan.q.weights = weights.data();
  plan.q.positions = positions.data();
  std::vector<float> keys(16 * 128, 0.5f);
  std::vector<int64_t> slots(16);
  std::iota(slots.begin(), slots.end(), 0);
  for (int32_t w = 0; w < 4; ++w) {
    plan.key_writes.push_back(
        {kernels::ElemType::kF32, 4, keys.data() + w * 4 * 128, nullptr, slots.data() + w * 4});
  }
  exec::TableEdits pending;
  for (int32_t n : {exec::kSectionEdits / 2, sizes.table_edit_chunk}) {
    SCOPED_TRACE(absl::StrCat(n, " edits of each kind"));
    pending.clear();
    plan.table_edits.clear();
    for (int32_t i = 0; i < n; ++i) {
      pending.push_back(i, i);
      plan.table_edits.push_back(1000 + i, i);
    }
    plan.pending_edits = &pending;
    absl::StatusOr<exec::StepUploads> up =
        exec::PackStepUploads(rank, staging, plan, exec::RowRange{0, 8});
    ASSERT_TRUE(up.ok()) << up.status();
    EXPECT_GE(up->slot, 0);
    EXPECT_TRUE(up->staged_q());
    ASSERT_TRUE(up->keys) << "a full chunk of f32 keys did not fit the slot";
    ASSERT_EQ(up->key_runs.size(), 1u);
    if (2 * n <= exec::kSectionEdits) {
      EXPECT_TRUE(up->section_edits);
      EXPECT_FALSE(up->edits);
    } else {
      EXPECT_FALSE(up->section_edits);
      EXPECT_TRUE(up->edits) << "a full chunk of edits of each kind did not fit beside the keys";
    }
    rank.staging_ring().Settle();
  }
  EXPECT_EQ(violations.load(), 0);
}

// The sub-step of `full` holding its sequences `order` (in that order), with the very same
// keys, q, weights and positions.
std::unique_ptr<StepData> SubStep(const StepData& full, const std::vector<size_t>& order,
                                  const config::Profile& profile) {
  auto step = std::make_unique<StepData>();
  const exec::StepInput& in = full.input;
  const int32_t H = profile.num_heads;
  const int32_t D = profile.head_dim;
  std::vector<int32_t> first_row(in.sequences.size() + 1, 0);
  for (size_t i = 0; i < in.sequences.size(); ++i) {
    first_row[i + 1] = first_row[i] + in.sequences[i].num_rows;
  }
  const size_t q_row = full.q.size() / in.num_rows;
  const size_t s_row = full.q_scales.empty() ? 0 : full.q_scales.size() / in.num_rows;
  step->input = in;
  step->input.sequences.clear();
  step->input.num_rows = 0;
  for (size_t k : order) {
    step->input.sequences.push_back(in.sequences[k]);
    step->input.num_rows += in.sequences[k].num_rows;
    for (int32_t r = first_row[k]; r < first_row[k + 1]; ++r) {
      step->q.insert(step->q.end(), full.q.begin() + r * q_row, full.q.begin() + (r + 1) * q_row);
      if (s_row > 0) {
        step->q_scales.insert(step->q_scales.end(), full.q_scales.begin() + r * s_row,
                              full.q_scales.begin() + (r + 1) * s_row);
      }
      step->weights.insert(step->weights.end(), full.weights.begin() + size_t(r) * H,
                           full.weights.begin() + size_t(r + 1) * H);
      if (!full.positions.empty()) step->positions.push_back(full.positions[r]);
    }
  }
  (void)D;
  step->input.q.q = step->q.data();
  step->input.q.scales = s_row > 0 ? step->q_scales.data() : nullptr;
  step->input.q.weights = step->weights.data();
  step->input.q.positions = full.input.q.positions ? step->positions.data() : nullptr;
  return step;
}

// A sequence's rows answer the same alone, inside a bigger batch, and in another order.
TEST(Executor, BatchCompositionIndependence) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const config::Profile profile = SmallV41();
  const int32_t K = profile.topk;
  const int32_t NB = profile.num_candidate_blocks;
  // Two executors with the same history; A runs whole batches (sharded on 2 ranks), B runs
  // the same sequences as a reordered part-batch and then one at a time.
  Harness h(profile, seed);
  ExecutorOptions options = CpuOptions(2);
  std::unique_ptr<Executor> a = MakeExecutor(profile, options);
  std::unique_ptr<Executor> b = MakeExecutor(profile, options);
  ASSERT_TRUE(a && b);
  const int32_t S = 8;
  for (uint64_t id = 1; id <= S; ++id) {
    ASSERT_TRUE(a->CreateSequence(id).ok());
    ASSERT_TRUE(b->CreateSequence(id).ok());
    for (int32_t layer : profile.CacheLayers()) {
      std::vector<uint8_t> keys, scales;
      KeysInput in;
      in.count = 1 + int32_t(h.rng()() % (3 * K));
      h.RandomKeys(layer, in.count, KeyForm::kF32, &keys, &scales, &in.type);
      in.keys = keys.data();
      ASSERT_TRUE(a->AppendKeys(id, layer, in).ok());
      ASSERT_TRUE(b->AppendKeys(id, layer, in).ok());
    }
  }
  for (int32_t n : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("next_n ", n));
    std::vector<SeqPlan> plans;
    for (uint64_t id = 1; id <= S; ++id) plans.push_back({id, n, n, {}});
    std::vector<size_t> order(S);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), h.rng());
    // B: the first 3 (shuffled) together, then the rest one by one.
    std::vector<std::vector<size_t>> parts = {{order[0], order[1], order[2]}};
    for (int32_t i = 3; i < S; ++i) parts.push_back({order[i]});
    std::vector<StepData*> source_steps;
    std::unique_ptr<StepData> source_full;
    for (const config::LayerSpec& layer : profile.layers) {
      SCOPED_TRACE(absl::StrCat("layer ", layer.layer));
      std::vector<SeqPlan> step_plans = plans;
      if (layer.role == LayerRole::kCandidateConsumer) {
        for (SeqPlan& p : step_plans) p.new_keys = 0;
      }
      std::unique_ptr<StepData> full = h.MakeStep(layer.layer, step_plans);
      full->input.return_candidates = layer.role == LayerRole::kCandidateSource;
      absl::StatusOr<StepResult> ra = a->DecodeStep(full->input);
      ASSERT_TRUE(ra.ok()) << ra.status();
      EXPECT_TRUE(ra->sharded);
      for (const std::vector<size_t>& part : parts) {
        std::unique_ptr<StepData> sub = SubStep(*full, part, profile);
        absl::StatusOr<StepResult> rb = b->DecodeStep(sub->input);
        ASSERT_TRUE(rb.ok()) << rb.status();
        int32_t row = 0;
        for (size_t k : part) {
          // Sequence k holds rows [k * n, (k + 1) * n) of the full batch.
          for (int32_t j = 0; j < n; ++j, ++row) {
            const auto want = ra->topk_indices.begin() + (size_t(k) * n + j) * K;
            EXPECT_TRUE(std::equal(want, want + K, rb->topk_indices.begin() + size_t(row) * K))
                << "sequence " << k + 1 << " row " << j;
            if (layer.role == LayerRole::kCandidateSource) {
              const auto wc = ra->candidate_blocks.begin() + (size_t(k) * n + j) * NB;
              EXPECT_TRUE(std::equal(wc, wc + NB, rb->candidate_blocks.begin() + size_t(row) * NB));
            }
          }
        }
      }
    }
  }
}

// New keys in device memory (KeysInput::on_device; on the CPU backend device memory is host
// memory): copied device to device, answering bit for bit what the same keys from the host
// answer, in any mix of device and host requests in one step (a device run, a host run, a
// device run: the key staging is reused between them), with q on the host or the device; a
// bad value in any run's staged copy (an FP8 NaN code; a NaN, Inf, zero or negative fp32
// scale; a 0xFF UE8M0 scale) fails the step naming new_keys.data / new_key_scales.data,
// commits nothing (lengths and pages as before, the retry answers as the host twin), whichever
// run it is in and whatever is checked after it.
TEST(Executor, DeviceKeysAnswerAsHostKeysAndAreCheckedOnTheDevice) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (const config::Profile& profile : {SmallV32(), SmallV41()}) {
    for (int32_t ranks : {1, 2}) {
      SCOPED_TRACE(absl::StrCat(profile.name, " ranks ", ranks));
      Harness h(profile, seed);
      std::unique_ptr<Executor> host = MakeExecutor(profile, CpuOptions(ranks));
      std::unique_ptr<Executor> device = MakeExecutor(profile, CpuOptions(ranks));
      ASSERT_TRUE(host && device);
      const std::vector<uint64_t> ids = {1, 2, 3};
      for (uint64_t id : ids) {
        ASSERT_TRUE(host->CreateSequence(id).ok());
        ASSERT_TRUE(device->CreateSequence(id).ok());
        for (int32_t layer : profile.CacheLayers()) {
          std::vector<uint8_t> keys, scales;
          KeysInput in;
          in.count = 20 + int32_t(h.rng()() % 40);
          h.RandomKeys(layer, in.count, KeyForm::kQuantized, &keys, &scales, &in.type);
          in.keys = keys.data();
          in.scales = scales.data();
          ASSERT_TRUE(host->AppendKeys(id, layer, in).ok());
          ASSERT_TRUE(device->AppendKeys(id, layer, in).ok());
          h.RecordAppend(id, layer, in);
        }
      }
      auto infos = [&](Executor& e) {
        std::vector<std::string> out;
        for (uint64_t id : ids) {
          absl::StatusOr<exec::SequenceInfo> info = e.GetSequence(id);
          EXPECT_TRUE(info.ok()) << info.status();
          std::string text;
          for (const exec::SequenceCacheInfo& c : info->caches) {
            absl::StrAppend(&text, c.cache_layer, ":", c.length, "/", c.pages, "/", c.shared_pages,
                            " ");
          }
          out.push_back(text);
        }
        return out;
      };
      // Which requests' keys are on the device: all, none of the middle one (three runs), one.
      const std::vector<std::vector<bool>> mixes = {
          {true, true, true}, {true, false, true}, {false, false, true}};
      int pass = 0;
      for (const std::vector<bool>& mix : mixes) {
        for (const bool q_on_device : {false, true}) {
          for (const config::LayerSpec& layer : profile.layers) {
            if (layer.role == LayerRole::kCandidateConsumer) continue;
            SCOPED_TRACE(absl::StrCat("pass ", pass, " layer ", layer.layer));
            std::vector<SeqPlan> plans;
            for (uint64_t id : ids) plans.push_back({id, 2, 1 + int32_t(h.rng()() % 3), {}});
            std::unique_ptr<StepData> step =
                h.MakeStep(layer.layer, plans, QForm::kQuantized, KeyForm::kQuantized, false);
            step->input.return_candidates = layer.role == LayerRole::kCandidateSource;
            exec::StepInput on = step->input;
            for (size_t i = 0; i < ids.size(); ++i) on.sequences[i].new_keys.on_device = mix[i];
            on.q.on_device = q_on_device;
            // A bad value in one device run (the first or the last), which a later check must
            // not clear.
            const bool fp8 = layer.cache_format == kernels::CacheFormat::kFp8;
            size_t bad = pass % 2 == 0 ? 0 : ids.size() - 1;
            while (!mix[bad]) bad += pass % 2 == 0 ? 1 : -1;
            struct Poison {
              bool scales;
              uint32_t bits;  // fp32 scale bits, or the code byte
            };
            std::vector<Poison> poisons;
            if (fp8) {
              poisons = {{false, 0x7F},       {false, 0xFF},       {true, 0x7FC00000u},
                         {true, 0x7F800000u}, {true, 0xBF800000u}, {true, 0u},
                         {true, 0x80000000u}};
            } else {
              poisons = {{true, 0xFF}};
            }
            const Poison p = poisons[size_t(h.rng()() % poisons.size())];
            std::vector<uint8_t>& victim = p.scales ? step->scales[bad] : step->keys[bad];
            const size_t width = p.scales && fp8 ? 4 : 1;
            const size_t at = width * size_t(h.rng()() % (victim.size() / width));
            const std::vector<uint8_t> clean = victim;
            if (width == 4) {
              std::memcpy(victim.data() + at, &p.bits, 4);
            } else {
              victim[at] = uint8_t(p.bits);
            }
            const std::vector<std::string> before = infos(*device);
            absl::StatusOr<StepResult> r = device->DecodeStep(on);
            EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
            EXPECT_THAT(std::string(r.status().message()),
                        ::testing::HasSubstr(p.scales ? "new_key_scales.data" : "new_keys.data"));
            EXPECT_THAT(std::string(r.status().message()),
                        ::testing::HasSubstr("committed nothing"));
            EXPECT_EQ(infos(*device), before);
            victim = clean;

            absl::StatusOr<StepResult> want = host->DecodeStep(step->input);
            ASSERT_TRUE(want.ok()) << want.status();
            absl::StatusOr<StepResult> got = device->DecodeStep(on);
            ASSERT_TRUE(got.ok()) << got.status();
            h.RecordStep(*step);
            EXPECT_TRUE(h.Check(*step, *want));
            EXPECT_EQ(got->topk_indices, want->topk_indices);
            EXPECT_EQ(got->candidate_blocks, want->candidate_blocks);
            EXPECT_EQ(got->lengths, want->lengths);
            EXPECT_EQ(infos(*device), infos(*host));
          }
          ++pass;
        }
      }
      // Unquantized keys cannot come from device memory; a prefill takes none from there.
      std::unique_ptr<StepData> step =
          h.MakeStep(0, {{1, 1, 1, {}}}, QForm::kQuantized, KeyForm::kF32, false);
      step->input.sequences[0].new_keys.on_device = true;
      absl::StatusOr<StepResult> r = device->DecodeStep(step->input);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_THAT(std::string(r.status().message()),
                  ::testing::HasSubstr("sequences[0].new_keys.dtype"));
      KeysInput in = step->input.sequences[0].new_keys;
      absl::StatusOr<int64_t> appended = device->AppendKeys(1, 0, in);
      EXPECT_EQ(appended.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(infos(*device), infos(*host));
    }
  }
}

// Concurrent callers are served one at a time; each thread's steps answer as the oracle says.
TEST(Executor, ConcurrentCallersAreServedInOrder) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const config::Profile profile = SmallV32();
  Harness h(profile, seed);
  std::unique_ptr<Executor> e = MakeExecutor(profile, CpuOptions(2));
  ASSERT_NE(e, nullptr);
  const int32_t T = 4, steps = 4;
  std::vector<std::vector<std::unique_ptr<StepData>>> work(T);
  for (int32_t t = 0; t < T; ++t) {
    const uint64_t id = 100 + t;
    ASSERT_TRUE(e->CreateSequence(id).ok());
    Append(h, *e, id, 0, 20 + int32_t(h.rng()() % 60), KeyForm::kF32);
    for (int32_t s = 0; s < steps; ++s) {
      work[t].push_back(h.MakeStep(0, {{id, 1 + s % 4, 1 + s % 4, {}}}));
    }
  }
  std::vector<std::vector<StepResult>> results(T);
  std::vector<std::thread> threads;
  for (int32_t t = 0; t < T; ++t) {
    threads.emplace_back([&, t] {
      for (auto& step : work[t]) {
        absl::StatusOr<StepResult> r = e->DecodeStep(step->input);
        if (r.ok()) results[t].push_back(*std::move(r));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  // Sequences are disjoint, so each thread's history replays on its own.
  for (int32_t t = 0; t < T; ++t) {
    ASSERT_EQ(results[t].size(), size_t(steps));
    for (int32_t s = 0; s < steps; ++s) {
      h.RecordStep(*work[t][s]);
      EXPECT_TRUE(h.Check(*work[t][s], results[t][s])) << "thread " << t << " step " << s;
      // Each caller gets its own step's result (not another thread's).
      EXPECT_EQ(results[t][s].step_id, work[t][s]->input.step_id) << "thread " << t;
      ASSERT_EQ(results[t][s].lengths.size(), 1u);
      EXPECT_EQ(results[t][s].lengths[0], h.Length(100 + t, 0)) << "thread " << t << " step " << s;
    }
  }
  exec::ExecutorStatus st = e->Status();
  EXPECT_EQ(st.steps, uint64_t(T * steps));
  EXPECT_EQ(st.num_ranks, 2);
}

// --logits-precision reaches the executor as a string: anything but default / exact / fp8 is
// refused naming the field, and the CPU backend (always exact) takes each valid value.
TEST(Executor, LogitsPrecisionOptionIsValidated) {
  ExecutorOptions o = CpuOptions(1);
  o.logits_precision = "fast";
  const absl::StatusOr<std::unique_ptr<Executor>> bad = Executor::Create(SmallV32(), o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("logits_precision"), std::string_view::npos)
      << bad.status();
  for (const char* v : {"default", "exact", "fp8"}) {
    o.logits_precision = v;
    EXPECT_TRUE(Executor::Create(SmallV32(), o).ok()) << v;
  }
}

}  // namespace
}  // namespace decode_indexer::testing
