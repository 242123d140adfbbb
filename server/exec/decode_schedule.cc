#include "server/exec/decode_schedule.h"

#include <algorithm>

#include "common/status_macros.h"
#include "server/exec/candidate_overlap.h"

namespace decode_indexer::exec {

using kernels::CacheFormat;
using kernels::ElemType;

absl::Status CopyStoreRows(Rank& rank, Staging& staging, const StepPlan& plan, bool into_store,
                           const StepUploads& packed) {
  RankBuffers& b = rank.buffers();
  if (!packed.store_packed) {
    DI_RETURN_IF_ERROR(
        staging.Upload(b.store_index, plan.store_rows.data(), plan.num_rows * sizeof(int32_t)));
  }
  const int32_t* store_index = packed.store_packed ? packed.store_index : b.store_index;
  kernels::CopyRowsArgs copy;
  copy.num_rows = plan.num_rows;
  copy.row_elems = rank.sizes().num_candidate_blocks;
  if (into_store) {
    copy.dst = b.candidate_store;
    copy.dst_index = store_index;
    copy.src = b.candidates;
  } else {
    copy.dst = b.candidates;
    copy.src = b.candidate_store;
    copy.src_index = store_index;
  }
  return rank.ops().CopyRows(copy);
}

absl::Status DecodeSchedule(Rank& rank, Staging& staging, const StepPlan& plan,
                            const StepUploads& packed) {
  if (plan.role != config::LayerRole::kCandidateConsumer) return absl::OkStatus();
  const bool need_candidates = plan.masked_consumer || !plan.reuse_expansion;
  if (need_candidates) {
    // The source's candidates for these rows, from the per-sequence store.
    DI_RETURN_IF_ERROR(CopyStoreRows(rank, staging, plan, /*into_store=*/false, packed));
  }
  // Fork and join (the side stream): outside any graph.
  if (!plan.masked_consumer && !plan.reuse_expansion) {
    DI_RETURN_IF_ERROR(rank.overlap().BuildInline(plan.num_rows, packed.row_length));
  }
  return absl::OkStatus();
}

bool TopKInPlace(const Rank& rank, const StepPlan& plan) {
  return plan.answer_in_place && plan.topk_device_out != nullptr &&
         rank.index() == plan.answer_rank && !plan.sharded &&
         reinterpret_cast<uintptr_t>(plan.topk_device_out) % kAnswerInPlaceAlign == 0;
}

ScoringCall::ScoringCall(Rank& rank, const StepPlan& plan, RowRange range, const QRows& q,
                         const StepUploads& packed) {
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const kernels::CacheView& cache = b.caches[plan.pool];
  const int32_t n = range.end - range.start;
  const int32_t NB = s.num_candidate_blocks;
  const bool consumer = plan.role == config::LayerRole::kCandidateConsumer;
  const bool source = plan.role == config::LayerRole::kCandidateSource;
  const bool graphs = rank.graphs_enabled();
  kernels::RowBatch rows;
  rows.num_rows = n;
  rows.row_request = packed.row_request + range.start;
  rows.row_length = packed.row_length + range.start;
  rows.page_table = b.page_tables[plan.pool];
  rows.page_table_stride = s.max_pages_per_sequence;
  rows.request_slot = packed.request_slot;
  rows.num_requests = plan.num_requests;
  // With graphs the bound is bucketed, for eager runs too, so a replay launches exactly what
  // an eager run of the same step would.
  rows.max_row_length =
      graphs ? BucketRowLength(plan.max_row_length, s.max_context) : plan.max_row_length;
  // The most rows one request has in this rank's slice (rows of a request are adjacent).
  for (int32_t r = range.start, run = 0; r < range.end; ++r) {
    run = r > range.start && plan.row_request[r] == plan.row_request[r - 1] ? run + 1 : 1;
    rows.rows_per_request = std::max(rows.rows_per_request, run);
  }
  const bool topk_in_place = TopKInPlace(rank, plan);
  int32_t* topk_out =
      (topk_in_place ? plan.topk_device_out : b.topk) + int64_t{range.start} * s.topk;

  if (!consumer) {  // dense logits + top-k (a source selects its candidate blocks too)
    kernel_ = Kernel::kDense;
    dense_.cache = cache;
    dense_.rows = rows;
    dense_.q = q.view;
    dense_.topk = s.topk;
    dense_.topk_out = topk_out;
    if (source) {
      dense_.candidates_out = b.candidates + int64_t{range.start} * NB;
      dense_.num_candidate_blocks = NB;
      dense_.candidate_block_size = s.candidate_block_size;
    }
  } else if (plan.masked_consumer) {
    kernel_ = Kernel::kMasked;
    masked_.cache = cache;
    masked_.rows = rows;
    masked_.q = q.view;
    masked_.candidates = b.candidates + int64_t{range.start} * NB;
    masked_.num_candidate_blocks = NB;
    masked_.candidate_block_size = s.candidate_block_size;
    masked_.topk = s.topk;
    masked_.topk_out = topk_out;
  } else {
    kernel_ = Kernel::kSparse;
    const int32_t max_positions = NB * s.candidate_block_size;
    sparse_.cache = cache;
    sparse_.rows = rows;
    sparse_.q = q.view;
    sparse_.positions = b.expansion_positions + int64_t{range.start} * max_positions;
    sparse_.counts = b.expansion_counts + range.start;
    sparse_.max_positions = max_positions;
    sparse_.topk = s.topk;
    sparse_.topk_out = topk_out;
  }

  shape_.pool = plan.pool;
  shape_.role = static_cast<int32_t>(plan.role);
  shape_.masked = consumer && plan.masked_consumer;
  shape_.candidates = source;
  shape_.range_start = range.start;
  shape_.rows = n;
  shape_.requests = plan.num_requests;
  shape_.q_type = static_cast<int32_t>(plan.q.type);
  shape_.positions = q.unquantized && plan.q.positions != nullptr;
  shape_.hadamard = q.unquantized && plan.hadamard;
  shape_.max_row_length = rows.max_row_length;
  shape_.rows_per_request = rows.rows_per_request;
  shape_.staging_slot = packed.slot;
  shape_.total_rows = plan.num_rows;
  shape_.staged_q = packed.staged_q();
  if (q.in_place) {
    shape_.q_codes = reinterpret_cast<uintptr_t>(q.view.codes);
    shape_.q_scales = reinterpret_cast<uintptr_t>(q.view.scales);
    shape_.q_weights = reinterpret_cast<uintptr_t>(q.view.weights);
  }
  shape_.q_check = q.checks.num_checks == 0 ? 0 : (q.checks.accumulate ? 2 : 1);
  // The answer's span is the client's: no staging buffer fixes where it lies.
  if (topk_in_place) shape_.topk_out = reinterpret_cast<uintptr_t>(topk_out);
}

absl::Status ScoringCall::Launch(kernels::IndexerOps& ops) const {
  switch (kernel_) {
    case Kernel::kDense:
      return ops.DenseTopK(dense_);
    case Kernel::kMasked:
      return ops.MaskedTopK(masked_);
    case Kernel::kSparse:
      return ops.SparseTopK(sparse_);
  }
  return absl::InternalError("unknown scoring kernel");
}

}  // namespace decode_indexer::exec
