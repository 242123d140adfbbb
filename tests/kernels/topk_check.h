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
#include "reference/reference.h"

namespace decode_indexer::testing {

// answer: k entries. exact[i]: the exact logit of valid position i (positions == nullptr: the
// valid positions are 0..exact.size()-1) or of (*positions)[i] (ascending). The rule is
// di_reference's (reference::CheckTopKRow).
inline ::testing::AssertionResult CheckTopKRow(const int32_t* answer, int32_t k,
                                               const std::vector<double>& exact, double tol,
                                               const std::vector<int32_t>* positions = nullptr) {
  const std::string why = reference::CheckTopKRow(answer, k, exact, tol, positions);
  if (why.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why;
}

// A tolerance of `ulps` float ulps of the row's largest magnitude: what rounding the exact
// logits to fp32 in a different order can move them by.
inline double TopKTolerance(const std::vector<double>& exact, double ulps = 4.0) {
  double m = 0.0;
  for (double v : exact) m = std::max(m, std::fabs(v));
  return m * ulps * std::ldexp(1.0, -24);
}

}  // namespace decode_indexer::testing
