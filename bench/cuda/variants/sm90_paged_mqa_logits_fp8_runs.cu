// Comparison variant kFp8Runs (mqa_variants.h): the production fp8 logits kernel
// (kernels/cuda/sm90_paged_mqa_logits_fp8.cuh) with its per-page bookkeeping cut, the same
// wgmmas, epilogue chains and summation order, so its logits are the production kernel's bit
// for bit (gpu_variants_test). Written to be promoted into the production template once the
// H200 confirms the bits and the time; it has not run on a GPU yet (no machine was lent the
// session it was written).
//
// Why (docs/results/cuda-bench.md, 2026-12-05: ncu beside DeepGEMM at 64 x 32K next_n 2, and
// both kernels' SASS): both issue-bound at ~0.55 instructions per scheduler cycle; ours issues
// ~325 warp instructions per consumer warp and page against DeepGEMM's ~274. The arithmetic is
// the same (64 FMNMX + 64 FFMA per row pair and warp); the difference is bookkeeping. In the
// production kernel's main loop, per page: a schedule cursor step and a request-change check
// (~20 instructions), a pass loop with its q-reload check (~10), per row a length and row check
// around the epilogue (BSSY / BSYNC, ~8), 4 shuffles + 4 adds per row and a select + predicated
// store by half the lanes, with the store address rebuilt from the thread index (S2R and shifts:
// rematerialised for lack of registers). DeepGEMM stores from every lane unconditionally.
//
// What changes:
// - The loop walks the block's tiles one request's run at a time: q, the lane's row lengths and
//   logit addresses once per run; per page only the wait, the wgmmas, the epilogue and the
//   store at a running position. A request with more rows than a pass holds is scored one pass
//   per run, the producer filling the run's pages once per pass (ProduceRunPages), instead of
//   every pass per page with q reloaded between passes (such requests are rare: the host sizes
//   the pass to the rows-per-request hint, at most 4).
// - The epilogue's 64-head sums of a row pair (4 values a lane group) are reduce-scattered
//   (Fp8ReduceScatter2: 3 shuffles and 3 adds instead of 8 and 8), leaving each lane one logit
//   (row c >> 1, key c & 1) to store: one unpredicated-by-lane store per lane and pair, the key
//   scale read once per page. With one row a pass lanes c and c ^ 2 store the same value to the
//   same address.
// - The warp index goes through a lane-0 shuffle (CUTLASS's canonical_warp_idx_sync): the
//   compiler then knows the consumer's branch is warp-uniform and keeps the loop's state and the
//   wgmma descriptors on the uniform datapath (UIADD3 / ULEA / USEL, as DeepGEMM's loop), where
//   the production kernel rebuilds them per page in vector registers and moves them over
//   (R2UR x 12, IMAD, VIADD). It also frees registers: 94 / 124 / 126 / 128 at next_n 1-4, no
//   spills (production: 96 / 128 / 128 / 128, 24 bytes spilled at next_n 4).
// - kFp8RunsN2FourBlocks: two rows a pass at 4 blocks per SM (16 consumer warps, DeepGEMM's
//   count) with the weights read from shared memory per page: 96 registers, no spills (the
//   production loop spilled there: bench variant kFp8N2SmemWeights4 was slower).
// - Static SASS (bench/cuda/sass_static.py on the cubin; not run): the page loop at next_n 2
//   is ~200 instructions a consumer warp (wait to closing branch with its preamble; 206 + 8 at
//   4 blocks) against the production kernel's ~309 on its common path, ~130 against ~250 at
//   next_n 1. Whole kernels: 1184 / 1280 / 1432 / 1536 instructions at next_n 1-4 against
//   1432 / 1720 / 1928 / 2080.
// - Tried on the same listing and not kept: the loop's bounds (not the warp index) through a
//   shuffle: the same loop instruction for instruction; a switch case per ring slot (constant
//   descriptors): 60-380 bytes of spills at every next_n.

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp8.cuh"

namespace decode_indexer::kernels::cuda {
namespace fp8_runs {

using fp8_logits::FillQTile;
using fp8_logits::Fp8HeadPartials;
using fp8_logits::IssuePage;
using fp8_logits::kConsumerThreads;
using fp8_logits::kConsumerWarps;
using fp8_logits::kHeads;
using fp8_logits::kQBarrier;
using fp8_logits::kQRowBytes;
using fp8_logits::kScales;
using fp8_logits::kThreads;
using fp8_logits::kValues;
using fp8_logits::LoadWeights;
using fp8_logits::QRows;
using fp8_logits::SmemBytes;
using fp8_logits::Sw128DescLo;

// The production kernel's Fp8HeadSums' second half as a reduce-scatter: the 4 lanes of a group hold
// partials p[r][k] (row r of the pair, key g + 8 k); lane c ends with the full sum of row c >> 1,
// key c & 1, in the bits the production kernel's Fp8HeadSums gives (its lane c: (P_c + P_c^1) +
// (P_c^2 + P_c^3), the same two additions here up to the order of their operands, which IEEE
// addition ignores). 3 shuffles for the pair's 4 sums instead of 8, and every lane stores one.
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

// The producer (the producer warp's lane 0): fills the ring through the TMA unit in the order
// the consumers score: the block's tiles one request's run at a time, each run once per pass
// (RunPasses; more than one only for a request with more rows than a pass holds, whose keys
// are then read again per pass rather than held while q is reloaded). Each page through
// FillSlotTma; the next page's page-table entry is read one page early so its latency
// overlaps the wait for a free slot. Keys at or past a tile's valid count are copied as they
// are (stale cache bytes): every key's logit depends only on its own codes and scale, and no
// logit at or past a row's length is stored.
template <int kRows, int kStages, bool kOwnSchedule>
__device__ __forceinline__ void ProduceRunPages(const PagedLogitsArgs& p,
                                                const BlockSchedule<kOwnSchedule>& sched,
                                                const PageRing<kStages>& ring,
                                                const void* values_map) {
  const uint8_t* __restrict__ cache = p.cache.base;
  PrefetchTensorMap(values_map);
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
    FillSlotTma(ring, i, cache, page, values_map);
  }
}

template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages, bool kWeightRegs>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsFp8RunsKernel(const PagedLogitsArgs p,
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
  // logits stored; the slot released once the wgmmas have read it.
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
    // barrier counts kConsumerThreads).
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
    if (kRows <= 2) release();
    store_group(acc, 0);
    if constexpr (kRows > 2) {
      WgmmaFence();
      // Rows 2-3 (at kRows == 3, row 3's columns are never stored).
      IssuePage<128>(acc, desc_kv, desc_q + uint32_t(2 * kQRowBytes / 16));
      WgmmaCommit();
      WgmmaWait<0>();
      release();
      store_group(acc, 1);
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

template <int kRows, bool kOwnSchedule, int kMinBlocks = PipeFp8MinBlocks(kRows),
          int kStages = kPipeFp8Stages, bool kWeightRegs = kPipeFp8WeightRegs>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<CUtensorMap> map = PageValuesTensorMap(args.cache);
  if (!map.ok()) return map.status();
  return LaunchPersistentGrid(
      per_device, "paged mqa logits (fp8 runs)",
      PagedMqaLogitsFp8RunsKernel<kRows, kOwnSchedule, kMinBlocks, kStages, kWeightRegs>, kThreads,
      SmemBytes<kRows, kOwnSchedule, kStages>(), num_sms, stream, args, *map);
}

// kFp8RunsN2FourBlocks: two rows a pass at 4 blocks per SM (16 consumer warps, as DeepGEMM's
// one block of four math warpgroups), every row's weights read from shared memory per page
// (96 registers: no spills once the loop's state is on the uniform datapath; the production
// kernel's loop spilled there, bench variant kFp8N2SmemWeights4); 4 ring slots.
template <bool kOwnSchedule>
absl::Status LaunchRows(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                        cudaStream_t stream) {
  switch (DenseRowsPerPass(args.rows)) {
    case 1:
      return LaunchTyped<1, kOwnSchedule>(args, num_sms, stream);
    case 2:
      if (v == MqaVariant::kFp8RunsN2FourBlocks) {
        return LaunchTyped<2, kOwnSchedule, 4, 4, false>(args, num_sms, stream);
      }
      return LaunchTyped<2, kOwnSchedule>(args, num_sms, stream);
    case 3:
      return LaunchTyped<3, kOwnSchedule>(args, num_sms, stream);
    default:
      return LaunchTyped<4, kOwnSchedule>(args, num_sms, stream);
  }
}

}  // namespace fp8_runs

absl::Status LaunchPagedMqaLogitsFp8Runs(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                         cudaStream_t stream) {
  return DenseComputesOwnSchedule(args.rows)
             ? fp8_runs::LaunchRows<true>(v, args, num_sms, stream)
             : fp8_runs::LaunchRows<false>(v, args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
