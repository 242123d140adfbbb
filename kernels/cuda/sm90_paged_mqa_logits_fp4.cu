// The production instantiations of the FP4 tensor-core paged MQA logits kernel
// (sm90_paged_mqa_logits_fp4.cuh; rows per pass, blocks per SM, ring slots and group rounds
// chosen in sm90_heuristics.h).
#include "kernels/cuda/sm90_paged_mqa_logits_fp4.cuh"

#include "kernels/cuda/sm90_heuristics.h"

namespace decode_indexer::kernels::cuda {
namespace {

template <bool kOwnSchedule>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    return fp4_logits::Launch<kRows, kOwnSchedule, PipeFp4MinBlocks(kRows), kPipeFp4Stages,
                              PipeFp4GroupRounds(kRows), kPipeFp4SignSplit>(args, num_sms, stream);
  });
}

}  // namespace

bool PagedMqaLogitsFp4Takes(const PagedLogitsArgs& args) { return fp4_logits::Takes(args); }

absl::Status LaunchPagedMqaLogitsFp4(const PagedLogitsArgs& args, int num_sms,
                                     cudaStream_t stream) {
  if (!PagedMqaLogitsFp4Takes(args)) {
    return absl::InvalidArgumentError(
        "paged mqa logits (fp4): needs an MXFP4 cache of 64-entry pages, 128 dims, 32 heads, q "
        "scales and a 16-byte aligned pool");
  }
  return DenseComputesOwnSchedule(args.rows) ? LaunchRows<true>(args, num_sms, stream)
                                             : LaunchRows<false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
