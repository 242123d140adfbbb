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

namespace decode_indexer::exec {

using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<kernels::Backend>>(
    int32_t rank, const kernels::BackendLimits& limits)>;

// options.ranks must be >= 1. options.backend "cuda" with ranks > 1 makes the ranks gather
// through NCCL (rank r on device r, in NCCL builds); anything else through host memory.
absl::StatusOr<std::unique_ptr<Executor>> CreateExecutorWithBackends(const config::Profile& profile,
                                                                     const ExecutorOptions& options,
                                                                     BackendFactory factory);

// Test hook, also reachable as DI_INJECT_FAULT=RANK:error|hang|device[:STEP]: the decode step
// `step` calls from now (0: the next one to reach the ranks) fails on `rank`: with an error
// before scoring (as a launch error would); or, in a sharded step with a collective, by
// passing the host agreement and then skipping the all-gather (hang: as a stuck device would),
// which the collective's timeout ends; or by passing the agreement and then failing the
// synchronize that waits for its kernels (device: as an asynchronous kernel fault would),
// which must abort the collective at once. A sharded step with no collective (direct
// answers, not a source) has nothing to hang in: there both are an error after scoring.
// Through InjectFault only (not DI_INJECT_FAULT), `pause`: the rank calls it before scoring
// and then runs the step normally, so a test can hold a step mid-run (e.g. until its
// caller's deadline has passed) without a timing guess.
struct FaultInjection {
  int32_t rank = -1;  // -1: none
  bool hang = false;
  uint64_t step = 0;
  bool device = false;  // (with hang false) the device kind
  std::function<void()> pause = nullptr;
};
void InjectFault(Executor& executor, const FaultInjection& fault);

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
