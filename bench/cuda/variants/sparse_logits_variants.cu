// The tensor-core sparse logits kernel's comparison variants (sparse_logits_variants.h): the
// template of kernels/cuda/sm90_sparse_logits_mma.cuh at the shapes the product does not run.
#include "bench/cuda/variants/sparse_logits_variants.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/sm90_sparse_logits_mma.cuh"

namespace decode_indexer::kernels::cuda {

using sparse_mma::LaunchTyped;

const char* SparseVariantName(SparseVariant v) {
  switch (v) {
    case SparseVariant::kMmaFolded:
      return "mma folded";
    case SparseVariant::kMmaFoldedPair:
      return "mma folded pair";
    case SparseVariant::kMmaPair:
      return "mma pair";
    case SparseVariant::kMmaQShared:
      return "mma q shared";
    case SparseVariant::kMmaPairLeanCopy:
      return "mma pair lean copy";
    case SparseVariant::kMmaPairLean:
      return "mma pair lean";
  }
  return "?";
}

bool SparseVariantSameBitsAsMma(SparseVariant v) {
  return v != SparseVariant::kMmaFolded && v != SparseVariant::kMmaFoldedPair;
}

absl::Status LaunchSparseLogitsVariant(SparseVariant v, const CacheView& cache,
                                       const RowBatch& rows, const QView& q,
                                       const int32_t* positions, const int32_t* counts,
                                       int32_t max_positions, float* logits, cudaStream_t stream) {
  if (rows.num_rows <= 0 || max_positions <= 0) return absl::OkStatus();
  if (!SparseLogitsMmaTakes(cache, q)) {
    return absl::UnimplementedError(absl::StrCat("sparse logits variant ", SparseVariantName(v),
                                                 ": ", q.num_heads, " heads, head dim ",
                                                 cache.geometry.head_dim));
  }
  const bool fp8 = cache.geometry.format == CacheFormat::kFp8;
  const bool narrow = q.num_heads <= 32;
  // FP8 has no group scales: every variant runs kMma's kernel there; so do > 32 heads under
  // kMmaPair, kMmaPairLeanCopy, kMmaPairLean and kMmaQShared (q is in shared memory there
  // already; two m-tiles spill).
  if (fp8) {
    return LaunchSparseLogitsMma(cache, rows, q, positions, counts, max_positions, logits, stream,
                                 SparseLogitsMath::kMma);
  }
  switch (v) {
    case SparseVariant::kMmaFolded:
      return narrow ? LaunchTyped<false, 4, 1, true>(cache, rows, q, positions, counts,
                                                     max_positions, logits, stream)
                    : LaunchTyped<false, 8, 1, true>(cache, rows, q, positions, counts,
                                                     max_positions, logits, stream);
    case SparseVariant::kMmaFoldedPair:
      // Two m-tiles of > 32 heads (q's fragments from shared memory, 64 accumulators per
      // m-tile) spill at 168 registers: those take one m-tile per step.
      return narrow ? LaunchTyped<false, 4, 2, true>(cache, rows, q, positions, counts,
                                                     max_positions, logits, stream)
                    : LaunchTyped<false, 8, 1, true>(cache, rows, q, positions, counts,
                                                     max_positions, logits, stream);
    default:
      break;
  }
  if (!narrow) {
    return LaunchSparseLogitsMma(cache, rows, q, positions, counts, max_positions, logits, stream,
                                 SparseLogitsMath::kMma);
  }
  switch (v) {
    case SparseVariant::kMmaPair:
      return LaunchTyped<false, 4, 2>(cache, rows, q, positions, counts, max_positions, logits,
                                      stream);
    case SparseVariant::kMmaPairLeanCopy:
      return LaunchTyped<false, 4, 2, false, false, true>(cache, rows, q, positions, counts,
                                                          max_positions, logits, stream);
    case SparseVariant::kMmaPairLean:
      return LaunchTyped<false, 4, 2, false, false, true, true>(cache, rows, q, positions, counts,
                                                                max_positions, logits, stream);
    case SparseVariant::kMmaQShared:
      return LaunchTyped<false, 4, 1, false, true>(cache, rows, q, positions, counts, max_positions,
                                                   logits, stream);
    default:
      break;
  }
  return absl::InvalidArgumentError("sparse logits variant: unknown");
}

}  // namespace decode_indexer::kernels::cuda
