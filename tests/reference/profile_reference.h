// Glue between the server's profile types and di_reference (reference/reference.h): the
// profile's constants only, no backend code.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "reference/reference.h"
#include "server/config/profile.h"

namespace decode_indexer::testing {

inline reference::Format RefFormat(kernels::CacheFormat f) {
  return f == kernels::CacheFormat::kFp8 ? reference::Format::kFp8 : reference::Format::kFp4;
}

inline reference::Rope RefRope(const config::Profile& p) {
  reference::Rope r;
  r.style = p.rope.style == kernels::RopeStyle::kNeox          ? reference::RopeStyle::kNeox
            : p.rope.style == kernels::RopeStyle::kInterleaved ? reference::RopeStyle::kInterleaved
                                                               : reference::RopeStyle::kNone;
  r.dim_offset = p.rope.dim_offset;
  r.rope_dim = p.rope.rope_dim;
  r.theta = p.rope.theta;
  r.yarn = p.rope.yarn;
  r.yarn_factor = p.rope.yarn_factor;
  r.yarn_original = p.rope.yarn_original_max_position;
  r.beta_fast = p.rope.yarn_beta_fast;
  r.beta_slow = p.rope.yarn_beta_slow;
  return r;
}

inline float Bf16Bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// gtest wrappers of the reference's spec-section-6 and -7 checks (tolerance: 4 fp32 ulps of
// the row's largest |logit|, what rounding exact logits to fp32 can move them by).
inline ::testing::AssertionResult RefTopKRow(const int32_t* answer, int32_t k,
                                             const std::vector<double>& exact,
                                             const std::vector<int32_t>* positions = nullptr,
                                             double ulps = 4.0) {
  const std::string why =
      reference::CheckTopKRow(answer, k, exact, reference::Tolerance(exact, ulps), positions);
  if (why.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why;
}

inline ::testing::AssertionResult RefCandidateRow(const int32_t* blocks, int32_t num_blocks,
                                                  int32_t block_size,
                                                  const std::vector<double>& exact,
                                                  double ulps = 4.0) {
  const std::string why = reference::CheckCandidateRow(blocks, num_blocks, block_size, exact,
                                                       reference::Tolerance(exact, ulps));
  if (why.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why;
}

// What the reference answers for one step: the exact top-k (and candidate blocks at a
// source), with every row's scored positions and exact logits, so that a backend's answer can
// be held to the spec's section-6 rule (Matches) instead of bit equality with another backend.
struct RefAnswer {
  int32_t rows = 0;
  int32_t k = 0;
  std::vector<int32_t> topk;        // [rows, k]: the reference's exact top-k
  std::vector<int32_t> candidates;  // [rows, num_candidate_blocks] at a source layer
  int32_t num_candidate_blocks = 0;
  int32_t candidate_block_size = 0;
  std::vector<std::vector<int32_t>> positions;  // per row: the positions it scored
  std::vector<std::vector<double>> logits;      // per row: their exact logits
  // Per row, when the reference was asked for it (ServiceOracle::set_fp8_bounds): the largest
  // fp8-accumulation bound E(t) of the row's logits (spec section 6, reference::
  // Fp8AccumulationBound); 0 where the row cannot run the fp8 kernel. Empty: not computed.
  std::vector<double> fp8_bound;

  // Row r's near-tie tolerance: the exact mode's `ulps` of the row's largest logit, or, with
  // `fp8`, spec section 6's fp8 rule: two logits each off by up to E + the ulps.
  double RowTolerance(int32_t r, double ulps, bool fp8) const {
    const double exact_tol = reference::Tolerance(logits[r], ulps);
    if (!fp8) return exact_tol;
    return 2 * (fp8_bound.at(static_cast<size_t>(r)) + exact_tol);
  }

  // Spec section 6 (and 7 for candidates, when given): every row of `got_topk` [rows, k] is
  // an acceptable answer of the exact logits; nothing else passes. `fp8`: at the fp8
  // accumulation tolerance (needs fp8_bound).
  ::testing::AssertionResult Matches(const int32_t* got_topk, const int32_t* got_candidates,
                                     double ulps = 4.0, bool fp8 = false) const {
    if (fp8 && fp8_bound.size() != static_cast<size_t>(rows)) {
      return ::testing::AssertionFailure() << "checker misuse: fp8 tolerance without fp8_bound";
    }
    for (int32_t r = 0; r < rows; ++r) {
      const std::string why =
          reference::CheckTopKRow(got_topk + static_cast<size_t>(r) * k, k, logits[r],
                                  RowTolerance(r, ulps, fp8), &positions[r]);
      if (!why.empty()) return ::testing::AssertionFailure() << "row " << r << ": " << why;
    }
    if (got_candidates != nullptr && !candidates.empty()) {
      for (int32_t r = 0; r < rows; ++r) {
        const std::string why = reference::CheckCandidateRow(
            got_candidates + static_cast<size_t>(r) * num_candidate_blocks, num_candidate_blocks,
            candidate_block_size, logits[r], RowTolerance(r, ulps, fp8));
        if (!why.empty()) return ::testing::AssertionFailure() << "row " << r << ": " << why;
      }
    }
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult Matches(const std::vector<int32_t>& got_topk,
                                     const std::vector<int32_t>& got_candidates = {},
                                     double ulps = 4.0, bool fp8 = false) const {
    if (got_topk.size() != topk.size()) {
      return ::testing::AssertionFailure()
             << "top-k has " << got_topk.size() << " entries, expected " << topk.size();
    }
    if (!got_candidates.empty() && got_candidates.size() != candidates.size()) {
      return ::testing::AssertionFailure() << "candidate blocks have " << got_candidates.size()
                                           << " entries, expected " << candidates.size();
    }
    return Matches(got_topk.data(), got_candidates.empty() ? nullptr : got_candidates.data(), ulps,
                   fp8);
  }
};

}  // namespace decode_indexer::testing
