// Row copies with optional gather/scatter indices (answer rows into their places).
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

__global__ void CopyRowsKernel(const CopyRowsArgs a) {
  const int i = blockIdx.x;
  const int64_t d = a.dst_index ? a.dst_index[i] : i;
  const int64_t s = a.src_index ? a.src_index[i] : i;
  for (int e = threadIdx.x; e < a.row_elems; e += blockDim.x) {
    a.dst[d * a.row_elems + e] = a.src[s * a.row_elems + e];
  }
}

}  // namespace

absl::Status LaunchCopyRows(const CopyRowsArgs& args, cudaStream_t stream) {
  if (args.num_rows <= 0 || args.row_elems <= 0) return absl::OkStatus();
  CopyRowsKernel<<<args.num_rows, kWarpKernelThreads, 0, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch CopyRowsKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
