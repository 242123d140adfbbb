// Test harness for the executor: small profiles, random steps, and an oracle that recomputes
// every answer with the independent reference (reference/reference.h: no code shared with
// kernels/, the backends under test) from its own record of every accepted key (no pages, no
// ranks, no staging), so the executor's math, paging, sharding and plumbing are all checked.
// Answers are held to the spec's section-6 rule (Answer::Matches).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "decode_indexer/kernels/types.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "tests/reference/profile_reference.h"

namespace decode_indexer::testing {

// The test's seed (tests/test_seed.h: DI_TEST_SEED replays one; printed when a test fails).
uint64_t FreshSeed();

// v41-style: H 4, D 128, K 24, page 16, FP4, candidate block 4 x 10 blocks; layers 0 dense,
// 1 source, 2 and 3 consumers of 1.
config::Profile SmallV41();
// v32-style: H 4, D 128, K 32, page 16, FP8, NeoX YaRN RoPE, Hadamard on; 2 dense layers.
config::Profile SmallV32();
// At the CUDA kernels' full width, short context (GPU tests): v32 (H 64, D 128, K 2048, FP8,
// YaRN NeoX RoPE), two dense layers; and v41-like (H 32, D 128, K 512, FP4, blocks of 8): a
// dense layer, the source and four consumers, 256 candidate blocks so that consumers score a
// real subset of a few-thousand-token context.
config::Profile FullWidthV32(int64_t max_context);
config::Profile FullWidthV41(int64_t max_context);

exec::ExecutorOptions CpuOptions(int32_t ranks);

// One sequence's part of a step to build.
struct SeqPlan {
  uint64_t id = 0;
  int32_t rows = 1;
  int32_t new_keys = 0;              // keys inserted (0 at a consumer)
  std::vector<int32_t> row_lengths;  // empty: causal
};

// A step with the buffers its StepInput points into.
struct StepData {
  exec::StepInput input;
  std::vector<std::vector<uint8_t>> keys;    // per sequence
  std::vector<std::vector<uint8_t>> scales;  // per sequence
  std::vector<uint8_t> q;
  std::vector<uint8_t> q_scales;
  std::vector<float> weights;
  std::vector<int64_t> positions;

  StepData() = default;
  StepData(const StepData&) = delete;
  StepData& operator=(const StepData&) = delete;
};

enum class QForm { kF32, kBF16, kQuantized };
enum class KeyForm { kF32, kBF16, kQuantized };

class Harness {
 public:
  Harness(config::Profile profile, uint64_t seed);

  const config::Profile& profile() const { return profile_; }
  std::mt19937_64& rng() { return rng_; }

  // Random keys of the given form for the cache `layer` owns.
  void RandomKeys(int32_t layer, int32_t count, KeyForm form, std::vector<uint8_t>* keys,
                  std::vector<uint8_t>* scales, kernels::ElemType* type);
  std::unique_ptr<StepData> MakeStep(int32_t layer, const std::vector<SeqPlan>& seqs,
                                     QForm q_form = QForm::kF32, KeyForm key_form = KeyForm::kF32,
                                     bool with_positions = true);

  // The oracle's record of what a successful call did.
  void RecordAppend(uint64_t id, int32_t layer, const exec::KeysInput& keys);
  void RecordStep(const StepData& step);
  void Release(uint64_t id) { model_.erase(id); }
  int64_t Length(uint64_t id, int32_t cache_layer) const;

  // The oracle's answer for a step already recorded with RecordStep. At a source it also
  // keeps the candidates that later consumer steps use (AdoptCandidates replaces them with
  // the executor's, once checked: they may legally differ at near-ties).
  using Answer = RefAnswer;
  Answer Oracle(const StepData& step);
  void AdoptCandidates(const StepData& step, const std::vector<int32_t>& blocks);
  // Oracle(step), then Matches(result) (candidates at a source, then adopted).
  ::testing::AssertionResult Check(const StepData& step, const exec::StepResult& result);

 private:
  struct KeyBatch {
    kernels::ElemType type;
    int32_t count;
    std::vector<uint8_t> keys;
    std::vector<uint8_t> scales;
  };
  struct SeqModel {
    std::map<int32_t, std::vector<KeyBatch>> inserts;  // by cache layer
    std::map<int32_t, int64_t> length;
    std::vector<int32_t> candidates;  // the last source answer's rows, [rows, NB]
    // The reference's dequantized entries, and how many of `inserts` they already hold.
    std::map<int32_t, reference::Cache> entries;
    std::map<int32_t, size_t> applied;
  };

  config::Profile profile_;
  std::mt19937_64 rng_;
  reference::Rope rope_;
  std::vector<double> inv_freq_;
  std::map<uint64_t, SeqModel> model_;
};

}  // namespace decode_indexer::testing
