#include "server/exec/step_io.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace decode_indexer::exec {
namespace {

using kernels::CacheFormat;
using kernels::ElemType;

int64_t InputElemBytes(ElemType type) { return type == ElemType::kBF16 ? 2 : 4; }

// Sets the entries of `edits` in `pool`'s resident table (page_table_mirror.h), in stream order
// before whatever the rank issues next: one scatter per chunk of the rank's edit buffers.
absl::Status ApplyTableEdits(Rank& rank, Staging& staging, int32_t pool, const TableEdits& edits) {
  RankBuffers& b = rank.buffers();
  const size_t chunk = static_cast<size_t>(rank.sizes().table_edit_chunk);
  for (size_t done = 0; done < edits.size(); done += chunk) {
    const int32_t n = static_cast<int32_t>(std::min(chunk, edits.size() - done));
    // The previous chunk's scatter read these buffers; the uploads follow it on the stream.
    DI_RETURN_IF_ERROR(
        staging.Upload(b.edit_index, edits.index.data() + done, size_t(n) * sizeof(int32_t)));
    DI_RETURN_IF_ERROR(
        staging.Upload(b.edit_pages, edits.page.data() + done, size_t(n) * sizeof(int32_t)));
    kernels::CopyRowsArgs scatter;
    scatter.num_rows = n;
    scatter.row_elems = 1;
    scatter.dst = b.page_tables[pool];
    scatter.dst_index = b.edit_index;
    scatter.src = b.edit_pages;
    DI_RETURN_IF_ERROR(rank.backend().CopyRows(scatter));
  }
  return absl::OkStatus();
}

// Device-resident q (QInput::on_device): the rank's copies of its rows are checked on its
// device; the flag word lands in the rank's host word with the step's last copies and is
// read after its Synchronize (DeviceInputsStatus).
constexpr uint32_t kQBit = 1, kQScalesBit = 2, kWeightsBit = 4;
absl::Status CheckDeviceInputs(Rank& rank, kernels::ValueCheck q, kernels::ValueCheck q_scales,
                               kernels::ValueCheck weights) {
  kernels::ValueCheckArgs args;
  for (const kernels::ValueCheck& c : {q, q_scales, weights}) {
    if (c.data != nullptr && c.count > 0) args.checks[args.num_checks++] = c;
  }
  args.flags = rank.buffers().value_flags;
  return rank.backend().CheckValues(args);
}

}  // namespace

absl::Status DeviceInputsStatus(uint32_t flags) {
  if (flags == 0) return absl::OkStatus();
  const char* field = (flags & kQBit)         ? "q.data"
                      : (flags & kQScalesBit) ? "q_scales.data"
                                              : "weights.data";
  return absl::InvalidArgumentError(absl::StrCat(
      field,
      ": NaN or Inf (FP8: a NaN code; UE8M0: 0xFF) in the device buffer, found by the check "
      "on the device; the step committed nothing"));
}

absl::Status UploadStepRows(Rank& rank, Staging& staging, const StepPlan& plan) {
  RankBuffers& b = rank.buffers();
  DI_RETURN_IF_ERROR(
      staging.Upload(b.row_request, plan.row_request.data(), plan.num_rows * sizeof(int32_t)));
  DI_RETURN_IF_ERROR(
      staging.Upload(b.row_length, plan.row_length.data(), plan.num_rows * sizeof(int32_t)));
  if (plan.pending_edits != nullptr) {
    DI_RETURN_IF_ERROR(ApplyTableEdits(rank, staging, plan.pool, *plan.pending_edits));
  }
  DI_RETURN_IF_ERROR(ApplyTableEdits(rank, staging, plan.pool, plan.table_edits));
  return staging.Upload(b.request_slot, plan.request_slot.data(),
                        plan.num_requests * sizeof(int32_t));
}

absl::StatusOr<QRows> UploadQ(Rank& rank, Staging& staging, const StepPlan& plan, RowRange range) {
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const CacheFormat format = b.caches[plan.pool].geometry.format;
  const int32_t H = s.num_heads;
  const int32_t D = s.head_dim;
  const int32_t n = range.end - range.start;
  // q of this rank's rows only, at the rows' own offsets in the staging buffers.
  const int64_t hd = int64_t{H} * D;
  const int64_t code_bytes = format == CacheFormat::kFp8 ? hd : hd / 2;
  const int64_t scale_bytes = hd / 32;
  uint8_t* q_codes = b.q_codes + range.start * code_bytes;
  uint8_t* q_scales = b.q_scales + range.start * scale_bytes;
  float* weights = b.weights + int64_t{range.start} * H;
  const QInput& q = plan.q;
  const bool unquantized = q.type == ElemType::kF32 || q.type == ElemType::kBF16;
  kernels::QPrepArgs prep;
  if (unquantized) {
    const int64_t eb = InputElemBytes(q.type);
    uint8_t* q_raw = b.q_raw + range.start * hd * eb;
    float* w_raw = b.weights_raw + int64_t{range.start} * H;
    auto upload = [&](void* dst, const void* src, size_t bytes) {
      return q.on_device ? staging.UploadFromDevice(dst, src, bytes)
                         : staging.Upload(dst, src, bytes);
    };
    DI_RETURN_IF_ERROR(
        upload(q_raw, static_cast<const uint8_t*>(q.q) + range.start * hd * eb, n * hd * eb));
    DI_RETURN_IF_ERROR(
        upload(w_raw, q.weights + int64_t{range.start} * H, int64_t{n} * H * sizeof(float)));
    if (q.on_device) {
      DI_RETURN_IF_ERROR(CheckDeviceInputs(rank, {q_raw, int64_t{n} * hd, q.type, kQBit}, {},
                                           {w_raw, int64_t{n} * H, ElemType::kF32, kWeightsBit}));
    }
    prep.num_rows = n;
    prep.num_heads = H;
    prep.head_dim = D;
    prep.q_type = q.type;
    prep.q = q_raw;
    prep.weights_raw = w_raw;
    if (q.positions != nullptr) {
      DI_RETURN_IF_ERROR(staging.Upload(b.positions + range.start, q.positions + range.start,
                                        n * sizeof(int64_t)));
      prep.positions = b.positions + range.start;
    }
    prep.rope = plan.rope;
    prep.rope.inv_freq = b.inv_freq;
    prep.hadamard = plan.hadamard;
    prep.format = format;
    prep.q_codes = q_codes;
    prep.q_scales = q_scales;
    prep.weights_out = weights;
  } else {
    // From a page-locked client region, straight to the device; else through the staging.
    // From the client's device buffer, device to device.
    auto upload = [&](void* dst, const void* src, size_t bytes) {
      if (q.on_device) return staging.UploadFromDevice(dst, src, bytes);
      return plan.q_page_locked ? staging.UploadPageLocked(dst, src, bytes)
                                : staging.Upload(dst, src, bytes);
    };
    DI_RETURN_IF_ERROR(upload(q_codes, static_cast<const uint8_t*>(q.q) + range.start * code_bytes,
                              n * code_bytes));
    if (format == CacheFormat::kFp4) {
      DI_RETURN_IF_ERROR(upload(q_scales, q.scales + range.start * scale_bytes, n * scale_bytes));
    }
    DI_RETURN_IF_ERROR(
        upload(weights, q.weights + int64_t{range.start} * H, int64_t{n} * H * sizeof(float)));
    if (q.on_device) {
      const bool fp4 = format == CacheFormat::kFp4;
      // FP4 codes are all finite; their UE8M0 scales are not.
      DI_RETURN_IF_ERROR(CheckDeviceInputs(
          rank, {fp4 ? nullptr : q_codes, fp4 ? 0 : int64_t{n} * hd, q.type, kQBit},
          {fp4 ? q_scales : nullptr, fp4 ? int64_t{n} * scale_bytes : 0, ElemType::kUE8M0,
           kQScalesBit},
          {weights, int64_t{n} * H, ElemType::kF32, kWeightsBit}));
    }
  }
  QRows out;
  out.unquantized = unquantized;
  out.prep = prep;
  out.view.codes = q_codes;
  out.view.scales = format == CacheFormat::kFp4 ? q_scales : nullptr;
  out.view.weights = weights;
  out.view.num_heads = H;
  return out;
}

}  // namespace decode_indexer::exec
