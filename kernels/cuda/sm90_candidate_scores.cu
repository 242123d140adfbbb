// Candidate-block scores at a source layer (spec section 7): block j of a row scores the max
// logit of its positions below the row's length; the newest block scores +inf so that it is
// always kept. The radix top-k then picks the blocks.
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

__global__ void CandidateScoresKernel(const float* __restrict__ logits, int64_t logits_stride,
                                      const int32_t* __restrict__ row_length, int32_t block_size,
                                      float* __restrict__ scores, int64_t scores_stride) {
  const int row = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int length = row_length[row];
  const int num_blocks = (length + block_size - 1) / block_size;
  if (j >= num_blocks) return;
  float score;
  if (j == num_blocks - 1) {
    score = INFINITY;
  } else {
    // Not the newest block, so all its positions lie below the length.
    const float* l = logits + int64_t{row} * logits_stride + int64_t{j} * block_size;
    score = l[0];
    for (int o = 1; o < block_size; ++o) score = fmaxf(score, l[o]);
  }
  scores[int64_t{row} * scores_stride + j] = score;
}

}  // namespace

absl::Status LaunchCandidateScores(int32_t num_rows, const float* logits, int64_t logits_stride,
                                   const int32_t* row_length, int32_t block_size, float* scores,
                                   int64_t scores_stride, int32_t max_blocks, cudaStream_t stream) {
  if (num_rows <= 0 || max_blocks <= 0) return absl::OkStatus();
  if (block_size <= 0) return absl::InvalidArgumentError("candidate scores: block size <= 0");
  const dim3 grid((max_blocks + kWarpKernelThreads - 1) / kWarpKernelThreads, num_rows);
  CandidateScoresKernel<<<grid, kWarpKernelThreads, 0, stream>>>(logits, logits_stride, row_length,
                                                                 block_size, scores, scores_stride);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch CandidateScoresKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
