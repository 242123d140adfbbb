// The production instantiations of the tensor-core sparse logits kernel
// (sm90_sparse_logits_mma.cuh): kMma (FP8; FP4 with more than 32 heads; the reference the
// variants are held to) and kMmaPairLeanOcc (FP4 with up to 32 heads: the backend's default,
// kSparseLogitsMathDefault in sm90_heuristics.h). The comparison variants (key-folded, plain
// pairs, q shared, the lean copy) live in bench/cuda/variants/sparse_logits_variants.cu.
#include "kernels/cuda/sm90_sparse_logits_mma.cuh"

#include "absl/strings/str_cat.h"

namespace decode_indexer::kernels::cuda {

using sparse_mma::kDim;
using sparse_mma::kMaxHeads;
using sparse_mma::LaunchTyped;

bool SparseLogitsMmaTakes(const CacheView& cache, const QView& q) {
  const CacheGeometry& geo = cache.geometry;
  // 16-byte copies of the codes, 4-byte copies of the scales (FP8 fp32 / FP4 4 x ue8m0).
  return geo.head_dim == kDim && q.num_heads > 0 && q.num_heads <= kMaxHeads &&
         reinterpret_cast<uintptr_t>(cache.base) % 16 == 0 && geo.page_bytes() % 16 == 0 &&
         geo.value_bytes() % 16 == 0 && geo.scale_bytes() == 4 &&
         reinterpret_cast<uintptr_t>(q.codes) % 4 == 0 && cache.num_pages <= INT32_MAX;
}

absl::Status LaunchSparseLogitsMma(const CacheView& cache, const RowBatch& rows, const QView& q,
                                   const int32_t* positions, const int32_t* counts,
                                   int32_t max_positions, float* logits, cudaStream_t stream,
                                   SparseLogitsMath math) {
  if (rows.num_rows <= 0 || max_positions <= 0) return absl::OkStatus();
  if (!SparseLogitsMmaTakes(cache, q)) {
    return absl::UnimplementedError(absl::StrCat("sparse logits (mma): ", q.num_heads,
                                                 " heads, head dim ", cache.geometry.head_dim));
  }
  const bool fp8 = cache.geometry.format == CacheFormat::kFp8;
  const bool narrow = q.num_heads <= 32;
  // FP8 has no group scales: kMmaPairLeanOcc runs kMma's kernel there; so do > 32 heads (q is in
  // shared memory there already; two m-tiles spill).
  if (!fp8 && narrow && math == SparseLogitsMath::kMmaPairLeanOcc) {
    return LaunchTyped<false, 4, 2, false, true, true, true>(cache, rows, q, positions, counts,
                                                             max_positions, logits, stream);
  }
  if (fp8) {
    return narrow ? LaunchTyped<true, 4>(cache, rows, q, positions, counts, max_positions, logits,
                                         stream)
                  : LaunchTyped<true, 8>(cache, rows, q, positions, counts, max_positions, logits,
                                         stream);
  }
  return narrow ? LaunchTyped<false, 4>(cache, rows, q, positions, counts, max_positions, logits,
                                        stream)
                : LaunchTyped<false, 8>(cache, rows, q, positions, counts, max_positions, logits,
                                        stream);
}

}  // namespace decode_indexer::kernels::cuda
