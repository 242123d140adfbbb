// Logits at listed positions (the candidate consumers' sparse path and the masked fallback).
// A simple, correct version for now (the candidate pipeline is issue 4): one warp per
// position, one lane per head, scalar dequantized dots in float. The same kernel serves the
// sparse and the masked consumer, so the two answer identically.
#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kDim = 128;

__global__ void __launch_bounds__(kWarpKernelThreads)
    SparseLogitsKernel(const CacheView cache, const RowBatch rows, const QView q,
                       const int32_t* __restrict__ positions, const int32_t* __restrict__ counts,
                       int32_t max_positions, float* __restrict__ logits) {
  __shared__ float key_values[kWarpKernelThreads / 32][kDim];
  __shared__ float key_scales[kWarpKernelThreads / 32][4];
  const int row = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int count = counts[row];
  const int request = rows.row_request[row];
  const CacheGeometry& geo = cache.geometry;
  const bool fp8 = geo.format == CacheFormat::kFp8;
  const int heads = q.num_heads;
  float* kv = key_values[warp];
  for (int i = warp; i < count; i += warps) {
    const int pos = positions[int64_t{row} * max_positions + i];
    const int page =
        rows.page_table[int64_t{request} * rows.page_table_stride + pos / geo.page_size];
    const int o = pos % geo.page_size;
    const uint8_t* base = cache.base + int64_t{page} * geo.page_bytes();
    const uint8_t* values = base + int64_t{o} * geo.value_bytes();
    const uint8_t* scale =
        base + int64_t{geo.page_size} * geo.value_bytes() + o * geo.scale_bytes();
    if (fp8) {
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[4 * lane + j] = DecodeE4M3(values[4 * lane + j]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[4 * lane + j] = DecodeE2M1(Fp4Nibble(values, 4 * lane + j));
      if (lane < 4) key_scales[warp][lane] = DecodeUE8M0(scale[lane]);
    }
    __syncwarp();
    float total = 0.f;
    for (int h = lane; h < heads; h += 32) {
      const int64_t v = int64_t{row} * heads + h;
      float dot = 0.f;
      if (fp8) {
        const uint8_t* qc = q.codes + v * kDim;
        for (int d = 0; d < kDim; ++d) dot += DecodeE4M3(qc[d]) * kv[d];
      } else {
        const uint8_t* qc = q.codes + v * (kDim / 2);
        for (int grp = 0; grp < 4; ++grp) {
          float gd = 0.f;
          for (int d = grp * 32; d < grp * 32 + 32; ++d) gd += DecodeE2M1(Fp4Nibble(qc, d)) * kv[d];
          dot += gd * (DecodeUE8M0(q.scales[v * 4 + grp]) * key_scales[warp][grp]);
        }
      }
      total += q.weights[v] * fmaxf(dot, 0.f);
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) total += __shfl_xor_sync(kFullMask, total, m);
    if (fp8) total *= *reinterpret_cast<const float*>(scale);
    if (lane == 0) logits[int64_t{row} * max_positions + i] = total;
    __syncwarp();
  }
}

}  // namespace

absl::Status LaunchSparseLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                                const int32_t* positions, const int32_t* counts,
                                int32_t max_positions, float* logits, cudaStream_t stream) {
  if (rows.num_rows <= 0) return absl::OkStatus();
  if (cache.geometry.head_dim != kDim) {
    return absl::UnimplementedError(
        absl::StrCat("sparse logits: head dim ", cache.geometry.head_dim, " (need 128)"));
  }
  SparseLogitsKernel<<<rows.num_rows, kWarpKernelThreads, 0, stream>>>(
      cache, rows, q, positions, counts, max_positions, logits);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch SparseLogitsKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
