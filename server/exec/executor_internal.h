// Inside the exec module (and its tests): an executor over backends from a given factory.
// Executor::Create picks them from ExecutorOptions::backend; tests hand in wrapped backends
// (e.g. one that checks every pointer a kernel receives lies in its own memory, which a CPU
// backend cannot tell apart from host memory).
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "decode_indexer/kernels/backend.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"

namespace decode_indexer::exec {

using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<kernels::Backend>>(
    int32_t rank, const kernels::BackendLimits& limits)>;

// options.ranks must be >= 1; options.backend is ignored.
absl::StatusOr<std::unique_ptr<Executor>> CreateExecutorWithBackends(const config::Profile& profile,
                                                                     const ExecutorOptions& options,
                                                                     BackendFactory factory);

}  // namespace decode_indexer::exec
