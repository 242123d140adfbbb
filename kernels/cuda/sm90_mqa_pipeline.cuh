// What the two warp-specialized paged MQA logits kernels share (the exact one,
// sm90_paged_mqa_logits_pipelined.cu, and the fp8 one, sm90_paged_mqa_logits_fp8.cu): the PTX
// wrappers (mbarriers for the page ring's full / empty signals, the cp.async arrive that lets a
// producer warp's copies complete a phase, named barriers so that one warpgroup can synchronise
// without stopping the producer, setmaxnreg), the page ring in shared memory, the block's share
// of the step's schedule and the producer warp that fills the ring.
//
// Why one copy: both kernels feed their consumer warpgroup the same pages in the same ring; only
// the consumer's math differs. The producer touches no logit, so sharing it cannot move a bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbarrier.init: `count` arrivals complete a phase.
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}

// One arrival (release semantics at CTA scope, the default: this thread's earlier
// shared-memory reads and writes are ordered before whoever observes the phase complete).
// Returns the barrier state token (callers that only arrive ignore it).
__device__ __forceinline__ uint64_t MbarArrive(uint64_t* bar) {
  uint64_t state;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n"
               : "=l"(state)
               : "r"(SmemAddr(bar))
               : "memory");
  return state;
}

// Waits until this thread's earlier shared-memory loads have been served, for a release of
// a ring slot before those loads' values are used: the arrive alone does not wait for them
// (in the SASS, SYNCS.ARRIVE follows an LDS / LDSM with nothing between that needs its
// result), so the producer's next fill could land first. Measured in session 17: an fp8
// kernel built to release with its key-scale load just issued read the next page's scales in
// 99 of 100 launches, 0 of 100 with this fence (MEMBAR.*.CTA) before the arrive
// (docs/results/gpu-test-runs.md). A release after the loaded values are used needs none.
__device__ __forceinline__ void FenceSlotReads() {
  asm volatile("fence.acq_rel.cta;\n" ::: "memory");
}

// Blocks until the phase of parity `parity` has completed (acquire semantics, the default).
// try_wait suspends the thread for a while in hardware, so the loop does not spin hot.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = SmemAddr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (done == 0);
}

// An arrival that fires when all of this thread's earlier cp.async copies have landed
// (.noinc: it counts against the arrivals given to MbarInit, one per producer lane).
__device__ __forceinline__ void CpAsyncMbarArrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddr(bar))
               : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// setmaxnreg (sm_90a): the warpgroup gives registers back to the block's pool (dec) or takes
// them from it (inc, waiting until enough are free). Every thread of the warpgroup must run
// it; kRegs is a multiple of 8 in [24, 256].
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegDec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: bad count");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegInc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: bad count");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- TMA (the bulk copy engine) -------------------------------------------------------------

// One arrival on `bar` that also raises the phase's expected transaction count by `bytes`: the
// phase completes once the arrival count is reached and that many bytes of bulk copies naming
// `bar` have landed.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}

// A 3-D tile of the tensor map `map` (a __grid_constant__ kernel parameter) at coordinates
// (c0, c1, c2) into shared memory at `dst`, completing `bytes` of `bar`'s transaction count.
__device__ __forceinline__ void TmaLoadTile3d(void* dst, const void* map, int c0, int c1, int c2,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar))
      : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) contiguous bytes from global
// memory into shared memory, completing them on `bar`.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}

__device__ __forceinline__ void PrefetchTensorMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- The page ring and its producer warp ----------------------------------------------------

// One ring slot's bytes: a page's 64 x 128 e4m3 codes (128B-swizzled, 1024-byte aligned: the
// wgmma SW128 K-major layout) and, in a separate array, its 64 fp32 key scales.
inline constexpr int kPipeSlotValues = kMqaTileKeys * kMqaHeadDim;  // 8192
inline constexpr int kPipeSlotScales = kMqaTileKeys * 4;            // 256
inline constexpr int kPipePageBytes = kPipeSlotValues + kPipeSlotScales;
// The kernels' block: one consumer warpgroup (warps 0-3) and one producer warp (warp 4).
inline constexpr int kPipeConsumerThreads = 128;
inline constexpr int kPipeConsumerWarps = kPipeConsumerThreads / 32;
inline constexpr int kPipeThreads = kPipeConsumerThreads + 32;
// The consumer warpgroup's named barrier (0 is __syncthreads).
inline constexpr int kPipeQBarrier = 1;

// kStages slots: `full[s]` completes when the producer's copies into slot s have landed (one
// cp.async arrival per producer lane), `empty[s]` when the consumer's 4 warps are done with it.
template <int kStages>
struct PageRing {
  uint8_t* values;  // [kStages][kPipeSlotValues]
  uint8_t* scales;  // [kStages][kPipeSlotScales]
  uint64_t* full;   // [kStages]
  uint64_t* empty;  // [kStages]

  // Shared-memory bytes of the barriers (the slots are counted by the kernel's layout).
  static constexpr int kBarrierBytes = 2 * kStages * 8;

  // Thread 0 only; the block synchronises before anyone waits on them. full_arrivals: 32 for
  // ProducePages (one cp.async arrival per producer lane), 1 for ProducePagesTma (one
  // arrive.expect_tx; the copies' bytes complete the phase). empty_arrivals: one per consumer
  // warp (lane 0 arrives after __syncwarp) or one per consumer thread.
  __device__ __forceinline__ void InitBarriers(uint32_t full_arrivals = 32,
                                               uint32_t empty_arrivals = kPipeConsumerWarps) const {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], full_arrivals);
      MbarInit(&empty[s], empty_arrivals);
    }
    // The TMA unit (async proxy) completes these barriers' transactions: make the
    // initialisation visible to it before the block barrier that publishes them.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __device__ __forceinline__ const uint8_t* Values(int slot) const {
    return values + slot * kPipeSlotValues;
  }
  __device__ __forceinline__ const float* Scales(int slot) const {
    return reinterpret_cast<const float*>(scales + slot * kPipeSlotScales);
  }
};

// The step's schedule as a block sees it: the four per-request arrays (the schedule kernel's
// output, or the block's own copy in shared memory when kOwnSchedule) and the block's contiguous
// range of key tiles.
template <bool kOwnSchedule>
struct BlockSchedule {
  int num_requests;
  const int32_t* prefix;
  const int32_t* first_row;
  const int32_t* num_rows;
  const int32_t* max_len;
  int begin;      // the block's first tile
  int num_tiles;  // its tile count (0: nothing to do)

  // The schedule (built in `own` by all kBlockThreads threads when kOwnSchedule), the block
  // barrier (which also publishes barriers thread 0 initialised before the call) and the
  // block's tile range. Every thread of the block calls it.
  template <int kBlockThreads>
  __device__ __forceinline__ void SetUp(const PagedLogitsArgs& p, int32_t* own, int tid) {
    num_requests = p.rows.num_requests;
    prefix = p.schedule.tile_prefix;
    first_row = p.schedule.request_first_row;
    num_rows = p.schedule.request_num_rows;
    max_len = p.schedule.request_max_len;
    if constexpr (kOwnSchedule) {
      // The schedule kernel's work, in shared memory (min / count / max are order-free, so the
      // numbers are the schedule kernel's).
      BuildOwnSchedule<kBlockThreads>(p, own, tid, num_requests, prefix, first_row, num_rows,
                                      max_len);
    }
    __syncthreads();  // barriers initialised (and the schedule built) for everyone
    const int total_tiles = Ld<kOwnSchedule>(&prefix[num_requests]);
    begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
    const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
    num_tiles = end > begin ? end - begin : 0;
  }
};

// The producer warp: walks the block's tiles and fills slot i % kStages with tile i, kStages
// ahead of the consumer (waiting only on the slot's `empty` phase), the page-table entry of the
// next tile loaded one tile early so its latency overlaps the wait. Returns once its last copies
// have landed.
template <int kStages, bool kOwnSchedule>
__device__ __forceinline__ void ProducePages(const PagedLogitsArgs& p,
                                             const BlockSchedule<kOwnSchedule>& sched,
                                             const PageRing<kStages>& ring, int lane) {
  const uint8_t* __restrict__ cache = p.cache.base;
  ScheduleCursor<kOwnSchedule> load;
  load.Seek(sched.prefix, sched.num_requests, sched.begin);
  auto locate = [&](int& page, int& valid) {
    const int b = load.request;
    const int j = load.tile - Ld<kOwnSchedule>(&sched.prefix[b]);
    page = __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
    valid = min(kMqaTileKeys, Ld<kOwnSchedule>(&sched.max_len[b]) - j * kMqaTileKeys);
  };
  int next_page, next_valid;
  locate(next_page, next_valid);
  for (int i = 0; i < sched.num_tiles; ++i) {
    const int page = next_page, valid = next_valid;
    if (i + 1 < sched.num_tiles) {
      load.Next(sched.prefix);
      locate(next_page, next_valid);
    }
    const int st = i % kStages;
    if (i >= kStages) MbarWait(&ring.empty[st], ((i / kStages) + 1) & 1);
    CopyPageToStage(cache + int64_t{page} * kPipePageBytes, ring.values + st * kPipeSlotValues,
                    ring.scales + st * kPipeSlotScales, valid, lane);
    CpAsyncMbarArrive(&ring.full[st]);
  }
  CpAsyncWait<0>();
}

// The producer's i-th page (`page` of `cache`) into slot i % kStages through the TMA unit, once
// the consumers have released the slot's previous page: one arrive.expect_tx on the slot's
// `full` barrier (InitBarriers(1)), one tensor copy of the page's 64 x 128 codes through
// `values_map` (PageValuesTensorMap: the 128B swizzle) and one bulk copy of its 64 scales.
template <int kStages>
__device__ __forceinline__ void FillSlotTma(const PageRing<kStages>& ring, int i,
                                            const uint8_t* cache, int page,
                                            const void* values_map) {
  const int st = i % kStages;
  if (i >= kStages) MbarWait(&ring.empty[st], ((i / kStages) + 1) & 1);
  MbarArriveExpectTx(&ring.full[st], kPipePageBytes);
  TmaLoadTile3d(ring.values + st * kPipeSlotValues, values_map, 0, 0, page, &ring.full[st]);
  BulkLoad(ring.scales + st * kPipeSlotScales,
           cache + int64_t{page} * kPipePageBytes + kPipeSlotValues, kPipeSlotScales,
           &ring.full[st]);
}

// ProducePages through the TMA unit, by one thread (the producer warp's lane 0): per tile one
// arrive.expect_tx on the slot's `full` barrier (InitBarriers(1)), one tensor copy of the
// page's 64 x 128 codes through `values_map` (PageValuesTensorMap: the map writes the 128B
// swizzle that CopyPageToStage writes by hand) and one bulk copy of its 64 scales. Keys at or
// past the tile's valid count are copied as they are (stale cache bytes, not zeros): every
// key's logit depends only on its own row of codes and its own scale, and the consumers store
// no logit at or past a row's length, so those keys cannot reach an answer.
template <int kStages, bool kOwnSchedule>
__device__ __forceinline__ void ProducePagesTma(const PagedLogitsArgs& p,
                                                const BlockSchedule<kOwnSchedule>& sched,
                                                const PageRing<kStages>& ring,
                                                const void* values_map) {
  const uint8_t* __restrict__ cache = p.cache.base;
  PrefetchTensorMap(values_map);
  ScheduleCursor<kOwnSchedule> load;
  load.Seek(sched.prefix, sched.num_requests, sched.begin);
  auto locate = [&]() {
    const int b = load.request;
    const int j = load.tile - Ld<kOwnSchedule>(&sched.prefix[b]);
    return __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
  };
  int next_page = locate();
  for (int i = 0; i < sched.num_tiles; ++i) {
    const int page = next_page;
    if (i + 1 < sched.num_tiles) {
      load.Next(sched.prefix);
      next_page = locate();
    }
    FillSlotTma(ring, i, cache, page, values_map);
  }
}

}  // namespace decode_indexer::kernels::cuda
