// The pieces of the warp-specialized paged MQA logits kernel (sm90_paged_mqa_logits_pipelined.cu)
// that are plain PTX wrappers: mbarriers (the page ring's full / empty signals), the cp.async
// arrive that lets a producer warp's copies complete a phase, and named barriers (so that one
// warpgroup can synchronise without stopping the producer).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

}  // namespace decode_indexer::kernels::cuda
