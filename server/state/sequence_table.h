// The sequence table: per sequence, each cache pool's committed length and page list, and per
// candidate source layer the record of the candidates it last published. Host truth only:
// the executor changes it after every rank has succeeded, never before.
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"

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
  std::vector<CachePages> caches;                 // by cache pool index
  std::map<int32_t, CandidateRecord> candidates;  // by source layer
};

class SequenceTable {
 public:
  SequenceTable(int32_t num_pools, int64_t max_sequences);

  // ALREADY_EXISTS if taken; RESOURCE_EXHAUSTED past max_sequences.
  absl::Status Create(uint64_t id);
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
};

}  // namespace decode_indexer::state
