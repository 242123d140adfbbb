// One rank: a thread, its Backend, its replica of every cache pool, its candidate store and
// its staging buffers. Everything is allocated once in Create, from the profile and the
// executor's limits, so a step allocates nothing big.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/kernels/backend.h"
#include "server/exec/candidate_overlap.h"
#include "server/exec/step_graphs.h"

namespace decode_indexer::exec {

// The sizes every rank's buffers are made for.
struct RankSizes {
  int32_t max_rows = 0;                // rows in one step
  int32_t max_requests = 0;            // requests in one step
  int32_t max_pages_per_sequence = 0;  // the resident page tables' row length
  int64_t max_sequences = 0;           // their rows (sequence slots)
  int32_t table_edit_chunk = 0;        // page-table edits applied per scatter
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  int32_t topk = 0;
  int32_t num_candidate_blocks = 0;  // 0: no candidate layers
  int32_t candidate_block_size = 0;
  int64_t candidate_store_rows = 0;
  int32_t key_chunk = 0;  // keys inserted per InsertKeys call
  std::vector<kernels::CacheGeometry> pools;
  int64_t pages_per_pool = 0;
  std::vector<double> inv_freq;  // the profile's RoPE frequencies (rope_dim / 2)
  int64_t max_context = 0;       // the backend's limit on a row's length
  // ExecutorOptions::cuda_graphs: replay the step's kernels from captured graphs where the
  // backend has them (SupportsGraphs).
  bool step_graphs = false;
  // ExecutorOptions::max_step_graphs: step shapes (graphs) a rank keeps (StepGraphs).
  int32_t max_step_graphs = static_cast<int32_t>(StepGraphs::kDefaultMaxShapes);
  // ExecutorOptions::pinned_staging: stage uploads in page-locked memory on a GPU backend.
  bool pinned_staging = false;
  // ExecutorOptions::packed_uploads: slots of the rank's device staging ring (StagingRing);
  // 0: no ring, every small array of a step is its own upload.
  int32_t staging_slots = 0;
};

// Page-locked host staging (Device::AllocateHost) for one step's uploads, used front to back
// and emptied when the step's work has finished (every step ends in a Synchronize).
struct HostArena {
  uint8_t* base = nullptr;
  size_t capacity = 0;
  size_t used = 0;
  bool pinned = false;  // from the backend's AllocateHost (else plain memory)
};

// The rank's persistent device staging ring (step_io.h, PackStepUploads): slots of
// `slot_bytes` in its device memory, sized at start-up from the limits (RankSizes), into which
// a step's small arrays (row tables, request slots, page-table edits, store rows, positions,
// staged weights, keys) are packed on the host and uploaded with one copy; the kernels read
// them there. A slot is busy from the step that filled it until that step's closing
// Synchronize (Settle). A step takes the lowest free slot: slot 0 whenever the previous step
// settled, as every step does today, so the kernel section's pointers (and the graphs
// captured over them, step_graphs.h) stay the same; a step that returned before its
// Synchronize leaves its slot busy and the next takes another, synchronizing only when none is
// free. The side stream's expansion may read a slot's row lengths after the Synchronize; every
// step joins it (CandidateOverlap::Join) before its upload, which is stream-ordered after.
// Each slot has its host side too (in the rank's host arena, after the space Staging hands
// out, page-locked with it), reused under the same rule, so a DMA still reading the host
// side of a busy slot is never overwritten either.
struct StagingRing {
  uint8_t* device = nullptr;  // [slots, slot_bytes] device memory
  uint8_t* host = nullptr;    // [slots, slot_bytes] in the host arena
  size_t slot_bytes = 0;
  std::vector<bool> busy;  // by slot
  int32_t slots() const { return static_cast<int32_t>(busy.size()); }
  uint8_t* slot(int32_t i) const { return device + size_t(i) * slot_bytes; }
  uint8_t* host_slot(int32_t i) const { return host + size_t(i) * slot_bytes; }
  // After a Synchronize of the rank's stream: no slot is read any more.
  void Settle() { busy.assign(busy.size(), false); }
};

// Buffers in the rank's backend memory.
struct RankBuffers {
  std::vector<kernels::CacheView> caches;  // by pool index
  int32_t* candidate_store = nullptr;      // [candidate_store_rows, num_candidate_blocks]
  // Key staging: [key_chunk, D] up to 4 bytes an element, scales, slots.
  uint8_t* keys = nullptr;
  uint8_t* key_scales = nullptr;
  int64_t* slots = nullptr;
  // Row description of the step.
  int32_t* row_request = nullptr;  // [max_rows]
  int32_t* row_length = nullptr;   // [max_rows]
  // Per pool, the resident page table (page_table_mirror.h): [max_sequences,
  // max_pages_per_sequence], row = sequence slot.
  std::vector<int32_t*> page_tables;
  int32_t* request_slot = nullptr;  // [max_requests] the step's requests' slots
  int32_t* edit_index = nullptr;    // [table_edit_chunk] a scatter's entries
  int32_t* edit_pages = nullptr;    // [table_edit_chunk] and their pages
  // q: raw inputs (unquantized path) and the quantized q the kernels read.
  uint8_t* q_raw = nullptr;      // [max_rows, H, D] up to 4 bytes an element
  float* weights_raw = nullptr;  // [max_rows, H]
  int64_t* positions = nullptr;  // [max_rows]
  uint8_t* q_codes = nullptr;    // [max_rows, H, D]
  uint8_t* q_scales = nullptr;   // [max_rows, H, D/32]
  float* weights = nullptr;      // [max_rows, H]
  // Answers.
  int32_t* topk = nullptr;         // [max_rows, topk]
  int32_t* candidates = nullptr;   // [max_rows, num_candidate_blocks]
  int32_t* store_index = nullptr;  // [max_rows] candidate store rows of the step's rows
  // The consumers' expansion (CandidateOverlap).
  int32_t* expansion_positions = nullptr;  // [max_rows, NB * block]
  int32_t* expansion_counts = nullptr;     // [max_rows]
  double* inv_freq = nullptr;              // RankSizes::inv_freq, copied once
  // IndexerOps::CheckValues' flag words (kernels::kValueFlagWords; device-resident inputs:
  // step_io.h DeviceChecks), in mapped host memory (Device::AllocateMapped): the device's
  // address of Rank::value_flags_host().
  uint32_t* value_flags = nullptr;
};

class Rank {
 public:
  using Job = std::function<absl::Status(Rank&)>;

  static absl::StatusOr<std::unique_ptr<Rank>> Create(int32_t index,
                                                      std::unique_ptr<kernels::Backend> backend,
                                                      const RankSizes& sizes);
  ~Rank();
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  int32_t index() const { return index_; }
  // The rank's device (memory, copies, stream, graphs, events) and the indexer's operations
  // on it: the narrow interface each caller needs.
  kernels::Device& device() { return backend_->device(); }
  kernels::IndexerOps& ops() { return backend_->ops(); }
  const RankSizes& sizes() const { return sizes_; }
  RankBuffers& buffers() { return buffers_; }
  // The rank's side of CandidateOverlap: the expansion's fork and join on the side stream.
  CandidateOverlap& overlap() { return *overlap_; }
  // The last step's deferred answer rows (StepPlan::defer_topk / defer_candidates), in this
  // rank's readback space until its next step: `elems` int32 of the top-k (or candidates)
  // answer starting at element `elem_offset`.
  struct ReadbackPiece {
    bool candidates = false;
    int64_t elem_offset = 0;
    const int32_t* data = nullptr;
    size_t elems = 0;
  };
  // What the rank's last decode step did: written by the step's code on this rank
  // (decode_rows.cc, step_graphs.cc, step_io.h) through step_record(), read by the executor
  // after the join through last_step().
  struct StepRecord {
    // Time spent in its collectives (agreement and all-gathers, after the rank's own work had
    // finished): the all-gather's share of a step.
    int64_t collective_ns = 0;
    // Collective calls (agreements and all-gathers) it made: a count, so tests can tell
    // whether a step ran a collective without reading a clock.
    int64_t collectives = 0;
    // What its kernel section did: captured a graph, replayed one.
    bool graph_captured = false;
    bool graph_replayed = false;
    bool graph_evicted = false;  // its shape evicted the least recently seen one (StepGraphs)
    std::vector<ReadbackPiece> readback;
  };
  const StepRecord& last_step() const { return last_step_; }
  StepRecord& step_record() { return last_step_; }

  // Whether this rank replays step graphs (the option and a backend that has them).
  bool graphs_enabled() const { return graphs_enabled_; }
  StepGraphs& graphs() { return graphs_; }
  HostArena& host_arena() { return arena_; }
  StagingRing& staging_ring() { return ring_; }
  // Page-locked landing space for the step's answers copied to the host (top-k and
  // candidates of every row), so the device-to-host copy is one DMA; the host copies them on
  // to their destination after the step's Synchronize. Empty where staging is not pinned.
  HostArena& readback() { return readback_; }
  // RankBuffers::value_flags as the host sees them: read after the step's Synchronize, no
  // copy. ClearValueFlags zeroes them for a step's first check, first waiting for the device
  // when an earlier step's checks may still be running (Settled says they are not), so no late
  // write lands in a later step's words.
  const volatile uint32_t* value_flags_host() const { return value_flags_host_; }
  absl::Status ClearValueFlags();
  void ChecksLaunched() { value_flags_settled_ = false; }
  // After a Synchronize with nothing queued since: the step's staging slot is read no more
  // and its checks have written their flag words.
  void Settled() {
    ring_.Settle();
    value_flags_settled_ = true;
  }
  // Job handoff: Start hands the job to the rank's thread (rank 0, which has none, runs it
  // before returning); Wait returns its status.
  void Start(const Job* job);
  absl::Status Wait();

 private:
  Rank(int32_t index, std::unique_ptr<kernels::Backend> backend, const RankSizes& sizes);
  absl::Status Allocate();
  template <typename T>
  absl::Status Alloc(T** out, int64_t count);
  void Loop();

  int32_t index_;
  std::unique_ptr<kernels::Backend> backend_;
  RankSizes sizes_;
  RankBuffers buffers_;
  std::vector<void*> allocations_;
  std::optional<CandidateOverlap> overlap_;  // made once the buffers exist
  bool graphs_enabled_ = false;
  StepGraphs graphs_;
  HostArena arena_;
  HostArena readback_;
  StagingRing ring_;
  volatile uint32_t* value_flags_host_ = nullptr;
  bool value_flags_settled_ = true;
  StepRecord last_step_;

  // The hand-off: job_, done_ and stop_ change under mu_ (with a notify), so a waiter that
  // sleeps on cv_ never misses one; they are atomics so that a waiter may first spin on them
  // for a bounded while (SpinFor) without the lock: a step's hand-offs are tens of
  // microseconds apart, and a condition variable's wake-up costs about as much.
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<const Job*> job_{nullptr};  // set by Start, cleared by the thread when done
  std::atomic<bool> done_{false};
  std::atomic<bool> stop_{false};
  absl::Status result_;
  std::thread thread_;
};

// Fans a job out to every rank and joins: rank 0's job runs on the calling thread (rank 0 has
// no thread of its own), the others' on their rank threads. Statuses are per rank.
std::vector<absl::Status> RunOnRanks(const std::vector<std::unique_ptr<Rank>>& ranks,
                                     const Rank::Job& job);

}  // namespace decode_indexer::exec
