// The executor's one test seam: where a decode step can be made to fail as a real fault would,
// or be held mid-run. Null in production (the executor then pays one pointer check a step and
// a rank one per point below); the implementations and the helpers tests drive them with live
// in server/testing/ (fault_injection.h), linked only by tests.
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

}  // namespace decode_indexer::exec
