// Test-only: faults injected into an executor's decode steps through its one seam
// (server/exec/step_hooks.h). Linked by tests (di_testing), never by the server.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "server/exec/executor.h"
#include "server/exec/step_hooks.h"

namespace decode_indexer::testing {

// The decode step `step` calls from now (0: the next one to reach the ranks) fails on `rank`:
// with an error before scoring (as a launch error would); or, in a sharded step with a
// collective, by passing the host agreement and then skipping the all-gather (hang: as a
// stuck device would), which the collective's timeout ends; or by passing the agreement and
// then failing the synchronize that waits for its kernels (device: as an asynchronous kernel
// fault would), which must abort the collective at once. A sharded step with no collective
// (direct answers, not a source) has nothing to hang in: there both are an error after
// scoring. With `pause`, the rank calls it before scoring and then runs the step normally,
// so a test can hold a step mid-run (e.g. until its caller's deadline has passed) without a
// timing guess.
struct FaultInjection {
  int32_t rank = -1;  // -1: none
  bool hang = false;
  uint64_t step = 0;
  bool device = false;  // (with hang false) the device kind
  std::function<void()> pause = nullptr;
};

// The fault as the executor's hooks: it acts once, on the step it names.
std::shared_ptr<exec::FaultHooks> MakeFaultHooks(FaultInjection fault);

// Sets the executor's hooks to MakeFaultHooks(fault), replacing any earlier injection.
void InjectFault(exec::Executor& executor, FaultInjection fault);

// DI_INJECT_FAULT=RANK:KIND[:STEP], KIND error|hang|device, STEP the 0-based index of the
// decode step (among those that reach the ranks) to fail, default 0: the fault it names, or
// nullopt (unset, or malformed: then with a warning). For tests that drive a whole process.
std::optional<FaultInjection> FaultFromSpec(std::string_view spec);
std::optional<FaultInjection> FaultFromEnv();
// InjectFault(FaultFromEnv()) where the environment names one; whether it did.
bool InjectFaultFromEnv(exec::Executor& executor);

}  // namespace decode_indexer::testing
