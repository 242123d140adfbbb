// A rank's step I/O: the host staging its uploads go through (Staging), the device-to-host
// copies of its answer rows (Readback), the uploads of a step's inputs: the row tables,
// the resident page tables' edits, the requests' slots (UploadStepRows) and q of the rank's
// rows (UploadQ), and the device-side value checks of device-resident inputs (DeviceChecks:
// q, its scales and weights, new keys and their scales).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/device.h"
#include "decode_indexer/kernels/indexer_ops.h"
#include "server/exec/bulk_copy.h"
#include "server/exec/page_table_mirror.h"
#include "server/exec/rank.h"
#include "server/exec/row_shard.h"
#include "server/exec/step_types.h"

namespace decode_indexer::exec {

// Host staging for one step's uploads (the rank's HostArena, page-locked on a GPU backend
// unless pinned staging is off). Upload copies the bytes into the arena first, so the device
// copy is a true asynchronous DMA that never waits for the stream; with a plain arena it
// copies straight from the source, as before. Reserve hands out arena space; when a step has
// used it all (only a step with more keys than one staging chunk) it waits for the copies
// queued so far, which read the arena, before reusing it. Every step starts with an empty
// arena: the previous one ended in a Synchronize.
class Staging {
 public:
  explicit Staging(Rank& rank) : be_(rank.device()), arena_(rank.host_arena()) { arena_.used = 0; }

  absl::StatusOr<uint8_t*> Reserve(size_t bytes) {
    const size_t aligned = (bytes + 63) / 64 * 64;
    if (aligned > arena_.capacity) {
      return absl::InternalError(absl::StrCat("host staging of ", bytes, " bytes exceeds the ",
                                              arena_.capacity, "-byte arena"));
    }
    if (arena_.used + aligned > arena_.capacity) {
      if (absl::Status s = be_.Synchronize(); !s.ok()) return s;
      arena_.used = 0;
    }
    uint8_t* p = arena_.base + arena_.used;
    arena_.used += aligned;
    return p;
  }

  absl::Status Upload(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (!arena_.pinned) return be_.CopyToDevice(dst, src, bytes);
    return UploadStaged(dst, src, bytes);
  }
  // From device memory (QInput::on_device, KeysInput::on_device): a copy on the device.
  absl::Status UploadFromDevice(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return be_.CopyDeviceToDevice(dst, src, bytes);
  }
  // Upload from memory that is page-locked already (StepInput::host_memory_page_locked):
  // a direct DMA, no staging copy.
  absl::Status UploadPageLocked(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return be_.CopyToDevice(dst, src, bytes);
  }

 private:
  absl::Status UploadStaged(void* dst, const void* src, size_t bytes) {
    absl::StatusOr<uint8_t*> host = Reserve(bytes);
    if (!host.ok()) return host.status();
    BulkCopy(*host, src, bytes);
    return be_.CopyToDevice(dst, *host, bytes);
  }

  kernels::Device& be_;
  HostArena& arena_;
};

// The step's device-to-host answer copies. To pageable memory (a gRPC response) the driver
// bounces a copy through its own buffer in pieces, each waiting for the stream; so the copy
// lands in the rank's page-locked readback space (one DMA) and Finish, after the step's
// Synchronize, moves it on with a memcpy (each rank its own rows, in parallel). Page-locked
// destinations, and ranks without readback space, copy directly. Deferred answers (the
// executor's own vectors: StepPlan::defer_topk / defer_candidates) stay in the readback space
// and Finish hands them to the executor (Rank::StepRecord::readback).
class Readback {
 public:
  enum class Answer { kTopK, kCandidates };

  Readback(Rank& rank, const StepPlan& plan)
      : rank_(rank), be_(rank.device()), space_(rank.readback()), plan_(plan) {
    space_.used = 0;
    rank_.step_record().readback.clear();
  }

  // `bytes` of answer `which` from element `elem_offset` on.
  absl::Status Copy(Answer which, int64_t elem_offset, const int32_t* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    const bool candidates = which == Answer::kCandidates;
    const bool defer = candidates ? plan_.defer_candidates : plan_.defer_topk;
    int32_t* dst = defer ? nullptr : (candidates ? plan_.candidates_out : plan_.topk_out);
    const size_t aligned = (bytes + 63) / 64 * 64;
    const bool fits = space_.pinned && space_.used + aligned <= space_.capacity;
    const bool page_locked = candidates ? plan_.candidates_page_locked : plan_.topk_page_locked;
    if (!defer && (page_locked || !fits)) {
      return be_.CopyToHost(dst + elem_offset, src, bytes);
    }
    if (!fits) {  // the executor defers only where every rank has room for every row
      return absl::InternalError("a deferred answer does not fit the readback space");
    }
    uint8_t* landing = space_.base + space_.used;
    space_.used += aligned;
    if (absl::Status s = be_.CopyToHost(landing, src, bytes); !s.ok()) return s;
    pending_.push_back({candidates, elem_offset, dst == nullptr ? nullptr : dst + elem_offset,
                        reinterpret_cast<const int32_t*>(landing), bytes});
    return absl::OkStatus();
  }

  // After the Synchronize that completed the copies.
  void Finish() {
    for (const Pending& p : pending_) {
      if (p.dst != nullptr) {
        BulkCopy(p.dst, p.landing, p.bytes);
      } else {
        rank_.step_record().readback.push_back(
            {p.candidates, p.elem_offset, p.landing, p.bytes / sizeof(int32_t)});
      }
    }
    pending_.clear();
  }

 private:
  struct Pending {
    bool candidates;
    int64_t elem_offset;
    int32_t* dst;  // null: deferred
    const int32_t* landing;
    size_t bytes;
  };
  Rank& rank_;
  kernels::Device& be_;
  HostArena& space_;
  const StepPlan& plan_;
  std::vector<Pending> pending_;
};

// One run of the step's new keys of one type (at most a key chunk), gathered into staging:
// its slots, values and scales (KeyRunLayout) and the InsertKeys call that reads them.
struct KeyRun {
  kernels::ElemType type = kernels::ElemType::kF32;
  int32_t count = 0;
  size_t first_write = 0;  // the run's first keys: write `first_write` from key `first_key`
  int32_t first_key = 0;
  size_t slots_offset = 0;  // in the run's staging: int64 slots, then values, then scales
  size_t keys_offset = 0;
  size_t scales_offset = 0;
  size_t bytes = 0;
  bool has_scales = false;
  // The run's keys and scales lie in device memory (KeyWrite::on_device): only its slots
  // are gathered on the host; the values are copied device to device (CopyKeyRunOnDevice).
  bool on_device = false;
};
// The step's key writes cut into runs (a change of key type or of where the keys lie, or a
// full chunk ends one), as InsertStepKeys inserts them.
std::vector<KeyRun> KeyRuns(const std::vector<KeyWrite>& writes, int32_t head_dim,
                            int32_t key_chunk);
// Copies run `run`'s keys, scales and slots into `base` at the run's offsets; of a run in
// device memory, only its slots.
void GatherKeyRun(const std::vector<KeyWrite>& writes, const KeyRun& run, int32_t head_dim,
                  uint8_t* base);
// A device run's keys and scales, device to device into `keys` / `scales` (the rank's key
// staging): one copy each for the writes whose sources follow one another (the columnar
// form's one tensor), in stream order.
absl::Status CopyKeyRunOnDevice(Staging& staging, const std::vector<KeyWrite>& writes,
                                const KeyRun& run, int32_t head_dim, uint8_t* keys,
                                uint8_t* scales);

// The value checks of a step's device-resident inputs on one rank (IndexerOps::CheckValues on
// what the kernels read: the rank's staged copies, or q read in place in the client's buffer):
// the keys' queued with Add and launched with Flush, as few launches as the staging allows (a
// key run's copies are checked before the next run overwrites them; the last run's are flushed
// before the kernel section). q's own checks are launched in the kernel section (QRows::checks,
// readied by ForSection), so that a replayed graph makes them with the scoring. The rank's
// flag words are mapped host memory: the host clears them before the step's first launch
// (Rank::ClearValueFlags), every launch adds to them, and DeviceInputsStatus reads their mask
// after the step's Synchronize, with no copy.
class DeviceChecks {
 public:
  // Flag bits, in the order the edge checks host bytes (the keys before q): the first set
  // one names the field.
  static constexpr uint32_t kNewKeys = 1, kNewKeyScales = 2, kQ = 4, kQScales = 8, kWeights = 16;

  explicit DeviceChecks(Rank& rank) : rank_(rank) {}
  // Whether a check has anything to check (data, a count, a type with NaN codes).
  static bool Checkable(const kernels::ValueCheck& check);
  // Queues a check (none for an empty tensor or a type with nothing to check).
  absl::Status Add(const kernels::ValueCheck& check);
  bool pending() const { return args_.num_checks > 0; }
  absl::Status Flush();
  // Readies `args` (checks the caller launches itself: q's, in the kernel section) as the
  // step's next launch: the rank's flag words (accumulate, a field of the kernel section's
  // StepShape, is always true: the host cleared them); counts it as launched. Nothing for no
  // checks. Call with nothing queued (after Flush).
  absl::Status ForSection(kernels::ValueCheckArgs& args);
  // Whether any check was launched this step (the flag words then hold the step's result).
  bool issued() const { return launched_ > 0; }

 private:
  absl::Status BeginLaunch(kernels::ValueCheckArgs& args);
  Rank& rank_;
  kernels::ValueCheckArgs args_;
  int32_t launched_ = 0;
};

// Where a step's small arrays lie on the device for its kernels: in a slot of the rank's
// staging ring, all uploaded with one copy by PackStepUploads, or (a null pointer, or a
// false flag) in the rank's own buffers, uploaded one array at a time as before.
//
// Packed, in this order, each 64-byte aligned: row_request, row_length, request_slot (every
// step); the rank's rows' positions (unquantized q with positions); the rank's rows' weights,
// and an FP4 q's scales, where they go through the host staging anyway (not a device-resident
// q, and for quantized q not a page-locked one: that is a direct DMA already, and packing it
// would add a host copy); the candidate store rows (a source or consumer); then, if they fit
// the slot, the step's new keys (all of their runs) behind a fixed area of kSectionEdits
// page-table edits, and the edits (pending, then the step's own) where that area does not
// hold them. Not packed: q itself (large, and often device-resident or page-locked), and an
// unquantized q's weights from the device. The fields the kernel section reads come first,
// so their offsets depend only on the step's shape (StepShape: rows, requests, range, q form,
// staged_q, the key runs) and the slot.
//
// A step whose keys are packed inserts them in its kernel section (InsertPackedKeys): one
// InsertKeys launch that also makes the step's page-table edits when, merged (pending, then
// the step's own; the last edit of an index wins), they fit the fixed area, padded with
// "no edit" entries so that the launch is the same whatever the count (a graph replays it).
// Other edits are made before the section, as a step without packed keys makes them.
inline constexpr int32_t kSectionEdits = 64;
struct StepUploads {
  int32_t slot = -1;  // the ring slot, -1: nothing packed
  // Always set: in the slot, or the rank's own buffers (slot -1).
  int32_t* row_request = nullptr;
  int32_t* row_length = nullptr;
  int32_t* request_slot = nullptr;
  int64_t* positions = nullptr;    // the rank's rows' (index 0: the range's first row)
  float* weights = nullptr;        // the rank's rows' weights (unquantized q: the raw ones)
  uint8_t* q_scales = nullptr;     // FP4 q's scales of the rank's rows
  int32_t* store_index = nullptr;  // the rank's own buffer unless store_packed
  bool store_packed = false;
  bool edits = false;  // the four below hold the edits
  int32_t* pending_index = nullptr;
  int32_t* pending_pages = nullptr;
  int32_t* edit_index = nullptr;
  int32_t* edit_pages = nullptr;
  bool keys = false;  // every run of the step's keys lies at slot + its offsets
  uint8_t* key_base = nullptr;
  std::vector<KeyRun> key_runs;
  // With packed keys: the fixed area of kSectionEdits edits (index -1: none), and whether it
  // holds the step's edits (else they are made before the section and the area is padding).
  int32_t* section_edit_index = nullptr;
  int32_t* section_edit_pages = nullptr;
  bool section_edits = false;
  // Whether the rank's rows' weights (and FP4 q scales) are packed (StepShape::staged_q).
  bool staged_q() const { return weights != nullptr; }
};

// Lays out the step's small arrays in the lowest free slot of the rank's staging ring (none
// free: synchronizes first), packs them into the host staging and uploads them with one
// copy. With no ring (ExecutorOptions::packed_uploads off) it packs nothing.
absl::StatusOr<StepUploads> PackStepUploads(Rank& rank, Staging& staging, const StepPlan& plan,
                                            RowRange range);

// The step's row tables (row_request, row_length), the pool's resident page-table edits (those
// recorded since a job last applied them, then the step's own; unless packed.section_edits: the
// kernel section makes them) and the requests' sequence slots: from the ring slot where
// packed, else uploaded into the rank's buffers. Every rank keeps every pool's resident table
// in step, whatever rows it scores.
absl::Status UploadStepRows(Rank& rank, Staging& staging, const StepPlan& plan,
                            const StepUploads& packed);

// q of the rank's rows [range), uploaded at the rows' own offsets in the rank's buffers (the
// weights, positions and scales that `packed` holds read from the slot): what the kernel
// section reads (view), and for unquantized q (f32 / bf16) the rope_quant_q call that RoPEs,
// quantizes and folds it there (prep).
//
// Device-resident q (QInput::on_device): quantized q (FP8, or FP4 with its scales) on the
// answering rank, whose device holds the client's buffer, is read in place: the view points
// at the rank's rows in that buffer and nothing is copied (unless a pointer is less aligned
// than the kernels' loads need: kInPlaceCodesAlign and kInPlaceWordAlign below; then it is
// copied device to device as on the other ranks, and as unquantized q always is). Its checks
// on the device (q or its FP4 scales, and the weights; of what the kernels read) are returned
// in `checks`, for the kernel section to launch (DeviceChecks::ForSection readies them).
struct QRows {
  bool unquantized = false;  // rope_quant_q runs first
  kernels::QPrepArgs prep;
  kernels::QView view;
  // view's codes, scales and weights lie in the client's buffer (no copy): their addresses
  // key the kernel section's graph (StepShape::q_codes, ...), a replay reading what it captured.
  bool in_place = false;
  kernels::ValueCheckArgs checks;  // num_checks 0: none (host q)
};
// The alignment q read in place needs: the codes' (16-byte vector loads) and the weights' and
// FP4 scales' (loaded as words or bytes; one word asked, as the edge asks of the weights).
inline constexpr uintptr_t kInPlaceCodesAlign = 16;
inline constexpr uintptr_t kInPlaceWordAlign = 4;
absl::StatusOr<QRows> UploadQ(Rank& rank, Staging& staging, const StepPlan& plan, RowRange range,
                              const StepUploads& packed);

// The device checks' flags (DeviceChecks; the mask of their words, kernels::ValueFlagsMask) as
// the step's status: INVALID_ARGUMENT naming the field at fault, or OK.
absl::Status DeviceInputsStatus(uint32_t flags);

}  // namespace decode_indexer::exec
