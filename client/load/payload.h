// Random but valid payloads for prefill and decode steps, cut from pools generated once so
// that a step costs the client a copy, not a random-number generator per byte.
//
// Pre-quantized payloads (the default, what a serving frontend sends: about 8 KB of FP8 q a
// row at H=64) are random codes: every e4m3 byte except the two NaNs, every e2m1 nibble,
// and power-of-two scales near 1. Unquantized payloads are fp32 normals.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "client/load/server_model.h"
#include "decode_indexer/v1/indexer.pb.h"

namespace decode_indexer::load {

enum class PayloadFormat { kQuantized, kFp32 };

class PayloadPool {
 public:
  PayloadPool(uint64_t seed, size_t bytes);

  // n bytes starting at a random offset (wrapping): valid e4m3 codes.
  void Fp8Codes(std::mt19937_64& rng, size_t n, std::string* out) const;
  // Any byte (two e2m1 codes).
  void Fp4Codes(std::mt19937_64& rng, size_t n, std::string* out) const;
  // n ue8m0 bytes in [2^-6, 2^3].
  void Ue8m0(std::mt19937_64& rng, size_t n, std::string* out) const;
  // n little-endian fp32 values: normal(0, 1), or in [lo, hi) for weights and scales.
  void Normals(std::mt19937_64& rng, size_t n, std::string* out) const;
  void Uniform(std::mt19937_64& rng, size_t n, float lo, float hi, std::string* out) const;

 private:
  void Cut(const std::string& pool, std::mt19937_64& rng, size_t n, size_t align,
           std::string* out) const;

  std::string fp8_;
  std::string fp4_;
  std::string ue8m0_;
  std::string normals_;
};

// Fills `keys` (and `scales`) with n new keys for a cache of `format` in the proto's forms.
void FillKeys(const PayloadPool& pool, std::mt19937_64& rng, const ServerModel& model,
              v1::CacheFormat format, PayloadFormat payload, int32_t n, v1::Tensor* keys,
              v1::Tensor* scales);

// Fills q (+ q_scales for pre-quantized FP4) and weights of a step of `rows` rows.
void FillQuery(const PayloadPool& pool, std::mt19937_64& rng, const ServerModel& model,
               v1::CacheFormat format, PayloadFormat payload, int32_t rows,
               v1::DecodeStepRequest* request);

}  // namespace decode_indexer::load
