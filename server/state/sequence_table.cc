#include "server/state/sequence_table.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/str_cat.h"

namespace decode_indexer::state {

namespace {
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Back to an empty write, fields cleared in place (its lists keep their storage).
void ResetWrite(CacheWrite& w) {
  w.position = 0;
  w.new_length = 0;
  w.keep = 0;
  w.tail.clear();
  w.fresh.clear();
  w.copies.clear();
  w.dropped.clear();
}
}  // namespace

absl::StatusOr<CacheWrite> PlanCacheWrite(const CachePages& cp, int64_t position, int64_t count,
                                          int32_t page_size, PageAllocator& pool) {
  assert(position >= 0 && position <= cp.length && count >= 0);
  const int64_t P = page_size;
  const int64_t held = static_cast<int64_t>(cp.pages.size());
  CacheWrite w;
  w.position = position;
  w.new_length = position + count;
  const int64_t need = CeilDiv(w.new_length, P);
  // Pages the write touches: [position / P, need). A pure cut touches none.
  const int64_t first = count == 0 ? need : position / P;
  w.keep = static_cast<size_t>(std::min(first, held));
  // A held page is replaced by a fresh one when another sequence holds it too or when the
  // write would overwrite committed entries in it; otherwise it is written in place.
  auto replaced = [&](int64_t k) {
    return pool.holders(cp.pages[k]) > 1 || cp.length > std::max(position, k * P);
  };
  int64_t fresh = 0;
  for (int64_t k = first; k < need; ++k) fresh += k >= held || replaced(k);
  absl::StatusOr<std::vector<int32_t>> got = pool.Reserve(fresh);
  if (!got.ok()) return got.status();
  w.fresh.assign(got->begin(), got->end());
  size_t next = 0;
  for (int64_t k = first; k < need; ++k) {
    if (k < held && !replaced(k)) {
      w.tail.push_back(cp.pages[k]);
      continue;
    }
    const int32_t page = w.fresh[next++];
    w.tail.push_back(page);
    if (k < held) {
      w.dropped.push_back(cp.pages[k]);
      // Entries [k * P, position) of the old page stay.
      if (k * P < position) w.copies.push_back({cp.pages[k], page});
    }
  }
  for (int64_t k = std::max(need, first); k < held; ++k) w.dropped.push_back(cp.pages[k]);
  return w;
}

void CommitCacheWrite(CachePages& cp, CacheWrite& write, PageAllocator& pool) {
  pool.Release(write.dropped);
  cp.pages.resize(write.keep);
  cp.pages.insert(cp.pages.end(), write.tail.begin(), write.tail.end());
  cp.length = write.new_length;
  ResetWrite(write);
}

void AbortCacheWrite(CacheWrite& write, PageAllocator& pool) {
  pool.Release(write.fresh);
  ResetWrite(write);
}

int64_t TruncateCache(CachePages& cp, int64_t length, int32_t page_size, PageAllocator& pool) {
  assert(length >= 0 && length <= cp.length);
  const size_t keep = static_cast<size_t>(CeilDiv(length, page_size));
  const int64_t let_go = static_cast<int64_t>(cp.pages.size() - std::min(keep, cp.pages.size()));
  if (keep < cp.pages.size()) {
    pool.Release(std::span<const int32_t>(cp.pages).subspan(keep));
    cp.pages.resize(keep);
  }
  cp.length = length;
  return let_go;
}

void ShareCache(const CachePages& parent, int64_t length, int32_t page_size, PageAllocator& pool,
                CachePages& child) {
  assert(length >= 0 && length <= parent.length && child.pages.empty());
  const size_t n = static_cast<size_t>(CeilDiv(length, page_size));
  child.pages.assign(parent.pages.begin(), parent.pages.begin() + n);
  pool.Share(child.pages);
  child.length = length;
}

int64_t DropCache(CachePages& cp, PageAllocator& pool) {
  const int64_t n = static_cast<int64_t>(cp.pages.size());
  pool.Release(cp.pages);
  cp.pages.clear();
  cp.length = 0;
  return n;
}

void AdoptCache(CachePages& cp, std::vector<int32_t> pages, int64_t length) {
  assert(cp.pages.empty());
  cp.pages = std::move(pages);
  cp.length = length;
}

SequenceTable::SequenceTable(int32_t num_pools, int64_t max_sequences)
    : num_pools_(num_pools), max_sequences_(max_sequences) {}

absl::Status SequenceTable::Create(uint64_t id) {
  if (absl::Status s = CanCreate(id); !s.ok()) return s;
  SequenceState& s = sequences_[id];
  s.id = id;
  s.caches.resize(num_pools_);
  if (!free_slots_.empty()) {
    s.slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    s.slot = next_slot_++;  // < max_sequences: CanCreate bounds the live count
  }
  return absl::OkStatus();
}

std::vector<uint64_t> SequenceTable::Ids() const {
  std::vector<uint64_t> ids;
  ids.reserve(sequences_.size());
  for (const auto& [id, s] : sequences_) ids.push_back(id);
  return ids;
}

absl::Status SequenceTable::CanCreate(uint64_t id) const {
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence_id: sequence ", id, " exists"));
  }
  if (size() >= max_sequences_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence_id: the server holds its maximum of ", max_sequences_,
                     " sequences; release one first"));
  }
  return absl::OkStatus();
}

SequenceState* SequenceTable::Find(uint64_t id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

const SequenceState* SequenceTable::Find(uint64_t id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

absl::Status SequenceTable::Remove(uint64_t id, SequenceState* removed) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence_id: no sequence ", id));
  }
  *removed = std::move(it->second);
  sequences_.erase(it);
  free_slots_.push_back(removed->slot);
  return absl::OkStatus();
}

}  // namespace decode_indexer::state
