// A pool of fixed-size units with reference counts: the pages of one cache pool, or the blocks
// of the candidate store. Reserve is all-or-nothing, so a request that does not fit leaves no
// trace. A unit shared by several sequences (ForkSequence) is counted once, and goes back to
// the free list only when its last holder releases it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace decode_indexer::state {

class PageAllocator {
 public:
  // `owner` and `unit` name the pool in messages: ("cache layer 3", "pages").
  PageAllocator(std::string owner, std::string unit, int64_t count);

  // n units, each held once, or RESOURCE_EXHAUSTED naming the pool and the counts; n == 0
  // gives none.
  absl::StatusOr<std::vector<int32_t>> Reserve(int64_t n);
  // One more holder for each unit (each must be held).
  void Share(std::span<const int32_t> units);
  // One holder fewer for each unit; a unit nobody holds goes back to the free list.
  void Release(std::span<const int32_t> units);
  // Holders of a unit (0: free).
  int32_t holders(int32_t unit) const { return refs_[unit]; }

  int64_t total() const { return total_; }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  const std::string& owner() const { return owner_; }

 private:
  std::string owner_;
  std::string unit_;
  int64_t total_;
  // A stack: released units are reused first, so page lists scatter as sequences come and go.
  std::vector<int32_t> free_;
  std::vector<int32_t> refs_;  // [total]
};

}  // namespace decode_indexer::state
