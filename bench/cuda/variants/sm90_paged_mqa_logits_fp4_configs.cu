// Comparison variants of the FP4 kernel (fp4_variants.h): the production template
// (kernels/cuda/sm90_paged_mqa_logits_fp4.cuh) at other shape choices.
#include "bench/cuda/variants/fp4_variants.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp4.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

// kFourBlocks: one row a pass at 4 blocks per SM (more rows at 3).
template <bool kFourBlocks>
constexpr int TwoRoundsMinBlocks(int rows) {
  return kFourBlocks && rows == 1 ? 4 : 3;
}

// kRounds 2: the group wgmmas in two rounds (kFourBlocks as above); 1: the production shape
// with the other sign handling.
template <bool kOwnSchedule, int kRounds, bool kFourBlocks>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    if constexpr (kRounds == 2) {
      return fp4_logits::Launch<kRows, kOwnSchedule, TwoRoundsMinBlocks<kFourBlocks>(kRows),
                                kPipeFp4Stages, 2, kPipeFp4SignSplit>(args, num_sms, stream);
    } else {
      return fp4_logits::Launch<kRows, kOwnSchedule, PipeFp4MinBlocks(kRows), kPipeFp4Stages,
                                PipeFp4GroupRounds(kRows), !kPipeFp4SignSplit>(args, num_sms,
                                                                               stream);
    }
  });
}

}  // namespace

const char* Fp4VariantName(Fp4Variant v) {
  switch (v) {
    case Fp4Variant::kTwoRounds4Blocks:
      return "fp4 two rounds, 4 blocks at one row";
    case Fp4Variant::kTwoRounds3Blocks:
      return "fp4 two rounds, 3 blocks";
    case Fp4Variant::kOtherSignHandling:
      return kPipeFp4SignSplit ? "fp4 signs in A (one wgmma a group)"
                               : "fp4 A split by sign (two wgmmas a group)";
  }
  return "?";
}

absl::Status LaunchFp4Variant(Fp4Variant v, const PagedLogitsArgs& args, int num_sms,
                              cudaStream_t stream) {
  if (!PagedMqaLogitsFp4Takes(args)) {
    return absl::InvalidArgumentError("fp4 variant: not a shape the FP4 kernel takes");
  }
  switch (v) {
    case Fp4Variant::kTwoRounds4Blocks:
      return DenseComputesOwnSchedule(args.rows)
                 ? LaunchTyped<true, 2, true>(args, num_sms, stream)
                 : LaunchTyped<false, 2, true>(args, num_sms, stream);
    case Fp4Variant::kTwoRounds3Blocks:
      return DenseComputesOwnSchedule(args.rows)
                 ? LaunchTyped<true, 2, false>(args, num_sms, stream)
                 : LaunchTyped<false, 2, false>(args, num_sms, stream);
    case Fp4Variant::kOtherSignHandling:
      return DenseComputesOwnSchedule(args.rows)
                 ? LaunchTyped<true, 1, false>(args, num_sms, stream)
                 : LaunchTyped<false, 1, false>(args, num_sms, stream);
  }
  return absl::InvalidArgumentError("fp4 variant: unknown");
}

}  // namespace decode_indexer::kernels::cuda
