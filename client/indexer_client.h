// A typed C++ client of the DecodeIndexer service. Depends only on the API (di_proto) and
// gRPC. Every call answers an absl::Status carrying the server's gRPC code and message.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/v1/indexer.grpc.pb.h"

namespace decode_indexer::client {

// Scale-out: every call that names sequences carries the (first) sequence id in this
// metadata key, so that a balancer hashing on it keeps a sequence on one replica.
inline constexpr const char* kSequenceIdMetadata = "x-di-sequence-id";
// Adds it to `context`.
void RouteBySequence(grpc::ClientContext& context, uint64_t sequence_id);

// grpc::Status -> absl::Status, code and message unchanged.
absl::Status FromGrpcStatus(const grpc::Status& status);

// One step's answer, parsed.
struct StepAnswer {
  uint64_t step_id = 0;
  int32_t rows = 0;
  int32_t k = 0;
  std::vector<int32_t> topk;  // [rows, k]
  int32_t num_candidate_blocks = 0;
  std::vector<int32_t> candidates;  // [rows, num_candidate_blocks] when asked
  bool sharded = false;
  int64_t queue_us = 0;
  int64_t compute_us = 0;
  std::vector<int64_t> lengths;  // per sequence, after the step
  double client_us = 0;          // round trip seen by the client (0 for stream answers)
  // The answer is not in the response: it was written into the shared-memory region (or
  // the CUDA IPC buffer) at the request's offsets, and topk/candidates are empty here.
  bool in_shared_memory = false;

  std::span<const int32_t> Row(int32_t r) const {
    return std::span<const int32_t>(topk).subspan(static_cast<size_t>(r) * k, k);
  }
  std::span<const int32_t> CandidateRow(int32_t r) const {
    return std::span<const int32_t>(candidates)
        .subspan(static_cast<size_t>(r) * num_candidate_blocks, num_candidate_blocks);
  }
};

// Parses and shape-checks a DecodeStepResponse.
absl::StatusOr<StepAnswer> ParseStepResponse(const v1::DecodeStepResponse& response);

// A tensor's bytes, not owned: dtype, shape in elements (FP4: the packed bytes hold two a
// byte) and the raw little-endian row-major bytes. An empty dtype means absent.
struct TensorView {
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;

  template <typename T>
  static TensorView Of(v1::DType dtype, std::span<const T> values, std::vector<int64_t> shape) {
    return {dtype, std::move(shape),
            std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(values.data()),
                                     values.size_bytes())};
  }
  bool present() const { return dtype != v1::DTYPE_UNSPECIFIED; }
};

// One layer of a decode step in the columnar form (DecodeStepRequest.sequence_ids ...): the
// requests as columns and every request's new keys as one stacked tensor, so that building
// the request takes a constant number of copies whatever the batch (no message per
// request). Answers exactly what the same step in the `sequences` form answers.
struct ColumnarStep {
  int32_t layer = 0;
  uint64_t step_id = 0;
  // The requests, in row order.
  std::span<const uint64_t> sequence_ids;
  // Rows of each request (one entry per request), or empty: rows_per_sequence for all.
  std::span<const int32_t> num_rows;
  int32_t rows_per_sequence = 1;
  // Every request's new keys stacked in request order, [sum of new_key_counts, D], in any
  // form AppendKeys takes (pre-quantized with new_key_scales); absent at a layer that reads
  // another layer's cache.
  TensorView new_keys;
  TensorView new_key_scales;
  // Keys of each request in new_keys (0: none); empty: as many as its rows.
  std::span<const int32_t> new_key_counts;
  // Where each request's keys start (-1: append); empty: all append.
  std::span<const int64_t> new_keys_positions;
  // One explicit length per row (0 on all of a request's rows: causal); empty: all causal.
  std::span<const int32_t> row_lengths;
  // As in DecodeStepRequest: q [rows, H, D], q_scales (FP4), weights [rows, H], positions.
  TensorView q;
  TensorView q_scales;
  TensorView weights;
  TensorView positions;
  bool return_candidates = false;
  v1::AnswerEncoding answer_encoding = v1::ANSWER_ENCODING_RAW;
  int64_t timeout_us = 0;
  // Not owned; null: none. The answer goes into a buffer registered with
  // RegisterCudaIpcMemory (DecodeStepRequest.cuda_ipc), and the tensors whose offsets it sets
  // are read there: q / q_scales / weights (q_offset ...) and the new keys and their scales
  // (new_keys_offset / new_key_scales_offset, pre-quantized). Give those TensorViews dtype and
  // shape with empty data: only dtype and shape go on the wire.
  const v1::CudaIpcStep* cuda_ipc = nullptr;
};

// The DecodeStepRequest of `step`, built into `request` (cleared first; its buffers keep
// their capacity when reused for the next step): every payload byte is copied once. Works
// for DecodeStep and for a StepStream's Write.
void BuildColumnarRequest(const ColumnarStep& step, v1::DecodeStepRequest& request);
v1::DecodeStepRequest BuildColumnarRequest(const ColumnarStep& step);

struct ClientOptions {
  // Per-call deadline.
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  // How long Connect waits for the channel to come up (0: do not wait).
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(10);
  int max_message_bytes = 512 << 20;
  // Sent as "authorization: Bearer <token>" on every call when set.
  std::string auth_token;
  // PEM contents (not paths). tls_root_ca set: TLS, verifying the server against it;
  // tls_cert + tls_key add a client certificate (mutual TLS). tls_target_name overrides the
  // name checked against the server certificate (e.g. "localhost" when dialing an IP).
  std::string tls_root_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_target_name;
  // HTTP/2 keepalive pings on the channel; 0 leaves gRPC's default (off).
  int keepalive_time_ms = 0;
  int keepalive_timeout_ms = 0;
  // Connect keeps this much freed heap memory in the process for reuse (common/
  // malloc_tuning.h: glibc mallopt, process-wide), so that each step's messages reuse warm
  // pages instead of faulting in fresh ones; 0 leaves the allocator alone.
  int64_t malloc_keep_mb = 64;
};

// A sealed memfd the client creates (memfd_create + ftruncate + posix_fallocate + F_SEAL_SHRINK |
// F_SEAL_GROW | F_SEAL_SEAL + mmap) and hands to the server over its shm socket
// (RegisterSharedMemory below): its size can never change again, so the server can map it safely.
// Unmapped and closed on destruction (the server keeps its own mapping until the region is
// unregistered).
class SharedMemory {
 public:
  // `name` only labels the memfd (/proc/PID/fd); size in bytes.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(const std::string& name,
                                                              uint64_t size);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  uint8_t* data() { return base_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  int fd() const { return fd_; }

 private:
  SharedMemory() = default;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::string name_;
  int fd_ = -1;
};

// Hands `size` bytes of the sealed memfd `fd` to the server listening on `socket_path`
// (--shm-socket); answers the region id (a random capability: keep it private).
absl::StatusOr<uint64_t> RegisterMemfd(const std::string& socket_path, int fd, uint64_t size);

// A DecodeStream session: steps answered in order; the stream ends with the first failing
// step's status (Read then fails and Finish answers it).
class StepStream {
 public:
  ~StepStream();
  absl::Status Write(const v1::DecodeStepRequest& request);
  // The columnar form, built into a request this stream reuses step after step.
  absl::Status WriteColumnar(const ColumnarStep& step);
  absl::StatusOr<StepAnswer> Read();
  // Write then Read.
  absl::StatusOr<StepAnswer> Step(const v1::DecodeStepRequest& request);
  // Half-closes and answers the stream's final status.
  absl::Status Finish();

 private:
  friend class IndexerClient;
  StepStream() = default;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeStepRequest, v1::DecodeStepResponse>> stream_;
  v1::DecodeStepRequest columnar_;  // reused by WriteColumnar
  bool writes_done_ = false;
  bool finished_ = false;
  absl::Status final_;
};

class IndexerClient {
 public:
  // Creates a channel to `target` ("host:port") and waits for it to connect.
  static absl::StatusOr<std::unique_ptr<IndexerClient>> Connect(const std::string& target,
                                                                const ClientOptions& options = {});

  absl::StatusOr<v1::ServerInfo> ServerInfo();
  absl::Status CreateSequence(uint64_t sequence_id);
  // Unquantized fp32 keys [n, head_dim]; answers the cache's new length.
  absl::StatusOr<int64_t> AppendKeys(uint64_t sequence_id, int32_t layer,
                                     std::span<const float> keys, int32_t head_dim);
  // Pre-quantized keys in the cache's format (or any Tensor form the API accepts).
  absl::StatusOr<int64_t> AppendKeys(uint64_t sequence_id, int32_t layer, v1::Tensor keys,
                                     v1::Tensor key_scales);
  absl::StatusOr<int64_t> AppendKeys(const v1::AppendKeysRequest& request);
  // Answers the pages freed.
  absl::StatusOr<int64_t> ReleaseSequence(uint64_t sequence_id);
  // Either form of a step; a batch is routed by its first sequence.
  absl::StatusOr<StepAnswer> DecodeStep(const v1::DecodeStepRequest& request);
  // The columnar form (BuildColumnarRequest, then DecodeStep).
  absl::StatusOr<StepAnswer> DecodeStepColumnar(const ColumnarStep& step);
  // route_sequence_id: sent as x-di-sequence-id so that a balancer routes the stream to the
  // replica holding that sequence (every step on it must name that replica's sequences).
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStream(
      std::optional<uint64_t> route_sequence_id = std::nullopt);
  absl::StatusOr<v1::Statistics> GetStatistics();
  // Registers `shm` over the server's shm socket (`socket_path`, else ServerInfo.shm_socket);
  // answers the region id for DecodeStepRequest.shared_memory.region_id.
  absl::StatusOr<uint64_t> RegisterSharedMemory(const SharedMemory& shm,
                                                const std::string& socket_path = "");
  absl::Status UnregisterSharedMemory(uint64_t region_id);
  // A device buffer exported with cudaIpcGetMemHandle (`handle`: the 64 bytes of the
  // cudaIpcMemHandle_t) on `device` (the server's ordinal of that GPU): answers the region id
  // for DecodeStepRequest.cuda_ipc.region_id. The buffer must stay allocated until
  // UnregisterCudaIpcMemory. The library needs no CUDA: the caller exports the handle.
  // `inputs_event` / `answer_event` (optional, 64 bytes each: cudaIpcGetEventHandle of events
  // created with cudaEventInterprocess | cudaEventDisableTiming): the events a step's
  // cuda_ipc.wait_inputs_event / record_answer_event (the ring's kWaitInputsEvent /
  // kRecordAnswerEvent) order the GPU work with.
  absl::StatusOr<uint64_t> RegisterCudaIpcMemory(std::string_view handle, uint64_t size,
                                                 int32_t device, std::string_view inputs_event = {},
                                                 std::string_view answer_event = {});
  absl::Status UnregisterCudaIpcMemory(uint64_t region_id);
  // The fast path's control calls (client/fast_path.h drives them; FastPathRing is the
  // usual way in).
  absl::StatusOr<v1::RegisterStepRingResponse> RegisterStepRing(
      const v1::RegisterStepRingRequest& request);
  absl::StatusOr<uint64_t> UnregisterStepRing(uint64_t ring_id);  // answers the ring's steps

  // Sequence lifecycle (spec section 10). Rollback is an AppendKeys / a step whose keys carry
  // a position (AppendKeysRequest.position, SequenceStep.new_keys_position).
  // Fp32 keys [n, head_dim] written at `position` (cut back there first); answers the length.
  absl::StatusOr<int64_t> AppendKeysAt(uint64_t sequence_id, int32_t layer, int64_t position,
                                       std::span<const float> keys, int32_t head_dim);
  // Cuts every cache longer than `length`; answers the pages freed.
  absl::StatusOr<int64_t> TruncateSequence(uint64_t sequence_id, int64_t length);
  absl::Status ForkSequence(uint64_t parent_id, uint64_t new_id, int64_t length);
  absl::StatusOr<v1::GetSequenceResponse> GetSequence(uint64_t sequence_id);
  // The whole export stream, in order.
  absl::StatusOr<std::vector<v1::SequenceChunk>> ExportSequence(uint64_t sequence_id,
                                                                int64_t chunk_bytes = 0);
  // Sends `chunks` as `sequence_id` (0: the exporter's id); answers the id it got.
  absl::StatusOr<uint64_t> ImportSequence(uint64_t sequence_id,
                                          std::span<const v1::SequenceChunk> chunks);
  // Export from here, import into `to` (as `new_id`, 0: the same id), chunk by chunk without
  // holding the whole stream.
  absl::StatusOr<uint64_t> MigrateSequence(uint64_t sequence_id, IndexerClient& to,
                                           uint64_t new_id = 0);

  grpc::Channel& channel() { return *channel_; }

 private:
  IndexerClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);
  void Prepare(grpc::ClientContext& context) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DecodeIndexer::Stub> stub_;
  ClientOptions options_;
};

}  // namespace decode_indexer::client
