#include "server/state/page_allocator.h"

#include <cassert>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace decode_indexer::state {

PageAllocator::PageAllocator(std::string owner, std::string unit, int64_t count)
    : owner_(std::move(owner)), unit_(std::move(unit)), total_(count) {
  assert(count >= 0 && count <= INT32_MAX);
  free_.reserve(count);
  refs_.assign(count, 0);
  // Unit 0 on top, so a fresh pool hands out 0, 1, 2, ...
  for (int64_t i = count; i-- > 0;) free_.push_back(static_cast<int32_t>(i));
}

absl::StatusOr<std::vector<int32_t>> PageAllocator::Reserve(int64_t n) {
  if (n < 0 || n > free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(owner_, ": need ", n, " ", unit_, ", only ", free(), " of ", total_, " free"));
  }
  // From the top of the free stack down: a fresh pool (and a run released as one) hands
  // out ascending ids, so that a cache filled in one go holds one run of consecutive pages
  // (exports and imports copy a run in one call).
  std::vector<int32_t> out(free_.rbegin(), free_.rbegin() + n);
  free_.resize(free_.size() - n);
  for (int32_t u : out) refs_[u] = 1;
  return out;
}

void PageAllocator::Share(std::span<const int32_t> units) {
  for (int32_t u : units) {
    assert(u >= 0 && u < total_ && refs_[u] > 0);
    ++refs_[u];
  }
}

void PageAllocator::Release(std::span<const int32_t> units) {
  // Last unit first, so that the next Reserve hands a released run out in its order again.
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    const int32_t u = *it;
    assert(u >= 0 && u < total_ && refs_[u] > 0);
    if (--refs_[u] == 0) free_.push_back(u);
  }
  assert(free() <= total_);
}

}  // namespace decode_indexer::state
