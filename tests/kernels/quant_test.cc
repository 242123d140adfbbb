// Quantizer unit tests (spec section 2) against brute-force nearest-code searches.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/quant.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

using namespace kernels;

// The e4m3 code a correct RNE-saturating encoder must give: the nearest finite code, ties to
// the even mantissa (even code), |x| >= 448 -> 448. Search over all codes.
uint8_t BruteE4M3(float x) {
  const double a = std::fabs(static_cast<double>(x));
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double err = std::fabs(OracleE4M3(static_cast<uint8_t>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

uint8_t BruteE2M1(float x) {
  const double a = std::fabs(static_cast<double>(x));
  const uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 8; ++c) {
    const double err = std::fabs(OracleE2M1(static_cast<uint8_t>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

// Log-uniform magnitudes over [2^lo, 2^hi), random sign.
std::vector<float> RandomFloats(std::mt19937_64& rng, int n, int lo, int hi) {
  std::uniform_real_distribution<double> exponent(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  for (float& f : v) {
    f = static_cast<float>(std::exp2(exponent(rng)));
    if (negative(rng)) f = -f;
  }
  return v;
}

TEST(E4M3, EncodeMatchesNearestCodeOnRandomValues) {
  std::mt19937_64& rng = PerTestRng();
  for (float x : RandomFloats(rng, 20000, -14, 10)) {
    ASSERT_EQ(EncodeE4M3(x), BruteE4M3(x)) << x;
  }
}

TEST(E4M3, TiesRoundToEvenAndNeighboursRoundToNearest) {
  // Every midpoint between adjacent positive codes (subnormal and normal), and the floats
  // just around it.
  int rounded_up = 0;  // ties that went to the upper code: those whose upper code is even
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = OracleE4M3(static_cast<uint8_t>(c));
    const double hi = OracleE4M3(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);  // midpoints are exact floats
    const uint8_t even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(EncodeE4M3(mid), even) << mid;
    EXPECT_EQ(EncodeE4M3(-mid), 0x80 | even) << -mid;
    EXPECT_EQ(EncodeE4M3(std::nextafter(mid, 0.0f)), c) << mid;
    EXPECT_EQ(EncodeE4M3(std::nextafter(mid, 1e9f)), c + 1) << mid;
    rounded_up += EncodeE4M3(mid) == c + 1;
  }
  // Half of the 126 ties round up (c odd), half down: not always one way.
  EXPECT_EQ(rounded_up, 63);
}

TEST(E4M3, SaturatesAt448) {
  std::mt19937_64& rng = PerTestRng();
  for (float x : RandomFloats(rng, 1000, 9, 30)) {
    const uint8_t code = EncodeE4M3(x);
    EXPECT_EQ(code & 0x7F, 0x7E) << x;
    EXPECT_EQ(DecodeE4M3(code), x > 0 ? 448.0f : -448.0f);
  }
  EXPECT_EQ(EncodeE4M3(std::numeric_limits<float>::infinity()), 0x7E);
  // 464 is the midpoint between 448 and the (non-existent) 512: still saturates.
  EXPECT_EQ(EncodeE4M3(463.99f), 0x7E);
  EXPECT_EQ(EncodeE4M3(464.0f), 0x7E);
}

TEST(E4M3, SubnormalsAndTinyValues) {
  // The subnormal codes m * 2^-9 and values around them.
  for (int m = 1; m < 8; ++m) {
    const float v = std::ldexp(static_cast<float>(m), -9);
    EXPECT_EQ(EncodeE4M3(v), m);
    EXPECT_EQ(DecodeE4M3(static_cast<uint8_t>(m)), v);
  }
  // Half the smallest subnormal ties to zero; anything above rounds up.
  EXPECT_EQ(EncodeE4M3(std::ldexp(1.0f, -10)), 0);
  EXPECT_EQ(EncodeE4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 1);
  EXPECT_EQ(EncodeE4M3(std::ldexp(1.0f, -11)), 0);
  EXPECT_EQ(EncodeE4M3(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(EncodeE4M3(-std::numeric_limits<float>::denorm_min()), 0x80);
  std::mt19937_64& rng = PerTestRng();
  for (float x : RandomFloats(rng, 5000, -13, -5)) ASSERT_EQ(EncodeE4M3(x), BruteE4M3(x)) << x;
}

TEST(E4M3, DecodeMatchesOracleAndRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(DecodeE4M3(static_cast<uint8_t>(c))));
      continue;
    }
    const float v = DecodeE4M3(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(v), OracleE4M3(static_cast<uint8_t>(c))) << c;
    EXPECT_EQ(EncodeE4M3(v), c) << c;
  }
}

TEST(E2M1, EncodeMatchesNearestCode) {
  std::mt19937_64& rng = PerTestRng();
  for (float x : RandomFloats(rng, 20000, -4, 4)) ASSERT_EQ(EncodeE2M1(x), BruteE2M1(x)) << x;
  // Midpoints tie to the even code; saturation above 6.
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 7; ++c) {
    const float mid = (mags[c] + mags[c + 1]) / 2;
    EXPECT_EQ(EncodeE2M1(mid), (c % 2 == 0) ? c : c + 1) << mid;
    EXPECT_EQ(EncodeE2M1(-mid), 0x8 | ((c % 2 == 0) ? c : c + 1)) << -mid;
    EXPECT_EQ(EncodeE2M1(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(EncodeE2M1(std::nextafter(mid, 100.0f)), c + 1);
  }
  EXPECT_EQ(EncodeE2M1(7.0f), 7);
  EXPECT_EQ(EncodeE2M1(1e30f), 7);
  EXPECT_EQ(EncodeE2M1(-1e30f), 0xF);
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(static_cast<double>(DecodeE2M1(static_cast<uint8_t>(c))),
              OracleE2M1(static_cast<uint8_t>(c)));
  }
}

TEST(UE8M0, RoundTripsPowersOfTwo) {
  for (int e = -100; e <= 100; ++e) {
    const float p = std::ldexp(1.0f, e);
    const uint8_t byte = EncodeUE8M0(p);
    EXPECT_EQ(byte, e + 127);
    EXPECT_EQ(DecodeUE8M0(byte), p);
    EXPECT_EQ(static_cast<double>(DecodeUE8M0(byte)), OracleUE8M0(byte));
  }
}

// s must be the smallest power of two with max(amax, 1e-4) / s <= limit.
void ExpectMinimalScale(float amax, float s, double limit) {
  int exponent;
  ASSERT_EQ(std::frexp(s, &exponent), 0.5f) << "not a power of two: " << s;
  const double a = std::max(static_cast<double>(amax), static_cast<double>(1e-4f));
  EXPECT_LE(a / s, limit) << amax;
  EXPECT_GT(a / (s / 2), limit) << amax;
}

TEST(Scales, Fp8AndFp4ScalesAreMinimalPowersOfTwo) {
  std::mt19937_64& rng = PerTestRng();
  for (float x : RandomFloats(rng, 5000, -20, 40)) {
    ExpectMinimalScale(std::fabs(x), Fp8Scale(std::fabs(x)), 448.0);
    ExpectMinimalScale(std::fabs(x), Fp4Scale(std::fabs(x)), 6.0);
  }
  // Exactly on a power of two: amax = 448 * 2^k gives 2^k, one ulp above gives 2^(k+1).
  for (int k = -10; k <= 10; ++k) {
    const float on = std::ldexp(448.0f, k);
    EXPECT_EQ(Fp8Scale(on), std::ldexp(1.0f, k));
    EXPECT_EQ(Fp8Scale(std::nextafter(on, 1e30f)), std::ldexp(1.0f, k + 1));
    const float on4 = std::ldexp(6.0f, k);
    EXPECT_EQ(Fp4Scale(on4), std::ldexp(1.0f, k));
    EXPECT_EQ(Fp4Scale(std::nextafter(on4, 1e30f)), std::ldexp(1.0f, k + 1));
  }
}

TEST(Scales, AmaxFlooredAt1e4) {
  std::mt19937_64& rng = PerTestRng();
  for (float x : RandomFloats(rng, 100, -40, -14)) {
    EXPECT_EQ(Fp8Scale(std::fabs(x)), Fp8Scale(1e-4f));
    EXPECT_EQ(Fp4Scale(std::fabs(x)), Fp4Scale(1e-4f));
  }
  EXPECT_EQ(Fp8Scale(0.0f), Fp8Scale(1e-4f));
  ExpectMinimalScale(0.0f, Fp8Scale(0.0f), 448.0);
  ExpectMinimalScale(0.0f, Fp4Scale(0.0f), 6.0);
}

TEST(BF16, WidensByShifting) {
  std::mt19937_64& rng = PerTestRng();
  for (int i = 0; i < 1000; ++i) {
    const uint16_t bits = static_cast<uint16_t>(rng());
    if (((bits >> 7) & 0xFF) == 0xFF) continue;  // inf / NaN
    uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float expected;
    std::memcpy(&expected, &wide, sizeof(expected));
    EXPECT_EQ(BF16ToFloat(bits), expected);
  }
}

TEST(QuantizeVector, Fp8CodesAndScale) {
  std::mt19937_64& rng = PerTestRng();
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> v(128);
    FillVectors(rng, 1, 128, v.data());
    std::vector<uint8_t> codes(128);
    const float s = cpu::QuantizeFp8(v.data(), 128, codes.data());
    float amax = 0.0f;
    for (float x : v) amax = std::max(amax, std::fabs(x));
    ExpectMinimalScale(amax, s, 448.0);
    for (int i = 0; i < 128; ++i) ASSERT_EQ(codes[i], BruteE4M3(v[i] / s)) << i;
  }
}

TEST(QuantizeVector, Fp4NibbleOrderAndGroupScales) {
  std::mt19937_64& rng = PerTestRng();
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> v(128);
    FillVectors(rng, 4, 32, v.data());  // each group its own magnitude
    std::vector<uint8_t> packed(64), scales(4);
    cpu::QuantizeFp4(v.data(), 128, packed.data(), scales.data());
    for (int g = 0; g < 4; ++g) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[g * 32 + i]));
      const double s = OracleUE8M0(scales[g]);
      ExpectMinimalScale(amax, static_cast<float>(s), 6.0);
      for (int i = 0; i < 32; ++i) {
        const int e = g * 32 + i;
        // Element 2j in the low nibble of byte j, element 2j + 1 in the high nibble.
        const uint8_t nibble = (e % 2) ? (packed[e / 2] >> 4) : (packed[e / 2] & 0xF);
        ASSERT_EQ(nibble, BruteE2M1(static_cast<float>(v[e] / s))) << e;
      }
    }
  }
}

}  // namespace
}  // namespace decode_indexer::testing
