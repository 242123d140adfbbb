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
#include "decode_indexer/kernels/bench_clocks.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/step_hooks.h"

namespace decode_indexer::exec {

using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<kernels::Backend>>(
    int32_t rank, const kernels::BackendLimits& limits)>;

// options.ranks must be >= 1. options.backend "cuda" with ranks > 1 makes the ranks gather
// through NCCL (rank r on device r, in NCCL builds); anything else through host memory.
absl::StatusOr<std::unique_ptr<Executor>> CreateExecutorWithBackends(const config::Profile& profile,
                                                                     const ExecutorOptions& options,
                                                                     BackendFactory factory);

// The test seam (step_hooks.h), null as in production unless set: the fault hooks every
// later decode step consults, their step index counted from this call (tests set them
// through server/testing/fault_injection.h); the observer every later decode step tells
// where its time goes (server/testing/step_timer.h). Call between steps.
void SetFaultHooks(Executor& executor, std::shared_ptr<FaultHooks> hooks);
void SetStepObserver(Executor& executor, std::shared_ptr<StepObserver> observer);

// Every rank's status of the last job that ran on the ranks.
std::vector<absl::Status> LastRankStatuses(const Executor& executor);

// Per rank, BenchClocks::LastScoringUs (kernels/bench_clocks.h) of the last decode step's eager
// scoring call (its kernels' device time); -1 where the backend does not time them or the step
// replayed a graph.
std::vector<double> LastScoringUs(const Executor& executor);
// BenchClocks::SetScoringTiming on every rank that has clocks (benchmarks; call between
// steps).
void SetScoringTiming(Executor& executor, bool on);

// Per rank, the backend's LastOverlapTiming (CandidateOverlap's fork/join spans), read between
// steps (benchmarks).
std::vector<absl::StatusOr<kernels::BenchClocks::OverlapTiming>> LastOverlapTimings(
    const Executor& executor);

}  // namespace decode_indexer::exec
