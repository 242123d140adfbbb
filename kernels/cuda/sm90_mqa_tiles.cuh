// The persistent logits grid's walk over the schedule's key tiles (one tile = one page).
#pragma once

#include <cstdint>

namespace decode_indexer::kernels::cuda {

// Walks the schedule's global tile indices in order: (request, page of the request). Requests
// without tiles are skipped; each step is O(1) amortised, no search per tile.
struct TileCursor {
  int tile, request, request_end;
  __device__ __forceinline__ void Seek(const int32_t* prefix, int num_requests, int t) {
    int lo = 0, hi = num_requests - 1;  // the last b with prefix[b] <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (__ldg(&prefix[mid]) <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    tile = t;
    request = lo;
    request_end = __ldg(&prefix[lo + 1]);
  }
  __device__ __forceinline__ void Next(const int32_t* prefix) {
    ++tile;
    while (tile >= request_end) {
      ++request;
      request_end = __ldg(&prefix[request + 1]);
    }
  }
};

}  // namespace decode_indexer::kernels::cuda
