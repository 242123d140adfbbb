// The paged-logits work schedule, computed on the device from the step's row lengths so that
// the host never waits for the GPU: per request its rows and longest row, and a prefix of its
// key tiles over which the persistent logits grid splits the work evenly.
#include <climits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

// One block: the request table is small (hundreds of entries), so a single block with global
// atomics and one block scan is cheaper than a second launch.
__global__ void __launch_bounds__(kScheduleThreads)
    MqaScheduleKernel(const int32_t* __restrict__ row_request,
                      const int32_t* __restrict__ row_length, int32_t num_rows,
                      int32_t num_requests, MqaSchedule s) {
  __shared__ uint32_t scratch[32];
  for (int b = threadIdx.x; b < num_requests; b += blockDim.x) {
    s.request_first_row[b] = INT_MAX;
    s.request_num_rows[b] = 0;
    s.request_max_len[b] = 0;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < num_rows; r += blockDim.x) {
    const int b = row_request[r];
    atomicMin(&s.request_first_row[b], r);
    atomicAdd(&s.request_num_rows[b], 1);
    atomicMax(&s.request_max_len[b], row_length[r]);
  }
  __syncthreads();
  // Each thread owns a contiguous run of requests; read through L2 (the atomics live there).
  const int per_thread = (num_requests + blockDim.x - 1) / blockDim.x;
  const int lo = min(num_requests, static_cast<int>(threadIdx.x) * per_thread);
  const int hi = min(num_requests, lo + per_thread);
  uint32_t local = 0;
  for (int b = lo; b < hi; ++b) {
    local += (__ldcg(&s.request_max_len[b]) + kMqaTileKeys - 1) / kMqaTileKeys;
  }
  uint32_t total = 0;
  uint32_t run = BlockExclusiveScan(local, scratch, &total);
  for (int b = lo; b < hi; ++b) {
    s.tile_prefix[b] = static_cast<int32_t>(run);
    run += (__ldcg(&s.request_max_len[b]) + kMqaTileKeys - 1) / kMqaTileKeys;
  }
  if (threadIdx.x == 0) s.tile_prefix[num_requests] = static_cast<int32_t>(total);
}

}  // namespace

int64_t MqaScheduleInts(int32_t max_requests) { return 4 * int64_t{max_requests} + 1; }

MqaSchedule CarveMqaSchedule(int32_t* workspace, int32_t max_requests) {
  MqaSchedule s;
  s.request_first_row = workspace;
  s.request_num_rows = workspace + max_requests;
  s.request_max_len = workspace + 2 * int64_t{max_requests};
  s.tile_prefix = workspace + 3 * int64_t{max_requests};
  return s;
}

absl::Status LaunchMqaSchedule(const RowBatch& rows, const MqaSchedule& schedule,
                               cudaStream_t stream) {
  if (rows.num_requests <= 0 || rows.num_rows <= 0) {
    return absl::InvalidArgumentError("mqa schedule: empty row batch");
  }
  MqaScheduleKernel<<<1, kScheduleThreads, 0, stream>>>(rows.row_request, rows.row_length,
                                                        rows.num_rows, rows.num_requests, schedule);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch MqaScheduleKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
