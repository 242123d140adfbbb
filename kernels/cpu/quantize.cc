// Quantizers, RoPE, Hadamard, key insertion and rope_quant_q: the host twins of the CUDA
// preparation kernels. The per-element math lives in quant.h so that both sides share it.
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/quant.h"

namespace decode_indexer::kernels::cpu {
namespace {

bool IsPowerOfTwo(int32_t n) { return n > 0 && (n & (n - 1)) == 0; }

// Loads one D-vector of an unquantized input (kF32 or kBF16) as float.
void LoadVector(ElemType type, const void* base, int64_t index, int32_t n, float* out) {
  if (type == ElemType::kF32) {
    std::memcpy(out, static_cast<const float*>(base) + index * n, sizeof(float) * n);
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(base) + index * n;
  for (int32_t i = 0; i < n; ++i) out[i] = BF16ToFloat(src[i]);
}

}  // namespace

float QuantizeFp8(const float* values, int32_t n, uint8_t* codes) {
  float amax = 0.0f;
  for (int32_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(values[i]));
  const float s = Fp8Scale(amax);
  for (int32_t i = 0; i < n; ++i) codes[i] = EncodeE4M3(values[i] / s);
  return s;
}

void QuantizeFp4(const float* values, int32_t n, uint8_t* packed, uint8_t* scales) {
  for (int32_t g = 0; g < n / 32; ++g) {
    const float* v = values + g * 32;
    float amax = 0.0f;
    for (int32_t i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(v[i]));
    const float s = Fp4Scale(amax);
    scales[g] = EncodeUE8M0(s);
    for (int32_t i = 0; i < 32; i += 2) {
      packed[g * 16 + i / 2] = PackFp4(EncodeE2M1(v[i] / s), EncodeE2M1(v[i + 1] / s));
    }
  }
}

void HadamardInPlace(float* x, int32_t n) {
  for (int32_t h = 1; h < n; h *= 2) {
    for (int32_t i = 0; i < n; i += 2 * h) {
      for (int32_t j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int32_t i = 0; i < n; ++i) x[i] *= norm;
}

void ApplyRope(float* x, int64_t position, const RopeConfig& rope) {
  if (rope.style == RopeStyle::kNone) return;
  const int32_t half = rope.rope_dim / 2;
  for (int32_t i = 0; i < half; ++i) {
    const int32_t a =
        rope.style == RopeStyle::kNeox ? rope.dim_offset + i : rope.dim_offset + 2 * i;
    const int32_t b = rope.style == RopeStyle::kNeox ? a + half : a + 1;
    const double angle = static_cast<double>(position) * rope.inv_freq[i];
    // cos/sin rounded to float first: the rotation every backend reproduces.
    const double c = static_cast<float>(std::cos(angle));
    const double s = static_cast<float>(std::sin(angle));
    const double x1 = x[a];
    const double x2 = x[b];
    x[a] = static_cast<float>(x1 * c - x2 * s);
    x[b] = static_cast<float>(x2 * c + x1 * s);
  }
}

float WeightScale(int32_t num_heads, int32_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(num_heads) * head_dim));
}

uint8_t* EntryValues(const CacheView& cache, int64_t slot_index) {
  const CacheGeometry& g = cache.geometry;
  return cache.base + (slot_index / g.page_size) * g.page_bytes() +
         (slot_index % g.page_size) * g.value_bytes();
}

uint8_t* EntryScale(const CacheView& cache, int64_t slot_index) {
  const CacheGeometry& g = cache.geometry;
  return cache.base + (slot_index / g.page_size) * g.page_bytes() +
         static_cast<int64_t>(g.page_size) * g.value_bytes() +
         (slot_index % g.page_size) * g.scale_bytes();
}

int64_t PositionSlot(const RowBatch& rows, const CacheGeometry& geometry, int32_t request,
                     int64_t position) {
  const int32_t page =
      rows.page_table[PageRowOffset(rows, request) + position / geometry.page_size];
  return static_cast<int64_t>(page) * geometry.page_size + position % geometry.page_size;
}

absl::Status InsertKeys(const KeyInsertArgs& args) {
  const CacheGeometry& g = args.cache.geometry;
  const int32_t d_dim = g.head_dim;
  if (args.num_edits < 0 ||
      (args.num_edits > 0 &&
       (args.page_table == nullptr || args.edit_index == nullptr || args.edit_pages == nullptr))) {
    return absl::InvalidArgumentError("InsertKeys: bad page-table edits");
  }
  for (int32_t i = 0; i < args.num_edits; ++i) {
    if (args.edit_index[i] >= 0) args.page_table[args.edit_index[i]] = args.edit_pages[i];
  }
  if (args.num_keys == 0) return absl::OkStatus();
  if (args.num_keys < 0 || args.keys == nullptr || args.slots == nullptr ||
      args.cache.base == nullptr) {
    return absl::InvalidArgumentError("InsertKeys: missing keys, slots or cache");
  }
  if (g.format == CacheFormat::kFp4 && d_dim % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("FP4 cache head_dim ", d_dim));
  }
  const bool unquantized = args.key_type == ElemType::kF32 || args.key_type == ElemType::kBF16;
  const bool matches = (args.key_type == ElemType::kFp8E4M3 && g.format == CacheFormat::kFp8) ||
                       (args.key_type == ElemType::kFp4E2M1 && g.format == CacheFormat::kFp4);
  if (!unquantized && !matches) {
    return absl::InvalidArgumentError("InsertKeys: key type does not match the cache format");
  }
  if (!unquantized && args.key_scales == nullptr) {
    return absl::InvalidArgumentError("InsertKeys: quantized keys need key_scales");
  }
  if (unquantized && args.hadamard && !IsPowerOfTwo(d_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("Hadamard needs a power of two, D ", d_dim));
  }
  const int64_t capacity = args.cache.num_pages * g.page_size;
  for (int32_t i = 0; i < args.num_keys; ++i) {
    if (args.slots[i] < 0 || args.slots[i] >= capacity) {
      return absl::InvalidArgumentError(absl::StrCat("slots[", i, "] = ", args.slots[i]));
    }
  }
  std::vector<float> key(d_dim);
  for (int32_t i = 0; i < args.num_keys; ++i) {
    uint8_t* values = EntryValues(args.cache, args.slots[i]);
    uint8_t* scale = EntryScale(args.cache, args.slots[i]);
    if (unquantized) {
      LoadVector(args.key_type, args.keys, i, d_dim, key.data());
      if (args.hadamard) HadamardInPlace(key.data(), d_dim);
      if (g.format == CacheFormat::kFp8) {
        const float s = QuantizeFp8(key.data(), d_dim, values);
        std::memcpy(scale, &s, sizeof(s));
      } else {
        QuantizeFp4(key.data(), d_dim, values, scale);
      }
    } else if (g.format == CacheFormat::kFp8) {
      std::memcpy(values, static_cast<const uint8_t*>(args.keys) + int64_t{i} * d_dim, d_dim);
      std::memcpy(scale, static_cast<const float*>(args.key_scales) + i, sizeof(float));
    } else {
      std::memcpy(values, static_cast<const uint8_t*>(args.keys) + int64_t{i} * (d_dim / 2),
                  d_dim / 2);
      std::memcpy(scale, static_cast<const uint8_t*>(args.key_scales) + int64_t{i} * (d_dim / 32),
                  d_dim / 32);
    }
  }
  return absl::OkStatus();
}

absl::Status RopeQuantQ(const QPrepArgs& args) {
  const int32_t h_dim = args.num_heads;
  const int32_t d_dim = args.head_dim;
  if (args.num_rows == 0) return absl::OkStatus();
  if (args.num_rows < 0 || h_dim <= 0 || d_dim <= 0 || args.q == nullptr ||
      args.weights_raw == nullptr || args.q_codes == nullptr || args.weights_out == nullptr) {
    return absl::InvalidArgumentError("RopeQuantQ: missing inputs or outputs");
  }
  if (args.q_type != ElemType::kF32 && args.q_type != ElemType::kBF16) {
    return absl::InvalidArgumentError("RopeQuantQ: q must be kF32 or kBF16");
  }
  if (args.format == CacheFormat::kFp4 && (d_dim % 32 != 0 || args.q_scales == nullptr)) {
    return absl::InvalidArgumentError("RopeQuantQ: FP4 needs D % 32 == 0 and q_scales");
  }
  const bool rope = args.positions != nullptr && args.rope.style != RopeStyle::kNone;
  if (rope &&
      (args.rope.inv_freq == nullptr || args.rope.rope_dim <= 0 || args.rope.rope_dim % 2 != 0 ||
       args.rope.dim_offset < 0 || args.rope.dim_offset + args.rope.rope_dim > d_dim)) {
    return absl::InvalidArgumentError("RopeQuantQ: rope span outside the head");
  }
  if (args.hadamard && !IsPowerOfTwo(d_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("Hadamard needs a power of two, D ", d_dim));
  }
  const float c = WeightScale(h_dim, d_dim);
  std::vector<float> x(d_dim);
  for (int32_t r = 0; r < args.num_rows; ++r) {
    for (int32_t h = 0; h < h_dim; ++h) {
      const int64_t v = static_cast<int64_t>(r) * h_dim + h;
      LoadVector(args.q_type, args.q, v, d_dim, x.data());
      if (rope) ApplyRope(x.data(), args.positions[r], args.rope);
      if (args.hadamard) HadamardInPlace(x.data(), d_dim);
      if (args.format == CacheFormat::kFp8) {
        const float s = QuantizeFp8(x.data(), d_dim, args.q_codes + v * d_dim);
        args.weights_out[v] = (args.weights_raw[v] * c) * s;
      } else {
        QuantizeFp4(x.data(), d_dim, args.q_codes + v * (d_dim / 2),
                    args.q_scales + v * (d_dim / 32));
        args.weights_out[v] = args.weights_raw[v] * c;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cpu
