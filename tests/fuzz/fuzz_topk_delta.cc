// The DELTA_VARINT answer decoding (client/tensor.h DecodeTopkDelta, what every client runs on
// a server's bytes) on arbitrary input: 8 bytes give the claimed rows and k (as a server's
// response shape would), the rest is topk_delta. Decoding must never crash or allocate
// without bound; what it accepts must be a well-formed answer (each row ascending, distinct,
// -1 padded), and the server's encoder (EncodeTopkDelta) must give bytes that decode to it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "client/tensor.h"
#include "server/service/data_plane.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  int32_t rows, k;
  std::memcpy(&rows, data, 4);
  std::memcpy(&k, data + 4, 4);
  const std::string bytes(reinterpret_cast<const char*>(data + 8), size - 8);
  // Shapes the decoder accepts are allocated in full: skip the big legal ones (they only
  // cost memset time); every shape the decoder must refuse still goes through.
  const bool legal = rows >= 0 && k >= 0 && k <= (1 << 20) &&
                     rows <= static_cast<int64_t>(bytes.size()) &&
                     int64_t{rows} * k <= (int64_t{1} << 28);
  if (legal && int64_t{rows} * k > (1 << 20)) return 0;
  absl::StatusOr<std::vector<int32_t>> topk =
      decode_indexer::client::DecodeTopkDelta(bytes, rows, k);
  if (!topk.ok()) {
    if (topk.status().message().empty()) std::abort();
    return 0;
  }
  if (topk->size() != static_cast<size_t>(rows) * static_cast<size_t>(k)) std::abort();
  for (int32_t r = 0; r < rows; ++r) {
    int64_t prev = -1;
    bool padding = false;
    for (int32_t i = 0; i < k; ++i) {
      const int32_t v = (*topk)[static_cast<size_t>(r) * k + i];
      if (v == -1) {
        padding = true;
        continue;
      }
      if (padding || v <= prev) std::abort();
      prev = v;
    }
  }
  std::string again;
  decode_indexer::service::EncodeTopkDelta(*topk, rows, k, again);
  absl::StatusOr<std::vector<int32_t>> back =
      decode_indexer::client::DecodeTopkDelta(again, rows, k);
  if (!back.ok() || *back != *topk) std::abort();
  return 0;
}
