// Inside the exec module (and its tests): an executor over backends from a given factory.
// Executor::Create picks them from ExecutorOptions::backend; tests hand in wrapped backends
// (e.g. one that checks every pointer a kernel receives lies in its own memory, which a CPU
// backend cannot tell apart from host memory).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_indexer/kernels/backend.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/fault_hooks.h"

namespace decode_indexer::exec {

using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<kernels::Backend>>(
    int32_t rank, const kernels::BackendLimits& limits)>;

// options.ranks must be >= 1. options.backend "cuda" with ranks > 1 makes the ranks gather
// through NCCL (rank r on device r, in NCCL builds); anything else through host memory.
absl::StatusOr<std::unique_ptr<Executor>> CreateExecutorWithBackends(const config::Profile& profile,
                                                                     const ExecutorOptions& options,
                                                                     BackendFactory factory);

// The test seam (fault_hooks.h): the hooks every later decode step consults (null, as in
// production: none), their step index counted from this call. Tests set them through
// server/testing/fault_injection.h.
void SetFaultHooks(Executor& executor, std::shared_ptr<FaultHooks> hooks);

// Every rank's status of the last job that ran on the ranks.
std::vector<absl::Status> LastRankStatuses(const Executor& executor);

// Per rank, the last decode step's time before its collectives and in them (ns): where a
// sharded step's time goes (benchmarks).
struct RankStepTimes {
  int64_t score_ns = 0;
  int64_t collective_ns = 0;
  // Rank::Phases of the last step: uploads issued, kernels issued, copies issued, final wait.
  int64_t uploads_ns = 0;
  int64_t launch_ns = 0;
  int64_t copies_ns = 0;
  int64_t wait_ns = 0;
  // Backend::LastScoringUs of the last eager scoring call (its kernels' device time); -1
  // where the backend does not time them or the step replayed a graph.
  double scoring_us = -1;
};
std::vector<RankStepTimes> LastRankStepTimes(const Executor& executor);
// Backend::SetScoringTiming on every rank (benchmarks; call between steps).
void SetScoringTiming(Executor& executor, bool on);

// The executor's own share of the last decode step (ns): planning under the turn (checks,
// page reservation, the plan), the fan-out to the ranks and back (the rank jobs and the
// hand-offs), and the commit.
struct StepPhases {
  int64_t plan_ns = 0;
  int64_t ranks_ns = 0;
  int64_t commit_ns = 0;
};
StepPhases LastStepPhases(const Executor& executor);

// Per rank, the backend's LastOverlapTiming (CandidateOverlap's fork/join spans), read between
// steps (benchmarks).
std::vector<absl::StatusOr<kernels::Backend::OverlapTiming>> LastOverlapTimings(
    const Executor& executor);

}  // namespace decode_indexer::exec
