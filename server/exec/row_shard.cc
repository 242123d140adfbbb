#include "server/exec/row_shard.h"

namespace decode_indexer::exec {

std::optional<RowRange> RowShardBounds(int32_t num_rows, int32_t num_requests, int32_t world_size,
                                       int32_t rank, int32_t min_requests) {
  if (world_size < 2 || num_requests < 1) return std::nullopt;
  const int32_t rows = num_rows / world_size;
  if (num_requests < min_requests || num_requests % world_size != 0 ||
      num_rows % num_requests != 0 || rows % 2 != 0) {
    return std::nullopt;
  }
  return RowRange{rank * rows, (rank + 1) * rows};
}

}  // namespace decode_indexer::exec
