// di_reference: an independent, naive reference of the indexer's math (spec sections 2, 3, 6
// and 7), written apart from kernels/ and sharing no code with any backend: its own code
// decoders (from the bit layouts), its own encoders (nearest representable value found by
// search over every code, ties to the even code), its own RoPE frequencies, logits in double
// from dequantized values, and a plain sort for top-k and candidate blocks. The service, the
// executor and the GPU tests check answers with it, and so does the load tester's --verify
// (a shipped tool: this library needs only the C++ standard library).
//
// Numerics: dequantized codes are exact in double, so a logit is the exact sum up to double
// rounding (~1e-16 relative), far below the fp32 rounding any backend applies. A backend's
// answer may therefore differ from NaiveTopK only at near-ties (spec section 6), which
// CheckTopKRow / CheckCandidateRow accept within a tolerance and nothing more.
//
// Where the spec fixes a value only up to fp32 rounding, the reference follows the one rule
// the API documents: FP8 weights are folded in fp32 as float(float(w_raw * c) * s) with
// c = float(1 / sqrt(H * D)); RoPE rounds cos and sin to fp32, rotates in double and rounds
// the result to fp32; the Hadamard rotation is the fp32 butterfly (a + b, a - b) followed by
// one multiply by float(1 / sqrt(n)).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace decode_indexer::reference {

enum class Format { kFp8, kFp4 };

// ---- Codes (spec section 2), from the bit layouts ------------------------------------------

// e4m3 (bias 7, no infinities, S.1111.111 is NaN): value = (-1)^s * 2^(e-7) * (1 + m/8), or
// (-1)^s * 2^-6 * m/8 for e == 0.
double DecodeE4M3(uint8_t code);
// e2m1 (bias 1): value = (-1)^s * 2^(e-1) * (1 + m/2), or (-1)^s * m/2 for e == 0.
double DecodeE2M1(uint8_t nibble);
// ue8m0: 2^(byte - 127).
double DecodeUE8M0(uint8_t byte);

// The finite code nearest to x, ties to the code with an even mantissa (its low bit 0);
// saturating (beyond the largest magnitude the largest is nearest). The sign of x is kept.
uint8_t EncodeE4M3(double x);
uint8_t EncodeE2M1(double x);

// The smallest power of two p with p * max_code >= max(amax, 1e-4f) (spec section 2).
double ScaleFor(float amax, double max_code);

// One D-vector: FP8 codes[d] and its scale; FP4 packed[d/2] (element 2i low nibble) and one
// ue8m0 byte per 32 elements.
float QuantizeFp8(const float* v, int32_t d, uint8_t* codes);
void QuantizeFp4(const float* v, int32_t d, uint8_t* packed, uint8_t* scales);

// ---- Preparation of unquantized inputs -------------------------------------------------

void Hadamard(float* x, int32_t n);  // n a power of two

enum class RopeStyle { kNone, kNeox, kInterleaved };
struct Rope {
  RopeStyle style = RopeStyle::kNone;
  int32_t dim_offset = 0;
  int32_t rope_dim = 0;
  double theta = 10000.0;
  bool yarn = false;
  double yarn_factor = 1.0;
  int64_t yarn_original = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};
// Pair i rotates by position * InvFreq(rope)[i] (DeepSeek-V3's YaRN where yarn is set).
std::vector<double> InvFreq(const Rope& rope);
// NeoX pairs (o + i, o + i + rope_dim / 2); interleaved pairs (o + 2i, o + 2i + 1).
void ApplyRope(float* x, int64_t position, const Rope& rope, const std::vector<double>& inv_freq);

// ---- Keys and queries, dequantized -----------------------------------------------------

// One cache: entry t's dequantized values at At(t) (double[dim]).
class Cache {
 public:
  Cache() = default;
  Cache(Format format, int32_t dim) : format_(format), dim_(dim) {}
  Format format() const { return format_; }
  int32_t dim() const { return dim_; }
  int64_t size() const { return static_cast<int64_t>(values_.size()) / dim_; }
  const double* At(int64_t t) const { return values_.data() + t * dim_; }

  // n FP8 entries: codes [n, dim], fp32 scales [n] (bytes, little-endian).
  void AppendFp8(const uint8_t* codes, const uint8_t* scale_bytes, int32_t n);
  // n FP4 entries: packed [n, dim / 2], ue8m0 [n, dim / 32].
  void AppendFp4(const uint8_t* packed, const uint8_t* scales, int32_t n);
  // n unquantized entries (fp32 [n, dim]), quantized for this cache's format first.
  void AppendFloat(const float* values, int32_t n, bool hadamard);
  void Truncate(int64_t n) { values_.resize(static_cast<size_t>(n) * dim_); }

 private:
  Format format_ = Format::kFp8;
  int32_t dim_ = 128;
  std::vector<double> values_;
};

// One decode row's query: heads x dim dequantized values and the per-head weight.
struct Query {
  int32_t heads = 0;
  int32_t dim = 0;
  std::vector<double> q;  // [heads, dim]
  std::vector<double> w;  // [heads]
};
// FP8 codes [heads, dim] with folded fp32 weights [heads] (the q scale inside the weight).
Query QueryFp8(const uint8_t* codes, const float* weights, int32_t heads, int32_t dim);
// FP4 packed [heads, dim / 2], ue8m0 [heads, dim / 32], weights [heads] (no q scale).
Query QueryFp4(const uint8_t* packed, const uint8_t* scales, const float* weights, int32_t heads,
               int32_t dim);
// Unquantized q [heads, dim] and raw weights: RoPE at `position` (when rope != nullptr),
// optional Hadamard, quantize for `format`, fold the weights (spec sections 2 and 3).
Query QueryFloat(const float* q, const float* w_raw, int32_t heads, int32_t dim, Format format,
                 const Rope* rope, const std::vector<double>* inv_freq, int64_t position,
                 bool hadamard);

// logit = sum_h w[h] * relu(q[h] . k), in double (spec section 3).
double Logit(const Query& q, const double* key);
// Logits of positions [0, length) of `cache`.
std::vector<double> DenseLogits(const Query& q, const Cache& cache, int64_t length);
std::vector<double> LogitsAt(const Query& q, const Cache& cache,
                             const std::vector<int32_t>& positions);

// ---- Selection (spec sections 6 and 7) ---------------------------------------------------

// The K largest by (logit desc, position asc), ascending, -1 padded to k. logits[i] belongs
// to positions[i] (nullptr: to i).
std::vector<int32_t> NaiveTopK(const std::vector<double>& logits, int32_t k,
                               const std::vector<int32_t>* positions = nullptr);
// Block scores of a dense row of `length` logits: block j's max over [bs*j, bs*j+bs) below
// length, the newest block +inf.
std::vector<double> BlockScores(const std::vector<double>& logits, int32_t block_size);
// Top min(num_blocks, ceil(L / bs)) blocks, ascending, -1 padded to num_blocks.
std::vector<int32_t> CandidateBlocks(const std::vector<double>& logits, int32_t num_blocks,
                                     int32_t block_size);
// The positions a consumer row of `length` scores: the blocks' positions below length,
// ascending. Entries of -1 are ignored.
std::vector<int32_t> ExpandBlocks(const int32_t* blocks, int32_t num_blocks, int32_t block_size,
                                  int32_t length);

// A tolerance of `ulps` fp32 ulps of the largest finite |value|: what rounding the exact
// logits to fp32 (in any order) can move them by.
double Tolerance(const std::vector<double>& exact, double ulps = 4.0);

// Spec section 6, the fp8-accumulation mode: a bound on |L_fp8 - L| for the logit of `key`
// (dequantized, as Cache::At gives it) under q, where L_fp8 is computed by an fp8 tensor core
// that sums each head's dot product in slices of 32 dims, each slice's 32 products and the
// incoming fp32 partial sum aligned to the largest of their exponents and kept to
// kFp8AccumFractionBits fraction bits (truncated). Per head h and slice s the 33 addends each
// lose less than 2^-f of the largest one's magnitude, M_hs <= max(|P_hs| + E_h, max |q_hd k_d|)
// (P_hs: the exact partial sum before the slice, E_h: the bound so far), so
//   |L_fp8 - L| <= sum_h |w_h| sum_s 33 * 2^-f * M_hs
// (relu is 1-Lipschitz), plus the fp32 rounding of the head sum that Tolerance() covers.
inline constexpr int kFp8AccumFractionBits = 13;
inline constexpr int kFp8AccumSlice = 32;
double Fp8AccumulationBound(const Query& q, const double* key);

// Spec section 6: "" when `answer` (k entries) is an acceptable top-k of the values `exact`
// (of positions[i], or of i when positions == nullptr; positions ascending): the first
// min(k, n) entries distinct valid positions ascending, the rest -1; when n <= k every
// position; else every returned value >= the K-th largest - tol and no left-out value
// > the K-th largest + tol. Otherwise what is wrong.
std::string CheckTopKRow(const int32_t* answer, int32_t k, const std::vector<double>& exact,
                         double tol, const std::vector<int32_t>* positions = nullptr);
// Spec section 7 for one source row of dense exact logits over [0, L): CheckTopKRow over the
// block scores with num_blocks, and the newest block present.
std::string CheckCandidateRow(const int32_t* blocks, int32_t num_blocks, int32_t block_size,
                              const std::vector<double>& exact, double tol);

}  // namespace decode_indexer::reference
