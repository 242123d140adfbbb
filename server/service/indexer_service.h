// The DecodeIndexer gRPC service: decode + validate at the edge, run on the executor, encode
// the answer, and keep per-RPC statistics. Each method's body is written once, against a
// CallContext (call_context.h), and served by either edge: the sync typed service below
// (v1::DecodeIndexer::Service) or the callback edge (callback_edge.h), which calls the same
// entry points (Unary, OpenStream/StreamStep, Export, ImportBegin/ImportChunk/ImportEnd).
// Bodies never throw and answer every failure as an absl::Status; the edges map it once
// (ToGrpcStatus).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "decode_indexer/v1/indexer.grpc.pb.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/exec/executor.h"
#include "server/service/call_context.h"
#include "server/service/data_plane.h"
#include "server/service/gpu_utilization.h"
#include "server/service/metrics.h"
#include "server/service/sequence_transfer.h"
#include "server/service/shm_socket.h"
#include "server/service/step_ring.h"

namespace decode_indexer::service {

// Count, errors and a latency histogram of one RPC method. The histogram has fixed
// log-spaced buckets (four per octave from 1 µs), so recording is O(1) and the
// percentiles are bucket upper bounds (within 19 %), capped at the observed maximum.
// Also counts answers per status code: GetStatistics and /metrics both read these counters.
class LatencyStats {
 public:
  static constexpr int kCodes = 17;  // canonical codes 0..16
  void Record(double latency_us, absl::StatusCode code);
  void Fill(v1::RpcStatistics& out) const;
  std::array<uint64_t, kCodes> Codes() const;

 private:
  static constexpr int kBuckets = 128;  // up to 2^32 µs
  mutable std::mutex mu_;
  uint64_t count_ = 0;
  uint64_t errors_ = 0;
  std::array<uint64_t, kCodes> codes_{};
  double total_us_ = 0;
  double max_us_ = 0;
  std::array<uint64_t, kBuckets> buckets_{};

  double Percentile(double q) const;  // mu_ held
};

struct ServiceOptions {
  // When set, every DecodeIndexer call must carry "authorization: Bearer <token>"
  // (UNAUTHENTICATED otherwise), checked by every handler (and, on TLS, before it in the auth
  // filter: auth.h). The health service is separate and stays open.
  std::string auth_token;
  // The gRPC send limit: a step whose answer could exceed it is refused before it runs
  // (RESOURCE_EXHAUSTED), so a failed send never follows a committed step. 0: no check.
  int64_t max_send_message_bytes = 0;
  // Sequences a step may carry; 0: no limit.
  int max_sequences_per_step = 0;
};

class IndexerService final : public v1::DecodeIndexer::Service {
 public:
  // `executor` must outlive the service.
  IndexerService(exec::Executor& executor, std::string version, ServiceOptions options = {});

  enum Method {
    kGetServerInfo,
    kCreateSequence,
    kAppendKeys,
    kReleaseSequence,
    kDecodeStep,
    kDecodeStream,
    kGetStatistics,
    kRegisterSharedMemory,
    kUnregisterSharedMemory,
    kRegisterCudaIpcMemory,
    kUnregisterCudaIpcMemory,
    kTruncateSequence,
    kForkSequence,
    kGetSequence,
    kExportSequence,
    kImportSequence,
    kRegisterStepRing,
    kUnregisterStepRing,
    kRingStep,  // a step through a step ring (not an RPC): the fast path's count and latency
    kNumMethods
  };
  static const char* MethodName(Method m);

  // ---- The edges' entry points (both the sync overrides below and the callback edge) ----

  // A unary method (every Method but DecodeStream, ExportSequence and ImportSequence):
  // request id, Authorize, the body, statistics. `request` and `response` are the method's
  // v1 messages.
  // `read_at`: when the request was read (DecodeStep's timeout_us counts from there).
  absl::Status Unary(Method method, CallContext& call, const google::protobuf::Message& request,
                     google::protobuf::Message& response,
                     std::chrono::steady_clock::time_point read_at);
  // DecodeStream: OpenStream once (request id into `request_id`, Authorize), then StreamStep
  // for each request in order, each answered before the next is read (the edge's part).
  absl::Status OpenStream(CallContext& call, std::string& request_id);
  absl::Status StreamStep(CallContext& call, const v1::DecodeStepRequest& request,
                          v1::DecodeStepResponse& response,
                          std::chrono::steady_clock::time_point read_at);
  // ExportSequence: `emit` takes each chunk in order (the edge writes or queues it).
  absl::Status Export(CallContext& call, const v1::ExportSequenceRequest& request,
                      const std::function<absl::Status(v1::SequenceChunk&)>& emit);
  // ImportSequence, in pieces so an edge never waits for the client on a worker: ImportBegin
  // when the call starts, ImportChunk per message until one fails, ImportEnd after the last.
  struct ImportCall {
    explicit ImportCall(const config::Profile& profile) : assembler(profile) {}
    SequenceAssembler assembler;
    uint64_t id = 0;
    bool first = true;
    std::chrono::steady_clock::time_point start;
    std::string request_id;
    absl::Status status;  // the first failure
  };
  std::unique_ptr<ImportCall> ImportBegin(CallContext& call);
  absl::Status ImportChunk(ImportCall& import, const v1::ImportSequenceRequest& request);
  absl::Status ImportEnd(CallContext& call, ImportCall& import,
                         v1::ImportSequenceResponse& response);
  // The callback edge, before it reads a message of a call: the token (Authorize). A refusal
  // is counted (auth_refused) and recorded against `method`; its request id is echoed.
  absl::Status AuthorizeBeforeRead(Method method, CallContext& call);
  // Whether the call carries the token (OK when none is set).
  absl::Status Authorize(const CallContext& call) const;
  // Tests: calls whose token was refused only after their request had been read and parsed
  // (the sync edge on plaintext; the callback edge refuses before reading, so never).
  uint64_t RefusedAfterReadForTesting() const { return refused_after_read_.load(); }

  grpc::Status GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest* request,
                             v1::ServerInfo* response) override;
  grpc::Status CreateSequence(grpc::ServerContext* context,
                              const v1::CreateSequenceRequest* request,
                              v1::CreateSequenceResponse* response) override;
  grpc::Status AppendKeys(grpc::ServerContext* context, const v1::AppendKeysRequest* request,
                          v1::AppendKeysResponse* response) override;
  grpc::Status ReleaseSequence(grpc::ServerContext* context,
                               const v1::ReleaseSequenceRequest* request,
                               v1::ReleaseSequenceResponse* response) override;
  grpc::Status DecodeStep(grpc::ServerContext* context, const v1::DecodeStepRequest* request,
                          v1::DecodeStepResponse* response) override;
  // Each step of a stream counts once under "DecodeStream".
  grpc::Status DecodeStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::DecodeStepResponse, v1::DecodeStepRequest>* stream) override;
  grpc::Status GetStatistics(grpc::ServerContext* context, const v1::GetStatisticsRequest* request,
                             v1::Statistics* response) override;
  grpc::Status RegisterSharedMemory(grpc::ServerContext* context,
                                    const v1::RegisterSharedMemoryRequest* request,
                                    v1::RegisterSharedMemoryResponse* response) override;
  grpc::Status UnregisterSharedMemory(grpc::ServerContext* context,
                                      const v1::UnregisterSharedMemoryRequest* request,
                                      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::Status RegisterCudaIpcMemory(grpc::ServerContext* context,
                                     const v1::RegisterCudaIpcMemoryRequest* request,
                                     v1::RegisterCudaIpcMemoryResponse* response) override;
  grpc::Status UnregisterCudaIpcMemory(grpc::ServerContext* context,
                                       const v1::UnregisterCudaIpcMemoryRequest* request,
                                       v1::UnregisterCudaIpcMemoryResponse* response) override;
  // The fast path (step_ring.h): a step ring in a registered region, served by a poller.
  grpc::Status RegisterStepRing(grpc::ServerContext* context,
                                const v1::RegisterStepRingRequest* request,
                                v1::RegisterStepRingResponse* response) override;
  grpc::Status UnregisterStepRing(grpc::ServerContext* context,
                                  const v1::UnregisterStepRingRequest* request,
                                  v1::UnregisterStepRingResponse* response) override;
  // Stops every step ring's poller (the Server's drain, before the executor stops).
  void StopStepRings() { step_rings_.StopAll(); }
  grpc::Status TruncateSequence(grpc::ServerContext* context,
                                const v1::TruncateSequenceRequest* request,
                                v1::TruncateSequenceResponse* response) override;
  grpc::Status ForkSequence(grpc::ServerContext* context, const v1::ForkSequenceRequest* request,
                            v1::ForkSequenceResponse* response) override;
  grpc::Status GetSequence(grpc::ServerContext* context, const v1::GetSequenceRequest* request,
                           v1::GetSequenceResponse* response) override;
  grpc::Status ExportSequence(grpc::ServerContext* context,
                              const v1::ExportSequenceRequest* request,
                              grpc::ServerWriter<v1::SequenceChunk>* writer) override;
  grpc::Status ImportSequence(grpc::ServerContext* context,
                              grpc::ServerReader<v1::ImportSequenceRequest>* reader,
                              v1::ImportSequenceResponse* response) override;

  // ServerInfo.instance_id (set by the Server before it serves: new, or the snapshot's).
  void SetInstanceId(std::string id) {
    std::lock_guard<std::mutex> lock(info_mu_);
    instance_id_ = std::move(id);
  }
  std::string instance_id() const {
    std::lock_guard<std::mutex> lock(info_mu_);
    return instance_id_;
  }
  // While set, every DecodeIndexer call answers UNAVAILABLE (the Server restores a snapshot).
  void SetRestoring(bool restoring) { restoring_ = restoring; }

  // Serves sealed-memfd registrations on the Unix socket `path` (see shm_socket.h); the path
  // is then advertised in ServerInfo.shm_socket. `lock` and `mode` as for ShmSocketServer::Start
  // (the lock ShmSocketServer::Reserve took before the server allocated anything).
  absl::Status StartShmSocket(const std::string& path, SocketPathLock lock = SocketPathLock(),
                              int mode = -1);

  void FillServerInfo(v1::ServerInfo& info) const;
  void FillStatistics(v1::Statistics& out) const;
  // The Prometheus text exposition (decode_indexer_*, process_*), from the same counters as
  // GetStatistics.
  std::string RenderMetrics() const;

  // Steps are admitted one at a time (the executor runs them in order anyway); a step checks
  // its deadline and cancellation once admitted, so one that expired while queued changes
  // nothing. Tests hold admission to queue a step deterministically.
  std::unique_lock<std::mutex> HoldStepAdmissionForTesting() {
    return std::unique_lock<std::mutex>(step_mu_);
  }
  // Tests: steps now waiting for admission, and the latest deadline (the server's, from its
  // grpc-timeout) of a step that queued, so a test knows a step is queued and when the server
  // will find it expired instead of sleeping and hoping.
  int StepsWaitingForAdmissionForTesting() const { return steps_waiting_.load(); }
  std::chrono::system_clock::time_point LastQueuedDeadlineForTesting() const {
    return std::chrono::system_clock::time_point(
        std::chrono::system_clock::duration(last_queued_deadline_.load()));
  }

  // Calls refused for their token (or, on mutual TLS, client certificate) before their
  // request was read: by the auth filter (TLS: auth.h's processor; the Server hands it this
  // counter) or by the callback edge (AuthorizeBeforeRead).
  std::atomic<uint64_t>* AuthRefusedCounter() { return &auth_refused_; }
  uint64_t auth_refused() const { return auth_refused_.load(); }

  // Called with false once the executor reports itself unhealthy (a device or collective
  // fault): the Server points it at the health service (NOT_SERVING).
  void SetHealthSink(std::function<void(bool serving)> sink);

 private:
  // sizeof(cudaIpcMemHandle_t), checked at the edge without CUDA headers.
  static constexpr size_t kCudaIpcHandleBytes = 64;

  // The wrapper every unary handler shares: Authorize, run `body` (exceptions become
  // INTERNAL), record the method's latency and status code, map to a grpc::Status.
  template <typename F>
  absl::Status Handle(Method method, CallContext& call, F&& body);
  // The unary bodies (under Handle).
  absl::Status DoGetServerInfo(CallContext& call, const v1::GetServerInfoRequest& request,
                               v1::ServerInfo& response);
  absl::Status DoCreateSequence(CallContext& call, const v1::CreateSequenceRequest& request,
                                v1::CreateSequenceResponse& response);
  absl::Status DoAppendKeys(CallContext& call, const v1::AppendKeysRequest& request,
                            v1::AppendKeysResponse& response);
  absl::Status DoReleaseSequence(CallContext& call, const v1::ReleaseSequenceRequest& request,
                                 v1::ReleaseSequenceResponse& response);
  absl::Status DoGetStatistics(CallContext& call, const v1::GetStatisticsRequest& request,
                               v1::Statistics& response);
  absl::Status DoRegisterSharedMemory(CallContext& call,
                                      const v1::RegisterSharedMemoryRequest& request,
                                      v1::RegisterSharedMemoryResponse& response);
  absl::Status DoUnregisterSharedMemory(CallContext& call,
                                        const v1::UnregisterSharedMemoryRequest& request,
                                        v1::UnregisterSharedMemoryResponse& response);
  absl::Status DoRegisterCudaIpcMemory(CallContext& call,
                                       const v1::RegisterCudaIpcMemoryRequest& request,
                                       v1::RegisterCudaIpcMemoryResponse& response);
  absl::Status DoUnregisterCudaIpcMemory(CallContext& call,
                                         const v1::UnregisterCudaIpcMemoryRequest& request,
                                         v1::UnregisterCudaIpcMemoryResponse& response);
  absl::Status DoTruncateSequence(CallContext& call, const v1::TruncateSequenceRequest& request,
                                  v1::TruncateSequenceResponse& response);
  absl::Status DoForkSequence(CallContext& call, const v1::ForkSequenceRequest& request,
                              v1::ForkSequenceResponse& response);
  absl::Status DoRegisterStepRing(CallContext& call, const v1::RegisterStepRingRequest& request,
                                  v1::RegisterStepRingResponse& response);
  absl::Status DoUnregisterStepRing(CallContext& call, const v1::UnregisterStepRingRequest& request,
                                    v1::UnregisterStepRingResponse& response);
  absl::Status DoGetSequence(CallContext& call, const v1::GetSequenceRequest& request,
                             v1::GetSequenceResponse& response);
  // One decode step: validate, admit (deadline, timeout_us counted from `read_at`,
  // cancellation), execute, encode.
  // A step ring's descriptor, as RunStep runs a gRPC step (same checks, same admission
  // order), with no call behind it: no deadline but timeout_us, never cancelled.
  absl::Status RunRingStep(const v1::DecodeStepRequest& request, v1::DecodeStepResponse& response,
                           std::chrono::steady_clock::time_point taken);
  absl::Status RunStep(CallContext* context, const v1::DecodeStepRequest& request,
                       v1::DecodeStepResponse& response,
                       std::chrono::steady_clock::time_point read_at);
  // After a failed call: whether the executor turned unhealthy; if so, tell the sink once.
  void CheckHealth(const absl::Status& status);
  // Page-locks a newly mapped region with the answering rank's backend (where it can).
  void PinRegion(SharedMemoryRegion& region);

  exec::Executor& executor_;
  std::string version_;
  ServiceOptions options_;
  std::array<LatencyStats, kNumMethods> stats_;
  std::mutex step_mu_;
  std::atomic<int> steps_waiting_{0};
  std::atomic<int64_t> last_queued_deadline_{0};  // system_clock ticks
  // Declared after executor_ (their release hooks call it) and destroyed first.
  // Shared-memory and CUDA IPC regions, one id space.
  RegionRegistry regions_;
  // prometheus-cpp metrics (thread-safe; the registry owns them). Per method: every answer's
  // time in the handler (a stream: each step's). Successful steps by layer role (dense,
  // source, consumer): wall time from read to answer; their queue time (see ServerTiming:
  // admission plus the executor's turn) and rows. Steps read and not yet answered.
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  std::array<prometheus::Histogram*, kNumMethods> rpc_seconds_{};
  std::array<prometheus::Histogram*, 3> step_seconds_{};
  prometheus::Histogram* queue_seconds_ = nullptr;
  prometheus::Histogram* rows_per_step_ = nullptr;
  prometheus::Gauge* steps_in_flight_ = nullptr;
  // Sum of successful steps' ServerTiming.queue_us (GetStatistics.queue_us_total).
  std::atomic<int64_t> queue_us_total_{0};
  std::atomic<uint64_t> auth_refused_{0};
  std::atomic<uint64_t> refused_after_read_{0};
  // Registers into regions_ (and pins through executor_): stopped before either goes.
  std::unique_ptr<ShmSocketServer> shm_socket_;
  std::mutex health_mu_;
  std::function<void(bool)> health_sink_;
  bool reported_unhealthy_ = false;
  mutable std::mutex info_mu_;
  std::string instance_id_;
  std::atomic<bool> restoring_{false};
  // NVML, opened at the first scrape of a CUDA server (never on host backends).
  mutable std::once_flag gpu_utilization_once_;
  mutable std::unique_ptr<GpuUtilization> gpu_utilization_;
  // Last: its pollers run steps through everything above, so they stop first.
  StepRingRegistry step_rings_;
};

}  // namespace decode_indexer::service
