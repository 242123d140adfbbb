// RoPE inverse frequencies, plain or YaRN as DeepSeek-V3 computes them
// (yarn_find_correction_range and a linear ramp mask over the pair index), in double.
#include "decode_indexer/kernels/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace decode_indexer::kernels {
namespace {

// The pair index at which a rotation of `rotations` full turns over the original context
// happens: d * ln(orig / (rotations * 2 pi)) / (2 ln theta).
double CorrectionDim(double rotations, int32_t dim, double theta, int64_t original) {
  return dim * std::log(static_cast<double>(original) / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

}  // namespace

std::vector<double> ComputeInvFreq(const RopeParams& params) {
  const int32_t dim = params.rope_dim;
  if (dim <= 0) return {};
  const int32_t half = dim / 2;
  std::vector<double> inv_freq(half);
  for (int32_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0 / std::pow(params.theta, static_cast<double>(2 * i) / dim);
  }
  if (!params.yarn) return inv_freq;
  double low = std::floor(
      CorrectionDim(params.yarn_beta_fast, dim, params.theta, params.yarn_original_max_position));
  double high = std::ceil(
      CorrectionDim(params.yarn_beta_slow, dim, params.theta, params.yarn_original_max_position));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int32_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double mask = 1.0 - ramp;  // 1: keep the original frequency (extrapolation)
    const double extra = inv_freq[i];
    const double inter = extra / params.yarn_factor;
    inv_freq[i] = inter * (1.0 - mask) + extra * mask;
  }
  return inv_freq;
}

}  // namespace decode_indexer::kernels
