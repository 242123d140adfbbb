// A sequence in transit: exec::SequenceImage to and from the SequenceChunk stream of
// ExportSequence / ImportSequence (also the records of a snapshot file). The stream is a
// header (the profile's identity, each cache's length and byte count, the candidates), then
// each cache's pages in order, each chunk with a CRC-32, the last one marked.
#pragma once

#include <cstdint>
#include <functional>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"

namespace decode_indexer::service {

// zlib's CRC-32 of `bytes`, continuing from `crc` (0 to start).
uint32_t Crc32(absl::string_view bytes, uint32_t crc = 0);
// The CRC-32 a header chunk carries: of the header's deterministic serialization.
uint32_t SequenceHeaderCrc(const v1::SequenceHeader& header);

// The header chunk of `image` (crc32 set; `last` when no cache has pages).
v1::SequenceChunk SequenceHeaderChunk(const exec::SequenceImage& image,
                                      const config::Profile& profile, uint64_t sequence_id);

// A data chunk of an image, as a view of its pages (no copy, no CRC yet).
struct DataChunkView {
  int32_t cache_index = 0;
  int64_t offset = 0;
  absl::string_view data;
  bool last = false;
};
// Calls `fn` with each data chunk of `image` in stream order (after the header); stops at the
// first error. chunk_bytes <= 0: 1 MiB.
absl::Status ForEachDataChunk(const exec::SequenceImage& image, int64_t chunk_bytes,
                              const std::function<absl::Status(const DataChunkView&)>& fn);

// Appends `v` as a protobuf varint (protobuf's own encoder), for messages framed by hand
// around bytes they do not copy (FrameDataChunk, the callback edge's SerializeStepResponse).
void PutVarint(std::string& out, uint64_t v);

// The canonical serialization (what SerializeToString writes: fields in number order,
// defaults left out) of ImportSequenceRequest{chunk: {cache_index, offset, data, crc32 =
// data_crc, last}}, split around the data bytes, which it does not copy: a snapshot record
// is prefix + data + suffix.
struct DataChunkFrame {
  std::string prefix;
  std::string suffix;
};
DataChunkFrame FrameDataChunk(const DataChunkView& chunk, uint32_t data_crc);

// Calls `emit` with each chunk of `image` in order (the header first, `last` set on the final
// one); stops at the first error `emit` returns. chunk_bytes <= 0: 1 MiB.
absl::Status EmitSequenceChunks(const exec::SequenceImage& image, const config::Profile& profile,
                                uint64_t sequence_id, int64_t chunk_bytes,
                                const std::function<absl::Status(v1::SequenceChunk&)>& emit);

// Rebuilds an image from a chunk stream, checking it as it comes: the header against this
// server's profile (name and CacheIdentityHash; FAILED_PRECONDITION on a mismatch), every
// chunk's CRC-32 (DATA_LOSS), the order and sizes (INVALID_ARGUMENT). Nothing changes state.
class SequenceAssembler {
 public:
  // kCoveredByCaller: the caller has checked a CRC over bytes that include every data chunk's
  // (a snapshot record's), so a data chunk's own CRC-32 is not computed again.
  enum class DataCrc { kCheck, kCoveredByCaller };
  explicit SequenceAssembler(const config::Profile& profile, DataCrc data_crc = DataCrc::kCheck)
      : profile_(profile), data_crc_(data_crc) {}
  // The page buffers of an image done with (a previous Finish's): the next caches are built
  // in them (their contents dropped, their memory kept), so that a run of imports (a
  // snapshot's restore) writes into warm memory instead of faulting fresh pages in.
  void Recycle(exec::SequenceImage image);

  absl::Status Add(const v1::SequenceChunk& chunk);
  // Whether the chunk marked `last` arrived (and everything before it checked out).
  bool complete() const { return complete_; }
  // The sequence id the exporter had (the header's).
  uint64_t exported_id() const { return exported_id_; }
  // The image; DATA_LOSS naming where the stream stopped when it is not complete.
  absl::StatusOr<exec::SequenceImage> Finish();

 private:
  const config::Profile& profile_;
  DataCrc data_crc_;
  bool have_header_ = false;
  bool complete_ = false;
  uint64_t exported_id_ = 0;
  int64_t chunks_ = 0;
  exec::SequenceImage image_;
  std::vector<std::string> spare_;   // Recycle's buffers, taken by the header's caches
  std::vector<int64_t> want_bytes_;  // per cache
  size_t cache_ = 0;                 // the cache being filled
};

}  // namespace decode_indexer::service
