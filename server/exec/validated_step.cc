#include "server/exec/validated_step.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace decode_indexer::exec {
namespace {

using config::LayerRole;
using config::LayerSpec;
using kernels::CacheFormat;
using kernels::ElemType;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

const char* FormatName(CacheFormat format) { return format == CacheFormat::kFp8 ? "FP8" : "FP4"; }

const char* TypeName(ElemType type) {
  switch (type) {
    case ElemType::kF32:
      return "fp32";
    case ElemType::kBF16:
      return "bf16";
    case ElemType::kFp8E4M3:
      return "FP8";
    case ElemType::kFp4E2M1:
      return "FP4";
    default:
      return "non-floating-point";
  }
}

bool Unquantized(ElemType type) { return type == ElemType::kF32 || type == ElemType::kBF16; }
bool Quantized(ElemType type) { return type == ElemType::kFp8E4M3 || type == ElemType::kFp4E2M1; }
ElemType QuantizedType(CacheFormat format) {
  return format == CacheFormat::kFp8 ? ElemType::kFp8E4M3 : ElemType::kFp4E2M1;
}

bool OwnsCache(const LayerSpec& spec) {
  return spec.role != LayerRole::kCandidateConsumer && spec.cache_layer == spec.layer;
}

std::string Request(int32_t i, absl::string_view suffix) {
  return absl::StrCat("sequences[", i, "]", suffix);
}

absl::StatusOr<const LayerSpec*> FindLayer(const config::Profile& profile, int32_t layer) {
  const LayerSpec* spec = profile.FindLayer(layer);
  if (spec == nullptr) {
    return Invalid("layer", absl::StrCat(layer, " is not a layer of profile ", profile.name,
                                         " (0..", int64_t(profile.layers.size()) - 1, ")"));
  }
  return spec;
}

}  // namespace

absl::Status CheckKeysForm(const KeysInput& keys, CacheFormat format, const KeyFields& fields) {
  if (keys.position.has_value() && *keys.position < 0) {
    return Invalid(fields.position, absl::StrCat("must be >= 0, got ", *keys.position));
  }
  if (keys.count < 0) return Invalid(fields.keys, absl::StrCat("negative key count ", keys.count));
  if (keys.count == 0) return absl::OkStatus();
  if (keys.keys == nullptr) return Invalid(fields.keys, "no data");
  if (keys.on_device && !Quantized(keys.type)) {
    return Invalid(absl::StrCat(fields.keys, ".dtype"),
                   absl::StrCat("keys in device memory must be pre-quantized in the cache's "
                                "format (",
                                FormatName(format), "), got ", TypeName(keys.type),
                                " keys (the server quantizes only keys it reads on the host)"));
  }
  if (Unquantized(keys.type)) {
    if (keys.scales != nullptr) {
      return Invalid(fields.scales,
                     absl::StrCat("only with pre-quantized keys; ", TypeName(keys.type),
                                  " keys are quantized by the server"));
    }
    return absl::OkStatus();
  }
  if (!Quantized(keys.type)) {
    return Invalid(absl::StrCat(fields.keys, ".dtype"),
                   absl::StrCat("unsupported key type (", TypeName(keys.type),
                                "): expected fp32, bf16 or the cache's ", FormatName(format)));
  }
  if (keys.type != QuantizedType(format)) {
    return Invalid(
        absl::StrCat(fields.keys, ".dtype"),
        absl::StrCat("pre-quantized keys must be in the cache's format (", FormatName(format),
                     "), got ", TypeName(keys.type), " keys (or send fp32 / bf16 keys)"));
  }
  if (keys.scales == nullptr) {
    return Invalid(fields.scales, absl::StrCat("required with ", TypeName(keys.type), " keys"));
  }
  return absl::OkStatus();
}

bool StepValidator::owns_cache() const { return OwnsCache(*spec_); }

absl::Status StepValidator::Layer(int32_t layer, bool return_candidates) {
  absl::StatusOr<const LayerSpec*> spec = FindLayer(profile_, layer);
  if (!spec.ok()) return spec.status();
  if (return_candidates && (*spec)->role != LayerRole::kCandidateSource) {
    return Invalid("return_candidates",
                   absl::StrCat("layer ", layer, " is not a candidate source"));
  }
  spec_ = *spec;
  layer_ = layer;
  return_candidates_ = return_candidates;
  return absl::OkStatus();
}

absl::Status StepValidator::Rows(int32_t i, uint64_t sequence_id, int32_t num_rows) {
  auto [it, inserted] = seen_.emplace(sequence_id, i);
  if (!inserted) {
    return Invalid(
        Request(i, ".sequence_id"),
        absl::StrCat(sequence_id, " appears twice in one step (also sequences[", it->second, "])"));
  }
  const int32_t max_rows = profile_.max_rows_per_sequence;
  if (num_rows < 1) {
    return Invalid(
        Request(i, ".num_rows"),
        absl::StrCat("must be >= 1 (a request brings at least one row), got ", num_rows));
  }
  if (num_rows > max_rows) {
    return Invalid(Request(i, ".num_rows"),
                   absl::StrCat(num_rows, " rows exceed max_rows_per_sequence ", max_rows));
  }
  ++rows_checked_;
  rows_ += num_rows;
  return absl::OkStatus();
}

absl::Status StepValidator::RowLengths(int32_t i, const SequenceStepInput& in) {
  const size_t n = in.row_lengths.size();
  if (n != 0 && n != size_t(in.num_rows)) {
    return Invalid(Request(i, ".row_lengths"),
                   absl::StrCat(n, " entries for num_rows ", in.num_rows));
  }
  for (size_t j = 0; j < n; ++j) {
    const int32_t len = in.row_lengths[j];
    if (len < 1 || len > profile_.max_context) {
      return Invalid(Request(i, absl::StrCat(".row_lengths[", j, "]")),
                     absl::StrCat("must be in [1, ", profile_.max_context, "], got ", len));
    }
  }
  ++row_lengths_checked_;
  return absl::OkStatus();
}

absl::Status StepValidator::Keys(int32_t i, const KeysInput& keys) {
  if (!owns_cache()) {
    auto takes_none = [&](absl::string_view field) {
      return Invalid(
          Request(i, field),
          absl::StrCat("layer ", spec_->layer, " reads layer ", spec_->cache_layer,
                       "'s cache and takes no keys; send keys to layer ", spec_->cache_layer));
    };
    if (keys.count != 0) return takes_none(".new_keys");
    if (keys.position.has_value()) return takes_none(".new_keys_position");
  }
  if (absl::Status s = CheckKeysForm(keys, spec_->cache_format,
                                     {Request(i, ".new_keys"), Request(i, ".new_key_scales"),
                                      Request(i, ".new_keys_position")});
      !s.ok()) {
    return s;
  }
  ++keys_checked_;
  return absl::OkStatus();
}

absl::Status StepValidator::Q(const QInput& q, int32_t num_rows) {
  if (num_rows != rows_) {
    return Invalid("num_rows",
                   absl::StrCat("the sequences bring ", rows_, " rows, the step says ", num_rows));
  }
  if (q.q == nullptr) return Invalid("q", "required");
  if (q.weights == nullptr) return Invalid("weights", "required");
  const CacheFormat format = spec_->cache_format;
  if (Quantized(q.type) && q.type != QuantizedType(format)) {
    return Invalid("q.dtype", absl::StrCat(TypeName(q.type), " q does not match layer ", layer_,
                                           "'s ", FormatName(format), " cache"));
  }
  if (!Quantized(q.type) && !Unquantized(q.type)) {
    return Invalid("q.dtype",
                   absl::StrCat("unsupported q type (", TypeName(q.type),
                                "): expected fp32, bf16 or the cache's ", FormatName(format)));
  }
  if (q.type == ElemType::kFp4E2M1 && q.scales == nullptr) {
    return Invalid("q_scales", "required with FP4 q");
  }
  if (q.type != ElemType::kFp4E2M1 && q.scales != nullptr) {
    return Invalid("q_scales", absl::StrCat("only with FP4 q, got ", TypeName(q.type), " q"));
  }
  if (q.positions != nullptr) {
    if (Quantized(q.type)) {
      return Invalid("positions", absl::StrCat("only with unquantized (fp32 or bf16) q; ",
                                               TypeName(q.type), " q is already rotated"));
    }
    for (int32_t r = 0; r < num_rows; ++r) {
      const int64_t v = q.positions[r];
      if (v < 0 || v >= profile_.max_context) {
        return Invalid(absl::StrCat("positions[", r, "]"),
                       absl::StrCat(v, " is out of range [0, ", profile_.max_context, ")"));
      }
    }
  }
  q_checked_ = true;
  return absl::OkStatus();
}

absl::StatusOr<ValidatedStep> StepValidator::Finish(StepInput input) {
  const int32_t n = static_cast<int32_t>(input.sequences.size());
  if (n == 0) return Invalid("sequences", "a step needs at least one sequence");
  if (spec_ == nullptr || input.layer != layer_ || input.return_candidates != return_candidates_ ||
      rows_checked_ != n || row_lengths_checked_ != n || keys_checked_ != n || !q_checked_ ||
      input.num_rows != rows_) {
    // A caller that skipped a stage (or validated another input): a bug, not a bad request.
    return absl::InternalError(
        absl::StrCat("the step's checks did not all run: layer ", spec_ != nullptr, " q ",
                     q_checked_, ", rows / row lengths / keys checked for ", rows_checked_, " / ",
                     row_lengths_checked_, " / ", keys_checked_, " of ", n, " requests"));
  }
  return ValidatedStep(std::move(input), spec_);
}

absl::StatusOr<ValidatedStep> ValidateStep(const config::Profile& profile, StepInput input) {
  StepValidator v(profile);
  if (absl::Status s = v.Layer(input.layer, input.return_candidates); !s.ok()) return s;
  if (input.sequences.empty()) return Invalid("sequences", "a step needs at least one sequence");
  for (size_t i = 0; i < input.sequences.size(); ++i) {
    const SequenceStepInput& in = input.sequences[i];
    const int32_t at = static_cast<int32_t>(i);
    if (absl::Status s = v.Rows(at, in.sequence_id, in.num_rows); !s.ok()) return s;
    if (absl::Status s = v.RowLengths(at, in); !s.ok()) return s;
    if (absl::Status s = v.Keys(at, in.new_keys); !s.ok()) return s;
  }
  if (absl::Status s = v.Q(input.q, input.num_rows); !s.ok()) return s;
  return v.Finish(std::move(input));
}

absl::StatusOr<ValidatedAppend> ValidateAppend(const config::Profile& profile, uint64_t sequence_id,
                                               int32_t layer, const KeysInput& keys) {
  absl::StatusOr<const LayerSpec*> spec = FindLayer(profile, layer);
  if (!spec.ok()) return spec.status();
  if (!OwnsCache(**spec)) {
    return Invalid("layer", absl::StrCat("layer ", layer,
                                         (*spec)->role == LayerRole::kCandidateConsumer
                                             ? " is a candidate consumer and"
                                             : "",
                                         " reads layer ", (*spec)->cache_layer,
                                         "'s cache; append keys to layer ", (*spec)->cache_layer));
  }
  if (keys.on_device && keys.count > 0) {
    return Invalid("keys", "keys in device memory are taken only by a decode step's new keys");
  }
  if (absl::Status s =
          CheckKeysForm(keys, (*spec)->cache_format, {"keys", "key_scales", "position"});
      !s.ok()) {
    return s;
  }
  return ValidatedAppend(sequence_id, *spec, keys);
}

}  // namespace decode_indexer::exec
