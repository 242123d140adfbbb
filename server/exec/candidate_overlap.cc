#include "server/exec/candidate_overlap.h"

namespace decode_indexer::exec {

absl::Status CandidateOverlap::Fork(int32_t num_rows, const int32_t* row_length) {
  if (absl::Status s = Join(); !s.ok()) return s;
  kernels::ExpandArgs args = expand_;
  args.num_rows = num_rows;
  if (row_length != nullptr) args.row_length = row_length;
  absl::Status s = ops_.ForkExpand(args);
  forked_ = true;  // even a failed fork may have queued work; the next join settles it
  return s;
}

absl::Status CandidateOverlap::Join() {
  if (!forked_) return absl::OkStatus();
  forked_ = false;
  return ops_.JoinExpand();
}

absl::Status CandidateOverlap::Warm() {
  if (warmed_) return absl::OkStatus();
  if (absl::Status s = BuildInline(0); !s.ok()) return s;
  warmed_ = true;
  return absl::OkStatus();
}

absl::Status CandidateOverlap::BuildInline(int32_t num_rows, const int32_t* row_length) {
  if (absl::Status s = Fork(num_rows, row_length); !s.ok()) return s;
  return Join();
}

}  // namespace decode_indexer::exec
