// The CPU reference: one free function per kernel, the oracle every other backend is tested
// against and the body of the CPU backend. All pointers are host pointers. The numerics are
// exact where the spec allows it (see spec/indexer.md and the numerics notes below), so these
// functions answer identically whatever the thread count or batch composition.
//
// Logits (spec section 3). FP8: per (row, head) the dot product of the e4m3 code values is
// exact (accumulated in double), relu, times w[h] in double, summed over heads ascending in
// double, times the key scale, rounded to float. FP4: per 32-dim group the exact dot times
// (q_scale[h,g] * k_scale[g]), summed over groups ascending in double, relu, times w[h],
// summed over heads ascending in double, rounded to float.
//
// Top-k (spec section 6): order by (logit desc, position asc), take the first K, output
// ascending, -1 padded.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/types.h"

namespace decode_indexer::kernels::cpu {

// ---- Quantizers (spec section 2) -----------------------------------------------------------

// FP8: codes[n] = e4m3(v / s); returns the scale s (a power of two).
float QuantizeFp8(const float* values, int32_t n, uint8_t* codes);
// MXFP4: n a multiple of 32; packed[n/2] (element 2i in the low nibble), scales[n/32] ue8m0.
void QuantizeFp4(const float* values, int32_t n, uint8_t* packed, uint8_t* scales);

// The normalised Sylvester-Hadamard rotation in place: the butterfly (h = 1, 2, 4, ...:
// a + b, a - b) in float, then one multiply by float(1 / sqrt(n)). n a power of two.
void HadamardInPlace(float* x, int32_t n);

// RoPE on one head vector x[head_dim] at `position` (no-op for RopeStyle::kNone).
void ApplyRope(float* x, int64_t position, const RopeConfig& rope);

// The weight scale c = float(1 / sqrt(double(H * D))).
float WeightScale(int32_t num_heads, int32_t head_dim);

// ---- Cache -------------------------------------------------------------------------------

// Byte address of entry `slot_index` (= page * page_size + slot) and of its scale.
uint8_t* EntryValues(const CacheView& cache, int64_t slot_index);
uint8_t* EntryScale(const CacheView& cache, int64_t slot_index);
// The cache slot index of request `request`'s position `position`.
int64_t PositionSlot(const RowBatch& rows, const CacheGeometry& geometry, int32_t request,
                     int64_t position);

// Quantize (if needed) and write keys into their slots (spec sections 2 and 4).
absl::Status InsertKeys(const KeyInsertArgs& args);
// rope_quant_q: RoPE, optional Hadamard, quantize q, fold the weights.
absl::Status RopeQuantQ(const QPrepArgs& args);

// ---- Logits ------------------------------------------------------------------------------

// Dense logits of row `row` over [0, row_length[row]) into out[row_length[row]].
void RowLogits(const CacheView& cache, const RowBatch& rows, const QView& q, int32_t row,
               float* out);
std::vector<float> RowLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                             int32_t row);
// Logits of row `row` at positions[0..count) (each below the row's length) into out[count].
// Bit-identical to the dense logits at those positions.
void RowLogitsAt(const CacheView& cache, const RowBatch& rows, const QView& q, int32_t row,
                 const int32_t* positions, int32_t count, float* out);

// ---- Selection ---------------------------------------------------------------------------

// Top-k of logits[0..length) by the canonical rule into out[k]: ascending, -1 padded.
void TopK(const float* logits, int32_t length, int32_t k, int32_t* out);
// Top-k over a subset: logits[i] is the logit of positions[i] (positions ascending); out[k]
// holds positions, ascending, -1 padded.
void TopKAt(const float* logits, const int32_t* positions, int32_t count, int32_t k, int32_t* out);
// Spec section 7: block j covers [j * block_size, (j + 1) * block_size); its score is the max
// logit of its positions below length; the newest block (length - 1) / block_size scores
// +inf; keep the top min(num_blocks, ceil(length / block_size)) by (score desc, block asc),
// ascending, -1 padded into out[num_blocks].
void SelectCandidateBlocks(const float* logits, int32_t length, int32_t num_blocks,
                           int32_t block_size, int32_t* out);
// Candidate blocks -> the positions a consumer row scores (ascending, below the row's length,
// -1 padded to max_positions).
absl::Status ExpandCandidates(const ExpandArgs& args);

// ---- Whole kernels (single-threaded twins of the Backend entry points) -------------------

absl::Status DenseTopK(const DenseArgs& args);
// Consumers. Sparse: logits at the expanded positions, top-k among them. Masked: dense
// logits, but positions outside the row's candidate blocks do not exist for the row (they are
// never returned, even when fewer than K candidate positions remain: the row is -1 padded),
// so it answers exactly as the sparse consumer.
absl::Status SparseTopK(const SparseArgs& args);
absl::Status MaskedTopK(const MaskedArgs& args);
absl::Status CopyRows(const CopyRowsArgs& args);
// IndexerOps::CheckValues on host memory.
absl::Status CheckValues(const ValueCheckArgs& args);

}  // namespace decode_indexer::kernels::cpu
