// The executor: runs every state-changing operation in arrival order across the ranks.
//
// A call arrives validated: the service edge decodes a request into the plain structs below
// and checks, once, everything that needs no state (validated_step.h: a ValidatedStep or
// ValidatedAppend; byte counts and NaN/Inf of host bytes where it decodes them). A caller
// holding a plain StepInput / KeysInput (tests, benchmarks) goes through the same checks with
// the overloads below. The executor trusts them and checks only what needs state (unknown
// sequence, lengths, pages, candidates: planner.h), reserves pages all-or-nothing, fans the step
// out to its rank threads (each with a Backend and a replica of every cache), row-shards it when
// the gate (row_shard_bounds) allows, has each rank copy its answer rows to the host
// (direct_answers; a source's candidates and device-memory answers are all-gathered through a
// Collective), and commits the new lengths only when every rank succeeded. A rejected call changes
// nothing.
//
// Status messages name the request field at fault in the proto's terms
// ("sequences[2].row_lengths[1]: ...") so the edge can pass them through unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/kernels/types.h"
#include "server/config/profile.h"
#include "server/exec/answer_sink.h"

namespace decode_indexer::kernels {
class Device;
}  // namespace decode_indexer::kernels

namespace decode_indexer::exec {

class ValidatedStep;    // validated_step.h
class ValidatedAppend;  // validated_step.h

struct ExecutorOptions {
  std::string backend = "auto";  // "auto" | "cpu" | "cuda"
  int32_t ranks = 0;             // 0: every visible GPU (cuda) or 1 (cpu)
  int64_t cache_pages = 4096;    // pages in each cache's pool
  int32_t row_shard_min_requests = 8;
  int64_t max_sequences = 4096;
  int32_t max_requests_per_step = 256;
  int32_t cpu_threads = 0;  // per rank; 0: hardware threads / ranks
  // CandidateOverlap: build the consumers' expansion when the source publishes candidates.
  bool candidate_overlap = true;
  // Consumers score the expansion (sparse) or run the dense masked fallback.
  bool masked_consumer = false;
  // How long a rank may wait for the others at a collective before the collective is aborted
  // and the executor turns unhealthy (--collective-timeout).
  int32_t collective_timeout_ms = 30000;
  // CUDA graphs (--cuda-graphs): a step whose shape a rank has seen before replays the
  // captured graph of its kernel section (rope_quant_q and scoring) instead of launching each
  // kernel; the answer is bit-identical. Only where the backend has graphs (CUDA).
  bool cuda_graphs = true;
  // Step shapes a rank keeps graphs for; past it, a new shape evicts the least recently seen
  // one (and its graph). Each kept graph holds a little device memory.
  int32_t max_step_graphs = 1024;
  // Stage each step's uploads (row tables, page table, q, weights, keys) in page-locked host
  // memory on a GPU backend, so they are asynchronous DMAs (off: copy from the caller's memory).
  bool pinned_staging = true;
  // One packed upload per step: a rank packs its step's small arrays (row tables, request
  // slots, page-table edits, store rows, positions, staged weights, keys) in its host staging
  // and uploads them with one copy into a slot of its persistent device staging ring, where
  // the kernels read them (off: one copy per array, as before). Answers are the same.
  bool packed_uploads = true;
  // A sharded step's ranks copy their own answer rows straight to host memory, so a dense or
  // consumer step needs no all-gather and no host agreement (--direct-answers; off: rank 0
  // gathers every row and copies the whole answer, as before). Answers are the same.
  bool direct_answers = true;
  // An unsharded step's answering rank writes its top-k straight into a device answer span
  // (AnswerSink::Device, a client's CUDA IPC buffer) instead of its own buffer and a
  // device-to-device copy (decode_schedule.h TopKInPlace). Answers are the same; off: the copy,
  // as before (a same-run baseline for the benchmarks).
  bool answer_in_place = true;
  // A sequence no call has named for this long is released (0: never). Later calls naming it
  // answer NOT_FOUND saying it was released as idle (--idle-sequence-timeout).
  int64_t idle_sequence_timeout_ms = 0;
  // Dense FP8 logits on the GPU (--logits-precision, spec section 6): "exact" (fp32 sums of
  // exact products), "fp8" (fp8 tensor-core accumulation, within the fp8 bound) or "default"
  // (the CUDA backend's choice, kernels/cuda/sm90_heuristics.h). The CPU backend is exact.
  std::string logits_precision = "default";
};

// Keys in one of the accepted forms (AppendKeys.keys / SequenceStep.new_keys).
struct KeysInput {
  kernels::ElemType type = kernels::ElemType::kF32;  // kF32, kBF16, kFp8E4M3, kFp4E2M1
  int32_t count = 0;                                 // n (0: no keys)
  const void* keys = nullptr;                        // host bytes, validated size
  const void* scales = nullptr;                      // FP8: float[n]; FP4: uint8[n, D/32]
  // The position of the first key (AppendKeysRequest.position / new_keys_position): below
  // the cache's length the sequence is first cut back to it; above it is a hole (refused).
  // Absent: append at the length.
  std::optional<int64_t> position;
  // keys and scales are device addresses (a client's CUDA IPC buffer, opened on the
  // answering rank's device; DecodeStepRequest.cuda_ipc.new_keys_offset), pre-quantized in
  // the cache's format (kFp8E4M3 / kFp4E2M1: the host cannot quantize what it cannot read).
  // Every rank copies them device to device into its staging and checks the copies there
  // (IndexerOps::CheckValues: FP8 NaN codes, NaN / Inf / non-positive fp32 scales, 0xFF
  // UE8M0 scales); a bad value fails the step with INVALID_ARGUMENT naming new_keys /
  // new_key_scales, committing nothing. Only in a decode step (not AppendKeys).
  bool on_device = false;
};

// The caller's side of a call: asked right before a state-changing call commits (after the
// ranks ran it). A non-OK answer (DEADLINE_EXCEEDED: the caller's deadline passed while the
// call ran; CANCELLED: the caller went away) makes the call commit nothing, exactly as a
// failed rank would, and fail with that code, saying nothing was committed. Empty: the caller
// waits however long the call takes. The gRPC edge asks its ServerContext.
using CallCheck = std::function<absl::Status()>;

struct SequenceStepInput {
  uint64_t sequence_id = 0;
  int32_t num_rows = 0;  // >= 1
  KeysInput new_keys;
  std::vector<int32_t> row_lengths;  // empty (causal) or num_rows entries
};

struct QInput {
  // kF32 / kBF16: unquantized (quantized and folded by the server); kFp8E4M3 / kFp4E2M1:
  // quantized in the layer's cache format with folded weights.
  kernels::ElemType type = kernels::ElemType::kFp8E4M3;
  const void* q = nullptr;             // [rows, H, D] (FP4 packed [rows, H, D/2])
  const uint8_t* scales = nullptr;     // FP4 only: [rows, H, D/32]
  const float* weights = nullptr;      // [rows, H] fp32
  const int64_t* positions = nullptr;  // [rows] or null (host memory in every case)
  // q, scales and weights are device addresses (a client's CUDA IPC buffer, opened on the
  // answering rank's device). The answering rank's kernels read quantized q (FP8, FP4 and its
  // scales, with the weights) there in place, the other ranks (and unquantized q) copy it
  // device to device (step_io.h UploadQ); the buffer must hold them until the step answers.
  // The edge checked their sizes but could not read their values: each rank checks the rows
  // its kernels read on its device (IndexerOps::CheckValues), and a NaN / Inf fails the step
  // with INVALID_ARGUMENT naming the field, committing nothing.
  bool on_device = false;
};

struct StepInput {
  int32_t layer = 0;
  std::vector<SequenceStepInput> sequences;
  int32_t num_rows = 0;  // sum of sequences[i].num_rows
  QInput q;
  uint64_t step_id = 0;
  bool return_candidates = false;
  // Where the answer goes (answer_sink.h), resolved once by the caller; null: StepResult's
  // vectors. Caller-owned and valid for the call (a caller may reuse one for every step); the
  // executor writes the answer into it exactly once. On failure see AnswerSink: nothing is
  // committed, an encoder is not called, a span may hold rows of the uncommitted answer.
  const AnswerSink* answer = nullptr;
  // q (values, scales, weights) lies in page-locked memory every device may DMA (a region
  // registered through Device::RegisterHostMemory): the ranks copy straight from it.
  // Otherwise it goes through each rank's own page-locked staging, since a copy from pageable
  // memory is bounced by the driver in pieces that each wait for the stream. A wrong `true` is
  // still correct, only slower. (The answer's own flag is AnswerSink::page_locked.)
  bool host_memory_page_locked = false;
  // With device-resident inputs (q.on_device, or a request's new_keys.on_device): a device
  // event (Device::OpenIpcEvent of the answering rank) every rank's stream waits on before it
  // reads any of them (the client recorded it after writing them), so the client's host need
  // not wait for its stream. Null: they are ready when the step arrives.
  void* inputs_ready_event = nullptr;
  // Whether the caller still wants the step, asked right before it commits (see CallCheck).
  CallCheck call_check;
};

struct StepResult {
  uint64_t step_id = 0;
  int32_t num_rows = 0;
  int32_t topk = 0;
  std::vector<int32_t> topk_indices;  // [num_rows, topk]; empty where a sink took it
  int32_t num_candidate_blocks = 0;
  // [num_rows, num_candidate_blocks] when asked and the sink has no candidate span
  std::vector<int32_t> candidate_blocks;
  bool sharded = false;
  int64_t queue_us = 0;
  int64_t compute_us = 0;
  std::vector<int64_t> lengths;  // per sequence, after the step
};

// A sequence's lengths (GetSequence): per cache pool, in the profile's cache-layer order.
struct SequenceCacheInfo {
  int32_t cache_layer = 0;
  int64_t length = 0;
  int64_t pages = 0;         // pages it holds
  int64_t shared_pages = 0;  // of those, held by another sequence too
};
struct SequenceInfo {
  uint64_t sequence_id = 0;
  std::vector<SequenceCacheInfo> caches;
  // Source layers whose candidates a consumer may use now, and the length they were made at.
  std::vector<std::pair<int32_t, int64_t>> candidates;
};

// A sequence's entries in every cache, page by page, and the candidates its sources last
// published (ExportSequence / ImportSequence, snapshots). Tied to the profile's identity
// (config::CacheIdentity), which the carrier checks.
struct CacheImage {
  int32_t cache_layer = 0;
  int64_t length = 0;
  // ceil(length / page_size) pages in the cache's page layout (spec section 4); the slots
  // past `length` in the last page are zero.
  std::string pages;
};
struct CandidateImage {
  int32_t source_layer = 0;
  int64_t length = 0;                // the source cache's length they were computed at
  std::vector<int32_t> row_lengths;  // [rows]
  std::vector<int32_t> blocks;       // [rows, num_candidate_blocks]
};
struct SequenceImage {
  std::vector<CacheImage> caches;  // one per cache pool, in cache-layer order
  std::vector<CandidateImage> candidates;
};

struct CachePoolStatus {
  int32_t cache_layer = 0;
  int64_t pages_total = 0;
  int64_t pages_free = 0;
};

struct ExecutorStatus {
  std::string backend;       // "cpu" | "cuda"
  std::string backend_desc;  // one line
  int32_t num_ranks = 0;
  int32_t row_shard_min_requests = 0;
  int64_t max_sequences = 0;
  int64_t sequences = 0;
  std::vector<CachePoolStatus> caches;
  uint64_t steps = 0;
  uint64_t steps_sharded = 0;
  uint64_t steps_unsharded = 0;
  uint64_t rows_scored = 0;
  double queue_us_total = 0;
  double compute_us_total = 0;
  // Of compute_us_total: rank 0's time in the sharded steps' collectives (all-gathers).
  double collective_us_total = 0;
  // Collective calls (agreements and all-gathers) rank 0 made in the sharded steps.
  uint64_t collectives_total = 0;
  // False once a device or collective fault (a CUDA/NCCL error, an aborted communicator, a
  // collective timeout) has left the ranks in an unknown state: every later AppendKeys and
  // DecodeStep fails UNAVAILABLE, and the service reports NOT_SERVING.
  bool healthy = true;
  std::string health_detail;  // why not healthy
  std::string collective;     // "in-process" | "nccl"
  int64_t idle_sequence_timeout_ms = 0;
  // CUDA graphs, summed over the ranks: kernel sections captured, and replayed from a graph.
  uint64_t graph_captures = 0;
  uint64_t graph_replays = 0;
  // Step shapes evicted from full graph tables (ExecutorOptions::max_step_graphs), summed over
  // the ranks: a count that keeps climbing means the working set of shapes exceeds the table.
  uint64_t graph_evictions = 0;
  // Per rank: device memory in use on its device (Device::DeviceMemoryBytes; 0 on host
  // backends), sampled at start-up and after steps (at most once a second).
  std::vector<int64_t> device_memory_bytes;
};

class Executor {
 public:
  static absl::StatusOr<std::unique_ptr<Executor>> Create(const config::Profile& profile,
                                                          const ExecutorOptions& options);
  virtual ~Executor() = default;

  // The calls below that change state ask `call_check` (see CallCheck) right before they
  // commit: the lifecycle calls run on the host in microseconds, but may wait for their turn
  // behind a long step.
  // ALREADY_EXISTS if taken; RESOURCE_EXHAUSTED past max_sequences.
  virtual absl::Status CreateSequence(uint64_t sequence_id,
                                      const CallCheck& call_check = nullptr) = 0;
  // Appends prefill keys to the cache the append's layer owns; answers the new length.
  // `call_check` is asked right before the keys are committed (see CallCheck).
  virtual absl::StatusOr<int64_t> AppendKeys(const ValidatedAppend& append,
                                             const CallCheck& call_check = nullptr) = 0;
  // The same for keys not validated yet: ValidateAppend (validated_step.h), then the above.
  absl::StatusOr<int64_t> AppendKeys(uint64_t sequence_id, int32_t layer, const KeysInput& keys,
                                     const CallCheck& call_check = nullptr);
  // Lets go of the sequence's pages in every cache; answers how many went back to the free
  // lists (a page another sequence still holds is not freed).
  virtual absl::StatusOr<int64_t> ReleaseSequence(uint64_t sequence_id,
                                                  const CallCheck& call_check = nullptr) = 0;
  // Cuts every cache longer than `length` to `length` (shorter ones stay); answers the pages
  // freed. The candidates of a source whose cache was cut are dropped.
  virtual absl::StatusOr<int64_t> TruncateSequence(uint64_t sequence_id, int64_t length,
                                                   const CallCheck& call_check = nullptr) = 0;
  // `new_id` starts as the first `length` entries of `parent_id` in every cache, sharing its
  // pages (copy-on-write). Without candidates: run the source layer before its consumers.
  virtual absl::Status ForkSequence(uint64_t parent_id, uint64_t new_id, int64_t length,
                                    const CallCheck& call_check = nullptr) = 0;
  virtual absl::StatusOr<SequenceInfo> GetSequence(uint64_t sequence_id) = 0;
  virtual absl::StatusOr<SequenceImage> ExportSequence(uint64_t sequence_id) = 0;
  // A new sequence `sequence_id` holding the image (checked against the profile's geometry:
  // one cache per pool, lengths, page bytes); all-or-nothing. `call_check` is asked right
  // before the sequence is committed (see CallCheck).
  virtual absl::Status ImportSequence(uint64_t sequence_id, const SequenceImage& image,
                                      const CallCheck& call_check = nullptr) = 0;
  // Every live sequence id, ascending.
  virtual std::vector<uint64_t> SequenceIds() const = 0;
  // Releases the sequences no call named for `idle_ms`; answers how many (the idle timeout
  // calls it; tests call it directly).
  virtual int64_t ReleaseIdleSequences(int64_t idle_ms) = 0;
  virtual absl::StatusOr<StepResult> DecodeStep(const ValidatedStep& step) = 0;
  // The same for a step not validated yet (built in process): ValidateStep (validated_step.h)
  // on a copy, then the above. A caller that runs one step many times validates it once.
  absl::StatusOr<StepResult> DecodeStep(const StepInput& step);

  virtual ExecutorStatus Status() const = 0;

  // Runs `fn` on the answering rank's (rank 0's) device in turn with the other calls (no
  // step runs meanwhile): the data plane opens CUDA IPC handles and page-locks client
  // regions there. UNIMPLEMENTED where the executor has no device.
  virtual absl::Status WithAnswerDevice(const std::function<absl::Status(kernels::Device&)>& fn) {
    (void)fn;
    return absl::UnimplementedError("this executor has no compute backend");
  }
  virtual const config::Profile& profile() const = 0;

  // Stops taking work (later calls fail UNAVAILABLE), finishes what was queued, joins the
  // rank threads. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace decode_indexer::exec
