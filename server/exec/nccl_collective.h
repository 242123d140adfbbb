// The Collective of CUDA ranks: one NCCL communicator across the executor's devices
// (ncclCommInitAll, one thread; each rank thread then drives its own communicator).
//
// Ordering: the Device interface does not expose its streams, so a collective first waits for
// the rank's backend (Synchronize), runs the NCCL call on the collective's own stream for that
// device and waits for it before returning; later backend work is ordered after it by the host.
// That costs a host round trip per collective (tens of microseconds); running NCCL on the
// backend's main stream would remove it.
//
// Faults: a rank waits for its NCCL call by polling, so a watchdog thread can bound it: every
// millisecond it checks each communicator with an op in flight (ncclCommGetAsyncError) and the
// op's age; on an async error or after the timeout it aborts every communicator
// (ncclCommAbort), which wakes every waiting rank with INTERNAL. Aborted stays aborted.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_indexer/kernels/device.h"
#include "server/exec/collective.h"

namespace decode_indexer::exec {

// backends[r] is rank r's CUDA device (not owned), on device devices[r].
absl::StatusOr<std::unique_ptr<Collective>> MakeNcclCollective(
    std::vector<kernels::Device*> backends, std::vector<int> devices,
    std::chrono::milliseconds timeout);

}  // namespace decode_indexer::exec
