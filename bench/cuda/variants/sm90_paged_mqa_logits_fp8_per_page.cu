// Comparison variant kFp8PerPage (mqa_variants.h): the fp8 logits kernel as it was in
// production until the run-ordered loop replaced it (kernels/cuda/sm90_paged_mqa_logits_fp8.cuh).
// Same wgmmas, epilogue chains and summation order, so its logits are the production kernel's bit
// for bit; its bookkeeping is the simpler one (per page: a schedule cursor step and a request
// check, a pass loop with its q-reload check, each row's epilogue behind its own length check,
// the 64-head sum completed in every lane and stored by two of four), which makes it the
// production kernel's differential check in gpu_variants_test
// (Fp8PerPageVariantEqualsTheProductionKernel: several passes, runs cut by the block's range,
// thin and uneven requests) and its "before" in the bench. Measured beside it and DeepGEMM in
// docs/results/cuda-bench.md (session 16's run-ordered loop section).

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp8.cuh"

namespace decode_indexer::kernels::cuda {
namespace fp8_per_page {

using fp8_logits::FillQTile;
using fp8_logits::Fp8HeadSums;
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

// kRows: rows of a request scored per pass over a page (RowsPerPass): one m64n128 instruction
// per k-step for each two of them (m64n64 for one). kMinBlocks, kStages, kWeightRegs: the
// production choices are PipeFp8MinBlocks, kPipeFp8Stages, kPipeFp8WeightRegs (sm90_heuristics.h).
// kWeightRegs: this thread's weights of the pass's first one or two rows in registers (loaded
// once per pass) instead of four 16-byte shared-memory loads per row and page.
template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages, bool kWeightRegs>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsFp8PerPageKernel(const PagedLogitsArgs p,
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
  const int warp = tid >> 5;
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
    if (lane == 0) ProducePagesTma(p, sched, ring, &values_map);
    return;
  }

  // ---- Consumer warpgroup. ----
  const int g = lane >> 2;
  const int c = lane & 3;
  const int key0 = warp * 16 + g;  // this thread's keys key0 and key0 + 8 of the page
  const int64_t stride = p.logits_stride;
  // Per request pass (load_q): this thread's weights at one row per pass (LoadWeights; more rows
  // read theirs from shared memory per page), each row's length, and where the pass's first
  // row's logits of this thread's key (key0 + 8 c; lanes c >= 2 store nothing) go.
  // With kWeightRegs the first one or two rows of a pass (rows 2-3 read shared memory).
  constexpr int kRegRows = kWeightRegs ? (kRows < 2 ? kRows : 2) : 0;
  float w_reg[kRegRows > 0 ? 16 * kRegRows : 1];
#pragma unroll
  for (float& w : w_reg) w = 0.f;
  int len_r[kRows];
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) len_r[rr] = 0;
  float* out_pass = p.logits;
  int loaded_request = -1, loaded_pass = -1;
  // q codes (as they are: e4m3 is the MMA's type), weights and row lengths of pass `pass` of
  // request b. Rows past the request's last are zero (their columns are computed, never stored).
  auto load_q = [&](int b, int pass, int first_row, int nrows) {
    NamedBarrierSync(kQBarrier, kConsumerThreads);  // every warp's wgmmas on the old q are done
    loaded_request = b;
    loaded_pass = pass;
    FillQTile<kRows>(p, q_tile, w_smem, tid, pass, first_row, nrows);
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      const int rin = pass * kRows + rr;
      len_r[rr] = rin < nrows ? __ldg(&p.rows.row_length[first_row + rin]) : 0;
    }
    out_pass = p.logits + int64_t{first_row + pass * kRows} * stride + key0 + 8 * c;
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
  ScheduleCursor<kOwnSchedule> cur;
  cur.Seek(prefix, sched.num_requests, sched.begin);
  // The current request's schedule entries, read when the cursor enters it.
  int b = -1, tile0 = 0, first_row = 0, nrows = 0, passes = 0;
  int st = 0;
  uint32_t phase = 0;
  for (int i = 0; i < num_tiles; ++i) {
    if (cur.request != b) {  // block-uniform
      b = cur.request;
      tile0 = Ld<kOwnSchedule>(&prefix[b]);
      first_row = Ld<kOwnSchedule>(&req_first_row[b]);
      nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
      passes = (nrows + kRows - 1) / kRows;
    }
    const int base_pos = (cur.tile - tile0) * kMqaTileKeys;
    if (b != loaded_request || loaded_pass != 0) load_q(b, 0, first_row, nrows);

    // The TMA unit wrote the slot through the async proxy, which the wgmmas read it through:
    // the barrier's phase is all the ordering they need (no proxy fence).
    MbarWait(&full[st], phase);
    const uint32_t desc_kv = desc_slot0 + uint32_t(st * (kValues / 16));
    const float* ksc = reinterpret_cast<const float*>(stage_scales + st * kScales);
    const float ks0 = ksc[key0];
    const float ks1 = ksc[key0 + 8];
    const float ks = c == 0 ? ks0 : ks1;  // the scale of the key this lane stores (c < 2)

    // Row rr of the pass: keys key0, key0 + 8 against heads 8 j + 2 c + e (acc[32 rr ...], the
    // m64nN accumulator layout), relu * w, the group's 4 lanes complete the 64-head sum; lane
    // c < 2 stores key key0 + 8 c.
    auto epilogue = [&](const float* acc, int pass, int rr) {
      if (pass * kRows + rr >= nrows) return;
      float s0, s1;
      if (rr < kRegRows) {  // rr is a constant at every call
        Fp8HeadSums(acc, *reinterpret_cast<const float(*)[16]>(w_reg + 16 * rr), s0, s1);
      } else {
        float w[16];
        LoadWeights(w_smem + rr * kHeads, c, w);
        Fp8HeadSums(acc, w, s0, s1);
      }
      const int pos = base_pos + key0 + 8 * c;
      if (c < 2 && pos < len_r[rr]) out_pass[rr * stride + base_pos] = (c == 0 ? s0 : s1) * ks;
    };
    // The slot's codes and scales are no longer read: every consumer thread arrives (the empty
    // barrier counts kConsumerThreads).
    auto release = [&]() { MbarArrive(&empty[st]); };

    // Rows two at a time (at most 64 accumulators live: 3-4 rows' 96-128 spilled at 2 blocks
    // per SM). Every group is issued even past the request's last row (nothing is stored then):
    // a branch around a wgmma makes ptxas serialize every wgmma in the kernel (C7520).
    for (int pass = 0; pass < passes; ++pass) {
      if (pass != loaded_pass) load_q(b, pass, first_row, nrows);  // warpgroup-uniform
      const bool last_pass = pass + 1 == passes;
      // Rows 0-1 in one m64n128k32 per k-step (m64n64 for one row per pass), then rows 2-3.
      float acc[64];
      constexpr int kFirst = kRows < 2 ? kRows : 2;
      WgmmaFence();
      IssuePage<64 * kFirst>(acc, desc_kv, desc_q);
      WgmmaCommit();
      WgmmaWait<0>();
      epilogue(acc, pass, 0);
      if constexpr (kRows >= 2) epilogue(acc + 32, pass, 1);
      if (kRows <= 2 && last_pass) release();  // after the stores: the production kernel's why
      if constexpr (kRows > 2) {
        WgmmaFence();
        // Rows 2-3 (at kRows == 3, row 3's columns are never stored).
        IssuePage<128>(acc, desc_kv, desc_q + uint32_t(2 * kQRowBytes / 16));
        WgmmaCommit();
        WgmmaWait<0>();
        epilogue(acc, pass, 2);
        if constexpr (kRows == 4) epilogue(acc + 32, pass, 3);
        if (last_pass) release();
      }
    }
    if (++st == kStages) {
      st = 0;
      phase ^= 1;
    }
    if (i + 1 < num_tiles) cur.Next(prefix);
  }
}

template <int kRows, bool kOwnSchedule>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  constexpr int kMinBlocks = PipeFp8MinBlocks(kRows), kStages = kPipeFp8Stages;
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<CUtensorMap> map = PageValuesTensorMap(args.cache);
  if (!map.ok()) return map.status();
  return LaunchPersistentGrid(
      per_device, "paged mqa logits (fp8 per page)",
      PagedMqaLogitsFp8PerPageKernel<kRows, kOwnSchedule, kMinBlocks, kStages, kPipeFp8WeightRegs>,
      kThreads, SmemBytes<kRows, kOwnSchedule, kStages>(), num_sms, stream, args, *map);
}

template <bool kOwnSchedule>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    return LaunchTyped<decltype(rows)::value, kOwnSchedule>(args, num_sms, stream);
  });
}

}  // namespace fp8_per_page

absl::Status LaunchPagedMqaLogitsFp8PerPage(const PagedLogitsArgs& args, int num_sms,
                                            cudaStream_t stream) {
  return DenseComputesOwnSchedule(args.rows)
             ? fp8_per_page::LaunchRows<true>(args, num_sms, stream)
             : fp8_per_page::LaunchRows<false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
