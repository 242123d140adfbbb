// Plain types shared by every backend: element types, cache formats and the paged cache
// layout of spec section 4. No gRPC, no threads, no sequences here.
#pragma once

#include <cstdint>

namespace decode_indexer::kernels {

enum class CacheFormat : int32_t { kFp8 = 1, kFp4 = 2 };

// Element type of an input buffer handed to a kernel.
enum class ElemType : int32_t {
  kF32 = 1,
  kBF16 = 2,
  kFp8E4M3 = 3,
  kFp4E2M1 = 4,  // two codes a byte, element 2i in the low nibble
  kUE8M0 = 5,
  kI32 = 6,
  kI64 = 7,
};

enum class RopeStyle : int32_t {
  kNone = 0,
  kNeox = 1,         // pairs (i, i + rope_dim/2) inside the rotated span
  kInterleaved = 2,  // pairs (2i, 2i + 1) inside the rotated span
};

// Geometry of one paged cache pool. Inside a page all values come first, then all scales:
// entry o's values at byte o * value_bytes(), its scale at page_size * value_bytes() +
// o * scale_bytes(). Never index a page as [entry][entry_bytes].
struct CacheGeometry {
  CacheFormat format = CacheFormat::kFp8;
  int32_t head_dim = 128;
  int32_t page_size = 64;

  constexpr int32_t value_bytes() const {
    return format == CacheFormat::kFp8 ? head_dim : head_dim / 2;
  }
  // FP8: one fp32 scale per entry; FP4: one ue8m0 byte per 32 dims.
  constexpr int32_t scale_bytes() const { return format == CacheFormat::kFp8 ? 4 : head_dim / 32; }
  constexpr int32_t entry_bytes() const { return value_bytes() + scale_bytes(); }
  constexpr int64_t page_bytes() const { return int64_t{page_size} * entry_bytes(); }
};

// A cache pool in a backend's memory: num_pages pages of geometry.page_bytes() each.
struct CacheView {
  uint8_t* base = nullptr;
  int64_t num_pages = 0;
  CacheGeometry geometry;
};

// The RoPE applied to q (spec section 1). inv_freq has rope_dim / 2 entries, computed once
// on the host (YaRN or plain) and placed in the backend's memory. Angles are
// double(position) * inv_freq[i]; cos and sin are taken in double and rounded to float so
// that every backend rotates identically.
struct RopeConfig {
  RopeStyle style = RopeStyle::kNone;
  int32_t dim_offset = 0;  // first rotated dim
  int32_t rope_dim = 0;    // rotated dims (even)
  const double* inv_freq = nullptr;
};

}  // namespace decode_indexer::kernels
