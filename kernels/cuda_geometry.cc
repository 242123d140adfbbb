// The shapes the CUDA backend's kernels take, stated once on the host so that the executor can
// refuse a profile at start-up. Compiled in every build (CPU-only too) so CI unit-tests it; the
// rules mirror the kernels' own checks (kernels/cuda: grep UnimplementedError), which stay as a
// second line.
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/sm90_tile_config.h"  // plain C++ constants: no CUDA headers
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/types.h"

namespace decode_indexer::kernels {
namespace {

// Every kernel (InsertKeys, RopeQuantQ, paged and sparse logits) works on 128-dim heads.
constexpr int32_t kHeadDim = cuda::kMqaHeadDim;
// Paged MQA logits: one key tile is one cache page.
constexpr int32_t kPageSize = cuda::kMqaTileKeys;
// Paged MQA logits instantiates 32 and 64 heads only.
constexpr int32_t kHeadsNarrow = 32;
constexpr int32_t kHeadsWide = 64;
// The candidate-score workspace is sized for blocks of at least this many positions (must match
// kMinCandidateBlock in kernels/cuda/cuda_backend.cc).
constexpr int32_t kMinCandidateBlock = 8;

absl::Status Refuse(const std::string& field, int64_t value, const std::string& takes) {
  return absl::FailedPreconditionError(
      absl::StrCat(field, ": ", value, " (the CUDA backend takes ", takes, ")"));
}

}  // namespace

absl::Status CudaSupportsGeometry(const CacheGeometry& geometry, int32_t num_heads,
                                  int32_t candidate_block_size, std::string_view cache_field_view) {
  // This absl's StrCat does not take std::string_view.
  const std::string cache_field(cache_field_view);
  if (geometry.format != CacheFormat::kFp8 && geometry.format != CacheFormat::kFp4) {
    return Refuse(absl::StrCat(cache_field, ".format"), static_cast<int32_t>(geometry.format),
                  "fp8 (1) or fp4 (2)");
  }
  if (geometry.head_dim != kHeadDim) {
    return Refuse(absl::StrCat(cache_field, ".head_dim"), geometry.head_dim,
                  absl::StrCat(kHeadDim));
  }
  if (geometry.page_size != kPageSize) {
    return Refuse(absl::StrCat(cache_field, ".page_size"), geometry.page_size,
                  absl::StrCat(kPageSize));
  }
  if (num_heads != kHeadsNarrow && num_heads != kHeadsWide) {
    return Refuse("num_heads", num_heads, absl::StrCat(kHeadsNarrow, " or ", kHeadsWide));
  }
  if (candidate_block_size != 0 && candidate_block_size < kMinCandidateBlock) {
    return Refuse("candidate_block_size", candidate_block_size,
                  absl::StrCat("0 (no candidate layers) or >= ", kMinCandidateBlock));
  }
  return absl::OkStatus();
}

absl::Status CudaSupportsRanks(int32_t ranks) {
  if (ranks < 1 || ranks > cuda::kMaxDevices) {
    return Refuse("ranks", ranks, absl::StrCat("1 to ", cuda::kMaxDevices, " GPUs"));
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels
