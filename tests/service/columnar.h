// Shared by the columnar-form tests: a step in the `sequences` form rewritten into the
// columnar form (DecodeStepRequest.sequence_ids ...), which must decode into the same
// StepInput and answer the same. Proto only (no client), so the decode suite can use it.
#pragma once

#include <cstdint>

#include "decode_indexer/v1/indexer.pb.h"

namespace decode_indexer::testing {

struct ColumnarOptions {
  // rows_per_sequence instead of num_rows (only where every request has the same rows).
  bool uniform_rows = false;
  // new_key_counts even where it could be left out (every request brings one key a row).
  bool explicit_counts = false;
  // new_keys_positions even where no request has a position.
  bool explicit_positions = false;
};

// The rows a SequenceStep brings (num_rows, or 0 and row_lengths).
inline int32_t RowsOf(const v1::SequenceStep& s) {
  return s.num_rows() != 0 ? s.num_rows() : s.row_lengths_size();
}

// The keys a SequenceStep brings.
inline int64_t KeysOf(const v1::SequenceStep& s) {
  return s.new_keys().shape_size() > 0 ? s.new_keys().shape(0) : 0;
}

// `request` with its `sequences` turned into the columnar fields. Every request's keys must
// share one dtype (the columnar form has one keys tensor).
inline v1::DecodeStepRequest ToColumnar(const v1::DecodeStepRequest& request,
                                        const ColumnarOptions& o = {}) {
  v1::DecodeStepRequest out = request;
  out.clear_sequences();
  bool uniform = o.uniform_rows && request.sequences_size() > 0;
  bool counts_needed = o.explicit_counts;
  bool any_keys = false, any_position = o.explicit_positions, any_lengths = false;
  for (const v1::SequenceStep& s : request.sequences()) {
    uniform = uniform && RowsOf(s) == RowsOf(request.sequences(0));
    const int64_t keys = KeysOf(s);
    counts_needed = counts_needed || keys != RowsOf(s);
    any_keys = any_keys || keys > 0;
    any_position = any_position || s.has_new_keys_position();
    any_lengths = any_lengths || s.row_lengths_size() > 0;
  }
  if (uniform) out.set_rows_per_sequence(RowsOf(request.sequences(0)));
  int64_t total_keys = 0;
  const v1::SequenceStep* first = nullptr;  // the first request with keys: dtypes and dims
  for (const v1::SequenceStep& s : request.sequences()) {
    out.add_sequence_ids(s.sequence_id());
    if (!uniform) out.add_num_rows(RowsOf(s));
    const int64_t n = KeysOf(s);
    if (counts_needed && any_keys) out.add_new_key_counts(static_cast<int32_t>(n));
    if (any_position) {
      out.add_new_keys_positions(s.has_new_keys_position() ? s.new_keys_position() : -1);
    }
    if (any_lengths) {
      for (int j = 0; j < RowsOf(s); ++j) {
        out.add_row_lengths(s.row_lengths_size() > 0 ? s.row_lengths(j) : 0);
      }
    }
    if (n == 0) continue;
    if (first == nullptr) first = &s;
    out.mutable_new_keys()->mutable_data()->append(s.new_keys().data());
    if (s.has_new_key_scales()) {
      out.mutable_new_key_scales()->mutable_data()->append(s.new_key_scales().data());
    }
    total_keys += n;
  }
  if (first != nullptr) {
    // [total, D] (and FP8 scales [total], FP4 scales [total, D/32]).
    v1::Tensor* k = out.mutable_new_keys();
    k->set_dtype(first->new_keys().dtype());
    k->add_shape(total_keys);
    k->add_shape(first->new_keys().shape(1));
    if (first->has_new_key_scales()) {
      v1::Tensor* ks = out.mutable_new_key_scales();
      ks->set_dtype(first->new_key_scales().dtype());
      ks->add_shape(total_keys);
      for (int i = 1; i < first->new_key_scales().shape_size(); ++i) {
        ks->add_shape(first->new_key_scales().shape(i));
      }
    }
  }
  return out;
}

}  // namespace decode_indexer::testing
