// Small device helpers shared by the SM90 kernels: async copies, ldmatrix, the fp8 MMA, the
// FP4 -> e4m3 widening and block scans. Inline PTX is wrapped here once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace decode_indexer::kernels::cuda {

inline constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Where request b's row starts in RowBatch::page_table: RowBatch::request_slot[b] (the server's
// resident per-sequence tables) or b (a table built for the call). A template, so this header
// needs no host types.
template <typename Rows>
__device__ __forceinline__ int64_t PageRowBase(const Rows& rows, int b) {
  const int row = rows.request_slot != nullptr ? __ldg(&rows.request_slot[b]) : b;
  return int64_t{row} * rows.page_table_stride;
}

// 16-byte cp.async (L2 only). When !valid no global byte is read and the 16 bytes are zeroed,
// so a tile never reads past a row's length yet holds no stale codes.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_size)
               : "memory");
}
// 4-byte cp.async (L1 and L2); when !valid no global byte is read and the 4 bytes are zeroed.
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x16-byte matrices: lane i gives the row address of matrix i / 8, row i % 8; register m
// of lane l receives word l % 4 of row l / 4 of matrix m (exactly an MMA B fragment).
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// D += A(16x32 e4m3, row) * B(32x8 e4m3, col), fp32 accumulate.
__device__ __forceinline__ void MmaE4M3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The first 1024-byte aligned byte of the dynamic shared memory `raw` (the kernel reserves 1 KB
// extra). Pointer arithmetic on the __shared__ array itself, not a round trip through an integer:
// the compiler then still knows the result points into shared memory and emits LDS / STS for
// every access through it. (Rounding the generic address as an integer made every access a
// generic LD / ST: measured on the fp8 logits kernel's SASS, where the weights, key scales, row
// lengths and the in-block schedule were all read with generic loads.)
__device__ __forceinline__ uint8_t* AlignSmem1024(uint8_t* raw) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return raw + ((1024u - (addr & 1023u)) & 1023u);
}

// ---- wgmma (sm_90a) -------------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major tile with 128-byte rows in the 128B swizzle
// (16-byte chunk c of row r stored at chunk c ^ (r % 8), 1024-byte aligned groups of 8 rows).
// Its fields other than the start address: leading byte offset 1 (16 B), stride 1024 B between
// 8-row groups, the 128B swizzle mode.
inline constexpr uint64_t kSmemDescSw128Fixed =
    (1ull << 16) | (uint64_t{1024 >> 4} << 32) | (1ull << 62);
__device__ __forceinline__ uint64_t SmemDescSw128(const void* smem) {
  const uint64_t addr = static_cast<uint64_t>(__cvta_generic_to_shared(smem));
  return ((addr & 0x3FFFFull) >> 4) | kSmemDescSw128Fixed;
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before later
// async-proxy reads (wgmma operands).
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// D(64 x 64, f32) (+)= A(64 x 32 e4m3, registers, the mma.m16n8k32 A layout per warp) *
// B(64 keys x 32 e4m3, K-major in shared memory). accumulate = 0 overwrites D.
__device__ __forceinline__ void WgmmaM64N64K32E4M3(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// D(64 x 64, f32) (+)= A(64 x 16 f16, registers, the mma.m16n8k16 A layout per warp) *
// B(64 keys x 16 f16, K-major in shared memory). f16 products of e4m3 values are exact and
// this path accumulates in full fp32 (the fp8 path sums in reduced precision).
__device__ __forceinline__ void WgmmaM64N64K16F16(float (&d)[32], const uint32_t (&a)[4],
                                                  uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// Two e4m3 codes (low byte first) -> f16x2, exactly.
__device__ __forceinline__ uint32_t E4M3x2ToF16x2(uint32_t two_codes) {
  uint32_t out;
  asm("{\n.reg .b16 t;\nmov.b16 t, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}\n"
      : "=r"(out)
      : "h"(static_cast<unsigned short>(two_codes & 0xFFFFu)));
  return out;
}

// e2m1 nibble -> the e4m3 byte of the same value (every e2m1 value is exactly an e4m3 one):
// 0, .5 (0x30), then 1, 1.5, 2, 3, 4, 6 = 0x38 + 4 * (code - 2); the sign moves to bit 7.
__device__ __forceinline__ uint32_t E2M1ToE4M3(uint32_t nibble) {
  const uint32_t m = nibble & 7u;
  const uint32_t mag = m < 2u ? m * 0x30u : 0x38u + ((m - 2u) << 2);
  return mag | ((nibble & 8u) << 4);
}
// Four packed e2m1 codes (16 bits, element 0 in the low nibble) -> four e4m3 bytes.
__device__ __forceinline__ uint32_t WidenFp4x4(uint32_t packed16) {
  return E2M1ToE4M3(packed16 & 0xFu) | (E2M1ToE4M3((packed16 >> 4) & 0xFu) << 8) |
         (E2M1ToE4M3((packed16 >> 8) & 0xFu) << 16) | (E2M1ToE4M3((packed16 >> 12) & 0xFu) << 24);
}

// Block-wide exclusive scan of one unsigned value per thread (uint32_t, or uint64_t holding
// several packed counters); *total receives the block sum. scratch holds 32 values. Every
// thread of the block must call it.
template <typename T>
__device__ __forceinline__ T BlockExclusiveScan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  T inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    T w = lane < num_warps ? scratch[lane] : T{0};
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T n = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += n;
    }
    scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const T warp_base = warp == 0 ? T{0} : scratch[warp - 1];
  *total = scratch[num_warps - 1];
  return warp_base + inc - v;
}

}  // namespace decode_indexer::kernels::cuda
