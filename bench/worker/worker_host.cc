// Host twins of worker_kernels.cu (the CPU smoke run and the prefill's keys).
#include "bench/worker/worker_kernels.h"

namespace decode_indexer::bench_worker {

void ProduceHost(const Shape& s, int32_t token, int32_t layer, uint8_t* q, float* weights,
                 uint8_t* keys, float* key_scales) {
  const int64_t nq = int64_t(s.rows) * s.heads * s.dim;
  for (int64_t i = 0; i < nq; ++i) q[i] = Fp8Code(ValueHash(1, token, layer, i));
  for (int64_t j = 0; j < int64_t(s.rows) * s.heads; ++j) {
    weights[j] = WeightValue(ValueHash(2, token, layer, j));
  }
  ProduceKeysHost(s, token, layer, keys, key_scales);
}

void ProduceKeysHost(const Shape& s, int32_t token, int32_t layer, uint8_t* keys,
                     float* key_scales) {
  for (int64_t j = 0; j < int64_t(s.rows) * s.dim; ++j) {
    keys[j] = Fp8Code(ValueHash(3, token, layer, j));
  }
  for (int64_t j = 0; j < s.rows; ++j) key_scales[j] = KeyScaleValue(ValueHash(4, token, layer, j));
}

void FillKvHost(uint32_t* kv, int32_t rows, int64_t kv_len) {
  const int64_t n = int64_t(rows) * kv_len * 4;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = ValueHash(5, 0, 0, uint64_t(i) / 2);
    kv[i] = (i & 1) ? uint32_t(h >> 32) : uint32_t(h);
  }
}

void AttentionHost(const Shape& s, const int32_t* answer, const uint32_t* kv, int64_t kv_len,
                   int64_t length, AttnOut* out) {
  for (int32_t r = 0; r < s.rows; ++r) {
    AttnOut o;
    for (int32_t j = 0; j < s.topk; ++j) {
      const int32_t idx = answer[int64_t(r) * s.topk + j];
      if (idx == -1) continue;
      if (idx < 0 || idx >= length || idx >= kv_len) {
        ++o.bad;
        continue;
      }
      const uint32_t* v = kv + (int64_t(r) * kv_len + idx) * 4;
      o.sum += v[0] + v[1] + v[2] + v[3];
      o.hash += IndexHash(idx);
      ++o.valid;
    }
    out[r] = o;
  }
}

void FillPrefillHost(uint64_t first, int64_t count, int32_t dim, uint8_t* keys, float* scales) {
  // One hash a word of 8 codes: the prefill is rows x context x D bytes (hundreds of MB).
  const int64_t words = count * dim / 8;
  for (int64_t w = 0; w < words; ++w) {
    uint64_t h = ValueHash(6, 0, 0, first * dim / 8 + uint64_t(w));
    for (int b = 0; b < 8; ++b) {
      keys[w * 8 + b] = Fp8Code(h);
      h >>= 8;
    }
  }
  for (int64_t i = 0; i < count; ++i) scales[i] = KeyScaleValue(ValueHash(4, -1, 0, first + i));
}

}  // namespace decode_indexer::bench_worker
