#include "server/exec/step_io.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/exec/insert_keys.h"

namespace decode_indexer::exec {
namespace {

using kernels::CacheFormat;
using kernels::ElemType;

int64_t InputElemBytes(ElemType type) { return type == ElemType::kBF16 ? 2 : 4; }

// Sets the entries of `edits` in `pool`'s resident table (page_table_mirror.h), in stream order
// before whatever the rank issues next: one scatter per chunk of the rank's edit buffers. With
// `index` and `pages` (the edits already in a ring slot, PackStepUploads) the scatters read
// them there, chunk by chunk as well; else each chunk is uploaded into the edit buffers first.
absl::Status ApplyTableEdits(Rank& rank, Staging& staging, int32_t pool, const TableEdits& edits,
                             const int32_t* index, const int32_t* pages) {
  RankBuffers& b = rank.buffers();
  const size_t chunk = static_cast<size_t>(rank.sizes().table_edit_chunk);
  for (size_t done = 0; done < edits.size(); done += chunk) {
    const int32_t n = static_cast<int32_t>(std::min(chunk, edits.size() - done));
    kernels::CopyRowsArgs scatter;
    scatter.num_rows = n;
    scatter.row_elems = 1;
    scatter.dst = b.page_tables[pool];
    if (index != nullptr) {
      scatter.dst_index = index + done;
      scatter.src = pages + done;
    } else {
      // The previous chunk's scatter read these buffers; the uploads follow it on the stream.
      DI_RETURN_IF_ERROR(
          staging.Upload(b.edit_index, edits.index.data() + done, size_t(n) * sizeof(int32_t)));
      DI_RETURN_IF_ERROR(
          staging.Upload(b.edit_pages, edits.page.data() + done, size_t(n) * sizeof(int32_t)));
      scatter.dst_index = b.edit_index;
      scatter.src = b.edit_pages;
    }
    DI_RETURN_IF_ERROR(rank.ops().CopyRows(scatter));
  }
  return absl::OkStatus();
}

constexpr size_t Align64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// The section's edit area (kSectionEdits entries): the pending edits, then the step's own,
// one entry per index (a later edit of an index overwrites the earlier's page), the rest
// "no edit" (-1); all padding when `fill` is false.
void FillSectionEdits(const TableEdits& pending, const TableEdits& own, bool fill, int32_t* index,
                      int32_t* pages) {
  std::fill(index, index + kSectionEdits, -1);
  std::fill(pages, pages + kSectionEdits, 0);
  if (!fill) return;
  int32_t n = 0;
  for (const TableEdits* edits : {&pending, &own}) {
    for (size_t i = 0; i < edits->size(); ++i) {
      const int32_t at = edits->index[i];
      int32_t k = 0;
      while (k < n && index[k] != at) ++k;
      if (k == n) index[n++] = at;
      pages[k] = edits->page[i];
    }
  }
}

}  // namespace

bool DeviceChecks::Checkable(const kernels::ValueCheck& check) {
  return check.data != nullptr && check.count > 0 && kernels::CheckedElemBytes(check.type) > 0;
}

absl::Status DeviceChecks::Add(const kernels::ValueCheck& check) {
  if (!Checkable(check)) return absl::OkStatus();
  if (args_.num_checks == kernels::ValueCheckArgs::kMaxChecks) DI_RETURN_IF_ERROR(Flush());
  args_.checks[args_.num_checks++] = check;
  return absl::OkStatus();
}

absl::Status DeviceChecks::BeginLaunch(kernels::ValueCheckArgs& args) {
  // The host clears the words before the step's first check (no memset on the stream): every
  // launch then adds to them.
  if (launched_ == 0) DI_RETURN_IF_ERROR(rank_.ClearValueFlags());
  args.flags = rank_.buffers().value_flags;
  args.accumulate = true;
  ++launched_;
  rank_.ChecksLaunched();
  return absl::OkStatus();
}

absl::Status DeviceChecks::Flush() {
  if (args_.num_checks == 0) return absl::OkStatus();
  absl::Status s = BeginLaunch(args_);
  if (s.ok()) s = rank_.ops().CheckValues(args_);
  args_.num_checks = 0;
  return s;
}

absl::Status DeviceChecks::ForSection(kernels::ValueCheckArgs& args) {
  if (args.num_checks == 0) return absl::OkStatus();
  if (pending()) return absl::InternalError("device checks still queued before the kernel section");
  return BeginLaunch(args);
}

absl::Status DeviceInputsStatus(uint32_t flags) {
  if (flags == 0) return absl::OkStatus();
  using C = DeviceChecks;
  const char* field = (flags & C::kNewKeys)        ? "new_keys.data"
                      : (flags & C::kNewKeyScales) ? "new_key_scales.data"
                      : (flags & C::kQ)            ? "q.data"
                      : (flags & C::kQScales)      ? "q_scales.data"
                                                   : "weights.data";
  const char* what = (flags & C::kNewKeys) ? "a NaN code (FP8 S.1111.111)"
                     : (flags & C::kNewKeyScales)
                         ? "a NaN, Inf or non-positive scale (fp32; UE8M0: the NaN scale 0xFF)"
                         : "NaN or Inf (FP8: a NaN code; UE8M0: 0xFF)";
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", what,
      " in the device buffer, found by the check on the device; the step committed nothing"));
}

std::vector<KeyRun> KeyRuns(const std::vector<KeyWrite>& writes, int32_t head_dim,
                            int32_t key_chunk) {
  std::vector<KeyRun> runs;
  size_t wi = 0;       // the write being gathered
  int32_t offset = 0;  // its keys gathered so far
  while (wi < writes.size()) {
    const ElemType type = writes[wi].type;
    const bool on_device = writes[wi].on_device;
    const int64_t vb = KeyValueBytes(type, head_dim);
    const int64_t sb = KeyScaleBytes(type, head_dim);
    int32_t total = 0;
    for (size_t j = wi, o = offset; j < writes.size() && writes[j].type == type &&
                                    writes[j].on_device == on_device && total < key_chunk;
         ++j, o = 0) {
      total += std::min<int32_t>(writes[j].count - static_cast<int32_t>(o), key_chunk - total);
    }
    if (total == 0) {  // only empty writes left in this run
      ++wi;
      offset = 0;
      continue;
    }
    KeyRun run;
    run.type = type;
    run.count = total;
    run.first_write = wi;
    run.first_key = offset;
    run.has_scales = sb > 0;
    run.on_device = on_device;
    // Slots, then values, then scales, each 64-byte aligned (the kernels read them in place
    // in a ring slot): one reservation for the three.
    run.slots_offset = 0;
    run.keys_offset = Align64(size_t(total) * sizeof(int64_t));
    run.scales_offset = run.keys_offset + Align64(size_t(total) * vb);
    run.bytes = run.scales_offset + size_t(total) * std::max<int64_t>(sb, 1);
    for (int32_t filled = 0; filled < total;) {
      const int32_t c = std::min(writes[wi].count - offset, total - filled);
      filled += c;
      offset += c;
      if (offset == writes[wi].count) {
        ++wi;
        offset = 0;
      }
    }
    runs.push_back(run);
  }
  return runs;
}

void GatherKeyRun(const std::vector<KeyWrite>& writes, const KeyRun& run, int32_t head_dim,
                  uint8_t* base) {
  const int64_t vb = KeyValueBytes(run.type, head_dim);
  const int64_t sb = KeyScaleBytes(run.type, head_dim);
  uint8_t* const slots = base + run.slots_offset;
  uint8_t* const keys = base + run.keys_offset;
  uint8_t* const scales = base + run.scales_offset;
  size_t wi = run.first_write;
  int32_t offset = run.first_key;
  for (int32_t filled = 0; filled < run.count;) {
    const KeyWrite& w = writes[wi];
    const int32_t c = std::min(w.count - offset, run.count - filled);
    // Device keys are never read on the host (CopyKeyRunOnDevice copies them).
    if (!run.on_device) {
      std::memcpy(keys + size_t(filled) * vb, static_cast<const uint8_t*>(w.keys) + offset * vb,
                  size_t(c) * vb);
    }
    if (sb > 0 && !run.on_device) {
      std::memcpy(scales + size_t(filled) * sb, static_cast<const uint8_t*>(w.scales) + offset * sb,
                  size_t(c) * sb);
    }
    std::memcpy(slots + size_t(filled) * sizeof(int64_t), w.slots + offset,
                size_t(c) * sizeof(int64_t));
    filled += c;
    offset += c;
    if (offset == w.count) {
      ++wi;
      offset = 0;
    }
  }
}

absl::Status CopyKeyRunOnDevice(Staging& staging, const std::vector<KeyWrite>& writes,
                                const KeyRun& run, int32_t head_dim, uint8_t* keys,
                                uint8_t* scales) {
  const int64_t vb = KeyValueBytes(run.type, head_dim);
  const int64_t sb = KeyScaleBytes(run.type, head_dim);
  // The pending copy: `count` keys from `src_keys` / `src_scales` to key `at` of the staging.
  const uint8_t* src_keys = nullptr;
  const uint8_t* src_scales = nullptr;
  int32_t at = 0;
  int32_t count = 0;
  auto flush = [&]() -> absl::Status {
    if (count == 0) return absl::OkStatus();
    DI_RETURN_IF_ERROR(
        staging.UploadFromDevice(keys + size_t(at) * vb, src_keys, size_t(count) * vb));
    if (sb > 0) {
      DI_RETURN_IF_ERROR(
          staging.UploadFromDevice(scales + size_t(at) * sb, src_scales, size_t(count) * sb));
    }
    return absl::OkStatus();
  };
  size_t wi = run.first_write;
  int32_t offset = run.first_key;
  for (int32_t filled = 0; filled < run.count;) {
    const KeyWrite& w = writes[wi];
    const int32_t c = std::min(w.count - offset, run.count - filled);
    const uint8_t* k = static_cast<const uint8_t*>(w.keys) + offset * vb;
    const uint8_t* sc = sb > 0 ? static_cast<const uint8_t*>(w.scales) + offset * sb : nullptr;
    const bool follows = count > 0 && k == src_keys + size_t(count) * vb &&
                         (sb == 0 || sc == src_scales + size_t(count) * sb);
    if (follows) {
      count += c;
    } else {
      DI_RETURN_IF_ERROR(flush());
      src_keys = k;
      src_scales = sc;
      at = filled;
      count = c;
    }
    filled += c;
    offset += c;
    if (offset == w.count) {
      ++wi;
      offset = 0;
    }
  }
  return flush();
}

absl::StatusOr<StepUploads> PackStepUploads(Rank& rank, Staging& staging, const StepPlan& plan,
                                            RowRange range) {
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  StepUploads up;
  // Today's buffers unless packed below.
  up.row_request = b.row_request;
  up.row_length = b.row_length;
  up.request_slot = b.request_slot;
  up.store_index = b.store_index;
  StagingRing& ring = rank.staging_ring();
  if (ring.slots() == 0) return up;
  int32_t slot = 0;
  while (slot < ring.slots() && ring.busy[size_t(slot)]) ++slot;
  if (slot == ring.slots()) {  // every slot may still be read: wait for the stream
    DI_RETURN_IF_ERROR(rank.device().Synchronize());
    ring.Settle();
    slot = 0;
  }

  // The layout: (offset, source, bytes) per array, 64-byte aligned, in the order above.
  struct Piece {
    size_t offset;
    const void* src;
    size_t bytes;
  };
  std::array<Piece, 12> pieces;
  size_t num_pieces = 0;
  size_t used = 0;
  auto place = [&](const void* src, size_t bytes) {
    pieces[num_pieces++] = {used, src, bytes};
    const size_t at = used;
    used += Align64(bytes);
    return at;
  };
  const QInput& q = plan.q;
  const int32_t H = s.num_heads;
  const int64_t hd = int64_t{H} * s.head_dim;
  const int32_t n = range.end - range.start;
  const bool unquantized = q.type == ElemType::kF32 || q.type == ElemType::kBF16;
  const bool fp4 = b.caches[plan.pool].geometry.format == CacheFormat::kFp4;
  const size_t rows_bytes = size_t(plan.num_rows) * sizeof(int32_t);
  const size_t at_request = place(plan.row_request.data(), rows_bytes);
  const size_t at_length = place(plan.row_length.data(), rows_bytes);
  const size_t at_slot =
      place(plan.request_slot.data(), size_t(plan.num_requests) * sizeof(int32_t));
  size_t at_positions = 0, at_weights = 0, at_scales = 0, at_store = 0;
  const bool positions = unquantized && q.positions != nullptr;
  if (positions) at_positions = place(q.positions + range.start, size_t(n) * sizeof(int64_t));
  const bool staged_q = !q.on_device && (unquantized || !plan.q_page_locked);
  if (staged_q) {
    at_weights = place(q.weights + int64_t{range.start} * H, size_t(n) * H * sizeof(float));
    if (!unquantized && fp4) {
      at_scales = place(q.scales + range.start * (hd / 32), size_t(n) * (hd / 32));
    }
  }
  const bool store =
      plan.role != config::LayerRole::kDense && plan.store_rows.size() >= size_t(plan.num_rows);
  if (store) at_store = place(plan.store_rows.data(), rows_bytes);
  if (used > ring.slot_bytes) return up;  // not within the limits the slot was sized for
  // The keys, all of their runs, behind the section's edit area, if they fit (and none lies
  // in device memory: the host cannot pack those; InsertStepKeys copies them device to
  // device).
  std::vector<KeyRun> runs = KeyRuns(plan.key_writes, s.head_dim, s.key_chunk);
  size_t key_bytes = 0;
  for (const KeyRun& r : runs) key_bytes += Align64(r.bytes);
  constexpr size_t kEditArea = Align64(kSectionEdits * sizeof(int32_t));
  const bool keys =
      !runs.empty() && !plan.keys_on_device && used + 2 * kEditArea + key_bytes <= ring.slot_bytes;
  const size_t at_section_edits = used;
  if (keys) used += 2 * kEditArea;
  const size_t at_keys = used;
  if (keys) used += key_bytes;
  // The edits: in the section's area if they fit it, else packed here if they fit the slot.
  static const TableEdits kNoEdits;
  const TableEdits& pending = plan.pending_edits != nullptr ? *plan.pending_edits : kNoEdits;
  const bool section_edits =
      keys && pending.size() + plan.table_edits.size() <= size_t{kSectionEdits};
  const size_t pending_bytes = pending.size() * sizeof(int32_t);
  const size_t own_bytes = plan.table_edits.size() * sizeof(int32_t);
  size_t at_edits[4] = {0, 0, 0, 0};
  const bool edits = !section_edits &&
                     used + 2 * Align64(pending_bytes) + 2 * Align64(own_bytes) <= ring.slot_bytes;
  if (edits) {
    at_edits[0] = place(pending.index.data(), pending_bytes);
    at_edits[1] = place(pending.page.data(), pending_bytes);
    at_edits[2] = place(plan.table_edits.index.data(), own_bytes);
    at_edits[3] = place(plan.table_edits.page.data(), own_bytes);
  }

  // Pack on the host side of the slot and upload it with one copy.
  uint8_t* const host = ring.host_slot(slot);
  uint8_t* const device = ring.slot(slot);
  for (size_t i = 0; i < num_pieces; ++i) {
    if (pieces[i].bytes > 0) std::memcpy(host + pieces[i].offset, pieces[i].src, pieces[i].bytes);
  }
  if (keys) {
    FillSectionEdits(pending, plan.table_edits, section_edits,
                     reinterpret_cast<int32_t*>(host + at_section_edits),
                     reinterpret_cast<int32_t*>(host + at_section_edits + kEditArea));
    size_t at = at_keys;
    for (KeyRun& r : runs) {
      GatherKeyRun(plan.key_writes, r, s.head_dim, host + at);
      r.slots_offset += at - at_keys;
      r.keys_offset += at - at_keys;
      r.scales_offset += at - at_keys;
      at += Align64(r.bytes);
    }
  }
  ring.busy[size_t(slot)] = true;
  DI_RETURN_IF_ERROR(staging.UploadPageLocked(device, host, used));

  up.slot = slot;
  up.row_request = reinterpret_cast<int32_t*>(device + at_request);
  up.row_length = reinterpret_cast<int32_t*>(device + at_length);
  up.request_slot = reinterpret_cast<int32_t*>(device + at_slot);
  if (positions) up.positions = reinterpret_cast<int64_t*>(device + at_positions);
  if (staged_q) {
    up.weights = reinterpret_cast<float*>(device + at_weights);
    if (!unquantized && fp4) up.q_scales = device + at_scales;
  }
  if (store) {
    up.store_index = reinterpret_cast<int32_t*>(device + at_store);
    up.store_packed = true;
  }
  if (edits) {
    up.edits = true;
    up.pending_index = reinterpret_cast<int32_t*>(device + at_edits[0]);
    up.pending_pages = reinterpret_cast<int32_t*>(device + at_edits[1]);
    up.edit_index = reinterpret_cast<int32_t*>(device + at_edits[2]);
    up.edit_pages = reinterpret_cast<int32_t*>(device + at_edits[3]);
  }
  if (keys) {
    up.keys = true;
    up.key_base = device + at_keys;
    up.key_runs = std::move(runs);
    up.section_edit_index = reinterpret_cast<int32_t*>(device + at_section_edits);
    up.section_edit_pages = reinterpret_cast<int32_t*>(device + at_section_edits + kEditArea);
    up.section_edits = section_edits;
  }
  return up;
}

absl::Status UploadStepRows(Rank& rank, Staging& staging, const StepPlan& plan,
                            const StepUploads& packed) {
  RankBuffers& b = rank.buffers();
  if (packed.slot < 0) {
    DI_RETURN_IF_ERROR(
        staging.Upload(b.row_request, plan.row_request.data(), plan.num_rows * sizeof(int32_t)));
    DI_RETURN_IF_ERROR(
        staging.Upload(b.row_length, plan.row_length.data(), plan.num_rows * sizeof(int32_t)));
  }
  // The edits, unless the kernel section's InsertKeys makes them (InsertPackedKeys).
  if (!packed.section_edits) {
    if (plan.pending_edits != nullptr) {
      DI_RETURN_IF_ERROR(ApplyTableEdits(rank, staging, plan.pool, *plan.pending_edits,
                                         packed.edits ? packed.pending_index : nullptr,
                                         packed.pending_pages));
    }
    DI_RETURN_IF_ERROR(ApplyTableEdits(rank, staging, plan.pool, plan.table_edits,
                                       packed.edits ? packed.edit_index : nullptr,
                                       packed.edit_pages));
  }
  if (packed.slot >= 0) return absl::OkStatus();
  return staging.Upload(b.request_slot, plan.request_slot.data(),
                        plan.num_requests * sizeof(int32_t));
}

absl::StatusOr<QRows> UploadQ(Rank& rank, Staging& staging, const StepPlan& plan, RowRange range,
                              const StepUploads& packed) {
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
  uint8_t* q_scales =
      packed.q_scales != nullptr ? packed.q_scales : b.q_scales + range.start * scale_bytes;
  float* weights = b.weights + int64_t{range.start} * H;
  // What the kernel section reads: the staging above, unless read elsewhere (a ring slot, or
  // in place).
  const uint8_t* view_codes = q_codes;
  const uint8_t* view_scales = q_scales;
  const float* view_weights = weights;
  const QInput& q = plan.q;
  const bool unquantized = q.type == ElemType::kF32 || q.type == ElemType::kBF16;
  QRows out;
  // q's checks on the device, launched in the kernel section (none unless q is on the device).
  auto check = [&out](const kernels::ValueCheck& c) {
    if (DeviceChecks::Checkable(c)) out.checks.checks[out.checks.num_checks++] = c;
  };
  kernels::QPrepArgs prep;
  if (unquantized) {
    const int64_t eb = InputElemBytes(q.type);
    uint8_t* q_raw = b.q_raw + range.start * hd * eb;
    float* w_raw =
        packed.weights != nullptr ? packed.weights : b.weights_raw + int64_t{range.start} * H;
    auto upload = [&](void* dst, const void* src, size_t bytes) {
      return q.on_device ? staging.UploadFromDevice(dst, src, bytes)
                         : staging.Upload(dst, src, bytes);
    };
    DI_RETURN_IF_ERROR(
        upload(q_raw, static_cast<const uint8_t*>(q.q) + range.start * hd * eb, n * hd * eb));
    if (packed.weights == nullptr) {
      DI_RETURN_IF_ERROR(
          upload(w_raw, q.weights + int64_t{range.start} * H, int64_t{n} * H * sizeof(float)));
    }
    if (q.on_device) {
      check({q_raw, int64_t{n} * hd, q.type, DeviceChecks::kQ});
      check({w_raw, int64_t{n} * H, ElemType::kF32, DeviceChecks::kWeights});
    }
    prep.num_rows = n;
    prep.num_heads = H;
    prep.head_dim = D;
    prep.q_type = q.type;
    prep.q = q_raw;
    prep.weights_raw = w_raw;
    if (packed.positions != nullptr) {
      prep.positions = packed.positions;
    } else if (q.positions != nullptr) {
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
    const bool fp4 = format == CacheFormat::kFp4;
    // The rank's rows in the client's buffer.
    const uint8_t* src_codes = static_cast<const uint8_t*>(q.q) + range.start * code_bytes;
    const uint8_t* src_scales = fp4 ? q.scales + range.start * scale_bytes : nullptr;
    const float* src_weights = q.weights + int64_t{range.start} * H;
    auto aligned = [](const void* p, uintptr_t to) {
      return reinterpret_cast<uintptr_t>(p) % to == 0;
    };
    // Read in place where the client's buffer lies on this rank's device (the answering
    // rank's, where the edge opened it) and every pointer is aligned for the kernels' loads.
    out.in_place = q.on_device && rank.index() == plan.answer_rank && n > 0 &&
                   aligned(src_codes, kInPlaceCodesAlign) &&
                   aligned(src_weights, kInPlaceWordAlign) &&
                   (!fp4 || aligned(src_scales, kInPlaceWordAlign));
    if (out.in_place) {
      view_codes = src_codes;
      if (fp4) view_scales = src_scales;
      view_weights = src_weights;
    } else {
      // From a page-locked client region, straight to the device; else through the staging.
      // From the client's device buffer, device to device.
      auto upload = [&](void* dst, const void* src, size_t bytes) {
        if (q.on_device) return staging.UploadFromDevice(dst, src, bytes);
        return plan.q_page_locked ? staging.UploadPageLocked(dst, src, bytes)
                                  : staging.Upload(dst, src, bytes);
      };
      DI_RETURN_IF_ERROR(upload(q_codes, src_codes, n * code_bytes));
      if (fp4 && packed.q_scales == nullptr) {
        DI_RETURN_IF_ERROR(upload(q_scales, src_scales, n * scale_bytes));
      }
      if (packed.weights != nullptr) {
        view_weights = packed.weights;
      } else {
        DI_RETURN_IF_ERROR(upload(weights, src_weights, int64_t{n} * H * sizeof(float)));
      }
    }
    if (q.on_device) {
      // What the kernels read. FP4 codes are all finite; their UE8M0 scales are not.
      if (fp4) {
        check({view_scales, int64_t{n} * scale_bytes, ElemType::kUE8M0, DeviceChecks::kQScales});
      } else {
        check({view_codes, int64_t{n} * hd, q.type, DeviceChecks::kQ});
      }
      check({view_weights, int64_t{n} * H, ElemType::kF32, DeviceChecks::kWeights});
    }
  }
  out.unquantized = unquantized;
  out.prep = prep;
  out.view.codes = view_codes;
  out.view.scales = format == CacheFormat::kFp4 ? view_scales : nullptr;
  out.view.weights = view_weights;
  out.view.num_heads = H;
  return out;
}

}  // namespace decode_indexer::exec
