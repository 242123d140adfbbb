#include "server/exec/insert_keys.h"

#include <algorithm>
#include <cstring>

#include "common/status_macros.h"

namespace decode_indexer::exec {

using kernels::ElemType;

namespace {

// The insert of `count` keys of `type` staged in the rank's key / scale / slot buffers.
absl::Status InsertStagedKeys(Rank& rank, int32_t pool, ElemType type, int32_t count,
                              bool has_scales, bool hadamard) {
  RankBuffers& b = rank.buffers();
  kernels::KeyInsertArgs args;
  args.cache = b.caches[pool];
  args.num_keys = count;
  args.key_type = type;
  args.keys = b.keys;
  args.key_scales = has_scales ? b.key_scales : nullptr;
  args.slots = b.slots;
  args.hadamard = hadamard;
  return rank.backend().InsertKeys(args);
}

}  // namespace

// The step's new keys (a few per sequence), gathered into one staging chunk per run of writes
// of one key type: three copies and one InsertKeys call per chunk instead of per sequence.
absl::Status InsertStepKeys(Rank& rank, Staging& staging, int32_t pool,
                            const std::vector<KeyWrite>& writes, bool hadamard) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  const int32_t chunk = rank.sizes().key_chunk;
  size_t wi = 0;       // the write being gathered
  int32_t offset = 0;  // its keys gathered so far
  while (wi < writes.size()) {
    const ElemType type = writes[wi].type;
    const int64_t vb = KeyValueBytes(type, D);
    const int64_t sb = KeyScaleBytes(type, D);
    int32_t total = 0;
    for (size_t j = wi, o = offset; j < writes.size() && writes[j].type == type && total < chunk;
         ++j, o = 0) {
      total += std::min<int32_t>(writes[j].count - static_cast<int32_t>(o), chunk - total);
    }
    if (total == 0) {  // only empty writes left in this run
      ++wi;
      offset = 0;
      continue;
    }
    // One reservation for the three, so they never straddle an arena reuse.
    const size_t slot_bytes = size_t(total) * sizeof(int64_t);
    const size_t value_bytes = (size_t(total) * vb + 7) / 8 * 8;
    absl::StatusOr<uint8_t*> slots =
        staging.Reserve(slot_bytes + value_bytes + size_t(total) * std::max<int64_t>(sb, 1));
    if (!slots.ok()) return slots.status();
    uint8_t* const keys = *slots + slot_bytes;
    uint8_t* const scales = keys + value_bytes;
    for (int32_t filled = 0; filled < total;) {
      const KeyWrite& w = writes[wi];
      const int32_t c = std::min(w.count - offset, total - filled);
      std::memcpy(keys + size_t(filled) * vb, static_cast<const uint8_t*>(w.keys) + offset * vb,
                  size_t(c) * vb);
      if (sb > 0) {
        std::memcpy(scales + size_t(filled) * sb,
                    static_cast<const uint8_t*>(w.scales) + offset * sb, size_t(c) * sb);
      }
      std::memcpy(*slots + size_t(filled) * sizeof(int64_t), w.slots + offset,
                  size_t(c) * sizeof(int64_t));
      filled += c;
      offset += c;
      if (offset == w.count) {
        ++wi;
        offset = 0;
      }
    }
    DI_RETURN_IF_ERROR(be.CopyToDevice(b.keys, keys, size_t(total) * vb));
    if (sb > 0) DI_RETURN_IF_ERROR(be.CopyToDevice(b.key_scales, scales, size_t(total) * sb));
    DI_RETURN_IF_ERROR(be.CopyToDevice(b.slots, *slots, size_t(total) * sizeof(int64_t)));
    DI_RETURN_IF_ERROR(InsertStagedKeys(rank, pool, type, total, sb > 0, hadamard));
  }
  return absl::OkStatus();
}

absl::Status CopyPagesOnRank(Rank& rank, int32_t pool,
                             std::span<const std::pair<int32_t, int32_t>> copies) {
  const kernels::CacheView& cache = rank.buffers().caches[pool];
  const int64_t bytes = cache.geometry.page_bytes();
  for (const auto& [src, dst] : copies) {
    DI_RETURN_IF_ERROR(rank.backend().CopyDeviceToDevice(cache.base + dst * bytes,
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
  kernels::Backend& be = rank.backend();
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
  kernels::Backend& be = rank.backend();
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
