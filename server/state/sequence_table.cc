#include "server/state/sequence_table.h"

#include "absl/strings/str_cat.h"

namespace decode_indexer::state {

SequenceTable::SequenceTable(int32_t num_pools, int64_t max_sequences)
    : num_pools_(num_pools), max_sequences_(max_sequences) {}

absl::Status SequenceTable::Create(uint64_t id) {
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence_id: sequence ", id, " exists"));
  }
  if (size() >= max_sequences_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence_id: the server holds its maximum of ", max_sequences_,
                     " sequences; release one first"));
  }
  SequenceState& s = sequences_[id];
  s.id = id;
  s.caches.resize(num_pools_);
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
  return absl::OkStatus();
}

}  // namespace decode_indexer::state
