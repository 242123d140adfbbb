// The same-host fast path, client side: a step ring (common/step_ring.h) in a sealed memfd
// this client creates and registers, then steps with no gRPC on the hot path.
//
//   auto ring = client::FastPathRing::Create(client);      // memfd + shm socket + gRPC, once
//   uint8_t* data = ring->region() + ring->data_offset();   // write q, weights, keys here
//   client::RingStep step;                                  // offsets into the region
//   step.descriptor.layer = 3; step.descriptor.q_dtype = v1::DTYPE_FP8_E4M3; ...
//   step.sequence_ids = ids;
//   absl::StatusOr<client::RingCompletion> done = ring->Step(step);
//   // answer: int32 [rows, K] at region() + step.descriptor.answer_offset
//
// A worker writes its tensors straight into the region (no copy); StepRequest() is the
// convenience that stages a columnar DecodeStepRequest's inline tensors there and answers a
// DecodeStepResponse exactly as the gRPC call would (the tests and the load tester use it).
// One thread drives a ring (Submit / Wait are not thread-safe); a worker with several
// threads makes a ring each.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/indexer_client.h"
#include "common/step_ring.h"
#include "decode_indexer/v1/indexer.pb.h"

namespace decode_indexer::client {

struct FastPathOptions {
  uint32_t slots = 4;
  uint32_t slot_bytes = 16384;
  // Step data after the ring (q, weights, keys, answers).
  uint64_t data_bytes = uint64_t{16} << 20;
  // The server's poller spins this long before sleeping on the doorbell (0: its default).
  uint32_t server_spin_us = 0;
  // Wait spins this long before sleeping on the completion futex.
  int64_t client_spin_us = 50;
  // The server's shm socket; empty: ServerInfo.shm_socket.
  std::string socket_path;
};

// A step for the ring. `descriptor` carries everything but its number and the column flags
// (Submit sets those from the spans); its offsets are bytes from region().
struct RingStep {
  ring::StepDescriptor descriptor{};
  std::span<const uint64_t> sequence_ids;
  std::span<const int32_t> num_rows;  // empty: descriptor.rows_per_sequence for all
  std::span<const int32_t> new_key_counts;
  std::span<const int64_t> new_keys_positions;
  std::span<const int32_t> row_lengths;
};

struct RingCompletion {
  uint64_t sequence = 0;
  uint64_t step_id = 0;
  absl::Status status;  // the step's: INVALID_ARGUMENT naming the field, ...
  std::vector<int64_t> lengths;
  int64_t queue_us = 0;
  int64_t compute_us = 0;
  int64_t server_us = 0;  // from the poller taking the descriptor to the completion
  bool sharded = false;
};

// A descriptor slot's bytes for step number `n`: the descriptor (its number and column
// flags set from the spans) and its columns. INVALID_ARGUMENT when a column has the wrong
// length or the columns do not fit `slot` (whose size is the ring's slot_bytes).
absl::Status WriteDescriptor(const RingStep& step, uint64_t n, std::span<uint8_t> slot);

// A columnar DecodeStepRequest with its tensors inline, copied into `region` from
// `data_offset` on (each tensor 64-byte aligned; the answer and the candidate blocks after
// them): the RingStep for it (its spans point into `request`), its rows and answer bytes.
struct StagedStep {
  RingStep step;
  int64_t rows = 0;
  uint64_t answer_bytes = 0;
  uint64_t candidate_bytes = 0;
};
absl::StatusOr<StagedStep> StageRequest(const v1::DecodeStepRequest& request,
                                        std::span<uint8_t> region, uint64_t data_offset,
                                        int32_t topk, int32_t num_candidate_blocks);

class FastPathRing {
 public:
  // Creates the memfd (ring + data_bytes), writes the ring header, registers the memfd over
  // the shm socket and the ring over gRPC. The server must run on this host.
  static absl::StatusOr<std::unique_ptr<FastPathRing>> Create(IndexerClient& client,
                                                              const FastPathOptions& options = {});
  ~FastPathRing();  // Unregister(), best effort
  FastPathRing(const FastPathRing&) = delete;
  FastPathRing& operator=(const FastPathRing&) = delete;

  uint8_t* region() { return memory_->data(); }
  uint64_t region_bytes() const { return memory_->size(); }
  uint64_t data_offset() const { return ring_bytes_; }  // the first byte past the ring
  uint64_t region_id() const { return region_id_; }
  uint64_t ring_id() const { return ring_id_; }
  uint32_t max_sequences() const { return max_sequences_; }
  uint32_t slots() const { return options_.slots; }

  // Publishes the step and rings the doorbell; answers its number for Wait.
  // FAILED_PRECONDITION when `slots` steps are in flight (Wait first) or the ring stopped.
  absl::StatusOr<uint64_t> Submit(const RingStep& step);
  // Step `sequence`'s completion. DEADLINE_EXCEEDED after `timeout`; UNAVAILABLE when the
  // server released the ring. Completions are read in order.
  absl::StatusOr<RingCompletion> Wait(uint64_t sequence,
                                      std::chrono::microseconds timeout = std::chrono::seconds(60));
  absl::StatusOr<RingCompletion> Step(const RingStep& step,
                                      std::chrono::microseconds timeout = std::chrono::seconds(60));

  // A columnar DecodeStepRequest with its tensors inline: staged into the data area from
  // data_offset() (answer there too), run through the ring, answered as DecodeStep would
  // answer it (topk / candidate_blocks with their bytes, lengths, timing). A failed step
  // answers its status.
  absl::StatusOr<v1::DecodeStepResponse> StepRequest(const v1::DecodeStepRequest& request);

  // Tests: publishes a slot's raw bytes as the next step (no checks, its number as written).
  absl::StatusOr<uint64_t> SubmitRawForTesting(std::span<const uint8_t> slot_bytes);

  // Releases the ring on the server (and the region). Idempotent.
  absl::Status Unregister();

 private:
  FastPathRing() = default;
  ring::RingHeader& header() { return *reinterpret_cast<ring::RingHeader*>(memory_->data()); }

  IndexerClient* client_ = nullptr;
  FastPathOptions options_;
  std::unique_ptr<SharedMemory> memory_;
  uint64_t ring_bytes_ = 0;
  uint64_t region_id_ = 0;
  uint64_t ring_id_ = 0;
  uint32_t max_sequences_ = 0;
  int32_t topk_ = 0;
  int32_t num_candidate_blocks_ = 0;
  uint64_t produced_ = 0;
  bool registered_ = false;
};

}  // namespace decode_indexer::client
