// RoPE frequencies (spec section 1): plain or YaRN, computed once on the host in double.
#pragma once

#include <cstdint>
#include <vector>

#include "decode_indexer/kernels/types.h"

namespace decode_indexer::kernels {

struct RopeParams {
  RopeStyle style = RopeStyle::kNone;
  int32_t dim_offset = 0;
  int32_t rope_dim = 0;
  double theta = 10000.0;
  // YaRN (DeepSeek-V3 style). mscale 1: cos and sin are not scaled.
  bool yarn = false;
  double yarn_factor = 1.0;
  int64_t yarn_original_max_position = 4096;
  double yarn_beta_fast = 32.0;
  double yarn_beta_slow = 1.0;
};

// inv_freq[i] for i in [0, rope_dim / 2): the angle of pair i at position p is p * inv_freq[i].
std::vector<double> ComputeInvFreq(const RopeParams& params);

}  // namespace decode_indexer::kernels
