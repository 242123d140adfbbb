// The independent reference (see reference.h). Deliberately naive: clarity over speed.
#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <numeric>
#include <sstream>
#include <unordered_map>

namespace decode_indexer::reference {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The nearest of `count` magnitudes (table[c] = decode(c) >= 0, ascending in c), ties to
// the even code.
uint8_t NearestMagnitude(double a, int count, const double* table) {
  int best = 0;
  double best_err = std::fabs(a - table[0]);
  for (int c = 1; c < count; ++c) {
    const double err = std::fabs(a - table[c]);
    if (err < best_err || (err == best_err && (c % 2) == 0 && (best % 2) != 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

int32_t ExponentOf(double power_of_two) { return std::ilogb(power_of_two); }

}  // namespace

double DecodeE4M3(uint8_t code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  if (e == 15 && m == 7) return kNaN;
  if (e == 0) return sign * std::ldexp(m / 8.0, -6);
  return sign * std::ldexp(1.0 + m / 8.0, e - 7);
}

double DecodeE2M1(uint8_t nibble) {
  const double sign = (nibble & 0x8) ? -1.0 : 1.0;
  const int e = (nibble >> 1) & 0x3;
  const int m = nibble & 0x1;
  if (e == 0) return sign * (m / 2.0);
  return sign * std::ldexp(1.0 + m / 2.0, e - 1);
}

double DecodeUE8M0(uint8_t byte) {
  if (byte == 255) return kNaN;
  return std::ldexp(1.0, byte - 127);
}

uint8_t EncodeE4M3(double x) {
  // 0x7F is NaN: magnitudes 0x00..0x7E.
  static const std::vector<double> table = [] {
    std::vector<double> t(0x7F);
    for (int c = 0; c < 0x7F; ++c) t[c] = DecodeE4M3(static_cast<uint8_t>(c));
    return t;
  }();
  const uint8_t mag = NearestMagnitude(std::fabs(x), 0x7F, table.data());
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | mag);
}

uint8_t EncodeE2M1(double x) {
  static const std::vector<double> table = [] {
    std::vector<double> t(8);
    for (int c = 0; c < 8; ++c) t[c] = DecodeE2M1(static_cast<uint8_t>(c));
    return t;
  }();
  const uint8_t mag = NearestMagnitude(std::fabs(x), 8, table.data());
  return static_cast<uint8_t>((std::signbit(x) ? 0x8 : 0) | mag);
}

double ScaleFor(float amax, double max_code) {
  const double a = std::max(amax, 1e-4f);
  int e = std::ilogb(a / max_code);
  while (std::ldexp(max_code, e) < a) ++e;
  while (std::ldexp(max_code, e - 1) >= a) --e;
  return std::ldexp(1.0, e);
}

float QuantizeFp8(const float* v, int32_t d, uint8_t* codes) {
  float amax = 0.0f;
  for (int32_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(v[i]));
  const double s = ScaleFor(amax, 448.0);
  for (int32_t i = 0; i < d; ++i) codes[i] = EncodeE4M3(v[i] / s);
  return static_cast<float>(s);
}

void QuantizeFp4(const float* v, int32_t d, uint8_t* packed, uint8_t* scales) {
  std::memset(packed, 0, static_cast<size_t>(d / 2));
  for (int32_t g = 0; g < d / 32; ++g) {
    float amax = 0.0f;
    for (int32_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[g * 32 + i]));
    const double s = ScaleFor(amax, 6.0);
    scales[g] = static_cast<uint8_t>(ExponentOf(s) + 127);
    for (int32_t i = 0; i < 32; ++i) {
      const int32_t idx = g * 32 + i;
      const uint8_t code = EncodeE2M1(v[idx] / s);
      packed[idx / 2] |= static_cast<uint8_t>((idx % 2) ? code << 4 : code);
    }
  }
}

void Hadamard(float* x, int32_t n) {
  for (int32_t len = 1; len < n; len <<= 1) {
    for (int32_t start = 0; start < n; start += 2 * len) {
      for (int32_t i = start; i < start + len; ++i) {
        const float lo = x[i], hi = x[i + len];
        x[i] = lo + hi;
        x[i + len] = lo - hi;
      }
    }
  }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int32_t i = 0; i < n; ++i) x[i] = x[i] * norm;
}

std::vector<double> InvFreq(const Rope& rope) {
  const int32_t dim = rope.rope_dim;
  std::vector<double> f(std::max(0, dim / 2));
  for (int32_t i = 0; i < dim / 2; ++i) {
    f[i] = 1.0 / std::pow(rope.theta, static_cast<double>(2 * i) / dim);
  }
  if (!rope.yarn || dim <= 0) return f;
  // DeepSeek-V3: find_correction_range, then a linear ramp over the pair index.
  auto correction_dim = [&](double rotations) {
    return dim *
           std::log(static_cast<double>(rope.yarn_original) /
                    (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(rope.theta));
  };
  double low = std::max(std::floor(correction_dim(rope.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(rope.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int32_t i = 0; i < dim / 2; ++i) {
    const double smooth = 1.0 - std::clamp((i - low) / (high - low), 0.0, 1.0);
    f[i] = f[i] / rope.yarn_factor * (1.0 - smooth) + f[i] * smooth;
  }
  return f;
}

void ApplyRope(float* x, int64_t position, const Rope& rope, const std::vector<double>& inv_freq) {
  if (rope.style == RopeStyle::kNone) return;
  const int32_t half = rope.rope_dim / 2;
  for (int32_t i = 0; i < half; ++i) {
    const int32_t a =
        rope.style == RopeStyle::kNeox ? rope.dim_offset + i : rope.dim_offset + 2 * i;
    const int32_t b = rope.style == RopeStyle::kNeox ? a + half : a + 1;
    const double angle = static_cast<double>(position) * inv_freq[i];
    const double cs = static_cast<float>(std::cos(angle));
    const double sn = static_cast<float>(std::sin(angle));
    const double xa = x[a], xb = x[b];
    x[a] = static_cast<float>(xa * cs - xb * sn);
    x[b] = static_cast<float>(xb * cs + xa * sn);
  }
}

void Cache::AppendFp8(const uint8_t* codes, const uint8_t* scale_bytes, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    float s;
    std::memcpy(&s, scale_bytes + 4 * static_cast<size_t>(i), 4);
    for (int32_t d = 0; d < dim_; ++d) {
      values_.push_back(DecodeE4M3(codes[static_cast<size_t>(i) * dim_ + d]) * s);
    }
  }
}

void Cache::AppendFp4(const uint8_t* packed, const uint8_t* scales, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    const uint8_t* p = packed + static_cast<size_t>(i) * (dim_ / 2);
    const uint8_t* s = scales + static_cast<size_t>(i) * (dim_ / 32);
    for (int32_t d = 0; d < dim_; ++d) {
      const uint8_t nib = (d % 2) ? (p[d / 2] >> 4) : (p[d / 2] & 0xF);
      values_.push_back(DecodeE2M1(nib) * DecodeUE8M0(s[d / 32]));
    }
  }
}

void Cache::AppendFloat(const float* values, int32_t n, bool hadamard) {
  std::vector<float> x(dim_);
  std::vector<uint8_t> codes(dim_), scales(dim_ / 32 + 4);
  for (int32_t i = 0; i < n; ++i) {
    std::copy(values + static_cast<size_t>(i) * dim_, values + static_cast<size_t>(i + 1) * dim_,
              x.begin());
    if (hadamard) Hadamard(x.data(), dim_);
    if (format_ == Format::kFp8) {
      const float s = QuantizeFp8(x.data(), dim_, codes.data());
      uint8_t sb[4];
      std::memcpy(sb, &s, 4);
      AppendFp8(codes.data(), sb, 1);
    } else {
      QuantizeFp4(x.data(), dim_, codes.data(), scales.data());
      AppendFp4(codes.data(), scales.data(), 1);
    }
  }
}

Query QueryFp8(const uint8_t* codes, const float* weights, int32_t heads, int32_t dim) {
  Query q{heads, dim, std::vector<double>(static_cast<size_t>(heads) * dim), {}};
  for (size_t i = 0; i < q.q.size(); ++i) q.q[i] = DecodeE4M3(codes[i]);
  q.w.assign(weights, weights + heads);
  return q;
}

Query QueryFp4(const uint8_t* packed, const uint8_t* scales, const float* weights, int32_t heads,
               int32_t dim) {
  Query q{heads, dim, std::vector<double>(static_cast<size_t>(heads) * dim), {}};
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t d = 0; d < dim; ++d) {
      const size_t idx = static_cast<size_t>(h) * dim + d;
      const uint8_t nib = (idx % 2) ? (packed[idx / 2] >> 4) : (packed[idx / 2] & 0xF);
      q.q[idx] =
          DecodeE2M1(nib) * DecodeUE8M0(scales[static_cast<size_t>(h) * (dim / 32) + d / 32]);
    }
  }
  q.w.assign(weights, weights + heads);
  return q;
}

Query QueryFloat(const float* q, const float* w_raw, int32_t heads, int32_t dim, Format format,
                 const Rope* rope, const std::vector<double>* inv_freq, int64_t position,
                 bool hadamard) {
  const float c = static_cast<float>(1.0 / std::sqrt(static_cast<double>(heads) * dim));
  Query out{heads, dim, std::vector<double>(static_cast<size_t>(heads) * dim),
            std::vector<double>(heads)};
  std::vector<float> x(dim);
  std::vector<uint8_t> codes(dim), scales(dim / 32 + 1);
  for (int32_t h = 0; h < heads; ++h) {
    std::copy(q + static_cast<size_t>(h) * dim, q + static_cast<size_t>(h + 1) * dim, x.begin());
    if (rope != nullptr && inv_freq != nullptr) ApplyRope(x.data(), position, *rope, *inv_freq);
    if (hadamard) Hadamard(x.data(), dim);
    double* dst = out.q.data() + static_cast<size_t>(h) * dim;
    if (format == Format::kFp8) {
      const float s = QuantizeFp8(x.data(), dim, codes.data());
      for (int32_t d = 0; d < dim; ++d) dst[d] = DecodeE4M3(codes[d]);
      const float folded = w_raw[h] * c;
      out.w[h] = static_cast<float>(folded * s);
    } else {
      QuantizeFp4(x.data(), dim, codes.data(), scales.data());
      for (int32_t d = 0; d < dim; ++d) {
        const uint8_t nib = (d % 2) ? (codes[d / 2] >> 4) : (codes[d / 2] & 0xF);
        dst[d] = DecodeE2M1(nib) * DecodeUE8M0(scales[d / 32]);
      }
      out.w[h] = static_cast<float>(w_raw[h] * c);
    }
  }
  return out;
}

double Logit(const Query& q, const double* key) {
  double logit = 0.0;
  for (int32_t h = 0; h < q.heads; ++h) {
    const double* qh = q.q.data() + static_cast<size_t>(h) * q.dim;
    double dot = 0.0;
    for (int32_t d = 0; d < q.dim; ++d) dot += qh[d] * key[d];
    logit += q.w[h] * (dot > 0.0 ? dot : 0.0);
  }
  return logit;
}

std::vector<double> DenseLogits(const Query& q, const Cache& cache, int64_t length) {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(length, 0)));
  for (int64_t t = 0; t < length; ++t) out[t] = Logit(q, cache.At(t));
  return out;
}

std::vector<double> LogitsAt(const Query& q, const Cache& cache,
                             const std::vector<int32_t>& positions) {
  std::vector<double> out(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) out[i] = Logit(q, cache.At(positions[i]));
  return out;
}

std::vector<int32_t> NaiveTopK(const std::vector<double>& logits, int32_t k,
                               const std::vector<int32_t>* positions) {
  auto pos = [&](size_t i) { return positions ? (*positions)[i] : static_cast<int32_t>(i); };
  std::vector<size_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    if (logits[a] != logits[b]) return logits[a] > logits[b];
    return pos(a) < pos(b);
  });
  std::vector<int32_t> out;
  for (size_t i = 0; i < idx.size() && static_cast<int32_t>(out.size()) < k; ++i) {
    out.push_back(pos(idx[i]));
  }
  std::sort(out.begin(), out.end());
  out.resize(static_cast<size_t>(std::max(k, 0)), -1);
  return out;
}

std::vector<double> BlockScores(const std::vector<double>& logits, int32_t block_size) {
  const int64_t length = static_cast<int64_t>(logits.size());
  const int64_t blocks = (length + block_size - 1) / block_size;
  std::vector<double> scores(blocks, -std::numeric_limits<double>::infinity());
  for (int64_t t = 0; t < length; ++t) {
    scores[t / block_size] = std::max(scores[t / block_size], logits[t]);
  }
  if (blocks > 0) scores[blocks - 1] = std::numeric_limits<double>::infinity();
  return scores;
}

std::vector<int32_t> CandidateBlocks(const std::vector<double>& logits, int32_t num_blocks,
                                     int32_t block_size) {
  return NaiveTopK(BlockScores(logits, block_size), num_blocks);
}

std::vector<int32_t> ExpandBlocks(const int32_t* blocks, int32_t num_blocks, int32_t block_size,
                                  int32_t length) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < num_blocks; ++i) {
    if (blocks[i] < 0) continue;
    for (int32_t p = blocks[i] * block_size; p < (blocks[i] + 1) * block_size && p < length; ++p) {
      out.push_back(p);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

double Tolerance(const std::vector<double>& exact, double ulps) {
  double m = 0.0;
  for (double v : exact) {
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  }
  return m * ulps * std::ldexp(1.0, -24);
}

double Fp8AccumulationBound(const Query& q, const double* key) {
  const double unit = (kFp8AccumSlice + 1) * std::ldexp(1.0, -kFp8AccumFractionBits);
  double bound = 0.0;
  for (int32_t h = 0; h < q.heads; ++h) {
    const double* qh = q.q.data() + static_cast<size_t>(h) * q.dim;
    double partial = 0.0, err = 0.0;
    for (int32_t s0 = 0; s0 < q.dim; s0 += kFp8AccumSlice) {
      double m = std::fabs(partial) + err;  // the computed partial sum's magnitude, at most
      double slice = 0.0;
      for (int32_t d = s0; d < std::min(q.dim, s0 + kFp8AccumSlice); ++d) {
        const double prod = qh[d] * key[d];
        m = std::max(m, std::fabs(prod));
        slice += prod;
      }
      err += unit * m;
      partial += slice;
    }
    bound += std::fabs(q.w[h]) * err;
  }
  return bound;
}

std::string CheckTopKRow(const int32_t* answer, int32_t k, const std::vector<double>& exact,
                         double tol, const std::vector<int32_t>* positions) {
  const int64_t n = static_cast<int64_t>(exact.size());
  std::ostringstream why;
  if (positions != nullptr && static_cast<int64_t>(positions->size()) != n) {
    return "checker misuse: positions and exact differ in size";
  }
  std::unordered_map<int32_t, int64_t> index_of;
  for (int64_t i = 0; i < n; ++i)
    index_of[positions ? (*positions)[i] : static_cast<int32_t>(i)] = i;
  const int64_t expected = std::min<int64_t>(k, n);
  std::vector<char> taken(static_cast<size_t>(n), 0);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t p = answer[j];
    if (j >= expected) {
      if (p != -1) {
        why << "entry " << j << " = " << p << ", expected -1 padding after " << expected
            << " positions";
        return why.str();
      }
      continue;
    }
    const auto it = index_of.find(p);
    if (it == index_of.end()) {
      why << "entry " << j << " = " << p << " is not a valid position of the row";
      return why.str();
    }
    if (j > 0 && p <= answer[j - 1]) {
      why << "entries " << j - 1 << ", " << j << " (" << answer[j - 1] << ", " << p
          << ") are not strictly ascending";
      return why.str();
    }
    taken[it->second] = 1;
  }
  if (n <= k) return "";
  std::vector<double> sorted = exact;
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<double>());
  const double kth = sorted[k - 1];
  why.precision(17);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = positions ? (*positions)[i] : static_cast<int32_t>(i);
    if (taken[i] && exact[i] < kth - tol) {
      why << "returned position " << p << " has exact logit " << exact[i] << " < K-th largest "
          << kth << " - " << tol;
      return why.str();
    }
    if (!taken[i] && exact[i] > kth + tol) {
      why << "left-out position " << p << " has exact logit " << exact[i] << " > K-th largest "
          << kth << " + " << tol;
      return why.str();
    }
  }
  return "";
}

std::string CheckCandidateRow(const int32_t* blocks, int32_t num_blocks, int32_t block_size,
                              const std::vector<double>& exact, double tol) {
  const std::string why = CheckTopKRow(blocks, num_blocks, BlockScores(exact, block_size), tol);
  return why.empty() ? why : "candidate blocks: " + why;
}

}  // namespace decode_indexer::reference
