// step_graphs: a rank's kernel section (the packed keys' insert with the step's page-table
// edits, device q's check, rope_quant_q and the scoring call) replayed from a captured graph
// per step shape (seed: warm, then capture). Two steps with
// equal shapes make the same launches with the same pointers and sizes, since every staging
// buffer is fixed at start-up (q read in place in a client's buffer, and a top-k written in
// place into a client's answer buffer: their addresses are part of the shape): the first sighting
// of a shape runs eagerly (and creates every workspace), the second captures, later ones replay.
// Only where the backend has graphs (CUDA).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <tuple>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"

namespace decode_indexer::exec {

class Rank;

// What changes the launches of a step's kernel section (the packed keys' insert, device q's
// check, rope_quant_q and the scoring call): two steps with equal shapes make the same launches
// with the same pointers and sizes, so the second may capture them and later ones replay the graph
// (seed: warm). Pointers are a function of these fields, since every staging buffer, and the
// staging ring's slots, are fixed at start-up; q read in place and an answer written in place are
// keyed by their addresses.
struct StepShape {
  int32_t pool = 0;
  int32_t role = 0;
  bool masked = false;
  bool candidates = false;  // a source writing candidates
  int32_t range_start = 0;  // this rank's rows
  int32_t rows = 0;
  int32_t requests = 0;
  int32_t q_type = 0;
  bool positions = false;
  bool hadamard = false;
  int32_t max_row_length = 0;    // bucketed (BucketRowLength)
  int32_t rows_per_request = 0;  // RowBatch::rows_per_request: picks the kernels' pass width
  // Where the step's packed arrays lie (step_io.h StepUploads): the ring slot (-1: the rank's
  // own buffers), and what else fixes their offsets in it (with rows, requests, range_start,
  // q_type, positions and pool).
  int32_t staging_slot = -1;
  int32_t total_rows = 0;
  bool staged_q = false;
  // q read in place from a client's device buffer (step_io.h QRows::in_place): the addresses
  // of the rank's rows' codes, FP4 scales and weights there, which no staging buffer fixes (0:
  // staged). A step whose q moved in the buffer is another shape, never a stale replay.
  uintptr_t q_codes = 0;
  uintptr_t q_scales = 0;
  uintptr_t q_weights = 0;
  // Device q's value check in the section (QRows::checks): 0 none, 1 a check that clears the
  // flag words first, 2 one that adds to them (the executor's: the host cleared them).
  int32_t q_check = 0;
  // The top-k written in place into the answer's device span (decode_schedule.h TopKInPlace):
  // the address of the rank's rows there (0: the rank's own buffer). A step whose answer
  // buffer moved is another shape: a replay never writes where an earlier step's answer went.
  uintptr_t topk_out = 0;
  // The step's new keys packed into the ring slot, inserted in the section with its page-table
  // edits (insert_keys.h InsertPackedKeys): per run its type, count and offsets in the slot,
  // and whether unquantized keys are rotated. Empty: no keys in the section (none, or inserted
  // before it). The edits' count is not part of the shape (a fixed, padded area).
  struct KeyRunShape {
    int32_t type = 0;
    int32_t count = 0;
    bool scales = false;
    uint32_t keys_offset = 0;
    uint32_t scales_offset = 0;
    uint32_t slots_offset = 0;
    auto Tie() const {
      return std::tie(type, count, scales, keys_offset, scales_offset, slots_offset);
    }
    bool operator<(const KeyRunShape& o) const { return Tie() < o.Tie(); }
    bool operator==(const KeyRunShape& o) const { return Tie() == o.Tie(); }
  };
  absl::InlinedVector<KeyRunShape, 2> key_runs;
  bool key_hadamard = false;
  auto Tie() const {
    return std::tie(pool, role, masked, candidates, range_start, rows, requests, q_type, positions,
                    hadamard, max_row_length, rows_per_request, staging_slot, total_rows, staged_q,
                    q_codes, q_scales, q_weights, q_check, topk_out, key_runs, key_hadamard);
  }
  bool operator<(const StepShape& o) const { return Tie() < o.Tie(); }
};

// The host bound on a step's row lengths as the kernels see it when graphs are on: rounded up
// to a bucket, so that a step whose longest row grew by a few tokens replays the same graph.
// Buckets: 4096, then four per power of two (5120, 6144, 7168, 8192, 10240, ...), capped at
// `cap` (the backend's limit). The kernels read each row's own length; the bound only sizes
// grids and workspaces, so the answer does not depend on it.
int32_t BucketRowLength(int32_t length, int64_t cap);

// The rank's step graphs: per shape, how often it was seen and the graph's key once captured.
// At most `max_shapes` shapes are kept (each captured one holds an instantiated graph on the
// device); a new shape past that evicts the least recently seen one, so that a long-running
// server whose batches drift (request counts, row-length buckets, clients' buffers) keeps
// capturing its current shapes instead of running every new one eagerly.
class StepGraphs {
 public:
  static constexpr size_t kDefaultMaxShapes = 1024;
  enum class Use { kEager, kCapture, kReplay };
  struct Entry {
    uint64_t key = 0;
    int32_t sightings = 0;
    bool captured = false;
    bool failed = false;    // capture failed once: this shape stays eager
    uint64_t last_use = 0;  // the table's clock at the latest sighting
  };
  // A shape a sighting evicted from the full table: `graph_key` is its graph's key if it had
  // a captured graph (the caller drops it from the device), else 0.
  struct Eviction {
    bool happened = false;
    uint64_t graph_key = 0;
  };
  explicit StepGraphs(size_t max_shapes = kDefaultMaxShapes)
      : max_shapes_(max_shapes > 0 ? max_shapes : 1) {}
  // Notes a sighting and says what to do: the first sighting runs eager (and creates every
  // workspace and per-device kernel attribute), the second captures, later ones replay. A new
  // shape in a full table evicts the least recently seen one first (*eviction says which).
  Use Next(const StepShape& shape, Entry** entry, Eviction* eviction);

 private:
  size_t max_shapes_;
  std::map<StepShape, Entry> entries_;
  uint64_t next_key_ = 1;
  uint64_t clock_ = 0;
};

// Runs the step's kernel section `launch` through the rank's step graphs: eager at a shape's
// first sighting (or where the rank has no graphs), captured at its second, replayed after.
// A capture that fails (an unsupported call while capturing) leaves the stream as it was: the
// shape stays eager and the section runs eagerly now.
absl::Status RunKernelSection(Rank& rank, const StepShape& shape,
                              const std::function<absl::Status()>& launch);

}  // namespace decode_indexer::exec
