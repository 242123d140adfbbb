// The executor's one test seam, two hooks, both null in production (the executor then pays a
// pointer check a step, a rank one per point below): FaultHooks, where a decode step can be
// made to fail as a real fault would or be held mid-run; StepObserver, told where a step's
// time goes (the benchmarks' phase tables), so the production path reads no clock for them.
// The implementations, and the helpers tests and benchmarks drive them with, live in
// server/testing/ (fault_injection.h, step_timer.h), never linked by the server.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace decode_indexer::exec {

// One decode step's faults, consulted by every rank of that step from its own thread (so
// const, and safe to call concurrently), at the three points where a real fault can strike.
class StepFaults {
 public:
  virtual ~StepFaults() = default;

  // Before the rank scores its rows. A non-OK status fails the rank's step as a launch error
  // would; the call may also block (a test holding the step mid-run) and return OK.
  virtual absl::Status BeforeScoring(int32_t rank) const = 0;

  // In a sharded step with a collective, once the host agreement has passed on every rank.
  struct AfterAgreement {
    enum class Kind {
      kNone,             // the rank goes on
      kSkipGather,       // returns `status` at once, never joining the all-gather (a stuck
                         // device: only the collective's timeout ends the peers' wait)
      kFailSynchronize,  // the synchronize that waits for its kernels fails with `status`,
                         // which aborts the collective (an asynchronous kernel fault)
    };
    Kind kind = Kind::kNone;
    absl::Status status;
  };
  virtual AfterAgreement AfterTheAgreement(int32_t rank) const = 0;

  // In a step with no collective (unsharded, or direct answers), after scoring: a non-OK
  // status fails the rank's step (a stuck or faulty device has no peer to keep waiting).
  virtual absl::Status WithoutCollective(int32_t rank) const = 0;
};

// Owned by the executor (SetFaultHooks, executor_internal.h). Called under the executor's
// turn once per decode step that reaches the ranks, `index` counting those steps from 0 since
// the hooks were set; null: the step runs untouched.
class FaultHooks {
 public:
  virtual ~FaultHooks() = default;
  virtual std::shared_ptr<const StepFaults> ForStep(uint64_t index) = 0;
};

// Owned by the executor (SetStepObserver): told when each decode step that reaches the ranks
// passes the points below. Step marks come under the executor's turn; rank marks from each
// rank's own thread (concurrently across ranks; one rank's in order), and are complete when
// DecodeStep returns. A failed step stops passing marks where it failed.
class StepObserver {
 public:
  virtual ~StepObserver() = default;

  enum class StepMark {
    kPlan,       // DecodeStep entered: planning under the turn
    kFanOut,     // the plan handed to the ranks
    kJoined,     // every rank returned
    kCommitted,  // the step committed (a failed one does not reach this)
  };
  virtual void OnStep(StepMark mark) = 0;

  enum class RankMark {
    kStepBegin,     // the rank's step entered
    kUploadsBegin,  // uploads, key inserts and q prep begin
    kLaunchBegin,   // ... issued; the kernel section (eager launches or a graph replay) begins
    kLaunchEnd,     // ... issued
    kScored,        // the rank's own work finished: before its collectives, or at its end
    kCopiesBegin,   // after any collective: the answer copies begin
    kWaitBegin,     // ... issued; the final synchronize begins
    kWaitEnd,       // ... returned
  };
  virtual void OnRank(int32_t rank, RankMark mark) = 0;
};

}  // namespace decode_indexer::exec
