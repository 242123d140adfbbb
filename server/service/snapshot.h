// Restart without loss (spec section 11): every sequence's entries and lengths written to
// DIR/snapshot.bin after the drain, and read back before the server reports SERVING.
//
// The file: 8 bytes "DISNAP01", then records [u32 length][u32 CRC-32 of the payload][payload]
// (little-endian): a header ("profile=...\nprofile_hash=...\ninstance_id=...\nsequences=N\n"),
// per sequence the ImportSequenceRequest messages of its export stream, and an end record
// ("end sequences=N\n"). It is written as snapshot.bin.tmp, fsynced, renamed over
// snapshot.bin and the directory fsynced, so a crash leaves either the old file or the new
// one, never half of one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "server/exec/executor.h"

namespace decode_indexer::service {

struct SnapshotInfo {
  std::string path;
  std::string instance_id;
  int64_t sequences = 0;
  int64_t bytes = 0;  // of the file
  double seconds = 0;
};

// Writes every sequence of `executor` (which no call may change meanwhile: after the drain).
absl::StatusOr<SnapshotInfo> WriteSnapshot(exec::Executor& executor, const std::string& dir,
                                           const std::string& instance_id);

// Restores DIR/snapshot.bin into `executor` (which holds no sequences) and removes the file,
// so that a later crash cannot resurrect it. nullopt when there is none (an unfinished
// snapshot.bin.tmp is removed with a warning). A torn or truncated, corrupt, foreign or
// mismatched file is an error naming the file, the byte offset, which of those it is and why.
absl::StatusOr<std::optional<SnapshotInfo>> RestoreSnapshot(exec::Executor& executor,
                                                            const std::string& dir);

}  // namespace decode_indexer::service
