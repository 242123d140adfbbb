// Helpers to build and parse decode_indexer.v1.Tensor messages (raw little-endian,
// row-major bytes). Header-only; depends only on the generated proto.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "decode_indexer/v1/indexer.pb.h"

namespace decode_indexer::client {

namespace internal {
template <typename T>
v1::Tensor MakeTensor(v1::DType dtype, std::span<const T> values,
                      std::initializer_list<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(values.data(), values.size_bytes());
  return t;
}
}  // namespace internal

// bf16 <-> fp32. FloatToBf16 rounds to nearest even (NaN stays NaN).
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline v1::Tensor F32Tensor(std::span<const float> values, std::initializer_list<int64_t> shape) {
  return internal::MakeTensor(v1::DTYPE_FP32, values, shape);
}
// fp32 values rounded to bf16 on the way.
inline v1::Tensor Bf16Tensor(std::span<const float> values, std::initializer_list<int64_t> shape) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = FloatToBf16(values[i]);
  return internal::MakeTensor(v1::DTYPE_BF16, std::span<const uint16_t>(bits), shape);
}
inline v1::Tensor Bf16BitsTensor(std::span<const uint16_t> bits,
                                 std::initializer_list<int64_t> shape) {
  return internal::MakeTensor(v1::DTYPE_BF16, bits, shape);
}
inline v1::Tensor I32Tensor(std::span<const int32_t> values, std::initializer_list<int64_t> shape) {
  return internal::MakeTensor(v1::DTYPE_INT32, values, shape);
}
inline v1::Tensor I64Tensor(std::span<const int64_t> values, std::initializer_list<int64_t> shape) {
  return internal::MakeTensor(v1::DTYPE_INT64, values, shape);
}
// Raw codes: DTYPE_FP8_E4M3, DTYPE_FP4_E2M1 (packed, shape counts elements) or DTYPE_UE8M0.
inline v1::Tensor CodesTensor(v1::DType dtype, std::span<const uint8_t> bytes,
                              std::initializer_list<int64_t> shape) {
  return internal::MakeTensor(dtype, bytes, shape);
}

inline int64_t NumElements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

// Parses a tensor of `dtype` whose bytes match its shape; T must have the dtype's width.
template <typename T>
absl::StatusOr<std::vector<T>> ParseTensor(const v1::Tensor& t, v1::DType dtype) {
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("tensor: expected ", v1::DType_Name(dtype),
                                                   ", got ", v1::DType_Name(t.dtype())));
  }
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    // Every element takes at least one byte, so more elements than bytes is a mismatch; the
    // check also keeps the product (and the byte count below) from overflowing.
    if (d < 0 || (d > 0 && n > static_cast<int64_t>(t.data().size()) / d)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor: bad shape [", absl::StrJoin(t.shape(), ", "), "]"));
    }
    n *= d;
  }
  if (static_cast<int64_t>(t.data().size()) != n * static_cast<int64_t>(sizeof(T))) {
    return absl::InvalidArgumentError(absl::StrCat("tensor: [", absl::StrJoin(t.shape(), ", "),
                                                   "] needs ", n * sizeof(T), " bytes, got ",
                                                   t.data().size()));
  }
  std::vector<T> out(n);
  if (n > 0) std::memcpy(out.data(), t.data().data(), n * sizeof(T));
  return out;
}
inline absl::StatusOr<std::vector<int32_t>> ParseI32(const v1::Tensor& t) {
  return ParseTensor<int32_t>(t, v1::DTYPE_INT32);
}
inline absl::StatusOr<std::vector<int64_t>> ParseI64(const v1::Tensor& t) {
  return ParseTensor<int64_t>(t, v1::DTYPE_INT64);
}
inline absl::StatusOr<std::vector<float>> ParseF32(const v1::Tensor& t) {
  return ParseTensor<float>(t, v1::DTYPE_FP32);
}

// Decodes ANSWER_ENCODING_DELTA_VARINT (see the proto) into rows x k positions, -1 padded.
inline absl::StatusOr<std::vector<int32_t>> DecodeTopkDelta(const std::string& bytes, int64_t rows,
                                                            int64_t k) {
  // The shape comes from the response: a row takes at least one byte, and the answer is
  // bounded (k up to 2^20, at most 2^28 positions) before anything is allocated.
  if (rows < 0 || k < 0 || k > (int64_t{1} << 20) || rows > static_cast<int64_t>(bytes.size()) ||
      rows * k > (int64_t{1} << 28)) {
    return absl::DataLossError(absl::StrCat("topk_delta: shape [", rows, ", ", k, "] does not fit ",
                                            bytes.size(), " bytes"));
  }
  std::vector<int32_t> out(static_cast<size_t>(rows * k), -1);
  const auto* at = reinterpret_cast<const uint8_t*>(bytes.data());
  const uint8_t* const end = at + bytes.size();
  auto next = [end](const uint8_t*& p, uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 35; shift += 7) {
      if (p >= end) return false;
      const uint8_t b = *p++;
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  for (int64_t r = 0; r < rows; ++r) {
    uint64_t valid = 0;
    if (!next(at, valid) || valid > static_cast<uint64_t>(k)) {
      return absl::DataLossError(absl::StrCat("topk_delta: row ", r, ": bad count"));
    }
    int32_t* row = out.data() + r * k;
    int64_t prev = -1;
    uint64_t i = 0;
    while (i < valid) {
      // Eight one-byte gaps at once (nearly every gap of a top-2048 in 8K+ keys is below 128):
      // one load and one test of their eight high bits; anything else (a longer varint, a
      // row's last few, the end of the bytes) is read varint by varint.
      if (valid - i >= 8 && end - at >= 8) {
        uint64_t w;
        std::memcpy(&w, at, 8);
        if ((w & 0x8080808080808080ull) == 0) {
          for (int j = 0; j < 8; ++j) {
            prev += static_cast<int64_t>((w >> (8 * j)) & 0xFF) + 1;
            row[i + j] = static_cast<int32_t>(prev);  // checked below before anyone reads it
          }
          if (prev > INT32_MAX) return absl::DataLossError("topk_delta: position overflows int32");
          at += 8;
          i += 8;
          continue;
        }
      }
      uint64_t gap = 0;
      if (!next(at, gap)) return absl::DataLossError(absl::StrCat("topk_delta: row ", r, ": cut"));
      prev += static_cast<int64_t>(gap) + 1;
      if (prev > INT32_MAX) return absl::DataLossError("topk_delta: position overflows int32");
      row[i++] = static_cast<int32_t>(prev);
    }
  }
  if (at != end) return absl::DataLossError("topk_delta: trailing bytes");
  return out;
}

}  // namespace decode_indexer::client
