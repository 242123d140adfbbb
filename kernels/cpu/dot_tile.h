// The exact dot products at the heart of the CPU scoring, in their own translation unit so
// they can be compiled for wider vectors and with fused multiply-add: every product of two
// code values is exact and so is every partial sum (see engine.cc), hence neither the
// instruction set nor the summation order can change a result.
#pragma once

#include <cstdint>

namespace decode_indexer::kernels::cpu::internal {

inline constexpr int32_t kTileKeys = 16;

// dots[h * kTileKeys + t] = sum over d in [d_begin, d_end) of q[h * q_stride + d] *
// tile[d * kTileKeys + t], for h in [0, num_heads) (num_heads <= 2) and t in [0, kTileKeys).
void DotTile(const double* q, int64_t q_stride, int32_t num_heads, const double* tile,
             int32_t d_begin, int32_t d_end, double* dots);

}  // namespace decode_indexer::kernels::cpu::internal
