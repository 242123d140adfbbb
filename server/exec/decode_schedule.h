// decode_schedule: what a rank scores in a step and in which order. A dense layer and a
// candidate source score dense logits + top-k (a source also selects its candidate blocks);
// a consumer first gathers its source's candidates from the store and has CandidateOverlap's
// expansion of them (forked by the source, or built inline here: the seed's decode_schedule),
// then scores sparse over the expansion (or, masked, dense logits with the candidate mask).
// The eager part (DecodeSchedule) runs before the kernel section; the scoring call
// (ScoringCall) is the kernel section's last launch, replayed from a graph with it.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "decode_indexer/kernels/backend.h"
#include "server/exec/rank.h"
#include "server/exec/row_shard.h"
#include "server/exec/step_graphs.h"
#include "server/exec/step_io.h"
#include "server/exec/step_types.h"

namespace decode_indexer::exec {

// The step's rows between the rank's candidate buffer and the per-sequence candidate store
// (rows plan.store_rows): a source scatters its new candidates into the store, a consumer
// gathers its source's from it. The store rows are read from the step's ring slot where
// `packed` holds them, else uploaded first.
absl::Status CopyStoreRows(Rank& rank, Staging& staging, const StepPlan& plan, bool into_store,
                           const StepUploads& packed);

// A consumer's eager schedule before its kernel section: the source's candidates for the
// step's rows (unless the expansion already holds them and the consumer is sparse) and their
// expansion inline (fork and join: outside any graph). Nothing for the other roles.
absl::Status DecodeSchedule(Rank& rank, Staging& staging, const StepPlan& plan,
                            const StepUploads& packed);

// Whether the rank's scoring call writes the step's top-k straight into the answer's device
// span (StepPlan::topk_device_out, a client's buffer in the answering rank's memory) instead
// of the rank's own buffer, so that CopyAnswer has no device-to-device copy of it to make
// (that copy cost the host ~6-9 us a step on the H200, docs/results/step-host.md). Only where
// nothing else reads the rank's top-k: on the answering rank of an unsharded step (it scores
// every row; a sharded step all-gathers the ranks' rows in their own buffers first), and only
// where the span is aligned for the top-k kernels' stores (kAnswerInPlaceAlign; the edge asks
// a CUDA IPC answer offset for as much, an in-process caller may not), else the copy as before.
// ExecutorOptions::answer_in_place off: always the copy (the benchmarks' same-run baseline).
bool TopKInPlace(const Rank& rank, const StepPlan& plan);
// Every top-k path (the CPU engine's, and CUDA's radix, cooperative and whole-row answers)
// stores int32 scalars at out + row * K + i: one int32's alignment is all they need.
inline constexpr uintptr_t kAnswerInPlaceAlign = alignof(int32_t);

// The scoring call of the rank's rows [range): the kernel for the layer's role with its
// arguments, and the shape that keys the kernel section's graph (step_graphs.h). Its top-k
// goes to the rank's own buffer, or in place into the answer's device span (TopKInPlace).
class ScoringCall {
 public:
  ScoringCall(Rank& rank, const StepPlan& plan, RowRange range, const QRows& q,
              const StepUploads& packed);
  // DenseTopK, SparseTopK or MaskedTopK on the rank's backend.
  absl::Status Launch(kernels::IndexerOps& ops) const;
  const StepShape& shape() const { return shape_; }

 private:
  enum class Kernel { kDense, kSparse, kMasked } kernel_ = Kernel::kDense;
  kernels::DenseArgs dense_;
  kernels::SparseArgs sparse_;
  kernels::MaskedArgs masked_;
  StepShape shape_;
};

}  // namespace decode_indexer::exec
