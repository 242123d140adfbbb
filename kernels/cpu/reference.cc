// The free reference functions: thin single-threaded entry points over the engine, so the
// oracle and the CPU backend share one implementation of every formula.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "kernels/cpu/engine.h"

namespace decode_indexer::kernels::cpu {

void RowLogits(const CacheView& cache, const RowBatch& rows, const QView& q, int32_t row,
               float* out) {
  internal::ThreadScratch scratch;
  internal::LoadQ(q, cache.geometry.format, cache.geometry.head_dim, row, 1, scratch.q);
  const int32_t length = rows.row_length[row];
  internal::ScoreSpan(cache, rows, rows.row_request[row], scratch.q, &length, 0, length, out,
                      length, scratch);
}

std::vector<float> RowLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                             int32_t row) {
  std::vector<float> out(rows.row_length[row]);
  RowLogits(cache, rows, q, row, out.data());
  return out;
}

void RowLogitsAt(const CacheView& cache, const RowBatch& rows, const QView& q, int32_t row,
                 const int32_t* positions, int32_t count, float* out) {
  internal::ThreadScratch scratch;
  internal::LoadQ(q, cache.geometry.format, cache.geometry.head_dim, row, 1, scratch.q);
  internal::ScorePositions(cache, rows, rows.row_request[row], scratch.q, positions, count, out,
                           scratch);
}

void TopK(const float* logits, int32_t length, int32_t k, int32_t* out) {
  std::vector<float> work;
  internal::TopKWith(logits, length, k, out, work);
}

void TopKAt(const float* logits, const int32_t* positions, int32_t count, int32_t k, int32_t* out) {
  std::vector<float> work;
  internal::TopKAtWith(logits, positions, count, k, out, work);
}

void SelectCandidateBlocks(const float* logits, int32_t length, int32_t num_blocks,
                           int32_t block_size, int32_t* out) {
  std::vector<float> scores, work;
  internal::SelectCandidateBlocksWith(logits, length, num_blocks, block_size, out, scores, work);
}

absl::Status ExpandCandidates(const ExpandArgs& args) {
  const CandidateExpansion& out = args.out;
  if (args.num_rows == 0) return absl::OkStatus();
  if (args.num_rows < 0 || args.candidates == nullptr || args.row_length == nullptr ||
      out.positions == nullptr || out.counts == nullptr || args.num_candidate_blocks <= 0 ||
      args.candidate_block_size <= 0 ||
      out.max_positions < int64_t{args.num_candidate_blocks} * args.candidate_block_size) {
    return absl::InvalidArgumentError("ExpandCandidates: bad arguments");
  }
  for (int32_t r = 0; r < args.num_rows; ++r) {
    const int32_t* candidates = args.candidates + int64_t{r} * args.num_candidate_blocks;
    int32_t* positions = out.positions + int64_t{r} * out.max_positions;
    const int32_t length = args.row_length[r];
    // Validity: blocks below ceil(length / block_size), ascending, -1 only as padding.
    int64_t prev = -1;
    bool padding = false;
    for (int32_t i = 0; i < args.num_candidate_blocks; ++i) {
      const int32_t c = candidates[i];
      if (c == -1) {
        padding = true;
      } else if (padding || c <= prev ||
                 int64_t{c} * args.candidate_block_size >= std::max(length, 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("row ", r, ": candidate block ", i, " = ", c, " is invalid"));
      } else {
        prev = c;
      }
    }
    const int32_t count = internal::ExpandRow(candidates, args.num_candidate_blocks,
                                              args.candidate_block_size, length, positions);
    std::fill(positions + count, positions + out.max_positions, -1);
    out.counts[r] = count;
  }
  return absl::OkStatus();
}

absl::Status DenseTopK(const DenseArgs& args) { return internal::Engine(nullptr).DenseTopK(args); }

absl::Status SparseTopK(const SparseArgs& args) {
  return internal::Engine(nullptr).SparseTopK(args);
}

absl::Status MaskedTopK(const MaskedArgs& args) {
  return internal::Engine(nullptr).MaskedTopK(args);
}

absl::Status CopyRows(const CopyRowsArgs& args) {
  if (args.num_rows == 0) return absl::OkStatus();
  if (args.num_rows < 0 || args.row_elems < 0 || args.dst == nullptr || args.src == nullptr) {
    return absl::InvalidArgumentError("CopyRows: bad arguments");
  }
  for (int32_t i = 0; i < args.num_rows; ++i) {
    const int64_t d = args.dst_index ? args.dst_index[i] : i;
    const int64_t s = args.src_index ? args.src_index[i] : i;
    // memmove: a caller may copy rows within one buffer.
    std::memmove(args.dst + d * args.row_elems, args.src + s * args.row_elems,
                 sizeof(int32_t) * args.row_elems);
  }
  return absl::OkStatus();
}

absl::Status CheckValues(const ValueCheckArgs& args) { return HostCheckValues(args); }

}  // namespace decode_indexer::kernels::cpu
