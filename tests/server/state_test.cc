// Host state: the page allocator, the sequence table, and the row_shard_bounds gate.
#include <algorithm>
#include <atomic>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/exec/bulk_copy.h"
#include "server/exec/row_shard.h"
#include "server/state/page_allocator.h"
#include "server/state/sequence_table.h"
#include "tests/test_seed.h"

namespace decode_indexer {
namespace {

using ::testing::HasSubstr;

TEST(PageAllocator, ReserveIsAllOrNothing) {
  state::PageAllocator pages("cache layer 3", "pages", 10);
  absl::StatusOr<std::vector<int32_t>> a = pages.Reserve(7);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), 7u);
  EXPECT_EQ(pages.free(), 3);
  absl::StatusOr<std::vector<int32_t>> b = pages.Reserve(4);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("cache layer 3: need 4 pages, only 3 of 10 free"));
  EXPECT_EQ(pages.free(), 3);  // nothing taken
  absl::StatusOr<std::vector<int32_t>> none = pages.Reserve(0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  pages.Release(*a);
  EXPECT_EQ(pages.free(), 10);
}

// A fresh pool hands out ascending runs, and a run released as one comes back in its order:
// what lets an export or import copy a cache's pages a run at a time.
TEST(PageAllocator, FreshAndReleasedRunsAreAscending) {
  state::PageAllocator pages("cache layer 0", "pages", 100);
  absl::StatusOr<std::vector<int32_t>> a = pages.Reserve(5);
  absl::StatusOr<std::vector<int32_t>> b = pages.Reserve(40);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  for (size_t i = 0; i < b->size(); ++i) EXPECT_EQ((*b)[i], 5 + int32_t(i));
  pages.Release(*b);
  absl::StatusOr<std::vector<int32_t>> c = pages.Reserve(40);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, *b);
}

// A random run of reserves and releases against a model: units are never handed out twice,
// every one comes back, and the counts agree.
TEST(PageAllocator, RandomReserveReleaseMatchesModel) {
  const uint64_t seed = ::decode_indexer::testing::TestSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t total = 200;
  state::PageAllocator pages("cache layer 0", "pages", total);
  std::set<int32_t> held;
  std::vector<std::vector<int32_t>> lists;
  for (int step = 0; step < 2000; ++step) {
    if (lists.empty() || rng() % 3 != 0) {
      const int64_t n = int64_t(rng() % 20);
      absl::StatusOr<std::vector<int32_t>> got = pages.Reserve(n);
      ASSERT_EQ(got.ok(), n <= total - int64_t(held.size()));
      if (!got.ok()) continue;
      for (int32_t p : *got) {
        ASSERT_GE(p, 0);
        ASSERT_LT(p, total);
        ASSERT_TRUE(held.insert(p).second) << "page " << p << " handed out twice";
      }
      lists.push_back(*got);
    } else {
      const size_t i = rng() % lists.size();
      for (int32_t p : lists[i]) held.erase(p);
      pages.Release(lists[i]);
      lists.erase(lists.begin() + i);
    }
    ASSERT_EQ(pages.free(), total - int64_t(held.size()));
  }
}

TEST(SequenceTable, CreateFindRemove) {
  state::SequenceTable table(3, 2);
  ASSERT_TRUE(table.Create(7).ok());
  EXPECT_EQ(table.Create(7).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(table.Create(9).ok());
  absl::Status full = table.Create(11);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_NE(table.Find(7), nullptr);
  EXPECT_EQ(table.Find(7)->caches.size(), 3u);
  table.Find(7)->caches[1].length = 42;
  table.Find(7)->caches[1].pages = {5, 1};
  state::SequenceState removed;
  ASSERT_TRUE(table.Remove(7, &removed).ok());
  EXPECT_EQ(removed.caches[1].length, 42);
  EXPECT_EQ(removed.caches[1].pages, (std::vector<int32_t>{5, 1}));
  EXPECT_EQ(table.Find(7), nullptr);
  EXPECT_EQ(table.Remove(7, &removed).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.size(), 1);
  EXPECT_TRUE(table.Create(11).ok());
}

// The seed's gate: world < 2, requests < min, requests % world, rows % requests and
// (rows / world) % 2 each keep the step unsharded.
TEST(RowShardBounds, GateTable) {
  struct Case {
    int32_t rows, requests, world, min;
    bool sharded;
  };
  const Case cases[] = {
      {16, 8, 1, 8, false},  // one rank
      {16, 8, 2, 8, true},   // 8 rows a rank
      {14, 7, 2, 4, false},  // requests % world
      {16, 4, 2, 8, false},  // fewer requests than the minimum
      {12, 8, 2, 8, false},  // rows % requests: not uniform
      {8, 8, 4, 8, true},    // 2 rows a rank
      {8, 8, 8, 8, false},   // 1 row a rank: odd
      {24, 8, 4, 8, true},   // 3 rows a request, 6 a rank
      {12, 4, 4, 2, false},  // 3 rows a rank: odd
      {32, 16, 2, 1, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.rows, " rows ", c.requests, " requests ", c.world, " ranks"));
    int32_t next = 0;
    for (int32_t r = 0; r < c.world; ++r) {
      std::optional<exec::RowRange> b = exec::RowShardBounds(c.rows, c.requests, c.world, r, c.min);
      ASSERT_EQ(b.has_value(), c.sharded);
      if (!b) continue;
      // Contiguous, equal, even-aligned slices covering every row.
      EXPECT_EQ(b->start, next);
      EXPECT_EQ(b->end - b->start, c.rows / c.world);
      EXPECT_EQ(b->start % 2, 0);
      next = b->end;
    }
    if (c.sharded) {
      EXPECT_EQ(next, c.rows);
    }
  }
}

}  // namespace
}  // namespace decode_indexer

namespace decode_indexer::testing {
namespace {

// BulkCopy with helper threads copies exactly (every byte, no byte outside the destination),
// for sizes below and above the threshold, unaligned pointers and lengths, and from several
// callers at once (the ones that find the helpers busy copy alone).
TEST(BulkCopy, CopiesExactlyWithHelpersAndConcurrentCallers) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (int helpers : {0, 1, 3}) {
    exec::SetBulkCopyHelpers(helpers);
    ASSERT_EQ(exec::BulkCopyHelpers(), helpers);
    for (size_t bytes : {size_t{1}, size_t{4095}, exec::kBulkCopyMin - 1, exec::kBulkCopyMin,
                         exec::kBulkCopyMin + 4097, size_t{3} << 20}) {
      SCOPED_TRACE(absl::StrCat(helpers, " helpers, ", bytes, " bytes"));
      const size_t skew = rng() % 64;
      std::vector<uint8_t> src(bytes + 64), dst(bytes + 128, 0xA5);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      exec::BulkCopy(dst.data() + 64 + skew, src.data() + skew, bytes);
      EXPECT_TRUE(
          std::equal(src.begin() + skew, src.begin() + skew + bytes, dst.begin() + 64 + skew));
      EXPECT_TRUE(
          std::all_of(dst.begin(), dst.begin() + 64 + skew, [](uint8_t b) { return b == 0xA5; }));
      EXPECT_TRUE(std::all_of(dst.begin() + 64 + skew + bytes, dst.end(),
                              [](uint8_t b) { return b == 0xA5; }));
    }
  }
  exec::SetBulkCopyHelpers(2);
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&wrong, t] {
      std::vector<uint8_t> src(size_t{1} << 20), dst(src.size());
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + t + round);
        exec::BulkCopy(dst.data(), src.data(), src.size());
        wrong += dst != src;
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(wrong.load(), 0);
  exec::SetBulkCopyHelpers(0);
}

}  // namespace
}  // namespace decode_indexer::testing
