// Logits at listed positions (the candidate consumers' sparse path and the masked fallback).
// The same kernel serves the sparse and the masked consumer, so the two answer identically.
//
// Why the grid kernel: the first version (kept as SparseLogitsMath::kWarpPerPosition, and the
// fallback for shapes the grid kernel does not take) ran one block per row, one warp per
// position and one lane per head, each lane decoding its head's q codes from global memory for
// every position: 64 rows gave 64 blocks on a 132-SM device, and each lane did H/32 x 128
// serial decode+FMA steps per position (~75 ms for 64 rows x 16K positions, 32 heads).
// The grid kernel spreads (row, chunk of 256 positions) over blocks, decodes the row's q once
// per block into shared memory, and gives each thread one position: its key bytes are loaded
// once (16-byte loads), widened by the hardware e4m3 -> f16 conversion, and dotted with every
// head's q (broadcast shared reads, 4 FMAs per read). Every logit is computed by one thread in
// a fixed order (d ascending per head, heads ascending), so it does not depend on the batch,
// the chunking or the run.
#include <cuda_fp16.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kDim = 128;
constexpr int kGridThreads = 256;  // positions per block, one per thread
constexpr int kMaxGridHeads = 64;  // q of one row in shared memory: 64 x 128 floats = 32 KB
constexpr int kHeadGroup = 16;     // accumulators live per thread at once

__global__ void __launch_bounds__(kWarpKernelThreads)
    SparseLogitsWarpKernel(const CacheView cache, const RowBatch rows, const QView q,
                           const int32_t* __restrict__ positions,
                           const int32_t* __restrict__ counts, int32_t max_positions,
                           float* __restrict__ logits) {
  __shared__ float key_values[kWarpKernelThreads / 32][kDim];
  __shared__ float key_scales[kWarpKernelThreads / 32][4];
  const int row = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int count = counts[row];
  const int request = rows.row_request[row];
  const int64_t table_row = PageRowBase(rows, request);
  const CacheGeometry& geo = cache.geometry;
  const bool fp8 = geo.format == CacheFormat::kFp8;
  const int heads = q.num_heads;
  float* kv = key_values[warp];
  for (int i = warp; i < count; i += warps) {
    const int pos = positions[int64_t{row} * max_positions + i];
    const int page = rows.page_table[table_row + pos / geo.page_size];
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

// Two e4m3 codes (low byte first) -> two exact floats.
__device__ __forceinline__ float2 E4M3x2ToFloat2(uint32_t two_codes) {
  const uint32_t h2 = E4M3x2ToF16x2(two_codes);
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

// acc[h] += q[h][d..d+3] . k[0..3], d ascending (one FMA chain per head).
__device__ __forceinline__ void DotFour(float (&acc)[kHeadGroup], const float (*q_s)[kDim], int h0,
                                        int d, float2 k01, float2 k23) {
#pragma unroll
  for (int h = 0; h < kHeadGroup; ++h) {
    const float4 qv = *reinterpret_cast<const float4*>(&q_s[h0 + h][d]);
    acc[h] = fmaf(qv.x, k01.x, acc[h]);
    acc[h] = fmaf(qv.y, k01.y, acc[h]);
    acc[h] = fmaf(qv.z, k23.x, acc[h]);
    acc[h] = fmaf(qv.w, k23.y, acc[h]);
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kGridThreads)
    SparseLogitsGridKernel(const CacheView cache, const RowBatch rows, const QView q,
                           const int32_t* __restrict__ positions,
                           const int32_t* __restrict__ counts, int32_t max_positions,
                           float* __restrict__ logits) {
  __shared__ __align__(16) float q_s[kMaxGridHeads][kDim];
  __shared__ float w_s[kMaxGridHeads];
  __shared__ float qscale_s[kMaxGridHeads][4];
  const int row = blockIdx.y;
  const int count = counts[row];
  const int first = blockIdx.x * kGridThreads;
  if (first >= count) return;  // the same for the whole block: no barrier is skipped
  const int heads = q.num_heads;
  const int padded = (heads + kHeadGroup - 1) / kHeadGroup * kHeadGroup;
  // Heads past `heads` (padding to a whole group) get q = 0 and w = 0: they add +0.
  for (int e = threadIdx.x; e < padded * kDim; e += blockDim.x) {
    const int h = e / kDim, d = e % kDim;
    float v = 0.f;
    if (h < heads) {
      const int64_t hv = int64_t{row} * heads + h;
      v = kFp8 ? DecodeE4M3(q.codes[hv * kDim + d])
               : DecodeE2M1(Fp4Nibble(q.codes + hv * (kDim / 2), d));
    }
    q_s[h][d] = v;
  }
  for (int h = threadIdx.x; h < padded; h += blockDim.x) {
    const int64_t hv = int64_t{row} * heads + h;
    w_s[h] = h < heads ? q.weights[hv] : 0.f;
    if (!kFp8) {
      for (int g = 0; g < 4; ++g)
        qscale_s[h][g] = h < heads ? DecodeUE8M0(q.scales[hv * 4 + g]) : 0.f;
    }
  }
  __syncthreads();
  const int i = first + threadIdx.x;
  if (i >= count) return;
  const CacheGeometry& geo = cache.geometry;
  const int request = rows.row_request[row];
  const int64_t table_row = PageRowBase(rows, request);
  const int pos = positions[int64_t{row} * max_positions + i];
  const int page = rows.page_table[table_row + pos / geo.page_size];
  const int o = pos % geo.page_size;
  const uint8_t* base = cache.base + int64_t{page} * geo.page_bytes();
  const uint4* values = reinterpret_cast<const uint4*>(base + int64_t{o} * geo.value_bytes());
  const uint8_t* scale = base + int64_t{geo.page_size} * geo.value_bytes() + o * geo.scale_bytes();
  constexpr int kWords = kFp8 ? 8 : 4;  // 16-byte words of one key's codes
  uint4 raw[kWords];
#pragma unroll
  for (int j = 0; j < kWords; ++j) raw[j] = __ldg(values + j);
  const uint32_t scale_word = __ldg(reinterpret_cast<const uint32_t*>(scale));
  float total = 0.f;
  for (int h0 = 0; h0 < padded; h0 += kHeadGroup) {
    float acc[kHeadGroup];
#pragma unroll
    for (int h = 0; h < kHeadGroup; ++h) acc[h] = 0.f;
    if constexpr (kFp8) {
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        const uint32_t words[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          DotFour(acc, q_s, h0, j * 16 + t * 4, E4M3x2ToFloat2(words[t] & 0xFFFFu),
                  E4M3x2ToFloat2(words[t] >> 16));
        }
      }
    } else {
#pragma unroll
      for (int grp = 0; grp < 4; ++grp) {
        float gd[kHeadGroup];
#pragma unroll
        for (int h = 0; h < kHeadGroup; ++h) gd[h] = 0.f;
        const uint32_t words[4] = {raw[grp].x, raw[grp].y, raw[grp].z, raw[grp].w};
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const uint32_t e4m3x4 = WidenFp4x4((words[t >> 1] >> (16 * (t & 1))) & 0xFFFFu);
          DotFour(gd, q_s, h0, grp * 32 + t * 4, E4M3x2ToFloat2(e4m3x4 & 0xFFFFu),
                  E4M3x2ToFloat2(e4m3x4 >> 16));
        }
        const float ks = DecodeUE8M0(static_cast<uint8_t>(scale_word >> (8 * grp)));
#pragma unroll
        for (int h = 0; h < kHeadGroup; ++h) {
          acc[h] = fmaf(gd[h], qscale_s[h0 + h][grp] * ks, acc[h]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kHeadGroup; ++h) total = fmaf(w_s[h0 + h], fmaxf(acc[h], 0.f), total);
  }
  if constexpr (kFp8) total *= __uint_as_float(scale_word);
  logits[int64_t{row} * max_positions + i] = total;
}

}  // namespace

absl::Status LaunchSparseLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                                const int32_t* positions, const int32_t* counts,
                                int32_t max_positions, float* logits, cudaStream_t stream,
                                SparseLogitsMath math) {
  if (rows.num_rows <= 0 || max_positions <= 0) return absl::OkStatus();
  const CacheGeometry& geo = cache.geometry;
  if (geo.head_dim != kDim) {
    return absl::UnimplementedError(
        absl::StrCat("sparse logits: head dim ", geo.head_dim, " (need 128)"));
  }
  if (math == SparseLogitsMath::kMma || math == SparseLogitsMath::kMmaPairLeanOcc) {
    if (SparseLogitsMmaTakes(cache, q)) {
      return LaunchSparseLogitsMma(cache, rows, q, positions, counts, max_positions, logits, stream,
                                   math);
    }
    math = SparseLogitsMath::kGrid;  // the shapes the tensor-core kernel does not take
  }
  // The grid kernel loads a key's codes as 16-byte words and q of up to 64 heads into shared
  // memory; other shapes take the warp kernel.
  const bool aligned = reinterpret_cast<uintptr_t>(cache.base) % 16 == 0 &&
                       geo.page_bytes() % 16 == 0 && geo.value_bytes() % 16 == 0;
  if (math == SparseLogitsMath::kGrid && aligned && q.num_heads <= kMaxGridHeads &&
      q.num_heads > 0) {
    const dim3 grid((max_positions + kGridThreads - 1) / kGridThreads, rows.num_rows);
    if (geo.format == CacheFormat::kFp8) {
      SparseLogitsGridKernel<true><<<grid, kGridThreads, 0, stream>>>(
          cache, rows, q, positions, counts, max_positions, logits);
    } else {
      SparseLogitsGridKernel<false><<<grid, kGridThreads, 0, stream>>>(
          cache, rows, q, positions, counts, max_positions, logits);
    }
    DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch SparseLogitsGridKernel");
    return absl::OkStatus();
  }
  SparseLogitsWarpKernel<<<rows.num_rows, kWarpKernelThreads, 0, stream>>>(
      cache, rows, q, positions, counts, max_positions, logits);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch SparseLogitsWarpKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
