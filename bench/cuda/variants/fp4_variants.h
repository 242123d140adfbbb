// Comparison variants of the FP4 tensor-core dense logits (kernels/cuda/
// sm90_paged_mqa_logits_fp4.cuh), built only with the benchmarks (di_bench_mqa_variants): the
// production kernel at other shape choices, timed beside it by the CUDA bench (--fp4) and held
// to its logits bit for bit by gpu_variants_test.
// - kTwoRounds4Blocks: one row a pass at 4 blocks per SM (96 registers), the 4 group wgmmas of
//   a row in two rounds of two (32 accumulators live instead of 64); more rows a pass keep 3
//   blocks, also in two rounds.
// - kOtherSignHandling: the other sign handling than the production one (kPipeFp4SignSplit, false:
// A
//   widened with its signs, five instructions per 4 codes, one wgmma a group): A split by sign
//   into two fragments, one prmt lookup per 4 codes each, a second wgmma subtracting.
// - kTwoRounds3Blocks: the group wgmmas in two rounds at the production 3 blocks per SM.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels::cuda {

enum class Fp4Variant { kTwoRounds4Blocks, kOtherSignHandling, kTwoRounds3Blocks };
inline constexpr Fp4Variant kAllFp4Variants[] = {
    Fp4Variant::kTwoRounds4Blocks, Fp4Variant::kOtherSignHandling, Fp4Variant::kTwoRounds3Blocks};
const char* Fp4VariantName(Fp4Variant v);

// As LaunchPagedMqaLogitsFp4 (InvalidArgument where PagedMqaLogitsFp4Takes does not hold).
absl::Status LaunchFp4Variant(Fp4Variant v, const PagedLogitsArgs& args, int num_sms,
                              cudaStream_t stream);

}  // namespace decode_indexer::kernels::cuda
