// CandidateOverlap (seed): the candidate consumers' expansion on a side stream.
//
// A consumer scores sparse over the expansion of its source's candidate blocks into positions
// (IndexerOps::ForkExpand's ExpandArgs). The expansion reads only the candidates and the row
// lengths, not q or the caches, so the candidate source forks it onto the side stream once it
// has written the candidates (Fork) and the rank's next step joins it (Join) before touching
// any buffer the expansion reads or writes; every consumer step over the same rows reuses it.
// With overlap off, or when the rows differ, the first consumer builds it inline (fork and
// join at once, the same kernels and inputs), so the outputs match.
//
// The side stream issues no collectives, and the fork orders it after the main stream's work
// so far (the previous step's reads of the expansion it overwrites). Nothing of it runs
// inside a captured step graph (step_graphs.h): Warm issues the side stream's first fork and
// join at start-up, from an eager point, so whatever a backend creates on that stream's first
// use exists before the first step.
//
// Two halves: CandidateOverlap is one rank's (the stream calls, owned by the Rank);
// ExpansionLedger is the executor's host record of which rows every rank's expansion holds.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/indexer_ops.h"

namespace decode_indexer::exec {

class CandidateOverlap {
 public:
  // `expand`: the rank's expansion buffers (candidates and row lengths in, positions and
  // counts out); each call sets the number of rows.
  CandidateOverlap(kernels::IndexerOps& ops, const kernels::ExpandArgs& expand)
      : ops_(ops), expand_(expand) {}
  CandidateOverlap(const CandidateOverlap&) = delete;
  CandidateOverlap& operator=(const CandidateOverlap&) = delete;

  // Start the expansion of the first `num_rows` rows on the side stream; the candidate source
  // calls this right after its kernels have written the candidates. Joins a pending fork
  // first. Even a failed fork may have queued work: the next Join settles it.
  // `row_length`: where the step's row lengths lie (its ring slot); null: the rank's buffer.
  absl::Status Fork(int32_t num_rows, const int32_t* row_length = nullptr);
  // Make the main stream wait for a pending fork, if any. Every job on the rank calls it
  // first, since the next step rewrites the row lengths and candidates the side stream may
  // still be reading.
  absl::Status Join();
  // Create the side stream's state from an eager point (start-up): one fork and join of zero
  // rows, once. Later calls do nothing.
  absl::Status Warm();
  // Fork and join at once: the inline path, with the same kernels and inputs.
  absl::Status BuildInline(int32_t num_rows, const int32_t* row_length = nullptr);

  bool pending() const { return forked_; }
  bool warmed() const { return warmed_; }

 private:
  kernels::IndexerOps& ops_;
  kernels::ExpandArgs expand_;
  bool forked_ = false;
  bool warmed_ = false;
};

// One row of an expansion, identified by what it depends on.
struct ExpansionRow {
  uint64_t sequence = 0;
  int32_t row = 0;
  uint64_t candidate_version = 0;
  int32_t length = 0;
  bool operator==(const ExpansionRow&) const = default;
};

// The host side: which rows every rank's expansion buffer holds, so a consumer step over the
// same rows reuses it (StepPlan::reuse_expansion) and a source forks it for its rows
// (StepPlan::fork_expansion) where the overlap is on.
class ExpansionLedger {
 public:
  explicit ExpansionLedger(bool overlap_enabled) : enabled_(overlap_enabled) {}

  // Whether a source step forks the expansion for its rows (ExecutorOptions::
  // candidate_overlap).
  bool enabled() const { return enabled_; }
  // Whether every rank's expansion buffer holds exactly these rows, in this order.
  bool Holds(const std::vector<ExpansionRow>& rows) const { return valid_ && rows == rows_; }
  // A committed step left the expansion of `rows` in every rank's buffer.
  void Commit(std::vector<ExpansionRow> rows) {
    rows_ = std::move(rows);
    valid_ = true;
  }
  // A failed step may have overwritten the buffers.
  void Invalidate() {
    valid_ = false;
    rows_.clear();
  }

 private:
  bool enabled_;
  bool valid_ = false;
  std::vector<ExpansionRow> rows_;
};

}  // namespace decode_indexer::exec
