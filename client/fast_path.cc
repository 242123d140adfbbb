#include "client/fast_path.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <ctime>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace decode_indexer::client {
namespace {

using Clock = std::chrono::steady_clock;

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us) {
  timespec ts{static_cast<time_t>(timeout_us / 1000000),
              static_cast<long>(timeout_us % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

absl::StatusOr<std::unique_ptr<FastPathRing>> FastPathRing::Create(IndexerClient& client,
                                                                   const FastPathOptions& options) {
  absl::StatusOr<v1::ServerInfo> info = client.ServerInfo();
  if (!info.ok()) return info.status();
  std::unique_ptr<FastPathRing> r(new FastPathRing());
  r->client_ = &client;
  r->options_ = options;
  r->topk_ = info->topk();
  r->num_candidate_blocks_ = info->num_candidate_blocks();
  r->ring_bytes_ = ring::RingBytes(options.slots, options.slot_bytes);
  absl::StatusOr<std::unique_ptr<SharedMemory>> memory = SharedMemory::Create(
      "di-step-ring", r->ring_bytes_ + std::max<uint64_t>(options.data_bytes, 64));
  if (!memory.ok()) return memory.status();
  r->memory_ = *std::move(memory);
  // The header before the server sees the region (the memfd is zero-filled: counters at 0).
  ring::RingHeader& h = r->header();
  h.magic = ring::kMagic;
  h.version = ring::kVersion;
  h.slots = options.slots;
  h.slot_bytes = options.slot_bytes;
  absl::StatusOr<uint64_t> region = client.RegisterSharedMemory(*r->memory_, options.socket_path);
  if (!region.ok()) return region.status();
  r->region_id_ = *region;
  v1::RegisterStepRingRequest request;
  request.set_region_id(r->region_id_);
  request.set_slots(options.slots);
  request.set_slot_bytes(options.slot_bytes);
  request.set_spin_us(options.server_spin_us);
  absl::StatusOr<v1::RegisterStepRingResponse> ring = client.RegisterStepRing(request);
  if (!ring.ok()) {
    client.UnregisterSharedMemory(r->region_id_).IgnoreError();
    return ring.status();
  }
  r->ring_id_ = ring->ring_id();
  r->max_sequences_ = ring->max_sequences();
  r->registered_ = true;
  return r;
}

FastPathRing::~FastPathRing() { Unregister().IgnoreError(); }

absl::Status FastPathRing::Unregister() {
  if (!registered_) return absl::OkStatus();
  registered_ = false;
  absl::StatusOr<uint64_t> steps = client_->UnregisterStepRing(ring_id_);
  absl::Status region = client_->UnregisterSharedMemory(region_id_);
  if (!steps.ok()) return steps.status();
  return region;
}

absl::Status WriteDescriptor(const RingStep& step, uint64_t n, std::span<uint8_t> slot) {
  ring::StepDescriptor d = step.descriptor;
  d.sequence = n;
  d.sequence_count = static_cast<uint32_t>(step.sequence_ids.size());
  d.flags &= ~(ring::kNumRowsColumn | ring::kNewKeyCountsColumn | ring::kNewKeysPositionsColumn);
  if (!step.num_rows.empty()) d.flags |= ring::kNumRowsColumn;
  if (!step.new_key_counts.empty()) d.flags |= ring::kNewKeyCountsColumn;
  if (!step.new_keys_positions.empty()) d.flags |= ring::kNewKeysPositionsColumn;
  d.row_lengths_count = static_cast<uint32_t>(step.row_lengths.size());
  // Wrong contents are the server's to name; here the columns only must fit the slot.
  auto fits = [&](size_t count) { return count == 0 || count == step.sequence_ids.size(); };
  if (!fits(step.num_rows.size()) || !fits(step.new_key_counts.size()) ||
      !fits(step.new_keys_positions.size())) {
    return absl::InvalidArgumentError(
        "fast path: num_rows, new_key_counts and new_keys_positions take one entry per "
        "sequence_ids entry (or none)");
  }
  const ring::ColumnOffsets c = ring::ColumnsOf(d.flags, d.sequence_count, d.row_lengths_count);
  if (c.end > slot.size()) {
    return absl::InvalidArgumentError(absl::StrCat("fast path: the step's columns take ", c.end,
                                                   " bytes, past the slot's ", slot.size(),
                                                   " (make the ring with a larger slot_bytes)"));
  }
  std::memcpy(slot.data(), &d, sizeof(d));
  auto put = [&](uint64_t at, const void* data, size_t bytes) {
    if (bytes > 0) std::memcpy(slot.data() + at, data, bytes);
  };
  put(c.sequence_ids, step.sequence_ids.data(), step.sequence_ids.size_bytes());
  put(c.num_rows, step.num_rows.data(), step.num_rows.size_bytes());
  put(c.new_key_counts, step.new_key_counts.data(), step.new_key_counts.size_bytes());
  put(c.new_keys_positions, step.new_keys_positions.data(), step.new_keys_positions.size_bytes());
  put(c.row_lengths, step.row_lengths.data(), step.row_lengths.size_bytes());
  return absl::OkStatus();
}

absl::StatusOr<StagedStep> StageRequest(const v1::DecodeStepRequest& request,
                                        std::span<uint8_t> region, uint64_t data_offset,
                                        int32_t topk, int32_t num_candidate_blocks) {
  if (request.sequences_size() > 0 || request.has_shared_memory() || request.has_cuda_ipc()) {
    return absl::InvalidArgumentError("fast path: stage a columnar step with its tensors inline");
  }
  StagedStep out;
  RingStep& step = out.step;
  ring::StepDescriptor& d = step.descriptor;
  d.layer = request.layer();
  d.step_id = request.step_id();
  d.rows_per_sequence = request.rows_per_sequence();
  d.answer_encoding = request.answer_encoding();
  d.timeout_us = request.timeout_us();
  if (request.return_candidates()) d.flags |= ring::kReturnCandidates;
  uint64_t at = data_offset;
  bool fits = true;
  auto stage = [&](const v1::Tensor& t, int32_t* dtype, uint64_t* offset) {
    *dtype = t.dtype();
    *offset = at;
    if (t.dtype() == v1::DTYPE_UNSPECIFIED) return;
    if (at + t.data().size() > region.size()) {
      fits = false;
      return;
    }
    std::memcpy(region.data() + at, t.data().data(), t.data().size());
    at = AlignUp(at + t.data().size(), 64);
  };
  stage(request.q(), &d.q_dtype, &d.q_offset);
  stage(request.q_scales(), &d.q_scales_dtype, &d.q_scales_offset);
  stage(request.weights(), &d.weights_dtype, &d.weights_offset);
  stage(request.positions(), &d.positions_dtype, &d.positions_offset);
  stage(request.new_keys(), &d.new_keys_dtype, &d.new_keys_offset);
  stage(request.new_key_scales(), &d.new_key_scales_dtype, &d.new_key_scales_offset);
  d.new_keys_rows = request.new_keys().shape_size() > 0 ? request.new_keys().shape(0) : 0;
  out.rows = request.q().shape_size() > 0 ? std::max<int64_t>(request.q().shape(0), 0) : 0;
  out.answer_bytes = uint64_t(out.rows) * uint64_t(std::max(topk, 0)) * 4;
  out.candidate_bytes = uint64_t(out.rows) * uint64_t(std::max(num_candidate_blocks, 0)) * 4;
  d.answer_offset = at;
  at = AlignUp(at + out.answer_bytes, 64);
  d.candidates_offset = at;
  at = AlignUp(at + out.candidate_bytes, 64);
  if (!fits || at > region.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("fast path: the step needs ", at - data_offset,
                                                     " bytes of step data, the "
                                                     "region has ",
                                                     region.size() - data_offset,
                                                     " (FastPathOptions.data_bytes)"));
  }
  step.sequence_ids =
      std::span<const uint64_t>(request.sequence_ids().data(), request.sequence_ids_size());
  step.num_rows = std::span<const int32_t>(request.num_rows().data(), request.num_rows_size());
  step.new_key_counts =
      std::span<const int32_t>(request.new_key_counts().data(), request.new_key_counts_size());
  step.new_keys_positions = std::span<const int64_t>(request.new_keys_positions().data(),
                                                     request.new_keys_positions_size());
  step.row_lengths =
      std::span<const int32_t>(request.row_lengths().data(), request.row_lengths_size());
  return out;
}

absl::StatusOr<uint64_t> FastPathRing::Submit(const RingStep& step) {
  ring::RingHeader& h = header();
  if (h.server_state.load(std::memory_order_acquire) != ring::kStateServing) {
    return absl::FailedPreconditionError("fast path: the ring is not served (released)");
  }
  if (produced_ - h.completed.load(std::memory_order_acquire) >= options_.slots) {
    return absl::FailedPreconditionError(
        absl::StrCat("fast path: ", options_.slots, " steps in flight; Wait for one first"));
  }
  const uint64_t n = produced_ + 1;
  uint8_t* slot = region() + ring::DescriptorSlot(options_.slots, options_.slot_bytes, n);
  if (absl::Status s = WriteDescriptor(step, n, std::span<uint8_t>(slot, options_.slot_bytes));
      !s.ok()) {
    return s;
  }
  // Publish, then the doorbell (the poller reads the bell before it re-checks the counter).
  h.produced.store(n, std::memory_order_seq_cst);
  h.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h.server_sleeping.load(std::memory_order_seq_cst) != 0) FutexWake(&h.doorbell);
  produced_ = n;
  return n;
}

absl::StatusOr<uint64_t> FastPathRing::SubmitRawForTesting(std::span<const uint8_t> slot_bytes) {
  ring::RingHeader& h = header();
  const uint64_t n = produced_ + 1;
  uint8_t* slot = region() + ring::DescriptorSlot(options_.slots, options_.slot_bytes, n);
  std::memcpy(slot, slot_bytes.data(), std::min<size_t>(slot_bytes.size(), options_.slot_bytes));
  h.produced.store(n, std::memory_order_seq_cst);
  h.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h.server_sleeping.load(std::memory_order_seq_cst) != 0) FutexWake(&h.doorbell);
  produced_ = n;
  return n;
}

absl::StatusOr<RingCompletion> FastPathRing::Wait(uint64_t sequence,
                                                  std::chrono::microseconds timeout) {
  if (sequence == 0 || sequence > produced_) {
    return absl::InvalidArgumentError(
        absl::StrCat("fast path: step ", sequence, " was not submitted (last: ", produced_, ")"));
  }
  ring::RingHeader& h = header();
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  const auto spin_until = start + std::chrono::microseconds(options_.client_spin_us);
  while (h.completed.load(std::memory_order_acquire) < sequence) {
    const auto now = Clock::now();
    if (h.server_state.load(std::memory_order_acquire) == ring::kStateStopped &&
        h.completed.load(std::memory_order_acquire) < sequence) {
      return absl::UnavailableError("fast path: the server released the ring");
    }
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("fast path: step ", sequence, " not completed in time"));
    }
    if (now < spin_until) continue;
    const uint32_t bell = h.completion_bell.load(std::memory_order_seq_cst);
    h.client_waiting.store(1, std::memory_order_seq_cst);
    if (h.completed.load(std::memory_order_seq_cst) < sequence) {
      const int64_t left =
          std::chrono::duration_cast<std::chrono::microseconds>(deadline - now).count();
      FutexWait(&h.completion_bell, bell, std::min<int64_t>(left + 1, 50000));
    }
    h.client_waiting.store(0, std::memory_order_relaxed);
  }
  const uint8_t* slot =
      region() + ring::CompletionSlot(options_.slots, options_.slot_bytes, sequence);
  ring::StepCompletion c;
  std::memcpy(&c, slot, sizeof(c));
  if (c.sequence != sequence) {
    return absl::DataLossError(absl::StrCat("fast path: completion slot holds step ", c.sequence,
                                            ", expected ", sequence, " (read in order)"));
  }
  RingCompletion out;
  out.sequence = c.sequence;
  out.step_id = c.step_id;
  out.status = absl::Status(static_cast<absl::StatusCode>(c.code),
                            std::string(c.message, std::min(c.message_bytes, ring::kMessageBytes)));
  out.queue_us = c.queue_us;
  out.compute_us = c.compute_us;
  out.server_us = c.server_us;
  out.sharded = c.sharded != 0;
  const uint64_t lengths =
      std::min<uint64_t>(c.lengths_count, ring::MaxLengths(options_.slot_bytes));
  out.lengths.resize(lengths);
  if (lengths > 0) std::memcpy(out.lengths.data(), slot + sizeof(c), lengths * sizeof(int64_t));
  return out;
}

absl::StatusOr<RingCompletion> FastPathRing::Step(const RingStep& step,
                                                  std::chrono::microseconds timeout) {
  absl::StatusOr<uint64_t> n = Submit(step);
  if (!n.ok()) return n.status();
  return Wait(*n, timeout);
}

absl::StatusOr<v1::DecodeStepResponse> FastPathRing::StepRequest(
    const v1::DecodeStepRequest& request) {
  absl::StatusOr<StagedStep> staged =
      StageRequest(request, std::span<uint8_t>(region(), region_bytes()), data_offset(), topk_,
                   num_candidate_blocks_);
  if (!staged.ok()) return staged.status();
  absl::StatusOr<RingCompletion> done = Step(staged->step);
  if (!done.ok()) return done.status();
  if (!done->status.ok()) return done->status;
  const ring::StepDescriptor& d = staged->step.descriptor;
  v1::DecodeStepResponse response;
  response.set_step_id(done->step_id);
  v1::Tensor* topk = response.mutable_topk();
  topk->set_dtype(v1::DTYPE_INT32);
  topk->add_shape(staged->rows);
  topk->add_shape(topk_);
  topk->set_data(region() + d.answer_offset, staged->answer_bytes);
  if (request.return_candidates()) {
    v1::Tensor* cand = response.mutable_candidate_blocks();
    cand->set_dtype(v1::DTYPE_INT32);
    cand->add_shape(staged->rows);
    cand->add_shape(num_candidate_blocks_);
    cand->set_data(region() + d.candidates_offset, staged->candidate_bytes);
  }
  response.mutable_timing()->set_queue_us(done->queue_us);
  response.mutable_timing()->set_compute_us(done->compute_us);
  response.set_sharded(done->sharded);
  for (int64_t len : done->lengths) response.add_lengths(len);
  return response;
}

}  // namespace decode_indexer::client
