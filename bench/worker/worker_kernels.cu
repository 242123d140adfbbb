#include <cuda_runtime.h>

#include "bench/worker/worker_kernels.h"

namespace decode_indexer::bench_worker {
namespace {

__global__ void ProduceKernel(Shape s, int32_t token, int32_t layer, uint8_t* q, float* weights,
                              uint8_t* keys, float* key_scales) {
  const int64_t nq = int64_t(s.rows) * s.heads * s.dim;
  const int64_t nw = int64_t(s.rows) * s.heads;
  const int64_t nk = int64_t(s.rows) * s.dim;
  const int64_t total = nq + nw + nk + s.rows;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (i < nq) {
      q[i] = Fp8Code(ValueHash(1, token, layer, i));
    } else if (i < nq + nw) {
      const int64_t j = i - nq;
      weights[j] = WeightValue(ValueHash(2, token, layer, j));
    } else if (i < nq + nw + nk) {
      const int64_t j = i - nq - nw;
      keys[j] = Fp8Code(ValueHash(3, token, layer, j));
    } else {
      const int64_t j = i - nq - nw - nk;
      key_scales[j] = KeyScaleValue(ValueHash(4, token, layer, j));
    }
  }
}

__global__ void FillKvKernel(uint32_t* kv, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = ValueHash(5, 0, 0, uint64_t(i) / 2);
    kv[i] = (i & 1) ? uint32_t(h >> 32) : uint32_t(h);
  }
}

// One block a row: each thread takes a strided share of the row's K indices.
__global__ void AttentionKernel(Shape s, const int32_t* answer, const uint4* kv, int64_t kv_len,
                                int64_t length, AttnOut* out) {
  __shared__ uint32_t sum, hash, bad, valid;
  if (threadIdx.x == 0) sum = hash = bad = valid = 0;
  __syncthreads();
  const int32_t r = blockIdx.x;
  uint32_t my_sum = 0, my_hash = 0, my_bad = 0, my_valid = 0;
  for (int32_t j = threadIdx.x; j < s.topk; j += blockDim.x) {
    const int32_t idx = answer[int64_t(r) * s.topk + j];
    if (idx == -1) continue;
    if (idx < 0 || idx >= length || idx >= kv_len) {
      ++my_bad;
      continue;
    }
    const uint4 v = kv[int64_t(r) * kv_len + idx];
    my_sum += v.x + v.y + v.z + v.w;
    my_hash += IndexHash(idx);
    ++my_valid;
  }
  atomicAdd(&sum, my_sum);
  atomicAdd(&hash, my_hash);
  atomicAdd(&bad, my_bad);
  atomicAdd(&valid, my_valid);
  __syncthreads();
  if (threadIdx.x == 0) out[r] = AttnOut{sum, hash, bad, valid};
}

int Blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 2048 ? (b < 1 ? 1 : b) : 2048);
}

}  // namespace

int LaunchProduce(const Shape& s, int32_t token, int32_t layer, uint8_t* q, float* weights,
                  uint8_t* keys, float* key_scales, void* stream) {
  const int64_t total = int64_t(s.rows) * (int64_t(s.heads) * s.dim + s.heads + s.dim + 1);
  ProduceKernel<<<Blocks(total, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      s, token, layer, q, weights, keys, key_scales);
  return static_cast<int>(cudaGetLastError());
}

int LaunchFillKv(uint32_t* kv, int32_t rows, int64_t kv_len, void* stream) {
  const int64_t n = int64_t(rows) * kv_len * 4;
  FillKvKernel<<<Blocks(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(kv, n);
  return static_cast<int>(cudaGetLastError());
}

int LaunchAttention(const Shape& s, const int32_t* answer, const uint32_t* kv, int64_t kv_len,
                    int64_t length, AttnOut* out, void* stream) {
  AttentionKernel<<<s.rows, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      s, answer, reinterpret_cast<const uint4*>(kv), kv_len, length, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace decode_indexer::bench_worker
