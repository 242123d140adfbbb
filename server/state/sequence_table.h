// The sequence table: per sequence, each cache pool's committed length and page list, and per
// candidate source layer the record of the candidates it last published. Host truth only:
// the executor changes it after every rank has succeeded, never before.
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/state/page_allocator.h"

namespace decode_indexer::state {

// One sequence's entries in one cache pool.
struct CachePages {
  int64_t length = 0;          // committed entries
  std::vector<int32_t> pages;  // page ids; position p lives in pages[p / page_size]
};

// The candidates a source layer last published for a sequence. A consumer may use them only
// at the same cache length and the same row lengths.
struct CandidateRecord {
  // Unique across the executor's lifetime (never reused), so a cached expansion keyed by it
  // cannot be confused with a later publication.
  uint64_t version = 0;
  int64_t length = 0;  // the source cache's length when they were computed
  int32_t rows = 0;
  std::vector<int32_t> row_lengths;  // [rows]
  // The candidate store block holding them: row j is store row block * rows_per_block + j.
  int32_t store_block = -1;
};

struct SequenceState {
  uint64_t id = 0;
  // Its row in every rank's resident page tables (PageTableMirror): [0, max_sequences),
  // unique among live sequences, reused after a release.
  int32_t slot = -1;
  // When a call last named the sequence (ExecutorOptions::idle_sequence_timeout).
  int64_t last_used_ms = 0;
  std::vector<CachePages> caches;                 // by cache pool index
  std::map<int32_t, CandidateRecord> candidates;  // by source layer
};

// Every change to a sequence's page lists goes through the functions below (host truth; a
// device mirror of the page tables would be updated in exactly these places).
//
// A write of `count` entries at `position` (<= the committed length) into one cache, planned
// without changing anything: the sequence is cut back to `position`, then the entries are
// written. A page written by it is replaced by a fresh one (copied first where entries below
// `position` must be kept) when another sequence also holds it (copy-on-write) or when it
// holds committed entries at or past `position` (so a failed write leaves them intact);
// other pages are written in place. Commit or abort every plan.
struct PageCopy {
  int32_t src = 0;
  int32_t dst = 0;
};
// A decode step plans one per sequence (its token's key: a page or two of tail), so the lists
// keep a few entries inline: no heap allocation per sequence and step (64 of them a step at 64
// requests cost ~1.8 us of planning on the development machine).
struct CacheWrite {
  template <typename T>
  using Pages = absl::InlinedVector<T, 4>;
  int64_t position = 0;
  int64_t new_length = 0;
  size_t keep = 0;         // pages[0, keep) stay as they are
  Pages<int32_t> tail;     // the pages [keep, ceil(new_length / P)) after the write
  Pages<int32_t> fresh;    // those of tail reserved for it
  Pages<PageCopy> copies;  // whole pages to copy before the entries are written
  Pages<int32_t> dropped;  // pages the sequence lets go of on commit

  int32_t PageAt(const CachePages& cp, int64_t index) const {
    return index < static_cast<int64_t>(keep) ? cp.pages[index] : tail[index - keep];
  }
  // Page * page_size + slot of position p (position <= p < new_length).
  int64_t Slot(const CachePages& cp, int64_t p, int32_t page_size) const {
    return int64_t{PageAt(cp, p / page_size)} * page_size + p % page_size;
  }
};
// RESOURCE_EXHAUSTED (nothing reserved) when the pool cannot give the fresh pages.
absl::StatusOr<CacheWrite> PlanCacheWrite(const CachePages& cp, int64_t position, int64_t count,
                                          int32_t page_size, PageAllocator& pool);
void CommitCacheWrite(CachePages& cp, CacheWrite& write, PageAllocator& pool);
void AbortCacheWrite(CacheWrite& write, PageAllocator& pool);
// Cuts one cache to `length` (<= its length); answers the pages the sequence let go of.
int64_t TruncateCache(CachePages& cp, int64_t length, int32_t page_size, PageAllocator& pool);
// `child` (empty) starts as the first `length` entries of `parent`, sharing its pages.
void ShareCache(const CachePages& parent, int64_t length, int32_t page_size, PageAllocator& pool,
                CachePages& child);
// Lets go of every page; answers how many.
int64_t DropCache(CachePages& cp, PageAllocator& pool);
// Takes over `pages` (freshly reserved) as the cache of an empty sequence.
void AdoptCache(CachePages& cp, std::vector<int32_t> pages, int64_t length);

class SequenceTable {
 public:
  SequenceTable(int32_t num_pools, int64_t max_sequences);

  // ALREADY_EXISTS if taken; RESOURCE_EXHAUSTED past max_sequences.
  absl::Status Create(uint64_t id);
  // What Create would answer, changing nothing.
  absl::Status CanCreate(uint64_t id) const;
  std::vector<uint64_t> Ids() const;
  SequenceState* Find(uint64_t id);
  const SequenceState* Find(uint64_t id) const;
  // Removes the entry and hands it back so the caller can free its pages and store blocks.
  // NOT_FOUND if absent.
  absl::Status Remove(uint64_t id, SequenceState* removed);

  int64_t size() const { return static_cast<int64_t>(sequences_.size()); }
  int64_t max_sequences() const { return max_sequences_; }

 private:
  int32_t num_pools_;
  int64_t max_sequences_;
  std::unordered_map<uint64_t, SequenceState> sequences_;
  // Slots never handed out are [next_slot_, max_sequences); released ones wait here (the most
  // recently released is reused first, so the tables' touched rows stay few).
  int32_t next_slot_ = 0;
  std::vector<int32_t> free_slots_;
};

}  // namespace decode_indexer::state
