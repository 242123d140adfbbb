// Host side of the paged MQA logits launchers: the per-device, per-instantiation set-up (the
// dynamic shared-memory opt-in and the occupancy query) that every persistent-grid launcher
// needs before its first launch on a device.
//
// Why once per device: cudaFuncSetAttribute is a device property (a rank may drive another GPU
// than the last one), and the occupancy query costs a driver round trip, so both run once for
// each device a process uses and their result is kept (the launcher's static table, one per
// kernel instantiation).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {

// What a launcher learns about its kernel on one device. blocks_per_sm_hist and regs are set
// only by launchers that ask for them (keys-M's histogram variant, the warp-specialized kernel).
struct KernelDeviceSetup {
  std::once_flag once;
  int blocks_per_sm = 0;
  int blocks_per_sm_hist = 0;
  int regs = 0;
  cudaError_t err = cudaSuccess;
};

// Runs `init(KernelDeviceSetup&) -> cudaError_t` once for the current device in `per_device` (the
// caller's static table) and returns that device's entry, or the error `init` met (named by
// `what`, as every later call on that device also reports it).
template <typename Init>
absl::StatusOr<const KernelDeviceSetup*> SetUpOncePerDevice(
    KernelDeviceSetup (&per_device)[kMaxDevices], const char* what, Init init) {
  int device = 0;
  DI_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= kMaxDevices) return absl::UnimplementedError("more than 16 GPUs");
  KernelDeviceSetup& pd = per_device[device];
  std::call_once(pd.once, [&] { pd.err = init(pd); });
  DI_CUDA_RETURN_IF_ERROR(pd.err, what);
  return &pd;
}

// The common case: opt `kernel` in to `smem` bytes of dynamic shared memory and return its
// resident blocks per SM at `threads` threads, once per device.
template <typename Kernel>
absl::StatusOr<int> OptInBlocksPerSm(KernelDeviceSetup (&per_device)[kMaxDevices], const char* what,
                                     Kernel kernel, int threads, int smem) {
  absl::StatusOr<const KernelDeviceSetup*> pd =
      SetUpOncePerDevice(per_device, what, [&](KernelDeviceSetup& d) {
        cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err == cudaSuccess) {
          err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d.blocks_per_sm, kernel, threads,
                                                              smem);
        }
        return err;
      });
  if (!pd.ok()) return pd.status();
  return (*pd)->blocks_per_sm;
}

// A persistent grid: OptInBlocksPerSm's blocks per SM (at least 1) on each of num_sms SMs, then
// the launch of kernel(args...) on it. `what` names the kernel in errors.
template <typename Kernel, typename... Args>
absl::Status LaunchPersistentGrid(KernelDeviceSetup (&per_device)[kMaxDevices], const char* what,
                                  Kernel kernel, int threads, int smem, int num_sms,
                                  cudaStream_t stream, const Args&... args) {
  const absl::StatusOr<int> blocks = OptInBlocksPerSm(per_device, what, kernel, threads, smem);
  if (!blocks.ok()) return blocks.status();
  const int grid = std::max(1, num_sms * std::max(1, *blocks));
  kernel<<<grid, threads, smem, stream>>>(args...);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR(what);
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
