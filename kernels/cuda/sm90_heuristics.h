// Which dense FP8 / 64-head logits kernel the CUDA backend runs, in one place: the exact one
// (fp32 sums of exact f16 products, spec section 6's 4 fp32 ulps) or the fp8 tensor-core one
// (spec section 6's fp8-accumulation bound). The choice is the precision the backend was asked
// for (BackendLimits::logits_precision, the server's --logits-precision); kDefault takes
// kDenseLogitsFp8ByDefault unless the environment says otherwise (DI_LOGITS_PRECISION=exact or
// fp8: a switch for measurements, read once per process).
#pragma once

#include <cstdlib>
#include <cstring>

#include "decode_indexer/kernels/backend.h"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels::cuda {

// The two production kernels.
inline constexpr MqaMath kExactDenseMqaMath = MqaMath::kWgmmaKeysMPipelined;
inline constexpr MqaMath kFp8DenseMqaMath = MqaMath::kWgmmaKeysMPipelinedFp8;
// What kDefault means: the fp8 kernel, which measured 1.36x the exact one at 64 x 32K next_n 1
// (79% against 58% of copy bandwidth) and 1.6x at next_n 2 on the H200 (docs/results/
// cuda-bench.md, issue 17's first run); the exact one stays a flag away (--logits-precision).
inline constexpr bool kDenseLogitsFp8ByDefault = true;

// kDefault resolved: DI_LOGITS_PRECISION (exact / fp8) if set, else kDenseLogitsFp8ByDefault.
inline LogitsPrecision ResolveLogitsPrecision(LogitsPrecision asked) {
  if (asked != LogitsPrecision::kDefault) return asked;
  static const LogitsPrecision resolved = [] {
    const char* env = std::getenv("DI_LOGITS_PRECISION");
    if (env != nullptr && std::strcmp(env, "exact") == 0) return LogitsPrecision::kExact;
    if (env != nullptr && std::strcmp(env, "fp8") == 0) return LogitsPrecision::kFp8;
    return kDenseLogitsFp8ByDefault ? LogitsPrecision::kFp8 : LogitsPrecision::kExact;
  }();
  return resolved;
}

inline MqaMath DenseMqaMath(LogitsPrecision asked) {
  return ResolveLogitsPrecision(asked) == LogitsPrecision::kFp8 ? kFp8DenseMqaMath
                                                                : kExactDenseMqaMath;
}

}  // namespace decode_indexer::kernels::cuda
