#include "server/service/step_ring.h"

#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <ctime>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace decode_indexer::service {
namespace {

using Clock = std::chrono::steady_clock;
using ring::StepDescriptor;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Shared (not private) futexes: the other side is another process.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us) {
  timespec ts{static_cast<time_t>(timeout_us / 1000000),
              static_cast<long>(timeout_us % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

template <typename T>
void CopyColumn(const uint8_t* at, uint64_t count, google::protobuf::RepeatedField<T>* out) {
  out->Resize(static_cast<int>(count), T{});
  if (count > 0) std::memcpy(out->mutable_data(), at, count * sizeof(T));
}

// A shape-only Tensor (its bytes are in the region).
void ShapeOnly(int32_t dtype, std::initializer_list<int64_t> shape, v1::Tensor* t) {
  t->set_dtype(static_cast<v1::DType>(dtype));
  for (int64_t d : shape) t->add_shape(d);
}

}  // namespace

uint32_t MaxSequencesPerSlot(uint32_t slot_bytes, int32_t max_rows_per_sequence) {
  if (slot_bytes < sizeof(ring::StepCompletion) + 8) return 0;
  const uint64_t per_request = 8 + 4 + 4 + 8 + 4 * uint64_t(std::max(1, max_rows_per_sequence));
  const uint64_t by_descriptor = (slot_bytes - sizeof(StepDescriptor) - 8) / per_request;
  return static_cast<uint32_t>(std::min<uint64_t>(by_descriptor, ring::MaxLengths(slot_bytes)));
}

absl::Status DescriptorToRequest(const StepDescriptor& d, const uint8_t* columns,
                                 uint64_t region_id, uint64_t ring_bytes,
                                 const config::Profile& profile, v1::DecodeStepRequest& out) {
  out.Clear();
  if ((d.flags & ~ring::kKnownFlags) != 0) {
    return Invalid("flags", absl::StrCat("unknown bits 0x", absl::Hex(d.flags & ~ring::kKnownFlags),
                                         " (known: 0x", absl::Hex(ring::kKnownFlags), ")"));
  }
  if (d.answer_encoding != v1::ANSWER_ENCODING_RAW) {
    return Invalid("answer_encoding",
                   absl::StrCat(d.answer_encoding,
                                ": the ring answers int32 [rows, K] into a buffer "
                                "(ANSWER_ENCODING_RAW, 0)"));
  }
  const bool ipc = (d.flags & ring::kAnswerCudaIpc) != 0;
  const bool ipc_inputs = (d.flags & ring::kInputsCudaIpc) != 0;
  if (ipc_inputs && !ipc) {
    return Invalid("flags", "kInputsCudaIpc (q in the CUDA IPC buffer) needs kAnswerCudaIpc");
  }
  const bool ipc_keys = (d.flags & ring::kKeysCudaIpc) != 0;
  if (ipc_keys && !ipc) {
    return Invalid("flags", "kKeysCudaIpc (new keys in the CUDA IPC buffer) needs kAnswerCudaIpc");
  }
  const bool wait_inputs = (d.flags & ring::kWaitInputsEvent) != 0;
  const bool record_answer = (d.flags & ring::kRecordAnswerEvent) != 0;
  if (wait_inputs && !ipc_inputs && !ipc_keys) {
    return Invalid("flags",
                   "kWaitInputsEvent (wait for the inputs on the GPU) needs kInputsCudaIpc or "
                   "kKeysCudaIpc");
  }
  if (record_answer && !ipc) {
    return Invalid("flags", "kRecordAnswerEvent (answer ready on the GPU) needs kAnswerCudaIpc");
  }
  // Step data lies past the ring: the answer must never land on the counters or slots.
  struct Offset {
    const char* field;
    uint64_t value;
    bool used;
  };
  const Offset offsets[] = {
      {"q_offset", d.q_offset, !ipc_inputs},
      {"q_scales_offset", d.q_scales_offset, !ipc_inputs && d.q_scales_dtype != 0},
      {"weights_offset", d.weights_offset, !ipc_inputs},
      {"positions_offset", d.positions_offset, d.positions_dtype != 0},
      {"new_keys_offset", d.new_keys_offset, !ipc_keys && d.new_keys_dtype != 0},
      {"new_key_scales_offset", d.new_key_scales_offset, !ipc_keys && d.new_key_scales_dtype != 0},
      {"answer_offset", d.answer_offset, !ipc},
      {"candidates_offset", d.candidates_offset, !ipc && (d.flags & ring::kReturnCandidates)},
  };
  for (const Offset& o : offsets) {
    if (o.used && o.value < ring_bytes) {
      return Invalid(absl::StrCat("shared_memory.", o.field),
                     absl::StrCat(o.value, " lies inside the step ring (the region's first ",
                                  ring_bytes, " bytes)"));
    }
  }

  const ring::ColumnOffsets c = ring::ColumnsOf(d.flags, d.sequence_count, d.row_lengths_count);
  const uint8_t* base = columns - sizeof(StepDescriptor);  // offsets count from the slot start
  const uint64_t n = d.sequence_count;
  out.set_layer(d.layer);
  out.set_step_id(d.step_id);
  out.set_return_candidates((d.flags & ring::kReturnCandidates) != 0);
  out.set_timeout_us(d.timeout_us);
  CopyColumn(base + c.sequence_ids, n, out.mutable_sequence_ids());
  // The rows the tensors' shapes are built for: each request's count clamped to what the
  // profile allows (a bad count is then reported by the step path, naming it).
  const int64_t max_rows = std::max(1, profile.max_rows_per_sequence);
  int64_t rows = 0;
  if (d.flags & ring::kNumRowsColumn) {
    CopyColumn(base + c.num_rows, n, out.mutable_num_rows());
    for (int32_t r : out.num_rows()) rows += std::clamp<int64_t>(r, 1, max_rows);
  } else {
    out.set_rows_per_sequence(d.rows_per_sequence);
    rows = int64_t(n) * std::clamp<int64_t>(d.rows_per_sequence, 1, max_rows);
  }
  if (d.flags & ring::kNewKeyCountsColumn) {
    CopyColumn(base + c.new_key_counts, n, out.mutable_new_key_counts());
  }
  if (d.flags & ring::kNewKeysPositionsColumn) {
    CopyColumn(base + c.new_keys_positions, n, out.mutable_new_keys_positions());
  }
  CopyColumn(base + c.row_lengths, d.row_lengths_count, out.mutable_row_lengths());

  const int64_t h = profile.num_heads, dim = profile.head_dim;
  v1::SharedMemoryStep* sm = out.mutable_shared_memory();
  sm->set_region_id(region_id);
  ShapeOnly(d.q_dtype, {rows, h, dim}, out.mutable_q());
  if (d.q_scales_dtype != 0) {
    ShapeOnly(d.q_scales_dtype, {rows, h, dim / 32}, out.mutable_q_scales());
  }
  ShapeOnly(d.weights_dtype, {rows, h}, out.mutable_weights());
  if (ipc_inputs) {
    v1::CudaIpcStep* ci = out.mutable_cuda_ipc();
    ci->set_q_offset(d.q_offset);
    if (d.q_scales_dtype != 0) ci->set_q_scales_offset(d.q_scales_offset);
    ci->set_weights_offset(d.weights_offset);
  } else {
    sm->set_q_offset(d.q_offset);
    if (d.q_scales_dtype != 0) sm->set_q_scales_offset(d.q_scales_offset);
    sm->set_weights_offset(d.weights_offset);
  }
  if (d.positions_dtype != 0) {
    ShapeOnly(d.positions_dtype, {rows}, out.mutable_positions());
    sm->set_positions_offset(d.positions_offset);
  }
  // The keys' offsets: in the CUDA IPC buffer with kKeysCudaIpc (the edge then names a
  // missing tensor or a bad offset as cuda_ipc.new_keys_offset ...), else in the region.
  if (ipc_keys) out.mutable_cuda_ipc()->set_new_keys_offset(d.new_keys_offset);
  if (d.new_keys_dtype != 0) {
    ShapeOnly(d.new_keys_dtype, {d.new_keys_rows, dim}, out.mutable_new_keys());
    if (!ipc_keys) sm->set_new_keys_offset(d.new_keys_offset);
  }
  if (d.new_key_scales_dtype != 0) {
    if (d.new_key_scales_dtype == v1::DTYPE_UE8M0) {
      ShapeOnly(d.new_key_scales_dtype, {d.new_keys_rows, dim / 32}, out.mutable_new_key_scales());
    } else {
      ShapeOnly(d.new_key_scales_dtype, {d.new_keys_rows}, out.mutable_new_key_scales());
    }
    if (ipc_keys) {
      out.mutable_cuda_ipc()->set_new_key_scales_offset(d.new_key_scales_offset);
    } else {
      sm->set_new_key_scales_offset(d.new_key_scales_offset);
    }
  }
  if (ipc) {
    v1::CudaIpcStep* ci = out.mutable_cuda_ipc();
    ci->set_region_id(d.cuda_ipc_region_id);
    ci->set_answer_offset(d.answer_offset);
    ci->set_candidates_offset(d.candidates_offset);
    ci->set_wait_inputs_event(wait_inputs);
    ci->set_record_answer_event(record_answer);
  } else {
    sm->set_answer_offset(d.answer_offset);
    sm->set_candidates_offset(d.candidates_offset);
  }
  return absl::OkStatus();
}

absl::Status ReadDescriptor(const uint8_t* slot, uint64_t n, const StepRingConfig& config,
                            uint64_t ring_bytes, const config::Profile& profile, StepDescriptor& d,
                            std::vector<uint8_t>& columns, v1::DecodeStepRequest& out) {
  // A snapshot: the client may scribble over the slot meanwhile, the checks hold for the copy.
  // Every later read is of the copy (d, then `columns`), never of the slot: what is checked is
  // what is used. The compiler fence keeps it so: the slot is plain memory to the compiler,
  // which could otherwise fold a read of the copy back into a second read of the slot; past
  // the fence it must assume the slot changed.
  std::memcpy(&d, slot, sizeof(d));
  std::atomic_signal_fence(std::memory_order_seq_cst);
  absl::Status status;
  if (d.sequence != n) {
    status = Invalid("sequence",
                     absl::StrCat("expected descriptor ", n, ", got ", d.sequence, " (at most ",
                                  config.slots, " descriptors may be in flight)"));
  } else if (d.sequence_count > ring::MaxLengths(config.slot_bytes)) {
    status = Invalid(
        "sequence_count",
        absl::StrCat(d.sequence_count, " requests exceed the ", ring::MaxLengths(config.slot_bytes),
                     " a completion slot of ", config.slot_bytes, " bytes reports"));
  } else if (d.row_lengths_count > config.slot_bytes / 4) {
    status = Invalid("row_lengths_count",
                     absl::StrCat(d.row_lengths_count, " row lengths do not fit a slot of ",
                                  config.slot_bytes, " bytes"));
  } else {
    const ring::ColumnOffsets c = ring::ColumnsOf(d.flags, d.sequence_count, d.row_lengths_count);
    if (c.end > config.slot_bytes) {
      status = Invalid(
          d.row_lengths_count > 0 ? "row_lengths_count" : "sequence_count",
          absl::StrCat(d.sequence_count, " requests and ", d.row_lengths_count,
                       " row lengths take ", c.end, " bytes, past the slot's ", config.slot_bytes));
    } else {
      std::memcpy(columns.data(), slot + sizeof(d), c.end - sizeof(d));
      std::atomic_signal_fence(std::memory_order_seq_cst);
      status = DescriptorToRequest(d, columns.data(), config.region_id, ring_bytes, profile, out);
    }
  }
  return status;
}

StepRing::StepRing(std::shared_ptr<SharedMemoryRegion> region, const StepRingConfig& config,
                   const config::Profile& profile)
    : region_(std::move(region)), config_(config), profile_(profile) {}

absl::StatusOr<std::unique_ptr<StepRing>> StepRing::Open(std::shared_ptr<SharedMemoryRegion> region,
                                                         const StepRingConfig& config,
                                                         const config::Profile& profile) {
  if (config.slots < 1 || config.slots > ring::kMaxSlots) {
    return Invalid("slots",
                   absl::StrCat("must be in [1, ", ring::kMaxSlots, "], got ", config.slots));
  }
  if (config.slot_bytes < ring::kMinSlotBytes || config.slot_bytes > ring::kMaxSlotBytes ||
      config.slot_bytes % 64 != 0) {
    return Invalid("slot_bytes",
                   absl::StrCat("must be a multiple of 64 in [", ring::kMinSlotBytes, ", ",
                                ring::kMaxSlotBytes, "], got ", config.slot_bytes));
  }
  if (config.spin_us > 1000) {
    return Invalid("spin_us", absl::StrCat("must be in [0, 1000], got ", config.spin_us));
  }
  const uint32_t max_sequences =
      MaxSequencesPerSlot(config.slot_bytes, profile.max_rows_per_sequence);
  if (max_sequences < 1) {
    return Invalid(
        "slot_bytes",
        absl::StrCat(config.slot_bytes, " bytes hold no request of profile ", profile.name,
                     " (max_rows_per_sequence ", profile.max_rows_per_sequence, ")"));
  }
  const uint64_t ring_bytes = ring::RingBytes(config.slots, config.slot_bytes);
  if (region->size() <= ring_bytes) {
    return Invalid(
        "region_id",
        absl::StrCat("the region's ", region->size(), " bytes do not hold a ring of ", config.slots,
                     " x ", config.slot_bytes, " bytes (", ring_bytes, ") and step data after it"));
  }
  const auto* h = reinterpret_cast<const ring::RingHeader*>(region->base());
  if (h->magic != ring::kMagic || h->version != ring::kVersion) {
    return Invalid("region_id",
                   absl::StrCat("no step ring header at the region's start (magic 0x",
                                absl::Hex(h->magic), " version ", h->version, "; expected 0x",
                                absl::Hex(ring::kMagic), " version ", ring::kVersion, ")"));
  }
  if (h->slots != config.slots || h->slot_bytes != config.slot_bytes) {
    return Invalid("slots",
                   absl::StrCat("the ring header says ", h->slots, " x ", h->slot_bytes,
                                " bytes, the request ", config.slots, " x ", config.slot_bytes));
  }
  if (h->produced.load() != 0 || h->completed.load() != 0 ||
      h->server_state.load() != ring::kStateUnregistered) {
    return Invalid("region_id",
                   "the ring's counters and state must be 0 when it is registered (a fresh ring)");
  }
  std::unique_ptr<StepRing> ring(new StepRing(std::move(region), config, profile));
  ring->ring_bytes_ = ring_bytes;
  ring->max_sequences_ = max_sequences;
  ring->columns_.resize(config.slot_bytes);
  return ring;
}

StepRing::~StepRing() { Stop(); }

void StepRing::Start(RingStepFn run, std::function<void()> on_owner_exit) {
  run_ = std::move(run);
  on_owner_exit_ = std::move(on_owner_exit);
  header().server_state.store(ring::kStateServing, std::memory_order_release);
  thread_ = std::thread([this] { Poll(); });
}

void StepRing::Stop() {
  stop_.store(true);
  ring::RingHeader& h = header();
  h.doorbell.fetch_add(1);
  FutexWake(&h.doorbell);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

bool StepRing::OwnerExited() const {
  const int fd = region_->owner_pidfd();
  if (fd < 0) return false;
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

bool StepRing::Idle(uint64_t next) {
  ring::RingHeader& h = header();
  const auto spin_until = Clock::now() + std::chrono::microseconds(config_.spin_us);
  do {
    for (int i = 0; i < 64; ++i) {
      if (h.produced.load(std::memory_order_acquire) >= next) return true;
      if (stop_.load(std::memory_order_relaxed)) return false;
      CpuRelax();
    }
  } while (Clock::now() < spin_until);
  if (OwnerExited()) return false;
  // Sleep on the doorbell: the bell is read before the counter is checked again, so a publish
  // after the check changes the bell and the wait returns at once (no lost wake-up).
  const uint32_t bell = h.doorbell.load(std::memory_order_seq_cst);
  h.server_sleeping.store(1, std::memory_order_seq_cst);
  if (h.produced.load(std::memory_order_seq_cst) < next && !stop_.load()) {
    // Bounded, so the owner's exit is seen within this much even with no doorbell.
    FutexWait(&h.doorbell, bell, 50000);
  }
  h.server_sleeping.store(0, std::memory_order_relaxed);
  return !stop_.load();
}

void StepRing::Poll() {
  uint64_t next = 1;
  bool owner_exited = false;
  for (;;) {
    if (stop_.load(std::memory_order_acquire)) break;
    if (header().produced.load(std::memory_order_acquire) >= next) {
      RunOne(next++);
      // Even a client that keeps its counter far ahead cannot keep a dead ring alive.
      if (next % 256 == 0 && OwnerExited()) {
        owner_exited = true;
        break;
      }
      continue;
    }
    if (!Idle(next)) {
      owner_exited = !stop_.load();
      break;
    }
  }
  ring::RingHeader& h = header();
  h.server_state.store(ring::kStateStopped, std::memory_order_release);
  h.completion_bell.fetch_add(1);
  FutexWake(&h.completion_bell);
  if (owner_exited) {
    spdlog::info("step ring on region {:x}: its owner exited after {} steps; released",
                 config_.region_id, steps_.load());
    if (on_owner_exit_) on_owner_exit_();
  }
}

void StepRing::RunOne(uint64_t n) {
  const auto taken = Clock::now();
  const uint8_t* slot =
      region_->base() + ring::DescriptorSlot(config_.slots, config_.slot_bytes, n);
  StepDescriptor d;
  absl::Status status =
      ReadDescriptor(slot, n, config_, ring_bytes_, profile_, d, columns_, request_);
  response_.Clear();
  if (status.ok()) status = run_(request_, response_, taken);
  Complete(n, d.step_id, status, status.ok() ? &response_ : nullptr, taken);
  steps_.fetch_add(1, std::memory_order_relaxed);
}

void StepRing::Complete(uint64_t n, uint64_t step_id, const absl::Status& status,
                        const v1::DecodeStepResponse* response, Clock::time_point taken) {
  auto* c = reinterpret_cast<ring::StepCompletion*>(
      region_->base() + ring::CompletionSlot(config_.slots, config_.slot_bytes, n));
  ring::StepCompletion out{};
  out.sequence = n;
  out.code = static_cast<int32_t>(status.code());
  out.message_bytes =
      static_cast<uint32_t>(std::min<size_t>(status.message().size(), ring::kMessageBytes));
  if (out.message_bytes > 0) std::memcpy(out.message, status.message().data(), out.message_bytes);
  out.step_id = step_id;
  if (response != nullptr) {
    out.queue_us = response->timing().queue_us();
    out.compute_us = response->timing().compute_us();
    out.sharded = response->sharded() ? 1 : 0;
    out.lengths_count = static_cast<uint32_t>(
        std::min<uint64_t>(response->lengths_size(), ring::MaxLengths(config_.slot_bytes)));
    if (out.lengths_count > 0) {
      std::memcpy(reinterpret_cast<uint8_t*>(c) + sizeof(out), response->lengths().data(),
                  out.lengths_count * sizeof(int64_t));
    }
  }
  out.server_us =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - taken).count();
  std::memcpy(c, &out, sizeof(out));
  ring::RingHeader& h = header();
  h.completed.store(n, std::memory_order_seq_cst);
  h.completion_bell.fetch_add(1, std::memory_order_seq_cst);
  if (h.client_waiting.load(std::memory_order_seq_cst) != 0) FutexWake(&h.completion_bell);
}

absl::StatusOr<v1::RegisterStepRingResponse> StepRingRegistry::Register(
    std::shared_ptr<SharedMemoryRegion> region, const StepRingConfig& config,
    const config::Profile& profile, RingStepFn run,
    std::function<void(uint64_t region_id)> on_owner_exit) {
  JoinExited();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return absl::UnavailableError("the server is shutting down");
    if (rings_.size() >= kMaxRings) {
      return absl::ResourceExhaustedError(absl::StrCat("at most ", kMaxRings, " step rings"));
    }
    for (const auto& [id, r] : rings_) {
      if (r->region_id() == config.region_id) {
        return Invalid("region_id", "already holds a step ring");
      }
    }
  }
  absl::StatusOr<std::unique_ptr<StepRing>> ring =
      StepRing::Open(std::move(region), config, profile);
  if (!ring.ok()) return ring.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return absl::UnavailableError("the server is shutting down");
  for (const auto& [id, r] : rings_) {
    if (r->region_id() == config.region_id)
      return Invalid("region_id", "already holds a step ring");
  }
  uint64_t id = RandomRegionId();
  while (rings_.count(id) != 0) id = RandomRegionId();
  StepRing* raw = ring->get();
  v1::RegisterStepRingResponse response;
  response.set_ring_id(id);
  response.set_ring_bytes(raw->ring_bytes());
  response.set_max_sequences(raw->max_sequences());
  rings_.emplace(id, *std::move(ring));
  raw->Start(std::move(run),
             [this, id, region_id = config.region_id, cb = std::move(on_owner_exit)] {
               Released(id);
               if (cb) cb(region_id);
             });
  return response;
}

void StepRingRegistry::Released(uint64_t ring_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = rings_.find(ring_id);
  if (it == rings_.end()) return;  // being stopped by Unregister / StopAll
  exited_.push_back(std::move(it->second));
  rings_.erase(it);
}

void StepRingRegistry::JoinExited() {
  std::vector<std::unique_ptr<StepRing>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done.swap(exited_);
  }
  done.clear();  // joins: each poller has returned or is returning from its exit callback
}

absl::StatusOr<uint64_t> StepRingRegistry::Unregister(uint64_t ring_id) {
  JoinExited();
  std::unique_ptr<StepRing> ring;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rings_.find(ring_id);
    if (it == rings_.end()) {
      return absl::NotFoundError(
          "ring_id: no such step ring (unregistered, or released when its owner exited)");
    }
    ring = std::move(it->second);
    rings_.erase(it);
  }
  ring->Stop();
  return ring->steps();
}

void StepRingRegistry::StopAll() {
  std::unordered_map<uint64_t, std::unique_ptr<StepRing>> rings;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    rings.swap(rings_);
  }
  for (auto& [id, r] : rings) r->Stop();
  rings.clear();
  JoinExited();
}

size_t StepRingRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rings_.size();
}

}  // namespace decode_indexer::service
