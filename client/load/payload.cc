#include "client/load/payload.h"

#include <algorithm>
#include <cstring>

namespace decode_indexer::load {
namespace {

std::string RandomBytes(std::mt19937_64& rng, size_t n, auto&& make_byte) {
  std::string bytes(n, '\0');
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>(make_byte(rng));
  return bytes;
}

void AppendFloats(const std::vector<float>& values, std::string* out) {
  out->resize(values.size() * sizeof(float));
  std::memcpy(out->data(), values.data(), out->size());
}

}  // namespace

PayloadPool::PayloadPool(uint64_t seed, size_t bytes) {
  std::mt19937_64 rng(seed);
  bytes = std::max<size_t>(bytes, 1 << 16);
  std::uniform_int_distribution<int> any_byte(0, 255);
  fp8_ = RandomBytes(rng, bytes, [&](std::mt19937_64& r) {
    int b = any_byte(r);
    // 0x7F and 0xFF are e4m3's NaNs: the server rejects nothing here, but a NaN code
    // would make every logit NaN. Fold them onto the largest finite codes.
    if ((b & 0x7F) == 0x7F) b -= 1;
    return b;
  });
  fp4_ = RandomBytes(rng, bytes, [&](std::mt19937_64& r) { return any_byte(r); });
  std::uniform_int_distribution<int> exponent(127 - 6, 127 + 3);
  ue8m0_ = RandomBytes(rng, bytes / 8, [&](std::mt19937_64& r) { return exponent(r); });
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> normals(bytes / sizeof(float));
  for (float& v : normals) v = normal(rng);
  AppendFloats(normals, &normals_);
}

void PayloadPool::Cut(const std::string& pool, std::mt19937_64& rng, size_t n, size_t align,
                      std::string* out) const {
  out->resize(n);
  const size_t slots = pool.size() / align;
  size_t offset = (rng() % slots) * align;
  size_t done = 0;
  while (done < n) {
    const size_t take = std::min(n - done, pool.size() - offset);
    std::memcpy(out->data() + done, pool.data() + offset, take);
    done += take;
    offset = 0;
  }
}

void PayloadPool::Fp8Codes(std::mt19937_64& rng, size_t n, std::string* out) const {
  Cut(fp8_, rng, n, 1, out);
}
void PayloadPool::Fp4Codes(std::mt19937_64& rng, size_t n, std::string* out) const {
  Cut(fp4_, rng, n, 1, out);
}
void PayloadPool::Ue8m0(std::mt19937_64& rng, size_t n, std::string* out) const {
  Cut(ue8m0_, rng, n, 1, out);
}
void PayloadPool::Normals(std::mt19937_64& rng, size_t n, std::string* out) const {
  Cut(normals_, rng, n * sizeof(float), sizeof(float), out);
}

void PayloadPool::Uniform(std::mt19937_64& rng, size_t n, float lo, float hi,
                          std::string* out) const {
  // Small arrays (weights, key scales): generated fresh, they are a few KB a step.
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  AppendFloats(values, out);
}

void FillKeys(const PayloadPool& pool, std::mt19937_64& rng, const ServerModel& model,
              v1::CacheFormat format, PayloadFormat payload, int32_t n, v1::Tensor* keys,
              v1::Tensor* scales) {
  const int32_t d = model.head_dim;
  keys->clear_shape();
  keys->add_shape(n);
  keys->add_shape(d);
  scales->Clear();
  if (payload == PayloadFormat::kFp32) {
    keys->set_dtype(v1::DTYPE_FP32);
    pool.Normals(rng, size_t{1} * n * d, keys->mutable_data());
    return;
  }
  if (format == v1::CACHE_FORMAT_FP8) {
    keys->set_dtype(v1::DTYPE_FP8_E4M3);
    pool.Fp8Codes(rng, size_t{1} * n * d, keys->mutable_data());
    scales->set_dtype(v1::DTYPE_FP32);
    scales->add_shape(n);
    pool.Uniform(rng, n, 1.0f / 128, 1.0f / 16, scales->mutable_data());
  } else {
    keys->set_dtype(v1::DTYPE_FP4_E2M1);
    pool.Fp4Codes(rng, size_t{1} * n * d / 2, keys->mutable_data());
    scales->set_dtype(v1::DTYPE_UE8M0);
    scales->add_shape(n);
    scales->add_shape(d / 32);
    pool.Ue8m0(rng, size_t{1} * n * d / 32, scales->mutable_data());
  }
}

void FillQuery(const PayloadPool& pool, std::mt19937_64& rng, const ServerModel& model,
               v1::CacheFormat format, PayloadFormat payload, int32_t rows,
               v1::DecodeStepRequest* request) {
  const int32_t h = model.num_heads;
  const int32_t d = model.head_dim;
  v1::Tensor* q = request->mutable_q();
  q->clear_shape();
  q->add_shape(rows);
  q->add_shape(h);
  q->add_shape(d);
  request->clear_q_scales();
  const size_t elems = size_t{1} * rows * h * d;
  if (payload == PayloadFormat::kFp32) {
    q->set_dtype(v1::DTYPE_FP32);
    pool.Normals(rng, elems, q->mutable_data());
  } else if (format == v1::CACHE_FORMAT_FP8) {
    q->set_dtype(v1::DTYPE_FP8_E4M3);
    pool.Fp8Codes(rng, elems, q->mutable_data());
  } else {
    q->set_dtype(v1::DTYPE_FP4_E2M1);
    pool.Fp4Codes(rng, elems / 2, q->mutable_data());
    v1::Tensor* qs = request->mutable_q_scales();
    qs->set_dtype(v1::DTYPE_UE8M0);
    qs->add_shape(rows);
    qs->add_shape(h);
    qs->add_shape(d / 32);
    pool.Ue8m0(rng, elems / 32, qs->mutable_data());
  }
  v1::Tensor* w = request->mutable_weights();
  w->set_dtype(v1::DTYPE_FP32);
  w->clear_shape();
  w->add_shape(rows);
  w->add_shape(h);
  // Mixed signs as in a trained indexer; folded weights are small.
  pool.Uniform(rng, size_t{1} * rows * h, -0.05f, 0.05f, w->mutable_data());
}

}  // namespace decode_indexer::load
