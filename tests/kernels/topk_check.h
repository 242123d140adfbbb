// A reusable checker of one top-k answer row against exact logits (spec section 6).
//
// A backend whose accumulation order differs from the reference may differ from it only at
// near-ties: every returned position's exact logit is >= the K-th largest exact logit - tol,
// and no left-out position's exact logit exceeds the K-th largest + tol. Beyond that the row
// must be well formed: the first min(K, n) entries are distinct valid positions in ascending
// order, the rest exactly -1, and when n <= K the row is every valid position.
//
//   EXPECT_TRUE(decode_indexer::testing::CheckTopKRow(row, k, exact, tol));
//   EXPECT_TRUE(CheckTopKRow(row, k, exact_at_candidates, tol, &candidate_positions));
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "gtest/gtest.h"

namespace decode_indexer::testing {

// answer: k entries. exact[i]: the exact logit of valid position i (positions == nullptr: the
// valid positions are 0..exact.size()-1) or of (*positions)[i] (ascending).
inline ::testing::AssertionResult CheckTopKRow(const int32_t* answer, int32_t k,
                                               const std::vector<double>& exact, double tol,
                                               const std::vector<int32_t>* positions = nullptr) {
  const int64_t n = static_cast<int64_t>(exact.size());
  if (positions != nullptr && static_cast<int64_t>(positions->size()) != n) {
    return ::testing::AssertionFailure() << "checker misuse: positions and exact differ in size";
  }
  std::unordered_map<int32_t, int64_t> index_of;  // position -> index into exact
  index_of.reserve(static_cast<size_t>(n) * 2);
  for (int64_t i = 0; i < n; ++i) {
    index_of[positions ? (*positions)[i] : static_cast<int32_t>(i)] = i;
  }
  const int64_t expected = std::min<int64_t>(k, n);
  std::vector<char> taken(static_cast<size_t>(n), 0);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t p = answer[j];
    if (j >= expected) {
      if (p != -1) {
        return ::testing::AssertionFailure()
               << "entry " << j << " = " << p << ", expected -1 padding after " << expected
               << " positions";
      }
      continue;
    }
    const auto it = index_of.find(p);
    if (it == index_of.end()) {
      return ::testing::AssertionFailure()
             << "entry " << j << " = " << p << " is not a valid position of the row";
    }
    if (j > 0 && p <= answer[j - 1]) {
      return ::testing::AssertionFailure()
             << "entries " << j - 1 << ", " << j << " (" << answer[j - 1] << ", " << p
             << ") are not strictly ascending";
    }
    taken[it->second] = 1;
  }
  if (n <= k) return ::testing::AssertionSuccess();  // every valid position, checked above
  std::vector<double> sorted = exact;
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<double>());
  const double kth = sorted[k - 1];
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = positions ? (*positions)[i] : static_cast<int32_t>(i);
    if (taken[i] && exact[i] < kth - tol) {
      return ::testing::AssertionFailure() << "returned position " << p << " has logit " << exact[i]
                                           << " < K-th largest " << kth << " - " << tol;
    }
    if (!taken[i] && exact[i] > kth + tol) {
      return ::testing::AssertionFailure() << "left-out position " << p << " has logit " << exact[i]
                                           << " > K-th largest " << kth << " + " << tol;
    }
  }
  return ::testing::AssertionSuccess();
}

// A tolerance of `ulps` float ulps of the row's largest magnitude: what rounding the exact
// logits to fp32 in a different order can move them by.
inline double TopKTolerance(const std::vector<double>& exact, double ulps = 4.0) {
  double m = 0.0;
  for (double v : exact) m = std::max(m, std::fabs(v));
  return m * ulps * std::ldexp(1.0, -24);
}

}  // namespace decode_indexer::testing
