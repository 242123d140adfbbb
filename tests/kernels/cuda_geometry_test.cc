// CudaSupportsGeometry / CudaSupportsRanks: every rule accepted and refused, without a GPU. The
// refused values are drawn fresh each run from the shapes the CUDA kernels do not take.
#include <cstdint>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/types.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_seed.h"

namespace decode_indexer::kernels {
namespace {

using ::testing::HasSubstr;

// A value in [lo, hi] other than the excluded ones.
int32_t Draw(std::mt19937& rng, int32_t lo, int32_t hi, std::initializer_list<int32_t> exclude) {
  std::uniform_int_distribution<int32_t> d(lo, hi);
  for (;;) {
    const int32_t v = d(rng);
    bool ok = true;
    for (int32_t e : exclude) ok = ok && v != e;
    if (ok) return v;
  }
}

CacheGeometry Supported(CacheFormat format) { return {format, 128, 64}; }

void ExpectRefused(const absl::Status& s, const std::string& field, int32_t value,
                   const std::string& takes) {
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field + ": " + std::to_string(value)));
  EXPECT_THAT(std::string(s.message()), HasSubstr("the CUDA backend takes " + takes));
}

TEST(CudaGeometryTest, AcceptsWhatTheKernelsTake) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  for (CacheFormat f : {CacheFormat::kFp8, CacheFormat::kFp4}) {
    for (int32_t heads : {32, 64}) {
      EXPECT_TRUE(CudaSupportsGeometry(Supported(f), heads, 0).ok());  // no candidate layers
      EXPECT_TRUE(CudaSupportsGeometry(Supported(f), heads, 8).ok());
      const int32_t bs = Draw(rng, 9, 4096, {});
      EXPECT_TRUE(CudaSupportsGeometry(Supported(f), heads, bs).ok()) << bs;
    }
  }
  for (int32_t r : {1, 16, Draw(rng, 2, 15, {})}) EXPECT_TRUE(CudaSupportsRanks(r).ok()) << r;
}

TEST(CudaGeometryTest, RefusesPageSize) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  for (int trial = 0; trial < 8; ++trial) {
    CacheGeometry g = Supported(trial % 2 ? CacheFormat::kFp4 : CacheFormat::kFp8);
    g.page_size = Draw(rng, 1, 4096, {64});
    ExpectRefused(CudaSupportsGeometry(g, 64, 8, "cache[3]"), "cache[3].page_size", g.page_size,
                  "64");
  }
  // The field prefix defaults to "cache".
  CacheGeometry g = Supported(CacheFormat::kFp8);
  g.page_size = 16;
  ExpectRefused(CudaSupportsGeometry(g, 32, 8), "cache.page_size", 16, "64");
}

TEST(CudaGeometryTest, RefusesHeadDim) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  for (int trial = 0; trial < 8; ++trial) {
    CacheGeometry g = Supported(trial % 2 ? CacheFormat::kFp4 : CacheFormat::kFp8);
    g.head_dim = 32 * Draw(rng, 1, 32, {4});
    ExpectRefused(CudaSupportsGeometry(g, 32, 0, "cache[0]"), "cache[0].head_dim", g.head_dim,
                  "128");
  }
}

TEST(CudaGeometryTest, RefusesHeads) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  for (int32_t heads : {Draw(rng, 1, 31, {}), Draw(rng, 33, 63, {}), Draw(rng, 65, 1024, {})}) {
    ExpectRefused(CudaSupportsGeometry(Supported(CacheFormat::kFp8), heads, 8), "num_heads", heads,
                  "32 or 64");
  }
}

TEST(CudaGeometryTest, RefusesSmallCandidateBlocks) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  const int32_t bs = Draw(rng, 1, 7, {});
  ExpectRefused(CudaSupportsGeometry(Supported(CacheFormat::kFp4), 32, bs), "candidate_block_size",
                bs, "0 (no candidate layers) or >= 8");
}

TEST(CudaGeometryTest, RefusesUnknownFormat) {
  CacheGeometry g = Supported(CacheFormat::kFp8);
  g.format = static_cast<CacheFormat>(7);
  ExpectRefused(CudaSupportsGeometry(g, 64, 0, "cache[1]"), "cache[1].format", 7, "fp8");
}

TEST(CudaGeometryTest, RefusesRanks) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  for (int32_t r : {0, Draw(rng, 17, 64, {})})
    ExpectRefused(CudaSupportsRanks(r), "ranks", r, "1 to 16");
}

}  // namespace
}  // namespace decode_indexer::kernels
