// rope_quant_q (seed): RoPE (NeoX or interleaved pairs, cos/sin in double rounded to float,
// rotation in double), optional Hadamard, FP8 / MXFP4 quantization and weight folding, fused
// in one kernel, one warp per (row, head). Bit-identical to the CPU twin: the same operations
// on the same operands (products of two floats are exact in double, so contraction into FMA
// cannot change the rotation).
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_warp_quant.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

__global__ void __launch_bounds__(kWarpKernelThreads)
    RopeQuantQKernel(const QPrepArgs a, float weight_scale, bool rope) {
  __shared__ float span[kWarpKernelThreads / 32][kWarpVectorDim];
  const int warp_in_block = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t v = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) >> 5;  // row * H + head
  if (v >= int64_t{a.num_rows} * a.num_heads) return;
  const int row = static_cast<int>(v / a.num_heads);
  float x[4];
  WarpLoadVector(a.q_type, a.q, v, lane, x);
  if (rope) {
    float* s = span[warp_in_block];
#pragma unroll
    for (int j = 0; j < 4; ++j) s[4 * lane + j] = x[j];
    __syncwarp();
    const int half = a.rope.rope_dim / 2;
    const double pos = static_cast<double>(a.positions[row]);
    for (int i = lane; i < half; i += 32) {
      const int d1 =
          a.rope.style == RopeStyle::kNeox ? a.rope.dim_offset + i : a.rope.dim_offset + 2 * i;
      const int d2 = a.rope.style == RopeStyle::kNeox ? d1 + half : d1 + 1;
      const double angle = pos * a.rope.inv_freq[i];
      const double c = static_cast<float>(cos(angle));
      const double sn = static_cast<float>(sin(angle));
      const double x1 = s[d1];
      const double x2 = s[d2];
      s[d1] = static_cast<float>(x1 * c - x2 * sn);
      s[d2] = static_cast<float>(x2 * c + x1 * sn);
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = s[4 * lane + j];
  }
  if (a.hadamard) WarpHadamard(x, lane);
  if (a.format == CacheFormat::kFp8) {
    const float s = WarpQuantizeFp8(x, lane, a.q_codes + v * kWarpVectorDim);
    if (lane == 0) a.weights_out[v] = (a.weights_raw[v] * weight_scale) * s;
  } else {
    WarpQuantizeFp4(x, lane, a.q_codes + v * (kWarpVectorDim / 2), a.q_scales + v * 4);
    if (lane == 0) a.weights_out[v] = a.weights_raw[v] * weight_scale;
  }
}

}  // namespace

absl::Status LaunchRopeQuantQ(const QPrepArgs& args, float weight_scale, cudaStream_t stream) {
  if (args.num_rows == 0) return absl::OkStatus();
  if (args.head_dim != kWarpVectorDim) {
    return absl::UnimplementedError(
        absl::StrCat("RopeQuantQ: head dim ", args.head_dim, " (the CUDA kernels need 128)"));
  }
  if (args.num_rows < 0 || args.num_heads <= 0 || args.q == nullptr ||
      args.weights_raw == nullptr || args.q_codes == nullptr || args.weights_out == nullptr ||
      (args.q_type != ElemType::kF32 && args.q_type != ElemType::kBF16) ||
      (args.format == CacheFormat::kFp4 && args.q_scales == nullptr)) {
    return absl::InvalidArgumentError("RopeQuantQ: missing or bad inputs / outputs");
  }
  const bool rope = args.positions != nullptr && args.rope.style != RopeStyle::kNone;
  if (rope &&
      (args.rope.inv_freq == nullptr || args.rope.rope_dim <= 0 || args.rope.rope_dim % 2 != 0 ||
       args.rope.dim_offset < 0 || args.rope.dim_offset + args.rope.rope_dim > args.head_dim)) {
    return absl::InvalidArgumentError("RopeQuantQ: rope span outside the head");
  }
  const int64_t warps = int64_t{args.num_rows} * args.num_heads;
  const int warps_per_block = kWarpKernelThreads / 32;
  const int64_t grid = (warps + warps_per_block - 1) / warps_per_block;
  RopeQuantQKernel<<<static_cast<unsigned>(grid), kWarpKernelThreads, 0, stream>>>(
      args, weight_scale, rope);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch RopeQuantQKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
