// row_shard_bounds (seed): which rows a rank scores in a decode step, or none when the step
// stays replicated (every rank scores every row).
#pragma once

#include <cstdint>
#include <optional>

namespace decode_indexer::exec {

struct RowRange {
  int32_t start = 0;
  int32_t end = 0;
  bool operator==(const RowRange&) const = default;
};

// Rows [start, end) that `rank` scores, or nullopt when the step runs unsharded. The gate
// reads only counts every rank knows, so every rank takes the same branch. A split holds whole
// requests of a uniform step (num_rows % num_requests == 0) and starts on an even row, as the
// seed's DeepGEMM path needs 8-byte aligned int32 rows.
std::optional<RowRange> RowShardBounds(int32_t num_rows, int32_t num_requests, int32_t world_size,
                                       int32_t rank, int32_t min_requests);

}  // namespace decode_indexer::exec
