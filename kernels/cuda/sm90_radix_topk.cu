// Radix-select top-k per row (spec section 6): the K largest values by (value desc, index
// asc), written ascending by index, -1 padded. Deterministic by construction: the selected set
// is defined exactly by the threshold key and the tie count, and the final pass writes it in
// index order with a block scan, so no atomics decide an output position.
//
// One thread-block cluster per row (1 to 8 blocks: few long rows get several SMs each, many
// rows one each): three histogram passes (11 + 11 + 10 bits of an order-preserving key), the
// blocks' histograms summed through distributed shared memory, find the exact K-th key T and
// how many entries equal to T to keep (the lowest indices win); a last ordered compaction pass
// writes the answer, each block its segment at the offset the earlier segments' counts give.
// Logits of a step are still in L2 when this runs, so the passes mostly read L2.
//
// Two algorithms (TopKArgs::Algo): kMultiPass, the first version just described (4 passes
// over the row), and kCompact (below): a bucket histogram of a 1/16 sample (or the one the
// logits epilogue built), then one pass that moves the few candidates into shared memory, so
// the row is read about once and a sixteenth instead of four times. kAuto (the default) takes
// kMultiPass for few rows (clusters of 4-8 blocks a row), kCompact otherwise: measured so on
// the H200 (docs/notes/cuda.md, "Top-k, second session"). kAuto hands rows the cooperative
// top-k measured faster on (CooperativeTopKPreferred) to LaunchCooperativeTopK
// (sm90_cooperative_topk.cu), which shares the passes and the compaction below.
#include <cooperative_groups.h>

#include <algorithm>
#include <mutex>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_topk_bucket.cuh"
#include "kernels/cuda/sm90_topk_common.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

__device__ __forceinline__ uint32_t OrderedKey(float x) { return TopKOrderedKey(x); }

// The row a block works on (both algorithms): its length in entries (candidate blocks: the
// length in blocks), where its answer goes and its index map.
struct TopKRow {
  int row;
  int32_t length;
  int32_t* out;
  const int32_t* map;
};
__device__ __forceinline__ TopKRow LoadTopKRow(const TopKArgs& a, int csize) {
  TopKRow r;
  r.row = blockIdx.x / csize;
  r.length = a.fixed_length;
  if (a.lengths != nullptr) r.length = (a.lengths[r.row] + a.length_divisor - 1) / a.length_divisor;
  r.out = a.out + int64_t{r.row} * a.k;
  r.map = a.index_map ? a.index_map + int64_t{r.row} * a.index_map_stride : nullptr;
  return r;
}
// A row no longer than k answers all of its entries (mapped), -1 padded: rank 0 writes it.
__device__ __forceinline__ void AnswerWholeRow(const TopKRow& r, int k, int tid) {
  for (int i = tid; i < k; i += blockDim.x) {
    r.out[i] = i < r.length ? (r.map ? r.map[i] : i) : -1;
  }
}

// 4 entries from i0 (a multiple of 4): one 16-byte load where the row allows.
__device__ __forceinline__ void LoadQuad(const float* __restrict__ v, bool vec, int i0, int hi,
                                         float (&x)[4]) {
  if (vec && i0 + 3 < hi) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(v + i0));
    x[0] = q.x;
    x[1] = q.y;
    x[2] = q.z;
    x[3] = q.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = i0 + e < hi ? __ldg(&v[i0 + e]) : 0.f;
  }
}

// kCluster: the row is split over a thread-block cluster; otherwise one block per row and
// no cluster barriers (cheaper when there are enough rows to fill the GPU).
template <bool kCluster>
__global__ void __launch_bounds__(kTopKThreads) RadixTopKMultiPassKernel(const TopKArgs a) {
  __shared__ RadixSelectShared sh;

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;
  const int rank = kCluster ? static_cast<int>(cluster.block_rank()) : 0;
  const TopKRow r = LoadTopKRow(a, csize);
  const int tid = threadIdx.x;
  const int k = a.k;
  const int32_t length = r.length;
  if (length <= k) {  // the same branch for every block of the cluster
    if (rank == 0) {
      AnswerWholeRow(r, k, tid);
    }
    return;
  }
  const float* __restrict__ v = a.values + int64_t{r.row} * a.stride;
  const bool vec = (a.stride % 4 == 0) && ((reinterpret_cast<uintptr_t>(a.values) & 15) == 0);
  // This block's segment of the row (multiples of 4 so that float4 loads stay aligned).
  const int seg = ((length + csize - 1) / csize + 3) & ~3;
  const int lo = min(length, rank * seg);
  const int hi = min(length, lo + seg);
  const int n4 = vec ? (hi - lo) / 4 : 0;

  // Each of the three passes reads the segment from the row (mostly L2).
  const RadixSelection sel =
      RadixSelectThreshold<kCluster>(cluster, static_cast<uint32_t>(k), sh, [&](auto&& f) {
        for (int i = tid; i < n4; i += blockDim.x) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(v + lo) + i);
          f(OrderedKey(x.x));
          f(OrderedKey(x.y));
          f(OrderedKey(x.z));
          f(OrderedKey(x.w));
        }
        for (int i = lo + 4 * n4 + tid; i < hi; i += blockDim.x) f(OrderedKey(__ldg(&v[i])));
      });

  // Ordered compaction of the segment, read from the row once more.
  OrderedCompactSegment(hi - lo, sel, r.map, r.out, sh.scratch,
                        [&](int i0, uint32_t(&key)[4], int(&idx)[4]) {
                          float x[4];
                          LoadQuad(v, vec, lo + i0, hi, x);
#pragma unroll
                          for (int e = 0; e < 4; ++e) {
                            key[e] = OrderedKey(x[e]);
                            idx[e] = lo + i0 + e;
                          }
                        });
}

// ---- kCompact: the row read about once ----------------------------------------------------
//
// 1. A histogram of TopKBucket over a sample of the row (the entries at multiples of
//    kSampleStride; or the same histogram the logits epilogue built) bounds the threshold
//    bucket from below: the bucket where the sample's 1.5 x K / 16 + 16-th largest falls.
//    Rows of at most kCandCap entries skip it (every entry is a candidate).
// 2. One pass over the row copies the candidates (bucket >= that bound), in index order, into
//    shared memory (an ordered compaction: one block scan per 16K entries).
// 3. The candidates' exact bucket histogram gives the bucket B0 of the K-th largest (exact for
//    every bucket >= the bound, which holds it when there are >= K candidates). Radix passes
//    over the rest of the key bits, on B0's candidates only (2 x 9 bits when B0 is an interior
//    bucket, whose keys share their top 14 bits; else 11 + 11 + 10), find the exact threshold
//    key T and how many entries equal to T to keep. 4. An ordered compaction of the buffer
//    writes the answer.
// Shared-memory atomics run at about one lane per clock per SM, so a histogram of the whole
// row would cost more than everything else (the first version did that: docs/notes/cuda.md).
// If the sample misleads (fewer than K candidates) or the candidates overflow a block's
// buffer: the row's full histogram, then 2-4 on B0's candidates if they fit, else on the row
// itself; the same answer, more passes. Nothing depends on timing or on the cluster size: the
// selected set is defined by T and the tie count, and every write position by scans.

constexpr int kCandCap = 16384;                    // candidates per block, in shared memory
constexpr int kCompactSmem = kCandCap * 8;         // keys, then row indices
constexpr int kLoads = 4;                          // float4 loads in flight per thread
constexpr int kChunk = kLoads * 4 * kTopKThreads;  // entries per block per step: 16K
constexpr int kSampleStride = kTopKSampleStride;

// Entry (j, thread t, e) of a chunk: base + 4 * (t + kTopKThreads * j) + e, so each of the
// kLoads loads is coalesced across the warp; all loads are issued before any use.
__device__ __forceinline__ int ChunkIndex(int base, int j, int e) {
  return base + 4 * (static_cast<int>(threadIdx.x) + kTopKThreads * j) + e;
}

template <typename F>
__device__ __forceinline__ void StreamSegment(const float* __restrict__ v, bool vec, int lo, int hi,
                                              F&& f) {
  for (int base = lo; base < hi; base += kChunk) {
    float x[kLoads][4];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) LoadQuad(v, vec, ChunkIndex(base, j, 0), hi, x[j]);
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int idx = ChunkIndex(base, j, e);
        if (idx < hi) f(TopKOrderedKey(x[j][e]), idx);
      }
    }
  }
}

template <bool kCluster>
__global__ void __launch_bounds__(kTopKThreads) RadixTopKCompactKernel(const TopKArgs a) {
  extern __shared__ __align__(16) uint32_t cand_smem[];
  uint32_t* cand_key = cand_smem;                                        // [kCandCap]
  int32_t* cand_idx = reinterpret_cast<int32_t*>(cand_smem + kCandCap);  // [kCandCap]
  __shared__ uint32_t hist[kTopKBins];   // this block's counts (read by the whole cluster)
  __shared__ uint32_t total[kTopKBins];  // the row's counts
  __shared__ uint32_t scratch[32];
  __shared__ uint64_t scratch64[32];
  __shared__ uint32_t found_bin, found_above, local_above;
  __shared__ uint32_t seg_counts[2];  // this block's keys > T and == T (read by the cluster)

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;
  const int rank = kCluster ? static_cast<int>(cluster.block_rank()) : 0;
  auto cluster_sync = [&]() { ClusterSync<kCluster>(cluster); };
  const TopKRow r = LoadTopKRow(a, csize);
  const int row = r.row;
  const int tid = threadIdx.x;
  const int k = a.k;
  const int32_t length = r.length;
  int32_t* out = r.out;
  const int32_t* map = r.map;
  uint32_t* row_hist = a.row_histogram ? a.row_histogram + int64_t{row} * kTopKBins : nullptr;
  if (length <= k) {  // the same branch for every block of the cluster
    if (rank == 0) {
      AnswerWholeRow(r, k, tid);
      if (row_hist != nullptr) {
        for (int i = tid; i < kTopKBins; i += blockDim.x) row_hist[i] = 0u;
      }
    }
    return;
  }
  const float* __restrict__ v = a.values + int64_t{row} * a.stride;
  const bool vec = (a.stride % 4 == 0) && ((reinterpret_cast<uintptr_t>(a.values) & 15) == 0);
  const int seg = ((length + csize - 1) / csize + 3) & ~3;
  const int lo = min(length, rank * seg);
  const int hi = min(length, lo + seg);

  // Ordered compaction of the segment's entries with bucket >= `from` into the buffer; returns
  // their count (which may exceed kCandCap: then the buffer holds only the first kCandCap).
  auto compact = [&](uint32_t from) {
    int n = 0;
    for (int base = lo; base < hi; base += kChunk) {
      float x[kLoads][4];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) LoadQuad(v, vec, ChunkIndex(base, j, 0), hi, x[j]);
      uint32_t keys[kLoads][4];
      uint32_t flags = 0;
      uint64_t packed = 0;
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        uint32_t cnt = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          keys[j][e] = TopKOrderedKey(x[j][e]);
          const bool in = ChunkIndex(base, j, e) < hi && TopKBucket(keys[j][e]) >= from;
          flags |= static_cast<uint32_t>(in) << (4 * j + e);
          cnt += in;
        }
        packed |= static_cast<uint64_t>(cnt) << (16 * j);
      }
      uint64_t chunk_total;
      const uint64_t excl = BlockExclusiveScan(packed, scratch64, &chunk_total);
      int before = n;  // candidates of loads j' < j of the whole block
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        int pos = before + static_cast<int>((excl >> (16 * j)) & 0xFFFFu);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if ((flags >> (4 * j + e)) & 1u) {
            if (pos < kCandCap) {
              cand_key[pos] = keys[j][e];
              cand_idx[pos] = ChunkIndex(base, j, e);
            }
            ++pos;
          }
        }
        before += static_cast<int>((chunk_total >> (16 * j)) & 0xFFFFu);
      }
      n = before;
    }
    __syncthreads();  // the buffer is complete
    return n;
  };
  // The cluster's sum of this block's hist[] into total[] (the caller has synced the cluster).
  auto sum_cluster = [&]() {
    if constexpr (kCluster) {
      for (int i = tid; i < kTopKBins; i += blockDim.x) {
        uint32_t sum = 0;
        for (int r = 0; r < csize; ++r) sum += cluster.map_shared_rank(hist, r)[i];
        total[i] = sum;
      }
    }
    __syncthreads();
  };
  const uint32_t* tot = kCluster ? total : hist;
  if (tid == 0) {  // stays in range even if a fused histogram did not match the row
    found_bin = 0u;
    found_above = 0u;
  }

  // ---- 1. A lower bound on the threshold bucket from a sample (every kSampleStride-th entry,
  // the same sample the logits epilogue counts), and the candidates above it. Rows that fit
  // in shared memory whole skip the sample. Shared atomics run about one lane per clock, so a
  // full histogram of the row costs more than everything else here; the sample's costs 1/16.
  uint32_t b0 = 0, above0 = 0;
  bool buffered = false;  // the buffer holds every entry with bucket >= b0 (of this segment)
  int n_local = 0;
  {
    uint32_t from = 0;
    if (length > kCandCap) {
      const uint32_t samples = static_cast<uint32_t>((length + kSampleStride - 1) / kSampleStride);
      const uint32_t want = min(
          samples, 3u * ((static_cast<uint32_t>(k) + kSampleStride - 1) / kSampleStride) / 2 + 16u);
      if (row_hist != nullptr) {
        for (int i = tid; i < kTopKBins; i += blockDim.x) total[i] = __ldcg(&row_hist[i]);
        __syncthreads();
        FindBin(total, want, scratch, &found_bin, &found_above);
      } else {
        for (int i = tid; i < kTopKBins; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        for (int i = ((lo + kSampleStride - 1) & ~(kSampleStride - 1)) + tid * kSampleStride;
             i < hi; i += kTopKThreads * kSampleStride) {
          atomicAdd(&hist[TopKBucket(TopKOrderedKey(__ldg(&v[i])))], 1u);
        }
        cluster_sync();  // every block's histogram is complete
        sum_cluster();
        FindBin(tot, want, scratch, &found_bin, &found_above);
      }
      from = found_bin;
      cluster_sync();  // the cluster is done with the sample histograms
    }
    if (row_hist != nullptr && rank == 0) {  // zero for the next step
      for (int i = tid; i < kTopKBins; i += blockDim.x) row_hist[i] = 0u;
    }
    n_local = compact(from);
    if (tid == 0) seg_counts[0] = static_cast<uint32_t>(n_local);
    cluster_sync();
    uint32_t cand = 0;
    bool overflow = false;
    for (int r = 0; r < csize; ++r) {
      const uint32_t n = kCluster ? cluster.map_shared_rank(seg_counts, r)[0] : seg_counts[0];
      cand += n;
      overflow |= n > static_cast<uint32_t>(kCandCap);
    }
    // The exact bucket histogram of the candidates: exact for every bucket >= from, which
    // holds the K-th largest when there are at least K candidates.
    if (!overflow && cand >= static_cast<uint32_t>(k)) {
      for (int i = tid; i < kTopKBins; i += blockDim.x) hist[i] = 0u;
      __syncthreads();
      for (int i = tid; i < n_local; i += blockDim.x) atomicAdd(&hist[TopKBucket(cand_key[i])], 1u);
      cluster_sync();
      sum_cluster();
      FindBin(tot, static_cast<uint32_t>(k), scratch, &found_bin, &found_above);
      b0 = found_bin;
      above0 = found_above;
      buffered = true;
    }
    cluster_sync();  // seg_counts and the histograms are free again
  }

  // ---- 2. Otherwise (the sample misled, or too many candidates): the row's exact histogram,
  // then the candidates at or above its threshold bucket if they fit.
  if (!buffered) {
    for (int i = tid; i < kTopKBins; i += blockDim.x) hist[i] = 0u;
    __syncthreads();
    StreamSegment(v, vec, lo, hi,
                  [&](uint32_t key, int) { atomicAdd(&hist[TopKBucket(key)], 1u); });
    cluster_sync();  // every block's histogram is complete
    sum_cluster();
    FindBin(tot, static_cast<uint32_t>(k), scratch, &found_bin, &found_above);
    b0 = found_bin;
    above0 = found_above;
    const bool fits = above0 + tot[b0] <= static_cast<uint32_t>(kCandCap);
    cluster_sync();  // the cluster is done reading the histograms
    if (fits) {
      n_local = min(compact(b0), kCandCap);
      buffered = true;
    }
  }
  const bool fast = buffered;

  // ---- 3. Radix passes over B0's entries: the exact threshold key and the ties to keep.
  const bool interior = TopKBucketIsInterior(b0);
  uint32_t prefix = interior ? TopKInteriorBucketPrefix(b0) : 0u;  // the key bits fixed so far
  int shift = interior ? 18 : 32;
  uint32_t remaining = static_cast<uint32_t>(k) - above0;
  uint32_t my_above = 0;  // this segment's keys known to be > the threshold
  bool first = true;
  while (shift > 0) {
    const int bits = interior ? 9 : (shift == 10 ? 10 : 11);
    shift -= bits;
    const int hi_shift = shift + bits;  // the key bits above this digit must match `prefix`
    const uint32_t mask = (1u << bits) - 1u;
    for (int i = tid; i < kTopKBins; i += blockDim.x) hist[i] = 0u;
    if (tid == 0) local_above = 0u;
    __syncthreads();
    uint32_t above_b0 = 0;  // first pass: this thread's entries in buckets above B0
    auto count = [&](uint32_t key, int) {
      const uint32_t b = TopKBucket(key);
      if (b == b0) {
        if (hi_shift >= 32 || (key >> hi_shift) == prefix) {
          atomicAdd(&hist[(key >> shift) & mask], 1u);
        }
      } else if (b > b0) {
        ++above_b0;
      }
    };
    if (fast) {
      for (int i = tid; i < n_local; i += blockDim.x) count(cand_key[i], i);
    } else {
      StreamSegment(v, vec, lo, hi, count);
    }
    if (first) {
      above_b0 = __reduce_add_sync(kFullMask, above_b0);
      if ((tid & 31) == 0 && above_b0 != 0u) atomicAdd(&local_above, above_b0);
    }
    cluster_sync();  // every block's histogram is complete
    if constexpr (kCluster) {
      for (int i = tid; i < kTopKBins; i += blockDim.x) {
        uint32_t sum = 0;
        for (int r = 0; r < csize; ++r) sum += cluster.map_shared_rank(hist, r)[i];
        total[i] = sum;
      }
      __syncthreads();
    }
    FindBin(kCluster ? total : hist, remaining, scratch, &found_bin, &found_above);
    // This segment's keys in bins above the found one are above the threshold.
    uint32_t mine = 0;
    for (int i = tid; i < kTopKBins; i += blockDim.x) {
      if (static_cast<uint32_t>(i) > found_bin) mine += hist[i];
    }
    mine = __reduce_add_sync(kFullMask, mine);
    if ((tid & 31) == 0 && mine != 0u) atomicAdd(&local_above, mine);
    __syncthreads();
    my_above += local_above;
    prefix = (prefix << bits) | found_bin;
    remaining -= found_above;
    if (shift == 0 && tid == 0) {
      seg_counts[0] = my_above;
      seg_counts[1] = hist[found_bin];
    }
    first = false;
    cluster_sync();  // the cluster is done reading this pass's histograms (and seg_counts set)
  }
  // prefix is now the threshold key T, remaining the entries equal to T to keep (lowest first).

  // ---- 4. Where this segment's answers start, then its ordered compaction: 4 consecutive
  // entries a thread a step, from the buffer or from the row.
  const RadixSelection sel = SegmentSelection<kCluster>(cluster, prefix, remaining, seg_counts);
  const int n_src = fast ? n_local : hi - lo;
  OrderedCompactSegment(
      n_src, sel, map, out, scratch, [&](int i0, uint32_t(&key)[4], int(&idx)[4]) {
        if (fast && i0 + 3 < n_src) {  // 16-byte aligned: kCandCap and i0 are multiples of 4
          const uint4 k4 = *reinterpret_cast<const uint4*>(cand_key + i0);
          const int4 i4 = *reinterpret_cast<const int4*>(cand_idx + i0);
          key[0] = k4.x;
          key[1] = k4.y;
          key[2] = k4.z;
          key[3] = k4.w;
          idx[0] = i4.x;
          idx[1] = i4.y;
          idx[2] = i4.z;
          idx[3] = i4.w;
        } else if (fast) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            key[e] = i0 + e < n_src ? cand_key[i0 + e] : 0u;
            idx[e] = i0 + e < n_src ? cand_idx[i0 + e] : 0;
          }
        } else {
          float x[4];
          LoadQuad(v, vec, lo + i0, hi, x);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            key[e] = TopKOrderedKey(x[e]);
            idx[e] = lo + i0 + e;
          }
        }
      });
}

// Blocks per row for kCompact. Measured (H200, 10:18, top-k alone): 64 rows of 32K 25.7 us in
// one block a row vs 26.5 in two; of 64K 40.9 vs 32.4; of 128K 63.8 vs 46.4; 128 rows of 128K
// 81.3 vs 97.5 (2 blocks a row no longer fit the SMs at once); clusters of 4-8 lose for 64+
// rows. Few rows: the multi-pass sizes (1 x 128K: 27.7 us in 4 or 8).
int CompactClusterSize(int32_t num_rows, int32_t max_length, int num_sms) {
  const int c = TopKClusterSize(num_rows, max_length, num_sms);
  if (c > 1) return c;
  return 2 * num_rows <= num_sms && max_length / 2 >= 32768 ? 2 : 1;
}

// Dynamic shared memory above 48 KB is opt-in, per device and kernel.
absl::Status PrepareCompact(int device) {
  struct PerDevice {
    std::once_flag once;
    cudaError_t err = cudaSuccess;
  };
  static PerDevice per_device[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return absl::UnimplementedError("more than 16 GPUs");
  PerDevice& pd = per_device[device];
  std::call_once(pd.once, [&] {
    pd.err = cudaFuncSetAttribute(RadixTopKCompactKernel<false>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, kCompactSmem);
    if (pd.err == cudaSuccess) {
      pd.err = cudaFuncSetAttribute(RadixTopKCompactKernel<true>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, kCompactSmem);
    }
  });
  DI_CUDA_RETURN_IF_ERROR(pd.err, "radix top-k (compact): shared-memory opt-in");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchRadixTopK(const TopKArgs& args, int num_sms, cudaStream_t stream) {
  if (args.num_rows <= 0) return absl::OkStatus();
  if (args.k <= 0) return absl::InvalidArgumentError("radix top-k: k must be positive");
  using Algo = TopKArgs::Algo;
  Algo algo = args.algo;
  if (algo == Algo::kAuto && args.row_histogram == nullptr &&
      CooperativeTopKPreferred(args.num_rows, args.max_length, args.k, num_sms)) {
    algo = Algo::kCooperative;
  }
  if (algo == Algo::kCooperative) return LaunchCooperativeTopK(args, stream);
  // Measured on the H200 (10:18 run): few rows (clusters of 4-8 a row) run the multi-pass
  // kernel faster; many rows the compact one; short plain rows the multi-pass kernel at any
  // row count (MultiPassTopKPreferred, sm90_heuristics.h).
  const int multi_csize = TopKClusterSize(args.num_rows, args.max_length, num_sms);
  if (algo == Algo::kAuto || algo == Algo::kGeneral) {
    const int32_t bound = args.lengths != nullptr ? args.max_length : args.fixed_length;
    const bool short_plain =
        args.index_map == nullptr && args.length_divisor == 1 && MultiPassTopKPreferred(bound);
    algo = args.row_histogram == nullptr && (multi_csize >= 4 || short_plain) ? Algo::kMultiPass
                                                                              : Algo::kCompact;
  }
  const bool compact = algo == Algo::kCompact;
  if (args.row_histogram != nullptr && (!compact || args.length_divisor != 1)) {
    return absl::InvalidArgumentError(
        "radix top-k: a row histogram needs the compact algorithm and length_divisor 1");
  }
  int csize = args.cluster_size;
  if (csize == 0)
    csize = compact ? CompactClusterSize(args.num_rows, args.max_length, num_sms) : multi_csize;
  if (csize != 1 && csize != 2 && csize != 4 && csize != 8) {
    return absl::InvalidArgumentError("radix top-k: cluster size must be 1, 2, 4 or 8");
  }
  const int smem = compact ? kCompactSmem : 0;
  if (compact) {
    int device = 0;
    DI_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
    if (absl::Status s = PrepareCompact(device); !s.ok()) return s;
  }
  if (csize == 1) {
    if (compact) {
      RadixTopKCompactKernel<false><<<args.num_rows, kTopKThreads, smem, stream>>>(args);
    } else {
      RadixTopKMultiPassKernel<false><<<args.num_rows, kTopKThreads, 0, stream>>>(args);
    }
    DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch RadixTopK kernel");
    return absl::OkStatus();
  }
  if (compact) {
    DI_CUDA_RETURN_IF_ERROR(LaunchTopKClusters(RadixTopKCompactKernel<true>, args.num_rows, csize,
                                               static_cast<size_t>(smem), stream, args),
                            "launch RadixTopKCompactKernel (cluster)");
  } else {
    DI_CUDA_RETURN_IF_ERROR(
        LaunchTopKClusters(RadixTopKMultiPassKernel<true>, args.num_rows, csize, 0, stream, args),
        "launch RadixTopKMultiPassKernel (cluster)");
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
