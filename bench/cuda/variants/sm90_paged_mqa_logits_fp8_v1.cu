// Comparison variant kFp8V1 (mqa_variants.h): the fp8 tensor-core dense kernel as it was before
// the TMA producer and the four-chain epilogue (kernels/cuda/sm90_paged_mqa_logits_fp8.cu): a
// producer warp's cp.async copies (ProducePages), KeysMHeadSums' two chains, weights read one
// float at a time at several rows per pass. Same wgmmas, so its logits differ from the
// production kernel's only by the epilogue's fp32 summation order (gpu_variants_test checks).
//
// The production kernel's notes as they stood:
//
// Paged MQA logits for FP8 caches with 64 heads on the fp8 tensor cores, keys as M
// (then MqaMath::kWgmmaKeysMPipelinedFp8, the product's default dense kernel, sm90_heuristics.h):
// the exact kernel's producer warp and page ring (ProducePages / PageRing, sm90_mqa_pipeline.cuh,
// shared with sm90_paged_mqa_logits_pipelined.cu) with the e4m3 -> f16 widening gone.
//
// Why: v6 spends ~100 of its ~300 instructions per consumer warp and page widening e4m3 to f16
// (ldmatrix + cvt / bit moves), and f16 wgmma has half fp8's rate, so next_n >= 2 is compute
// bound (docs/notes/cuda.md). Here the consumer warpgroup's wgmmas read both operands straight
// from shared memory:
// - A = the ring slot: 64 keys x 128 e4m3 dims, K-major, 128-byte rows in the 128B swizzle the
//   producer already writes (CopyPageToStage), which is wgmma's SW128 layout because every slot
//   is 1024-byte aligned. k-step ks (32 dims) starts ks * 32 bytes into the rows.
// - B = q in e4m3: row rr's 64 heads at rows 64 rr .. 64 rr + 63 of a [64 x rows][128 B] SW128
//   K-major tile, so one m64nNk32 instruction with N = 64 (one row) or 128 (a row pair) covers
//   two of a pass's rows: every key is read from DRAM once per request and from shared memory
//   once per k-step and row pair for next_n 1-4. (One m64n64 chain per row instead, once kept
//   as kWgmmaKeysMPipelinedFp8PerRow, gave the same bits and was slower from next_n 2 on: 64 x
//   32K next_n 2 136.6 against 117.2 us, docs/results/raw/steps_and_dg_1428.log.)
// - 4 wgmma per page and row pair, then v6's epilogue (relu * weight over this thread's heads,
//   the 4 lanes of a group complete the 64-head sum) times the key scale. The slot goes back to
//   the producer once the last pass's wgmmas have completed (they read it until then).
//
// Numerics: NOT exact. Each wgmma k=32 slice aligns its products to the largest exponent and
// keeps ~13 fraction bits (docs/spec.md section 6 gives the bound, reference/ computes it). The
// order is fixed: the same 4 instructions per row in the same order, the same epilogue, no
// dependence on the schedule, the grid or the batch, so the logits are bit-identical across runs
// and batch compositions (gpu_test checks).
#include <algorithm>

#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_mqa_pipeline.cuh"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_wgmma_fp8.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

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
         QRows(kRows) * kHeads * 4 + 16 + PageRing<kStages>::kBarrierBytes +
         (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

// The 4 k-steps of one page against q rows starting at `q` (kN / 64 of them): k-step ks reads
// 32 dims, ks * 32 bytes into both operands' 128-byte swizzled rows.
template <int kN>
__device__ __forceinline__ void IssuePage(float* acc, const uint8_t* kv, const uint8_t* q) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    WgmmaM64NK32E4M3SS<kN>(acc, SmemDescSw128(kv + ks * 32), SmemDescSw128(q + ks * 32), ks);
  }
}

// kRows: rows of a request scored per pass over a page (RowsPerPass): one m64n128 instruction
// per k-step for each two of them (m64n64 for one). kMinBlocks, kStages: V1MinBlocks,
// V1Stages below.
template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsFp8V1Kernel(const PagedLogitsArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* stage_values = smem;                // [stages][64 keys][128 B], SW128
  uint8_t* q_tile = smem + kStages * kValues;  // [rows][64 heads][128 B], SW128
  constexpr int kQRows = QRows(kRows);
  uint8_t* stage_scales = q_tile + kQRows * kQRowBytes;                        // [stages][64] fp32
  float* w_smem = reinterpret_cast<float*>(stage_scales + kStages * kScales);  // [q rows][64]
  int32_t* len_smem = reinterpret_cast<int32_t*>(w_smem + kQRows * kHeads);    // [4]
  uint64_t* full = reinterpret_cast<uint64_t*>(len_smem + 4);                  // 16-byte aligned
  const PageRing<kStages> ring{stage_values, stage_scales, full, full + kStages};
  int32_t* own = reinterpret_cast<int32_t*>(full + 2 * kStages);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  if (tid == 0) ring.InitBarriers();
  BlockSchedule<kOwnSchedule> sched;
  sched.template SetUp<kThreads>(p, own, tid);
  if (sched.num_tiles == 0) return;
  const int num_tiles = sched.num_tiles;
  const int32_t* prefix = sched.prefix;
  const int32_t* req_first_row = sched.first_row;
  const int32_t* req_num_rows = sched.num_rows;
  uint64_t* empty = ring.empty;

  if (warp == kConsumerWarps) {
    ProducePages(p, sched, ring, lane);
    return;
  }

  // ---- Consumer warpgroup. ----
  const int g = lane >> 2;
  const int c = lane & 3;
  int loaded_request = -1, loaded_pass = -1;
  float w_reg[16];  // one row per pass: this thread's 16 head weights (heads 8 j + 2 c + e)
#pragma unroll
  for (int k = 0; k < 16; ++k) w_reg[k] = 0.f;
  // q codes (as they are: e4m3 is the MMA's type), weights and row lengths of pass `pass` of
  // request b. Rows past the request's last are zero (their columns are computed, never stored).
  auto load_q = [&](int b, int pass, int first_row, int nrows) {
    NamedBarrierSync(kQBarrier, kConsumerThreads);  // every warp's wgmmas on the old q are done
    loaded_request = b;
    loaded_pass = pass;
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
              reinterpret_cast<const uint4*>(p.q.codes + (row * kHeads + head) * kMqaHeadDim) +
              oct);
          if (oct == 0) wv[u] = __ldg(&p.q.weights[row * kHeads + head]);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = it0 + u * kConsumerThreads + tid;
        const int n = it / 8, oct = it % 8;  // B row n = 64 rr + head
        *reinterpret_cast<uint4*>(q_tile + n * 128 + ((oct ^ (n & 7)) << 4)) = codes[u];
        if (oct == 0) w_smem[n] = wv[u];
      }
    }
    if (tid < kRows) {
      const int rin = pass * kRows + tid;
      len_smem[tid] = rin < nrows ? __ldg(&p.rows.row_length[first_row + rin]) : 0;
    }
    FenceProxyAsyncShared();  // st.shared before the wgmmas' (async proxy) reads of q
    NamedBarrierSync(kQBarrier, kConsumerThreads);
    if constexpr (kRows == 1) {
#pragma unroll
      for (int k = 0; k < 16; ++k) w_reg[k] = w_smem[8 * (k >> 1) + 2 * c + (k & 1)];
    }
  };

  ScheduleCursor<kOwnSchedule> cur;
  cur.Seek(prefix, sched.num_requests, sched.begin);
  const int key0 = warp * 16 + g;  // this thread's keys key0 and key0 + 8 of the page
  for (int i = 0; i < num_tiles; ++i) {
    const int b = cur.request;
    const int base_pos = (cur.tile - Ld<kOwnSchedule>(&prefix[b])) * kMqaTileKeys;
    const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
    const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
    const int passes = (nrows + kRows - 1) / kRows;
    if (b != loaded_request || loaded_pass != 0) load_q(b, 0, first_row, nrows);

    const int st = i % kStages;
    MbarWait(&full[st], (i / kStages) & 1);
    // cp.async writes the slot through the generic proxy and the wgmmas read it through the
    // async proxy: order the two (the mbarrier's acquire made the bytes visible to this thread).
    FenceProxyAsyncShared();
    const uint8_t* kv = stage_values + st * kValues;
    const float* ksc = reinterpret_cast<const float*>(stage_scales + st * kScales);
    const float ks0 = ksc[key0];
    const float ks1 = ksc[key0 + 8];

    // Row rr of the pass: keys key0, key0 + 8 against heads 8 j + 2 c + e (acc[32 rr ...], the
    // m64nN accumulator layout), relu * w, the group's 4 lanes complete the 64-head sum.
    auto epilogue = [&](const float* acc, int pass, int rr) {
      if (pass * kRows + rr >= nrows) return;
      const float* w = w_smem + rr * kHeads;
      float s0, s1;
      KeysMHeadSums(
          *reinterpret_cast<const float(*)[32]>(acc),
          [&](int j, int e) { return kRows == 1 ? w_reg[2 * j + e] : w[8 * j + 2 * c + e]; }, s0,
          s1);
      if (c < 2) {
        const int pos = base_pos + key0 + 8 * c;
        if (pos < len_smem[rr]) {
          const int64_t row = first_row + pass * kRows + rr;
          p.logits[row * p.logits_stride + pos] = c == 0 ? s0 * ks0 : s1 * ks1;
        }
      }
    };
    auto release = [&]() {  // the slot's codes and scales are no longer read
      __syncwarp();
      if (lane == 0) MbarArrive(&empty[st]);
    };

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
      IssuePage<64 * kFirst>(acc, kv, q_tile);
      WgmmaCommit();
      WgmmaWait<0>();
      epilogue(acc, pass, 0);
      if constexpr (kRows >= 2) epilogue(acc + 32, pass, 1);
      if (kRows <= 2 && last_pass) release();  // after the stores: the production kernel's why
      if constexpr (kRows > 2) {
        WgmmaFence();
        IssuePage<128>(acc, kv, q_tile + 2 * kQRowBytes);  // row 3 not stored at kRows == 3
        WgmmaCommit();
        WgmmaWait<0>();
        epilogue(acc, pass, 2);
        if constexpr (kRows == 4) epilogue(acc + 32, pass, 3);
        if (last_pass) release();
      }
    }
    if (i + 1 < num_tiles) cur.Next(prefix);
  }
}

// The shape choices sm90_heuristics.h made for this kernel when it was the production one,
// frozen here so that the variant stays the kernel as it stood (the heuristics now choose for
// the new kernel): 4 slots, or 3 at two rows per pass; 4 blocks per SM up to two rows, else 3.
constexpr int V1Stages(int rows_per_pass) { return rows_per_pass == 2 ? 3 : 4; }
constexpr int V1MinBlocks(int rows_per_pass) { return rows_per_pass <= 2 ? 4 : 3; }

template <int kRows, bool kOwnSchedule>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  static KernelDeviceSetup per_device[kMaxDevices];
  return LaunchPersistentGrid(
      per_device, "paged mqa logits (fp8 v1 variant)",
      PagedMqaLogitsFp8V1Kernel<kRows, kOwnSchedule, V1MinBlocks(kRows), V1Stages(kRows)>, kThreads,
      SmemBytes<kRows, kOwnSchedule, V1Stages(kRows)>(), num_sms, stream, args);
}

template <bool kOwnSchedule>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    return LaunchTyped<decltype(rows)::value, kOwnSchedule>(args, num_sms, stream);
  });
}

}  // namespace

absl::Status LaunchPagedMqaLogitsFp8V1(const PagedLogitsArgs& args, int num_sms,
                                       cudaStream_t stream) {
  return DenseComputesOwnSchedule(args.rows) ? LaunchRows<true>(args, num_sms, stream)
                                             : LaunchRows<false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
