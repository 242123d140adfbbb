// Comparison variant kFp8Wide (mqa_variants.h): the production fp8 logits kernel
// (kernels/cuda/sm90_paged_mqa_logits_fp8.cuh) in a wide block, DeepGEMM's block shape: one block
// per SM of four consumer warpgroups that share a request's q in shared memory, and a producer
// warpgroup that fills a page ring per consumer warpgroup with the TMA unit and q with cp.async.
// Taken where the host hint bounds every request's rows (RowBatch::rows_per_request 1-4, as the
// server always sets it); the production kernel otherwise.
//
// Why it is a variant and not the product (docs/results/cuda-bench.md, 2026-12-04 21:28): its
// first form, one producer thread filling all four rings in tile order, gave the production
// kernel's logits bit for bit (gpu_test then, now gpu_variants_test) but was no faster: within
// 0-5% either way at 1-8 requests and next_n 2-4, and 10-22% slower at 64-128 requests x
// 64K-128K, next_n 1 (128 x 128K: 717 against 588 us as graph replay), with 17% fewer
// instructions and the warps waiting on memory (ncu). The form here gives each consumer
// warpgroup its own producer warp (DeepGEMM's arrangement), so that a warpgroup that lags holds
// up only its own ring; it compiles and its scheduling is the tested one's, but it has not run
// on a GPU yet (no machine was lent after the first measurement): gpu_variants_test's
// Fp8WideVariantEqualsTheProductionKernel and the bench's "fp8 wide" column are the next call.
//
// The one-warpgroup kernel runs 3-4 blocks of 160 threads per SM, so a thread gets 96 registers
// at next_n 1 (4 blocks) and next_n 2 keeps only 12 math warps per SM (3 blocks); ncu beside
// DeepGEMM's kernel showed ours waiting on fixed-latency dependencies with fewer eligible warps.
// Here 16 math warps per SM get 104-112 registers (setmaxnreg), and q and the weights are loaded
// once per request and block instead of once per request and warpgroup.
//
// The work: the block's contiguous range of key tiles (BlockSchedule, as the one-warpgroup
// kernel, on a grid of one block per SM), tile i of the range to warpgroup i % 4, into slot
// (i / 4) % kStages of that warpgroup's ring, which producer warp i % 4 fills. Every request of
// the range ("ordinal" k: the k-th request with tiles in the range) gets q stage k % 2: producer
// warp 0 fills it once the four warpgroups have released ordinal k - 2; a warpgroup releases an
// ordinal when it moves past it (waiting for the stage to fill first when it skips a short
// request it has no tile of, so that its arrivals always count towards the ordinal they name).
//
// The arithmetic is the one-warpgroup kernel's, instruction for instruction (the same wgmma
// shapes and k-steps against the same q tile layout, the same epilogue, Fp8HeadSums), so the
// logits are its logits bit for bit. One pass per tile: the hint promises that no request has
// more rows than kRows (rows past kRows would not be scored; such launches take the production
// kernel, which loops passes).

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp8.cuh"

namespace decode_indexer::kernels::cuda {
namespace fp8_wide {

using fp8_logits::kHeads;
using fp8_logits::kQRowBytes;
using fp8_logits::kScales;
using fp8_logits::kValues;
using fp8_logits::QRows;

constexpr int kMathWarpgroups = 4;
constexpr int kMathThreads = 128 * kMathWarpgroups;
constexpr int kProducerWarp = kMathThreads / 32;  // warp 16, the first of warpgroup 4
constexpr int kThreads = kMathThreads + 128;      // 640: the producer's whole warpgroup
// Registers: the launch gives each of the 640 threads 96 (ptxas: 65536 / 640, in steps of 8;
// 544 threads, a lone producer warp, gave 96 as well), and setmaxnreg can only move the block's
// own registers between its warpgroups (an increase that the decreases do not pay for waits
// forever: 120 for the consumers hung the first try). At one row a pass the consumers need 104
// and the producers keep 56 (at 32 they spilled; ptxas -v); more rows want 112 for the
// consumers, which leaves the producers 32 (a few bytes of producer spills at two rows, none in
// the consumers).
constexpr int ConsumerRegs(int rows) { return rows == 1 ? 104 : 112; }
constexpr int ProducerRegs(int rows) { return rows == 1 ? 56 : 32; }
static_assert(kMathThreads * ConsumerRegs(1) + 128 * ProducerRegs(1) <= kThreads * 96 &&
                  kMathThreads * ConsumerRegs(2) + 128 * ProducerRegs(2) <= kThreads * 96,
              "setmaxnreg: more registers than the launch gave the block");
constexpr int kQStages = 2;
// Rows of a pass whose head weights a consumer thread keeps in registers (loaded once per
// request; later rows read theirs from shared memory per tile, four 16-byte loads a row): row 0
// only (at 112 registers rows 0-1 spilled 56-76 bytes at two rows a pass: ptxas -v). Where the
// weights sit moves no arithmetic.
constexpr int kWeightRegRows = 1;

template <int kRows, bool kOwnSchedule, int kStages>
struct Layout {
  static constexpr int kQRows = QRows(kRows);
  static constexpr int kQStageBytes = kQRows * kQRowBytes;
  static constexpr int kSlots = kMathWarpgroups * kStages;
  static constexpr int kValuesOffset = 0;                                   // [slots][8192]
  static constexpr int kQOffset = kValuesOffset + kSlots * kValues;         // [2][q rows][8 KB]
  static constexpr int kScalesOffset = kQOffset + kQStages * kQStageBytes;  // [slots][64] f32
  static constexpr int kWeightsOffset = kScalesOffset + kSlots * kScales;   // [2][q rows][64]
  static constexpr int kBarrierOffset = kWeightsOffset + kQStages * kQRows * kHeads * 4;
  // full[slots], empty[slots], qfull[2], qempty[2]
  static constexpr int kOwnOffset = kBarrierOffset + (2 * kSlots + 2 * kQStages) * 8;
  static constexpr int kBytes = kOwnOffset + (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
  static_assert(kQOffset % 1024 == 0 && kQStageBytes % 1024 == 0, "SW128 tiles 1024-aligned");
  static_assert(kBarrierOffset % 8 == 0, "mbarriers 8-byte aligned");
  static_assert(kBytes <= 227 * 1024, "over the SM's shared memory");
};

// A ScheduleCursor that also counts the requests with tiles it has entered (its ordinal: 0 at
// the tile it was seeded with).
template <bool kShared>
struct OrdinalCursor {
  int tile, request, request_end, ordinal;
  __device__ __forceinline__ void Seek(const int32_t* prefix, int num_requests, int t) {
    ScheduleCursor<kShared> c;
    c.Seek(prefix, num_requests, t);
    tile = c.tile;
    request = c.request;
    request_end = c.request_end;
    ordinal = 0;
  }
  // n tiles on (the caller keeps the result below the schedule's last tile).
  __device__ __forceinline__ void Advance(const int32_t* prefix, int n) {
    tile += n;
    while (tile >= request_end) {
      ++request;
      const int begin = request_end;
      request_end = Ld<kShared>(&prefix[request + 1]);
      ordinal += request_end > begin;  // requests without tiles have no ordinal
    }
  }
};

template <int kRows, bool kOwnSchedule, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    PagedMqaLogitsFp8WideKernel(const PagedLogitsArgs p,
                                const __grid_constant__ CUtensorMap values_map) {
  using L = Layout<kRows, kOwnSchedule, kStages>;
  constexpr int kQRows = L::kQRows;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignSmem1024(smem_raw);
  uint8_t* values = smem + L::kValuesOffset;
  uint8_t* q_tiles = smem + L::kQOffset;
  uint8_t* scales = smem + L::kScalesOffset;
  float* w_smem = reinterpret_cast<float*>(smem + L::kWeightsOffset);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset);
  uint64_t* empty = full + L::kSlots;
  uint64_t* qfull = empty + L::kSlots;
  uint64_t* qempty = qfull + kQStages;
  int32_t* own = reinterpret_cast<int32_t*>(smem + L::kOwnOffset);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < L::kSlots; ++s) {
      MbarInit(&full[s], 1);     // the producer's arrive.expect_tx; the TMA bytes complete it
      MbarInit(&empty[s], 128);  // every thread of the slot's warpgroup
    }
    for (int s = 0; s < kQStages; ++s) {
      MbarInit(&qfull[s], 32);             // one cp.async arrival per producer lane
      MbarInit(&qempty[s], kMathThreads);  // every consumer thread, once per ordinal
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  BlockSchedule<kOwnSchedule> sched;
  sched.template SetUp<kThreads>(p, own, tid);
  if (sched.num_tiles == 0) return;
  const int num_tiles = sched.num_tiles;
  const int begin = sched.begin;
  const int32_t* prefix = sched.prefix;
  const int32_t* req_first_row = sched.first_row;
  const int32_t* req_num_rows = sched.num_rows;

  if (warp >= kProducerWarp) {
    // ---- The producer warpgroup: warp pw fills warpgroup pw's ring (lane 0, TMA) with tiles
    // pw, pw + 4, ...; warp 0 also fills the q stages (all lanes, cp.async). One producer per
    // ring, so that a warpgroup that lags holds up only its own pages (one thread filling all
    // four rings in tile order measured slower than the one-warpgroup kernel at 128 x 128K).
    SetMaxNRegDec<ProducerRegs(kRows)>();
    const int pw = warp - kProducerWarp;
    const int my_tiles =
        num_tiles > pw ? (num_tiles - pw + kMathWarpgroups - 1) / kMathWarpgroups : 0;
    if (lane == 0) PrefetchTensorMap(&values_map);
    const uint8_t* __restrict__ cache = p.cache.base;
    // Page-table entries 32 of this warp's tiles at a time, one a lane, a chunk ahead of use.
    ScheduleCursor<kOwnSchedule> pc;
    int my_m = lane;  // this lane's cursor is on the warp's tile my_m (block tile pw + 4 my_m)
    if (my_tiles > 0) {
      pc.Seek(prefix, sched.num_requests, begin + pw + kMathWarpgroups * min(lane, my_tiles - 1));
    }
    auto page_of = [&]() {
      if (my_m >= my_tiles) return 0;
      const int b = pc.request;
      const int j = pc.tile - Ld<kOwnSchedule>(&prefix[b]);
      return __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
    };
    auto next_chunk = [&]() {
      my_m += 32;
      if (my_m < my_tiles) {
        pc.tile += 32 * kMathWarpgroups - 1;  // Next adds the last one
        pc.Next(prefix);
      }
      return page_of();
    };
    int page_now = page_of();
    int page_next = next_chunk();
    // This warp's m-th tile into slot m % kStages of its ring.
    auto issue = [&](int m) {
      if (m > 0 && (m & 31) == 0) {
        page_now = page_next;
        page_next = next_chunk();
      }
      const int page = __shfl_sync(kFullMask, page_now, m & 31);
      if (lane == 0) {
        const int slot = pw * kStages + m % kStages;
        if (m >= kStages) MbarWait(&empty[slot], ((m / kStages) + 1) & 1);
        MbarArriveExpectTx(&full[slot], kPipePageBytes);
        TmaLoadTile3d(values + slot * kValues, &values_map, 0, 0, page, &full[slot]);
        BulkLoad(scales + slot * kScales, cache + int64_t{page} * kPipePageBytes + kValues, kScales,
                 &full[slot]);
      }
      __syncwarp();
    };
    if (pw != 0) {
      for (int m = 0; m < my_tiles; ++m) issue(m);
      return;
    }
    // Warp 0 walks every tile of the range: q for each new request (before the pages of its
    // own tiles that follow, so that a wait for a q stage never holds back a page its ring's
    // consumers need first), then its own tiles' pages.
    ScheduleCursor<kOwnSchedule> walk;
    walk.Seek(prefix, sched.num_requests, begin);
    int ordinal = -1, request = -1;
    for (int i = 0; i < num_tiles; ++i) {
      if (i > 0) walk.Next(prefix);
      if (walk.request != request) {  // warp-uniform: a new ordinal, its q into stage k % 2
        request = walk.request;
        const int k = ++ordinal;
        const int qs = k % kQStages;
        if (k >= kQStages) MbarWait(&qempty[qs], ((k / kQStages) + 1) & 1);
        const int first_row = Ld<kOwnSchedule>(&req_first_row[request]);
        const int nrows = Ld<kOwnSchedule>(&req_num_rows[request]);
        uint8_t* qt = q_tiles + qs * L::kQStageBytes;
        // B row n = 64 rr + head, its 8 16-byte chunks in the 128B swizzle; rows past the
        // request's last are zeros.
#pragma unroll 4
        for (int it = lane; it < kQRows * kHeads * 8; it += 32) {
          const int n = it >> 3, oct = it & 7, rr = n >> 6;
          const bool valid = rr < nrows;
          const uint8_t* src = p.q.codes +
                               (int64_t{first_row + (valid ? rr : 0)} * kHeads + (n & 63)) * 128 +
                               oct * 16;
          CpAsync16(qt + n * 128 + ((oct ^ (n & 7)) << 4), src, valid);
        }
        float* ws = w_smem + qs * kQRows * kHeads;
#pragma unroll 2
        for (int it = lane; it < kQRows * kHeads; it += 32) {
          const int rr = it >> 6, head = it & 63;
          const bool valid = rr < nrows;
          CpAsync4(ws + rr * kHeads + fp8_logits::WeightSlot(head),
                   p.q.weights + int64_t{first_row + (valid ? rr : 0)} * kHeads + head, valid);
        }
        CpAsyncMbarArrive(&qfull[qs]);
      }
      if ((i & (kMathWarpgroups - 1)) == 0) issue(i / kMathWarpgroups);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // q's copies landed before exit
    return;
  }

  // ---- Consumer warpgroup wg: tiles wg, wg + 4, ... of the block's range. ----
  SetMaxNRegInc<ConsumerRegs(kRows)>();
  const int wg = warp >> 2;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int key0 = (warp & 3) * 16 + g;  // this thread's keys key0 and key0 + 8 of the page
  const int64_t stride = p.logits_stride;
  constexpr int kRegRows = kWeightRegRows;
  float w_reg[16 * kRegRows];
  int len_r[kRows];
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) len_r[rr] = 0;
  float* out_pass = p.logits;
  const float* w_stage = w_smem;
  int nrows = 0, tile0 = 0;

  const uint32_t desc_slot0 = __shfl_sync(kFullMask, fp8_logits::Sw128DescLo(values), 0);
  const uint32_t desc_q0 = __shfl_sync(kFullMask, fp8_logits::Sw128DescLo(q_tiles), 0);
  uint32_t desc_q = desc_q0;

  // Ordinals: `held` is the one whose q stage this warpgroup reads (-1: none yet). Moving to
  // `target` releases it and every ordinal skipped on the way (waiting for each to fill first),
  // then (wait_target) waits for target's q.
  int held = -1;
  auto move_to = [&](int target, bool wait_target) {
    if (held >= 0) MbarArrive(&qempty[held % kQStages]);
    for (int k = held + 1; k < target; ++k) {
      MbarWait(&qfull[k % kQStages], (k / kQStages) & 1);
      MbarArrive(&qempty[k % kQStages]);
    }
    held = target;
    if (wait_target) {
      MbarWait(&qfull[target % kQStages], (target / kQStages) & 1);
      // cp.async wrote q through the generic proxy; the wgmmas read it through the async one.
      FenceProxyAsyncShared();
    }
  };

  OrdinalCursor<kOwnSchedule> cur;
  cur.Seek(prefix, sched.num_requests, begin);
  int n = 0;
  for (int i = wg; i < num_tiles; i += kMathWarpgroups, ++n) {
    cur.Advance(prefix, i == wg ? wg : kMathWarpgroups);
    if (cur.ordinal != held) {  // warpgroup-uniform
      move_to(cur.ordinal, true);
      const int b = cur.request;
      tile0 = Ld<kOwnSchedule>(&prefix[b]);
      const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
      nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        len_r[rr] = rr < nrows ? __ldg(&p.rows.row_length[first_row + rr]) : 0;
      }
      out_pass = p.logits + int64_t{first_row} * stride + key0 + 8 * c;
      const int qs = held % kQStages;
      desc_q = desc_q0 + uint32_t(qs * (L::kQStageBytes / 16));
      w_stage = w_smem + qs * kQRows * kHeads;
#pragma unroll
      for (int rr = 0; rr < kRegRows; ++rr) {
        fp8_logits::LoadWeights(w_stage + rr * kHeads, c,
                                *reinterpret_cast<float(*)[16]>(w_reg + 16 * rr));
      }
    }
    const int base_pos = (cur.tile - tile0) * kMqaTileKeys;
    const int slot = wg * kStages + n % kStages;
    MbarWait(&full[slot], (n / kStages) & 1);
    const uint32_t desc_kv = desc_slot0 + uint32_t(slot * (kValues / 16));
    const float* ksc = reinterpret_cast<const float*>(scales + slot * kScales);
    const float ks0 = ksc[key0];
    const float ks1 = ksc[key0 + 8];
    const float ks = c == 0 ? ks0 : ks1;  // the scale of the key this lane stores (c < 2)

    // As the one-warpgroup kernel's epilogue (one pass: rr is the request's row).
    auto epilogue = [&](const float* acc, int rr) {
      if (rr >= nrows) return;
      float s0, s1;
      if (rr < kRegRows) {
        fp8_logits::Fp8HeadSums(acc, *reinterpret_cast<const float(*)[16]>(w_reg + 16 * rr), s0,
                                s1);
      } else {
        float w[16];
        fp8_logits::LoadWeights(w_stage + rr * kHeads, c, w);
        fp8_logits::Fp8HeadSums(acc, w, s0, s1);
      }
      const int pos = base_pos + key0 + 8 * c;
      if (c < 2 && pos < len_r[rr]) out_pass[rr * stride + base_pos] = (c == 0 ? s0 : s1) * ks;
    };

    float acc[64];
    constexpr int kFirst = kRows < 2 ? kRows : 2;
    WgmmaFence();
    fp8_logits::IssuePage<64 * kFirst>(acc, desc_kv, desc_q);
    WgmmaCommit();
    WgmmaWait<0>();
    epilogue(acc, 0);
    if constexpr (kRows >= 2) epilogue(acc + 32, 1);
    // After the stores: the production kernel's why (sm90_paged_mqa_logits_fp8.cuh, score_page).
    if constexpr (kRows <= 2) MbarArrive(&empty[slot]);
    if constexpr (kRows > 2) {
      WgmmaFence();
      fp8_logits::IssuePage<128>(acc, desc_kv, desc_q + uint32_t(2 * kQRowBytes / 16));
      WgmmaCommit();
      WgmmaWait<0>();
      epilogue(acc, 2);
      if constexpr (kRows == 4) epilogue(acc + 32, 3);
      MbarArrive(&empty[slot]);
    }
  }
  // Release every ordinal up to the block's last, so that the producer can fill the later ones.
  cur.Advance(prefix, (begin + num_tiles - 1) - cur.tile);
  move_to(cur.ordinal + 1, false);
}

template <int kRows, bool kOwnSchedule, int kStages>
absl::Status Launch(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<CUtensorMap> map = PageValuesTensorMap(args.cache);
  if (!map.ok()) return map.status();
  return LaunchPersistentGrid(per_device, "paged mqa logits (fp8 wide)",
                              PagedMqaLogitsFp8WideKernel<kRows, kOwnSchedule, kStages>, kThreads,
                              Layout<kRows, kOwnSchedule, kStages>::kBytes, num_sms, stream, args,
                              *map);
}

// Ring slots per consumer warpgroup (DeepGEMM runs 3).
constexpr int kStages = 4;

template <bool kOwnSchedule>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    return Launch<decltype(rows)::value, kOwnSchedule, kStages>(args, num_sms, stream);
  });
}

}  // namespace fp8_wide

bool Fp8WideTakes(const RowBatch& rows) {
  return rows.rows_per_request >= 1 && rows.rows_per_request <= 4;
}

absl::Status LaunchPagedMqaLogitsFp8Wide(const PagedLogitsArgs& args, int num_sms,
                                         cudaStream_t stream) {
  if (!Fp8WideTakes(args.rows)) return LaunchPagedMqaLogitsFp8(args, num_sms, stream);
  return DenseComputesOwnSchedule(args.rows) ? fp8_wide::LaunchRows<true>(args, num_sms, stream)
                                             : fp8_wide::LaunchRows<false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
