// The radix top-k's first level (sm90_radix_topk.cu), shared with the logits kernels that can
// build its histogram in their epilogue (the threshold filter, PagedLogitsArgs::row_histogram).
//
// A logit goes to one of kTopKBins (2048) buckets, a monotone function of its order-preserving
// key. Not the key's top 11 bits: those are sign, exponent and 2 mantissa bits, a quarter of an
// octave per bucket, so the bucket holding the K-th largest logit can hold a good part of a row
// whose logits span a few octaves, and the candidates (the entries at or above that bucket)
// would not fit in shared memory. Here each sign gets 1024 buckets: 32 octaves [2^-16, 2^16)
// of 32 steps each (5 mantissa bits, ~2% wide), magnitudes outside clamped into the end
// buckets. Exactness never depends on the choice (the later passes look at every key bit),
// only the number of candidates does.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DI_TOPK_HD __host__ __device__
#else
#define DI_TOPK_HD
#endif

namespace decode_indexer::kernels::cuda {

inline constexpr uint32_t kTopKBucketMinExp = 111;  // biased exponent of 2^-16
// The top-k's sample (and the threshold-filter histogram's): the entries at positions that are
// multiples of this.
inline constexpr int kTopKSampleStride = 16;
inline constexpr uint32_t kTopKBucketsPerSign = 1024;

// 31-bit magnitude (exponent, mantissa) -> 0..1023: (exponent, top 5 mantissa bits) minus the
// window's start, clamped. Non-decreasing in the magnitude.
DI_TOPK_HD constexpr uint32_t TopKMagnitudeBucket(uint32_t mag) {
  const int32_t v = static_cast<int32_t>(mag >> 18) - static_cast<int32_t>(kTopKBucketMinExp * 32);
  return v < 0 ? 0u : v > 1023 ? 1023u : static_cast<uint32_t>(v);
}

// Order-preserving key (larger float, larger key; see TopKOrderedKey) -> bucket 0..2047,
// non-decreasing in the key: negative values 0..1023, the others 1024..2047.
DI_TOPK_HD constexpr uint32_t TopKBucket(uint32_t key) {
  return (key >> 31) ? kTopKBucketsPerSign + TopKMagnitudeBucket(key & 0x7FFFFFFFu)
                     : kTopKBucketsPerSign - 1u - TopKMagnitudeBucket(~key & 0x7FFFFFFFu);
}

// A bucket that no clamping reaches: all its keys share their top 14 bits (key >> 18), so the
// radix passes that refine it need only the 18 bits below.
DI_TOPK_HD constexpr bool TopKBucketIsInterior(uint32_t bucket) {
  const uint32_t m = bucket >= kTopKBucketsPerSign ? bucket - kTopKBucketsPerSign
                                                   : kTopKBucketsPerSign - 1u - bucket;
  return m != 0u && m != 1023u;
}
// key >> 18 of every key in an interior bucket.
DI_TOPK_HD constexpr uint32_t TopKInteriorBucketPrefix(uint32_t bucket) {
  return bucket >= kTopKBucketsPerSign
             ? (1u << 13) | (bucket - kTopKBucketsPerSign + kTopKBucketMinExp * 32)
             : ~(kTopKBucketsPerSign - 1u - bucket + kTopKBucketMinExp * 32) & 0x1FFFu;
}

#if defined(__CUDACC__)
// Larger float -> larger key; -0 and +0 are the same value (and the same key). A NaN of either
// sign takes -inf's key, as the CPU twin ranks it (kernels/cpu/engine.cc, SelectionRank): left
// as its bits, a +NaN would outrank +inf and the backends would answer differently.
__device__ __forceinline__ uint32_t TopKOrderedKey(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u << 1) == 0u) u = 0u;
  if ((u << 1) > 0xFF000000u) u = 0xFF800000u;  // NaN -> -inf
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
#endif

}  // namespace decode_indexer::kernels::cuda
