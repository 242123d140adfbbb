#include "server/service/request_decode.h"

#include <cstring>
#include <limits>
#include <span>
#include <string_view>
#include <utility>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "decode_indexer/kernels/value_check.h"

namespace decode_indexer::service {
namespace {

using kernels::CacheFormat;
using kernels::ElemType;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::string_view DTypeName(v1::DType dtype) {
  const std::string& name = v1::DType_Name(dtype);
  return name.empty() ? absl::string_view("DTYPE_<unknown>") : absl::string_view(name);
}

bool IsAbsent(const v1::Tensor& t) {
  return t.dtype() == v1::DTYPE_UNSPECIFIED && t.shape_size() == 0 && t.data().empty();
}

// Bytes of `elements` values of `dtype` (FP4: two a byte; the caller keeps elements even).
int64_t DataBytes(v1::DType dtype, int64_t elements) {
  switch (dtype) {
    case v1::DTYPE_FP32:
    case v1::DTYPE_INT32:
      return elements * 4;
    case v1::DTYPE_BF16:
      return elements * 2;
    case v1::DTYPE_FP8_E4M3:
    case v1::DTYPE_UE8M0:
      return elements;
    case v1::DTYPE_FP4_E2M1:
      return elements / 2;
    case v1::DTYPE_INT64:
      return elements * 8;
    default:
      return -1;
  }
}

// One expected dimension: a fixed value, or free (kFree) up to `bound` and printed by name.
constexpr int64_t kFree = -1;
struct Dim {
  int64_t value = kFree;
  absl::string_view name = "n";
  int64_t bound = 0;
};

std::string ExpectedString(std::span<const Dim> dims) {
  std::vector<std::string> parts;
  for (const Dim& d : dims) {
    parts.push_back(d.value == kFree ? std::string(d.name) : absl::StrCat(d.value));
  }
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

// Checks presence, dtype, shape and byte count; answers the shape. `field` is the tensor's
// proto path ("sequences[1].new_keys").
absl::StatusOr<std::vector<int64_t>> CheckTensor(const v1::Tensor& t, std::string_view data,
                                                 absl::string_view field,
                                                 std::span<const v1::DType> allowed,
                                                 std::span<const Dim> dims) {
  if (t.dtype() == v1::DTYPE_UNSPECIFIED) {
    return Invalid(absl::StrCat(field, ".dtype"), "required");
  }
  bool ok = false;
  for (v1::DType d : allowed) ok = ok || d == t.dtype();
  if (!ok) {
    std::vector<std::string> names;
    for (v1::DType d : allowed) names.emplace_back(DTypeName(d));
    return Invalid(
        absl::StrCat(field, ".dtype"),
        absl::StrCat("expected ", absl::StrJoin(names, " or "), ", got ", DTypeName(t.dtype())));
  }
  bool shape_ok = t.shape_size() == static_cast<int>(dims.size());
  for (int i = 0; shape_ok && i < t.shape_size(); ++i) {
    shape_ok = dims[i].value == kFree ? t.shape(i) >= 0 : t.shape(i) == dims[i].value;
  }
  if (!shape_ok) {
    return Invalid(absl::StrCat(field, ".shape"),
                   absl::StrCat("expected ", ExpectedString(dims), ", got ", ShapeString(t)));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i].value == kFree && t.shape(i) > dims[i].bound) {
      return Invalid(absl::StrCat(field, ".shape[", i, "]"),
                     absl::StrCat(dims[i].name, " = ", t.shape(i), " exceeds ", dims[i].bound));
    }
  }
  // Every dim is now bounded (fixed dims come from the profile, free dims by `bound`), so
  // the product cannot overflow.
  int64_t elements = 1;
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  for (int64_t v : shape) elements *= v;
  if (t.dtype() == v1::DTYPE_FP4_E2M1 && elements % 2 != 0) {
    return Invalid(
        absl::StrCat(field, ".shape"),
        absl::StrCat("DTYPE_FP4_E2M1 needs an even element count, got ", ShapeString(t)));
  }
  const int64_t bytes = DataBytes(t.dtype(), elements);
  if (static_cast<int64_t>(data.size()) != bytes) {
    return Invalid(absl::StrCat(field, ".data"),
                   absl::StrCat("expected ", bytes, " bytes for ", DTypeName(t.dtype()), " ",
                                ShapeString(t), ", got ", data.size()));
  }
  return shape;
}

// "[row 2, head 3, dim 5]" for a flat element index of a tensor of `shape`.
std::string IndexString(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] > 0) {
      idx[i] = flat % shape[i];
      flat /= shape[i];
    }
  }
  return absl::StrCat("[", absl::StrJoin(idx, ", "), "]");
}

ElemType ToElemType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return ElemType::kF32;
    case v1::DTYPE_BF16:
      return ElemType::kBF16;
    case v1::DTYPE_FP8_E4M3:
      return ElemType::kFp8E4M3;
    case v1::DTYPE_FP4_E2M1:
      return ElemType::kFp4E2M1;
    case v1::DTYPE_UE8M0:
      return ElemType::kUE8M0;
    case v1::DTYPE_INT32:
      return ElemType::kI32;
    default:
      return ElemType::kI64;
  }
}

// NaN/Inf (and, for scales, non-positive values) in a checked tensor: the one rule of
// kernels::IsBadValue, scanned at memory speed (kernels::HostAnyBadValue); only a tensor with
// a bad element is walked again to name the first one.
absl::Status CheckValues(const v1::Tensor& t, std::string_view data, absl::string_view field,
                         const std::vector<int64_t>& shape, bool positive) {
  const ElemType type = ToElemType(t.dtype());
  const int32_t eb = kernels::CheckedElemBytes(type);
  if (eb == 0) return absl::OkStatus();  // FP4 codes are all finite; integers have no NaN.
  const int64_t n = static_cast<int64_t>(data.size()) / eb;
  const bool fp32_positive = positive && type == ElemType::kF32;
  if (!kernels::HostAnyBadValue(type, data.data(), n, fp32_positive)) return absl::OkStatus();
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, data.data() + i * eb, static_cast<size_t>(eb));
    if (!kernels::IsBadValue(type, bits, fp32_positive)) continue;
    const bool nan_or_inf = kernels::IsBadValue(type, bits);
    absl::string_view what = type == ElemType::kFp8E4M3 ? "NaN code"
                             : type == ElemType::kUE8M0 ? "NaN scale (0xFF)"
                             : nan_or_inf               ? "NaN or Inf"
                                                        : "non-positive scale";
    return Invalid(absl::StrCat(field, ".data"),
                   absl::StrCat(what, " at element ", i, " ", IndexString(i, shape)));
  }
  return absl::OkStatus();
}

// The request's bytes when suitably aligned for `align`, else a copy kept in `storage`.
const void* AlignedView(std::string_view data, size_t align,
                        std::vector<std::vector<uint8_t>>& storage) {
  if (reinterpret_cast<uintptr_t>(data.data()) % align == 0) return data.data();
  storage.emplace_back(data.begin(), data.end());  // operator new aligns for any scalar
  return storage.back().data();
}

const float* AlignedFloats(std::string_view data, std::vector<float>& storage) {
  if (reinterpret_cast<uintptr_t>(data.data()) % alignof(float) == 0) {
    return reinterpret_cast<const float*>(data.data());
  }
  storage.resize(data.size() / sizeof(float));
  std::memcpy(storage.data(), data.data(), storage.size() * sizeof(float));
  return storage.data();
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Bytes a client may rewrite at any moment (its shared-memory region), copied once into
// storage the decoded step owns: the values checked are then the values used. Called only
// once `data`'s size is checked against a bounded shape, so a client's claim cannot make the
// server allocate more than a valid tensor of that kind takes.
std::string_view PrivateCopy(std::string_view data, std::vector<std::vector<uint8_t>>& storage) {
  const auto* p = reinterpret_cast<const uint8_t*>(data.data());
  std::vector<uint8_t>& copy = storage.emplace_back(p, p + data.size());
  return std::string_view(reinterpret_cast<const char*>(copy.data()), copy.size());
}

// Keys in any form a cache may take (AppendKeys.keys / new_keys): their tensors' dtype, shape,
// bytes and values. Whether the form fits the layer's cache (pre-quantized in its format, with
// scales; scales only then) is the validator's (exec::CheckKeysForm): scales the form does not
// take are passed on unchecked for it to refuse, missing ones as null.
//
// keys_at / scales_at in host memory (not on_device) are a client's shared-memory region:
// each is copied (PrivateCopy) once its size is checked and before its values are, since the
// keys are stored in the sequence's cache. Checked in place and copied into the cache later,
// a NaN code or a NaN, zero or negative scale written meanwhile would land there, past every
// check: the sequence's answers spoiled, its export refused, and a snapshot holding it
// refused whole at the next start (executor_lifecycle.cc CheckCacheImage), every client's
// sequences with it.
absl::StatusOr<exec::KeysInput> DecodeKeys(
    const v1::Tensor& keys, const v1::Tensor& scales, absl::string_view keys_field,
    absl::string_view scales_field, const config::Profile& profile,
    std::vector<float>& scale_storage, std::vector<std::vector<uint8_t>>& realigned,
    int64_t expected_n = kFree, std::optional<std::string_view> keys_at = {},
    std::optional<std::string_view> scales_at = {}, bool on_device = false) {
  const int32_t d = profile.head_dim;
  // The bytes: the Tensors' own, or where the caller found them (a shared-memory region).
  std::string_view keys_data = keys_at.value_or(std::string_view(keys.data()));
  std::string_view scales_data = scales_at.value_or(std::string_view(scales.data()));
  const bool copy_keys = keys_at.has_value() && !on_device;
  const bool copy_scales = scales_at.has_value() && !on_device;
  const bool scales_absent = !scales_at.has_value() && IsAbsent(scales);
  const v1::DType allowed[] = {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP8_E4M3,
                               v1::DTYPE_FP4_E2M1};
  // Device bytes (cuda_ipc.new_keys_offset): pre-quantized only, since the host cannot read
  // (so cannot quantize) them; their values are checked on the device.
  const v1::DType device_allowed[] = {v1::DTYPE_FP8_E4M3, v1::DTYPE_FP4_E2M1};
  const Dim dims[] = {{expected_n, "n", profile.max_context}, {d}};
  absl::StatusOr<std::vector<int64_t>> shape = CheckTensor(
      keys, keys_data, keys_field,
      on_device ? std::span<const v1::DType>(device_allowed) : std::span<const v1::DType>(allowed),
      dims);
  if (!shape.ok()) return shape.status();
  const int64_t n = (*shape)[0];
  if (n == 0) return Invalid(absl::StrCat(keys_field, ".shape"), "no keys (n = 0)");
  if (copy_keys) keys_data = PrivateCopy(keys_data, realigned);
  if (!on_device) {
    if (absl::Status s = CheckValues(keys, keys_data, keys_field, *shape, false); !s.ok()) {
      return s;
    }
  }

  exec::KeysInput out;
  out.type = ToElemType(keys.dtype());
  out.count = static_cast<int32_t>(n);
  out.on_device = on_device;
  const bool pre_quantized =
      keys.dtype() == v1::DTYPE_FP8_E4M3 || keys.dtype() == v1::DTYPE_FP4_E2M1;
  if (!pre_quantized) {
    // Scales here are refused by the validator, unread.
    if (!scales_absent) out.scales = scales_data.data();
    out.keys = AlignedView(keys_data, keys.dtype() == v1::DTYPE_FP32 ? 4 : 2, realigned);
    return out;
  }
  out.keys = keys_data.data();
  if (scales_absent) return out;  // the validator says they are required
  if (keys.dtype() == v1::DTYPE_FP8_E4M3) {
    const v1::DType scale_types[] = {v1::DTYPE_FP32};
    const Dim scale_dims[] = {{n}};
    absl::StatusOr<std::vector<int64_t>> sshape =
        CheckTensor(scales, scales_data, scales_field, scale_types, scale_dims);
    if (!sshape.ok()) return sshape.status();
    if (copy_scales) scales_data = PrivateCopy(scales_data, realigned);
    if (on_device) {  // values on the device; a device address is never realigned
      out.scales = scales_data.data();
      return out;
    }
    if (absl::Status s = CheckValues(scales, scales_data, scales_field, *sshape, true); !s.ok()) {
      return s;
    }
    out.scales = AlignedFloats(scales_data, scale_storage);
  } else {
    const v1::DType scale_types[] = {v1::DTYPE_UE8M0};
    const Dim scale_dims[] = {{n}, {d / 32}};
    absl::StatusOr<std::vector<int64_t>> sshape =
        CheckTensor(scales, scales_data, scales_field, scale_types, scale_dims);
    if (!sshape.ok()) return sshape.status();
    if (copy_scales) scales_data = PrivateCopy(scales_data, realigned);
    if (!on_device) {
      if (absl::Status s = CheckValues(scales, scales_data, scales_field, *sshape, false);
          !s.ok()) {
        return s;
      }
    }
    out.scales = scales_data.data();
  }
  return out;
}

// The `sequences` form: one SequenceStep message per request, each checked by the validator's
// stages as it is decoded. Answers the step's rows.
absl::StatusOr<int64_t> DecodeSequenceMessages(const v1::DecodeStepRequest& request,
                                               const config::Profile& profile,
                                               exec::StepValidator& v, exec::StepInput& step,
                                               DecodedStep& out) {
  step.sequences.reserve(request.sequences_size());
  out.key_scales.resize(request.sequences_size());
  int64_t total_rows = 0;
  for (int i = 0; i < request.sequences_size(); ++i) {
    const v1::SequenceStep& seq = request.sequences(i);
    // num_rows 0: the row count comes from row_lengths.
    const int32_t rows = seq.num_rows() == 0 ? seq.row_lengths_size() : seq.num_rows();
    if (absl::Status s = v.Rows(i, seq.sequence_id(), rows); !s.ok()) return s;
    exec::SequenceStepInput in;
    in.sequence_id = seq.sequence_id();
    in.num_rows = rows;
    in.row_lengths.assign(seq.row_lengths().begin(), seq.row_lengths().end());
    if (absl::Status s = v.RowLengths(i, in); !s.ok()) return s;
    if (!IsAbsent(seq.new_keys()) || !IsAbsent(seq.new_key_scales())) {
      const std::string prefix = absl::StrCat("sequences[", i, "]");
      absl::StatusOr<exec::KeysInput> keys = DecodeKeys(
          seq.new_keys(), seq.new_key_scales(), absl::StrCat(prefix, ".new_keys"),
          absl::StrCat(prefix, ".new_key_scales"), profile, out.key_scales[i], out.realigned);
      if (!keys.ok()) return keys.status();
      in.new_keys = *keys;
    }
    if (seq.has_new_keys_position()) in.new_keys.position = seq.new_keys_position();
    if (absl::Status s = v.Keys(i, in.new_keys); !s.ok()) return s;
    total_rows += rows;
    step.sequences.push_back(std::move(in));
  }
  return total_rows;
}

// Whether any field of the columnar form of a step's requests is set, and the first one
// (in the proto's order) for messages.
bool HasColumnarFields(const v1::DecodeStepRequest& r) {
  return r.sequence_ids_size() > 0 || r.num_rows_size() > 0 || r.rows_per_sequence() != 0 ||
         !IsAbsent(r.new_keys()) || !IsAbsent(r.new_key_scales()) || r.new_key_counts_size() > 0 ||
         r.new_keys_positions_size() > 0 || r.row_lengths_size() > 0;
}

absl::string_view FirstColumnarField(const v1::DecodeStepRequest& r) {
  if (r.sequence_ids_size() > 0) return "sequence_ids";
  if (r.num_rows_size() > 0) return "num_rows";
  if (r.rows_per_sequence() != 0) return "rows_per_sequence";
  if (!IsAbsent(r.new_keys())) return "new_keys";
  if (!IsAbsent(r.new_key_scales())) return "new_key_scales";
  if (r.new_key_counts_size() > 0) return "new_key_counts";
  if (r.new_keys_positions_size() > 0) return "new_keys_positions";
  return "row_lengths";
}

// Bytes of one key row of `type` at head dim d.
size_t KeyRowBytes(ElemType type, int32_t d) {
  switch (type) {
    case ElemType::kF32:
      return size_t(d) * 4;
    case ElemType::kBF16:
      return size_t(d) * 2;
    case ElemType::kFp4E2M1:
      return size_t(d) / 2;
    default:
      return size_t(d);
  }
}

// "3 entries for 4 sequence_ids (one per request, or none)".
absl::Status ColumnLength(absl::string_view field, int got, int64_t want, absl::string_view what,
                          absl::string_view otherwise) {
  return Invalid(field,
                 absl::StrCat(got, " entries for ", want, " ", what, " (one per ",
                              what == "rows" ? "row" : "request", ", or none", otherwise, ")"));
}

// The columnar form: packed columns and one stacked keys tensor, decoded into the same
// StepInput the `sequences` form gives; each request's keys point into the one tensor.
// Answers the step's rows.
absl::StatusOr<int64_t> DecodeColumnar(const v1::DecodeStepRequest& request,
                                       const config::Profile& profile,
                                       const ExternalStepBytes& external, exec::StepValidator& v,
                                       exec::StepInput& step, DecodedStep& out) {
  const config::LayerSpec& spec = v.spec();
  const int n = request.sequence_ids_size();
  const uint64_t* ids = request.sequence_ids().data();
  const int32_t max_rows = profile.max_rows_per_sequence;
  const int32_t d = profile.head_dim;

  // Rows: one count per request, or one for all.
  const int32_t* num_rows = nullptr;
  const int32_t uniform = request.rows_per_sequence();
  if (request.num_rows_size() != 0) {
    if (request.num_rows_size() != n) {
      return ColumnLength("num_rows", request.num_rows_size(), n, "sequence_ids",
                          " and rows_per_sequence");
    }
    if (uniform != 0) {
      return Invalid("rows_per_sequence", "set together with num_rows (give one of them)");
    }
    num_rows = request.num_rows().data();
  } else if (uniform == 0) {
    return Invalid("rows_per_sequence", "required (or num_rows, one per sequence_ids entry)");
  } else if (uniform < 0) {
    return Invalid("rows_per_sequence", absl::StrCat("must be >= 1, got ", uniform));
  } else if (uniform > max_rows) {
    return Invalid("rows_per_sequence",
                   absl::StrCat(uniform, " rows exceed max_rows_per_sequence ", max_rows));
  }
  const int32_t* counts = nullptr;
  if (request.new_key_counts_size() != 0) {
    if (request.new_key_counts_size() != n) {
      return ColumnLength("new_key_counts", request.new_key_counts_size(), n, "sequence_ids", "");
    }
    counts = request.new_key_counts().data();
  }
  const int64_t* positions = nullptr;
  if (request.new_keys_positions_size() != 0) {
    if (request.new_keys_positions_size() != n) {
      return ColumnLength("new_keys_positions", request.new_keys_positions_size(), n,
                          "sequence_ids", "");
    }
    positions = request.new_keys_positions().data();
  }
  const bool owns = v.owns_cache();
  const bool has_keys = external.new_keys.has_value() || external.new_key_scales.has_value() ||
                        !IsAbsent(request.new_keys()) || !IsAbsent(request.new_key_scales());
  auto no_keys = [&] {
    return absl::StrCat("layer ", spec.layer, " reads layer ", spec.cache_layer,
                        "'s cache and takes no keys");
  };
  if (has_keys && !owns) return Invalid("new_keys", no_keys());

  step.sequences.resize(n);
  int64_t total_rows = 0;
  int64_t total_keys = 0;
  for (int i = 0; i < n; ++i) {
    // The request's id and rows (the validator's messages renamed to the columns by the
    // caller: NameColumnarFields).
    const int32_t rows = num_rows != nullptr ? num_rows[i] : uniform;
    if (absl::Status s = v.Rows(i, ids[i], rows); !s.ok()) return s;
    exec::SequenceStepInput& in = step.sequences[i];
    in.sequence_id = ids[i];
    in.num_rows = rows;
    // Field names are built on the error paths only: this loop runs for every request.
    auto at = [i](absl::string_view column) { return absl::StrCat(column, "[", i, "]"); };
    if (counts != nullptr) {
      const int32_t c = counts[i];
      if (c < 0) return Invalid(at("new_key_counts"), absl::StrCat("negative: ", c));
      if (c > 0 && !owns) return Invalid(at("new_key_counts"), no_keys());
      if (c > profile.max_context) {
        return Invalid(at("new_key_counts"),
                       absl::StrCat(c, " keys exceed max_context ", profile.max_context));
      }
      in.new_keys.count = c;
    } else if (has_keys) {
      in.new_keys.count = rows;  // one key per new row
    }
    total_keys += in.new_keys.count;
    if (positions != nullptr) {
      const int64_t p = positions[i];
      if (p < -1) {
        return Invalid(at("new_keys_positions"),
                       absl::StrCat("must be >= 0, or -1 for none, got ", p));
      }
      if (p >= 0) in.new_keys.position = p;  // none at a consumer: the validator's Keys
    }
    total_rows += rows;
  }

  // Row lengths: a request's rows are all explicit, or all 0 (causal); the explicit ones'
  // range is the validator's.
  const int32_t* lengths = request.row_lengths_size() != 0 ? request.row_lengths().data() : nullptr;
  if (lengths != nullptr && request.row_lengths_size() != total_rows) {
    return ColumnLength("row_lengths", request.row_lengths_size(), total_rows, "rows", "");
  }
  int64_t r = 0;
  for (int i = 0; i < n; ++i) {
    exec::SequenceStepInput& in = step.sequences[i];
    const int32_t* mine = lengths != nullptr ? lengths + r : nullptr;
    bool any = false;
    for (int32_t j = 0; mine != nullptr && j < in.num_rows; ++j) any = any || mine[j] != 0;
    if (any) {
      for (int32_t j = 0; j < in.num_rows; ++j) {
        if (mine[j] == 0) {
          return Invalid(absl::StrCat("row_lengths[", r + j, "]"),
                         absl::StrCat("0 (causal) among explicit lengths of sequence_ids[", i,
                                      "]'s rows (give all of a request's rows a length, "
                                      "or 0 on all of them)"));
        }
      }
      in.row_lengths.assign(mine, mine + in.num_rows);
    }
    if (absl::Status s = v.RowLengths(i, in); !s.ok()) return s;
    r += in.num_rows;
  }

  // Keys: one tensor, each request's slice viewed in place.
  if (has_keys) {
    const v1::Tensor& keys = request.new_keys();
    if (keys.shape_size() == 2 && keys.shape(0) != total_keys) {
      return Invalid("new_keys.shape",
                     absl::StrCat("expected [", total_keys, ", ", d, "] (",
                                  counts != nullptr ? "the sum of new_key_counts"
                                                    : "one key per row: new_key_counts is empty",
                                  "), got ", ShapeString(keys)));
    }
    out.key_scales.resize(1);
    absl::StatusOr<exec::KeysInput> all =
        DecodeKeys(keys, request.new_key_scales(), "new_keys", "new_key_scales", profile,
                   out.key_scales[0], out.realigned, total_keys, external.new_keys,
                   external.new_key_scales, external.keys_on_device);
    if (!all.ok()) return all.status();
    const char* base = static_cast<const char*>(all->keys);
    const char* scales = static_cast<const char*>(all->scales);
    const size_t row_bytes = KeyRowBytes(all->type, d);
    // Scales of the keys' own type (the validator refuses a type that is not the cache's).
    const size_t scale_bytes = all->type == ElemType::kFp4E2M1 ? size_t(d) / 32 : sizeof(float);
    int64_t at = 0;
    for (exec::SequenceStepInput& in : step.sequences) {
      if (in.new_keys.count > 0) {
        in.new_keys.type = all->type;
        in.new_keys.on_device = all->on_device;
        in.new_keys.keys = base + at * row_bytes;
        in.new_keys.scales = scales != nullptr ? scales + at * scale_bytes : nullptr;
      }
      at += in.new_keys.count;
    }
  } else if (total_keys > 0) {
    return Invalid("new_keys", absl::StrCat("required: new_key_counts give ", total_keys, " keys"));
  }
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = v.Keys(i, step.sequences[i].new_keys); !s.ok()) return s;
  }
  return total_rows;
}

}  // namespace

std::string ShapeString(const v1::Tensor& tensor) {
  // Bounded: a client's shape of 40,000 dims must not become a 130 kB message.
  constexpr int kMaxDims = 8;
  if (tensor.shape_size() <= kMaxDims) {
    return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "]");
  }
  return absl::StrCat(
      "[", absl::StrJoin(tensor.shape().begin(), tensor.shape().begin() + kMaxDims, ", "),
      ", ... (", tensor.shape_size(), " dims)]");
}

absl::StatusOr<DecodedAppend> DecodeAppendKeys(const v1::AppendKeysRequest& request,
                                               const config::Profile& profile) {
  if (IsAbsent(request.keys()) && !request.has_position()) return Invalid("keys", "required");
  DecodedAppend out;
  exec::KeysInput keys;
  // Without keys: a cut back to `position` with nothing written.
  if (!IsAbsent(request.keys())) {
    absl::StatusOr<exec::KeysInput> decoded =
        DecodeKeys(request.keys(), request.key_scales(), "keys", "key_scales", profile,
                   out.scale_storage, out.realigned);
    if (!decoded.ok()) return decoded.status();
    keys = *decoded;
  }
  if (request.has_position()) keys.position = request.position();
  // The layer, and whether the keys' form fits its cache: the executor's one check.
  absl::StatusOr<exec::ValidatedAppend> append =
      exec::ValidateAppend(profile, request.sequence_id(), request.layer(), keys);
  if (!append.ok()) return append.status();
  out.append.emplace(*std::move(append));
  return out;
}

namespace {

// DecodeStepRequest's decoding into `step`, the validator's stages run where the bytes need
// them, and on success `out.validated`.
absl::Status DecodeStep(const v1::DecodeStepRequest& request, const config::Profile& profile,
                        const ExternalStepBytes& external, exec::StepInput& step,
                        DecodedStep& out) {
  exec::StepValidator v(profile);
  if (absl::Status s = v.Layer(request.layer(), request.return_candidates()); !s.ok()) return s;
  const int32_t h = profile.num_heads;
  const int32_t d = profile.head_dim;

  if (!v1::AnswerEncoding_IsValid(request.answer_encoding())) {
    // An open enum keeps unknown numbers: refuse them rather than serve them as RAW.
    return Invalid("answer_encoding",
                   absl::StrCat("unknown value ", request.answer_encoding(),
                                " (expected ANSWER_ENCODING_RAW or ANSWER_ENCODING_DELTA_VARINT)"));
  }
  const bool columnar = HasColumnarFields(request) || external.new_keys.has_value() ||
                        external.new_key_scales.has_value();
  if ((external.new_keys || external.new_key_scales) && request.sequences_size() > 0) {
    const char* from = external.keys_on_device ? "cuda_ipc." : "shared_memory.";
    return Invalid(
        absl::StrCat(from, external.new_keys ? "new_keys_offset" : "new_key_scales_offset"),
        "only with the columnar form (sequence_ids), not with sequences");
  }
  if (columnar && request.sequences_size() > 0) {
    return Invalid(FirstColumnarField(request),
                   "the columnar form cannot be mixed with sequences (send one form)");
  }
  if (columnar && request.sequence_ids_size() == 0) {
    return Invalid("sequence_ids", absl::StrCat("required with ", FirstColumnarField(request),
                                                " (the columnar form)"));
  }
  if (!columnar && request.sequences_size() == 0) {
    return Invalid("sequences", "at least one required (or sequence_ids, the columnar form)");
  }

  step.layer = request.layer();
  step.step_id = request.step_id();
  step.return_candidates = request.return_candidates();
  absl::StatusOr<int64_t> rows_or = columnar
                                        ? DecodeColumnar(request, profile, external, v, step, out)
                                        : DecodeSequenceMessages(request, profile, v, step, out);
  if (!rows_or.ok()) return rows_or.status();
  const int64_t total_rows = *rows_or;
  // Bounded by sequences * max_rows_per_sequence; still refuse what an int32 cannot count.
  if (total_rows > std::numeric_limits<int32_t>::max() / (int64_t{h} * d)) {
    return Invalid(columnar ? "sequence_ids" : "sequences",
                   absl::StrCat(total_rows, " rows in one step are too many"));
  }
  step.num_rows = static_cast<int32_t>(total_rows);

  // q: unquantized (fp32/bf16) or pre-quantized in the layer's cache format.
  const v1::Tensor& q = request.q();
  const std::string_view q_data = external.q.value_or(std::string_view(q.data()));
  if (!external.q && IsAbsent(q)) return Invalid("q", "required");
  // The dtypes q may have; whether a quantized one is the layer's cache format is the
  // validator's (StepValidator::Q).
  const v1::DType q_types[] = {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP8_E4M3,
                               v1::DTYPE_FP4_E2M1};
  const Dim q_dims[] = {{total_rows}, {h}, {d}};
  absl::StatusOr<std::vector<int64_t>> q_shape = CheckTensor(q, q_data, "q", q_types, q_dims);
  if (!q_shape.ok()) return q_shape.status();
  // Device bytes (external.q_on_device) are checked on the device, and never realigned.
  const bool on_device = external.q_on_device;
  if (!on_device) {
    if (absl::Status s = CheckValues(q, q_data, "q", *q_shape, false); !s.ok()) return s;
  }
  const bool q_quantized = q.dtype() == v1::DTYPE_FP8_E4M3 || q.dtype() == v1::DTYPE_FP4_E2M1;
  step.q.type = ToElemType(q.dtype());
  step.q.on_device = on_device;
  step.q.q = q_quantized || on_device
                 ? static_cast<const void*>(q_data.data())
                 : AlignedView(q_data, q.dtype() == v1::DTYPE_FP32 ? 4 : 2, out.realigned);
  const std::string_view s_data =
      external.q_scales.value_or(std::string_view(request.q_scales().data()));
  const bool has_scales = external.q_scales.has_value() || !IsAbsent(request.q_scales());
  // Present or not as q's type needs: the validator's.
  if (has_scales) {
    const v1::DType s_types[] = {v1::DTYPE_UE8M0};
    const Dim s_dims[] = {{total_rows}, {h}, {d / 32}};
    absl::StatusOr<std::vector<int64_t>> s_shape =
        CheckTensor(request.q_scales(), s_data, "q_scales", s_types, s_dims);
    if (!s_shape.ok()) return s_shape.status();
    if (absl::Status s = on_device
                             ? absl::OkStatus()
                             : CheckValues(request.q_scales(), s_data, "q_scales", *s_shape, false);
        !s.ok()) {
      return s;
    }
    step.q.scales = reinterpret_cast<const uint8_t*>(s_data.data());
  }

  // weights [rows, H]: fp32 viewed in place, bf16 widened into owned storage.
  const std::string_view w_data =
      external.weights.value_or(std::string_view(request.weights().data()));
  if (!external.weights && IsAbsent(request.weights())) return Invalid("weights", "required");
  const v1::DType w_types[] = {v1::DTYPE_FP32, v1::DTYPE_BF16};
  const Dim w_dims[] = {{total_rows}, {h}};
  absl::StatusOr<std::vector<int64_t>> w_shape =
      CheckTensor(request.weights(), w_data, "weights", w_types, w_dims);
  if (!w_shape.ok()) return w_shape.status();
  if (on_device) {
    if (request.weights().dtype() != v1::DTYPE_FP32) {
      return Invalid("weights.dtype",
                     absl::StrCat("DTYPE_FP32 expected for weights in device memory "
                                  "(cuda_ipc.weights_offset), got ",
                                  DTypeName(request.weights().dtype())));
    }
    step.q.weights = reinterpret_cast<const float*>(w_data.data());
  } else if (absl::Status s = CheckValues(request.weights(), w_data, "weights", *w_shape, false);
             !s.ok()) {
    return s;
  } else if (request.weights().dtype() == v1::DTYPE_BF16) {
    const std::string_view data = w_data;
    out.weights.resize(data.size() / 2);
    for (size_t i = 0; i < out.weights.size(); ++i) {
      uint16_t bits;
      std::memcpy(&bits, data.data() + 2 * i, 2);
      out.weights[i] = Bf16ToFloat(bits);
    }
    step.q.weights = out.weights.data();
  } else {
    step.q.weights = AlignedFloats(w_data, out.weights);
  }

  // positions [rows], widened to int64 (RoPE needs the unrotated q, so only with unquantized
  // q, and each in [0, max_context): the validator's).
  if (external.positions.has_value() || !IsAbsent(request.positions())) {
    const std::string_view p_data =
        external.positions.value_or(std::string_view(request.positions().data()));
    const v1::DType p_types[] = {v1::DTYPE_INT32, v1::DTYPE_INT64};
    const Dim p_dims[] = {{total_rows}};
    absl::StatusOr<std::vector<int64_t>> p_shape =
        CheckTensor(request.positions(), p_data, "positions", p_types, p_dims);
    if (!p_shape.ok()) return p_shape.status();
    const std::string_view data = p_data;
    const bool is32 = request.positions().dtype() == v1::DTYPE_INT32;
    out.positions.resize(total_rows);
    for (int64_t r = 0; r < total_rows; ++r) {
      int64_t pos;
      if (is32) {
        int32_t pos32;
        std::memcpy(&pos32, data.data() + 4 * r, 4);
        pos = pos32;
      } else {
        std::memcpy(&pos, data.data() + 8 * r, 8);
      }
      out.positions[r] = pos;
    }
    step.q.positions = out.positions.data();
  }
  if (absl::Status s = v.Q(step.q, step.num_rows); !s.ok()) return s;
  absl::StatusOr<exec::ValidatedStep> validated = v.Finish(std::move(step));
  if (!validated.ok()) return validated.status();
  out.validated.emplace(*std::move(validated));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DecodedStep> DecodeStepRequest(const v1::DecodeStepRequest& request,
                                              const config::Profile& profile,
                                              const ExternalStepBytes& external) {
  DecodedStep out;
  exec::StepInput step;
  absl::Status s = DecodeStep(request, profile, external, step, out);
  // The validator names requests the `sequences` way; a columnar step hears its own fields.
  if (!s.ok()) return NameColumnarFields(s, request);
  return out;
}

absl::Status NameColumnarFields(const absl::Status& status, const v1::DecodeStepRequest& request) {
  const absl::string_view message = status.message();
  constexpr absl::string_view kPrefix = "sequences[";
  if (status.ok() || request.sequences_size() > 0 || request.sequence_ids_size() == 0 ||
      !absl::StartsWith(message, kPrefix)) {
    return status;
  }
  const size_t close = message.find(']');
  int64_t i = 0;
  if (close == absl::string_view::npos ||
      !absl::SimpleAtoi(message.substr(kPrefix.size(), close - kPrefix.size()), &i) || i < 0 ||
      i >= request.sequence_ids_size()) {
    return status;
  }
  absl::string_view rest = message.substr(close + 1);  // ".row_lengths[1]: ..." or ": ..."
  const std::string request_name = absl::StrCat("sequence_ids[", i, "]");
  std::string renamed;
  auto take = [&](absl::string_view field) { return absl::ConsumePrefix(&rest, field); };
  if (take(".sequence_id")) {
    // "... appears twice in one step (also sequences[1])": the other request by its column.
    std::string text(rest);
    const std::string also = "(also sequences[";
    if (const size_t at = text.find(also); at != std::string::npos) {
      text.replace(at, also.size(), "(also sequence_ids[");
    }
    renamed = absl::StrCat(request_name, text);
  } else if (take(".new_keys.dtype") || take(".new_key_scales")) {
    // Every request's keys are slices of the one new_keys tensor, and its scales of the one
    // new_key_scales: their form is the tensor's.
    const bool dtype = !absl::StartsWith(message.substr(close + 1), ".new_key_scales");
    renamed = absl::StrCat(dtype ? "new_keys.dtype" : "new_key_scales", rest);
  } else if (take(".num_rows")) {
    renamed = request.num_rows_size() > 0
                  ? absl::StrCat("num_rows[", i, "]", rest)
                  : absl::StrCat("rows_per_sequence (", request_name, ")", rest);
  } else if (take(".row_lengths[")) {
    // Row j of request i is entry (rows of the requests before it) + j of the column.
    const size_t end = rest.find(']');
    int64_t j = 0;
    if (end == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, end), &j)) {
      return status;
    }
    int64_t first = 0;
    for (int64_t r = 0; r < i; ++r) {
      first += request.num_rows_size() > 0 ? request.num_rows(static_cast<int>(r))
                                           : request.rows_per_sequence();
    }
    renamed = absl::StrCat("row_lengths[", first + j, "]", rest.substr(end + 1));
  } else if (take(".row_lengths")) {
    renamed = absl::StrCat("row_lengths (", request_name, ")", rest);
  } else if (take(".new_keys_position")) {
    renamed = absl::StrCat("new_keys_positions[", i, "]", rest);
  } else if (take(".new_keys")) {
    renamed = absl::StrCat("new_keys (", request_name, "'s keys)", rest);
  } else {
    renamed = absl::StrCat(request_name, rest);
  }
  return absl::Status(status.code(), renamed);
}

}  // namespace decode_indexer::service
