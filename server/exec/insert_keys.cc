#include "server/exec/insert_keys.h"

#include <algorithm>
#include <cstring>

#include "common/status_macros.h"

namespace decode_indexer::exec {

using kernels::ElemType;

namespace {

// The insert of `count` keys of `type` staged at `keys` / `scales` / `slots` (the rank's key
// buffers, or a run in a ring slot).
kernels::KeyInsertArgs StagedKeysArgs(Rank& rank, int32_t pool, ElemType type, int32_t count,
                                      bool has_scales, bool hadamard, const void* keys,
                                      const void* scales, const int64_t* slots) {
  RankBuffers& b = rank.buffers();
  kernels::KeyInsertArgs args;
  args.cache = b.caches[pool];
  args.num_keys = count;
  args.key_type = type;
  args.keys = keys;
  args.key_scales = has_scales ? scales : nullptr;
  args.slots = slots;
  args.hadamard = hadamard;
  return args;
}

absl::Status InsertStagedKeys(Rank& rank, int32_t pool, ElemType type, int32_t count,
                              bool has_scales, bool hadamard) {
  RankBuffers& b = rank.buffers();
  return rank.ops().InsertKeys(
      StagedKeysArgs(rank, pool, type, count, has_scales, hadamard, b.keys, b.key_scales, b.slots));
}

}  // namespace

// The keys PackStepUploads packed into the step's ring slot: one InsertKeys call per run
// (KeyRuns), the first making the section's page-table edits (all padding unless
// packed.section_edits). Pointers and counts are a function of the step's shape (StepShape's
// key runs), so the kernel section captures and replays them.
absl::Status InsertPackedKeys(Rank& rank, int32_t pool, bool hadamard, const StepUploads& packed) {
  bool first = true;
  for (const KeyRun& run : packed.key_runs) {
    kernels::KeyInsertArgs args =
        StagedKeysArgs(rank, pool, run.type, run.count, run.has_scales, hadamard,
                       packed.key_base + run.keys_offset, packed.key_base + run.scales_offset,
                       reinterpret_cast<const int64_t*>(packed.key_base + run.slots_offset));
    if (first) {
      args.page_table = rank.buffers().page_tables[pool];
      args.edit_index = packed.section_edit_index;
      args.edit_pages = packed.section_edit_pages;
      args.num_edits = kSectionEdits;
      first = false;
    }
    DI_RETURN_IF_ERROR(rank.ops().InsertKeys(args));
  }
  return absl::OkStatus();
}

// The step's new keys (a few per sequence), gathered into one staging chunk per run of writes
// of one key type (KeyRuns): where PackStepUploads packed them into the step's ring slot,
// nothing here (the kernel section inserts them: InsertPackedKeys); else one InsertKeys call
// per run after three copies into the key buffers. A run in device memory
// (KeysInput::on_device) is copied device to device instead, its slots alone from the host,
// and its staged copies are queued for the check on the device.
absl::Status InsertStepKeys(Rank& rank, Staging& staging, int32_t pool,
                            const std::vector<KeyWrite>& writes, bool hadamard,
                            const StepUploads& packed, DeviceChecks& checks) {
  kernels::Device& be = rank.device();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  if (packed.keys) return absl::OkStatus();
  for (const KeyRun& run : KeyRuns(writes, D, rank.sizes().key_chunk)) {
    // A previous run's checks read the key buffers this run overwrites: launched first.
    DI_RETURN_IF_ERROR(checks.Flush());
    // One reservation for the three (a device run: its slots only), so they never straddle
    // an arena reuse.
    absl::StatusOr<uint8_t*> host =
        staging.Reserve(run.on_device ? size_t(run.count) * sizeof(int64_t) : run.bytes);
    if (!host.ok()) return host.status();
    GatherKeyRun(writes, run, D, *host);
    const int64_t vb = KeyValueBytes(run.type, D);
    const int64_t sb = KeyScaleBytes(run.type, D);
    if (run.on_device) {
      DI_RETURN_IF_ERROR(CopyKeyRunOnDevice(staging, writes, run, D, b.keys, b.key_scales));
      // FP8 codes (FP4 codes are all finite) and the scales: fp32 ones must also be > 0.
      if (run.type == kernels::ElemType::kFp8E4M3) {
        DI_RETURN_IF_ERROR(
            checks.Add({b.keys, int64_t{run.count} * vb, run.type, DeviceChecks::kNewKeys}));
        DI_RETURN_IF_ERROR(checks.Add({b.key_scales, run.count, kernels::ElemType::kF32,
                                       DeviceChecks::kNewKeyScales, /*positive=*/true}));
      } else {
        DI_RETURN_IF_ERROR(checks.Add({b.key_scales, int64_t{run.count} * sb,
                                       kernels::ElemType::kUE8M0, DeviceChecks::kNewKeyScales}));
      }
    } else {
      DI_RETURN_IF_ERROR(be.CopyToDevice(b.keys, *host + run.keys_offset, size_t(run.count) * vb));
      if (sb > 0) {
        DI_RETURN_IF_ERROR(
            be.CopyToDevice(b.key_scales, *host + run.scales_offset, size_t(run.count) * sb));
      }
    }
    DI_RETURN_IF_ERROR(
        be.CopyToDevice(b.slots, *host + run.slots_offset, size_t(run.count) * sizeof(int64_t)));
    DI_RETURN_IF_ERROR(InsertStagedKeys(rank, pool, run.type, run.count, sb > 0, hadamard));
  }
  return absl::OkStatus();
}

absl::Status CopyPagesOnRank(Rank& rank, int32_t pool,
                             std::span<const std::pair<int32_t, int32_t>> copies) {
  const kernels::CacheView& cache = rank.buffers().caches[pool];
  const int64_t bytes = cache.geometry.page_bytes();
  for (const auto& [src, dst] : copies) {
    DI_RETURN_IF_ERROR(rank.device().CopyDeviceToDevice(cache.base + dst * bytes,
                                                        cache.base + src * bytes, bytes));
  }
  return absl::OkStatus();
}

int64_t KeyValueBytes(ElemType type, int32_t head_dim) {
  switch (type) {
    case ElemType::kF32:
      return int64_t{head_dim} * 4;
    case ElemType::kBF16:
      return int64_t{head_dim} * 2;
    case ElemType::kFp8E4M3:
      return head_dim;
    case ElemType::kFp4E2M1:
      return head_dim / 2;
    default:
      return 0;
  }
}

int64_t KeyScaleBytes(ElemType type, int32_t head_dim) {
  if (type == ElemType::kFp8E4M3) return 4;
  if (type == ElemType::kFp4E2M1) return head_dim / 32;
  return 0;
}

absl::Status InsertKeysOnRank(Rank& rank, int32_t pool, const std::vector<KeyWrite>& writes,
                              bool hadamard) {
  kernels::Device& be = rank.device();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  const int32_t chunk = rank.sizes().key_chunk;
  for (const KeyWrite& w : writes) {
    const int64_t vb = KeyValueBytes(w.type, D);
    const int64_t sb = KeyScaleBytes(w.type, D);
    for (int32_t done = 0; done < w.count; done += chunk) {
      const int32_t c = std::min(chunk, w.count - done);
      DI_RETURN_IF_ERROR(
          be.CopyToDevice(b.keys, static_cast<const uint8_t*>(w.keys) + done * vb, c * vb));
      if (sb > 0) {
        DI_RETURN_IF_ERROR(be.CopyToDevice(
            b.key_scales, static_cast<const uint8_t*>(w.scales) + done * sb, c * sb));
      }
      DI_RETURN_IF_ERROR(be.CopyToDevice(b.slots, w.slots + done, c * sizeof(int64_t)));
      DI_RETURN_IF_ERROR(InsertStagedKeys(rank, pool, w.type, c, sb > 0, hadamard));
    }
  }
  return absl::OkStatus();
}

absl::Status BroadcastInsertKeysOnRank(Rank& rank, int32_t pool,
                                       const std::vector<KeyWrite>& writes, bool hadamard,
                                       Collective& collective) {
  kernels::Device& be = rank.device();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  const int32_t chunk = rank.sizes().key_chunk;
  const bool root = rank.index() == 0;
  for (const KeyWrite& w : writes) {
    const int64_t vb = KeyValueBytes(w.type, D);
    const int64_t sb = KeyScaleBytes(w.type, D);
    for (int32_t done = 0; done < w.count; done += chunk) {
      const int32_t c = std::min(chunk, w.count - done);
      absl::Status st;
      if (root) {
        st = be.CopyToDevice(b.keys, static_cast<const uint8_t*>(w.keys) + done * vb, c * vb);
        if (st.ok() && sb > 0) {
          st = be.CopyToDevice(b.key_scales, static_cast<const uint8_t*>(w.scales) + done * sb,
                               c * sb);
        }
      }
      // The slots are small (8 bytes a key): every rank copies them itself.
      if (st.ok()) st = be.CopyToDevice(b.slots, w.slots + done, c * sizeof(int64_t));
      // The previous chunk's insert has read the staging buffers the broadcast overwrites.
      if (st.ok()) st = be.Synchronize();
      DI_RETURN_IF_ERROR(collective.Agree(rank.index(), st));
      DI_RETURN_IF_ERROR(collective.Broadcast(rank.index(), b.keys, size_t(c) * vb));
      if (sb > 0) {
        DI_RETURN_IF_ERROR(collective.Broadcast(rank.index(), b.key_scales, size_t(c) * sb));
      }
      DI_RETURN_IF_ERROR(InsertStagedKeys(rank, pool, w.type, c, sb > 0, hadamard));
    }
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::exec
