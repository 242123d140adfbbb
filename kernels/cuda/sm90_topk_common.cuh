// Device helpers shared by the radix top-k kernels (sm90_radix_topk.cu) and the cooperative
// top-k / candidate-block selection (sm90_cooperative_topk.cu): the cluster barrier, the search
// of a summed histogram for the bin that holds the K-th largest entry, the three radix passes
// that find the exact K-th key over a row split across a cluster, and the ordered compaction
// that writes the answer. The kernels differ only in where a block's keys come from (the row
// in global memory, or keys already in shared memory); keeping one copy of the rest keeps
// their answers identical bit for bit.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {

// A cluster barrier when the row is split over a cluster, else a block barrier.
template <bool kCluster>
__device__ __forceinline__ void ClusterSync(cooperative_groups::cluster_group& cluster) {
  if constexpr (kCluster) {
    cluster.sync();
  } else {
    __syncthreads();
  }
}

// The bin, counted from the top of tot[kTopKBins], that holds the remaining-th largest entry,
// and the count in the bins above it (into shared *bin / *above). Every thread of a
// kTopKThreads block calls it.
__device__ __forceinline__ void FindBin(const uint32_t* tot, uint32_t remaining, uint32_t* scratch,
                                        uint32_t* bin, uint32_t* above_out) {
  constexpr int kPer = kTopKBins / kTopKThreads;
  const int top = kTopKBins - static_cast<int>(threadIdx.x) * kPer;  // exclusive upper bin
  uint32_t local = 0;
#pragma unroll
  for (int j = 1; j <= kPer; ++j) local += tot[top - j];
  uint32_t sum_all;
  uint32_t above = BlockExclusiveScan(local, scratch, &sum_all);
#pragma unroll
  for (int j = 1; j <= kPer; ++j) {
    const uint32_t cnt = tot[top - j];
    if (above < remaining && above + cnt >= remaining) {
      *bin = static_cast<uint32_t>(top - j);
      *above_out = above;
    }
    above += cnt;
  }
  __syncthreads();
}

// One step of the ordered compaction that writes a top-k answer: each thread holds 4
// consecutive entries (keys, their indices, the first `valid` of them real); those with a key
// above the threshold T, and the first `need` (over the whole row) equal to T, go to `out` in
// index order (mapped through `map` when given). run_gt / run_eq count the entries > T and
// == T before this step (the earlier steps and, in a cluster, the earlier segments); every
// thread gets them advanced past the step. Positions come from a block scan, never from an
// atomic, so the answer does not depend on timing. Every thread of the block calls it.
__device__ __forceinline__ void OrderedCompactStep(const uint32_t (&key)[4], const int (&idx)[4],
                                                   int valid, uint32_t threshold, uint32_t need,
                                                   const int32_t* map, int32_t* out,
                                                   uint32_t* scratch, uint32_t& run_gt,
                                                   uint32_t& run_eq) {
  uint32_t gt_flags = 0, eq_flags = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (e < valid) {
      gt_flags |= static_cast<uint32_t>(key[e] > threshold) << e;
      eq_flags |= static_cast<uint32_t>(key[e] == threshold) << e;
    }
  }
  const uint32_t packed = (static_cast<uint32_t>(__popc(gt_flags)) << 16) | __popc(eq_flags);
  uint32_t chunk_total;
  const uint32_t excl = BlockExclusiveScan(packed, scratch, &chunk_total);
  uint32_t gt_before = run_gt + (excl >> 16);
  uint32_t eq_before = run_eq + (excl & 0xFFFFu);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if ((gt_flags >> e) & 1u) {
      out[gt_before + min(eq_before, need)] = map ? map[idx[e]] : idx[e];
      ++gt_before;
    } else if ((eq_flags >> e) & 1u) {
      if (eq_before < need) out[gt_before + eq_before] = map ? map[idx[e]] : idx[e];
      ++eq_before;
    }
  }
  run_gt += chunk_total >> 16;
  run_eq += chunk_total & 0xFFFFu;
}

// Shared memory of RadixSelectThreshold (one per block; hist and seg_counts are read by the
// other blocks of the cluster).
struct RadixSelectShared {
  uint32_t hist[kTopKBins];   // this block's counts
  uint32_t total[kTopKBins];  // the row's counts, summed over the cluster
  uint32_t scratch[32];
  uint32_t found_bin, found_above, local_above;
  uint32_t seg_counts[2];  // this block's keys > T and == T
};

// What RadixSelectThreshold finds: the K-th largest key T of the row, how many keys equal to T
// to keep (the lowest indices win), and where this block's segment's answers start and end
// (keys > T and == T in the cluster's earlier segments, and through this one).
struct RadixSelection {
  uint32_t threshold;
  uint32_t need;
  uint32_t run_gt, run_eq;
  uint32_t end_gt, end_eq;
};

// The selection once the threshold T and the ties to keep are known: where this block's
// answers start (the counts seg_counts[0] of keys > T and seg_counts[1] of keys == T of the
// cluster's earlier blocks) and end. seg_counts must be complete in every block of the
// cluster (a cluster barrier since they were written); ends with a cluster barrier so that no
// block leaves while another still reads its shared memory.
template <bool kCluster>
__device__ __forceinline__ RadixSelection
SegmentSelection(cooperative_groups::cluster_group& cluster, uint32_t threshold, uint32_t need,
                 uint32_t* seg_counts) {
  RadixSelection sel{threshold, need, 0u, 0u, 0u, 0u};
  if constexpr (kCluster) {
    const int rank = static_cast<int>(cluster.block_rank());
    for (int r = 0; r < rank; ++r) {
      const uint32_t* sc = cluster.map_shared_rank(seg_counts, r);
      sel.run_gt += sc[0];
      sel.run_eq += sc[1];
    }
  }
  sel.end_gt = sel.run_gt + seg_counts[0];
  sel.end_eq = sel.run_eq + seg_counts[1];
  if constexpr (kCluster) cluster.sync();
  return sel;
}

// Three radix passes (11 + 11 + 10 bits of the order-preserving key) over the keys of a row
// longer than k, split in segments over the cluster (kCluster) or in one block; the blocks'
// histograms are summed through distributed shared memory. for_each_key(f) calls f(key) on
// every key of this block's segment (any order, any thread). Every thread of every block of
// the cluster calls it; it ends with SegmentSelection's cluster barrier.
template <bool kCluster, typename ForEachKey>
__device__ __forceinline__ RadixSelection
RadixSelectThreshold(cooperative_groups::cluster_group& cluster, uint32_t k, RadixSelectShared& s,
                     ForEachKey&& for_each_key) {
  const int csize = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t prefix = 0;  // the key bits fixed so far
  uint32_t remaining = k;
  uint32_t my_above = 0;  // keys of this segment known to be > the threshold
  constexpr int kShift[3] = {21, 10, 0};
  constexpr int kBits[3] = {11, 11, 10};
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = kShift[pass];
    const uint32_t mask = (1u << kBits[pass]) - 1u;
    const int hi_shift = shift + kBits[pass];  // bits above this digit must match `prefix`
    for (int i = tid; i < kTopKBins; i += blockDim.x) s.hist[i] = 0u;
    if (tid == 0) s.local_above = 0u;
    __syncthreads();
    for_each_key([&](uint32_t key) {
      if (pass == 0 || (key >> hi_shift) == prefix) atomicAdd(&s.hist[(key >> shift) & mask], 1u);
    });
    ClusterSync<kCluster>(cluster);  // every block's histogram is complete
    if constexpr (kCluster) {
      for (int i = tid; i < kTopKBins; i += blockDim.x) {
        uint32_t sum = 0;
        for (int r = 0; r < csize; ++r) sum += cluster.map_shared_rank(s.hist, r)[i];
        s.total[i] = sum;
      }
      __syncthreads();
    }
    FindBin(kCluster ? s.total : s.hist, remaining, s.scratch, &s.found_bin, &s.found_above);
    // This segment's keys in bins above the found one are above the threshold.
    uint32_t mine = 0;
    for (int i = tid; i < kTopKBins; i += blockDim.x) {
      if (static_cast<uint32_t>(i) > s.found_bin) mine += s.hist[i];
    }
    mine = __reduce_add_sync(kFullMask, mine);
    if ((tid & 31) == 0 && mine != 0u) atomicAdd(&s.local_above, mine);
    __syncthreads();
    my_above += s.local_above;
    prefix = (prefix << kBits[pass]) | s.found_bin;
    remaining -= s.found_above;
    if (pass == 2 && tid == 0) {
      s.seg_counts[0] = my_above;
      s.seg_counts[1] = s.hist[s.found_bin];
    }
    ClusterSync<kCluster>(cluster);  // the cluster is done with this pass (seg_counts set)
  }
  return SegmentSelection<kCluster>(cluster, prefix, remaining, s.seg_counts);
}

// The ordered compaction of a block's segment of n entries, 4 consecutive entries a thread a
// step: load4(i0, key, idx) fills the keys and row indices of entries i0..i0+3 (i0 a multiple
// of 4; entries at or past n are ignored, whatever it puts there). Stops once the segment's
// answers are all written. Every thread of the block calls it.
template <typename Load4>
__device__ __forceinline__ void OrderedCompactSegment(int n, const RadixSelection& sel,
                                                      const int32_t* map, int32_t* out,
                                                      uint32_t* scratch, Load4&& load4) {
  uint32_t run_gt = sel.run_gt, run_eq = sel.run_eq;
  for (int base = 0; base < n; base += 4 * static_cast<int>(blockDim.x)) {
    if (run_gt == sel.end_gt && (run_eq == sel.end_eq || run_eq >= sel.need)) break;
    const int i0 = base + 4 * static_cast<int>(threadIdx.x);
    uint32_t key[4];
    int idx[4];
    load4(i0, key, idx);
    OrderedCompactStep(key, idx, n - i0, sel.threshold, sel.need, map, out, scratch, run_gt,
                       run_eq);
  }
}

// Host: launches `kernel` over num_rows rows of csize kTopKThreads-thread blocks each, in
// thread-block clusters of csize (one cluster a row), with smem bytes of dynamic shared memory.
template <typename... Params, typename... Args>
cudaError_t LaunchTopKClusters(void (*kernel)(Params...), int32_t num_rows, int csize, size_t smem,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(num_rows * csize));
  cfg.blockDim = dim3(kTopKThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(csize);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace decode_indexer::kernels::cuda
