#include "server/exec/candidate_overlap.h"

namespace decode_indexer::exec {
namespace {

kernels::ExpandArgs MakeExpandArgs(Rank& rank, int32_t num_rows) {
  const RankSizes& s = rank.sizes();
  RankBuffers& b = rank.buffers();
  kernels::ExpandArgs args;
  args.num_rows = num_rows;
  args.candidates = b.candidates;
  args.row_length = b.row_length;
  args.num_candidate_blocks = s.num_candidate_blocks;
  args.candidate_block_size = s.candidate_block_size;
  args.out.positions = b.expansion_positions;
  args.out.counts = b.expansion_counts;
  args.out.max_positions = s.num_candidate_blocks * s.candidate_block_size;
  return args;
}

}  // namespace

absl::Status ForkExpansion(Rank& rank, int32_t num_rows) {
  if (absl::Status s = JoinExpansion(rank); !s.ok()) return s;
  absl::Status s = rank.backend().ForkExpand(MakeExpandArgs(rank, num_rows));
  // Even a failed fork may have queued work; the next join settles it.
  rank.fork_pending = true;
  return s;
}

absl::Status JoinExpansion(Rank& rank) {
  if (!rank.fork_pending) return absl::OkStatus();
  rank.fork_pending = false;
  return rank.backend().JoinExpand();
}

absl::Status BuildExpansionInline(Rank& rank, int32_t num_rows) {
  if (absl::Status s = ForkExpansion(rank, num_rows); !s.ok()) return s;
  return JoinExpansion(rank);
}

}  // namespace decode_indexer::exec
