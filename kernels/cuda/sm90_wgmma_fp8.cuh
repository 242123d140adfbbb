// wgmma with both operands in shared memory for the FP8 paged MQA logits
// (sm90_paged_mqa_logits_fp8.cu): m64nNk32 e4m3 x e4m3 -> f32, N = 64 (one row of q) or 128
// (a row pair); N = 32 for the FP4 kernel's one row of 32 heads (sm90_paged_mqa_logits_fp4.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace decode_indexer::kernels::cuda {

// The accumulator operands of one m64nNk32 instruction: "+f"(d[i]) for i < N / 2, in groups of 8.
#define DI_WGMMA_D8(i)                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define DI_WGMMA_D16 DI_WGMMA_D8(0), DI_WGMMA_D8(8)
#define DI_WGMMA_D32 DI_WGMMA_D8(0), DI_WGMMA_D8(8), DI_WGMMA_D8(16), DI_WGMMA_D8(24)
#define DI_WGMMA_D64 \
  DI_WGMMA_D32, DI_WGMMA_D8(32), DI_WGMMA_D8(40), DI_WGMMA_D8(48), DI_WGMMA_D8(56)
// The instruction text: N, its N / 2 accumulator registers, then the two descriptors and the
// scale-d predicate (operands N / 2 .. N / 2 + 2).
#define DI_WGMMA_E4M3_SS(n, regs, a, b, acc)                                        \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" acc                                          \
  ", 0;\n"                                                                          \
  "wgmma.mma_async.sync.aligned.m64n" n "k32.f32.e4m3.e4m3 {" regs "}, %" a ", %" b \
  ", p, 1, 1;\n}\n"

// D(64 x N, f32) (+)= A(64 x 32 e4m3, K-major in shared memory) * B(N x 32 e4m3, K-major in
// shared memory)^T, both through SmemDescSw128-style descriptors; accumulate = 0 overwrites D.
// The fp8 tensor core aligns each instruction's 32 products (and D's input) to the largest
// exponent and keeps ~13 fraction bits (docs/spec.md section 6): not exact, unlike the f16 path.
// d holds N / 2 floats per thread (the m64nN accumulator layout). One template: the shapes
// differ only in N and the accumulator count.
template <int kN>
__device__ __forceinline__ void WgmmaM64NK32E4M3SS(float* d, uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  static_assert(kN == 32 || kN == 64 || kN == 128,
                "m64nNk32: N = 32 (one 32-head row), 64 (one q row) or 128 (a row pair)");
  if constexpr (kN == 32) {
    asm volatile(DI_WGMMA_E4M3_SS(
                     "32", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
                     "16", "17", "18")
                 : DI_WGMMA_D16
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else if constexpr (kN == 64) {
    asm volatile(DI_WGMMA_E4M3_SS(
                     "64",
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                     "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                     "32", "33", "34")
                 : DI_WGMMA_D32
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        DI_WGMMA_E4M3_SS(
            "128",
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
            "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
            "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
            "64", "65", "66")
        : DI_WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// D(64 x 32, f32) (+)= A(64 x 32 e4m3, in registers) * B(32 x 32 e4m3, K-major in shared
// memory)^T: the FP4 kernel's m64n32k32 with its widened keys as A. a: this thread's fragment of
// its warp's 16 rows of A, as for mma.m16n8k32 (rows g = lane / 4 and g + 8, columns 4 (lane %
// 4) .. + 3 and 16 + 4 (lane % 4) .. + 3: a[0] (g, low), a[1] (g + 8, low), a[2] (g, high),
// a[3] (g + 8, high), the first column in the lowest byte). kScaleA = -1 subtracts the product.
template <int kScaleA = 1>
__device__ __forceinline__ void WgmmaM64N32K32E4M3RS(float* d, const uint32_t (&a)[4],
                                                     uint64_t desc_b, int accumulate) {
  static_assert(kScaleA == 1 || kScaleA == -1);
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, %22, 1;\n}\n"
      : DI_WGMMA_D16
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kScaleA));
}

#undef DI_WGMMA_E4M3_SS
#undef DI_WGMMA_D64
#undef DI_WGMMA_D32
#undef DI_WGMMA_D16
#undef DI_WGMMA_D8

}  // namespace decode_indexer::kernels::cuda
