// RoPE, YaRN frequencies, Hadamard, key insertion (page layout) and rope_quant_q.
#include <cmath>
#include <cstring>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/quant.h"
#include "decode_indexer/kernels/rope.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

using namespace kernels;

TEST(InvFreq, PlainMatchesFormula) {
  RopeParams p;
  p.rope_dim = 64;
  p.theta = 10000.0;
  const std::vector<double> f = ComputeInvFreq(p);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(f[i], std::exp(-std::log(10000.0) * 2.0 * i / 64.0), 1e-13 * f[i]) << i;
  }
}

TEST(InvFreq, YarnMatchesHandComputedRamp) {
  // v32: rope_dim 64, theta 1e4, factor 40, original 4096, beta_fast 32, beta_slow 1.
  // By hand: corr_dim(32) = 64 ln(4096 / (64 pi)) / (2 ln 1e4) = 10.47 -> low 10;
  // corr_dim(1) = 64 ln(4096 / (2 pi)) / (2 ln 1e4) = 22.51 -> high 23.
  RopeParams p;
  p.rope_dim = 64;
  p.theta = 10000.0;
  p.yarn = true;
  p.yarn_factor = 40.0;
  p.yarn_original_max_position = 4096;
  p.yarn_beta_fast = 32.0;
  p.yarn_beta_slow = 1.0;
  const double corr_fast =
      64 * std::log(4096 / (32 * 2 * std::numbers::pi)) / (2 * std::log(10000.0));
  const double corr_slow =
      64 * std::log(4096 / (1 * 2 * std::numbers::pi)) / (2 * std::log(10000.0));
  ASSERT_EQ(std::floor(corr_fast), 10.0);
  ASSERT_EQ(std::ceil(corr_slow), 23.0);
  const std::vector<double> f = ComputeInvFreq(p);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    const double extra = std::exp(-std::log(10000.0) * 2.0 * i / 64.0);
    double expected;
    if (i <= 10) {
      expected = extra;  // high-frequency pairs keep their frequency
    } else if (i >= 23) {
      expected = extra / 40.0;  // low-frequency pairs are interpolated
    } else {
      const double ramp = (i - 10) / 13.0;
      expected = extra / 40.0 * ramp + extra * (1.0 - ramp);
    }
    EXPECT_NEAR(f[i], expected, 1e-13 * expected) << i;
  }
}

TEST(InvFreq, YarnClampsAndWidensAnEmptyRamp) {
  // A tiny original context pushes both correction dims below 0: low = high = 0, so the ramp
  // is (i - 0) / 0.001: only pair 0 keeps its frequency.
  RopeParams p;
  p.rope_dim = 16;
  p.theta = 10000.0;
  p.yarn = true;
  p.yarn_factor = 4.0;
  p.yarn_original_max_position = 2;
  const std::vector<double> f = ComputeInvFreq(p);
  ASSERT_EQ(f.size(), 8u);
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  for (int i = 1; i < 8; ++i) {
    EXPECT_NEAR(f[i], std::pow(10000.0, -2.0 * i / 16) / 4.0, 1e-15) << i;
  }
}

// The contract's rotation, written out: cos/sin in double rounded to float, the products and
// sums in double, rounded to float.
void ContractRotate(float& x1, float& x2, double angle) {
  const double c = static_cast<float>(std::cos(angle));
  const double s = static_cast<float>(std::sin(angle));
  const double a = x1, b = x2;
  x1 = static_cast<float>(a * c - b * s);
  x2 = static_cast<float>(b * c + a * s);
}

TEST(Rope, NeoxAndInterleavedPairs) {
  std::mt19937_64& rng = PerTestRng();
  std::uniform_real_distribution<double> freq(1e-4, 1.0);
  std::uniform_int_distribution<int64_t> position(0, 200000);
  for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int32_t offset = style == RopeStyle::kNeox ? 0 : 64;
      std::vector<double> inv_freq(32);
      for (double& f : inv_freq) f = freq(rng);
      RopeConfig rope{style, offset, 64, inv_freq.data()};
      std::vector<float> x(128);
      FillVectors(rng, 1, 128, x.data());
      const int64_t pos = position(rng);
      std::vector<float> got = x;
      cpu::ApplyRope(got.data(), pos, rope);
      std::vector<float> want = x;
      for (int i = 0; i < 32; ++i) {
        const int a = style == RopeStyle::kNeox ? offset + i : offset + 2 * i;
        const int b = style == RopeStyle::kNeox ? offset + i + 32 : offset + 2 * i + 1;
        const double angle = static_cast<double>(pos) * inv_freq[i];
        ContractRotate(want[a], want[b], angle);
        // And close to the exact rotation (only float roundings apart).
        const double ea = x[a] * std::cos(angle) - x[b] * std::sin(angle);
        EXPECT_NEAR(got[a], ea, 1e-6 * (std::fabs(x[a]) + std::fabs(x[b])));
      }
      for (int d = 0; d < 128; ++d) ASSERT_EQ(got[d], want[d]) << d;
      // Dims outside the span are untouched.
      for (int d = 0; d < 128; ++d) {
        if (d < offset || d >= offset + 64) {
          ASSERT_EQ(got[d], x[d]) << d;
        }
      }
    }
  }
}

TEST(Hadamard, MatchesTheNormalisedMatrixAndIsAnInvolution) {
  constexpr int kD = 128;
  // Sylvester's H: H[i][j] = (-1)^popcount(i & j); H H = D I.
  std::vector<double> h(kD * kD);
  for (int i = 0; i < kD; ++i) {
    for (int j = 0; j < kD; ++j) h[i * kD + j] = (__builtin_popcount(i & j) % 2) ? -1.0 : 1.0;
  }
  for (int i = 0; i < kD; ++i) {
    for (int j = 0; j < kD; ++j) {
      double dot = 0.0;
      for (int k = 0; k < kD; ++k) dot += h[i * kD + k] * h[k * kD + j];
      ASSERT_EQ(dot, i == j ? kD : 0.0);
    }
  }
  std::mt19937_64& rng = PerTestRng();
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> x(kD);
    FillVectors(rng, 1, kD, x.data());
    std::vector<float> y = x;
    cpu::HadamardInPlace(y.data(), kD);
    double norm_x = 0.0, norm_y = 0.0;
    for (int i = 0; i < kD; ++i) {
      double want = 0.0, mag = 0.0;
      for (int k = 0; k < kD; ++k) {
        want += h[i * kD + k] * x[k];
        mag += std::fabs(x[k]);
      }
      want /= std::sqrt(static_cast<double>(kD));
      EXPECT_NEAR(y[i], want, 1e-6 * mag) << i;
      norm_x += double{x[i]} * x[i];
      norm_y += double{y[i]} * y[i];
    }
    EXPECT_NEAR(norm_y, norm_x, 1e-5 * norm_x);
    cpu::HadamardInPlace(y.data(), kD);  // normalised H is its own inverse
    for (int i = 0; i < kD; ++i) EXPECT_NEAR(y[i], x[i], 1e-5 * std::sqrt(norm_x)) << i;
  }
}

class InsertKeysTest : public ::testing::TestWithParam<CacheFormat> {};

TEST_P(InsertKeysTest, WritesValuesThenScalesOnAShuffledPageTable) {
  const CacheFormat format = GetParam();
  const CacheGeometry g{format, 128, 64};
  constexpr int kPages = 7;
  const int32_t value_bytes = format == CacheFormat::kFp8 ? 128 : 64;
  const int32_t scale_bytes = format == CacheFormat::kFp8 ? 4 : 4;
  ASSERT_EQ(g.page_bytes(), 64 * (value_bytes + scale_bytes));
  std::mt19937_64& rng = PerTestRng();
  for (ElemType type : {ElemType::kF32, ElemType::kBF16}) {
    for (bool hadamard : {false, true}) {
      std::vector<uint8_t> pool(kPages * g.page_bytes(), 0);
      CacheView cache{pool.data(), kPages, g};
      // 150 keys at random distinct slots of the pool.
      std::vector<int64_t> all(kPages * 64);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      const int n = 150;
      std::vector<int64_t> slots(all.begin(), all.begin() + n);
      std::vector<float> keys(n * 128);
      FillVectors(rng, n, 128, keys.data());
      std::vector<uint16_t> keys_bf16(n * 128);
      if (type == ElemType::kBF16) {
        for (int i = 0; i < n * 128; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &keys[i], 4);
          keys_bf16[i] = static_cast<uint16_t>(bits >> 16);
          keys[i] = BF16ToFloat(keys_bf16[i]);  // what the kernel will see
        }
      }
      KeyInsertArgs args;
      args.cache = cache;
      args.num_keys = n;
      args.key_type = type;
      args.keys = type == ElemType::kF32 ? static_cast<const void*>(keys.data())
                                         : static_cast<const void*>(keys_bf16.data());
      args.slots = slots.data();
      args.hadamard = hadamard;
      ASSERT_TRUE(cpu::InsertKeys(args).ok());
      std::vector<char> written(kPages * 64, 0);
      for (int i = 0; i < n; ++i) {
        std::vector<float> k(keys.begin() + i * 128, keys.begin() + (i + 1) * 128);
        if (hadamard) cpu::HadamardInPlace(k.data(), 128);
        const int64_t page = slots[i] / 64, o = slots[i] % 64;
        const uint8_t* values = pool.data() + page * g.page_bytes() + o * value_bytes;
        const uint8_t* scale =
            pool.data() + page * g.page_bytes() + 64 * value_bytes + o * scale_bytes;
        written[slots[i]] = 1;
        if (format == CacheFormat::kFp8) {
          std::vector<uint8_t> codes(128);
          const float s = cpu::QuantizeFp8(k.data(), 128, codes.data());
          float stored;
          std::memcpy(&stored, scale, 4);
          ASSERT_EQ(stored, s);
          ASSERT_EQ(std::memcmp(values, codes.data(), 128), 0) << i;
        } else {
          std::vector<uint8_t> packed(64), scales(4);
          cpu::QuantizeFp4(k.data(), 128, packed.data(), scales.data());
          ASSERT_EQ(std::memcmp(scale, scales.data(), 4), 0) << i;
          ASSERT_EQ(std::memcmp(values, packed.data(), 64), 0) << i;
        }
      }
      // Entries not written stay zero, values and scales alike.
      for (int64_t slot = 0; slot < kPages * 64; ++slot) {
        if (written[slot]) continue;
        const int64_t page = slot / 64, o = slot % 64;
        const uint8_t* values = pool.data() + page * g.page_bytes() + o * value_bytes;
        const uint8_t* scale =
            pool.data() + page * g.page_bytes() + 64 * value_bytes + o * scale_bytes;
        for (int b = 0; b < value_bytes; ++b) ASSERT_EQ(values[b], 0);
        for (int b = 0; b < scale_bytes; ++b) ASSERT_EQ(scale[b], 0);
      }
    }
  }
}

TEST_P(InsertKeysTest, PreQuantizedKeysAreCopied) {
  const CacheFormat format = GetParam();
  const CacheGeometry g{format, 128, 64};
  std::vector<uint8_t> pool(3 * g.page_bytes(), 0);
  std::mt19937_64& rng = PerTestRng();
  const int n = 40;
  std::vector<int64_t> slots(n);
  for (int i = 0; i < n; ++i) slots[i] = (i * 37 + 5) % (3 * 64);
  std::vector<uint8_t> codes(n * g.value_bytes());
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & 0x77);  // finite codes
  std::vector<float> fp8_scales(n);
  std::vector<uint8_t> fp4_scales(n * 4);
  for (float& s : fp8_scales) s = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
  for (uint8_t& s : fp4_scales) s = static_cast<uint8_t>(117 + rng() % 20);
  KeyInsertArgs args;
  args.cache = {pool.data(), 3, g};
  args.num_keys = n;
  args.key_type = format == CacheFormat::kFp8 ? ElemType::kFp8E4M3 : ElemType::kFp4E2M1;
  args.keys = codes.data();
  args.key_scales = format == CacheFormat::kFp8 ? static_cast<const void*>(fp8_scales.data())
                                                : static_cast<const void*>(fp4_scales.data());
  args.slots = slots.data();
  ASSERT_TRUE(cpu::InsertKeys(args).ok());
  for (int i = 0; i < n; ++i) {
    const int64_t page = slots[i] / 64, o = slots[i] % 64;
    const uint8_t* base = pool.data() + page * g.page_bytes();
    ASSERT_EQ(std::memcmp(base + o * g.value_bytes(), codes.data() + i * g.value_bytes(),
                          g.value_bytes()),
              0);
    const uint8_t* scale = base + 64 * g.value_bytes() + o * g.scale_bytes();
    if (format == CacheFormat::kFp8) {
      ASSERT_EQ(std::memcmp(scale, &fp8_scales[i], 4), 0);
    } else {
      ASSERT_EQ(std::memcmp(scale, &fp4_scales[i * 4], 4), 0);
    }
  }
  // The wrong pre-quantized type for the cache is refused.
  args.key_type = format == CacheFormat::kFp8 ? ElemType::kFp4E2M1 : ElemType::kFp8E4M3;
  EXPECT_FALSE(cpu::InsertKeys(args).ok());
  // A slot outside the pool is refused.
  args.key_type = format == CacheFormat::kFp8 ? ElemType::kFp8E4M3 : ElemType::kFp4E2M1;
  slots[3] = 3 * 64;
  EXPECT_FALSE(cpu::InsertKeys(args).ok());
}

INSTANTIATE_TEST_SUITE_P(Formats, InsertKeysTest,
                         ::testing::Values(CacheFormat::kFp8, CacheFormat::kFp4),
                         [](const ::testing::TestParamInfo<CacheFormat>& info) {
                           return std::string(FormatName(info.param));
                         });

TEST(RopeQuantQ, RotatesQuantizesAndFoldsWeights) {
  std::mt19937_64& rng = PerTestRng();
  constexpr int kRows = 3, kHeads = 8, kD = 128;
  RopeParams params;
  params.style = RopeStyle::kNeox;
  params.rope_dim = 64;
  params.yarn = true;
  params.yarn_factor = 40.0;
  const std::vector<double> inv_freq = ComputeInvFreq(params);
  for (CacheFormat format : {CacheFormat::kFp8, CacheFormat::kFp4}) {
    for (bool hadamard : {false, true}) {
      std::vector<float> q(kRows * kHeads * kD), w(kRows * kHeads);
      FillVectors(rng, kRows * kHeads, kD, q.data());
      std::normal_distribution<float> normal;
      for (float& x : w) x = normal(rng);
      std::vector<int64_t> positions = {5, 1000, 131071};
      std::vector<uint8_t> codes(kRows * kHeads * kD), scales(kRows * kHeads * kD / 32);
      std::vector<float> weights(kRows * kHeads);
      QPrepArgs args;
      args.num_rows = kRows;
      args.num_heads = kHeads;
      args.head_dim = kD;
      args.q = q.data();
      args.weights_raw = w.data();
      args.positions = positions.data();
      args.rope = {RopeStyle::kNeox, 0, 64, inv_freq.data()};
      args.hadamard = hadamard;
      args.format = format;
      args.q_codes = codes.data();
      args.q_scales = scales.data();
      args.weights_out = weights.data();
      ASSERT_TRUE(cpu::RopeQuantQ(args).ok());
      const float c = static_cast<float>(1.0 / std::sqrt(double{kHeads} * kD));
      for (int r = 0; r < kRows; ++r) {
        for (int h = 0; h < kHeads; ++h) {
          const int v = r * kHeads + h;
          std::vector<float> x(q.begin() + v * kD, q.begin() + (v + 1) * kD);
          cpu::ApplyRope(x.data(), positions[r], args.rope);
          if (hadamard) cpu::HadamardInPlace(x.data(), kD);
          if (format == CacheFormat::kFp8) {
            std::vector<uint8_t> want(kD);
            const float s = cpu::QuantizeFp8(x.data(), kD, want.data());
            ASSERT_EQ(std::memcmp(codes.data() + v * kD, want.data(), kD), 0);
            ASSERT_EQ(weights[v], (w[v] * c) * s);
          } else {
            std::vector<uint8_t> want(kD / 2), want_scales(kD / 32);
            cpu::QuantizeFp4(x.data(), kD, want.data(), want_scales.data());
            ASSERT_EQ(std::memcmp(codes.data() + v * kD / 2, want.data(), kD / 2), 0);
            ASSERT_EQ(std::memcmp(scales.data() + v * kD / 32, want_scales.data(), kD / 32), 0);
            ASSERT_EQ(weights[v], w[v] * c);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace decode_indexer::testing
