// Unit tests of the load tester's pieces that need no server: the near-tie rule --verify
// applies to other backends, the layer plan, and the percentile summary.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "client/load/report.h"
#include "client/load/runner.h"
#include "client/load/server_model.h"
#include "client/load/verify.h"
#include "gtest/gtest.h"
#include "tests/test_seed.h"

namespace decode_indexer::load {
namespace {

// The canonical top-k (logit desc, position asc), ascending, -1 padded.
std::vector<int32_t> CanonicalTopK(const std::vector<float>& logits,
                                   const std::vector<int32_t>& positions, int32_t k) {
  std::vector<size_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : positions[a] < positions[b];
  });
  std::vector<int32_t> out;
  for (size_t i = 0; i < order.size() && out.size() < size_t(k); ++i) {
    out.push_back(positions[order[i]]);
  }
  std::sort(out.begin(), out.end());
  out.resize(k, -1);
  return out;
}

class ToleranceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
    std::normal_distribution<float> normal(0, 1);
    const int n = 200 + static_cast<int>(rng() % 200);
    // A sparse, shuffled subset of positions, as a consumer scores.
    for (int p = 0; p < 3 * n; ++p) {
      if (rng() % 3 == 0) positions_.push_back(p);
    }
    for (size_t i = 0; i < positions_.size(); ++i) logits_.push_back(normal(rng));
    k_ = 16 + static_cast<int>(rng() % 32);
    answer_ = CanonicalTopK(logits_, positions_, k_);
  }

  // Index (into positions_) of the chosen entry with the smallest logit, and of the left-out
  // one with the largest.
  std::pair<size_t, size_t> Boundary() const {
    size_t worst_in = 0, best_out = 0;
    float lo = 1e30f, hi = -1e30f;
    for (size_t i = 0; i < positions_.size(); ++i) {
      const bool in = std::binary_search(answer_.begin(), answer_.end() - Padding(), positions_[i]);
      if (in && logits_[i] < lo) lo = logits_[i], worst_in = i;
      if (!in && logits_[i] > hi) hi = logits_[i], best_out = i;
    }
    return {worst_in, best_out};
  }
  long Padding() const { return std::count(answer_.begin(), answer_.end(), -1); }

  std::vector<int32_t> Swapped(size_t out_index, size_t in_index) const {
    std::vector<int32_t> a = answer_;
    std::replace(a.begin(), a.end(), positions_[out_index], positions_[in_index]);
    std::sort(a.begin(), a.end() - Padding());
    return a;
  }

  std::vector<int32_t> positions_;
  std::vector<float> logits_;
  int32_t k_ = 0;
  std::vector<int32_t> answer_;
};

TEST_F(ToleranceTest, ExactAnswerPasses) {
  EXPECT_TRUE(TopKWithinTolerance(logits_, positions_, answer_.data(), k_, 0.0));
}

TEST_F(ToleranceTest, NearTieSwapPassesOnlyWithinTolerance) {
  auto [worst_in, best_out] = Boundary();
  // Make the best left-out position a near-tie of the K-th: just below it.
  logits_[best_out] = logits_[worst_in] * (1 - 1e-6f) - 1e-7f;
  answer_ = CanonicalTopK(logits_, positions_, k_);
  std::tie(worst_in, best_out) = Boundary();
  const std::vector<int32_t> swapped = Swapped(worst_in, best_out);
  EXPECT_TRUE(TopKWithinTolerance(logits_, positions_, swapped.data(), k_, 1e-3));
  EXPECT_FALSE(TopKWithinTolerance(logits_, positions_, swapped.data(), k_, 0.0));
}

TEST_F(ToleranceTest, ClearlyWrongAnswersFail) {
  // Swap the best chosen position for the worst left-out one.
  size_t best_in = 0, worst_out = 0;
  float hi = -1e30f, lo = 1e30f;
  for (size_t i = 0; i < positions_.size(); ++i) {
    const bool in = std::binary_search(answer_.begin(), answer_.end(), positions_[i]);
    if (in && logits_[i] > hi) hi = logits_[i], best_in = i;
    if (!in && logits_[i] < lo) lo = logits_[i], worst_out = i;
  }
  const std::vector<int32_t> bad = Swapped(best_in, worst_out);
  EXPECT_FALSE(TopKWithinTolerance(logits_, positions_, bad.data(), k_, 1e-3));
  // A position that was never scored, a duplicate, and a descending order all fail.
  std::vector<int32_t> unscored = answer_;
  unscored[0] = positions_.back() + 1;
  std::sort(unscored.begin(), unscored.end());
  EXPECT_FALSE(TopKWithinTolerance(logits_, positions_, unscored.data(), k_, 1e-3));
  std::vector<int32_t> duplicate = answer_;
  duplicate[1] = duplicate[0];
  EXPECT_FALSE(TopKWithinTolerance(logits_, positions_, duplicate.data(), k_, 1e-3));
  std::vector<int32_t> descending = answer_;
  std::reverse(descending.begin(), descending.end());
  EXPECT_FALSE(TopKWithinTolerance(logits_, positions_, descending.data(), k_, 1e-3));
}

TEST_F(ToleranceTest, ShortRowsMustReturnEverything) {
  const int32_t k = static_cast<int32_t>(positions_.size()) + 5;
  std::vector<int32_t> all = positions_;
  all.resize(k, -1);
  EXPECT_TRUE(TopKWithinTolerance(logits_, positions_, all.data(), k, 0.0));
  all[0] = -1;  // one missing
  std::rotate(all.begin(), all.begin() + 1, all.end());
  EXPECT_FALSE(TopKWithinTolerance(logits_, positions_, all.data(), k, 1.0));
}

v1::LayerInfo Layer(int layer, v1::LayerRole role, int cache_layer) {
  v1::LayerInfo l;
  l.set_layer(layer);
  l.set_role(role);
  l.set_cache_layer(cache_layer);
  l.set_cache_format(v1::CACHE_FORMAT_FP4);
  return l;
}

TEST(ServerModelTest, ConsumersRunAfterTheirSource) {
  // A plan (listed out of order) where consumer 1 reads source 3: it must wait for it.
  v1::ServerInfo info;
  info.set_num_heads(8);
  info.set_head_dim(128);
  info.set_topk(64);
  info.set_page_size(64);
  *info.add_layers() = Layer(4, v1::LAYER_ROLE_CANDIDATE_CONSUMER, 3);
  *info.add_layers() = Layer(0, v1::LAYER_ROLE_DENSE, 0);
  *info.add_layers() = Layer(1, v1::LAYER_ROLE_CANDIDATE_CONSUMER, 3);
  *info.add_layers() = Layer(3, v1::LAYER_ROLE_CANDIDATE_SOURCE, 3);
  *info.add_layers() = Layer(2, v1::LAYER_ROLE_DENSE, 2);
  auto model = BuildServerModel(info, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> order;
  for (const LayerStep& s : model->plan) order.push_back(s.layer);
  EXPECT_EQ(order, (std::vector<int32_t>{0, 2, 3, 1, 4}));
  EXPECT_EQ(model->cache_layers, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_FALSE(model->plan[3].owns_cache);

  auto cut = BuildServerModel(info, 3);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(cut->plan.size(), 3u);

  *info.add_layers() = Layer(5, v1::LAYER_ROLE_CANDIDATE_CONSUMER, 9);  // no such source
  EXPECT_FALSE(BuildServerModel(info, 0).ok());
}

TEST(ReportTest, PercentilesAreNearestRank) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  std::vector<double> us(1000 + rng() % 1000);
  for (double& v : us) v = 1 + rng() % 1000000;
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  auto rank = [&](double p) {
    return sorted[static_cast<size_t>(std::ceil(p / 100 * sorted.size())) - 1] / 1e3;
  };
  const LatencySummary s = Summarize(us);
  EXPECT_EQ(s.count, us.size());
  EXPECT_DOUBLE_EQ(s.p50, rank(50));
  EXPECT_DOUBLE_EQ(s.p99, rank(99));
  EXPECT_DOUBLE_EQ(s.p999, rank(99.9));
  EXPECT_DOUBLE_EQ(s.max, sorted.back() / 1e3);
  EXPECT_NEAR(s.mean, std::accumulate(us.begin(), us.end(), 0.0) / us.size() / 1e3, 1e-9);
}

// Backoff after failures: doubles from the initial wait, capped, jittered into [50%, 100%)
// of the envelope, and nothing before the first failure.
TEST(BackoffTest, ExponentialCappedJittered) {
  EXPECT_EQ(BackoffDelayMs(0, 10, 1000, 0.5), 0);
  EXPECT_EQ(BackoffDelayMs(3, 0, 1000, 0.5), 0);  // --backoff-initial-ms 0: off
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int failures = 1; failures <= 40; ++failures) {
    const double envelope = std::min(1000.0, 10.0 * std::pow(2.0, failures - 1));
    const double d = BackoffDelayMs(failures, 10, 1000, unit(rng));
    EXPECT_GE(d, 0.5 * envelope) << failures;
    EXPECT_LE(d, envelope) << failures;
  }
  EXPECT_EQ(BackoffDelayMs(1, 10, 1000, 0.0), 5);
  EXPECT_EQ(BackoffDelayMs(4, 10, 1000, 1.0), 80);
  EXPECT_EQ(BackoffDelayMs(30, 10, 1000, 1.0), 1000);
  // Two workers failing together with different jitter wait different times.
  EXPECT_NE(BackoffDelayMs(5, 10, 1000, 0.1), BackoffDelayMs(5, 10, 1000, 0.9));
}

// The JSON histogram: every latency in exactly one bucket, the right one.
TEST(ReportTest, HistogramBucketsEveryLatency) {
  const std::vector<double> us = {5, 10, 11, 1500, 2000, 2001, 7e5, 2e11};
  const nlohmann::json h = HistogramJson(us);
  const std::vector<double> bounds = h["bounds_ms"];
  const std::vector<uint64_t> counts = h["counts"];
  ASSERT_EQ(counts.size(), bounds.size() + 1);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), uint64_t{0}), us.size());
  auto at = [&](double ms) {
    return std::lower_bound(bounds.begin(), bounds.end(), ms) - bounds.begin();
  };
  EXPECT_EQ(counts[at(0.01)], 2u);  // 5 us and 10 us: <= 0.01 ms
  EXPECT_EQ(counts[at(0.02)], 1u);  // 11 us
  EXPECT_EQ(counts[at(2)], 2u);     // 1.5 ms, 2 ms
  EXPECT_EQ(counts[at(5)], 1u);     // 2.001 ms
  EXPECT_EQ(counts.back(), 1u);     // above every bound
  // Clean decimal bounds (no 0.30000000000000004).
  for (double b : bounds) EXPECT_LE(nlohmann::json(b).dump().size(), 8u) << b;
}

// --csv appends: the header once, one row per run; another report's columns are refused.
TEST(ReportTest, CsvIsAppendedNotOverwritten) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("di-load-csv-" + std::to_string(getpid()) + ".csv"))
                               .string();
  std::filesystem::remove(path);
  ASSERT_TRUE(AppendCsv(path, "a,b\n1,2\n").ok());
  ASSERT_TRUE(AppendCsv(path, "a,b\n3,4\n").ok());
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), "a,b\n1,2\n3,4\n");
  const absl::Status other = AppendCsv(path, "a,b,c\n5,6,7\n");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  std::filesystem::remove(path);
}

TEST(ReportTest, IsoTimeIsUtc) {
  EXPECT_EQ(IsoTimeUtc(0), "1970-01-01T00:00:00.000Z");
  EXPECT_EQ(IsoTimeUtc(1764618126.25), "2025-12-01T19:42:06.250Z");
}

}  // namespace
}  // namespace decode_indexer::load
