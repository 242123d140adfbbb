// Comparison variants of the FP8 / 64-head dense logits, built only with the benchmarks
// (DI_BUILD_BENCH: the library di_bench_mqa_variants). The product runs one kernel per job
// (kernels/cuda, chosen in sm90_heuristics.h); these stay so that the CUDA bench can time them
// beside the production kernels and gpu_variants_test can hold them to the exact production
// kernel's logits bit for bit. Each gives the exact kernel's logits (MqaMath::
// kWgmmaKeysMPipelined) bit for bit:
// - kWgmmaKeysM (v4): keys as M, cvt widening, a schedule launch, block barriers per page;
// - kWgmmaKeysMSplit: half the widening by integer bit moves; kWgmmaKeysMBitMove: all of it;
// - kWgmmaKeysMFused (the default until the pipelined kernel): the in-block schedule, split
//   widening at one row per pass; the only kernel that fills PagedLogitsArgs::row_histogram;
// - kWgmmaKeysMPipelinedWs2 / Ws4 (v7): a producer warpgroup and 2 / 4 consumer warpgroups
//   (setmaxnreg), one row per pass (several rows run the production exact kernel).
// And fp8 variants (not exact; outside kAllMqaVariants, which hold to the exact kernel):
// - kFp8V1: the fp8 production kernel before the TMA producer and the four-chain epilogue
//   (its logits equal the production fp8 kernel's up to the epilogue's fp32 summation order);
// - kFp8N2SmemWeights4 / kFp8N34SmemWeights: the production fp8 kernel with sm90_heuristics.h's
//   earlier choices (two rows per pass at 4 blocks per SM and 3 ring slots, three or four rows
//   at 3 blocks; every row's weights read from shared memory per page), bit for bit its logits.
// - kFp8Wide: the production fp8 kernel in DeepGEMM's block shape (four consumer warpgroups
//   sharing q, a producer warp per ring; sm90_paged_mqa_logits_fp8_wide.cu) where the
//   rows-per-request hint is 1-4 (Fp8WideTakes), the production kernel otherwise; bit for bit
//   its logits.
// - kFp8PerPage: the fp8 kernel before its run-ordered loop (per-page bookkeeping;
//   sm90_paged_mqa_logits_fp8_per_page.cu); bit for bit the production kernel's logits, and its
//   differential check.
// Removed, their measurements recorded in docs/results/cuda-bench.md and its raw/ logs:
// the heads-as-M wgmma f16 / fp8 kernels, the exact kernel's page pairs, the fp8 kernel's
// per-row m64n64 chains, the run-ordered loop's 4-blocks form at two rows a pass and the per-page
// kernel with only its warp index shuffled (kFp8RunsN2FourBlocks, kFp8ShflWarp).
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels::cuda {

enum class MqaVariant {
  kWgmmaKeysM,
  kWgmmaKeysMSplit,
  kWgmmaKeysMFused,
  kWgmmaKeysMBitMove,
  kWgmmaKeysMPipelinedWs2,
  kWgmmaKeysMPipelinedWs4,
  kFp8V1,
  kFp8N2SmemWeights4,
  kFp8N34SmemWeights,
  kFp8Wide,
  kFp8PerPage,
};
inline constexpr MqaVariant kAllMqaVariants[] = {MqaVariant::kWgmmaKeysM,
                                                 MqaVariant::kWgmmaKeysMSplit,
                                                 MqaVariant::kWgmmaKeysMFused,
                                                 MqaVariant::kWgmmaKeysMBitMove,
                                                 MqaVariant::kWgmmaKeysMPipelinedWs2,
                                                 MqaVariant::kWgmmaKeysMPipelinedWs4};
const char* MqaVariantName(MqaVariant v);
// The fp8 tensor-core variants (their logits are not the exact kernel's).
inline constexpr MqaVariant kFp8MqaVariants[] = {MqaVariant::kFp8V1, MqaVariant::kFp8N2SmemWeights4,
                                                 MqaVariant::kFp8N34SmemWeights,
                                                 MqaVariant::kFp8Wide, MqaVariant::kFp8PerPage};
// True for the fp8 variants whose logits are the production fp8 kernel's bit for bit (its shape
// choices moved); false for kFp8V1 (another summation order) and the exact-kernel variants.
bool MqaVariantSameBitsAsFp8(MqaVariant v);

// As LaunchPagedMqaLogits (args.math is not read); FP8 caches with 64 heads, page size 64 and
// head dim 128 only (InvalidArgument otherwise).
absl::Status LaunchMqaVariant(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                              cudaStream_t stream);
// False when the variant derives the schedule itself (then args.schedule is not read).
bool MqaVariantNeedsSchedule(MqaVariant v, const PagedLogitsArgs& args);
// True when the variant fills args.row_histogram (kWgmmaKeysM / Split / Fused / BitMove).
bool MqaVariantFillsHistogram(MqaVariant v);

// The kernel files' launchers (reached through LaunchMqaVariant).
absl::Status LaunchPagedMqaLogitsKeysM(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                       cudaStream_t stream);
bool KeysMComputesOwnSchedule(MqaVariant v, const PagedLogitsArgs& args);
absl::Status LaunchPagedMqaLogitsWs(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                    cudaStream_t stream);
absl::Status LaunchPagedMqaLogitsFp8V1(const PagedLogitsArgs& args, int num_sms,
                                       cudaStream_t stream);
absl::Status LaunchPagedMqaLogitsFp8Wide(const PagedLogitsArgs& args, int num_sms,
                                         cudaStream_t stream);
absl::Status LaunchPagedMqaLogitsFp8PerPage(const PagedLogitsArgs& args, int num_sms,
                                            cudaStream_t stream);
// True where kFp8Wide runs its own kernel (the hint says 1-4 rows a request).
bool Fp8WideTakes(const RowBatch& rows);
absl::Status LaunchPagedMqaLogitsFp8Config(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                           cudaStream_t stream);

}  // namespace decode_indexer::kernels::cuda
