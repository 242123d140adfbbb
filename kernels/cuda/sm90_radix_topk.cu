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
#include <cooperative_groups.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

// Larger float -> larger key; -0 and +0 are the same value (and the same key).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u << 1) == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// kCluster: the row is split over a thread-block cluster; otherwise one block per row and
// no cluster barriers (cheaper when there are enough rows to fill the GPU).
template <bool kCluster>
__global__ void __launch_bounds__(kTopKThreads) RadixTopKKernel(const TopKArgs a) {
  __shared__ uint32_t hist[kTopKBins];   // this block's counts (read by the whole cluster)
  __shared__ uint32_t total[kTopKBins];  // the row's counts, summed over the cluster
  __shared__ uint32_t scratch[32];
  __shared__ uint32_t found_bin, found_above, local_above;
  __shared__ uint32_t seg_counts[2];  // this block's keys > T and == T (read by the cluster)

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;
  const int rank = kCluster ? static_cast<int>(cluster.block_rank()) : 0;
  auto cluster_sync = [&]() {
    if constexpr (kCluster) {
      cluster.sync();
    } else {
      __syncthreads();
    }
  };
  const int row = blockIdx.x / csize;
  const int tid = threadIdx.x;
  const int k = a.k;
  int32_t length = a.fixed_length;
  if (a.lengths != nullptr) {
    length = (a.lengths[row] + a.length_divisor - 1) / a.length_divisor;
  }
  int32_t* out = a.out + int64_t{row} * k;
  const int32_t* map = a.index_map ? a.index_map + int64_t{row} * a.index_map_stride : nullptr;
  if (length <= k) {  // the same branch for every block of the cluster
    if (rank == 0) {
      for (int i = tid; i < k; i += blockDim.x) out[i] = i < length ? (map ? map[i] : i) : -1;
    }
    return;
  }
  const float* __restrict__ v = a.values + int64_t{row} * a.stride;
  const bool vec = (a.stride % 4 == 0) && ((reinterpret_cast<uintptr_t>(a.values) & 15) == 0);
  // This block's segment of the row (multiples of 4 so that float4 loads stay aligned).
  const int seg = ((length + csize - 1) / csize + 3) & ~3;
  const int lo = min(length, rank * seg);
  const int hi = min(length, lo + seg);
  const int n4 = vec ? (hi - lo) / 4 : 0;

  uint32_t prefix = 0;  // the key bits fixed so far
  uint32_t remaining = static_cast<uint32_t>(k);
  uint32_t my_above = 0;  // keys of this segment known to be > the threshold
  constexpr int kShift[3] = {21, 10, 0};
  constexpr int kBits[3] = {11, 11, 10};
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = kShift[pass];
    const uint32_t mask = (1u << kBits[pass]) - 1u;
    const int hi_shift = shift + kBits[pass];  // bits above this digit must match `prefix`
    for (int i = tid; i < kTopKBins; i += blockDim.x) hist[i] = 0u;
    if (tid == 0) local_above = 0u;
    __syncthreads();
    auto count = [&](float x) {
      const uint32_t key = OrderedKey(x);
      if (pass == 0 || (key >> hi_shift) == prefix) atomicAdd(&hist[(key >> shift) & mask], 1u);
    };
    for (int i = tid; i < n4; i += blockDim.x) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(v + lo) + i);
      count(x.x);
      count(x.y);
      count(x.z);
      count(x.w);
    }
    for (int i = lo + 4 * n4 + tid; i < hi; i += blockDim.x) count(__ldg(&v[i]));
    cluster_sync();  // every block's histogram is complete
    if constexpr (kCluster) {
      for (int i = tid; i < kTopKBins; i += blockDim.x) {
        uint32_t sum = 0;
        for (int r = 0; r < csize; ++r) sum += cluster.map_shared_rank(hist, r)[i];
        total[i] = sum;
      }
      __syncthreads();
    }
    const uint32_t* tot = kCluster ? total : hist;
    // Suffix sums: thread t owns bins [top - kPer, top) counted from the top.
    constexpr int kPer = kTopKBins / kTopKThreads;
    const int top = kTopKBins - tid * kPer;  // exclusive upper bin
    uint32_t local = 0;
#pragma unroll
    for (int j = 1; j <= kPer; ++j) local += tot[top - j];
    uint32_t sum_all;
    uint32_t above = BlockExclusiveScan(local, scratch, &sum_all);  // count in bins >= top
#pragma unroll
    for (int j = 1; j <= kPer; ++j) {
      const uint32_t cnt = tot[top - j];
      if (above < remaining && above + cnt >= remaining) {
        found_bin = static_cast<uint32_t>(top - j);
        found_above = above;
      }
      above += cnt;
    }
    __syncthreads();
    // This segment's keys in bins above the found one are above the threshold.
    uint32_t mine = 0;
#pragma unroll
    for (int j = 1; j <= kPer; ++j) {
      if (static_cast<uint32_t>(top - j) > found_bin) mine += hist[top - j];
    }
    if (mine != 0u) atomicAdd(&local_above, mine);
    __syncthreads();
    my_above += local_above;
    prefix = (prefix << kBits[pass]) | found_bin;
    remaining -= found_above;
    if (pass == 2 && tid == 0) {
      seg_counts[0] = my_above;
      seg_counts[1] = hist[found_bin];
    }
    cluster_sync();  // the cluster is done reading this pass's histograms (and seg_counts set)
  }
  const uint32_t threshold = prefix;
  const uint32_t need = remaining;  // entries equal to the threshold to keep, lowest first

  // Where this segment's answers start: the counts of the segments before it.
  uint32_t run_gt = 0, run_eq = 0;
  if constexpr (kCluster) {
    for (int r = 0; r < rank; ++r) {
      const uint32_t* sc = cluster.map_shared_rank(seg_counts, r);
      run_gt += sc[0];
      run_eq += sc[1];
    }
  }
  const uint32_t end_gt = run_gt + seg_counts[0];
  const uint32_t end_eq = run_eq + seg_counts[1];
  if constexpr (kCluster) cluster.sync();  // no block leaves while others read its memory

  // Ordered compaction of the segment, 4 consecutive entries per thread per chunk.
  for (int base = lo; base < hi; base += 4 * blockDim.x) {
    if (run_gt == end_gt && (run_eq == end_eq || run_eq >= need)) break;  // nothing left
    const int i0 = base + 4 * tid;
    float x[4];
    if (vec && i0 + 3 < hi) {
      const float4 x4 = __ldg(reinterpret_cast<const float4*>(v + i0));
      x[0] = x4.x;
      x[1] = x4.y;
      x[2] = x4.z;
      x[3] = x4.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = i0 + j < hi ? __ldg(&v[i0 + j]) : 0.f;
    }
    uint32_t gt_flags = 0, eq_flags = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j < hi) {
        const uint32_t key = OrderedKey(x[j]);
        gt_flags |= static_cast<uint32_t>(key > threshold) << j;
        eq_flags |= static_cast<uint32_t>(key == threshold) << j;
      }
    }
    const uint32_t packed = (static_cast<uint32_t>(__popc(gt_flags)) << 16) | __popc(eq_flags);
    uint32_t chunk_total;
    const uint32_t excl = BlockExclusiveScan(packed, scratch, &chunk_total);
    uint32_t gt_before = run_gt + (excl >> 16);
    uint32_t eq_before = run_eq + (excl & 0xFFFFu);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int idx = i0 + j;
      if ((gt_flags >> j) & 1u) {
        out[gt_before + min(eq_before, need)] = map ? map[idx] : idx;
        ++gt_before;
      } else if ((eq_flags >> j) & 1u) {
        if (eq_before < need) out[gt_before + eq_before] = map ? map[idx] : idx;
        ++eq_before;
      }
    }
    run_gt += chunk_total >> 16;
    run_eq += chunk_total & 0xFFFFu;
  }
}

}  // namespace

absl::Status LaunchRadixTopK(const TopKArgs& args, int num_sms, cudaStream_t stream) {
  if (args.num_rows <= 0) return absl::OkStatus();
  if (args.k <= 0) return absl::InvalidArgumentError("radix top-k: k must be positive");
  const int csize = TopKClusterSize(args.num_rows, args.max_length, num_sms);
  if (csize == 1) {
    RadixTopKKernel<false><<<args.num_rows, kTopKThreads, 0, stream>>>(args);
    DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch RadixTopKKernel");
    return absl::OkStatus();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(args.num_rows * csize));
  cfg.blockDim = dim3(kTopKThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(csize);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DI_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, RadixTopKKernel<true>, args),
                          "launch RadixTopKKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
