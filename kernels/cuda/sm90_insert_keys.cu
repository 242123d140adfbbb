// Key insert (spec sections 2 and 4): quantize-and-cache of unquantized keys (optional
// Hadamard) or a copy of pre-quantized ones, into the paged layout. One warp per key.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_warp_quant.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

__global__ void __launch_bounds__(kWarpKernelThreads) InsertKeysKernel(const KeyInsertArgs a) {
  // The page-table edits (no two name one index): block 0's threads.
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < a.num_edits; i += blockDim.x) {
      const int32_t at = a.edit_index[i];
      if (at >= 0) a.page_table[at] = a.edit_pages[i];
    }
  }
  const int key = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (key >= a.num_keys) return;
  const CacheGeometry& geo = a.cache.geometry;
  const int64_t slot = a.slots[key];
  uint8_t* page = a.cache.base + (slot / geo.page_size) * geo.page_bytes();
  const int64_t o = slot % geo.page_size;
  uint8_t* values = page + o * geo.value_bytes();
  uint8_t* scale = page + int64_t{geo.page_size} * geo.value_bytes() + o * geo.scale_bytes();
  const bool fp8 = geo.format == CacheFormat::kFp8;
  if (a.key_type == ElemType::kF32 || a.key_type == ElemType::kBF16) {
    float x[4];
    WarpLoadVector(a.key_type, a.keys, key, lane, x);
    if (a.hadamard) WarpHadamard(x, lane);
    if (fp8) {
      const float s = WarpQuantizeFp8(x, lane, values);
      if (lane == 0) *reinterpret_cast<float*>(scale) = s;
    } else {
      WarpQuantizeFp4(x, lane, values, scale);
    }
  } else if (fp8) {
    reinterpret_cast<uint32_t*>(values)[lane] =
        reinterpret_cast<const uint32_t*>(a.keys)[int64_t{key} * 32 + lane];
    if (lane == 0) {
      *reinterpret_cast<float*>(scale) = static_cast<const float*>(a.key_scales)[key];
    }
  } else {
    reinterpret_cast<uint16_t*>(values)[lane] =
        reinterpret_cast<const uint16_t*>(a.keys)[int64_t{key} * 32 + lane];
    if (lane < 4) scale[lane] = static_cast<const uint8_t*>(a.key_scales)[int64_t{key} * 4 + lane];
  }
}

}  // namespace

absl::Status LaunchInsertKeys(const KeyInsertArgs& args, cudaStream_t stream) {
  if (args.num_edits < 0 ||
      (args.num_edits > 0 &&
       (args.page_table == nullptr || args.edit_index == nullptr || args.edit_pages == nullptr))) {
    return absl::InvalidArgumentError("InsertKeys: bad page-table edits");
  }
  if (args.num_keys == 0 && args.num_edits == 0) return absl::OkStatus();
  const CacheGeometry& geo = args.cache.geometry;
  if (geo.head_dim != kWarpVectorDim) {
    return absl::UnimplementedError(
        absl::StrCat("InsertKeys: head dim ", geo.head_dim, " (the CUDA kernels need 128)"));
  }
  const bool unquantized = args.key_type == ElemType::kF32 || args.key_type == ElemType::kBF16;
  const bool matches = (args.key_type == ElemType::kFp8E4M3 && geo.format == CacheFormat::kFp8) ||
                       (args.key_type == ElemType::kFp4E2M1 && geo.format == CacheFormat::kFp4);
  if (args.num_keys < 0 ||
      (args.num_keys > 0 &&
       (args.keys == nullptr || args.slots == nullptr || args.cache.base == nullptr ||
        (!unquantized && !matches) || (!unquantized && args.key_scales == nullptr)))) {
    return absl::InvalidArgumentError("InsertKeys: bad keys, slots, cache or key type");
  }
  const int warps_per_block = kWarpKernelThreads / 32;
  const int grid = std::max(1, (args.num_keys + warps_per_block - 1) / warps_per_block);
  InsertKeysKernel<<<grid, kWarpKernelThreads, 0, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch InsertKeysKernel");
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cuda
