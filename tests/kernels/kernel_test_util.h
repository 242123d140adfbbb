// Test fixtures for the kernel tests: random decode steps over a shuffled paged cache, and a
// naive double-precision oracle written from the spec, independent of kernels/cpu (the
// decoders of di_reference, its own page addressing). The randomness comes from the test's
// seed (tests/test_seed.h: PerTestRng()): fresh every run, replayed by DI_TEST_SEED.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/types.h"
#include "gtest/gtest.h"
#include "reference/reference.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {

using kernels::CacheFormat;

inline const char* FormatName(CacheFormat f) { return f == CacheFormat::kFp8 ? "fp8" : "fp4"; }

// ---- Independent decoders (spec section 2) -------------------------------------------------

// The decoders of di_reference (reference/reference.h), derived from the bit layouts.
inline double OracleE4M3(uint8_t code) { return reference::DecodeE4M3(code); }
inline double OracleE2M1(uint8_t nibble) { return reference::DecodeE2M1(nibble); }
inline double OracleUE8M0(uint8_t byte) { return reference::DecodeUE8M0(byte); }

// ---- A random decode step ------------------------------------------------------------------

struct SceneSpec {
  CacheFormat format = CacheFormat::kFp8;
  int32_t heads = 16;
  int32_t head_dim = 128;
  int32_t page_size = 64;
  std::vector<int32_t> lengths;    // L_b per request (after this step's keys)
  int32_t next_n = 1;              // rows per request; row j scores L_b - n + j + 1
  uint64_t seed = PerTestRng()();  // the scene's randomness: drawn from the test's seed
};

// Host buffers of one step; the views point into them.
struct Scene {
  SceneSpec spec;
  kernels::CacheGeometry geometry;
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;
  int32_t stride = 0;  // page-table entries per request
  std::vector<int32_t> page_table;
  std::vector<int32_t> row_request, row_length;
  std::vector<uint8_t> q_codes, q_scales;
  std::vector<float> weights;

  int32_t num_rows() const { return static_cast<int32_t>(row_length.size()); }
  int32_t num_requests() const { return static_cast<int32_t>(spec.lengths.size()); }
  kernels::CacheView cache() { return {pool.data(), num_pages, geometry}; }
  kernels::RowBatch rows() {
    kernels::RowBatch b;
    b.num_rows = num_rows();
    b.row_request = row_request.data();
    b.row_length = row_length.data();
    b.page_table = page_table.data();
    b.page_table_stride = stride;
    b.num_requests = num_requests();
    b.max_row_length =
        row_length.empty() ? 0 : *std::max_element(row_length.begin(), row_length.end());
    return b;
  }
  kernels::QView q() {
    return {q_codes.data(), spec.format == CacheFormat::kFp4 ? q_scales.data() : nullptr,
            weights.data(), spec.heads};
  }
};

// A scene's page table laid out as the server's resident tables are (RowBatch::request_slot):
// a row per sequence slot, the requests at shuffled slots of a table twice as tall, and every
// other row holding valid pages of other requests (so a read through the wrong row gives
// wrong keys, not a fault).
struct SlottedTable {
  std::vector<int32_t> table;  // [rows, scene.stride]
  std::vector<int32_t> slots;  // [requests]
};
inline SlottedTable MakeSlottedTable(const Scene& s, std::mt19937_64& rng) {
  const int32_t requests = static_cast<int32_t>(s.spec.lengths.size());
  const int32_t rows = 2 * requests + 1;
  std::vector<int32_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  SlottedTable t;
  t.slots.assign(order.begin(), order.begin() + requests);
  t.table.resize(int64_t{rows} * s.stride);
  for (int32_t r = 0; r < rows; ++r) {  // decoys: request (r + 1) % requests's pages, reversed
    const int32_t* src = s.page_table.data() + int64_t{(r + 1) % requests} * s.stride;
    std::reverse_copy(src, src + s.stride, t.table.begin() + int64_t{r} * s.stride);
  }
  for (int32_t b = 0; b < requests; ++b) {
    std::copy_n(s.page_table.begin() + int64_t{b} * s.stride, s.stride,
                t.table.begin() + int64_t{t.slots[b]} * s.stride);
  }
  return t;
}

// Random floats with a per-vector magnitude spread over several binades, so that the scales
// differ between vectors; never all zeros.
inline void FillVectors(std::mt19937_64& rng, int64_t vectors, int32_t dim, float* out) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-6, 6);
  for (int64_t v = 0; v < vectors; ++v) {
    const float scale = std::ldexp(1.0f, binade(rng));
    for (int32_t d = 0; d < dim; ++d) out[v * dim + d] = normal(rng) * scale;
  }
}

inline Scene MakeScene(const SceneSpec& spec) {
  Scene s;
  s.spec = spec;
  s.geometry = {spec.format, spec.head_dim, spec.page_size};
  std::mt19937_64 rng(spec.seed);
  const int32_t requests = static_cast<int32_t>(spec.lengths.size());
  int32_t max_pages = 1;
  for (int32_t len : spec.lengths) {
    max_pages = std::max(max_pages, (len + spec.page_size - 1) / spec.page_size);
  }
  s.stride = max_pages + 1;  // a spare column that no row may read
  s.num_pages = int64_t{requests} * s.stride + 3;
  s.pool.assign(s.num_pages * s.geometry.page_bytes(), 0);
  std::vector<int32_t> perm(s.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  s.page_table.assign(int64_t{requests} * s.stride, -1);
  for (int64_t i = 0; i < int64_t{requests} * s.stride; ++i) s.page_table[i] = perm[i];

  // Every request's keys, quantized into the cache through InsertKeys.
  for (int32_t b = 0; b < requests; ++b) {
    const int32_t len = spec.lengths[b];
    std::vector<float> keys(int64_t{len} * spec.head_dim);
    FillVectors(rng, len, spec.head_dim, keys.data());
    std::vector<int64_t> slots(len);
    for (int32_t p = 0; p < len; ++p) {
      slots[p] =
          int64_t{s.page_table[int64_t{b} * s.stride + p / spec.page_size]} * spec.page_size +
          p % spec.page_size;
    }
    kernels::KeyInsertArgs insert;
    insert.cache = s.cache();
    insert.num_keys = len;
    insert.keys = keys.data();
    insert.slots = slots.data();
    EXPECT_TRUE(kernels::cpu::InsertKeys(insert).ok());
  }
  for (int32_t b = 0; b < requests; ++b) {
    for (int32_t j = 0; j < spec.next_n; ++j) {
      s.row_request.push_back(b);
      s.row_length.push_back(std::max(1, spec.lengths[b] - spec.next_n + j + 1));
    }
  }
  const int32_t rows = s.num_rows();
  std::vector<float> q(int64_t{rows} * spec.heads * spec.head_dim);
  FillVectors(rng, int64_t{rows} * spec.heads, spec.head_dim, q.data());
  std::vector<float> w_raw(int64_t{rows} * spec.heads);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& w : w_raw) w = normal(rng);
  const int32_t value_bytes = spec.format == CacheFormat::kFp8 ? spec.head_dim : spec.head_dim / 2;
  s.q_codes.assign(int64_t{rows} * spec.heads * value_bytes, 0);
  s.q_scales.assign(int64_t{rows} * spec.heads * (spec.head_dim / 32), 0);
  s.weights.assign(int64_t{rows} * spec.heads, 0.0f);
  kernels::QPrepArgs prep;
  prep.num_rows = rows;
  prep.num_heads = spec.heads;
  prep.head_dim = spec.head_dim;
  prep.q = q.data();
  prep.weights_raw = w_raw.data();
  prep.format = spec.format;
  prep.q_codes = s.q_codes.data();
  prep.q_scales = s.q_scales.data();
  prep.weights_out = s.weights.data();
  EXPECT_TRUE(kernels::cpu::RopeQuantQ(prep).ok());
  return s;
}

// ---- The oracle (spec section 3) -----------------------------------------------------------

// The exact-as-possible logit of row r at position t, from the cache bytes (own addressing).
inline double OracleLogit(const Scene& s, int32_t r, int32_t t) {
  const SceneSpec& sp = s.spec;
  const int32_t b = s.row_request[r];
  const int64_t page = s.page_table[int64_t{b} * s.stride + t / sp.page_size];
  const int64_t o = t % sp.page_size;
  const int32_t d_dim = sp.head_dim;
  const int64_t value_bytes = sp.format == CacheFormat::kFp8 ? d_dim : d_dim / 2;
  const int64_t scale_bytes = sp.format == CacheFormat::kFp8 ? 4 : d_dim / 32;
  const uint8_t* page_base = s.pool.data() + page * sp.page_size * (value_bytes + scale_bytes);
  const uint8_t* k = page_base + o * value_bytes;
  const uint8_t* ks = page_base + sp.page_size * value_bytes + o * scale_bytes;
  double logit = 0.0;
  for (int32_t h = 0; h < sp.heads; ++h) {
    const int64_t rh = int64_t{r} * sp.heads + h;
    double score = 0.0;
    if (sp.format == CacheFormat::kFp8) {
      float k_scale;
      std::memcpy(&k_scale, ks, sizeof(k_scale));
      const uint8_t* q = s.q_codes.data() + rh * d_dim;
      for (int32_t d = 0; d < d_dim; ++d) score += OracleE4M3(q[d]) * OracleE4M3(k[d]);
      score *= k_scale;
    } else {
      const uint8_t* q = s.q_codes.data() + rh * (d_dim / 2);
      const uint8_t* qs = s.q_scales.data() + rh * (d_dim / 32);
      for (int32_t d = 0; d < d_dim; ++d) {
        const uint8_t qn = (d % 2) ? (q[d / 2] >> 4) : (q[d / 2] & 0xF);
        const uint8_t kn = (d % 2) ? (k[d / 2] >> 4) : (k[d / 2] & 0xF);
        score +=
            OracleE2M1(qn) * OracleUE8M0(qs[d / 32]) * OracleE2M1(kn) * OracleUE8M0(ks[d / 32]);
      }
    }
    logit += double{s.weights[rh]} * std::max(score, 0.0);
  }
  return logit;
}

inline std::vector<double> OracleRow(const Scene& s, int32_t r) {
  std::vector<double> out(s.row_length[r]);
  for (int32_t t = 0; t < s.row_length[r]; ++t) out[t] = OracleLogit(s, r, t);
  return out;
}

// The canonical top-k, naively: sort by (logit desc, position asc), first K, ascending.
template <typename T>
std::vector<int32_t> NaiveTopK(const std::vector<T>& logits, const std::vector<int32_t>& pos,
                               int32_t k) {
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
    if (logits[a] != logits[b]) return logits[a] > logits[b];
    return pos[a] < pos[b];
  });
  std::vector<int32_t> out;
  for (int32_t i = 0; i < std::min<int32_t>(k, static_cast<int32_t>(idx.size())); ++i) {
    out.push_back(pos[idx[i]]);
  }
  std::sort(out.begin(), out.end());
  out.resize(k, -1);
  return out;
}

inline std::vector<int32_t> Iota(int32_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace decode_indexer::testing
