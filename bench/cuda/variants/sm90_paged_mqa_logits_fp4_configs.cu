// Comparison variants of the FP4 kernel (fp4_variants.h): the production template
// (kernels/cuda/sm90_paged_mqa_logits_fp4.cuh) at other shape choices.
#include "bench/cuda/variants/fp4_variants.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp4.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

template <bool kOwnSchedule>
absl::Status LaunchTwoRounds(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    return fp4_logits::Launch < kRows, kOwnSchedule, kRows == 1 ? 4 : 3, kPipeFp4Stages,
           2 > (args, num_sms, stream);
  });
}

}  // namespace

const char* Fp4VariantName(Fp4Variant v) {
  switch (v) {
    case Fp4Variant::kTwoRounds4Blocks:
      return "fp4 two rounds, 4 blocks at one row";
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
      return DenseComputesOwnSchedule(args.rows) ? LaunchTwoRounds<true>(args, num_sms, stream)
                                                 : LaunchTwoRounds<false>(args, num_sms, stream);
  }
  return absl::InvalidArgumentError("fp4 variant: unknown");
}

}  // namespace decode_indexer::kernels::cuda
