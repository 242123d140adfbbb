// Dense logits vs the double oracle, the top-k rule, candidate blocks, expansion, and the two
// consumers (sparse and masked) against each other and the oracle.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/kernels/topk_check.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

using namespace kernels;

// |cpu - oracle| is one float rounding of (nearly) the exact value.
void ExpectLogitsMatchOracle(Scene& s, int32_t r) {
  const std::vector<float> got = cpu::RowLogits(s.cache(), s.rows(), s.q(), r);
  ASSERT_EQ(got.size(), static_cast<size_t>(s.row_length[r]));
  const std::vector<double> want = OracleRow(s, r);
  double max_abs = 0.0;
  for (double v : want) max_abs = std::max(max_abs, std::fabs(v));
  ASSERT_GT(max_abs, 0.0);
  for (size_t t = 0; t < got.size(); ++t) {
    ASSERT_NEAR(got[t], want[t], std::ldexp(std::fabs(want[t]), -23) + 1e-12 * max_abs)
        << "row " << r << " position " << t;
  }
}

struct LogitsCase {
  CacheFormat format;
  int32_t heads;
  int32_t next_n;
};

class DenseLogitsTest : public ::testing::TestWithParam<LogitsCase> {};

TEST_P(DenseLogitsTest, MatchOracleOnEveryRow) {
  const LogitsCase c = GetParam();
  SceneSpec spec;
  spec.format = c.format;
  spec.heads = c.heads;
  spec.next_n = c.next_n;
  spec.lengths = {300, 77, 129};
  Scene s = MakeScene(spec);
  for (int32_t r = 0; r < s.num_rows(); ++r) ExpectLogitsMatchOracle(s, r);
  // The kernel scores exactly [0, row_length) of each row: with K above every length the
  // answer is every such position and nothing else, although the cache holds the request's
  // later keys (row j of a request sees L - n + j + 1 of its L positions).
  const int32_t k = 320;
  std::vector<int32_t> out(size_t(s.num_rows()) * k, -9);
  DenseArgs a;
  a.cache = s.cache();
  a.rows = s.rows();
  a.q = s.q();
  a.topk = k;
  a.topk_out = out.data();
  ASSERT_TRUE(cpu::DenseTopK(a).ok());
  for (int32_t r = 0; r < s.num_rows(); ++r) {
    const int32_t len = spec.lengths[r / c.next_n] - c.next_n + r % c.next_n + 1;
    std::vector<int32_t> want(k, -1);
    std::iota(want.begin(), want.begin() + len, 0);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), out.begin() + size_t(r) * k)) << "row " << r;
  }
}

TEST_P(DenseLogitsTest, LogitsAtPositionsEqualDenseLogits) {
  const LogitsCase c = GetParam();
  SceneSpec spec;
  spec.format = c.format;
  spec.heads = c.heads;
  spec.next_n = c.next_n;
  spec.lengths = {211, 64};
  Scene s = MakeScene(spec);
  std::mt19937_64& rng = PerTestRng();
  for (int32_t r = 0; r < s.num_rows(); ++r) {
    const std::vector<float> dense = cpu::RowLogits(s.cache(), s.rows(), s.q(), r);
    std::vector<int32_t> positions;
    for (int32_t t = 0; t < s.row_length[r]; ++t) {
      if (rng() % 3 == 0) positions.push_back(t);
    }
    std::vector<float> at(positions.size());
    cpu::RowLogitsAt(s.cache(), s.rows(), s.q(), r, positions.data(),
                     static_cast<int32_t>(positions.size()), at.data());
    for (size_t i = 0; i < positions.size(); ++i) ASSERT_EQ(at[i], dense[positions[i]]);
  }
}

INSTANTIATE_TEST_SUITE_P(Profiles, DenseLogitsTest,
                         ::testing::Values(LogitsCase{CacheFormat::kFp8, 64, 1},
                                           LogitsCase{CacheFormat::kFp8, 5, 3},
                                           LogitsCase{CacheFormat::kFp4, 32, 2},
                                           LogitsCase{CacheFormat::kFp4, 3, 4}),
                         [](const ::testing::TestParamInfo<LogitsCase>& info) {
                           return absl::StrCat(FormatName(info.param.format), "_H",
                                               info.param.heads, "_next", info.param.next_n);
                         });

// ---- Top-k rule ----------------------------------------------------------------------------

std::vector<float> TieHeavyLogits(std::mt19937_64& rng, int32_t n, int32_t distinct) {
  std::uniform_int_distribution<int32_t> pick(0, distinct - 1);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(pick(rng)) * 0.25f - 3.0f;
  return v;
}

TEST(TopK, CanonicalRuleWithTiesToLowerPositions) {
  std::mt19937_64& rng = PerTestRng();
  for (int32_t k : {2048, 512, 7}) {
    for (int32_t n : {k + 1, k + 17, 3 * k, 5000}) {
      for (int32_t distinct : {2, 10, 1000000}) {
        const std::vector<float> logits = TieHeavyLogits(rng, n, distinct);
        std::vector<int32_t> got(k);
        cpu::TopK(logits.data(), n, k, got.data());
        ASSERT_EQ(got, NaiveTopK(logits, Iota(n), k)) << "k " << k << " n " << n;
        std::vector<double> exact(logits.begin(), logits.end());
        EXPECT_TRUE(CheckTopKRow(got.data(), k, exact, 0.0));
      }
    }
  }
}

TEST(TopK, ShortRowsAreEveryPositionPadded) {
  std::mt19937_64& rng = PerTestRng();
  for (int32_t k : {2048, 512}) {
    for (int32_t n : {1, 2, k - 1, k}) {
      const std::vector<float> logits = TieHeavyLogits(rng, n, 50);
      std::vector<int32_t> got(k, 12345);
      cpu::TopK(logits.data(), n, k, got.data());
      for (int32_t i = 0; i < k; ++i) ASSERT_EQ(got[i], i < n ? i : -1);
    }
  }
}

TEST(TopK, SubsetSelectsAmongListedPositions) {
  std::mt19937_64& rng = PerTestRng();
  for (int32_t trial = 0; trial < 20; ++trial) {
    std::vector<int32_t> positions;
    for (int32_t p = 0; p < 3000; ++p) {
      if (rng() % 2) positions.push_back(p);
    }
    const int32_t n = static_cast<int32_t>(positions.size());
    const std::vector<float> logits = TieHeavyLogits(rng, n, 8);
    for (int32_t k : {512, 2048}) {
      std::vector<int32_t> got(k);
      cpu::TopKAt(logits.data(), positions.data(), n, k, got.data());
      ASSERT_EQ(got, NaiveTopK(logits, positions, k));
    }
  }
}

// NaN logits rank below every number (a NaN is reachable: scores that overflow to inf - inf,
// or q a client rewrote in its shared memory after the edge checked it). A row is still
// exactly k positions, ascending, each below the length, chosen as if every NaN were -inf,
// and nothing of what `out` held before survives: out is the rank's reused top-k buffer,
// where an earlier step's answer (another client's, maybe) would be sent as this one's.
TEST(TopK, NanLogitsRankLowestAndNeverLeaveStaleEntries) {
  std::mt19937_64 rng(35);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int32_t k : {7, 512}) {
    for (int32_t n : {k + 1, 3 * k, 5000}) {
      for (int nan_percent : {100, 90, 50, 1}) {
        std::vector<float> logits = TieHeavyLogits(rng, n, 1000);
        std::vector<float> ranked = logits;
        for (int32_t i = 0; i < n; ++i) {
          if (static_cast<int>(rng() % 100) < nan_percent) {
            logits[i] = nan;
            ranked[i] = -INFINITY;
          }
        }
        std::vector<int32_t> got(k, 12345);
        cpu::TopK(logits.data(), n, k, got.data());
        ASSERT_EQ(got, NaiveTopK(ranked, Iota(n), k))
            << "k " << k << " n " << n << " NaN " << nan_percent << "%";
        std::vector<int32_t> positions(n);
        for (int32_t i = 0; i < n; ++i) positions[i] = 2 * i + 1;
        std::fill(got.begin(), got.end(), 12345);
        cpu::TopKAt(logits.data(), positions.data(), n, k, got.data());
        ASSERT_EQ(got, NaiveTopK(ranked, positions, k))
            << "subset, k " << k << " n " << n << " NaN " << nan_percent << "%";
      }
    }
  }
  // Candidate blocks from NaN logits: ascending block ids below the length's blocks, the
  // newest last, never what the buffer held.
  for (int32_t length : {9, 1000, 17000}) {
    std::vector<float> logits(length, nan);
    std::vector<int32_t> got(16, 999);
    cpu::SelectCandidateBlocks(logits.data(), length, 16, 8, got.data());
    const int32_t blocks = (length + 7) / 8;
    const int32_t count = std::min(16, blocks);
    for (int32_t i = 0; i < 16; ++i) {
      if (i < count) {
        ASSERT_GE(got[i], 0) << "length " << length;
        ASSERT_LT(got[i], blocks) << "length " << length;
        if (i > 0) {
          ASSERT_GT(got[i], got[i - 1]) << "length " << length;
        }
      } else {
        ASSERT_EQ(got[i], -1) << "length " << length;
      }
    }
    EXPECT_EQ(got[count - 1], blocks - 1);
  }
}

// The checker itself must reject wrong answers.
TEST(TopKCheck, RejectsMalformedAndWrongRows) {
  std::mt19937_64& rng = PerTestRng();
  // Exact logits that fp32 holds exactly, so that `good` (the CPU's top-k of the fp32 values)
  // is the exact top-k. Doubles rounded to fp32 can swap two values closer than an fp32
  // rounding (~6e-8 here, far above the 1e-9 tolerance below) across the K-th: a correct
  // fp32 answer that the checker rightly rejects at 1e-9 (spec section 6 allows such swaps
  // only within the tolerance; seed 1921266 drew one).
  std::vector<double> exact(100);
  for (double& v : exact) {
    v = static_cast<float>(std::uniform_real_distribution<double>(-1, 1)(rng));
  }
  std::vector<float> f(exact.begin(), exact.end());
  std::vector<int32_t> good(10);
  cpu::TopK(f.data(), 100, 10, good.data());
  ASSERT_TRUE(CheckTopKRow(good.data(), 10, exact, 1e-9));
  std::vector<int32_t> bad = good;
  std::swap(bad[0], bad[1]);  // not ascending
  EXPECT_FALSE(CheckTopKRow(bad.data(), 10, exact, 1e-9));
  bad = good;
  bad[9] = -1;  // missing entry
  EXPECT_FALSE(CheckTopKRow(bad.data(), 10, exact, 1e-9));
  // Replace the returned position with the smallest logit by the best left-out one... and by
  // the worst left-out one: only the latter is wrong.
  std::vector<int32_t> order = Iota(100);
  std::sort(order.begin(), order.end(), [&](int a, int b) {  // canonical: ties to lower
    return exact[a] != exact[b] ? exact[a] > exact[b] : a < b;
  });
  bad = good;
  std::replace(bad.begin(), bad.end(), order[9], order[99]);
  std::sort(bad.begin(), bad.end());
  EXPECT_FALSE(CheckTopKRow(bad.data(), 10, exact, 1e-9));
  EXPECT_TRUE(CheckTopKRow(bad.data(), 10, exact, 10.0));  // within a huge tolerance
  std::vector<int32_t> short_row(200, -1);
  for (int i = 0; i < 100; ++i) short_row[i] = i;
  EXPECT_TRUE(CheckTopKRow(short_row.data(), 200, exact, 0.0));
  short_row[100] = 100;
  EXPECT_FALSE(CheckTopKRow(short_row.data(), 200, exact, 0.0));
}

// ---- Candidate blocks ----------------------------------------------------------------------

std::vector<int32_t> NaiveCandidates(const std::vector<float>& logits, int32_t length,
                                     int32_t num_blocks, int32_t bs) {
  const int32_t blocks = (length + bs - 1) / bs;
  std::vector<double> score(blocks, -INFINITY);
  for (int32_t p = 0; p < length; ++p) score[p / bs] = std::max<double>(score[p / bs], logits[p]);
  score[(length - 1) / bs] = INFINITY;
  std::vector<int32_t> out = NaiveTopK(score, Iota(blocks), std::min(num_blocks, blocks));
  out.resize(num_blocks, -1);
  return out;
}

TEST(Candidates, NewestBlockWinsAndCountIsBounded) {
  std::mt19937_64& rng = PerTestRng();
  for (int32_t num_blocks : {16, 2048}) {
    for (int32_t length : {1, 7, 8, 9, 127, 128, 129, 1000, 17000, 20003}) {
      // Ties between blocks are common with few distinct logits.
      for (int32_t distinct : {3, 100000}) {
        std::vector<float> logits = TieHeavyLogits(rng, length, distinct);
        // Make the newest block the worst, so only the +inf rule can keep it.
        for (int32_t p = (length - 1) / 8 * 8; p < length; ++p) logits[p] = -100.0f;
        std::vector<int32_t> got(num_blocks, 999);
        cpu::SelectCandidateBlocks(logits.data(), length, num_blocks, 8, got.data());
        ASSERT_EQ(got, NaiveCandidates(logits, length, num_blocks, 8))
            << "length " << length << " blocks " << num_blocks;
        const int32_t expected = std::min(num_blocks, (length + 7) / 8);
        const int32_t count = static_cast<int32_t>(
            std::count_if(got.begin(), got.end(), [](int32_t c) { return c >= 0; }));
        EXPECT_EQ(count, expected);
        EXPECT_EQ(got[count - 1], (length - 1) / 8);  // newest block, the largest id
        EXPECT_TRUE(std::is_sorted(got.begin(), got.begin() + count));
      }
    }
  }
}

TEST(Candidates, ExpansionListsPositionsBelowTheLength) {
  std::mt19937_64& rng = PerTestRng();
  constexpr int32_t kBlocks = 64, kBs = 8;
  std::vector<int32_t> lengths = {1, 8, 13, 300, 600, 511, 9};
  const int32_t rows = static_cast<int32_t>(lengths.size());
  std::vector<int32_t> candidates(rows * kBlocks);
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<float> logits = TieHeavyLogits(rng, lengths[r], 1000);
    cpu::SelectCandidateBlocks(logits.data(), lengths[r], kBlocks, kBs,
                               candidates.data() + r * kBlocks);
  }
  std::vector<int32_t> positions(rows * kBlocks * kBs, 777), counts(rows, -5);
  ExpandArgs args;
  args.num_rows = rows;
  args.candidates = candidates.data();
  args.row_length = lengths.data();
  args.num_candidate_blocks = kBlocks;
  args.candidate_block_size = kBs;
  args.out = {positions.data(), counts.data(), kBlocks * kBs};
  ASSERT_TRUE(cpu::ExpandCandidates(args).ok());
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<int32_t> want;
    for (int32_t i = 0; i < kBlocks; ++i) {
      const int32_t c = candidates[r * kBlocks + i];
      if (c < 0) continue;
      for (int32_t p = c * kBs; p < std::min(lengths[r], c * kBs + kBs); ++p) want.push_back(p);
    }
    ASSERT_EQ(counts[r], static_cast<int32_t>(want.size()));
    want.resize(kBlocks * kBs, -1);
    ASSERT_TRUE(std::equal(want.begin(), want.end(), positions.begin() + r * kBlocks * kBs));
  }
  // Invalid candidates are refused: a block beyond the length, a duplicate.
  candidates[0] = 1;  // row 0 has length 1: only block 0 exists
  EXPECT_FALSE(cpu::ExpandCandidates(args).ok());
}

// ---- The full source -> consumer pipeline ---------------------------------------------------

struct PipelineCase {
  CacheFormat format;
  int32_t next_n;
  int32_t topk;
};

class PipelineTest : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(PipelineTest, DenseSparseAndMaskedAgreeWithTheOracle) {
  const PipelineCase c = GetParam();
  constexpr int32_t kBlocks = 24, kBs = 8;
  // Source and consumer layers: the consumer has its own q over the source's cache.
  SceneSpec spec;
  spec.format = c.format;
  spec.heads = 4;
  spec.next_n = c.next_n;
  spec.lengths = {700, 40, 263, 9};  // rows both longer and shorter than K
  Scene source = MakeScene(spec);
  Scene consumer = source;
  {
    SceneSpec q_spec = spec;
    q_spec.seed = PerTestRng()();  // its own q and weights
    Scene other = MakeScene(q_spec);
    consumer.q_codes = other.q_codes;
    consumer.q_scales = other.q_scales;
    consumer.weights = other.weights;
  }
  const int32_t rows = source.num_rows();
  std::vector<int32_t> topk(rows * c.topk), candidates(rows * kBlocks);
  DenseArgs dense;
  dense.cache = source.cache();
  dense.rows = source.rows();
  dense.q = source.q();
  dense.topk = c.topk;
  dense.topk_out = topk.data();
  dense.candidates_out = candidates.data();
  dense.num_candidate_blocks = kBlocks;
  dense.candidate_block_size = kBs;
  ASSERT_TRUE(cpu::DenseTopK(dense).ok());
  for (int32_t r = 0; r < rows; ++r) {
    const std::vector<float> logits = cpu::RowLogits(source.cache(), source.rows(), source.q(), r);
    std::vector<int32_t> want(c.topk);
    cpu::TopK(logits.data(), source.row_length[r], c.topk, want.data());
    ASSERT_TRUE(std::equal(want.begin(), want.end(), topk.begin() + r * c.topk));
    std::vector<int32_t> want_c(kBlocks);
    cpu::SelectCandidateBlocks(logits.data(), source.row_length[r], kBlocks, kBs, want_c.data());
    ASSERT_TRUE(std::equal(want_c.begin(), want_c.end(), candidates.begin() + r * kBlocks));
    const std::vector<double> exact = OracleRow(source, r);
    EXPECT_TRUE(CheckTopKRow(topk.data() + r * c.topk, c.topk, exact, TopKTolerance(exact)))
        << "row " << r;
  }

  std::vector<int32_t> positions(rows * kBlocks * kBs), counts(rows);
  ExpandArgs expand;
  expand.num_rows = rows;
  expand.candidates = candidates.data();
  expand.row_length = source.row_length.data();
  expand.num_candidate_blocks = kBlocks;
  expand.candidate_block_size = kBs;
  expand.out = {positions.data(), counts.data(), kBlocks * kBs};
  ASSERT_TRUE(cpu::ExpandCandidates(expand).ok());

  std::vector<int32_t> sparse_out(rows * c.topk, 5), masked_out(rows * c.topk, 6);
  SparseArgs sparse;
  sparse.cache = consumer.cache();
  sparse.rows = consumer.rows();
  sparse.q = consumer.q();
  sparse.positions = positions.data();
  sparse.counts = counts.data();
  sparse.max_positions = kBlocks * kBs;
  sparse.topk = c.topk;
  sparse.topk_out = sparse_out.data();
  ASSERT_TRUE(cpu::SparseTopK(sparse).ok());
  MaskedArgs masked;
  masked.cache = consumer.cache();
  masked.rows = consumer.rows();
  masked.q = consumer.q();
  masked.candidates = candidates.data();
  masked.num_candidate_blocks = kBlocks;
  masked.candidate_block_size = kBs;
  masked.topk = c.topk;
  masked.topk_out = masked_out.data();
  ASSERT_TRUE(cpu::MaskedTopK(masked).ok());
  EXPECT_EQ(sparse_out, masked_out);
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<int32_t> pos(positions.begin() + r * kBlocks * kBs,
                             positions.begin() + r * kBlocks * kBs + counts[r]);
    std::vector<double> exact;
    for (int32_t p : pos) exact.push_back(OracleLogit(consumer, r, p));
    EXPECT_TRUE(
        CheckTopKRow(sparse_out.data() + r * c.topk, c.topk, exact, TopKTolerance(exact), &pos))
        << "row " << r;
  }
}

TEST(DenseTopK, ExplicitRowLengthsInAnyOrder) {
  // A request may give each row's length explicitly: rows of one request need not be causal.
  SceneSpec spec;
  spec.heads = 8;
  spec.next_n = 4;
  spec.lengths = {500, 120};
  Scene s = MakeScene(spec);
  std::mt19937_64& rng = PerTestRng();
  for (int32_t r = 0; r < s.num_rows(); ++r) {
    s.row_length[r] = 1 + static_cast<int32_t>(rng() % spec.lengths[s.row_request[r]]);
  }
  constexpr int32_t kTopK = 40;
  std::vector<int32_t> out(s.num_rows() * kTopK);
  ASSERT_TRUE(cpu::DenseTopK({s.cache(), s.rows(), s.q(), kTopK, out.data()}).ok());
  for (int32_t r = 0; r < s.num_rows(); ++r) {
    const std::vector<double> exact = OracleRow(s, r);
    EXPECT_TRUE(CheckTopKRow(out.data() + r * kTopK, kTopK, exact, TopKTolerance(exact)))
        << "row " << r << " length " << s.row_length[r];
  }
}

TEST(DenseTopK, RejectsRowsBeyondTheirPageTable) {
  SceneSpec spec;
  spec.lengths = {100};
  Scene s = MakeScene(spec);
  s.row_length[0] = s.stride * spec.page_size + 1;
  std::vector<int32_t> out(16);
  EXPECT_EQ(cpu::DenseTopK({s.cache(), s.rows(), s.q(), 16, out.data()}).code(),
            absl::StatusCode::kInvalidArgument);
  s.row_length[0] = 0;
  EXPECT_EQ(cpu::DenseTopK({s.cache(), s.rows(), s.q(), 16, out.data()}).code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Cases, PipelineTest,
                         ::testing::Values(PipelineCase{CacheFormat::kFp8, 1, 64},
                                           PipelineCase{CacheFormat::kFp8, 4, 50},
                                           PipelineCase{CacheFormat::kFp4, 2, 64},
                                           PipelineCase{CacheFormat::kFp4, 3, 512}),
                         [](const ::testing::TestParamInfo<PipelineCase>& info) {
                           return absl::StrCat(FormatName(info.param.format), "_next",
                                               info.param.next_n, "_K", info.param.topk);
                         });

}  // namespace
}  // namespace decode_indexer::testing
