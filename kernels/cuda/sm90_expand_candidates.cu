// Candidate expansion (spec section 7): a consumer row's candidate blocks (ascending, -1
// padded) become the ascending positions it scores, below its length, -1 padded. It reads only
// candidates and lengths, which is what lets it run on a side stream (CandidateOverlap).
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kExpandThreads = 256;

__global__ void __launch_bounds__(kExpandThreads) ExpandCandidatesKernel(const ExpandArgs a) {
  __shared__ uint32_t scratch[32];
  const int row = blockIdx.x;
  const int length = a.row_length[row];
  const int bs = a.candidate_block_size;
  const int32_t* cand = a.candidates + int64_t{row} * a.num_candidate_blocks;
  int32_t* out = a.out.positions + int64_t{row} * a.out.max_positions;
  uint32_t run = 0;
  for (int base = 0; base < a.num_candidate_blocks; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const int block = j < a.num_candidate_blocks ? cand[j] : -1;
    const int first = block >= 0 ? block * bs : 0;
    const int count = (block >= 0 && first < length) ? min(bs, length - first) : 0;
    uint32_t total;
    const uint32_t at = run + BlockExclusiveScan(static_cast<uint32_t>(count), scratch, &total);
    for (int o = 0; o < count && at + o < static_cast<uint32_t>(a.out.max_positions); ++o) {
      out[at + o] = first + o;
    }
    run += total;
  }
  const int written = min(static_cast<int>(run), a.out.max_positions);
  for (int i = written + threadIdx.x; i < a.out.max_positions; i += blockDim.x) out[i] = -1;
  if (threadIdx.x == 0) a.out.counts[row] = written;
}

}  // namespace

absl::Status LaunchExpandCandidates(const ExpandArgs& args, cudaStream_t stream) {
  if (args.num_rows <= 0) return absl::OkStatus();
  ExpandCandidatesKernel<<<args.num_rows, kExpandThreads, 0, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch ExpandCandidatesKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
