// Comparison variants of the production fp8 logits kernel's shape choices (mqa_variants.h:
// kFp8N2SmemWeights4, kFp8N34SmemWeights): the same kernel template
// (kernels/cuda/sm90_paged_mqa_logits_fp8.cuh) at other blocks per SM, ring slots or weight
// placement than sm90_heuristics.h picks, so the bench can time a heuristic's alternatives
// beside it. The choices move no arithmetic: their logits equal the production kernel's bit for
// bit (gpu_variants_test). Shapes whose rows per pass a variant does not cover run the production
// choice.
#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp8.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

template <bool kOwnSchedule>
absl::Status Dispatch(MqaVariant v, const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  const int rows = DenseRowsPerPass(args.rows);
  if (v == MqaVariant::kFp8N2SmemWeights4 && rows == 2) {
    return fp8_logits::Launch<2, kOwnSchedule, 4, 3, false>(args, num_sms, stream);
  }
  if (v == MqaVariant::kFp8N34SmemWeights && rows == 3) {
    return fp8_logits::Launch<3, kOwnSchedule, 3, 4, false>(args, num_sms, stream);
  }
  if (v == MqaVariant::kFp8N34SmemWeights && rows == 4) {
    return fp8_logits::Launch<4, kOwnSchedule, 3, 4, false>(args, num_sms, stream);
  }
  return LaunchPagedMqaLogitsFp8(args, num_sms, stream);
}

}  // namespace

absl::Status LaunchPagedMqaLogitsFp8Config(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                           cudaStream_t stream) {
  return DenseComputesOwnSchedule(args.rows) ? Dispatch<true>(v, args, num_sms, stream)
                                             : Dispatch<false>(v, args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
