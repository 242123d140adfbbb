// The CUDA entry points of a build without the CUDA backend.
#include "decode_indexer/kernels/backend.h"

namespace decode_indexer::kernels {

bool CudaBackendAvailable() { return false; }

int CudaDeviceCount() { return 0; }

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendLimits& /*limits*/,
                                                         int /*device*/) {
  return absl::UnimplementedError("built without CUDA");
}

}  // namespace decode_indexer::kernels
