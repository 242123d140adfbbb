// The DecodeIndexer service on gRPC's callback API (--grpc-edge callback): one reactor per
// call, each method registered as a raw bidi callback method (methods(): gRPC reads no
// message on its own) and every other path through the generic callback service (this
// class), so that the reactor sees the method and the client's metadata before any message
// is read:
//  - a call without the bearer token is finished UNAUTHENTICATED before its request is read
//    (on plaintext too: only what the stream's HTTP/2 window let in is ever buffered, and
//    nothing is parsed), and an unknown method gets UNIMPLEMENTED;
//  - an open stream costs no thread: the reactors run on gRPC's callback threads and never
//    block; every method body (IndexerService's, the same code the sync edge runs) runs on a
//    fixed pool of `workers` threads, one task per unary call, per stream step, per import
//    chunk. A DecodeStream answers in request order: its next request is read only once the
//    previous answer has been written.
// Requests are parsed from the received slices (grpc::ProtoBufferReader, no flattening);
// answers are serialized into one slice of their exact size. Health and reflection stay
// typed services (registered beside this one) and stay open for probes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/impl/service_type.h>

#include "server/service/indexer_service.h"

namespace decode_indexer::service {

// A DecodeStepResponse into `out` without copying its raw answer (topk.data, the executor's
// int32 [rows, K] written in place): one slice holds every other field, then topk's tag,
// length, dtype and shape and the data field's tag and length; a second slice takes over the
// answer's bytes (moved out of `response`, freed when gRPC is done with them). Fields in
// another order than protobuf's own serializer writes them, the same message to any parser.
// Answers under 64 KiB are serialized whole (one slice, as every other message).
void SerializeStepResponse(v1::DecodeStepResponse& response, grpc::ByteBuffer& out);

// A fixed number of threads running posted tasks, each lane in order of posting. Data tasks
// (steps, appends, imports, exports: they wait for step admission and the executor) run on at
// most size - 1 threads at once, so a control call (server info, statistics, sequence
// lifecycle) always finds a thread even while every other worker waits behind a step.
class WorkerPool {
 public:
  enum class Lane { kControl, kData };
  explicit WorkerPool(int threads);
  ~WorkerPool();  // runs what is queued, then joins
  void Post(Lane lane, std::function<void()> task);
  int size() const { return static_cast<int>(threads_.size()); }
  // Tasks posted to `lane` and not yet started.
  int queued(Lane lane) {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>((lane == Lane::kData ? data_ : control_).size());
  }

 private:
  void Run();
  bool Runnable() const;  // mu_ held
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> control_;
  std::deque<std::function<void()>> data_;
  int data_running_ = 0;
  int max_data_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// The default pool: the machine's hardware threads, at least 4.
int DefaultEdgeWorkers();

class CallbackEdge final : public grpc::CallbackGenericService {
 public:
  // `service` must outlive the edge; the edge must outlive the grpc::Server it is registered
  // with (destroy it after the server's Shutdown returned). workers <= 0: DefaultEdgeWorkers.
  CallbackEdge(IndexerService& service, int workers);

  // Register both: builder.RegisterService(edge.methods()) (the DecodeIndexer methods, listed
  // by reflection) and builder.RegisterCallbackGenericService(&edge) (unknown methods: the
  // token first on the DecodeIndexer prefix, then UNIMPLEMENTED).
  grpc::Service* methods() { return &methods_; }

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

  int workers() const { return pool_.size(); }
  // Tests: bytes of request messages the edge has read (a call refused before it was read
  // adds none).
  uint64_t bytes_read() const { return bytes_read_.load(); }
  // Calls whose reactor exists (open streams included).
  int64_t open_calls() const { return open_calls_.load(); }
  // Data tasks (steps, appends, imports, exports) waiting for a worker.
  int data_tasks_queued() { return pool_.queued(WorkerPool::Lane::kData); }

 private:
  class Call;
  class Methods final : public grpc::Service {
   public:
    explicit Methods(CallbackEdge& edge);
  };
  IndexerService& service_;
  Methods methods_;
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<int64_t> open_calls_{0};
  WorkerPool pool_;  // last: joined first, while the rest is still there
};

}  // namespace decode_indexer::service
