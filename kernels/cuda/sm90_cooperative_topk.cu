// Cooperative top-k (the seed's cooperative_topk): for up to kCooperativeTopKMaxRows rows, one
// launch with one thread-block cluster a row (2-8 blocks, every block of the step resident at
// once: rows x cluster <= the SMs of an H100/H200) whose blocks hold the row's keys in shared
// memory; the three radix passes (11 + 11 + 10 key bits) then read only shared memory, the
// blocks' histograms summed through distributed shared memory, and find the exact K-th key T
// and how many keys equal to T to keep (the lowest indices win); an ordered compaction of the
// shared keys writes the ascending answer, each block its segment at the offset the earlier
// segments' counts give. The same threshold search and compaction as the radix top-k
// (sm90_topk_common.cuh), so the answer is LaunchRadixTopK's bit for bit. Deterministic by
// construction: no atomic decides an output position.
//
// Two sources of keys, one kernel:
// - candidate-block selection (spec section 7; the seed's select_candidate_blocks_cooperative):
//   block j's key is the max logit of positions [j * bs, j * bs + bs), the newest block +inf,
//   scored straight from the logits. One launch instead of LaunchCandidateScores (scores to
//   global memory) + LaunchRadixTopK (read back).
// - a plain top-k (TopKArgs::Algo::kCooperative): the keys are the row's values, per-row
//   lengths from a counts array, an optional index map (out = map[i], the dense top-k and the
//   candidate consumer's index-mapped top-k).
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_topk_bucket.cuh"
#include "kernels/cuda/sm90_topk_common.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

// Keys one block holds in shared memory: 208 KB, which with the two 8 KB histograms stays
// under the 227 KB a Hopper block may opt in to.
constexpr int kCoopMaxKeysPerBlock = 52 * 1024;

// Blocks per row: the most (up to the portable 8) with rows x cluster <= 128, so that on a
// 132-SM H100/H200 every block of the step is resident at once, one per SM.
constexpr int CoopClusterSize(int32_t num_rows) {
  return num_rows <= 16 ? 8 : num_rows <= 32 ? 4 : 2;
}

// Keys of one block's segment of a row of `keys` keys (a multiple of 4, so the 16-byte shared
// and global accesses stay aligned).
constexpr int64_t CoopSegment(int64_t keys, int csize) {
  return ((keys + csize - 1) / csize + 3) / 4 * 4;
}

constexpr bool CoopFits(int32_t num_rows, int64_t max_keys, int32_t k, int csize) {
  return num_rows >= 1 && num_rows <= kCooperativeTopKMaxRows && max_keys >= 1 && k >= 1 &&
         CoopSegment(max_keys, csize) <= kCoopMaxKeysPerBlock;
}

// Block scores of blocks [lo, lo + n) of a row of nb blocks of bs logits into skey (the newest
// block +inf, its logits never read).
__device__ __forceinline__ void ScoreBlocks(const float* __restrict__ v, int64_t stride, int bs,
                                            int nb, int lo, int n, uint32_t* skey,
                                            const float* base) {
  const int tid = threadIdx.x;
  const bool vec8 = bs == 8 && stride % 4 == 0 && (reinterpret_cast<uintptr_t>(base) & 15) == 0;
  if (vec8) {
    // Quad q (4 logits) of the segment: thread pairs (even, odd lane) share a block, so each
    // warp load is 512 contiguous bytes; 4 loads in flight per thread.
    constexpr int kQuadLoads = 4;
    const int q_hi = 2 * n;
    for (int b = 0; b < q_hi; b += kQuadLoads * kTopKThreads) {
      float m[kQuadLoads];
#pragma unroll
      for (int u = 0; u < kQuadLoads; ++u) {
        const int q = b + u * kTopKThreads + tid;
        const int j = lo + q / 2;
        m[u] = -INFINITY;
        if (q < q_hi && j != nb - 1) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(v + int64_t{j} * 8) + (q & 1));
          m[u] = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
        }
      }
#pragma unroll
      for (int u = 0; u < kQuadLoads; ++u) {
        const int q = b + u * kTopKThreads + tid;
        const float other = __shfl_xor_sync(kFullMask, m[u], 1);
        if (q < q_hi && (q & 1) == 0) {
          const int j = lo + q / 2;
          skey[q / 2] = TopKOrderedKey(j == nb - 1 ? INFINITY : fmaxf(m[u], other));
        }
      }
    }
  } else {
    for (int i = tid; i < n; i += blockDim.x) {
      const int j = lo + i;
      float s = INFINITY;
      if (j != nb - 1) {
        const float* l = v + int64_t{j} * bs;
        s = __ldg(&l[0]);
        for (int o = 1; o < bs; ++o) s = fmaxf(s, __ldg(&l[o]));
      }
      skey[i] = TopKOrderedKey(s);
    }
  }
}

// Values [lo, lo + n) of a row into skey as order-preserving keys (lo a multiple of 4): 16-byte
// loads where the row is aligned, 4 in flight per thread.
__device__ __forceinline__ void LoadKeys(const float* __restrict__ v, bool vec, int lo, int n,
                                         uint32_t* skey) {
  const int tid = threadIdx.x;
  int done = 0;
  if (vec) {
    constexpr int kLoads = 4;
    const float4* v4 = reinterpret_cast<const float4*>(v + lo);
    const int n4 = n / 4;
    for (int b = 0; b < n4; b += kLoads * kTopKThreads) {
      float4 x[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int q = b + u * kTopKThreads + tid;
        if (q < n4) x[u] = __ldg(v4 + q);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int q = b + u * kTopKThreads + tid;
        if (q < n4) {
          *reinterpret_cast<uint4*>(skey + 4 * q) =
              make_uint4(TopKOrderedKey(x[u].x), TopKOrderedKey(x[u].y), TopKOrderedKey(x[u].z),
                         TopKOrderedKey(x[u].w));
        }
      }
    }
    done = 4 * n4;
  }
  for (int i = done + tid; i < n; i += blockDim.x) skey[i] = TopKOrderedKey(__ldg(&v[lo + i]));
}

template <bool kBlockScores>
__global__ void __launch_bounds__(kTopKThreads)
    CooperativeTopKKernel(const TopKArgs a, int seg_cap) {
  extern __shared__ __align__(16) uint32_t skey[];  // [seg_cap]: this segment's keys
  __shared__ RadixSelectShared sh;

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int row = blockIdx.x / csize;
  const int tid = threadIdx.x;
  const int k = a.k;
  const int32_t length = max(0, a.lengths != nullptr ? a.lengths[row] : a.fixed_length);
  const int32_t div = a.length_divisor;
  const int32_t nb = length / div + (length % div != 0);  // the row's keys (no overflow)
  int32_t* out = a.out + int64_t{row} * k;
  const int32_t* map =
      a.index_map != nullptr ? a.index_map + int64_t{row} * a.index_map_stride : nullptr;
  const int seg = static_cast<int>(CoopSegment(nb, csize));
  // The same branch for every block of the cluster. A row longer than the host's bound would
  // not fit: it answers -1s (a contract violation made visible, not a write past shared
  // memory).
  if (nb <= k || seg > seg_cap) {
    if (rank == 0) {
      for (int i = tid; i < k; i += blockDim.x) {
        out[i] = nb <= k && i < nb ? (map != nullptr ? map[i] : i) : -1;
      }
    }
    return;
  }
  const int lo = min(nb, rank * seg);
  const int n_local = min(nb, lo + seg) - lo;
  const float* __restrict__ v = a.values + int64_t{row} * a.stride;
  if constexpr (kBlockScores) {
    ScoreBlocks(v, a.stride, div, nb, lo, n_local, skey, a.values);
  } else {
    const bool vec = a.stride % 4 == 0 && (reinterpret_cast<uintptr_t>(a.values) & 15) == 0;
    LoadKeys(v, vec, lo, n_local, skey);
  }
  __syncthreads();

  // The radix passes over the shared keys, then the ordered compaction from shared memory.
  const RadixSelection sel =
      RadixSelectThreshold<true>(cluster, static_cast<uint32_t>(k), sh, [&](auto&& f) {
        for (int i = tid; i < n_local; i += blockDim.x) f(skey[i]);
      });
  OrderedCompactSegment(n_local, sel, map, out, sh.scratch,
                        [&](int i0, uint32_t(&key)[4], int(&idx)[4]) {
                          if (i0 + 3 < n_local) {
                            const uint4 k4 = *reinterpret_cast<const uint4*>(skey + i0);
                            key[0] = k4.x;
                            key[1] = k4.y;
                            key[2] = k4.z;
                            key[3] = k4.w;
                          } else {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                              key[e] = i0 + e < n_local ? skey[i0 + e] : 0u;
                            }
                          }
#pragma unroll
                          for (int e = 0; e < 4; ++e) idx[e] = lo + i0 + e;
                        });
}

// One launch of rows x csize blocks in clusters of csize, shared memory sized for max_keys.
template <bool kBlockScores>
absl::Status LaunchCooperative(const TopKArgs& rows, int32_t num_rows, int64_t max_keys, int csize,
                               cudaStream_t stream) {
  const int seg_cap = static_cast<int>(CoopSegment(max_keys, csize));
  static KernelDeviceSetup per_device[kMaxDevices];  // one table per instantiation
  absl::StatusOr<const KernelDeviceSetup*> setup = SetUpOncePerDevice(
      per_device, "cooperative top-k: shared-memory opt-in", [](KernelDeviceSetup&) {
        return cudaFuncSetAttribute(CooperativeTopKKernel<kBlockScores>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kCoopMaxKeysPerBlock * static_cast<int>(sizeof(uint32_t)));
      });
  if (!setup.ok()) return setup.status();
  DI_CUDA_RETURN_IF_ERROR(
      LaunchTopKClusters(CooperativeTopKKernel<kBlockScores>, num_rows, csize,
                         sizeof(uint32_t) * static_cast<size_t>(seg_cap), stream, rows, seg_cap),
      kBlockScores ? "launch CooperativeTopKKernel (candidate blocks)"
                   : "launch CooperativeTopKKernel (top-k)");
  return absl::OkStatus();
}

}  // namespace

bool CooperativeTopKSupported(int32_t num_rows, int32_t max_length, int32_t k) {
  return CoopFits(num_rows, max_length, k, CoopClusterSize(num_rows));
}

bool CooperativeTopKPreferred(int32_t num_rows, int32_t max_length, int32_t k, int num_sms) {
  // Measured on the H200 (13:07 run, docs/results/cuda-bench.md; K 2048 at 1 / 8 / 64 rows x
  // 16K-128K, K 512 index-mapped at 64 x 16K): faster than kAuto's radix choice wherever a
  // block held <= ~21K keys (1.07-1.55x), even (1.01x) at ~42K; slower only where the row
  // needed clusters larger than the SMs hold at once. So: where the gate holds and a block's
  // segment is at most kPreferredKeysPerBlock keys, on a GPU whose SMs hold every block of
  // the step at once (the cluster sizes assume a 132-SM H100/H200), for rows of at least the
  // shortest measured bound (shorter rows: not measured, the radix kernels as before). Row
  // counts between the measured 1, 8 and 64 are judged by the same keys-per-block bound.
  // Not for 9-32 rows: 16 rows (8 requests x next_n 2) in clusters of 8 measured 34-44 us
  // against 20-38 us for the radix kernels at 32K-128K (13:21 run): that many 8-block clusters
  // do not all fit the GPCs at once, so they run in two waves. 1-8 and 33-64 rows measured
  // faster.
  constexpr int64_t kPreferredKeysPerBlock = 24 * 1024;
  constexpr int32_t kShortestMeasured = 16 * 1024;
  return num_sms >= 128 && max_length >= kShortestMeasured && (num_rows <= 8 || num_rows > 32) &&
         CooperativeTopKSupported(num_rows, max_length, k) &&
         CoopSegment(max_length, CoopClusterSize(num_rows)) <= kPreferredKeysPerBlock;
}

bool CooperativeCandidatesSupported(int32_t num_rows, int32_t max_blocks_per_row, int32_t k) {
  return CooperativeTopKSupported(num_rows, max_blocks_per_row, k);
}

absl::Status LaunchCooperativeCandidates(const CooperativeCandidatesArgs& args,
                                         cudaStream_t stream) {
  if (args.num_rows == 0) return absl::OkStatus();
  if (!CooperativeCandidatesSupported(args.num_rows, args.max_blocks_per_row, args.k)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cooperative candidates: ", args.num_rows, " rows of up to ", args.max_blocks_per_row,
        " blocks, k ", args.k, " (takes 1-", kCooperativeCandidatesMaxRows,
        " rows whose blocks fit the cluster's shared memory)"));
  }
  if (args.block_size <= 0 || args.logits == nullptr || args.row_length == nullptr ||
      args.out == nullptr) {
    return absl::InvalidArgumentError("cooperative candidates: block size <= 0 or null buffer");
  }
  TopKArgs rows;  // the keys: block scores of the logits
  rows.num_rows = args.num_rows;
  rows.values = args.logits;
  rows.stride = args.logits_stride;
  rows.lengths = args.row_length;
  rows.length_divisor = args.block_size;
  rows.k = args.k;
  rows.out = args.out;
  return LaunchCooperative<true>(rows, args.num_rows, args.max_blocks_per_row,
                                 CoopClusterSize(args.num_rows), stream);
}

absl::Status LaunchCooperativeTopK(const TopKArgs& args, cudaStream_t stream) {
  if (args.num_rows <= 0) return absl::OkStatus();
  const int32_t div = args.length_divisor;
  if (div <= 0 || args.values == nullptr || args.out == nullptr ||
      (args.lengths == nullptr && args.fixed_length < 0)) {
    return absl::InvalidArgumentError(
        "cooperative top-k: length_divisor <= 0, null buffer or negative fixed length");
  }
  if (args.row_histogram != nullptr) {
    return absl::InvalidArgumentError("cooperative top-k: takes no row histogram");
  }
  // The bound on a row's keys sizes shared memory: max_length (in keys), or the fixed length.
  const int64_t max_keys = args.lengths != nullptr
                               ? args.max_length
                               : std::max<int64_t>(1, (int64_t{args.fixed_length} + div - 1) / div);
  const int csize = args.cluster_size == 0 ? CoopClusterSize(args.num_rows) : args.cluster_size;
  if (csize != 1 && csize != 2 && csize != 4 && csize != 8) {
    return absl::InvalidArgumentError("cooperative top-k: cluster size must be 1, 2, 4 or 8");
  }
  if (!CoopFits(args.num_rows, max_keys, args.k, csize)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cooperative top-k: ", args.num_rows, " rows of up to ", max_keys, " keys, k ", args.k,
        ", cluster ", csize, " (takes 1-", kCooperativeTopKMaxRows,
        " rows with a known bound (max_length) whose keys fit the cluster's shared memory)"));
  }
  return LaunchCooperative<false>(args, args.num_rows, max_keys, csize, stream);
}

}  // namespace decode_indexer::kernels::cuda
