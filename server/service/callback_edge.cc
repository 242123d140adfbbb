#include "server/service/callback_edge.h"

#include <grpcpp/impl/codegen/server_callback_handlers.h>
#include <grpcpp/impl/rpc_service_method.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/service/auth.h"
#include "server/service/logging.h"
#include "server/service/sequence_transfer.h"
#include "server/service/status_mapping.h"

namespace decode_indexer::service {
namespace {

using Clock = std::chrono::steady_clock;
using Method = IndexerService::Method;

enum class Kind { kUnary, kServerStream, kClientStream, kBidi };

struct Entry {
  std::string path;  // "/decode_indexer.v1.DecodeIndexer/<method>"
  Method method;
  Kind kind;
  const google::protobuf::Message* request;  // prototypes (default instances)
  const google::protobuf::Message* response;
  bool data;  // the pool's data lane: waits for step admission or moves a sequence's bytes
};

// The DecodeIndexer methods by their gRPC path.
const std::unordered_map<std::string, Entry>& Table() {
  static const auto* table = [] {
    auto* t = new std::unordered_map<std::string, Entry>();
    auto add = [t](Method m, Kind k, const google::protobuf::Message& request,
                   const google::protobuf::Message& response) {
      const std::string path = std::string(kTokenGuardedPrefix) + IndexerService::MethodName(m);
      using S = IndexerService;
      const bool data = m == S::kDecodeStep || m == S::kDecodeStream || m == S::kAppendKeys ||
                        m == S::kExportSequence || m == S::kImportSequence;
      t->emplace(path, Entry{path, m, k, &request, &response, data});
    };
    using S = IndexerService;
    add(S::kGetServerInfo, Kind::kUnary, v1::GetServerInfoRequest::default_instance(),
        v1::ServerInfo::default_instance());
    add(S::kCreateSequence, Kind::kUnary, v1::CreateSequenceRequest::default_instance(),
        v1::CreateSequenceResponse::default_instance());
    add(S::kAppendKeys, Kind::kUnary, v1::AppendKeysRequest::default_instance(),
        v1::AppendKeysResponse::default_instance());
    add(S::kReleaseSequence, Kind::kUnary, v1::ReleaseSequenceRequest::default_instance(),
        v1::ReleaseSequenceResponse::default_instance());
    add(S::kDecodeStep, Kind::kUnary, v1::DecodeStepRequest::default_instance(),
        v1::DecodeStepResponse::default_instance());
    add(S::kDecodeStream, Kind::kBidi, v1::DecodeStepRequest::default_instance(),
        v1::DecodeStepResponse::default_instance());
    add(S::kGetStatistics, Kind::kUnary, v1::GetStatisticsRequest::default_instance(),
        v1::Statistics::default_instance());
    add(S::kRegisterSharedMemory, Kind::kUnary, v1::RegisterSharedMemoryRequest::default_instance(),
        v1::RegisterSharedMemoryResponse::default_instance());
    add(S::kUnregisterSharedMemory, Kind::kUnary,
        v1::UnregisterSharedMemoryRequest::default_instance(),
        v1::UnregisterSharedMemoryResponse::default_instance());
    add(S::kRegisterCudaIpcMemory, Kind::kUnary,
        v1::RegisterCudaIpcMemoryRequest::default_instance(),
        v1::RegisterCudaIpcMemoryResponse::default_instance());
    add(S::kUnregisterCudaIpcMemory, Kind::kUnary,
        v1::UnregisterCudaIpcMemoryRequest::default_instance(),
        v1::UnregisterCudaIpcMemoryResponse::default_instance());
    add(S::kTruncateSequence, Kind::kUnary, v1::TruncateSequenceRequest::default_instance(),
        v1::TruncateSequenceResponse::default_instance());
    add(S::kForkSequence, Kind::kUnary, v1::ForkSequenceRequest::default_instance(),
        v1::ForkSequenceResponse::default_instance());
    add(S::kGetSequence, Kind::kUnary, v1::GetSequenceRequest::default_instance(),
        v1::GetSequenceResponse::default_instance());
    add(S::kRegisterStepRing, Kind::kUnary, v1::RegisterStepRingRequest::default_instance(),
        v1::RegisterStepRingResponse::default_instance());
    add(S::kUnregisterStepRing, Kind::kUnary, v1::UnregisterStepRingRequest::default_instance(),
        v1::UnregisterStepRingResponse::default_instance());
    add(S::kExportSequence, Kind::kServerStream, v1::ExportSequenceRequest::default_instance(),
        v1::SequenceChunk::default_instance());
    add(S::kImportSequence, Kind::kClientStream, v1::ImportSequenceRequest::default_instance(),
        v1::ImportSequenceResponse::default_instance());
    return t;
  }();
  return *table;
}

const Entry* Lookup(const std::string& path) {
  auto it = Table().find(path);
  return it == Table().end() ? nullptr : &it->second;
}

// Parses straight from the received slices (no flattening into one buffer first), then lets
// them go. protobuf 3.21 copies a `bytes` field into its own std::string once (as the sync
// edge's deserializer does); that is the only copy of a tensor on the way in.
bool Parse(grpc::ByteBuffer& buffer, google::protobuf::Message& message) {
  if (!buffer.Valid() || buffer.Length() == 0) {
    message.Clear();  // an empty message: every field at its default
    buffer.Clear();
    return true;
  }
  bool ok;
  {
    grpc::ProtoBufferReader reader(&buffer);
    ok = message.ParseFromZeroCopyStream(&reader) && reader.status().ok();
  }
  buffer.Clear();
  return ok;
}

// Into one slice of exactly the message's size: one pass over the answer, no chunking.
void Serialize(const google::protobuf::Message& message, grpc::ByteBuffer& out) {
  const size_t size = message.ByteSizeLong();
  grpc::Slice slice(size);
  message.SerializeWithCachedSizesToArray(const_cast<uint8_t*>(slice.begin()));
  grpc::ByteBuffer buffer(&slice, 1);
  out.Swap(&buffer);
}

}  // namespace

namespace {

// `head` then `bytes` (taken over, freed when gRPC lets go of the slice) as a two-slice
// buffer: the bytes are never copied.
void HeadAndOwnedBytes(const std::string& head, std::string bytes, grpc::ByteBuffer& out) {
  auto* owned = new std::string(std::move(bytes));
  grpc::Slice slices[2] = {grpc::Slice(head),
                           grpc::Slice(
                               owned->data(), owned->size(),
                               [](void* p) { delete static_cast<std::string*>(p); }, owned)};
  grpc::ByteBuffer buffer(slices, 2);
  out.Swap(&buffer);
}

}  // namespace

void SerializeStepResponse(v1::DecodeStepResponse& response, grpc::ByteBuffer& out) {
  constexpr size_t kZeroCopyMin = 64 << 10;
  if (response.topk_delta().size() >= kZeroCopyMin) {
    // A delta answer likewise: [the response without topk_delta][its tag and length] + [its
    // bytes] (a field's place in the message is free on the wire).
    std::string delta = std::move(*response.mutable_topk_delta());
    response.clear_topk_delta();
    std::string head = response.SerializeAsString();
    head.push_back(0x3a);  // DecodeStepResponse.topk_delta: field 7, length-delimited
    PutVarint(head, delta.size());
    HeadAndOwnedBytes(head, std::move(delta), out);
    return;
  }
  if (!response.has_topk() || response.topk().data().size() < kZeroCopyMin) {
    Serialize(response, out);
    return;
  }
  std::string answer = std::move(*response.mutable_topk()->mutable_data());
  response.mutable_topk()->clear_data();
  v1::Tensor topk;
  topk.Swap(response.mutable_topk());
  response.clear_topk();
  // [the response without topk][topk: tag 2, length, its fields but data, data's tag 3 and
  // length] + [the answer's bytes].
  std::string head = response.SerializeAsString();
  const std::string fields = topk.SerializeAsString();
  const uint64_t n = answer.size();
  std::string data_head;
  data_head.push_back(0x1a);  // Tensor.data: field 3, length-delimited
  PutVarint(data_head, n);
  head.push_back(0x12);  // DecodeStepResponse.topk: field 2, length-delimited
  PutVarint(head, fields.size() + data_head.size() + n);
  head += fields;
  head += data_head;
  HeadAndOwnedBytes(head, std::move(answer), out);
}

namespace {

// Per worker thread and method, the request and answer messages reused from call to call:
// cleared, their tensor buffers keep their capacity, so steady traffic allocates (and
// page-faults) nothing for them, as the sync edge's stream loop reuses its two messages. Held
// per worker, not per call, so open streams hold none; one that grew past kKeepBytes is
// dropped after its call instead of kept.
struct Scratch {
  std::unique_ptr<google::protobuf::Message> request;
  std::unique_ptr<google::protobuf::Message> response;
};
constexpr size_t kKeepBytes = size_t{8} << 20;

Scratch& ScratchFor(const Entry& entry) {
  thread_local std::array<Scratch, IndexerService::kNumMethods> scratch;
  Scratch& s = scratch[entry.method];
  if (s.request == nullptr) s.request.reset(entry.request->New());
  if (s.response == nullptr) s.response.reset(entry.response->New());
  return s;
}

void Recycle(std::unique_ptr<google::protobuf::Message>& message) {
  if (message->SpaceUsedLong() > kKeepBytes) {
    message.reset();
  } else {
    message->Clear();
  }
}

void Recycle(Scratch& s) {
  Recycle(s.request);
  Recycle(s.response);
}

}  // namespace

WorkerPool::WorkerPool(int threads) {
  max_data_ = std::max(1, threads - 1);
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::Post(Lane lane, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    (lane == Lane::kData ? data_ : control_).push_back(std::move(task));
  }
  cv_.notify_one();
}

bool WorkerPool::Runnable() const {
  return !control_.empty() || (!data_.empty() && data_running_ < max_data_);
}

void WorkerPool::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return Runnable() || (stopping_ && data_.empty()); });
    if (!Runnable()) return;  // stopping, and nothing left
    const bool data = control_.empty();
    std::deque<std::function<void()>>& queue = data ? data_ : control_;
    std::function<void()> task = std::move(queue.front());
    queue.pop_front();
    if (data) ++data_running_;
    lock.unlock();
    task();
    lock.lock();
    if (data) {
      --data_running_;
      // A data task may have been waiting for this slot while its thread slept.
      if (!data_.empty()) cv_.notify_all();
    }
  }
}

int DefaultEdgeWorkers() {
  return std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
}

// One call. Reactions (the constructor, OnReadDone, OnWriteDone) run on gRPC's threads and
// only start operations or post work; the bodies run on the pool. Every path ends in exactly
// one Finish / StartWriteAndFinish, after which gRPC calls OnDone and the call deletes itself;
// no task touches the call after starting its final operation.
class CallbackEdge::Call final : public grpc::ServerGenericBidiReactor {
 public:
  // `entry`: the method, null for an unknown `path`.
  Call(CallbackEdge& edge, grpc::CallbackServerContext* context, const Entry* entry,
       const std::string& path)
      : edge_(edge), service_(edge.service_), call_(context), entry_(entry), path_(path) {
    edge_.open_calls_.fetch_add(1, std::memory_order_relaxed);
    if (entry_ == nullptr) {
      // The token first on the guarded prefix: without it a client learns nothing, not even
      // which methods exist.
      absl::Status s = std::string_view(path).starts_with(kTokenGuardedPrefix)
                           ? service_.Authorize(call_)
                           : absl::OkStatus();
      s = s.ok() ? absl::UnimplementedError(
                       absl::StrCat("method ", EchoInput(path), " is not served here"))
                 : absl::UnauthenticatedError(
                       absl::StrCat(s.message(), "; refused before the request was read"));
      Finish(ToGrpcStatus(s));
      return;
    }
    // Before any message is read: a refused call's bytes are never buffered beyond the
    // stream's flow-control window, and never parsed.
    if (absl::Status s = service_.AuthorizeBeforeRead(entry_->method, call_); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    if (entry_->kind == Kind::kBidi) {
      if (absl::Status s = service_.OpenStream(call_, request_id_); !s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
    } else if (entry_->kind == Kind::kClientStream) {
      import_ = service_.ImportBegin(call_);
      if (!import_->status.ok()) {
        edge_.pool_.Post(WorkerPool::Lane::kData, [this] { EndImport(); });
        return;
      }
    }
    if (entry_->kind == Kind::kBidi) {
      std::lock_guard<std::mutex> lock(mu_);
      stream_.reading = true;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    const auto read_at = Clock::now();
    if (ok) edge_.bytes_read_.fetch_add(in_.Length(), std::memory_order_relaxed);
    switch (entry_->kind) {
      case Kind::kUnary:
      case Kind::kServerStream:
        if (!ok) {
          Finish(ToGrpcStatus(
              absl::InvalidArgumentError("request: the call ended without its request message")));
          return;
        }
        edge_.pool_.Post(entry_->data ? WorkerPool::Lane::kData : WorkerPool::Lane::kControl,
                         [this, read_at] { RunUnary(read_at); });
        return;
      case Kind::kBidi:
        StreamReadDone(ok, read_at);
        return;
      case Kind::kClientStream:
        edge_.pool_.Post(WorkerPool::Lane::kData, [this, ok] {
          if (ok) {
            RunImportChunk();
          } else {
            EndImport();
          }
        });
        return;
    }
  }

  void OnWriteDone(bool ok) override {
    if (entry_->kind == Kind::kBidi) {
      StreamWriteDone(ok);
      return;
    }
    out_.Clear();
    if (!ok) {
      Finish(ToGrpcStatus(absl::CancelledError("the client went away")));
      return;
    }
    WriteNextChunk();  // ExportSequence
  }

  void OnDone() override {
    edge_.open_calls_.fetch_sub(1, std::memory_order_relaxed);
    delete this;
  }

 private:
  // Unary methods and ExportSequence (one request).
  void RunUnary(Clock::time_point read_at) {
    Scratch& scratch = ScratchFor(*entry_);
    google::protobuf::Message& request = *scratch.request;
    if (!Parse(in_, request)) {
      Recycle(scratch);
      Finish(ToGrpcStatus(UnparseableRequestError(path_)));
      return;
    }
    if (entry_->kind == Kind::kServerStream) {
      absl::Status s = RunExport(static_cast<const v1::ExportSequenceRequest&>(request));
      Recycle(scratch);
      if (!s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
      WriteNextChunk();
      return;
    }
    google::protobuf::Message& response = *scratch.response;
    absl::Status s = service_.Unary(entry_->method, call_, request, response, read_at);
    if (s.ok() && response.GetDescriptor() == v1::DecodeStepResponse::descriptor()) {
      SerializeStepResponse(static_cast<v1::DecodeStepResponse&>(response), out_);
    } else if (s.ok()) {
      Serialize(response, out_);
    }
    Recycle(scratch);
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }

  // The chunks are serialized up front (the image is in memory anyway), so no worker waits
  // for a slow reader: the reactor writes them one after another.
  absl::Status RunExport(const v1::ExportSequenceRequest& request) {
    absl::Status s = service_.Export(call_, request, [this](v1::SequenceChunk& chunk) {
      chunks_.emplace_back();
      Serialize(chunk, chunks_.back());
      return absl::OkStatus();
    });
    if (!s.ok()) chunks_.clear();
    return s;
  }

  void WriteNextChunk() {
    if (next_chunk_ == chunks_.size()) {
      chunks_.clear();
      Finish(grpc::Status::OK);
      return;
    }
    out_.Swap(&chunks_[next_chunk_++]);
    StartWrite(&out_);
  }

  // DecodeStream. Steps run one at a time and are answered in request order, while the next
  // request is already being received (read ahead by one) and the previous answer may still
  // be being written (one queued behind it): at most one request waiting, one step running,
  // one answer written and one queued. The state is under mu_; operations are started after
  // it is released.
  struct StreamState {
    bool reading = false;      // a read in flight (into in_)
    bool half_closed = false;  // the client sent its last request
    bool has_next = false;     // next / next_read_at: a request read, its step not started
    grpc::ByteBuffer next;
    Clock::time_point next_read_at;
    bool stepping = false;  // a step on a worker
    bool writing = false;   // out_ in flight
    bool has_queued = false;
    grpc::ByteBuffer queued;  // an answer waiting for out_'s write
    bool failed = false;      // a step failed: its status once the writes are done
    grpc::Status failure;
    bool finished = false;
  };
  // What to start once mu_ is released.
  struct Actions {
    bool read = false;
    bool write = false;
    bool step = false;
    grpc::ByteBuffer step_request;
    Clock::time_point step_read_at;
    bool finish = false;
    grpc::Status status;
  };

  void StreamReadDone(bool ok, Clock::time_point read_at) {
    Actions a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stream_.reading = false;
      if (!ok) {
        stream_.half_closed = true;  // (or the client went away: then Finish is moot)
      } else {
        stream_.next.Swap(&in_);
        stream_.has_next = true;
        stream_.next_read_at = read_at;
      }
      Advance(a);
    }
    Act(a);
  }

  void StreamWriteDone(bool ok) {
    Actions a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stream_.writing = false;
      out_.Clear();
      if (!ok && !stream_.failed) {
        stream_.failed = true;
        stream_.failure = ToGrpcStatus(absl::CancelledError("the client went away"));
        stream_.has_queued = false;
        stream_.queued.Clear();
      }
      Advance(a);
    }
    Act(a);
  }

  // The next operations the state allows (mu_ held).
  void Advance(Actions& a) {
    StreamState& st = stream_;
    if (st.finished) return;
    if (!st.writing && st.has_queued) {
      out_.Swap(&st.queued);
      st.has_queued = false;
      st.writing = true;
      a.write = true;
    }
    if (st.failed) {
      st.has_next = false;
      st.next.Clear();
      if (!st.stepping && !st.writing) {
        st.finished = true;
        a.finish = true;
        a.status = st.failure;
      }
      return;
    }
    if (!st.stepping && st.has_next && !st.has_queued) {
      st.stepping = true;
      st.has_next = false;
      a.step = true;
      a.step_request.Swap(&st.next);
      a.step_read_at = st.next_read_at;
    }
    if (!st.reading && !st.half_closed && !st.has_next) {
      st.reading = true;
      a.read = true;
    }
    if (st.half_closed && !st.has_next && !st.stepping && !st.writing && !st.has_queued) {
      st.finished = true;  // every step answered
      a.finish = true;
      a.status = grpc::Status::OK;
    }
  }

  void Act(Actions& a) {
    if (a.write) StartWrite(&out_);
    if (a.read) StartRead(&in_);
    if (a.step) {
      edge_.pool_.Post(WorkerPool::Lane::kData,
                       [this, at = a.step_read_at, taken = std::move(a.step_request)]() mutable {
                         RunStreamStep(taken, at);
                       });
    }
    if (a.finish) Finish(a.status);
  }

  void RunStreamStep(grpc::ByteBuffer& buffer, Clock::time_point read_at) {
    grpc::ByteBuffer answer;
    absl::Status s;
    {
      ScopedRequestId scope(request_id_);
      Scratch& scratch = ScratchFor(*entry_);
      auto& request = static_cast<v1::DecodeStepRequest&>(*scratch.request);
      auto& response = static_cast<v1::DecodeStepResponse&>(*scratch.response);
      s = Parse(buffer, request) ? service_.StreamStep(call_, request, response, read_at)
                                 : UnparseableRequestError(path_);
      if (s.ok()) SerializeStepResponse(response, answer);
      Recycle(scratch);
    }
    Actions a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stream_.stepping = false;
      if (!s.ok()) {
        if (!stream_.failed) {
          stream_.failed = true;
          stream_.failure = ToGrpcStatus(s);
        }
      } else if (!stream_.failed) {
        stream_.queued.Swap(&answer);
        stream_.has_queued = true;
      }
      Advance(a);
    }
    Act(a);
  }

  void RunImportChunk() {
    v1::ImportSequenceRequest request;
    const absl::Status s = Parse(in_, request) ? service_.ImportChunk(*import_, request)
                                               : (import_->status = UnparseableRequestError(path_));
    if (!s.ok()) {
      EndImport();
      return;
    }
    StartRead(&in_);
  }

  void EndImport() {
    v1::ImportSequenceResponse response;
    absl::Status s = service_.ImportEnd(call_, *import_, response);
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    Serialize(response, out_);
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }

  CallbackEdge& edge_;
  IndexerService& service_;
  GrpcCallContext call_;
  const Entry* entry_;
  const std::string path_;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
  std::string request_id_;                              // DecodeStream
  std::vector<grpc::ByteBuffer> chunks_;                // ExportSequence
  size_t next_chunk_ = 0;                               // ExportSequence
  std::unique_ptr<IndexerService::ImportCall> import_;  // ImportSequence
  std::mutex mu_;                                       // DecodeStream: stream_
  StreamState stream_;
};

// Every DecodeIndexer method registered under its own path but as a raw bidi callback
// method: gRPC reads no message before the reactor starts one (a unary method registered as
// unary would have its request read first), and the server lists the service (reflection).
CallbackEdge::Methods::Methods(CallbackEdge& edge) {
  int index = 0;
  for (const auto& [path, entry] : Table()) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        entry.path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING, nullptr));
    const Entry* e = &entry;
    MarkMethodRawCallback(
        index++, new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                     [&edge, e](grpc::CallbackServerContext* context) {
                       return new Call(edge, context, e, e->path);
                     }));
  }
}

CallbackEdge::CallbackEdge(IndexerService& service, int workers)
    : service_(service), methods_(*this), pool_(workers > 0 ? workers : DefaultEdgeWorkers()) {}

grpc::ServerGenericBidiReactor* CallbackEdge::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new Call(*this, context, Lookup(context->method()), context->method());
}

}  // namespace decode_indexer::service
