#include "kernels/cpu/dot_tile.h"

#include <cstring>

namespace decode_indexer::kernels::cpu::internal {
namespace {

// GCC/Clang vector extension: 4 doubles (one AVX register, two SSE2 registers). Written out
// so the accumulators stay in registers (16 keys x 2 heads = 8 vectors).
using V4 = double __attribute__((vector_size(32)));
static_assert(kTileKeys == 16, "the tile is four vectors wide");

inline V4 Load(const double* p) {
  V4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(double* p, V4 v) { std::memcpy(p, &v, sizeof(v)); }

template <int kHeads>
inline void DotTileN(const double* q, int64_t q_stride, const double* tile, int32_t d_begin,
                     int32_t d_end, double* dots) {
  V4 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  const double* q1 = q + (kHeads == 2 ? q_stride : 0);
  for (int32_t d = d_begin; d < d_end; ++d) {
    const double* kd = tile + static_cast<int64_t>(d) * kTileKeys;
    const V4 k0 = Load(kd), k1 = Load(kd + 4), k2 = Load(kd + 8), k3 = Load(kd + 12);
    const double qa = q[d];
    a0 += qa * k0;
    a1 += qa * k1;
    a2 += qa * k2;
    a3 += qa * k3;
    if constexpr (kHeads == 2) {
      const double qb = q1[d];
      b0 += qb * k0;
      b1 += qb * k1;
      b2 += qb * k2;
      b3 += qb * k3;
    }
  }
  Store(dots, a0);
  Store(dots + 4, a1);
  Store(dots + 8, a2);
  Store(dots + 12, a3);
  if constexpr (kHeads == 2) {
    Store(dots + 16, b0);
    Store(dots + 20, b1);
    Store(dots + 24, b2);
    Store(dots + 28, b3);
  }
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void DotTile(const double* q, int64_t q_stride, int32_t num_heads, const double* tile,
             int32_t d_begin, int32_t d_end, double* dots) {
  if (num_heads == 2) {
    DotTileN<2>(q, q_stride, tile, d_begin, d_end, dots);
  } else {
    DotTileN<1>(q, q_stride, tile, d_begin, d_end, dots);
  }
}

}  // namespace decode_indexer::kernels::cpu::internal
