// The dispatcher of the comparison variants (mqa_variants.h).
#include "bench/cuda/variants/mqa_variants.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {

const char* MqaVariantName(MqaVariant v) {
  switch (v) {
    case MqaVariant::kWgmmaKeysM:
      return "keys-M";
    case MqaVariant::kWgmmaKeysMSplit:
      return "keys-M split";
    case MqaVariant::kWgmmaKeysMFused:
      return "keys-M fused";
    case MqaVariant::kWgmmaKeysMBitMove:
      return "keys-M bit move";
    case MqaVariant::kWgmmaKeysMPipelinedWs2:
      return "ws2";
    case MqaVariant::kWgmmaKeysMPipelinedWs4:
      return "ws4";
    case MqaVariant::kFp8V1:
      return "fp8 v1";
    case MqaVariant::kFp8N2SmemWeights4:
      return "fp8 n2 smem weights 4 blocks";
    case MqaVariant::kFp8N34SmemWeights:
      return "fp8 n3-4 smem weights";
    case MqaVariant::kFp8Wide:
      return "fp8 wide";
    case MqaVariant::kFp8PerPage:
      return "fp8 per page";
  }
  return "?";
}

absl::Status LaunchMqaVariant(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                              cudaStream_t stream) {
  const CacheGeometry& geo = args.cache.geometry;
  if (geo.format != CacheFormat::kFp8 || args.q.num_heads != 64 || geo.page_size != kMqaTileKeys ||
      geo.head_dim != kMqaHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("mqa variant ", MqaVariantName(v),
                     ": FP8 caches with 64 heads, page size 64 and head ", "dim 128 only"));
  }
  if (args.rows.num_rows <= 0 || args.rows.num_requests <= 0) return absl::OkStatus();
  if (v == MqaVariant::kWgmmaKeysMPipelinedWs2 || v == MqaVariant::kWgmmaKeysMPipelinedWs4) {
    return LaunchPagedMqaLogitsWs(v, args, num_sms, stream);
  }
  if (v == MqaVariant::kFp8V1) return LaunchPagedMqaLogitsFp8V1(args, num_sms, stream);
  if (v == MqaVariant::kFp8Wide) return LaunchPagedMqaLogitsFp8Wide(args, num_sms, stream);
  if (v == MqaVariant::kFp8PerPage) return LaunchPagedMqaLogitsFp8PerPage(args, num_sms, stream);
  if (MqaVariantSameBitsAsFp8(v)) return LaunchPagedMqaLogitsFp8Config(v, args, num_sms, stream);
  return LaunchPagedMqaLogitsKeysM(v, args, num_sms, stream);
}

bool MqaVariantNeedsSchedule(MqaVariant v, const PagedLogitsArgs& args) {
  if (v == MqaVariant::kWgmmaKeysMPipelinedWs2 || v == MqaVariant::kWgmmaKeysMPipelinedWs4 ||
      v == MqaVariant::kFp8V1 || MqaVariantSameBitsAsFp8(v)) {
    return !DenseComputesOwnSchedule(args.rows);
  }
  return !KeysMComputesOwnSchedule(v, args);
}

bool MqaVariantFillsHistogram(MqaVariant v) {
  return v != MqaVariant::kWgmmaKeysMPipelinedWs2 && v != MqaVariant::kWgmmaKeysMPipelinedWs4 &&
         v != MqaVariant::kFp8V1 && !MqaVariantSameBitsAsFp8(v);
}

bool MqaVariantSameBitsAsFp8(MqaVariant v) {
  return v == MqaVariant::kFp8N2SmemWeights4 || v == MqaVariant::kFp8N34SmemWeights ||
         v == MqaVariant::kFp8Wide || v == MqaVariant::kFp8PerPage;
}

}  // namespace decode_indexer::kernels::cuda
