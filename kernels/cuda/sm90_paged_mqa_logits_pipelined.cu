// Paged MQA logits for FP8 caches with 64 heads, keys as M (MqaMath::kWgmmaKeysMPipelined): the
// keys-as-M math of sm90_paged_mqa_logits_keys_m.cu, bit for bit, with the page loads moved to a
// producer warp.
//
// Why: the keys-M kernel is latency bound (docs/notes/cuda.md). Each of its blocks runs, per page,
// cp.async wait -> block barrier -> page-table load + 17 cp.async address computations per thread
// -> widen -> wgmma -> wait -> epilogue in series, so DRAM stays 35-45% busy. Here each block is
// one consumer warpgroup (warps 0-3) and one producer warp (warp 4):
// - The producer walks the block's tiles ahead of the consumer, loads each page-table entry one
//   tile early, and fills a kPipeStages-deep ring of page slots with cp.async (the same 128B
//   swizzle as keys-M); each lane's `cp.async.mbarrier.arrive` completes the slot's `full` phase
//   once its copies have landed. It waits only on the slot's `empty` barrier.
// - The consumer waits on `full`, widens the page into A fragments (ldmatrix + cvt / bit moves, as
//   keys-M), reads the page's key scales and releases the slot (`empty`, one arrival per warp)
//   before its wgmmas even start, so the producer refills it while the MMA and the epilogue run. No
//   block-wide barrier in the steady state: only a named barrier over the warpgroup when a new
//   request's q is written to shared memory.
// - With several rows per pass (next_n >= 2) two rows' wgmma groups are in flight at once, so the
//   second row's MMA overlaps the first row's epilogue.
// - Several such blocks per SM overlap each other's MMA, widening and epilogue phases.
//
// Numerics: every logit is computed by the same instructions on the same operands as in keys-M
// (same k-step grouping, the same permuted q layout, the same widening choice per rows-per-pass,
// the same epilogue order), so the logits are keys-M's bit for bit (gpu_test checks every entry).
// The order does not depend on the schedule, the grid or the batch.
#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_mqa_pipeline.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kHeads = 64;
constexpr int kConsumerThreads = 128;                  // one warpgroup: warps 0-3
constexpr int kConsumerWarps = kConsumerThreads / 32;  // the producer is warp 4
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kStages = kPipeStages;
constexpr int kValues = kMqaTileKeys * kMqaHeadDim;  // 8192: a page's e4m3 codes
constexpr int kScales = kMqaTileKeys * 4;            // 256: its fp32 scales
constexpr int kPageBytes = kValues + kScales;        // 8448
constexpr int kQBytes = kHeads * kMqaHeadDim * 2;    // one row's q in f16: 16 KB
constexpr int kHalfBytes = kHeads * 128;             // 64 dims of q: one swizzled tile
constexpr int kQBarrier = 1;                         // named barrier of the consumer warpgroup

template <int kRowsPerPass, bool kOwnSchedule>
constexpr int SmemBytes() {
  return kStages * kValues + kRowsPerPass * kQBytes + kStages * kScales +
         kRowsPerPass * kHeads * 4 + 16 + 2 * kStages * 8 + (kOwnSchedule ? kOwnScheduleBytes : 0) +
         1024;
}

static_assert(kHalfBytes == kKeysMQHalfBytes, "QOffset's q tile layout");

// keys-M's schedule walk (sm90_mqa_keys_m.cuh), under this file's name.
template <bool kShared>
using Cursor = ScheduleCursor<kShared>;

// kMinBlocks: blocks per SM the register cap is sized for; kPairRows: two rows' MMAs in flight
// (twice the accumulators) when a pass has several rows; kPagePairs (one row per pass only): two
// pages of a request per step, the second page's MMA running during the first page's epilogue
// (twice the A fragments and accumulators).
template <int kRowsPerPass, int kWiden, bool kOwnSchedule, int kMinBlocks, bool kPairRows,
          bool kPagePairs>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsPipelinedKernel(const PagedLogitsArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* stage_values = smem;                             // [stages][8192], swizzled
  uint8_t* q_tile = smem + kStages * kValues;               // [rows][2][64][128 B]
  uint8_t* stage_scales = q_tile + kRowsPerPass * kQBytes;  // [stages][64] fp32
  float* w_smem = reinterpret_cast<float*>(stage_scales + kStages * kScales);      // [rows][64]
  int32_t* len_smem = reinterpret_cast<int32_t*>(w_smem + kRowsPerPass * kHeads);  // [rows]
  uint64_t* full = reinterpret_cast<uint64_t*>(len_smem + 4);  // 16-byte aligned
  uint64_t* empty = full + kStages;
  int32_t* own = reinterpret_cast<int32_t*>(empty + kStages);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], 32);               // one cp.async arrival per producer lane
      MbarInit(&empty[s], kConsumerWarps);  // one arrival per consumer warp
    }
  }

  const int num_requests = p.rows.num_requests;
  const int32_t* prefix = p.schedule.tile_prefix;
  const int32_t* req_first_row = p.schedule.request_first_row;
  const int32_t* req_num_rows = p.schedule.request_num_rows;
  const int32_t* req_max_len = p.schedule.request_max_len;
  if constexpr (kOwnSchedule) {
    // The schedule kernel's work, in shared memory (as keys-M fused; min / count / max are
    // order-free, so the numbers are the schedule kernel's).
    BuildOwnSchedule<kThreads>(p, own, tid, num_requests, prefix, req_first_row, req_num_rows,
                               req_max_len);
  }
  __syncthreads();  // barriers initialised (and the schedule built) for everyone
  const int total_tiles = Ld<kOwnSchedule>(&prefix[num_requests]);
  const int begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
  if (begin >= end) return;
  const int num_tiles = end - begin;

  if (warp == kConsumerWarps) {
    // ---- Producer warp: page slots, kStages ahead of the consumer. ----
    const uint8_t* __restrict__ cache = p.cache.base;
    Cursor<kOwnSchedule> load;
    load.Seek(prefix, num_requests, begin);
    // The page-table entry of the tile after the one being issued is loaded one tile early, so its
    // latency overlaps the wait on the slot.
    auto locate = [&](int& page, int& valid) {
      const int b = load.request;
      const int j = load.tile - Ld<kOwnSchedule>(&prefix[b]);
      page = __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
      valid = min(kMqaTileKeys, Ld<kOwnSchedule>(&req_max_len[b]) - j * kMqaTileKeys);
    };
    int next_page, next_valid;
    locate(next_page, next_valid);
    for (int i = 0; i < num_tiles; ++i) {
      const int page = next_page, valid = next_valid;
      if (i + 1 < num_tiles) {
        load.Next(prefix);
        locate(next_page, next_valid);
      }
      const int st = i % kStages;
      if (i >= kStages) MbarWait(&empty[st], ((i / kStages) + 1) & 1);
      const uint8_t* src = cache + int64_t{page} * kPageBytes;
      uint8_t* dv = stage_values + st * kValues;
      uint8_t* ds = stage_scales + st * kScales;
      CopyPageToStage(src, dv, ds, valid, lane);
      CpAsyncMbarArrive(&full[st]);
    }
    CpAsyncWait<0>();
    return;
  }

  // ---- Consumer warpgroup. ----
  const int g = lane >> 2;
  const int c = lane & 3;
  constexpr bool kSplit = kWiden != kWidenCvt;
  int loaded_request = -1, loaded_pass = -1;
  // One row per pass: this thread's 16 head weights (heads 8 j + 2 c + e) in registers, read once
  // per q load instead of 16 shared loads per page (the same values, so the same sums).
  float w_reg[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) w_reg[k] = 0.f;
  // q (and w, row lengths) of pass `pass` of request b into shared memory. The named barrier first:
  // every warp's wgmmas on the previous q have completed (each waited on its own).
  auto load_q = [&](int b, int pass, int first_row, int nrows) {
    NamedBarrierSync(kQBarrier, kConsumerThreads);
    loaded_request = b;
    loaded_pass = pass;
    // 16 codes per item (one 16-byte load), four items per thread in flight at once.
    constexpr int kItems = kRowsPerPass * kHeads * 8;
#pragma unroll
    for (int it0 = 0; it0 < kItems; it0 += 4 * kConsumerThreads) {
      uint4 codes[4];
      float wv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = it0 + u * kConsumerThreads + tid;
        const int rr = it / (kHeads * 8), head = (it / 8) % kHeads, oct = it % 8;
        const int rin = pass * kRowsPerPass + rr;
        codes[u] = make_uint4(0u, 0u, 0u, 0u);
        wv[u] = 0.f;
        if (it < kItems && rin < nrows) {
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
        const int rr = it / (kHeads * 8), head = (it / 8) % kHeads, oct = it % 8;
        if (it >= kItems || pass * kRowsPerPass + rr >= nrows) continue;
        uint8_t* qt = q_tile + rr * kQBytes;
        StoreQQuad<kWiden>(qt, head, 4 * oct + 0, codes[u].x);
        StoreQQuad<kWiden>(qt, head, 4 * oct + 1, codes[u].y);
        StoreQQuad<kWiden>(qt, head, 4 * oct + 2, codes[u].z);
        StoreQQuad<kWiden>(qt, head, 4 * oct + 3, codes[u].w);
        if (oct == 0) w_smem[rr * kHeads + head] = wv[u];
      }
    }
    if (tid < kRowsPerPass) {
      const int rin = pass * kRowsPerPass + tid;
      len_smem[tid] = rin < nrows ? __ldg(&p.rows.row_length[first_row + rin]) : 0;
    }
    FenceProxyAsyncShared();  // st.shared before the wgmmas' (async proxy) reads of q
    NamedBarrierSync(kQBarrier, kConsumerThreads);
    if constexpr (kRowsPerPass == 1) {
#pragma unroll
      for (int k = 0; k < 16; ++k) w_reg[k] = w_smem[8 * (k >> 1) + 2 * c + (k & 1)];
    }
  };

  Cursor<kOwnSchedule> cur;
  cur.Seek(prefix, num_requests, begin);

  if constexpr (kPagePairs) {
    static_assert(kRowsPerPass == 1, "page pairs: one row per pass");
    // The same structure as the row pairs below (two MMA groups, both always issued, waits
    // unconditional: ptxas serializes every wgmma otherwise): the second page is the next tile of
    // the same request (same q); when there is none, the first page's fragments are widened twice
    // and the second result is dropped.
    auto epilogue = [&](const float(&acc)[32], int64_t row, int base, float k0, float k1) {
      float s0, s1;
      KeysMHeadSums(
          acc, [&](int j, int e) { return w_reg[2 * j + e]; }, s0, s1);
      if (c < 2) {
        const int pos = base + warp * 16 + g + 8 * c;
        if (pos < len_smem[0]) p.logits[row * p.logits_stride + pos] = c == 0 ? s0 * k0 : s1 * k1;
      }
    };
    int i = 0;
    while (i < num_tiles) {
      const int b = cur.request;
      const int base_pos = (cur.tile - Ld<kOwnSchedule>(&prefix[b])) * kMqaTileKeys;
      const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
      const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
      const bool second = i + 1 < num_tiles && cur.tile + 1 < cur.request_end;
      if (b != loaded_request || loaded_pass != 0) load_q(b, 0, first_row, nrows);
      const int st0 = i % kStages, st1 = (i + 1) % kStages;
      MbarWait(&full[st0], (i / kStages) & 1);
      if (second) MbarWait(&full[st1], ((i + 1) / kStages) & 1);
      const int sb = second ? st1 : st0;
      const float* ksc0 = reinterpret_cast<const float*>(stage_scales + st0 * kScales);
      const float* ksc1 = reinterpret_cast<const float*>(stage_scales + sb * kScales);
      uint32_t a0[8][4], a1[8][4];
      WidenPage<kWiden>(stage_values + st0 * kValues, warp, lane, a0);
      WidenPage<kWiden>(stage_values + sb * kValues, warp, lane, a1);
      const int key0 = warp * 16 + g;
      const float k00 = kSplit ? 256.f * ksc0[key0] : ksc0[key0];
      const float k01 = kSplit ? 256.f * ksc0[key0 + 8] : ksc0[key0 + 8];
      const float k10 = kSplit ? 256.f * ksc1[key0] : ksc1[key0];
      const float k11 = kSplit ? 256.f * ksc1[key0 + 8] : ksc1[key0 + 8];
      __syncwarp();
      if (lane == 0) {
        MbarArrive(&empty[st0]);
        if (second) MbarArrive(&empty[st1]);
      }
      for (int pass = 0; pass < nrows; ++pass) {
        if (pass != loaded_pass) load_q(b, pass, first_row, nrows);  // warpgroup-uniform
        float acc0[32], acc1[32];
        WgmmaFence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          WgmmaM64N64K16F16(acc0, a0[ks],
                            SmemDescSw128(q_tile + (ks >> 2) * kHalfBytes + (ks & 3) * 32), ks);
        }
        WgmmaCommit();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          WgmmaM64N64K16F16(acc1, a1[ks],
                            SmemDescSw128(q_tile + (ks >> 2) * kHalfBytes + (ks & 3) * 32), ks);
        }
        WgmmaCommit();
        WgmmaWait<1>();
        epilogue(acc0, int64_t{first_row} + pass, base_pos, k00, k01);
        WgmmaWait<0>();
        if (second) epilogue(acc1, int64_t{first_row} + pass, base_pos + kMqaTileKeys, k10, k11);
      }
      for (int adv = second ? 2 : 1; adv > 0; --adv) {
        if (i + 1 < num_tiles) cur.Next(prefix);
        ++i;
      }
    }
  } else {
    for (int i = 0; i < num_tiles; ++i) {
      const int b = cur.request;
      const int base_pos = (cur.tile - Ld<kOwnSchedule>(&prefix[b])) * kMqaTileKeys;
      const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
      const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
      const int passes = (nrows + kRowsPerPass - 1) / kRowsPerPass;
      // A new request's first q while its page may still be in flight.
      if (b != loaded_request || loaded_pass != 0) load_q(b, 0, first_row, nrows);

      const int st = i % kStages;
      MbarWait(&full[st], (i / kStages) & 1);
      const uint8_t* kv = stage_values + st * kValues;
      const float* ksc = reinterpret_cast<const float*>(stage_scales + st * kScales);

      uint32_t a[8][4];
      WidenPage<kWiden>(kv, warp, lane, a);
      const int key0 = warp * 16 + g;
      // Bit moves: the sums are 2^-8 times the true ones (exactly); 256 * ks is exact too.
      const float ks0 = kSplit ? 256.f * ksc[key0] : ksc[key0];
      const float ks1 = kSplit ? 256.f * ksc[key0 + 8] : ksc[key0 + 8];
      // The slot is no longer read: hand it back to the producer before the MMA.
      __syncwarp();
      if (lane == 0) MbarArrive(&empty[st]);

      // Keys key0 and key0 + 8 against heads 8 j + 2 c + e: relu * w, then the 4 lanes of the group
      // complete the 64-head sum (keys-M's order); stores below the row's length.
      auto epilogue = [&](const float(&acc)[32], int pass, int rr) {
        const float* w = w_smem + rr * kHeads;
        float s0, s1;
        KeysMHeadSums(
            acc,
            [&](int j, int e) {
              return kRowsPerPass == 1 ? w_reg[2 * j + e] : w[8 * j + 2 * c + e];
            },
            s0, s1);
        if (c < 2) {
          const int key = key0 + 8 * c;
          const int pos = base_pos + key;
          if (pos < len_smem[rr]) {
            const int64_t row = first_row + pass * kRowsPerPass + rr;
            p.logits[row * p.logits_stride + pos] = c == 0 ? s0 * ks0 : s1 * ks1;
          }
        }
      };
      auto issue_row = [&](float(&acc)[32], int rr) {
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          WgmmaM64N64K16F16(
              acc, a[ks],
              SmemDescSw128(q_tile + rr * kQBytes + (ks >> 2) * kHalfBytes + (ks & 3) * 32), ks);
        }
        WgmmaCommit();
      };

      for (int pass = 0; pass < passes; ++pass) {
        if (pass != loaded_pass) load_q(b, pass, first_row, nrows);  // warpgroup-uniform
        if constexpr (kPairRows) {
          // Rows two at a time: the second row's wgmmas run during the first row's epilogue. The
          // second row's MMA is issued even past the request's last row (its q slot then holds
          // stale values and nothing is stored): a branch around wgmma would serialize every wgmma
          // in the kernel (ptxas C7520).
#pragma unroll
          for (int rr0 = 0; rr0 < kRowsPerPass; rr0 += 2) {
            const int rin0 = pass * kRowsPerPass + rr0;
            if (rin0 >= nrows) break;
            const bool has_second = rr0 + 1 < kRowsPerPass;  // a constant once unrolled
            float acc0[32], acc1[32];
            WgmmaFence();
            issue_row(acc0, rr0);
            if (has_second) {
              issue_row(acc1, rr0 + 1);
              WgmmaWait<1>();
            } else {
              WgmmaWait<0>();
            }
            epilogue(acc0, pass, rr0);
            if (has_second) {
              WgmmaWait<0>();
              if (rin0 + 1 < nrows) epilogue(acc1, pass, rr0 + 1);
            }
          }
        } else {
          for (int rr = 0; rr < kRowsPerPass; ++rr) {
            if (pass * kRowsPerPass + rr >= nrows) break;
            float acc[32];
            WgmmaFence();
            issue_row(acc, rr);
            WgmmaWait<0>();
            epilogue(acc, pass, rr);
          }
        }
      }
      if (i + 1 < num_tiles) cur.Next(prefix);
    }
  }
}

template <int kRowsPerPass, int kWiden, bool kOwnSchedule, int kMinBlocks, bool kPairRows,
          bool kPagePairs = false>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  auto kernel = PagedMqaLogitsPipelinedKernel<kRowsPerPass, kWiden, kOwnSchedule, kMinBlocks,
                                              kPairRows, kPagePairs>;
  constexpr int kSmem = SmemBytes<kRowsPerPass, kOwnSchedule>();
  // The shared-memory opt-in and the occupancy are per device and per instantiation.
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<int> blocks = OptInBlocksPerSm(
      per_device, "paged mqa logits (pipelined): attributes / occupancy", kernel, kThreads, kSmem);
  if (!blocks.ok()) return blocks.status();
  const int grid = std::max(1, num_sms * std::max(1, *blocks));
  kernel<<<grid, kThreads, kSmem, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch PagedMqaLogitsPipelinedKernel");
  return absl::OkStatus();
}

// Widening as keys-M fused: split where a page serves one row per pass, cvt otherwise (both give
// the same logits; the choice is speed only). One row per pass: 3 blocks per SM with 128 registers
// (measured 09:59: faster than 4 blocks with 96 registers, which spill, at 1-64 x 8K-64K); several
// rows: row pairs at 2 blocks per SM (faster than one row at a time with 3 blocks at every next_n 2
// shape). kPagePairs (kWgmmaKeysMPipelinedPagePairs, a measurement): one row per pass by page pairs
// at 2 blocks per SM (10-15% slower than 3 single-page blocks at 64 requests, 10:30 / 10:34).
template <bool kOwnSchedule, bool kPagePairs>
absl::Status LaunchVariant(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  constexpr int kOne = kPipeMinBlocksOneRow;
  constexpr int kMulti = kPipeMinBlocksMultiRow;
  switch (RowsPerPass(args.rows.num_rows, args.rows.num_requests, args.rows.rows_per_request)) {
    case 1:
      if constexpr (kPagePairs) {
        return LaunchTyped<1, kWidenSplit, kOwnSchedule, kMulti, false, true>(args, num_sms,
                                                                              stream);
      }
      return LaunchTyped<1, kWidenSplit, kOwnSchedule, kOne, false>(args, num_sms, stream);
    case 2:
      return LaunchTyped<2, kWidenCvt, kOwnSchedule, kMulti, true>(args, num_sms, stream);
    case 3:
      return LaunchTyped<3, kWidenCvt, kOwnSchedule, kMulti, true>(args, num_sms, stream);
    default:
      return LaunchTyped<4, kWidenCvt, kOwnSchedule, kMulti, true>(args, num_sms, stream);
  }
}

// Half `kHalf` of WidenPage: k-steps 4 kHalf .. 4 kHalf + 3 into a[0..3] (the same instructions).
template <int kWiden, int kHalf>
__device__ __forceinline__ void WidenHalfPage(const uint8_t* kv, int warp, int lane,
                                              uint32_t (&a)[4][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    WidenKSteps<kWiden>(kv, warp, lane, 2 * kHalf + h, a[2 * h], a[2 * h + 1]);
}

// ---- v7: a producer warpgroup and several consumer warpgroups (setmaxnreg) ----
//
// Why: v6 is latency bound with 3 consumer warpgroups per SM (its producer warp costs as many
// registers per lane as a consumer, docs/notes/cuda.md v6). Here the producer is a whole
// warpgroup that gives registers back (setmaxnreg.dec; its 4 warps fill the ring, tiles pw,
// pw + 4, ...) and kConsumers consumer warpgroups take them (setmaxnreg.inc), so an SM runs 4
// consumer warpgroups. Tile i of the block goes to consumer i % kConsumers through ring slot
// i % stages (stages a multiple of 4 and of kConsumers: one producer warp and one consumer per
// slot); each consumer keeps its own q. One row per pass only (next_n 1): the per-entry math is
// v6's one-row path (split widening, 8 wgmma in order, the same epilogue; the A fragments are
// widened half a page at a time), so the logits are keys-M's bit for bit.
// Measured slower than v6 (docs/notes/cuda.md, v7): selectable, not the default.
template <int kConsumers>
struct WsConfig {
  static constexpr int kThreads = kConsumerThreads * (kConsumers + 1);
  static constexpr int kMinBlocks = kConsumers == 2 ? 2 : 1;
  static constexpr int kStages = kPipeWsStagesPerConsumer * kConsumers;
  // What __launch_bounds__ gives every thread, and the split after setmaxnreg: the consumers
  // take what the producer warpgroup gives back (the pool is per block).
  static constexpr int kLaunchRegs = std::min(248, (65536 / (kThreads * kMinBlocks)) & ~7);
  static constexpr int kProducerRegs = kPipeWsProducerRegs;
  static constexpr int kConsumerRegs =
      std::min(240, ((kThreads * kLaunchRegs - kConsumerThreads * kProducerRegs) /
                     (kConsumerThreads * kConsumers)) &
                        ~7);
  static_assert(kConsumerRegs >= kLaunchRegs, "setmaxnreg.inc below the launch count");
};

template <int kConsumers, bool kOwnSchedule>
constexpr int WsSmemBytes() {
  constexpr int kS = WsConfig<kConsumers>::kStages;
  return kS * kValues + kConsumers * kQBytes + kS * kScales + kConsumers * kHeads * 4 +
         kConsumers * 16 + 2 * kS * 8 + (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

template <int kConsumers, bool kOwnSchedule>
__global__ void __launch_bounds__(WsConfig<kConsumers>::kThreads, WsConfig<kConsumers>::kMinBlocks)
    PagedMqaLogitsWsKernel(const PagedLogitsArgs p) {
  using Cfg = WsConfig<kConsumers>;
  constexpr int kS = Cfg::kStages;
  constexpr int kThreadsWs = Cfg::kThreads;
  constexpr int kWiden = kWidenSplit;  // v6's one-row choice
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* stage_values = smem;                            // [stages][8192], swizzled
  uint8_t* q_tiles = smem + kS * kValues;                  // [consumers][2][64][128 B]
  uint8_t* stage_scales = q_tiles + kConsumers * kQBytes;  // [stages][64] fp32
  float* w_all = reinterpret_cast<float*>(stage_scales + kS * kScales);        // [consumers][64]
  int32_t* len_all = reinterpret_cast<int32_t*>(w_all + kConsumers * kHeads);  // [consumers][4]
  uint64_t* full = reinterpret_cast<uint64_t*>(len_all + 4 * kConsumers);
  uint64_t* empty = full + kS;
  int32_t* own = reinterpret_cast<int32_t*>(empty + kS);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < kS; ++s) {
      MbarInit(&full[s], 32);               // one cp.async arrival per producer lane
      MbarInit(&empty[s], kConsumerWarps);  // one arrival per warp of the consuming warpgroup
    }
  }

  const int num_requests = p.rows.num_requests;
  const int32_t* prefix = p.schedule.tile_prefix;
  const int32_t* req_first_row = p.schedule.request_first_row;
  const int32_t* req_num_rows = p.schedule.request_num_rows;
  const int32_t* req_max_len = p.schedule.request_max_len;
  if constexpr (kOwnSchedule) {
    // As v6 (and keys-M fused): the schedule kernel's numbers, built in shared memory.
    BuildOwnSchedule<kThreadsWs>(p, own, tid, num_requests, prefix, req_first_row, req_num_rows,
                                 req_max_len);
  }
  __syncthreads();  // barriers initialised (and the schedule built) for everyone
  const int total_tiles = Ld<kOwnSchedule>(&prefix[num_requests]);
  const int begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
  if (begin >= end) return;  // the whole block: no setmaxnreg is left waiting
  const int num_tiles = end - begin;
  const int wg = tid / kConsumerThreads;

  if (wg == kConsumers) {
    // ---- Producer warpgroup: registers back to the pool; v6's producer loop per warp. ----
    SetMaxNRegDec<Cfg::kProducerRegs>();
    // Four producer warps, tiles pw, pw + 4, ... each (one warp fed 2-4 consumers too slowly:
    // measured 11:10, 2.4x slower than v6). Stages are a multiple of 4, so each slot has one
    // producer warp.
    const int pw = warp - kConsumers * kConsumerWarps;
    if (pw >= num_tiles) return;
    const uint8_t* __restrict__ cache = p.cache.base;
    Cursor<kOwnSchedule> load;
    load.Seek(prefix, num_requests, begin + pw);
    auto locate = [&](int& page, int& valid) {
      const int b = load.request;
      const int j = load.tile - Ld<kOwnSchedule>(&prefix[b]);
      page = __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
      valid = min(kMqaTileKeys, Ld<kOwnSchedule>(&req_max_len[b]) - j * kMqaTileKeys);
    };
    int next_page, next_valid;
    locate(next_page, next_valid);
    for (int i = pw; i < num_tiles; i += kConsumerWarps) {
      const int page = next_page, valid = next_valid;
      if (i + kConsumerWarps < num_tiles) {
        for (int k = 0; k < kConsumerWarps; ++k) load.Next(prefix);
        locate(next_page, next_valid);
      }
      const int st = i % kS;
      if (i >= kS) MbarWait(&empty[st], ((i / kS) + 1) & 1);
      const uint8_t* src = cache + int64_t{page} * kPageBytes;
      uint8_t* dv = stage_values + st * kValues;
      uint8_t* ds = stage_scales + st * kScales;
      CopyPageToStage(src, dv, ds, valid, lane);
      CpAsyncMbarArrive(&full[st]);
    }
    CpAsyncWait<0>();
    return;
  }

  // ---- Consumer warpgroup `wg`: tiles wg, wg + kConsumers, ... of the block. ----
  SetMaxNRegInc<Cfg::kConsumerRegs>();
  const int cw = warp % kConsumerWarps;  // warp inside the warpgroup: its 16 keys of a page
  const int ctid = tid % kConsumerThreads;
  const int q_barrier = kQBarrier + wg;
  // This consumer's q tile and thread index pass through an opaque move at each use: otherwise
  // nvcc hoists the q store addresses (64 of them) and the 8 wgmma descriptors out of the loop as
  // invariants, and the consumer spilled ~1 KB; they are cheap to recompute (q loads are rare).
  auto opaque = [](int v) {
    int r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
  };
  const int q_offset = wg * kQBytes;
  auto my_q_tile = [&]() { return q_tiles + opaque(q_offset); };
  float* w_smem = w_all + wg * kHeads;
  int32_t* len_smem = len_all + 4 * wg;
  const int g = lane >> 2;
  const int c = lane & 3;
  int loaded_request = -1, loaded_row = -1;
  // Row `row`'s q, weights and length into this consumer's slots (v6's load_q for one row).
  auto load_q = [&](int b, int row) {
    NamedBarrierSync(q_barrier, kConsumerThreads);
    uint8_t* q_tile = my_q_tile();
    const int qtid = opaque(ctid);
    loaded_request = b;
    loaded_row = row;
    constexpr int kItems = kHeads * 8;  // 16 codes each: 4 per thread
    static_assert(kItems == 4 * kConsumerThreads, "one round of q loads");
    uint4 codes[4];
    float wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = u * kConsumerThreads + qtid;
      const int head = it / 8, oct = it % 8;
      codes[u] = __ldg(
          reinterpret_cast<const uint4*>(p.q.codes + (int64_t{row} * kHeads + head) * kMqaHeadDim) +
          oct);
      wv[u] = oct == 0 ? __ldg(&p.q.weights[int64_t{row} * kHeads + head]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = u * kConsumerThreads + qtid;
      const int head = it / 8, oct = it % 8;
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 0, codes[u].x);
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 1, codes[u].y);
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 2, codes[u].z);
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 3, codes[u].w);
      if (oct == 0) w_smem[head] = wv[u];
    }
    if (qtid == 0) len_smem[0] = __ldg(&p.rows.row_length[row]);
    FenceProxyAsyncShared();  // st.shared before the wgmmas' (async proxy) reads of q
    NamedBarrierSync(q_barrier, kConsumerThreads);
  };

  // The loop runs over this consumer's tiles only (a branch around the wgmmas would make ptxas
  // serialize them, C7520); the cursor steps over the other consumers' tiles.
  Cursor<kOwnSchedule> cur;
  cur.Seek(prefix, num_requests, min(begin + wg, end - 1));
  for (int i = wg; i < num_tiles; i += kConsumers) {
    const int b = cur.request;
    const int base_pos = (cur.tile - Ld<kOwnSchedule>(&prefix[b])) * kMqaTileKeys;
    const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
    const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
    const int st = i % kS;
    MbarWait(&full[st], (i / kS) & 1);
    const uint8_t* kv = stage_values + st * kValues;
    const float* ksc = reinterpret_cast<const float*>(stage_scales + st * kScales);
    const int key0 = cw * 16 + g;
    // Bit moves: the sums are 2^-8 times the true ones (exactly); 256 * ks is exact too.
    const float ks0 = 256.f * ksc[key0];
    const float ks1 = 256.f * ksc[key0 + 8];

    for (int rin = 0; rin < nrows; ++rin) {
      const int row = first_row + rin;
      if (row != loaded_row) load_q(b, row);  // warpgroup-uniform
      const uint8_t* q_tile = my_q_tile();
      // Half a page of A fragments at a time (16 registers fewer than v6's 32, so the consumer
      // fits its setmaxnreg share): k-steps 0-3, wait, then 4-7 into the same accumulators in
      // the same order as v6, so the same sums.
      float acc[32];
      uint32_t a[4][4];
      WidenHalfPage<kWiden, 0>(kv, cw, lane, a);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        WgmmaM64N64K16F16(acc, a[ks], SmemDescSw128(q_tile + ks * 32), ks);
      }
      WgmmaCommit();
      WgmmaWait<0>();  // the wgmmas read a[] until they complete
      WidenHalfPage<kWiden, 1>(kv, cw, lane, a);
      WgmmaFence();
#pragma unroll
      for (int ks = 4; ks < 8; ++ks) {
        WgmmaM64N64K16F16(acc, a[ks - 4], SmemDescSw128(q_tile + kHalfBytes + (ks & 3) * 32), ks);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      // v6's epilogue: relu * w over this thread's heads, then the 4 lanes of the group.
      // (16 fewer live registers than v6)
      float s0, s1;
      KeysMHeadSums(
          acc, [&](int j, int e) { return w_smem[8 * j + 2 * c + e]; }, s0, s1);
      if (c < 2) {
        const int pos = base_pos + key0 + 8 * c;
        if (pos < len_smem[0])
          p.logits[int64_t{row} * p.logits_stride + pos] = c == 0 ? s0 * ks0 : s1 * ks1;
      }
    }
    // The slot is no longer read: back to the producer (here, not inside the row loop: a branch
    // between the wgmmas made ptxas serialize them, C7520).
    __syncwarp();
    if (lane == 0) MbarArrive(&empty[st]);
    for (int k = 1; k <= kConsumers && i + k < num_tiles; ++k) cur.Next(prefix);
  }
}

template <int kConsumers, bool kOwnSchedule>
absl::Status LaunchWs(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  using Cfg = WsConfig<kConsumers>;
  auto kernel = PagedMqaLogitsWsKernel<kConsumers, kOwnSchedule>;
  constexpr int kSmem = WsSmemBytes<kConsumers, kOwnSchedule>();
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<const KernelDeviceSetup*> setup =
      SetUpOncePerDevice(per_device, "paged mqa logits (warp-specialized): attributes / occupancy",
                         [&](KernelDeviceSetup& d) {
                           cudaError_t err = cudaFuncSetAttribute(
                               kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
                           cudaFuncAttributes attr{};
                           if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
                           d.regs = attr.numRegs;
                           if (err == cudaSuccess) {
                             err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                 &d.blocks_per_sm, kernel, Cfg::kThreads, kSmem);
                           }
                           return err;
                         });
  if (!setup.ok()) return setup.status();
  const KernelDeviceSetup& pd = **setup;
  // setmaxnreg.inc waits for registers the block does not have if ptxas allocated fewer than
  // planned: that would hang, so refuse instead.
  if (pd.regs * Cfg::kThreads <
      kConsumerThreads * (Cfg::kProducerRegs + kConsumers * Cfg::kConsumerRegs)) {
    return absl::InternalError(absl::StrCat("paged mqa logits (warp-specialized): ", pd.regs,
                                            " registers per thread, fewer than the plan's ",
                                            Cfg::kLaunchRegs));
  }
  const int grid = std::max(1, num_sms * std::max(1, pd.blocks_per_sm));
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch PagedMqaLogitsWsKernel");
  return absl::OkStatus();
}

}  // namespace

bool PipelinedComputesOwnSchedule(const PagedLogitsArgs& args) {
  return (args.math == MqaMath::kWgmmaKeysMPipelined ||
          args.math == MqaMath::kWgmmaKeysMPipelinedPagePairs ||
          args.math == MqaMath::kWgmmaKeysMPipelinedWs2 ||
          args.math == MqaMath::kWgmmaKeysMPipelinedWs4) &&
         args.rows.num_requests <= kOwnScheduleMaxRequests;
}

absl::Status LaunchPagedMqaLogitsPipelined(const PagedLogitsArgs& args, int num_sms,
                                           cudaStream_t stream) {
  const bool own = PipelinedComputesOwnSchedule(args);
  const bool one_row =
      RowsPerPass(args.rows.num_rows, args.rows.num_requests, args.rows.rows_per_request) == 1;
  if (one_row && args.math == MqaMath::kWgmmaKeysMPipelinedWs2) {
    return own ? LaunchWs<2, true>(args, num_sms, stream)
               : LaunchWs<2, false>(args, num_sms, stream);
  }
  if (one_row && args.math == MqaMath::kWgmmaKeysMPipelinedWs4) {
    return own ? LaunchWs<4, true>(args, num_sms, stream)
               : LaunchWs<4, false>(args, num_sms, stream);
  }
  if (args.math == MqaMath::kWgmmaKeysMPipelinedPagePairs) {
    return own ? LaunchVariant<true, true>(args, num_sms, stream)
               : LaunchVariant<false, true>(args, num_sms, stream);
  }
  return own ? LaunchVariant<true, false>(args, num_sms, stream)
             : LaunchVariant<false, false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
