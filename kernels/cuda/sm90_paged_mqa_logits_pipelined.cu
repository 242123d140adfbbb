// Paged MQA logits for FP8 caches with 64 heads, exact (MqaMath::kWgmmaKeysMPipelined: the
// product's exact dense kernel, sm90_heuristics.h): keys as the MMA's M dimension, e4m3 widened
// to f16 (exact) on the way into the A fragments, full fp32 sums, a producer warp feeding pages.
//
// Why: the first keys-M kernel (bench/cuda/variants/sm90_paged_mqa_logits_keys_m.cu, kept for
// comparison) is latency bound (docs/notes/cuda.md). Each of its blocks runs, per page, cp.async
// wait -> block barrier -> page-table load + 17 cp.async address computations per thread -> widen
// -> wgmma -> wait -> epilogue in series, so DRAM stays 35-45% busy. Here each block is one
// consumer warpgroup (warps 0-3) and one producer warp (warp 4):
// - The producer (ProducePages, sm90_mqa_pipeline.cuh, shared with the fp8 kernel) walks the
//   block's tiles ahead of the consumer, loads each page-table entry one tile early, and fills a
//   kPipeStages-deep ring of page slots with cp.async (the 128B swizzle); each lane's
//   `cp.async.mbarrier.arrive` completes the slot's `full` phase once its copies have landed. It
//   waits only on the slot's `empty` barrier.
// - The consumer waits on `full`, widens the page into A fragments (ldmatrix + cvt / bit moves),
//   reads the page's key scales and releases the slot (`empty`, one arrival per warp) before its
//   wgmmas even start, so the producer refills it while the MMA and the epilogue run. No
//   block-wide barrier in the steady state: only a named barrier over the warpgroup when a new
//   request's q is written to shared memory.
// - With several rows per pass (next_n >= 2) two rows' wgmma groups are in flight at once, so the
//   second row's MMA overlaps the first row's epilogue.
// - Several such blocks per SM overlap each other's MMA, widening and epilogue phases.
//
// Numerics: every logit is computed by the same instructions on the same operands as in keys-M
// (same k-step grouping, the same permuted q layout of sm90_mqa_keys_m.cuh, the same epilogue
// order), so the logits are keys-M's bit for bit (gpu_variants_test checks every entry) and
// within 4 fp32 ulps of the CPU's (gpu_test). The order does not depend on the schedule, the
// grid or the batch.
#include <algorithm>
#include <climits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_mqa_pipeline.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kHeads = 64;
constexpr int kConsumerThreads = kPipeConsumerThreads;  // one warpgroup: warps 0-3
constexpr int kThreads = kPipeThreads;                  // and the producer, warp 4
constexpr int kConsumerWarps = kPipeConsumerWarps;
constexpr int kStages = kPipeStages;
constexpr int kValues = kPipeSlotValues;           // 8192: a page's e4m3 codes
constexpr int kScales = kPipeSlotScales;           // 256: its fp32 scales
constexpr int kQBytes = kHeads * kMqaHeadDim * 2;  // one row's q in f16: 16 KB
constexpr int kHalfBytes = kHeads * 128;           // 64 dims of q: one swizzled tile
constexpr int kQBarrier = kPipeQBarrier;           // named barrier of the consumer warpgroup

template <int kRowsPerPass, bool kOwnSchedule>
constexpr int SmemBytes() {
  return kStages * kValues + kRowsPerPass * kQBytes + kStages * kScales +
         kRowsPerPass * kHeads * 4 + 16 + PageRing<kStages>::kBarrierBytes +
         (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

static_assert(kHalfBytes == kKeysMQHalfBytes, "QOffset's q tile layout");

// kMinBlocks: blocks per SM the register cap is sized for; kPairRows: two rows' MMAs in flight
// (twice the accumulators) when a pass has several rows.
template <int kRowsPerPass, int kWiden, bool kOwnSchedule, int kMinBlocks, bool kPairRows>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsPipelinedKernel(const PagedLogitsArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignSmem1024(smem_raw);
  uint8_t* stage_values = smem;                             // [stages][8192], swizzled
  uint8_t* q_tile = smem + kStages * kValues;               // [rows][2][64][128 B]
  uint8_t* stage_scales = q_tile + kRowsPerPass * kQBytes;  // [stages][64] fp32
  float* w_smem = reinterpret_cast<float*>(stage_scales + kStages * kScales);      // [rows][64]
  int32_t* len_smem = reinterpret_cast<int32_t*>(w_smem + kRowsPerPass * kHeads);  // [rows]
  uint64_t* full = reinterpret_cast<uint64_t*>(len_smem + 4);  // 16-byte aligned
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

  ScheduleCursor<kOwnSchedule> cur;
  cur.Seek(prefix, sched.num_requests, sched.begin);

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
    // The slot is no longer read: hand it back to the producer before the MMA, once this
    // lane's loads from it (the codes, the two scales) have been served (FenceSlotReads: the
    // arrive comes before their values' first use).
    FenceSlotReads();
    __syncwarp();
    if (lane == 0) MbarArrive(&empty[st]);

    // Keys key0 and key0 + 8 against heads 8 j + 2 c + e: relu * w, then the 4 lanes of the group
    // complete the 64-head sum (keys-M's order); stores below the row's length.
    auto epilogue = [&](const float(&acc)[32], int pass, int rr) {
      const float* w = w_smem + rr * kHeads;
      float s0, s1;
      KeysMHeadSums(
          acc,
          [&](int j, int e) { return kRowsPerPass == 1 ? w_reg[2 * j + e] : w[8 * j + 2 * c + e]; },
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

template <int kRowsPerPass, int kWiden, bool kOwnSchedule, int kMinBlocks, bool kPairRows>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  // The shared-memory opt-in and the occupancy are per device and per instantiation.
  static KernelDeviceSetup per_device[kMaxDevices];
  return LaunchPersistentGrid(
      per_device, "paged mqa logits (pipelined)",
      PagedMqaLogitsPipelinedKernel<kRowsPerPass, kWiden, kOwnSchedule, kMinBlocks, kPairRows>,
      kThreads, SmemBytes<kRowsPerPass, kOwnSchedule>(), num_sms, stream, args);
}

// The widening, the blocks per SM and the row pairs per rows-per-pass (PipelinedShape,
// sm90_heuristics.h; the logits do not depend on any of it).
template <bool kOwnSchedule>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    constexpr PipelinedShape shape = PipelinedShapeFor(kRows);
    return LaunchTyped<kRows, shape.widen, kOwnSchedule, shape.min_blocks, shape.pair_rows>(
        args, num_sms, stream);
  });
}

}  // namespace

absl::Status LaunchPagedMqaLogitsPipelined(const PagedLogitsArgs& args, int num_sms,
                                           cudaStream_t stream) {
  return DenseComputesOwnSchedule(args.rows) ? LaunchRows<true>(args, num_sms, stream)
                                             : LaunchRows<false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
