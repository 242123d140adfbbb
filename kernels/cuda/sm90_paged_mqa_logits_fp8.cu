// The production instantiations of the FP8 tensor-core paged MQA logits kernel
// (sm90_paged_mqa_logits_fp8.cuh; its rows per pass, blocks per SM, ring slots and weight
// placement chosen in sm90_heuristics.h) and the tensor map its TMA producer reads pages through.
#include "kernels/cuda/sm90_paged_mqa_logits_fp8.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/sm90_heuristics.h"

namespace decode_indexer::kernels::cuda {
namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

}  // namespace

// The cache's page codes as a 3-D tensor for the TMA unit: [pages][64 keys][128 bytes], a page
// every kPipePageBytes (its scales follow its codes), one page a box, written into shared memory
// in the 128B swizzle (wgmma's SW128 K-major layout in a 1024-byte aligned slot). Encoded on
// the host (no driver round trip); the last map of this thread is reused while the cache is.
absl::StatusOr<CUtensorMap> PageValuesTensorMap(const CacheView& cache) {
  thread_local const void* last_base = nullptr;
  thread_local int64_t last_pages = -1;
  thread_local CUtensorMap last_map;
  if (cache.base == last_base && cache.num_pages == last_pages) return last_map;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) {
    return absl::InternalError("paged mqa logits (fp8): cuTensorMapEncodeTiled is not available");
  }
  if (cache.base == nullptr || cache.num_pages <= 0 ||
      reinterpret_cast<uintptr_t>(cache.base) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged mqa logits (fp8): cache.base must be a 16-byte aligned pool of at least one page "
        "(got ",
        cache.num_pages, " pages)"));
  }
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kMqaHeadDim),
                              static_cast<cuuint64_t>(kMqaTileKeys),
                              static_cast<cuuint64_t>(cache.num_pages)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kMqaHeadDim),
                                 static_cast<cuuint64_t>(kPipePageBytes)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kMqaHeadDim),
                             static_cast<cuuint32_t>(kMqaTileKeys), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, cache.base, dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("paged mqa logits (fp8): cuTensorMapEncodeTiled failed (CUresult ", r, ")"));
  }
  last_base = cache.base;
  last_pages = cache.num_pages;
  last_map = map;
  return map;
}

namespace {

template <int kRows, bool kOwnSchedule>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return fp8_logits::Launch<kRows, kOwnSchedule, PipeFp8MinBlocks(kRows), kPipeFp8Stages,
                            kPipeFp8WeightRegs>(args, num_sms, stream);
}

template <bool kOwnSchedule>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    return LaunchTyped<decltype(rows)::value, kOwnSchedule>(args, num_sms, stream);
  });
}

}  // namespace

absl::Status LaunchPagedMqaLogitsFp8(const PagedLogitsArgs& args, int num_sms,
                                     cudaStream_t stream) {
  return DenseComputesOwnSchedule(args.rows) ? LaunchRows<true>(args, num_sms, stream)
                                             : LaunchRows<false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
