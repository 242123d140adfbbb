// IndexerOps: the indexer's operations on one rank's device (kernels/include/decode_indexer/
// kernels/backend.h joins them with the Device they run on): key insertion, rope_quant_q,
// dense and sparse scoring with their top-k, the candidate expansion (CandidateOverlap's fork
// and join), row copies and the device-side value checks.
//
// Every pointer an operation receives lives in its device's memory (Device::Allocate).
// Operations are ordered on the device's main stream and may return before the work is done
// (Device::Synchronize waits). Argument checks belong to the caller (the server's validation
// and planner); operations assert only what is cheap and return a Status on failure.
//
// The math is spec/indexer.md; the CPU backend is the oracle every other backend is tested
// against (identical answers except at near-ties, spec section 6).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/kernels/types.h"
#include "decode_indexer/kernels/value_check.h"

namespace decode_indexer::kernels {

// Quantize-and-cache of keys into the paged layout (spec sections 2 and 4).
struct KeyInsertArgs {
  CacheView cache;
  int32_t num_keys = 0;
  // kF32 / kBF16: unquantized [n, D], quantized here to the cache's format.
  // kFp8E4M3: [n, D] codes with float key_scales [n] (FP8 cache only).
  // kFp4E2M1: [n, D/2] packed bytes with ue8m0 key_scales [n, D/32] (FP4 cache only).
  ElemType key_type = ElemType::kF32;
  const void* keys = nullptr;
  const void* key_scales = nullptr;
  // [n] destination of key i: page * page_size + slot.
  const int64_t* slots = nullptr;
  // Rotate unquantized keys by the normalised Hadamard matrix before quantizing.
  bool hadamard = false;
  // Page-table edits made with the keys (the executor's kernel section: one launch for a
  // step's new pages and its keys; step_io.h): entry i sets page_table[edit_index[i]] =
  // edit_pages[i], and a negative index is no edit (padding). No two entries name one index,
  // so their order does not matter. num_edits 0: none.
  int32_t* page_table = nullptr;
  const int32_t* edit_index = nullptr;
  const int32_t* edit_pages = nullptr;
  int32_t num_edits = 0;
};

// rope_quant_q: RoPE (when positions is given), optional Hadamard, quantize q to the cache's
// format and fold the weights (spec sections 2 and 3).
struct QPrepArgs {
  int32_t num_rows = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  ElemType q_type = ElemType::kF32;  // kF32 or kBF16, [rows, H, D]
  const void* q = nullptr;
  const float* weights_raw = nullptr;  // [rows, H]
  const int64_t* positions = nullptr;  // [rows] or null: q already rotated
  RopeConfig rope;
  bool hadamard = false;
  CacheFormat format = CacheFormat::kFp8;
  // Outputs. FP8: q_codes [rows, H, D], weights_out = w_raw * c * q_scale with
  // c = float(1 / sqrt(H * D)). FP4: q_codes [rows, H, D/2] packed, q_scales
  // [rows, H, D/32] ue8m0, weights_out = w_raw * c.
  uint8_t* q_codes = nullptr;
  uint8_t* q_scales = nullptr;
  float* weights_out = nullptr;
};

// The rows of one decode step (or a contiguous slice of them). Rows of one request are
// adjacent; row r belongs to request row_request[r] and scores positions [0, row_length[r]).
struct RowBatch {
  int32_t num_rows = 0;
  const int32_t* row_request = nullptr;  // [num_rows]
  const int32_t* row_length = nullptr;   // [num_rows], each >= 1
  // Request b's position p lives in page page_table[PageRow(b) * stride + p / page_size],
  // slot p % page_size, where PageRow(b) is request_slot[b] when request_slot is given (the
  // server's resident per-sequence tables: one row per sequence slot, never rebuilt per
  // step) and b otherwise (a [num_requests, stride] table built for the call).
  const int32_t* page_table = nullptr;
  int32_t page_table_stride = 0;
  int32_t num_requests = 0;
  // Host-known bound on row_length (workspace and grid sizing; no device read needed).
  int32_t max_row_length = 0;
  // Host-known: the most rows any request has in this batch (0: ceil(num_rows /
  // num_requests)). A rank's slice of a sharded step holds the rows of only some of the
  // step's requests, so the average would say 1 row where each request has next_n rows and
  // the kernels would re-read each key tile per row instead of sharing it. Sizes passes only:
  // the answer does not depend on it.
  int32_t rows_per_request = 0;
  // [num_requests] or null: see page_table (last, so positional initializers stay valid).
  const int32_t* request_slot = nullptr;
};

// Where request b's page-table row starts in RowBatch::page_table (host code; the CUDA kernels
// have their own copy of the rule).
inline int64_t PageRowOffset(const RowBatch& rows, int32_t request) {
  const int32_t row = rows.request_slot != nullptr ? rows.request_slot[request] : request;
  return static_cast<int64_t>(row) * rows.page_table_stride;
}

// Quantized q of the rows of a RowBatch (row r's q at codes + r * H * value_bytes).
struct QView {
  const uint8_t* codes = nullptr;   // FP8 [rows, H, D]; FP4 [rows, H, D/2]
  const uint8_t* scales = nullptr;  // FP4 only: [rows, H, D/32] ue8m0
  const float* weights = nullptr;   // [rows, H] folded
  int32_t num_heads = 0;
};

// How a backend selects candidate blocks (the answer is the same either way; the CPU backend
// has one path and ignores it). kGeneral: block scores, then the radix top-k (two launches);
// kCooperative: the single cooperative launch (seed: cooperative_topk), refused
// (InvalidArgument) where its gate does not hold; kAuto: the backend's choice.
enum class CandidateSelect { kAuto, kGeneral, kCooperative };

// Dense paged logits over [0, L_r) and the row's top-k (spec sections 3 and 6); at a
// candidate source also the row's candidate blocks (spec section 7).
struct DenseArgs {
  CacheView cache;
  RowBatch rows;
  QView q;
  int32_t topk = 0;
  int32_t* topk_out = nullptr;  // [num_rows, topk]: ascending, -1 padded
  // Optional: candidate blocks [num_rows, num_candidate_blocks], ascending, -1 padded.
  int32_t* candidates_out = nullptr;
  int32_t num_candidate_blocks = 0;
  int32_t candidate_block_size = 0;
  CandidateSelect candidate_select = CandidateSelect::kAuto;
};

// The positions a consumer row scores: its candidate blocks expanded, below its length,
// ascending. Depends only on candidates and lengths, so one expansion serves every consumer
// layer of a step.
struct CandidateExpansion {
  int32_t* positions = nullptr;  // [num_rows, max_positions]
  int32_t* counts = nullptr;     // [num_rows]
  int32_t max_positions = 0;     // num_candidate_blocks * candidate_block_size
};

struct ExpandArgs {
  int32_t num_rows = 0;
  const int32_t* candidates = nullptr;  // [num_rows, num_candidate_blocks]
  const int32_t* row_length = nullptr;  // [num_rows]
  int32_t num_candidate_blocks = 0;
  int32_t candidate_block_size = 0;
  CandidateExpansion out;
};

// How a backend runs a consumer's top-k (the answer is the same either way; the CPU backend
// has one path and ignores it). kGeneral: the radix top-k kernels; kCooperative: the
// cooperative top-k (one cluster a row, the row's logits in shared memory), refused
// (InvalidArgument) where its gate does not hold; kAuto: the backend's choice.
enum class TopKSelect { kAuto, kGeneral, kCooperative };

// A consumer: logits over the expanded candidate positions only, top-k among them.
struct SparseArgs {
  CacheView cache;  // the source layer's cache
  RowBatch rows;
  QView q;
  const int32_t* positions = nullptr;  // CandidateExpansion::positions of these rows
  const int32_t* counts = nullptr;     // CandidateExpansion::counts of these rows
  int32_t max_positions = 0;
  int32_t topk = 0;
  int32_t* topk_out = nullptr;
  TopKSelect topk_select = TopKSelect::kAuto;
};

// The fallback consumer: dense logits with every position outside the row's candidate blocks
// masked out. Must answer exactly as the sparse consumer.
struct MaskedArgs {
  CacheView cache;
  RowBatch rows;
  QView q;
  const int32_t* candidates = nullptr;  // [num_rows, num_candidate_blocks]
  int32_t num_candidate_blocks = 0;
  int32_t candidate_block_size = 0;
  int32_t topk = 0;
  int32_t* topk_out = nullptr;
};

// Copies num_rows rows of row_elems int32 each: dst[dst_index ? dst_index[i] : i] =
// src[src_index ? src_index[i] : i]. Index arrays live in backend memory.
struct CopyRowsArgs {
  int32_t num_rows = 0;
  int32_t row_elems = 0;
  int32_t* dst = nullptr;
  const int32_t* dst_index = nullptr;
  const int32_t* src = nullptr;
  const int32_t* src_index = nullptr;
};

class IndexerOps {
 public:
  virtual ~IndexerOps() = default;

  virtual absl::Status InsertKeys(const KeyInsertArgs& args) = 0;
  virtual absl::Status RopeQuantQ(const QPrepArgs& args) = 0;
  virtual absl::Status DenseTopK(const DenseArgs& args) = 0;
  virtual absl::Status SparseTopK(const SparseArgs& args) = 0;
  virtual absl::Status MaskedTopK(const MaskedArgs& args) = 0;
  virtual absl::Status CopyRows(const CopyRowsArgs& args) = 0;
  // Checks inputs that live in the device's memory for NaN / Inf (value_check.h): clears
  // *args.flags, then sets the bit of every tensor holding a bad element. The default scans
  // on the host (devices whose memory is host memory); a GPU runs it on its main stream.
  virtual absl::Status CheckValues(const ValueCheckArgs& args) { return HostCheckValues(args); }

  // CandidateOverlap (seed): the expansion may run on a side stream. ForkExpand orders the
  // side stream after the main stream's work so far, then expands there; JoinExpand makes
  // the main stream wait for it. Devices without streams run it inline.
  virtual absl::Status ForkExpand(const ExpandArgs& args) = 0;
  virtual absl::Status JoinExpand() = 0;
  // (The benchmarks' clocks are not operations: kernels/bench_clocks.h.)
};

}  // namespace decode_indexer::kernels
