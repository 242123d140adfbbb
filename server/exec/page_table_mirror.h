// Resident page tables. Every rank keeps, per cache pool, a page table in its backend memory
// with one row per sequence slot ([max_sequences, stride], row `slot` holding the sequence's
// page ids in position order), so a step's plan names its requests' slots instead of building
// and uploading a [requests, pages] table per step. The host side (PageTableMirror) records
// every change of a sequence's page list as an edit; a rank job applies a pool's edits, in
// order, before any kernel of the job reads that pool's table (decode_rows.cc).
//
// The invariant: once a pool's recorded edits are applied, entry i of slot s's row equals
// page i of the sequence in slot s, for every committed page. Entries past a sequence's pages
// are never read (a row reads positions below its length only), so a cut-back or a release
// needs no edit. A step applies its own writes' pages as edits after the recorded ones; if it
// fails, the executor records the committed pages back over them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace decode_indexer::exec {

// Entries to set in one pool's resident table: table[index[i]] = page[i], index = slot *
// stride + page position. Applied as one scatter per chunk, so an index appears once.
struct TableEdits {
  std::vector<int32_t> index;
  std::vector<int32_t> page;
  size_t size() const { return index.size(); }
  bool empty() const { return index.empty(); }
  void clear() {
    index.clear();
    page.clear();
  }
  void push_back(int32_t i, int32_t p) {
    index.push_back(i);
    page.push_back(p);
  }
};

class PageTableMirror {
 public:
  PageTableMirror() = default;
  PageTableMirror(int32_t num_pools, int32_t stride) : stride_(stride), pending_(num_pools) {}

  int32_t stride() const { return stride_; }
  int32_t Index(int32_t slot, int64_t position_page) const {
    return static_cast<int32_t>(int64_t{slot} * stride_ + position_page);
  }
  // Entries [first, first + pages.size()) of `slot`'s row in `pool` now hold `pages`.
  void Record(int32_t pool, int32_t slot, int64_t first, std::span<const int32_t> pages);
  // The pool's edits recorded and not yet applied by every rank, each index once (the last
  // edit recorded for an index wins).
  const TableEdits& Pending(int32_t pool);
  // Every rank applied the pool's pending edits (a job that succeeded everywhere).
  void Applied(int32_t pool) { pending_[pool].edits.clear(); }

 private:
  struct Pool {
    TableEdits edits;
    bool unique = true;  // no index appears twice in `edits`
  };
  int32_t stride_ = 0;
  std::vector<Pool> pending_;
};

}  // namespace decode_indexer::exec
