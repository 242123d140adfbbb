#include "client/indexer_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/tensor.h"
#include "common/malloc_tuning.h"

namespace decode_indexer::client {
namespace {

using Clock = std::chrono::steady_clock;

void SetTensor(const TensorView& view, v1::Tensor& out) {
  out.set_dtype(view.dtype);
  for (int64_t d : view.shape) out.add_shape(d);
  out.set_data(view.data.data(), view.data.size());
}

// Whether a step names sequences, and its first one, in either form.
bool StepNamesSequences(const v1::DecodeStepRequest& request) {
  return request.sequences_size() > 0 || request.sequence_ids_size() > 0;
}
uint64_t FirstSequence(const v1::DecodeStepRequest& request) {
  if (request.sequences_size() > 0) return request.sequences(0).sequence_id();
  if (request.sequence_ids_size() > 0) return request.sequence_ids(0);
  return 0;
}

}  // namespace

void BuildColumnarRequest(const ColumnarStep& step, v1::DecodeStepRequest& request) {
  request.Clear();
  request.set_layer(step.layer);
  request.set_step_id(step.step_id);
  request.set_return_candidates(step.return_candidates);
  request.set_answer_encoding(step.answer_encoding);
  request.set_timeout_us(step.timeout_us);
  request.mutable_sequence_ids()->Add(step.sequence_ids.begin(), step.sequence_ids.end());
  if (step.num_rows.empty()) {
    request.set_rows_per_sequence(step.rows_per_sequence);
  } else {
    request.mutable_num_rows()->Add(step.num_rows.begin(), step.num_rows.end());
  }
  if (step.new_keys.present()) SetTensor(step.new_keys, *request.mutable_new_keys());
  if (step.new_key_scales.present()) {
    SetTensor(step.new_key_scales, *request.mutable_new_key_scales());
  }
  request.mutable_new_key_counts()->Add(step.new_key_counts.begin(), step.new_key_counts.end());
  request.mutable_new_keys_positions()->Add(step.new_keys_positions.begin(),
                                            step.new_keys_positions.end());
  request.mutable_row_lengths()->Add(step.row_lengths.begin(), step.row_lengths.end());
  if (step.q.present()) SetTensor(step.q, *request.mutable_q());
  if (step.q_scales.present()) SetTensor(step.q_scales, *request.mutable_q_scales());
  if (step.weights.present()) SetTensor(step.weights, *request.mutable_weights());
  if (step.positions.present()) SetTensor(step.positions, *request.mutable_positions());
  if (step.cuda_ipc != nullptr) *request.mutable_cuda_ipc() = *step.cuda_ipc;
}

v1::DecodeStepRequest BuildColumnarRequest(const ColumnarStep& step) {
  v1::DecodeStepRequest request;
  BuildColumnarRequest(step, request);
  return request;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<StepAnswer> ParseStepResponse(const v1::DecodeStepResponse& response) {
  StepAnswer a;
  a.step_id = response.step_id();
  if (response.topk().shape_size() != 2) {
    return absl::InternalError(absl::StrCat("topk.shape: expected [rows, k], got ",
                                            response.topk().shape_size(), " dims"));
  }
  a.rows = static_cast<int32_t>(response.topk().shape(0));
  a.k = static_cast<int32_t>(response.topk().shape(1));
  const bool shape_only = NumElements(response.topk()) > 0 && response.topk().data().empty();
  if (shape_only && !response.topk_delta().empty()) {
    absl::StatusOr<std::vector<int32_t>> topk = DecodeTopkDelta(response.topk_delta(), a.rows, a.k);
    if (!topk.ok()) return topk.status();
    a.topk = std::move(*topk);
  } else if (shape_only) {
    a.in_shared_memory = true;
  } else {
    absl::StatusOr<std::vector<int32_t>> topk = ParseI32(response.topk());
    if (!topk.ok()) return topk.status();
    a.topk = std::move(*topk);
  }
  if (a.in_shared_memory && response.has_candidate_blocks()) {
    a.num_candidate_blocks = static_cast<int32_t>(response.candidate_blocks().shape(1));
  } else if (response.has_candidate_blocks()) {
    if (response.candidate_blocks().shape_size() != 2 ||
        response.candidate_blocks().shape(0) != a.rows) {
      return absl::InternalError("candidate_blocks.shape: expected [rows, blocks]");
    }
    absl::StatusOr<std::vector<int32_t>> cand = ParseI32(response.candidate_blocks());
    if (!cand.ok()) return cand.status();
    a.num_candidate_blocks = static_cast<int32_t>(response.candidate_blocks().shape(1));
    a.candidates = std::move(*cand);
  }
  a.sharded = response.sharded();
  a.queue_us = response.timing().queue_us();
  a.compute_us = response.timing().compute_us();
  a.lengths.assign(response.lengths().begin(), response.lengths().end());
  return a;
}

IndexerClient::IndexerClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : channel_(std::move(channel)),
      stub_(v1::DecodeIndexer::NewStub(channel_)),
      options_(options) {}

absl::StatusOr<std::unique_ptr<IndexerClient>> IndexerClient::Connect(
    const std::string& target, const ClientOptions& options) {
  if (options.malloc_keep_mb > 0) KeepFreedMemory(options.malloc_keep_mb);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.keepalive_time_ms > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, options.keepalive_time_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  if (options.keepalive_timeout_ms > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, options.keepalive_timeout_ms);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_root_ca.empty() || !options.tls_cert.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_ca;
    ssl.pem_private_key = options.tls_key;
    ssl.pem_cert_chain = options.tls_cert;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_target_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_target_name);
    }
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("target: cannot create a channel to ", target));
  }
  if (options.connect_timeout.count() > 0 &&
      !channel->WaitForConnected(std::chrono::system_clock::now() + options.connect_timeout)) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", target, " within ",
                                               options.connect_timeout.count(), " ms"));
  }
  return std::unique_ptr<IndexerClient>(new IndexerClient(std::move(channel), options));
}

void IndexerClient::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(std::chrono::system_clock::now() + options_.timeout);
  if (!options_.auth_token.empty()) {
    context.AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
}

absl::StatusOr<v1::ServerInfo> IndexerClient::ServerInfo() {
  grpc::ClientContext context;
  Prepare(context);
  v1::ServerInfo info;
  grpc::Status s = stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  if (!s.ok()) return FromGrpcStatus(s);
  return info;
}

absl::Status IndexerClient::CreateSequence(uint64_t sequence_id) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, sequence_id);
  v1::CreateSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::CreateSequenceResponse response;
  return FromGrpcStatus(stub_->CreateSequence(&context, request, &response));
}

absl::StatusOr<int64_t> IndexerClient::AppendKeys(const v1::AppendKeysRequest& request) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, request.sequence_id());
  v1::AppendKeysResponse response;
  grpc::Status s = stub_->AppendKeys(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.length();
}

absl::StatusOr<int64_t> IndexerClient::AppendKeys(uint64_t sequence_id, int32_t layer,
                                                  std::span<const float> keys, int32_t head_dim) {
  if (head_dim <= 0 || keys.size() % head_dim != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: ", keys.size(), " values are not [n, ", head_dim, "]"));
  }
  v1::AppendKeysRequest request;
  request.set_sequence_id(sequence_id);
  request.set_layer(layer);
  *request.mutable_keys() =
      F32Tensor(keys, {static_cast<int64_t>(keys.size() / head_dim), head_dim});
  return AppendKeys(request);
}

absl::StatusOr<int64_t> IndexerClient::AppendKeys(uint64_t sequence_id, int32_t layer,
                                                  v1::Tensor keys, v1::Tensor key_scales) {
  v1::AppendKeysRequest request;
  request.set_sequence_id(sequence_id);
  request.set_layer(layer);
  *request.mutable_keys() = std::move(keys);
  *request.mutable_key_scales() = std::move(key_scales);
  return AppendKeys(request);
}

absl::StatusOr<int64_t> IndexerClient::ReleaseSequence(uint64_t sequence_id) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, sequence_id);
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::ReleaseSequenceResponse response;
  grpc::Status s = stub_->ReleaseSequence(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.pages_freed();
}

absl::StatusOr<int64_t> IndexerClient::AppendKeysAt(uint64_t sequence_id, int32_t layer,
                                                    int64_t position, std::span<const float> keys,
                                                    int32_t head_dim) {
  if (head_dim <= 0 || keys.size() % head_dim != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: ", keys.size(), " values are not [n, ", head_dim, "]"));
  }
  v1::AppendKeysRequest request;
  request.set_sequence_id(sequence_id);
  request.set_layer(layer);
  request.set_position(position);
  if (!keys.empty()) {
    *request.mutable_keys() =
        F32Tensor(keys, {static_cast<int64_t>(keys.size() / head_dim), head_dim});
  }
  return AppendKeys(request);
}

absl::StatusOr<int64_t> IndexerClient::TruncateSequence(uint64_t sequence_id, int64_t length) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, sequence_id);
  v1::TruncateSequenceRequest request;
  request.set_sequence_id(sequence_id);
  request.set_length(length);
  v1::TruncateSequenceResponse response;
  grpc::Status s = stub_->TruncateSequence(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.pages_freed();
}

absl::Status IndexerClient::ForkSequence(uint64_t parent_id, uint64_t new_id, int64_t length) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, parent_id);  // the fork is made where the parent lives
  v1::ForkSequenceRequest request;
  request.set_parent_id(parent_id);
  request.set_new_id(new_id);
  request.set_length(length);
  v1::ForkSequenceResponse response;
  return FromGrpcStatus(stub_->ForkSequence(&context, request, &response));
}

absl::StatusOr<v1::GetSequenceResponse> IndexerClient::GetSequence(uint64_t sequence_id) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, sequence_id);
  v1::GetSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::GetSequenceResponse response;
  grpc::Status s = stub_->GetSequence(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<std::vector<v1::SequenceChunk>> IndexerClient::ExportSequence(uint64_t sequence_id,
                                                                             int64_t chunk_bytes) {
  grpc::ClientContext context;
  Prepare(context);
  RouteBySequence(context, sequence_id);
  v1::ExportSequenceRequest request;
  request.set_sequence_id(sequence_id);
  request.set_chunk_bytes(chunk_bytes);
  std::unique_ptr<grpc::ClientReader<v1::SequenceChunk>> reader =
      stub_->ExportSequence(&context, request);
  std::vector<v1::SequenceChunk> chunks;
  v1::SequenceChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(std::move(chunk));
  grpc::Status s = reader->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return chunks;
}

absl::StatusOr<uint64_t> IndexerClient::ImportSequence(uint64_t sequence_id,
                                                       std::span<const v1::SequenceChunk> chunks) {
  grpc::ClientContext context;
  Prepare(context);
  if (sequence_id != 0) RouteBySequence(context, sequence_id);
  v1::ImportSequenceResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ImportSequenceRequest>> writer =
      stub_->ImportSequence(&context, &response);
  bool first = true;
  for (const v1::SequenceChunk& chunk : chunks) {
    v1::ImportSequenceRequest request;
    if (first) request.set_sequence_id(sequence_id);
    first = false;
    *request.mutable_chunk() = chunk;
    if (!writer->Write(request)) break;  // the server answered early: Finish says why
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return response.sequence_id();
}

absl::StatusOr<uint64_t> IndexerClient::MigrateSequence(uint64_t sequence_id, IndexerClient& to,
                                                        uint64_t new_id) {
  grpc::ClientContext export_context;
  Prepare(export_context);
  RouteBySequence(export_context, sequence_id);
  v1::ExportSequenceRequest request;
  request.set_sequence_id(sequence_id);
  std::unique_ptr<grpc::ClientReader<v1::SequenceChunk>> reader =
      stub_->ExportSequence(&export_context, request);
  grpc::ClientContext import_context;
  to.Prepare(import_context);
  RouteBySequence(import_context, new_id == 0 ? sequence_id : new_id);
  v1::ImportSequenceResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ImportSequenceRequest>> writer =
      to.stub_->ImportSequence(&import_context, &response);
  v1::ImportSequenceRequest out;
  out.set_sequence_id(new_id == 0 ? sequence_id : new_id);
  bool writing = true;
  while (reader->Read(out.mutable_chunk())) {
    if (writing && !writer->Write(out)) writing = false;
    out.set_sequence_id(0);
  }
  grpc::Status exported = reader->Finish();
  if (!exported.ok()) {
    // The importer must not take a partial stream: cancel it.
    import_context.TryCancel();
    writer->Finish().ok();
    return FromGrpcStatus(exported);
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return response.sequence_id();
}

absl::StatusOr<StepAnswer> IndexerClient::DecodeStepColumnar(const ColumnarStep& step) {
  return DecodeStep(BuildColumnarRequest(step));
}

absl::StatusOr<StepAnswer> IndexerClient::DecodeStep(const v1::DecodeStepRequest& request) {
  grpc::ClientContext context;
  Prepare(context);
  // A batch is replica-affine: it is routed by its first sequence.
  if (StepNamesSequences(request)) RouteBySequence(context, FirstSequence(request));
  v1::DecodeStepResponse response;
  const auto start = Clock::now();
  grpc::Status s = stub_->DecodeStep(&context, request, &response);
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  if (!s.ok()) return FromGrpcStatus(s);
  absl::StatusOr<StepAnswer> answer = ParseStepResponse(response);
  if (answer.ok()) answer->client_us = us;
  return answer;
}

void RouteBySequence(grpc::ClientContext& context, uint64_t sequence_id) {
  context.AddMetadata(kSequenceIdMetadata, std::to_string(sequence_id));
}

absl::StatusOr<std::unique_ptr<StepStream>> IndexerClient::OpenStream(
    std::optional<uint64_t> route_sequence_id) {
  std::unique_ptr<StepStream> stream(new StepStream());
  stream->context_ = std::make_unique<grpc::ClientContext>();
  Prepare(*stream->context_);
  if (route_sequence_id.has_value()) RouteBySequence(*stream->context_, *route_sequence_id);
  stream->stream_ = stub_->DecodeStream(stream->context_.get());
  if (stream->stream_ == nullptr) return absl::UnavailableError("DecodeStream: cannot open");
  return stream;
}

absl::StatusOr<v1::Statistics> IndexerClient::GetStatistics() {
  grpc::ClientContext context;
  Prepare(context);
  v1::Statistics stats;
  grpc::Status s = stub_->GetStatistics(&context, v1::GetStatisticsRequest(), &stats);
  if (!s.ok()) return FromGrpcStatus(s);
  return stats;
}

absl::StatusOr<uint64_t> IndexerClient::RegisterSharedMemory(const SharedMemory& shm,
                                                             const std::string& socket_path) {
  std::string path = socket_path;
  if (path.empty()) {
    absl::StatusOr<v1::ServerInfo> info = ServerInfo();
    if (!info.ok()) return info.status();
    path = info->shm_socket();
    if (path.empty()) {
      return absl::FailedPreconditionError(
          "shared memory: the server has no --shm-socket (ServerInfo.shm_socket is empty)");
    }
  }
  return RegisterMemfd(path, shm.fd(), shm.size());
}

absl::StatusOr<uint64_t> RegisterMemfd(const std::string& socket_path, int fd, uint64_t size) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError("shm socket: path too long or empty");
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  if (connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(sock);
    return absl::UnavailableError(
        absl::StrCat("shm socket ", socket_path, ": connect: ", std::strerror(err)));
  }
  char payload[16];
  std::memcpy(payload, "DISHM001", 8);
  for (int i = 0; i < 8; ++i) payload[8 + i] = static_cast<char>(size >> (8 * i));
  iovec iov = {payload, sizeof(payload)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(sock, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(payload))) {
    const int err = errno;
    close(sock);
    return absl::UnavailableError(absl::StrCat("shm socket: sendmsg: ", std::strerror(err)));
  }
  char reply[12 + 256];
  ssize_t n;
  do {
    n = recv(sock, reply, sizeof(reply), 0);
  } while (n < 0 && errno == EINTR);
  close(sock);
  if (n < 12) return absl::UnavailableError("shm socket: no reply from the server");
  uint32_t code = 0;
  uint64_t id = 0;
  for (int i = 0; i < 4; ++i)
    code |= static_cast<uint32_t>(static_cast<uint8_t>(reply[i])) << (8 * i);
  for (int i = 0; i < 8; ++i)
    id |= static_cast<uint64_t>(static_cast<uint8_t>(reply[4 + i])) << (8 * i);
  if (code != 0) {
    const absl::StatusCode sc =
        code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
    return absl::Status(sc, std::string(reply + 12, static_cast<size_t>(n - 12)));
  }
  return id;
}

absl::Status IndexerClient::UnregisterSharedMemory(uint64_t region_id) {
  grpc::ClientContext context;
  Prepare(context);
  v1::UnregisterSharedMemoryRequest request;
  request.set_region_id(region_id);
  v1::UnregisterSharedMemoryResponse response;
  return FromGrpcStatus(stub_->UnregisterSharedMemory(&context, request, &response));
}

absl::StatusOr<uint64_t> IndexerClient::RegisterCudaIpcMemory(std::string_view handle,
                                                              uint64_t size, int32_t device,
                                                              std::string_view inputs_event,
                                                              std::string_view answer_event) {
  grpc::ClientContext context;
  Prepare(context);
  v1::RegisterCudaIpcMemoryRequest request;
  request.set_handle(handle.data(), handle.size());
  request.set_size(size);
  request.set_device(device);
  request.set_inputs_event(inputs_event.data(), inputs_event.size());
  request.set_answer_event(answer_event.data(), answer_event.size());
  v1::RegisterCudaIpcMemoryResponse response;
  grpc::Status s = stub_->RegisterCudaIpcMemory(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.region_id();
}

absl::Status IndexerClient::UnregisterCudaIpcMemory(uint64_t region_id) {
  grpc::ClientContext context;
  Prepare(context);
  v1::UnregisterCudaIpcMemoryRequest request;
  request.set_region_id(region_id);
  v1::UnregisterCudaIpcMemoryResponse response;
  return FromGrpcStatus(stub_->UnregisterCudaIpcMemory(&context, request, &response));
}

absl::StatusOr<v1::RegisterStepRingResponse> IndexerClient::RegisterStepRing(
    const v1::RegisterStepRingRequest& request) {
  grpc::ClientContext context;
  Prepare(context);
  v1::RegisterStepRingResponse response;
  grpc::Status s = stub_->RegisterStepRing(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<uint64_t> IndexerClient::UnregisterStepRing(uint64_t ring_id) {
  grpc::ClientContext context;
  Prepare(context);
  v1::UnregisterStepRingRequest request;
  request.set_ring_id(ring_id);
  v1::UnregisterStepRingResponse response;
  grpc::Status s = stub_->UnregisterStepRing(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.steps();
}

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(const std::string& name,
                                                                   uint64_t size) {
  const std::string label = name.empty() ? std::string("di-client") : name;
  const int fd = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  // Sized, its pages allocated (by this process, charged to it: the server refuses a region
  // whose pages it would have to allocate itself), then sealed: neither this process nor anyone
  // it passes the descriptor to can change the size again, which lets the server map it safely.
  int err = 0;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    err = errno;
  } else if (const int e = posix_fallocate(fd, 0, static_cast<off_t>(size)); e != 0) {
    err = e;
  } else if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    err = errno;
  }
  if (err != 0) {
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd of ", size, " bytes: ", std::strerror(err)));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mmap: ", std::strerror(err)));
  }
  std::unique_ptr<SharedMemory> shm(new SharedMemory());
  shm->base_ = static_cast<uint8_t*>(base);
  shm->size_ = size;
  shm->name_ = label;
  shm->fd_ = fd;
  return shm;
}

SharedMemory::~SharedMemory() {
  if (base_ != nullptr) munmap(base_, size_);
  if (fd_ >= 0) close(fd_);
}

StepStream::~StepStream() {
  if (stream_ != nullptr && !finished_) {
    context_->TryCancel();
    (void)stream_->Finish();
  }
}

absl::Status StepStream::Write(const v1::DecodeStepRequest& request) {
  if (finished_ || writes_done_) return absl::FailedPreconditionError("stream: already closed");
  if (!stream_->Write(request)) {
    // The server ended the stream (a failed step); its status says why.
    absl::Status s = Finish();
    return s.ok() ? absl::UnavailableError("stream: closed by the server") : s;
  }
  return absl::OkStatus();
}

absl::Status StepStream::WriteColumnar(const ColumnarStep& step) {
  BuildColumnarRequest(step, columnar_);
  return Write(columnar_);
}

absl::StatusOr<StepAnswer> StepStream::Read() {
  if (finished_) {
    return final_.ok() ? absl::OutOfRangeError("stream: finished") : final_;
  }
  v1::DecodeStepResponse response;
  if (!stream_->Read(&response)) {
    absl::Status s = Finish();
    return s.ok() ? absl::OutOfRangeError("stream: ended") : s;
  }
  return ParseStepResponse(response);
}

absl::StatusOr<StepAnswer> StepStream::Step(const v1::DecodeStepRequest& request) {
  if (absl::Status s = Write(request); !s.ok()) return s;
  return Read();
}

absl::Status StepStream::Finish() {
  if (finished_) return final_;
  if (!writes_done_) {
    stream_->WritesDone();
    writes_done_ = true;
  }
  // Drain answers the caller did not read, so Finish can complete.
  v1::DecodeStepResponse unread;
  while (stream_->Read(&unread)) {
  }
  final_ = FromGrpcStatus(stream_->Finish());
  finished_ = true;
  return final_;
}

}  // namespace decode_indexer::client
