// Cooperative single-launch candidate-block selection (spec section 7; the seed's
// select_candidate_blocks_cooperative): for up to kCooperativeCandidatesMaxRows rows, one
// launch does what the general path does in two (LaunchCandidateScores writes block scores to
// global memory, then LaunchRadixTopK with length_divisor reads them back).
//
// One thread-block cluster per row, every block of the step resident at once (rows x cluster
// <= the SMs of an H100/H200): each block scores its segment of the row's blocks straight from
// the logits (block j: the max logit of positions [j * bs, j * bs + bs), the newest block
// +inf) into shared memory as order-preserving keys; the three radix passes (11 + 11 + 10 key
// bits) then read only shared memory, the blocks' histograms summed through distributed shared
// memory, and find the exact K-th key T and how many keys equal to T to keep (the lowest block
// ids win); an ordered compaction of the shared keys writes the ascending answer, each block
// its segment at the offset the earlier segments' counts give. The same threshold search and
// compaction step as the radix top-k (sm90_topk_common.cuh), so the answer is the general
// path's bit for bit. Deterministic by construction: no atomic decides an output position.
#include <cooperative_groups.h>

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

// Keys of one block's segment of a row of `blocks` candidate blocks (a multiple of 4, so the
// compaction's 16-byte shared loads stay aligned).
constexpr int64_t CoopSegment(int64_t blocks, int csize) {
  return ((blocks + csize - 1) / csize + 3) / 4 * 4;
}

__global__ void __launch_bounds__(kTopKThreads)
    CooperativeCandidatesKernel(const CooperativeCandidatesArgs a, int seg_cap) {
  extern __shared__ __align__(16) uint32_t skey[];  // [seg_cap]: this segment's score keys
  __shared__ uint32_t hist[kTopKBins];              // this block's counts (read by the cluster)
  __shared__ uint32_t total[kTopKBins];             // the row's counts
  __shared__ uint32_t scratch[32];
  __shared__ uint32_t found_bin, found_above, local_above;
  __shared__ uint32_t seg_counts[2];  // this block's keys > T and == T (read by the cluster)

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int row = blockIdx.x / csize;
  const int tid = threadIdx.x;
  const int k = a.k;
  const int bs = a.block_size;
  const int32_t length = max(0, a.row_length[row]);
  const int32_t nb = length / bs + (length % bs != 0);  // the row's blocks (no overflow)
  int32_t* out = a.out + int64_t{row} * k;
  const int seg = static_cast<int>(CoopSegment(nb, csize));
  // The same branch for every block of the cluster. A row longer than the host's bound
  // (max_blocks_per_row) would not fit: it answers -1s (a contract violation made visible, not
  // a write past shared memory).
  if (nb <= k || seg > seg_cap) {
    if (rank == 0) {
      for (int i = tid; i < k; i += blockDim.x) out[i] = nb <= k && i < nb ? i : -1;
    }
    return;
  }
  const int lo = min(nb, rank * seg);
  const int hi = min(nb, lo + seg);
  const int n_local = hi - lo;
  const float* __restrict__ v = a.logits + int64_t{row} * a.logits_stride;

  // ---- Scores into shared memory. Every block but the newest lies below the length.
  const bool vec8 =
      bs == 8 && a.logits_stride % 4 == 0 && (reinterpret_cast<uintptr_t>(a.logits) & 15) == 0;
  if (vec8) {
    // Quad q (4 logits) of the segment: thread pairs (even, odd lane) share a block, so each
    // warp load is 512 contiguous bytes; 4 loads in flight per thread.
    constexpr int kQuadLoads = 4;
    const int q_hi = 2 * n_local;
    for (int base = 0; base < q_hi; base += kQuadLoads * kTopKThreads) {
      float m[kQuadLoads];
#pragma unroll
      for (int u = 0; u < kQuadLoads; ++u) {
        const int q = base + u * kTopKThreads + tid;
        const int j = lo + q / 2;
        m[u] = -INFINITY;
        if (q < q_hi && j != nb - 1) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(v + int64_t{j} * 8) + (q & 1));
          m[u] = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
        }
      }
#pragma unroll
      for (int u = 0; u < kQuadLoads; ++u) {
        const int q = base + u * kTopKThreads + tid;
        const float other = __shfl_xor_sync(kFullMask, m[u], 1);
        if (q < q_hi && (q & 1) == 0) {
          const int j = lo + q / 2;
          skey[q / 2] = TopKOrderedKey(j == nb - 1 ? INFINITY : fmaxf(m[u], other));
        }
      }
    }
  } else {
    for (int i = tid; i < n_local; i += blockDim.x) {
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
  __syncthreads();

  // ---- Radix passes over the shared keys, histograms summed across the cluster.
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
    for (int i = tid; i < n_local; i += blockDim.x) {
      const uint32_t key = skey[i];
      if (pass == 0 || (key >> hi_shift) == prefix) atomicAdd(&hist[(key >> shift) & mask], 1u);
    }
    cluster.sync();  // every block's histogram is complete
    for (int i = tid; i < kTopKBins; i += blockDim.x) {
      uint32_t sum = 0;
      for (int r = 0; r < csize; ++r) sum += cluster.map_shared_rank(hist, r)[i];
      total[i] = sum;
    }
    __syncthreads();
    FindBin(total, remaining, scratch, &found_bin, &found_above);
    // This segment's keys in bins above the found one are above the threshold.
    uint32_t mine = 0;
    for (int i = tid; i < kTopKBins; i += blockDim.x) {
      if (static_cast<uint32_t>(i) > found_bin) mine += hist[i];
    }
    mine = __reduce_add_sync(kFullMask, mine);
    if ((tid & 31) == 0 && mine != 0u) atomicAdd(&local_above, mine);
    __syncthreads();
    my_above += local_above;
    prefix = (prefix << kBits[pass]) | found_bin;
    remaining -= found_above;
    if (pass == 2 && tid == 0) {
      seg_counts[0] = my_above;
      seg_counts[1] = hist[found_bin];
    }
    cluster.sync();  // the cluster is done reading this pass's histograms (and seg_counts set)
  }
  const uint32_t threshold = prefix;
  const uint32_t need = remaining;  // keys equal to the threshold to keep, lowest block first

  // ---- Where this segment's answers start, then its ordered compaction from shared memory.
  uint32_t run_gt = 0, run_eq = 0;
  for (int r = 0; r < rank; ++r) {
    const uint32_t* sc = cluster.map_shared_rank(seg_counts, r);
    run_gt += sc[0];
    run_eq += sc[1];
  }
  const uint32_t end_gt = run_gt + seg_counts[0];
  const uint32_t end_eq = run_eq + seg_counts[1];
  cluster.sync();  // no block leaves while others read its shared memory
  for (int base = 0; base < n_local; base += 4 * kTopKThreads) {
    if (run_gt == end_gt && (run_eq == end_eq || run_eq >= need)) break;  // nothing left
    const int i0 = base + 4 * tid;
    uint32_t key[4];
    int idx[4];
    if (i0 + 3 < n_local) {
      const uint4 k4 = *reinterpret_cast<const uint4*>(skey + i0);
      key[0] = k4.x;
      key[1] = k4.y;
      key[2] = k4.z;
      key[3] = k4.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) key[e] = i0 + e < n_local ? skey[i0 + e] : 0u;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) idx[e] = lo + i0 + e;
    OrderedCompactStep(key, idx, n_local - i0, threshold, need, nullptr, out, scratch, run_gt,
                       run_eq);
  }
}

}  // namespace

bool CooperativeCandidatesSupported(int32_t num_rows, int32_t max_blocks_per_row, int32_t k) {
  if (num_rows < 1 || num_rows > kCooperativeCandidatesMaxRows) return false;
  if (max_blocks_per_row < 1 || k < 1) return false;
  return CoopSegment(max_blocks_per_row, CoopClusterSize(num_rows)) <= kCoopMaxKeysPerBlock;
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
  const int csize = CoopClusterSize(args.num_rows);
  const int seg_cap = static_cast<int>(CoopSegment(args.max_blocks_per_row, csize));
  static KernelDeviceSetup per_device[kMaxDevices];
  absl::StatusOr<const KernelDeviceSetup*> setup = SetUpOncePerDevice(
      per_device, "cooperative candidates: shared-memory opt-in", [](KernelDeviceSetup&) {
        return cudaFuncSetAttribute(CooperativeCandidatesKernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kCoopMaxKeysPerBlock * static_cast<int>(sizeof(uint32_t)));
      });
  if (!setup.ok()) return setup.status();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(args.num_rows * csize));
  cfg.blockDim = dim3(kTopKThreads);
  cfg.dynamicSmemBytes = sizeof(uint32_t) * static_cast<size_t>(seg_cap);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(csize);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DI_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, CooperativeCandidatesKernel, args, seg_cap),
                          "launch CooperativeCandidatesKernel (cluster)");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
