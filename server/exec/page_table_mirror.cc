#include "server/exec/page_table_mirror.h"

#include <algorithm>
#include <numeric>

namespace decode_indexer::exec {

void PageTableMirror::Record(int32_t pool, int32_t slot, int64_t first,
                             std::span<const int32_t> pages) {
  Pool& p = pending_[pool];
  // A recorded edit may repeat an index only if edits are already pending (one Record call
  // covers distinct entries).
  if (!p.edits.empty() && !pages.empty()) p.unique = false;
  for (size_t i = 0; i < pages.size(); ++i) {
    p.edits.push_back(Index(slot, first + static_cast<int64_t>(i)), pages[i]);
  }
}

const TableEdits& PageTableMirror::Pending(int32_t pool) {
  Pool& p = pending_[pool];
  if (p.unique || p.edits.size() < 2) {
    p.unique = true;
    return p.edits;
  }
  // Keep the last edit of each index: order by (index, recording order), take each run's end.
  std::vector<uint32_t> order(p.edits.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return p.edits.index[a] < p.edits.index[b]; });
  TableEdits unique;
  unique.index.reserve(order.size());
  unique.page.reserve(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    if (k + 1 < order.size() && p.edits.index[order[k + 1]] == p.edits.index[order[k]]) continue;
    unique.push_back(p.edits.index[order[k]], p.edits.page[order[k]]);
  }
  p.edits = std::move(unique);
  p.unique = true;
  return p.edits;
}

}  // namespace decode_indexer::exec
