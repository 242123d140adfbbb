// di_reference's own checks: its decoders against values the spec and the OCP formats state,
// its encoders against the kernels' bit-manipulating quantizers (two derivations that share
// no code), its selection rules on hand-made rows, and the section-6 checker's both sides.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/quant.h"
#include "gtest/gtest.h"
#include "reference/reference.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

namespace ref = reference;

TEST(Reference, DecodersGiveTheFormatsStatedValues) {
  // Spec section 2: e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; sign in bit 3.
  const double e2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(ref::DecodeE2M1(static_cast<uint8_t>(c)), e2m1[c]) << c;
    EXPECT_EQ(ref::DecodeE2M1(static_cast<uint8_t>(c | 8)), -e2m1[c]) << c;
  }
  // e4m3 (OCP FN): 448 the largest, 2^-9 the smallest subnormal, 2^-6 the smallest normal,
  // 1.0 = 0x38, 0x7F NaN.
  EXPECT_EQ(ref::DecodeE4M3(0x7E), 448.0);
  EXPECT_EQ(ref::DecodeE4M3(0xFE), -448.0);
  EXPECT_EQ(ref::DecodeE4M3(0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(ref::DecodeE4M3(0x08), std::ldexp(1.0, -6));
  EXPECT_EQ(ref::DecodeE4M3(0x38), 1.0);
  EXPECT_EQ(ref::DecodeE4M3(0x3C), 1.5);
  EXPECT_TRUE(std::isnan(ref::DecodeE4M3(0x7F)));
  EXPECT_EQ(ref::DecodeUE8M0(127), 1.0);
  EXPECT_EQ(ref::DecodeUE8M0(130), 8.0);
  EXPECT_EQ(ref::DecodeUE8M0(120), 1.0 / 128);
  // Codes 0..0x7E ascend strictly: the encoders' search relies on it.
  for (int c = 1; c < 0x7F; ++c) {
    EXPECT_LT(ref::DecodeE4M3(static_cast<uint8_t>(c - 1)),
              ref::DecodeE4M3(static_cast<uint8_t>(c)));
  }
}

TEST(Reference, EncodersAgreeWithTheKernelsQuantizers) {
  // Every 997th float bit pattern over the e4m3 range and beyond (every e2m1 one over
  // [1/32, 8]), both signs: the reference's nearest-code search and the kernels' bit
  // manipulation give the same code.
  int checked = 0;
  for (uint32_t bits = 0x30000000u; bits < 0x44800000u; bits += 997) {
    float x;
    std::memcpy(&x, &bits, 4);
    ASSERT_EQ(ref::EncodeE4M3(x), kernels::EncodeE4M3(x)) << x;
    ASSERT_EQ(ref::EncodeE4M3(-x), kernels::EncodeE4M3(-x)) << -x;
    ++checked;
  }
  for (uint32_t bits = 0x3D000000u; bits < 0x41000000u; bits += 101) {
    float x;
    std::memcpy(&x, &bits, 4);
    ASSERT_EQ(ref::EncodeE2M1(x), kernels::EncodeE2M1(x)) << x;
    ASSERT_EQ(ref::EncodeE2M1(-x), kernels::EncodeE2M1(-x)) << -x;
    ++checked;
  }
  EXPECT_GT(checked, 600000);
  // Midpoints between adjacent codes (the ties) are where rounding rules differ.
  for (int c = 0; c < 0x7E; ++c) {
    const float mid = static_cast<float>(
        (ref::DecodeE4M3(static_cast<uint8_t>(c)) + ref::DecodeE4M3(static_cast<uint8_t>(c + 1))) /
        2);
    EXPECT_EQ(ref::EncodeE4M3(mid), kernels::EncodeE4M3(mid)) << mid;
    EXPECT_EQ(ref::EncodeE4M3(mid) % 2, 0) << mid;
  }
  // Whole vectors: codes and scales.
  std::mt19937_64& rng = PerTestRng();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-12, 12);
  for (int v = 0; v < 200; ++v) {
    std::vector<float> x(128);
    const float m = std::ldexp(1.0f, binade(rng));
    for (float& e : x) e = normal(rng) * m;
    std::vector<uint8_t> a(128), b(128), as(4), bs(4);
    EXPECT_EQ(ref::QuantizeFp8(x.data(), 128, a.data()),
              kernels::cpu::QuantizeFp8(x.data(), 128, b.data()));
    EXPECT_EQ(a, b);
    ref::QuantizeFp4(x.data(), 128, a.data(), as.data());
    kernels::cpu::QuantizeFp4(x.data(), 128, b.data(), bs.data());
    a.resize(64);
    b.resize(64);
    EXPECT_EQ(a, b);
    EXPECT_EQ(as, bs);
  }
}

TEST(Reference, ScaleIsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(ref::ScaleFor(448.0f, 448.0), 1.0);
  EXPECT_EQ(ref::ScaleFor(448.5f, 448.0), 2.0);
  EXPECT_EQ(ref::ScaleFor(447.0f, 448.0), 1.0);
  EXPECT_EQ(ref::ScaleFor(224.0f, 448.0), 0.5);
  EXPECT_EQ(ref::ScaleFor(6.0f, 6.0), 1.0);
  EXPECT_EQ(ref::ScaleFor(6.01f, 6.0), 2.0);
  EXPECT_EQ(ref::ScaleFor(0.0f, 448.0), ref::ScaleFor(1e-4f, 448.0));  // the amax floor
}

TEST(Reference, TopKTiesGoToTheLowerPosition) {
  const std::vector<double> logits = {1, 3, 3, 2, 3, 0};
  EXPECT_EQ(ref::NaiveTopK(logits, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(ref::NaiveTopK(logits, 4), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(ref::NaiveTopK(logits, 8), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, -1, -1}));
  const std::vector<int32_t> pos = {10, 11, 20, 21, 30, 31};
  EXPECT_EQ(ref::NaiveTopK(logits, 1, &pos), (std::vector<int32_t>{11}));
}

TEST(Reference, CandidateBlocksFollowSection7) {
  // Blocks of 2 over 7 positions: scores max(9, 1) = 9, max(2, 8) = 8, max(0, 5) = 5, and the
  // newest block 3 (position 6) wins whatever its logit.
  const std::vector<double> logits = {9, 1, 2, 8, 0, 5, -100};
  EXPECT_EQ(ref::CandidateBlocks(logits, 2, 2), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(ref::CandidateBlocks(logits, 3, 2), (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(ref::CandidateBlocks(logits, 6, 2), (std::vector<int32_t>{0, 1, 2, 3, -1, -1}));
  const int32_t blocks[3] = {3, 0, -1};
  EXPECT_EQ(ref::ExpandBlocks(blocks, 3, 2, 7), (std::vector<int32_t>{0, 1, 6}));
  EXPECT_EQ(ref::ExpandBlocks(blocks, 3, 2, 6), (std::vector<int32_t>{0, 1}));
}

TEST(Reference, CheckerAcceptsNearTiesOnlyWithinTheTolerance) {
  const std::vector<double> exact = {5.0, 4.0, 3.0 + 1e-9, 3.0, 1.0};
  const int32_t good[3] = {0, 1, 2}, near[3] = {0, 1, 3}, far[3] = {0, 1, 4};
  EXPECT_EQ(ref::CheckTopKRow(good, 3, exact, 0.0), "");
  EXPECT_NE(ref::CheckTopKRow(near, 3, exact, 0.0), "");
  EXPECT_EQ(ref::CheckTopKRow(near, 3, exact, 1e-8), "");
  EXPECT_NE(ref::CheckTopKRow(far, 3, exact, 1e-8), "");
  const int32_t unsorted[3] = {1, 0, 2}, dup[3] = {0, 0, 1}, outside[3] = {0, 1, 7};
  EXPECT_NE(ref::CheckTopKRow(unsorted, 3, exact, 1.0), "");
  EXPECT_NE(ref::CheckTopKRow(dup, 3, exact, 1.0), "");
  EXPECT_NE(ref::CheckTopKRow(outside, 3, exact, 1.0), "");
  // Short rows: every position, then -1.
  const std::vector<double> two = {1.0, 2.0};
  const int32_t all[3] = {0, 1, -1}, missing[3] = {1, -1, -1};
  EXPECT_EQ(ref::CheckTopKRow(all, 3, two, 0.0), "");
  EXPECT_NE(ref::CheckTopKRow(missing, 3, two, 0.0), "");
  // The newest block must be among the candidates however low its logits.
  const std::vector<double> logits = {9, 1, 2, 8, 0, 5, -100};
  const int32_t without_newest[2] = {0, 1}, with_newest[2] = {0, 3};
  EXPECT_NE(ref::CheckCandidateRow(without_newest, 2, 2, logits, 0.0), "");
  EXPECT_EQ(ref::CheckCandidateRow(with_newest, 2, 2, logits, 0.0), "");
}

TEST(Reference, LogitIsTheWeightedReluSum) {
  // Two heads of dim 2: w0 relu(q0 . k) + w1 relu(q1 . k).
  ref::Query q{2, 2, {1, 2, -3, 1}, {0.5, 2.0}};
  const double k[2] = {1, 1};
  EXPECT_EQ(ref::Logit(q, k), 0.5 * 3 + 2.0 * 0);
  const double k2[2] = {-1, 1};
  EXPECT_EQ(ref::Logit(q, k2), 0.5 * 1 + 2.0 * 4);
}

// The fp8-accumulation bound against an emulation of the model it is derived from: per slice of
// 32 dims, the incoming partial sum and the 32 products aligned to the largest exponent among
// them and truncated to 13 fraction bits, then summed (exactly: few bits). On random e4m3 codes
// (dequantized, key scales of any size) the emulated logit stays within the bound, and the bound
// is not vacuous: it stays well below the logit's scale sum_h |w_h| sum_d |q_hd k_d|.
TEST(Reference, Fp8AccumulationBoundCoversTheTruncationModel) {
  std::mt19937_64& rng = PerTestRng();
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<double> uw(-1.0, 1.0);
  const int32_t heads = 8, dim = 128;
  auto e4m3 = [&] {
    for (;;) {
      const int c = code(rng);
      if ((c & 0x7F) != 0x7F) return ref::DecodeE4M3(static_cast<uint8_t>(c));  // not NaN
    }
  };
  auto truncate = [](double v, int e) {  // toward zero, to a multiple of 2^(e - 13)
    const double u = std::ldexp(1.0, e - ref::kFp8AccumFractionBits);
    return std::trunc(v / u) * u;
  };
  double worst_ratio = 0.0;
  for (int trial = 0; trial < 400; ++trial) {
    ref::Query q{heads, dim, std::vector<double>(heads * dim), std::vector<double>(heads)};
    for (auto& v : q.q) v = e4m3();
    for (auto& v : q.w) v = uw(rng);
    const double kscale = std::ldexp(1.0 + uw(rng) * 0.4, trial % 20 - 10);
    std::vector<double> key(dim);
    for (auto& v : key) v = e4m3() * kscale;
    double emulated = 0.0, scale = 0.0;
    for (int32_t h = 0; h < heads; ++h) {
      double acc = 0.0;
      for (int32_t s0 = 0; s0 < dim; s0 += ref::kFp8AccumSlice) {
        double mx = std::fabs(acc);
        for (int32_t d = s0; d < s0 + ref::kFp8AccumSlice; ++d) {
          mx = std::max(mx, std::fabs(q.q[h * dim + d] * key[d]));
        }
        if (mx == 0.0) continue;
        const int e = std::ilogb(mx);
        double sum = truncate(acc, e);
        for (int32_t d = s0; d < s0 + ref::kFp8AccumSlice; ++d) {
          sum += truncate(q.q[h * dim + d] * key[d], e);
          scale += std::fabs(q.w[h] * q.q[h * dim + d] * key[d]);
        }
        acc = sum;
      }
      emulated += q.w[h] * std::max(acc, 0.0);
    }
    const double exact = ref::Logit(q, key.data());
    const double bound = ref::Fp8AccumulationBound(q, key.data());
    EXPECT_LE(std::fabs(emulated - exact), bound) << "trial " << trial;
    EXPECT_LT(bound, 0.05 * scale) << "trial " << trial;
    if (bound > 0) worst_ratio = std::max(worst_ratio, std::fabs(emulated - exact) / bound);
  }
  std::printf("  [fp8 bound] largest emulated error / bound = %.3g\n", worst_ratio);
}

}  // namespace
}  // namespace decode_indexer::testing
