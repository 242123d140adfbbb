// One rank: a thread, its Backend, its replica of every cache pool, its candidate store and
// its staging buffers. Everything is allocated once in Create, from the profile and the
// executor's limits, so a step allocates nothing big.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/kernels/backend.h"

namespace decode_indexer::exec {

// The sizes every rank's buffers are made for.
struct RankSizes {
  int32_t max_rows = 0;      // rows in one step
  int32_t max_requests = 0;  // requests in one step
  int32_t max_pages_per_sequence = 0;
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
  int32_t* page_table = nullptr;   // [max_requests, max_pages_per_sequence]
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
  kernels::Backend& backend() { return *backend_; }
  const RankSizes& sizes() const { return sizes_; }
  RankBuffers& buffers() { return buffers_; }
  // Whether a ForkExpand is in flight on the side stream (JoinExpand not yet called).
  bool fork_pending = false;
  // Time the last decode step spent in its collectives (agreement and all-gathers, after the
  // rank's own work had finished): the all-gather's share of a step.
  int64_t last_collective_ns = 0;
  // Time the last decode step spent before its collectives: uploads, keys, q prep and scoring,
  // up to the rank's own work finishing (the whole step when unsharded).
  int64_t last_score_ns = 0;

  // Job handoff: Start hands the job to the rank's thread; Wait returns its status.
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

  std::mutex mu_;
  std::condition_variable cv_;
  const Job* job_ = nullptr;  // set by Start, cleared by the thread when done
  bool done_ = false;
  bool stop_ = false;
  absl::Status result_;
  std::thread thread_;
};

// Fans a job out to every rank and joins. Statuses are per rank.
std::vector<absl::Status> RunOnRanks(const std::vector<std::unique_ptr<Rank>>& ranks,
                                     const Rank::Job& job);

}  // namespace decode_indexer::exec
