// The fast path's server side: step rings (common/step_ring.h) in client shared-memory
// regions, each served by its own poller thread.
//
// A poller takes descriptor after descriptor in order, turns each into the columnar
// DecodeStepRequest it stands for (sequence_ids, num_rows ..., q / weights / keys / positions
// as shape-only Tensors with their bytes at shared_memory offsets, the answer at
// shared_memory's or cuda_ipc's offsets) and hands it to the service's step path
// (IndexerService::RunRingStep): the very checks, admission order and executor call of a gRPC
// step, so a descriptor answers exactly as the same step over gRPC and fails with the same
// field-naming error, written into its completion record. What only a descriptor can get
// wrong (its number, flags, counts past its slot, offsets inside the ring) is checked here,
// before anything runs.
//
// A ring stops (its state word says kStateStopped, nothing more is taken) on
// UnregisterStepRing, at shutdown, and when the process that registered its region exits
// (the region's pidfd): then the ring is released and its region unregistered. A descriptor
// the poller has taken runs to completion and commits (its completion is written into the
// region, which stays mapped until the ring is gone); a published descriptor not yet taken
// when the owner's exit is seen is dropped, and one not yet published is never read. So a
// step is never half-applied: each is committed whole or not at all.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/step_ring.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "server/config/profile.h"
#include "server/service/data_plane.h"

namespace decode_indexer::service {

// Runs one step through the service's step path; `taken` is when the poller took it
// (timeout_us counts from there).
using RingStepFn = std::function<absl::Status(const v1::DecodeStepRequest& request,
                                              v1::DecodeStepResponse& response,
                                              std::chrono::steady_clock::time_point taken)>;

struct StepRingConfig {
  uint64_t region_id = 0;
  uint32_t slots = 0;
  uint32_t slot_bytes = 0;
  uint32_t spin_us = 50;
};

// The most requests a descriptor can carry in a slot of `slot_bytes` with every column and
// max_rows_per_sequence explicit row lengths per request (RegisterStepRingResponse).
uint32_t MaxSequencesPerSlot(uint32_t slot_bytes, int32_t max_rows_per_sequence);

// The request a descriptor stands for. `columns` are the slot's bytes after the descriptor
// (at least ring::ColumnsOf(...).end - sizeof(StepDescriptor) of them, checked by the
// caller). Checks only what is the descriptor's own (flags, answer_encoding, offsets inside
// the ring); everything else is the step path's. Exposed for the tests.
absl::Status DescriptorToRequest(const ring::StepDescriptor& d, const uint8_t* columns,
                                 uint64_t region_id, uint64_t ring_bytes,
                                 const config::Profile& profile, v1::DecodeStepRequest& out);

// What the poller does with descriptor `n` in its slot (`slot`: config.slot_bytes bytes the
// client may still be writing): snapshots the descriptor into `d` and its columns into
// `columns` (config.slot_bytes bytes, reused step after step), checks what is the
// descriptor's own (its number; counts that fit the slot and the completion; then
// DescriptorToRequest's) and builds the request into `out`. Exposed for the fuzzer.
absl::Status ReadDescriptor(const uint8_t* slot, uint64_t n, const StepRingConfig& config,
                            uint64_t ring_bytes, const config::Profile& profile,
                            ring::StepDescriptor& d, std::vector<uint8_t>& columns,
                            v1::DecodeStepRequest& out);

class StepRing {
 public:
  // Checks the config against the region and the ring header the client wrote (magic,
  // version, slots, slot_bytes, counters at 0) and the profile (the slot holds a request).
  static absl::StatusOr<std::unique_ptr<StepRing>> Open(std::shared_ptr<SharedMemoryRegion> region,
                                                        const StepRingConfig& config,
                                                        const config::Profile& profile);
  ~StepRing();  // Stop()
  StepRing(const StepRing&) = delete;
  StepRing& operator=(const StepRing&) = delete;

  // Starts the poller. `on_owner_exit` runs on the poller thread, once, after the ring
  // stopped because the region's owner exited.
  void Start(RingStepFn run, std::function<void()> on_owner_exit);
  // Stops taking descriptors (a step running finishes first) and joins the poller; from the
  // poller thread itself only flags the stop. Idempotent.
  void Stop();

  uint64_t region_id() const { return config_.region_id; }
  uint64_t ring_bytes() const { return ring_bytes_; }
  uint32_t max_sequences() const { return max_sequences_; }
  uint64_t steps() const { return steps_.load(); }

 private:
  StepRing(std::shared_ptr<SharedMemoryRegion> region, const StepRingConfig& config,
           const config::Profile& profile);
  ring::RingHeader& header() const { return *reinterpret_cast<ring::RingHeader*>(region_->base()); }
  void Poll();
  // Waits for the next descriptor (spin, then the doorbell futex); false when the ring must
  // stop (Stop, or the owner exited).
  bool Idle(uint64_t next);
  bool OwnerExited() const;
  void RunOne(uint64_t n);
  void Complete(uint64_t n, uint64_t step_id, const absl::Status& status,
                const v1::DecodeStepResponse* response,
                std::chrono::steady_clock::time_point taken);

  std::shared_ptr<SharedMemoryRegion> region_;
  const StepRingConfig config_;
  const config::Profile& profile_;
  uint64_t ring_bytes_ = 0;
  uint32_t max_sequences_ = 0;
  RingStepFn run_;
  std::function<void()> on_owner_exit_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> steps_{0};
  std::thread thread_;
  // Reused step after step (the poller's only).
  std::vector<uint8_t> columns_;
  v1::DecodeStepRequest request_;
  v1::DecodeStepResponse response_;
};

class StepRingRegistry {
 public:
  static constexpr size_t kMaxRings = 16;
  StepRingRegistry() = default;
  ~StepRingRegistry() { StopAll(); }

  // Opens and starts a ring over `region`; `on_owner_exit(region_id)` runs (on the poller
  // thread) after the ring stopped because the region's owner exited and was released.
  absl::StatusOr<v1::RegisterStepRingResponse> Register(
      std::shared_ptr<SharedMemoryRegion> region, const StepRingConfig& config,
      const config::Profile& profile, RingStepFn run,
      std::function<void(uint64_t region_id)> on_owner_exit);
  // Stops and releases the ring; answers the steps it ran.
  absl::StatusOr<uint64_t> Unregister(uint64_t ring_id);
  // Stops every ring (drain, shutdown); later registrations are refused.
  void StopAll();
  size_t size() const;

 private:
  void Released(uint64_t ring_id);  // an owner exited: from its poller thread
  void JoinExited();                // rings whose owner exited, stopped outside the lock

  mutable std::mutex mu_;
  bool stopped_ = false;
  std::unordered_map<uint64_t, std::unique_ptr<StepRing>> rings_;
  std::vector<std::unique_ptr<StepRing>> exited_;
};

}  // namespace decode_indexer::service
