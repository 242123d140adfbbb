// The step ring of the same-host fast path: its binary layout, shared by the server's poller
// (server/service/step_ring.cc) and the C++ client (client/fast_path.h). docs/fast-path.md
// describes the protocol; this header is the layout's one definition.
//
// The ring lies at offset 0 of a shared-memory region (a sealed memfd the client registered
// over the shm socket), little-endian, 64-byte aligned:
//
//   [0, 1024)                          RingHeader
//   [1024, 1024 + slots * slot_bytes)  descriptor slots: StepDescriptor + its columns
//   [.., + slots * slot_bytes)         completion slots: StepCompletion + lengths
//   rounded up to 4096: ring_bytes     the step data (q, weights, keys, answers) after it
//
// Descriptor n (1, 2, ...) lives in slot (n - 1) % slots and its completion in the same
// completion slot. The client may reuse a slot only once the completion of the descriptor
// before it in that slot has been read (completed >= n - slots).
//
// Protocol (both sides, no locks):
//   client:  write descriptor n (sequence = n) into its slot;
//            produced.store(n, release); doorbell.fetch_add(1);
//            if (server_sleeping) futex_wake(&doorbell)
//   server:  sees produced >= n (acquire), copies the descriptor out of the slot, checks
//            and runs it, writes completion n, completed.store(n, release);
//            completion_bell.fetch_add(1); if (client_waiting) futex_wake(&completion_bell)
//   client:  completed >= n (acquire): completion n is readable.
// The futexes are shared (not FUTEX_PRIVATE): they are waited on across processes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace decode_indexer::ring {

inline constexpr uint64_t kMagic = 0x31304752'49444944ull;  // "DIDIRG01" little-endian
inline constexpr uint32_t kVersion = 1;
inline constexpr uint64_t kHeaderBytes = 1024;
inline constexpr uint32_t kMaxSlots = 1024;
inline constexpr uint32_t kMinSlotBytes = 1024;
inline constexpr uint32_t kMaxSlotBytes = 1u << 20;
inline constexpr uint32_t kMessageBytes = 256;  // completion messages are cut to this

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the ring's counters are shared between processes: they must be lock-free");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4);

// Server states (RingHeader.server_state).
enum ServerState : uint32_t {
  kStateUnregistered = 0,  // not (yet) served
  kStateServing = 1,       // a poller takes descriptors
  kStateStopped = 2,       // released (unregistered, shutdown, owner gone): nothing is taken
};

struct RingHeader {
  // Written by the client before RegisterStepRing, checked once by the server.
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t slot_bytes;
  uint32_t reserved0;
  uint8_t pad0[40];
  // Client -> server, each on its own cache line.
  alignas(64) std::atomic<uint64_t> produced;  // descriptors published (the last one's number)
  alignas(64) std::atomic<uint32_t> doorbell;  // futex word: bumped after each publish
  std::atomic<uint32_t> client_waiting;        // the client sleeps on completion_bell
  // Server -> client.
  alignas(64) std::atomic<uint64_t> completed;        // completions written
  alignas(64) std::atomic<uint32_t> completion_bell;  // futex word: bumped after each completion
  std::atomic<uint32_t> server_sleeping;              // the poller sleeps on doorbell
  alignas(64) std::atomic<uint32_t> server_state;     // ServerState
  uint8_t pad1[1024 - 5 * 64 - 4];
};
static_assert(sizeof(RingHeader) == kHeaderBytes);
static_assert(offsetof(RingHeader, produced) == 64 && offsetof(RingHeader, doorbell) == 128 &&
              offsetof(RingHeader, completed) == 192 &&
              offsetof(RingHeader, completion_bell) == 256 &&
              offsetof(RingHeader, server_state) == 320);

// StepDescriptor.flags.
enum DescriptorFlags : uint32_t {
  kReturnCandidates = 1u << 0,  // DecodeStepRequest.return_candidates
  kNumRowsColumn = 1u << 1,     // a num_rows column (else rows_per_sequence for all)
  kNewKeyCountsColumn = 1u << 2,
  kNewKeysPositionsColumn = 1u << 3,
  kAnswerCudaIpc = 1u << 4,  // answer / candidates offsets are in cuda_ipc_region_id's buffer
  // q / q_scales / weights offsets are in cuda_ipc_region_id's buffer too (read device to
  // device, checked on the device: CudaIpcStep.q_offset); needs kAnswerCudaIpc.
  kInputsCudaIpc = 1u << 5,
  // GPU-side ordering with the CUDA IPC events the buffer was registered with
  // (CudaIpcStep.wait_inputs_event / record_answer_event): kWaitInputsEvent needs
  // kInputsCudaIpc or kKeysCudaIpc, kRecordAnswerEvent needs kAnswerCudaIpc.
  kWaitInputsEvent = 1u << 6,
  kRecordAnswerEvent = 1u << 7,
  // new_keys_offset / new_key_scales_offset are in cuda_ipc_region_id's buffer (read device
  // to device, checked on the device: CudaIpcStep.new_keys_offset; pre-quantized keys only,
  // both offsets multiples of 16); needs kAnswerCudaIpc, not kInputsCudaIpc. Without it they
  // are offsets in the ring's region, as before this flag existed.
  kKeysCudaIpc = 1u << 8,
  kKnownFlags = (1u << 9) - 1,
};

// One step: the columnar DecodeStepRequest (the same fields, the same checks, the same
// errors: a completion's message names the proto field, e.g. "num_rows[2]: ..." or
// "shared_memory.q_offset: ..." for this descriptor's q_offset). Dtypes are v1::DType
// numbers; 0 (DTYPE_UNSPECIFIED) leaves an optional tensor out. Offsets are bytes from the
// start of the region and must lie past the ring (ring_bytes).
struct StepDescriptor {
  uint64_t sequence;  // this descriptor's number n (1, 2, ...)
  uint64_t step_id;   // echoed in the completion
  int32_t layer;
  uint32_t flags;              // DescriptorFlags
  uint32_t sequence_count;     // requests (sequence_ids entries)
  int32_t rows_per_sequence;   // without kNumRowsColumn
  uint32_t row_lengths_count;  // 0 (all causal) or the step's rows
  int32_t answer_encoding;     // ANSWER_ENCODING_RAW (the only one a buffer answer takes)
  // q [rows, H, D]; q_scales [rows, H, D/32] (FP4 q); weights [rows, H]; positions [rows];
  // new_keys [new_keys_rows, D]; new_key_scales [new_keys_rows] (FP8) or
  // [new_keys_rows, D/32] (FP4, UE8M0).
  int32_t q_dtype;
  int32_t q_scales_dtype;
  int32_t weights_dtype;
  int32_t positions_dtype;
  int32_t new_keys_dtype;
  int32_t new_key_scales_dtype;
  int64_t new_keys_rows;
  int64_t timeout_us;  // DecodeStepRequest.timeout_us, counted from when the poller took it
  uint64_t q_offset;
  uint64_t q_scales_offset;
  uint64_t weights_offset;
  uint64_t positions_offset;
  uint64_t new_keys_offset;
  uint64_t new_key_scales_offset;
  uint64_t answer_offset;       // int32 [rows, K]
  uint64_t candidates_offset;   // int32 [rows, num_candidate_blocks] with kReturnCandidates
  uint64_t cuda_ipc_region_id;  // with kAnswerCudaIpc: a RegisterCudaIpcMemory region
  uint8_t reserved[256 - 152];
  // Then, in the slot, the columns (each 8-byte aligned at its start):
  //   uint64 sequence_ids[sequence_count]
  //   int32  num_rows[sequence_count]            with kNumRowsColumn
  //   int32  new_key_counts[sequence_count]      with kNewKeyCountsColumn
  //   int64  new_keys_positions[sequence_count]  with kNewKeysPositionsColumn (-1: append)
  //   int32  row_lengths[row_lengths_count]
};
static_assert(sizeof(StepDescriptor) == 256);
static_assert(offsetof(StepDescriptor, cuda_ipc_region_id) == 144);

struct StepCompletion {
  uint64_t sequence;  // the descriptor's number
  int32_t code;       // absl / gRPC status code (0 = OK)
  uint32_t message_bytes;
  uint64_t step_id;
  int64_t queue_us;    // ServerTiming.queue_us
  int64_t compute_us;  // ServerTiming.compute_us
  uint32_t lengths_count;
  uint32_t sharded;
  int64_t server_us;  // from taking the descriptor to writing this record
  uint8_t reserved[8];
  char message[kMessageBytes];  // the error, not NUL-terminated
  // Then int64 lengths[lengths_count]: each request's cache length after the step.
};
static_assert(sizeof(StepCompletion) == 320);

inline constexpr uint64_t Align8(uint64_t v) { return (v + 7) & ~uint64_t{7}; }

// Where a descriptor's columns lie, relative to the slot's start; `end` is the bytes used.
struct ColumnOffsets {
  uint64_t sequence_ids = 0, num_rows = 0, new_key_counts = 0, new_keys_positions = 0,
           row_lengths = 0, end = 0;
};
inline ColumnOffsets ColumnsOf(uint32_t flags, uint64_t sequence_count,
                               uint64_t row_lengths_count) {
  ColumnOffsets c;
  uint64_t at = sizeof(StepDescriptor);
  c.sequence_ids = at;
  at += 8 * sequence_count;
  c.num_rows = at;
  if (flags & kNumRowsColumn) at += 4 * sequence_count;
  c.new_key_counts = at;
  if (flags & kNewKeyCountsColumn) at += 4 * sequence_count;
  at = Align8(at);
  c.new_keys_positions = at;
  if (flags & kNewKeysPositionsColumn) at += 8 * sequence_count;
  c.row_lengths = at;
  at += 4 * row_lengths_count;
  c.end = at;
  return c;
}

inline constexpr uint64_t RingBytes(uint32_t slots, uint32_t slot_bytes) {
  return (kHeaderBytes + 2 * uint64_t{slots} * slot_bytes + 4095) & ~uint64_t{4095};
}
inline constexpr uint64_t DescriptorSlot(uint32_t slots, uint32_t slot_bytes, uint64_t n) {
  return kHeaderBytes + ((n - 1) % slots) * uint64_t{slot_bytes};
}
inline constexpr uint64_t CompletionSlot(uint32_t slots, uint32_t slot_bytes, uint64_t n) {
  return kHeaderBytes + uint64_t{slots} * slot_bytes + ((n - 1) % slots) * uint64_t{slot_bytes};
}
// Lengths a completion slot holds.
inline constexpr uint64_t MaxLengths(uint32_t slot_bytes) {
  return (slot_bytes - sizeof(StepCompletion)) / 8;
}

}  // namespace decode_indexer::ring
