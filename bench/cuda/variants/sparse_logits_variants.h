// Comparison variants of the tensor-core sparse logits kernel (kernels/cuda/
// sm90_sparse_logits_mma.cuh), built with the benchmarks only (di_bench_mqa_variants): the
// product runs kMma and kMmaPairLeanOcc (SparseLogitsMath, sm90_launchers.h); these stay so that
// the CUDA bench can time them beside those and gpu_variants_test can hold them to kMma.
// FP4 only: under an FP8 cache every variant runs kMma's kernel.
//
// - kMmaPair (two m-tiles per warp step: one wait, copy issue and scale read per 32 positions)
//   and kMmaQShared (q's B fragments from shared memory, 96 registers, 5 blocks per SM) compute
//   kMma's sums in kMma's order: the same logits bit for bit. So do kMmaPairLeanCopy (kMmaPair
//   with the copy issue's per-lane offsets computed once), kMmaPairLean (+ each key's group
//   scales decoded once per step, kDecScales) and kMmaPairLeanOcc (the backend's default: + q
//   from shared memory, the step's two m-tiles sharing each B-fragment read, 3 stages: 128
//   registers and 4 blocks per SM instead of 168 and 3; 6% faster than kMmaPair on the H200).
// - kMmaFolded / kMmaFoldedPair: each key's group scales folded into its f16 values
//   (KeyFoldExponents), so the 8 k-steps are one fp32 tensor-core sum per (key, head), like
//   FP8's; keys whose groups lie more than 2^23 apart take kMma's group-scaled path for that
//   key alone. Measured no faster than kMma on the H200 (docs/notes/cuda.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels::cuda {

enum class SparseVariant {
  kMmaFolded,
  kMmaFoldedPair,
  kMmaPair,
  kMmaQShared,
  kMmaPairLeanCopy,
  kMmaPairLean,
};
inline constexpr SparseVariant kAllSparseVariants[] = {
    SparseVariant::kMmaFolded,  SparseVariant::kMmaFoldedPair,   SparseVariant::kMmaPair,
    SparseVariant::kMmaQShared, SparseVariant::kMmaPairLeanCopy, SparseVariant::kMmaPairLean};
const char* SparseVariantName(SparseVariant v);
// True for the variants whose logits are kMma's bit for bit (all but the key-folded ones, whose
// sums differ from kMma's by fp32 rounding).
bool SparseVariantSameBitsAsMma(SparseVariant v);

// As LaunchSparseLogitsMma (Unimplemented for the shapes that kernel does not take).
absl::Status LaunchSparseLogitsVariant(SparseVariant v, const CacheView& cache,
                                       const RowBatch& rows, const QView& q,
                                       const int32_t* positions, const int32_t* counts,
                                       int32_t max_positions, float* logits, cudaStream_t stream);

}  // namespace decode_indexer::kernels::cuda
