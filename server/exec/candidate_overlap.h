// CandidateOverlap (seed): the consumers' expansion of candidate blocks into positions depends
// only on the candidates and the row lengths, so it is built once per source publication and
// reused by every consumer step over the same rows. With overlap on, the source forks the
// expansion (Backend::ForkExpand, a side stream on a GPU) right after it has written its
// candidates; the next step on the rank joins it before touching any buffer the expansion
// reads. With overlap off, or when the rows differ, the first consumer builds it inline.
//
// The host side (this class) remembers which rows every rank's expansion buffer holds; the
// rank side (the free functions) issues the backend calls.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "server/exec/rank.h"

namespace decode_indexer::exec {

// One row of an expansion, identified by what it depends on.
struct ExpansionRow {
  uint64_t sequence = 0;
  int32_t row = 0;
  uint64_t candidate_version = 0;
  int32_t length = 0;
  bool operator==(const ExpansionRow&) const = default;
};

class CandidateOverlap {
 public:
  explicit CandidateOverlap(bool enabled) : enabled_(enabled) {}

  // Whether a source step forks the expansion for its rows.
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

// Rank side. The expansion reads buffers().candidates and buffers().row_length of the first
// num_rows rows and writes buffers().expansion_*.
absl::Status ForkExpansion(Rank& rank, int32_t num_rows);
// Waits for a pending fork, if any. Every job calls it first, since the next step rewrites
// the row lengths and candidates the side stream may still be reading.
absl::Status JoinExpansion(Rank& rank);
// Fork and join at once: the inline path, with the same kernels and inputs.
absl::Status BuildExpansionInline(Rank& rank, int32_t num_rows);

}  // namespace decode_indexer::exec
