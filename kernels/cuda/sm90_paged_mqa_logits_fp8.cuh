// The FP8 tensor-core paged MQA logits kernel (MqaMath::kWgmmaKeysMPipelinedFp8), as a template
// of its shape choices (rows per pass, blocks per SM, ring slots, weights in registers), and its
// launcher: sm90_paged_mqa_logits_fp8.cu instantiates the production choices
// (sm90_heuristics.h); the bench's fp8 variants (bench/cuda/variants/) instantiate others to
// time them beside it. Every instantiation computes the same logits bit for bit: the choices
// move no arithmetic (gpu_variants_test checks).
//
// Paged MQA logits for FP8 caches with 64 heads on the fp8 tensor cores, keys as M
// (MqaMath::kWgmmaKeysMPipelinedFp8: the product's default dense kernel, sm90_heuristics.h): the
// exact kernel's page ring (PageRing, sm90_mqa_pipeline.cuh) filled by the TMA unit
// (ProducePagesTma: one thread, one tensor copy and one bulk copy a page, instead of the
// producer warp's 17 cp.async a lane), with the e4m3 -> f16 widening gone.
//
// Why: v6 spends ~100 of its ~300 instructions per consumer warp and page widening e4m3 to f16
// (ldmatrix + cvt / bit moves), and f16 wgmma has half fp8's rate, so next_n >= 2 is compute
// bound (docs/notes/cuda.md). Here the consumer warpgroup's wgmmas read both operands straight
// from shared memory:
// - A = the ring slot: 64 keys x 128 e4m3 dims, K-major, 128-byte rows in the 128B swizzle the
//   TMA unit writes (PageValuesTensorMap; the same layout CopyPageToStage writes by hand), which
//   is wgmma's SW128 layout because every slot is 1024-byte aligned. k-step ks (32 dims) starts
//   ks * 32 bytes into the rows.
// - B = q in e4m3: row rr's 64 heads at rows 64 rr .. 64 rr + 63 of a [64 x rows][128 B] SW128
//   K-major tile, so one m64nNk32 instruction with N = 64 (one row) or 128 (a row pair) covers
//   two of a pass's rows: every key is read from DRAM once per request and from shared memory
//   once per k-step and row pair for next_n 1-4. (One m64n64 chain per row instead, once kept
//   as kWgmmaKeysMPipelinedFp8PerRow, gave the same bits and was slower from next_n 2 on: 64 x
//   32K next_n 2 136.6 against 117.2 us, docs/results/raw/steps_and_dg_1428.log.)
// - 4 wgmma per page and row pair (descriptors as 32-bit low words added to, Sw128Desc), then
//   the epilogue (relu * weight over this thread's 16 heads in four independent fp32 chains,
//   Fp8HeadSums; the 4 lanes of a group complete the 64-head sum) times the key scale. Weights
//   sit in shared memory permuted so that a thread's 16 are contiguous: a pass's first one or
//   two rows' loaded into registers once per request (kWeightRegs), rows 2-3's read with four
//   16-byte loads a row and page. The slot goes back to the producer once the page's logits
//   are stored (every consumer thread arrives on its empty barrier after its store: see
//   score_page for why not as soon as the wgmmas have read it).
// - The loop walks the block's tiles one request's run at a time: q, the lane's row lengths and
//   logit addresses once per run; per page only the wait, the wgmmas, the epilogue and a store
//   at a running position. A request with more rows than a pass holds is scored one pass per
//   run, the producer filling the run's pages once per pass (ProduceRunPages), instead of q
//   reloaded between passes on every page (rare: the host sizes the pass to the
//   rows-per-request hint, at most 4). The 64-head sums of a row pair are reduce-scattered
//   over the group's 4 lanes (Fp8ReduceScatter2: 3 shuffles and 3 adds instead of 8 and 8), so
//   every lane stores one logit, unpredicated by lane. The warp index goes through a lane-0
//   shuffle, so ptxas sees the consumer's branch as warp-uniform and keeps the loop's state and
//   the wgmma descriptors on the uniform datapath. Against the per-page loop it replaced (bench
//   variant kFp8PerPage, the same bits): 30-35% fewer instructions issued at 64 x 32K and 1-25%
//   less time at every one of the 32 shapes measured (docs/results/cuda-bench.md, session 16's
//   run-ordered loop section).
// - What this layout cost before (measured, docs/results/cuda-bench.md): every shared-memory
//   access compiled to a generic load while the aligned base went through an integer
//   (AlignSmem1024 keeps the address space), the descriptors were rebuilt per k-step, and at two
//   rows the weights came from shared memory 16 floats at a time at 4 blocks per SM. The kernel
//   as it was then is the bench variant kFp8V1 (bench/cuda/variants/), kept to time against.
//
// Numerics: NOT exact. Each wgmma k=32 slice aligns its products to the largest exponent and
// keeps ~13 fraction bits (docs/spec.md section 6 gives the bound, reference/ computes it). The
// order is fixed: the same 4 instructions per row in the same order, the same epilogue, no
// dependence on the schedule, the grid or the batch, so the logits are bit-identical across runs
// and batch compositions (gpu_test checks).
#pragma once

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_mqa_pipeline.cuh"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_wgmma_fp8.cuh"

namespace decode_indexer::kernels::cuda {

// The cache's page codes as a 3-D tensor for the TMA unit (sm90_paged_mqa_logits_fp8.cu).
absl::StatusOr<CUtensorMap> PageValuesTensorMap(const CacheView& cache);

namespace fp8_logits {

constexpr int kHeads = 64;
constexpr int kConsumerThreads = kPipeConsumerThreads;  // one warpgroup: warps 0-3
constexpr int kThreads = kPipeThreads;                  // and the producer, warp 4
constexpr int kConsumerWarps = kPipeConsumerWarps;
constexpr int kValues = kPipeSlotValues;          // 8192: a page's e4m3 codes
constexpr int kScales = kPipeSlotScales;          // 256: its fp32 scales
constexpr int kQRowBytes = kHeads * kMqaHeadDim;  // one row's q in e4m3: 8 KB
constexpr int kQBarrier = kPipeQBarrier;          // named barrier of the consumer warpgroup

static_assert(kValues % 1024 == 0 && kQRowBytes % 1024 == 0, "SW128 tiles stay 1024-aligned");

// Rows of q in shared memory: whole row pairs beyond one row (a third row's MMA runs as
// m64n128 against a zero fourth row: m64n64 into half of the pair's accumulators made ptxas
// serialize the wgmmas for lack of registers, C7511).
constexpr int QRows(int rows) { return rows == 1 ? 1 : (rows + 1) / 2 * 2; }

template <int kRows, bool kOwnSchedule, int kStages>
constexpr int SmemBytes() {
  return kStages * kValues + QRows(kRows) * kQRowBytes + kStages * kScales +
         QRows(kRows) * kHeads * 4 + PageRing<kStages>::kBarrierBytes +
         (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

// Where head h's weight sits in a row's 64 weights in shared memory: thread c of a group reads
// heads 8 j + 2 c + e (j < 8, e < 2) as 16 contiguous floats, k = 2 j + e.
__device__ __forceinline__ int WeightSlot(int head) {
  return ((head & 7) >> 1) * 16 + (head >> 3) * 2 + (head & 1);
}

// Keys g and g + 8 of an m64nN accumulator's 32 entries of one row (acc[4 j + e]: key g,
// acc[4 j + 2 + e]: key g + 8, head 8 j + 2 c + e) through relu, times the head's weight w[2 j +
// e], summed over this thread's 16 heads in four independent chains (key, e) so that the FFMAs
// do not wait on each other: this thread's partial sums of key g (s0) and g + 8 (s1). A fixed
// order: the same bits on every run and grid.
__device__ __forceinline__ void Fp8HeadPartials(const float* acc, const float (&w)[16], float& s0,
                                                float& s1) {
  float a0 = 0.f, a1 = 0.f, b0 = 0.f, b1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    a0 = fmaf(w[2 * j], fmaxf(acc[4 * j], 0.f), a0);
    a1 = fmaf(w[2 * j + 1], fmaxf(acc[4 * j + 1], 0.f), a1);
    b0 = fmaf(w[2 * j], fmaxf(acc[4 * j + 2], 0.f), b0);
    b1 = fmaf(w[2 * j + 1], fmaxf(acc[4 * j + 3], 0.f), b1);
  }
  s0 = a0 + a1;
  s1 = b0 + b1;
}

// The partials, then the 4 lanes of the group complete both keys' 64-head sums (every lane
// holds both; lane c's: (P_c + P_c^1) + (P_c^2 + P_c^3)).
__device__ __forceinline__ void Fp8HeadSums(const float* acc, const float (&w)[16], float& s0,
                                            float& s1) {
  Fp8HeadPartials(acc, w, s0, s1);
  s0 += __shfl_xor_sync(kFullMask, s0, 1);
  s1 += __shfl_xor_sync(kFullMask, s1, 1);
  s0 += __shfl_xor_sync(kFullMask, s0, 2);
  s1 += __shfl_xor_sync(kFullMask, s1, 2);
}

// This thread's 16 weights of one row (w_row: the row's 64 in WeightSlot order): four 16-byte
// loads.
__device__ __forceinline__ void LoadWeights(const float* w_row, int c, float (&w)[16]) {
  const float4* src = reinterpret_cast<const float4*>(w_row + 16 * c);
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const float4 x = src[v];
    w[4 * v] = x.x;
    w[4 * v + 1] = x.y;
    w[4 * v + 2] = x.z;
    w[4 * v + 3] = x.w;
  }
}

// An SW128 K-major descriptor (SmemDescSw128) from its low word: the 14-bit start address / 16
// and the leading byte offset; the high word (stride 1024 B between 8-row groups, the 128B
// swizzle mode) is the same for every tile here. Offsets inside shared memory (a slot, a k-step,
// a q row pair) are then 32-bit additions to the low word.
__device__ __forceinline__ uint32_t Sw128DescLo(const void* smem) {
  return static_cast<uint32_t>(SmemDescSw128(smem));
}
__device__ __forceinline__ uint64_t Sw128Desc(uint32_t lo) {
  return (kSmemDescSw128Fixed & 0xFFFFFFFF00000000ull) | lo;
}

// The 4 k-steps of one page against q rows (kN / 64 of them): k-step ks reads 32 dims, ks * 32
// bytes into both operands' 128-byte swizzled rows (2 added to the descriptors' low words).
template <int kN>
__device__ __forceinline__ void IssuePage(float* acc, uint32_t desc_kv, uint32_t desc_q) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    WgmmaM64NK32E4M3SS<kN>(acc, Sw128Desc(desc_kv + 2 * ks), Sw128Desc(desc_q + 2 * ks), ks);
  }
}

// Fills the q tile and the weights in shared memory for pass `pass` of the request whose rows
// are first_row .. first_row + nrows - 1, by the consumer threads (tid < kConsumerThreads): q
// codes as they are (e4m3 is the MMA's type), in the SW128 layout the wgmmas read; rows past
// the request's last are zero, and at three rows a pass the tile's fourth row holds the next
// pass's first row, if any (the columns of both are computed, never stored). The caller orders it
// between two kQBarrier syncs and fences it for the async proxy.
template <int kRows>
__device__ __forceinline__ void FillQTile(const PagedLogitsArgs& p, uint8_t* q_tile, float* w_smem,
                                          int tid, int pass, int first_row, int nrows) {
  constexpr int kQRows = QRows(kRows);
  constexpr int kItems = kQRows * kHeads * 8;  // 16 codes each
  static_assert(kItems % (4 * kConsumerThreads) == 0, "whole rounds of q loads");
  // Not unrolled: with 3-4 rows, all rounds' loads hoisted together spilled (ptxas -v).
#pragma unroll 1
  for (int it0 = 0; it0 < kItems; it0 += 4 * kConsumerThreads) {
    uint4 codes[4];
    float wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = it0 + u * kConsumerThreads + tid;
      const int rr = it / (kHeads * 8), head = (it / 8) % kHeads, oct = it % 8;
      const int rin = pass * kRows + rr;
      codes[u] = make_uint4(0u, 0u, 0u, 0u);
      wv[u] = 0.f;
      if (rin < nrows) {
        const int64_t row = first_row + rin;
        codes[u] = __ldg(
            reinterpret_cast<const uint4*>(p.q.codes + (row * kHeads + head) * kMqaHeadDim) + oct);
        if (oct == 0) wv[u] = __ldg(&p.q.weights[row * kHeads + head]);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = it0 + u * kConsumerThreads + tid;
      const int n = it / 8, oct = it % 8;  // B row n = 64 rr + head
      *reinterpret_cast<uint4*>(q_tile + n * 128 + ((oct ^ (n & 7)) << 4)) = codes[u];
      if (oct == 0) w_smem[(n >> 6) * kHeads + WeightSlot(n & 63)] = wv[u];
    }
  }
}

// Fp8HeadSums' second half as a reduce-scatter: the 4 lanes of a group hold partials p[r][k] (row
// r of the pair, key g + 8 k); lane c ends with the full sum of row c >> 1, key c & 1, in the bits
// Fp8HeadSums gives (its lane c: (P_c + P_c^1) + (P_c^2 + P_c^3), the same two additions here up
// to the order of their operands, which IEEE addition ignores). 3 shuffles for the pair's 4 sums
// instead of 8, and every lane stores one.
__device__ __forceinline__ float Fp8ReduceScatter2(const float (&p)[2][2], int c) {
  const bool k1 = c & 1, r1 = c & 2;
  // Step 1 (lanes c, c ^ 1): keep key c & 1 of both rows, hand over the other key.
  float t[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float keep = k1 ? p[r][1] : p[r][0];
    const float give = k1 ? p[r][0] : p[r][1];
    t[r] = keep + __shfl_xor_sync(kFullMask, give, 1);
  }
  // Step 2 (lanes c, c ^ 2): keep row c >> 1, hand over the other row.
  const float keep = r1 ? t[1] : t[0];
  const float give = r1 ? t[0] : t[1];
  return keep + __shfl_xor_sync(kFullMask, give, 2);
}
// One row: lane c ends with key c & 1's sum (lanes c and c ^ 2 alike).
__device__ __forceinline__ float Fp8ReduceScatter1(const float (&p)[2], int c) {
  const bool k1 = c & 1;
  const float keep = k1 ? p[1] : p[0];
  const float give = k1 ? p[0] : p[1];
  const float t = keep + __shfl_xor_sync(kFullMask, give, 1);
  return t + __shfl_xor_sync(kFullMask, t, 2);
}

// Passes over a request's tiles: its rows kRows at a time (one for a request without rows).
template <int kRows>
__device__ __forceinline__ int RunPasses(int nrows) {
  return nrows > kRows ? (nrows + kRows - 1) / kRows : 1;
}

// The producer's walk (the producer warp's lane 0), for any page ring: the block's tiles in the
// order the consumers score them, one request's run at a time, each run once per pass
// (RunPasses; more than one only for a request with more rows than a pass holds, whose keys
// are then read again per pass rather than held while q is reloaded), `fill(i, page)` for the
// i-th page. The next page's page-table entry is read one page early so its latency overlaps
// the wait for a free slot. Keys at or past a tile's valid count are copied as they are (stale
// cache bytes): every key's logit depends only on its own codes and scale, and no logit at or
// past a row's length is stored. (The FP4 kernel, sm90_paged_mqa_logits_fp4.cu, walks its own
// ring the same way.)
template <int kRows, bool kOwnSchedule, typename Fill>
__device__ __forceinline__ void WalkRunPages(const PagedLogitsArgs& p,
                                             const BlockSchedule<kOwnSchedule>& sched,
                                             Fill&& fill) {
  const int end = sched.begin + sched.num_tiles;
  ScheduleCursor<kOwnSchedule> seek;
  seek.Seek(sched.prefix, sched.num_requests, sched.begin);
  int b = seek.request, tile0 = 0, run_begin = 0, run_end = 0, passes = 1, pass = 0, t = 0;
  int64_t row_base = 0;
  // Request b's run from tile `from` (b the first request with a tile at or past it).
  auto enter = [&](int from) {
    while ((run_end = min(end, Ld<kOwnSchedule>(&sched.prefix[b + 1]))) <= from) ++b;
    tile0 = Ld<kOwnSchedule>(&sched.prefix[b]);
    run_begin = t = from;
    pass = 0;
    passes = RunPasses<kRows>(Ld<kOwnSchedule>(&sched.num_rows[b]));
    row_base = PageRowBase(p.rows, b);
  };
  // The next (run, pass, tile); false after the block's last.
  auto advance = [&]() {
    if (++t < run_end) return true;
    if (++pass < passes) {
      t = run_begin;
      return true;
    }
    if (run_end >= end) return false;
    ++b;
    enter(run_end);
    return true;
  };
  enter(sched.begin);
  int next_page = __ldg(&p.rows.page_table[row_base + t - tile0]);
  bool more = true;
  for (int i = 0; more; ++i) {
    const int page = next_page;
    more = advance();
    if (more) next_page = __ldg(&p.rows.page_table[row_base + t - tile0]);
    fill(i, page);
  }
}

// The fp8 kernel's producer: WalkRunPages, each page into the ring through FillSlotTma.
template <int kRows, int kStages, bool kOwnSchedule>
__device__ __forceinline__ void ProduceRunPages(const PagedLogitsArgs& p,
                                                const BlockSchedule<kOwnSchedule>& sched,
                                                const PageRing<kStages>& ring,
                                                const void* values_map) {
  const uint8_t* __restrict__ cache = p.cache.base;
  PrefetchTensorMap(values_map);
  WalkRunPages<kRows>(p, sched,
                      [&](int i, int page) { FillSlotTma(ring, i, cache, page, values_map); });
}

// kRows: rows of a request scored per pass over a page (RowsPerPass): one m64n128 instruction
// per k-step for each two of them (m64n64 for one). kMinBlocks, kStages, kWeightRegs: the
// production choices are PipeFp8MinBlocks, kPipeFp8Stages, kPipeFp8WeightRegs (sm90_heuristics.h).
// kWeightRegs: this thread's weights of the pass's first one or two rows in registers (loaded
// once per pass) instead of four 16-byte shared-memory loads per row and page.
template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages, bool kWeightRegs>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsFp8Kernel(const PagedLogitsArgs p,
                            const __grid_constant__ CUtensorMap values_map) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignSmem1024(smem_raw);
  uint8_t* stage_values = smem;                // [stages][64 keys][128 B], SW128
  uint8_t* q_tile = smem + kStages * kValues;  // [rows][64 heads][128 B], SW128
  constexpr int kQRows = QRows(kRows);
  uint8_t* stage_scales = q_tile + kQRows * kQRowBytes;                        // [stages][64] fp32
  float* w_smem = reinterpret_cast<float*>(stage_scales + kStages * kScales);  // [q rows][64]
  uint64_t* full = reinterpret_cast<uint64_t*>(w_smem + kQRows * kHeads);      // 16-byte aligned
  const PageRing<kStages> ring{stage_values, stage_scales, full, full + kStages};
  int32_t* own = reinterpret_cast<int32_t*>(full + 2 * kStages);

  const int tid = threadIdx.x;
  // The warp index through a lane-0 shuffle: the same in every lane, and now provably so to the
  // compiler, which then treats the consumer's branch as warp-uniform and keeps the run loop's
  // state (tile, ring slot, phase, position) and the wgmma descriptors in uniform registers:
  // no R2UR / IMAD / VIADD for them per page (CUTLASS's canonical_warp_idx_sync does the same).
  const int warp = __shfl_sync(kFullMask, tid >> 5, 0);
  const int lane = tid & 31;

  if (tid == 0) ring.InitBarriers(1, kConsumerThreads);
  BlockSchedule<kOwnSchedule> sched;
  sched.template SetUp<kThreads>(p, own, tid);
  if (sched.num_tiles == 0) return;
  const int num_tiles = sched.num_tiles;
  const int32_t* prefix = sched.prefix;
  const int32_t* req_first_row = sched.first_row;
  const int32_t* req_num_rows = sched.num_rows;
  uint64_t* empty = ring.empty;

  if (warp == kConsumerWarps) {
    if (lane == 0) ProduceRunPages<kRows>(p, sched, ring, &values_map);
    return;
  }

  // ---- Consumer warpgroup. ----
  const int g = lane >> 2;
  const int c = lane & 3;
  const int key0 = warp * 16 + g;  // this thread's keys key0 and key0 + 8 of the page
  // The one logit this lane stores per row group and page (Fp8ReduceScatter): key kkey of the
  // page, row 2 u + (c >> 1) of a pass's group u (rows 0-1, then 2-3); with one row a pass,
  // lanes c and c ^ 2 store the same value to the same place.
  const int kkey = key0 + 8 * (c & 1);
  const int krow = kRows == 1 ? 0 : c >> 1;
  const int64_t stride = p.logits_stride;
  // Per request pass (load_q): this thread's weights at one or two rows (LoadWeights; rows 2-3
  // read theirs from shared memory per page), and for each row group where this lane's logit of
  // the pass's tile 0 goes and the lane's row's length (0 past the request's last row: nothing
  // stored). Positions are then base_pos + kkey, the address out_u + base_pos.
  constexpr int kRegRows = kWeightRegs ? (kRows < 2 ? kRows : 2) : 0;
  constexpr int kGroups = kRows > 2 ? 2 : 1;
  float w_reg[kRegRows > 0 ? 16 * kRegRows : 1];
#pragma unroll
  for (float& w : w_reg) w = 0.f;
  int len_u[kGroups];
  float* out_u[kGroups];
#pragma unroll
  for (int u = 0; u < kGroups; ++u) {
    len_u[u] = 0;
    out_u[u] = p.logits;
  }
  // q codes (as they are: e4m3 is the MMA's type), weights and this lane's rows' lengths and
  // logit addresses for pass `pass` of request b. Rows past the request's last are zero (their
  // columns are computed, never stored).
  auto load_q = [&](int b, int pass) {
    NamedBarrierSync(kQBarrier, kConsumerThreads);  // every warp's wgmmas on the old q are done
    const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
    const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
    FillQTile<kRows>(p, q_tile, w_smem, tid, pass, first_row, nrows);
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int rin = pass * kRows + 2 * u + krow;
      const bool valid = 2 * u + krow < kRows && rin < nrows;
      len_u[u] = valid ? __ldg(&p.rows.row_length[first_row + rin]) : 0;
      out_u[u] = p.logits + (valid ? int64_t{first_row + rin} * stride : 0) + kkey;
    }
    FenceProxyAsyncShared();  // st.shared before the wgmmas' (async proxy) reads of q
    NamedBarrierSync(kQBarrier, kConsumerThreads);
    if constexpr (kRegRows > 0) {
#pragma unroll
      for (int rr = 0; rr < kRegRows; ++rr) {
        LoadWeights(w_smem + rr * kHeads, c, *reinterpret_cast<float(*)[16]>(w_reg + 16 * rr));
      }
    }
  };

  // The wgmma descriptors' low words (the high word is the same for every SW128 tile here):
  // slot st's is desc_slot0 + st * kValues / 16, k-step ks adds 2, q row pair 1 adds
  // 2 * kQRowBytes / 16 (Sw128Desc).
  // (Through a shuffle: warp-uniform in the compiler's eyes, so they stay in uniform registers
  // instead of being rebuilt from the shared-memory base every page.)
  const uint32_t desc_slot0 = __shfl_sync(kFullMask, Sw128DescLo(stage_values), 0);
  const uint32_t desc_q = __shfl_sync(kFullMask, Sw128DescLo(q_tile), 0);
  int st = 0;
  uint32_t phase = 0;

  // One page (ring slot st, the request's tile at base_pos) against the loaded pass's rows, its
  // logits stored; the slot released once this thread's logits of it are stored.
  auto score_page = [&](int base_pos) {
    const uint32_t desc_kv = desc_slot0 + uint32_t(st * (kValues / 16));
    const float ks = reinterpret_cast<const float*>(stage_scales + st * kScales)[kkey];
    const int pos = base_pos + kkey;
    // Row group u's accumulators (rows 2u, 2u + 1; m64n64 for a one-row pass): relu * w summed
    // over this thread's 16 heads, then Fp8ReduceScatter leaves this lane's one logit.
    auto store_group = [&](const float* acc, int u) {
      float part[2][2];
#pragma unroll
      for (int h = 0; h < (kRows == 1 ? 1 : 2); ++h) {
        const int rr = 2 * u + h;
        if (rr >= kRows) {  // the zero fourth row of a three-row pass: no lane stores it
          part[h][0] = part[h][1] = 0.f;
        } else if (rr < kRegRows) {  // a constant at every call
          Fp8HeadPartials(acc + 32 * h, *reinterpret_cast<const float(*)[16]>(w_reg + 16 * rr),
                          part[h][0], part[h][1]);
        } else {
          float w[16];
          LoadWeights(w_smem + rr * kHeads, c, w);
          Fp8HeadPartials(acc + 32 * h, w, part[h][0], part[h][1]);
        }
      }
      float sum;
      if constexpr (kRows == 1) {
        sum = Fp8ReduceScatter1(part[0], c);
      } else {
        sum = Fp8ReduceScatter2(part, c);
      }
      if (pos < len_u[u]) out_u[u][base_pos] = sum * ks;
    };
    // The slot's codes and scales are no longer read: every consumer thread arrives (the empty
    // barrier counts kConsumerThreads). Only after store_group has multiplied by ks: the arrive
    // must not overtake the shared-memory load of ks, or the producer's next fill of the slot
    // can land first and the tile is scaled by the next page's scales. Released as soon as the
    // wgmmas had completed (the load issued before them), that happened at 8 requests x 20000
    // keys, next_n 2 in 31 of 100 launches on an H100 (one tile, every key off by its two
    // pages' scale ratio; docs/results/gpu-test-runs.md, session 17): in the SASS the arrive
    // came before the load's first use, so nothing made it wait for the load, which could still
    // be queued behind the wgmmas' shared-memory traffic. The multiply consumes ks, so in-order
    // issue now puts the load's completion before the arrive.
    auto release = [&]() { MbarArrive(&empty[st]); };

    // Rows two at a time (at most 64 accumulators live: 3-4 rows' 96-128 spilled at 2 blocks
    // per SM). Every group is issued even past the request's last row (nothing is stored then):
    // a branch around a wgmma makes ptxas serialize every wgmma in the kernel (C7520).
    // Rows 0-1 in one m64n128k32 per k-step (m64n64 for one row per pass), then rows 2-3.
    float acc[64];
    constexpr int kFirst = kRows < 2 ? kRows : 2;
    WgmmaFence();
    IssuePage<64 * kFirst>(acc, desc_kv, desc_q);
    WgmmaCommit();
    WgmmaWait<0>();
    store_group(acc, 0);
    if (kRows <= 2) release();
    if constexpr (kRows > 2) {
      WgmmaFence();
      // Rows 2-3 (at kRows == 3, row 3's columns are never stored).
      IssuePage<128>(acc, desc_kv, desc_q + uint32_t(2 * kQRowBytes / 16));
      WgmmaCommit();
      WgmmaWait<0>();
      store_group(acc, 1);
      release();
    }
  };
  auto next_slot = [&]() {
    if (++st == kStages) {
      st = 0;
      phase ^= 1;
    }
  };

  // The block's tiles, one request's run at a time, the run once per pass (ProduceRunPages
  // fills the ring in this order): the request's schedule entries and q once per run and
  // pass, then its pages with nothing but the page's work.
  int tile = sched.begin;
  const int end_tile = sched.begin + num_tiles;
  ScheduleCursor<kOwnSchedule> seek;
  seek.Seek(prefix, sched.num_requests, tile);
  int b = seek.request;
  int pass = 0;
  while (tile < end_tile) {
    const int tile0 = Ld<kOwnSchedule>(&prefix[b]);
    const int run_end = min(end_tile, Ld<kOwnSchedule>(&prefix[b + 1]));
    if (tile >= run_end) {  // no tiles of request b here
      ++b;
      continue;
    }
    // Every run and pass has its own q (consecutive runs are different requests).
    load_q(b, pass);
    const int run_begin = tile;
    for (int base_pos = (tile - tile0) * kMqaTileKeys; tile < run_end;
         ++tile, base_pos += kMqaTileKeys) {
      // The TMA unit wrote the slot through the async proxy, which the wgmmas read it through:
      // the barrier's phase is all the ordering they need (no proxy fence).
      MbarWait(&full[st], phase);
      score_page(base_pos);
      next_slot();
    }
    if (++pass < RunPasses<kRows>(Ld<kOwnSchedule>(&req_num_rows[b]))) {
      tile = run_begin;  // the run again, for the request's next rows
    } else {
      pass = 0;
      ++b;
    }
  }
}

// One instantiation's launch on a persistent grid (its blocks per SM from the occupancy query).
template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages, bool kWeightRegs>
absl::Status Launch(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<CUtensorMap> map = PageValuesTensorMap(args.cache);
  if (!map.ok()) return map.status();
  return LaunchPersistentGrid(
      per_device, "paged mqa logits (fp8 pipelined)",
      PagedMqaLogitsFp8Kernel<kRows, kOwnSchedule, kMinBlocks, kStages, kWeightRegs>, kThreads,
      SmemBytes<kRows, kOwnSchedule, kStages>(), num_sms, stream, args, *map);
}

}  // namespace fp8_logits
}  // namespace decode_indexer::kernels::cuda
