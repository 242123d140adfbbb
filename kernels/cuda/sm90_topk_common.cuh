// Device helpers shared by the radix top-k kernels (sm90_radix_topk.cu) and the cooperative
// candidate-block selection (sm90_cooperative_candidates.cu): the cluster barrier and the
// search of a summed histogram for the bin that holds the K-th largest entry. Both kernels
// split a row over a thread-block cluster and sum their blocks' histograms through distributed
// shared memory; keeping one copy of these keeps their threshold logic identical.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

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

}  // namespace decode_indexer::kernels::cuda
