// A free list of fixed-size units: the pages of one cache pool, or the blocks of the candidate
// store. Reserve is all-or-nothing, so a request that does not fit leaves no trace.
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

  // n units, or RESOURCE_EXHAUSTED naming the pool and the counts; n == 0 gives none.
  absl::StatusOr<std::vector<int32_t>> Reserve(int64_t n);
  // Returns units to the free list. Each must have come from Reserve and not be free.
  void Release(std::span<const int32_t> units);

  int64_t total() const { return total_; }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  const std::string& owner() const { return owner_; }

 private:
  std::string owner_;
  std::string unit_;
  int64_t total_;
  // A stack: released units are reused first, so page lists scatter as sequences come and go.
  std::vector<int32_t> free_;
};

}  // namespace decode_indexer::state
