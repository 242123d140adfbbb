// Error handling for CUDA runtime calls: every call is checked and turned into an absl::Status
// that names what was being done, so a failure deep inside a launcher surfaces with context.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace decode_indexer::kernels::cuda {

inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

}  // namespace decode_indexer::kernels::cuda

// Returns from the enclosing function (which returns absl::Status) when the call fails.
#define DI_CUDA_RETURN_IF_ERROR(expr, what)                                   \
  do {                                                                        \
    const cudaError_t di_cuda_err_ = (expr);                                  \
    if (di_cuda_err_ != cudaSuccess)                                          \
      return ::decode_indexer::kernels::cuda::CudaStatus(di_cuda_err_, what); \
  } while (0)

// After a kernel launch: the launch itself (configuration, resources) must have succeeded.
#define DI_CUDA_RETURN_IF_LAUNCH_ERROR(what) DI_CUDA_RETURN_IF_ERROR(cudaGetLastError(), what)
