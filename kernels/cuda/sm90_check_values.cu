// Backend::CheckValues on the device: NaN / Inf in inputs the host never saw (value_check.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "decode_indexer/kernels/value_check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kCheckThreads = 256;

// blockIdx.y picks the tensor; the blocks of a row stride over its elements (consecutive
// threads read consecutive elements). A block that saw a bad element sets the tensor's word.
__global__ void __launch_bounds__(kCheckThreads) CheckValuesKernel(const ValueCheckArgs a) {
  const ValueCheck v = a.checks[blockIdx.y];
  const int32_t eb = CheckedElemBytes(v.type);
  bool bad = false;
  if (eb != 0) {
    const auto* p = static_cast<const uint8_t*>(v.data);
    const int64_t stride = int64_t{gridDim.x} * blockDim.x;
    for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < v.count; i += stride) {
      uint32_t bits;
      if (eb == 4) {
        bits = __ldg(reinterpret_cast<const uint32_t*>(p) + i);
      } else if (eb == 2) {
        bits = __ldg(reinterpret_cast<const uint16_t*>(p) + i);
      } else {
        bits = __ldg(p + i);
      }
      bad |= IsBadValue(v.type, bits, v.positive);
    }
  }
  // A plain store of 1 to the tensor's own word (ValueFlagWord): every writer stores the same
  // value, so no atomic, and the words may be mapped host memory.
  if (__syncthreads_or(bad) && threadIdx.x == 0 && v.bit != 0) {
    *reinterpret_cast<volatile uint32_t*>(a.flags + ValueFlagWord(v.bit)) = 1u;
  }
}

}  // namespace

absl::Status LaunchCheckValues(const ValueCheckArgs& args, int32_t num_sms, cudaStream_t stream) {
  if (args.flags == nullptr || args.num_checks < 0 ||
      args.num_checks > ValueCheckArgs::kMaxChecks) {
    return absl::InvalidArgumentError("CheckValues: bad arguments");
  }
  if (!args.accumulate) {
    DI_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(args.flags, 0, kValueFlagWords * sizeof(uint32_t), stream),
        "cudaMemsetAsync (value flags)");
  }
  int64_t most = 0;
  for (int32_t c = 0; c < args.num_checks; ++c) {
    if (CheckedElemBytes(args.checks[c].type) == 0 || args.checks[c].count <= 0) continue;
    if (args.checks[c].data == nullptr)
      return absl::InvalidArgumentError("CheckValues: null tensor");
    most = std::max(most, args.checks[c].count);
  }
  if (most == 0) return absl::OkStatus();
  // About one pass of 8 elements a thread, at most two waves of blocks.
  const int64_t want = (most + int64_t{kCheckThreads} * 8 - 1) / (int64_t{kCheckThreads} * 8);
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<int64_t>(want, 1, 2 * int64_t{std::max(num_sms, 1)}));
  CheckValuesKernel<<<dim3(blocks, static_cast<unsigned>(args.num_checks)), kCheckThreads, 0,
                      stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch CheckValuesKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
