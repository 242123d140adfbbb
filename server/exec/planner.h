// The plan of a decode step, built in one place (the step's "plan" in
// shared/design/architecture.md): the stateful checks against the sequence table, the page
// and candidate-store reservation (all-or-nothing), row_shard_bounds evaluated once, and the
// StepPlan every rank runs, with the answer's destination resolved once. The executor holds
// the turn and its mutex while planning; it runs the plan on the ranks (decode_rows.h) and
// then commits what the plan reserved, or abandons it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "server/config/profile.h"
#include "server/exec/answer_sink.h"
#include "server/exec/candidate_overlap.h"
#include "server/exec/executor.h"
#include "server/exec/page_table_mirror.h"
#include "server/exec/step_types.h"
#include "server/exec/validated_step.h"
#include "server/state/page_allocator.h"
#include "server/state/sequence_table.h"

namespace decode_indexer::exec {

// A request field's name, made only when a check fails (a step checks every sequence: building
// names up front cost ~3 strings a sequence a step).
using FieldName = absl::FunctionRef<std::string()>;

// A position for keys (KeysInput::position, validated not negative): at most the cache's
// committed length.
absl::Status CheckPosition(const std::optional<int64_t>& position, int64_t length,
                           int32_t cache_layer, FieldName field);

// What a planned step holds besides the StepPlan: what its commit (or abandonment) needs.
struct PlannedStep {
  const config::LayerSpec* spec = nullptr;
  bool source = false;
  bool consumer = false;
  int32_t pool = 0;
  std::vector<state::SequenceState*> seqs;  // per request
  std::vector<int64_t> lengths;             // per request, the cache length after the step
  std::vector<state::CacheWrite> writes;    // per request, reserved
  std::vector<int32_t> new_blocks;          // source: the reserved candidate-store blocks
  std::vector<uint64_t> versions;           // source: the new candidates' versions
  std::vector<ExpansionRow> expansion;      // the rows of the step's expansion (sources, consumers)
  AnswerSink::Kind sink_kind = AnswerSink::Kind::kVector;
  // The answer so far: ids, counts, and the vectors the ranks write into where they do.
  StepResult result;
};

class StepPlanner {
 public:
  // The executor's host truth the planner reads and reserves from. Owned by the executor and
  // changed only by the turn holder under its mutex; the planner keeps references.
  struct HostState {
    const config::Profile& profile;
    const ExecutorOptions& options;
    const std::vector<int32_t>& pool_of_layer;  // cache layer -> pool index
    const std::vector<kernels::CacheGeometry>& pool_geometry;
    state::SequenceTable& table;
    std::vector<state::PageAllocator>& pools;
    std::optional<state::PageAllocator>& store_blocks;
    PageTableMirror& mirror;
    const ExpansionLedger& expansions;  // which rows the ranks' expansions hold
    uint64_t& next_candidate_version;
    // NOT_FOUND for an unknown sequence id (the executor knows which were released idle).
    std::function<absl::Status(const std::string& field, uint64_t id)> no_sequence;
  };

  explicit StepPlanner(HostState host) : host_(std::move(host)) {}

  // Once the ranks exist: their number (row_shard_bounds' world) and whether every rank has
  // page-locked readback space, so answers bound for the result's vectors or an encoder are
  // deferred (StepPlan::defer_topk / defer_candidates).
  void Init(int32_t world_size, bool defer_answers);

  // Checks `step` (its stateless checks passed: validated_step.h) against the sequence table,
  // reserves its pages (and a source's store blocks) and fills `plan` (Reset by the caller)
  // and `out`. On failure nothing stays reserved and nothing changed. On success the
  // reservation is held until Commit by the executor or Abandon.
  absl::Status Plan(const ValidatedStep& step, StepPlan& plan, PlannedStep& out);

  // Gives back what Plan reserved (a failed step): the fresh pages and the store blocks.
  void Abandon(PlannedStep& planned);

  // An encoder sink's top-k where the ranks have no readback space (filled by the ranks).
  std::span<const int32_t> encode_scratch() const { return encode_scratch_; }

 private:
  HostState host_;
  int32_t world_size_ = 1;
  bool defer_answers_ = false;
  std::vector<int64_t> step_slots_;  // the step's key slots
  std::vector<int32_t> encode_scratch_;
};

}  // namespace decode_indexer::exec
