// Clocks a backend may offer the benchmarks beside its IndexerOps: device time of the last
// eager scoring call and what CandidateOverlap's side stream hid. Not part of the operations'
// contract (the executor's step never reads them); the CUDA backend has them (events on its
// streams), the CPU backend and test decorators do not. Reached through ClocksOf, by the
// bench-only helpers of server/exec/executor_internal.h and the GPU tests.
#pragma once

#include "absl/status/statusor.h"
#include "decode_indexer/kernels/indexer_ops.h"

namespace decode_indexer::kernels {

class BenchClocks {
 public:
  virtual ~BenchClocks() = default;
  // Of the last fork/join pair: the side stream's span from the fork to the expansion's end,
  // and the main stream's span from the fork to the point where it reached the join (its own
  // work and idle time in between). The join waits for max(0, side - main) of the side's
  // span: hidden share = min(1, main_us / side_us). Valid once the main stream has passed
  // that join (after a Synchronize).
  struct OverlapTiming {
    double side_us = 0;
    double main_us = 0;
  };
  virtual absl::StatusOr<OverlapTiming> LastOverlapTiming() = 0;
  // Device time of the last scoring call's kernels (DenseTopK, SparseTopK or MaskedTopK run
  // eagerly; not one replayed from a graph), from events around them on the stream: what a
  // step's kernels cost apart from its copies. Off unless SetScoringTiming(true) (two event
  // records a step otherwise spent for nobody); valid after a Synchronize.
  virtual void SetScoringTiming(bool on) = 0;
  virtual absl::StatusOr<double> LastScoringUs() = 0;
};

// The clocks of the backend behind `ops`; null where it has none.
inline BenchClocks* ClocksOf(IndexerOps& ops) { return dynamic_cast<BenchClocks*>(&ops); }

}  // namespace decode_indexer::kernels
