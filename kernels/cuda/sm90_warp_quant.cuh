// One 128-dim vector per warp (lane l holds dims 4l..4l+3): load, Hadamard, FP8 / MXFP4
// quantize. The scalar math is quant.h's, shared with the CPU reference, so codes and scales
// are bit-identical to it; only the reductions are spread over the warp (max is exact, so the
// order does not matter).
#pragma once

#include <cstdint>

#include "decode_indexer/kernels/quant.h"
#include "decode_indexer/kernels/types.h"
#include "kernels/cuda/sm90_device_utils.cuh"

namespace decode_indexer::kernels::cuda {

inline constexpr int kWarpVectorDim = 128;

__device__ __forceinline__ void WarpLoadVector(ElemType type, const void* base, int64_t index,
                                               int lane, float (&x)[4]) {
  if (type == ElemType::kF32) {
    const float4 v =
        *reinterpret_cast<const float4*>(static_cast<const float*>(base) + index * 128 + 4 * lane);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) +
                                                    index * 128 + 4 * lane);
    x[0] = BF16ToFloat(v.x & 0xFFFFu);
    x[1] = BF16ToFloat(v.x >> 16);
    x[2] = BF16ToFloat(v.y & 0xFFFFu);
    x[3] = BF16ToFloat(v.y >> 16);
  }
}

// The Sylvester butterfly (h = 1, 2, 4, ...: a + b, a - b) in float, then one multiply by
// float(1 / sqrt(128)): the same operations on the same operands as the CPU's loop.
__device__ __forceinline__ void WarpHadamard(float (&x)[4], int lane) {
  float y0 = x[0] + x[1], y1 = x[0] - x[1], y2 = x[2] + x[3], y3 = x[2] - x[3];
  x[0] = y0 + y2;
  x[2] = y0 - y2;
  x[1] = y1 + y3;
  x[3] = y1 - y3;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // h = 4 m: the partner element lives in lane ^ m
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float other = __shfl_xor_sync(kFullMask, x[j], m);
      x[j] = (lane & m) ? other - x[j] : x[j] + other;
    }
  }
  const float norm = static_cast<float>(1.0 / sqrt(static_cast<double>(kWarpVectorDim)));
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] *= norm;
}

// FP8: writes this lane's 4 codes to codes[4 lane ..] and returns the scale (every lane).
__device__ __forceinline__ float WarpQuantizeFp8(const float (&x)[4], int lane, uint8_t* codes) {
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, m));
  const float s = Fp8Scale(amax);
  const uint32_t packed = static_cast<uint32_t>(EncodeE4M3(x[0] / s)) |
                          (static_cast<uint32_t>(EncodeE4M3(x[1] / s)) << 8) |
                          (static_cast<uint32_t>(EncodeE4M3(x[2] / s)) << 16) |
                          (static_cast<uint32_t>(EncodeE4M3(x[3] / s)) << 24);
  *reinterpret_cast<uint32_t*>(codes + 4 * lane) = packed;
  return s;
}

// MXFP4: each 32-dim group is 8 lanes. Writes this lane's 2 packed bytes and, from the first
// lane of each group, the group's ue8m0 scale byte.
__device__ __forceinline__ void WarpQuantizeFp4(const float (&x)[4], int lane, uint8_t* packed,
                                                uint8_t* scales) {
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
#pragma unroll
  for (int m = 4; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, m));
  const float s = Fp4Scale(amax);
  const uint16_t two = static_cast<uint16_t>(
      PackFp4(EncodeE2M1(x[0] / s), EncodeE2M1(x[1] / s)) |
      (static_cast<uint16_t>(PackFp4(EncodeE2M1(x[2] / s), EncodeE2M1(x[3] / s))) << 8));
  *reinterpret_cast<uint16_t*>(packed + 2 * lane) = two;
  if ((lane & 7) == 0) scales[lane >> 3] = EncodeUE8M0(s);
}

}  // namespace decode_indexer::kernels::cuda
