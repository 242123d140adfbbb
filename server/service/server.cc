#include "server/service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/server_interceptor.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/service/auth.h"
#include "server/service/listen_address.h"
#include "server/service/shm_socket.h"
#include "server/service/snapshot.h"
#include "server/service/status_mapping.h"
#include "spdlog/spdlog.h"

#include "decode_indexer/version.h"

namespace decode_indexer::service {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The key must belong to the certificate: gRPC would only say it "cannot serve".
absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem) {
  BIO* cert_bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = cert_bio ? PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(cert_bio);
  BIO* key_bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = key_bio ? PEM_read_bio_PrivateKey(key_bio, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(key_bio);
  absl::Status status = absl::OkStatus();
  if (cert == nullptr) {
    status = absl::InvalidArgumentError("tls-cert: not a PEM certificate");
  } else if (key == nullptr) {
    status = absl::InvalidArgumentError("tls-key: not a PEM private key (or it is encrypted)");
  } else if (X509_check_private_key(cert, key) != 1) {
    status = absl::InvalidArgumentError(
        "tls-key: the private key does not match the certificate of --tls-cert");
  }
  ERR_clear_error();
  X509_free(cert);
  EVP_PKEY_free(key);
  return status;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const ServerOptions& options) {
  if (options.tls_cert.empty() && options.tls_key.empty() && options.tls_client_ca.empty()) {
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_cert.empty() || options.tls_key.empty()) {
    return absl::InvalidArgumentError("tls: --tls-cert and --tls-key go together");
  }
  absl::StatusOr<std::string> cert = ReadFile("tls-cert", options.tls_cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile("tls-key", options.tls_key);
  if (!key.ok()) return key.status();
  if (absl::Status s = CheckKeyMatchesCertificate(*cert, *key); !s.ok()) return s;
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadFile("tls-client-ca", options.tls_client_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// The last word on every status a call ends with (gRPC's own included): gRPC answers a
// request whose bytes do not parse with INTERNAL and no message, which tells the client
// nothing; and a status message over kMaxStatusMessage is cut so it stays deliverable.
class StatusInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit StatusInterceptor(grpc::experimental::ServerRpcInfo* info)
      : method_(info->method() != nullptr ? info->method() : "") {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status s = methods->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::INTERNAL && s.error_message().empty()) {
        methods->ModifySendStatus(ToGrpcStatus(UnparseableRequestError(method_)));
      } else if (s.error_message().size() > kMaxStatusMessage) {
        methods->ModifySendStatus(grpc::Status(
            s.error_code(), s.error_message().substr(0, kMaxStatusMessage - 3) + "..."));
      }
    }
    methods->Proceed();
  }

 private:
  std::string method_;
};

class StatusInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new StatusInterceptor(info);
  }
};
// 128 random bits as hex: ServerInfo.instance_id of a start without a restore.
std::string NewInstanceId() {
  std::random_device rd;
  uint64_t a = (uint64_t(rd()) << 32) ^ rd();
  uint64_t b = (uint64_t(rd()) << 32) ^ rd();
  return absl::StrFormat("%016x%016x", a, b);
}

}  // namespace

int DefaultMaxMessageBytes(const config::Profile& profile, int64_t max_sequences) {
  // The largest legal DecodeStep: every live sequence at max_rows_per_sequence rows, fp32 q
  // [rows, H, D] + fp32 weights [rows, H] + int64 positions + one fp32 key [D] per row; and
  // a prefill chunk of 64 MiB (v32: 128K fp32 keys). Plus framing slack. Clients split
  // larger prefills.
  const int64_t rows = std::max<int64_t>(1, max_sequences) * profile.max_rows_per_sequence;
  const int64_t per_row = int64_t{profile.num_heads} * profile.head_dim * 4 +
                          int64_t{profile.num_heads} * 4 + 8 + int64_t{profile.head_dim} * 4 + 32;
  const int64_t step = rows * per_row + (1 << 20);
  const int64_t bytes = std::max<int64_t>(step, int64_t{64} << 20);
  return static_cast<int>(std::min<int64_t>(bytes, std::numeric_limits<int>::max()));
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  // Every address is checked before the executor allocates its caches, so a typo fails at
  // once and names the address.
  if (options.listen.empty()) {
    return absl::InvalidArgumentError("listen: no address to serve on");
  }
  absl::StatusOr<std::vector<ListenAddress>> parsed = ParseListenAddresses(options.listen);
  if (!parsed.ok()) return parsed.status();
  std::vector<ListenAddress> listen = *std::move(parsed);
  if (options.socket_mode < -1 || options.socket_mode > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket_mode: expected a file mode of 0..0777 (-1: as created), got ",
                     options.socket_mode));
  }
  if (absl::Status s = CheckShmSocketIsNotListened(options.shm_socket, listen); !s.ok()) return s;
  // Each socket path is locked, then checked, and stays locked for the server's life: a second
  // server started on one of them, even at the same instant, is refused here.
  std::vector<SocketPathLock> socket_locks;
  for (const ListenAddress& address : listen) {
    absl::StatusOr<SocketPathLock> lock = ReserveListenAddress(address);
    if (!lock.ok()) return lock.status();
    if (lock->held()) socket_locks.push_back(*std::move(lock));
  }
  // The shared-memory socket too, before the caches are allocated (it binds once the service
  // exists, under this lock).
  SocketPathLock shm_lock;
  if (!options.shm_socket.empty()) {
    absl::StatusOr<SocketPathLock> lock = ShmSocketServer::Reserve(options.shm_socket);
    if (!lock.ok()) return lock.status();
    shm_lock = *std::move(lock);
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = MakeCredentials(options);
  if (!credentials.ok()) return credentials.status();
  if (!options.snapshot_dir.empty()) {
    struct stat st;
    if (::stat(options.snapshot_dir.c_str(), &st) != 0 &&
        ::mkdir(options.snapshot_dir.c_str(), 0755) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "snapshot_dir: cannot create ", options.snapshot_dir, ": ", std::strerror(errno)));
    }
    if (::stat(options.snapshot_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        ::access(options.snapshot_dir.c_str(), W_OK) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("snapshot_dir: ", options.snapshot_dir, " is not a writable directory"));
    }
  }
  std::unique_ptr<Server> server(new Server());
  server->socket_locks_ = std::move(socket_locks);
  server->snapshot_dir_ = options.snapshot_dir;
  // One limit on a step's sequences: the edge refuses more than --max-sequences-per-step, and
  // the executor sizes its per-step buffers for exactly that many (it refused more than its
  // own default of 256 even when the flag allowed more).
  exec::ExecutorOptions executor_options = options.executor;
  if (options.max_sequences_per_step > 0) {
    executor_options.max_requests_per_step = options.max_sequences_per_step;
  }
  absl::StatusOr<std::unique_ptr<exec::Executor>> executor =
      exec::Executor::Create(options.profile, executor_options);
  if (!executor.ok()) return executor.status();
  server->executor_ = std::move(*executor);
  const int receive_limit =
      options.max_message_bytes > 0
          ? options.max_message_bytes
          : DefaultMaxMessageBytes(options.profile, options.max_sequences_per_step);
  const int send_limit =
      options.max_send_message_bytes > 0 ? options.max_send_message_bytes : receive_limit;
  ServiceOptions service_options;
  service_options.auth_token = options.auth_token;
  service_options.max_send_message_bytes = send_limit;
  service_options.max_sequences_per_step = options.max_sequences_per_step;
  server->service_ =
      std::make_unique<IndexerService>(*server->executor_, DI_VERSION_STRING, service_options);
  if (!options.shm_socket.empty()) {
    if (absl::Status s = server->service_->StartShmSocket(options.shm_socket, std::move(shm_lock),
                                                          options.socket_mode);
        !s.ok()) {
      server->executor_->Shutdown();
      return s;
    }
  }
  if (!options.tls_cert.empty()) {
    // TLS: the token (and with mutual TLS the client certificate's use) is checked in gRPC's
    // auth filter, before a request is read or its handler runs.
    AuthOptions auth;
    auth.token = options.auth_token;
    auth.check_client_certificate = !options.tls_client_ca.empty();
    if (absl::StatusOr<std::string> pem = ReadFile("tls-cert", options.tls_cert); pem.ok()) {
      auth.server_certificate_pem = *std::move(pem);
    }
    (*credentials)
        ->SetAuthMetadataProcessor(
            MakeAuthProcessor(std::move(auth), server->service_->AuthRefusedCounter()));
  }
  server->service_->SetInstanceId(NewInstanceId());
  // Until the snapshot is restored every call answers UNAVAILABLE and health NOT_SERVING.
  server->service_->SetRestoring(!options.snapshot_dir.empty());

  // Both are process-wide switches read when the builder is made.
  grpc::EnableDefaultHealthCheckService(true);
  if (options.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // One set of credentials for every address: TLS on a Unix socket works (gRPC allows it;
  // clients must verify the certificate against a name it holds, e.g. with
  // ssl_target_name_override), it only costs the handshake and the encryption on bytes that
  // never leave the host.
  std::vector<int> ports(listen.size(), 0);
  for (size_t i = 0; i < listen.size(); ++i) {
    builder.AddListeningPort(listen[i].address, *credentials, &ports[i]);
  }
  // gRPC sets SO_REUSEPORT on TCP listeners by default, so a second server started on a live
  // server's host:port would start too and the kernel would split new connections between
  // the two: a client's sequences would live in one process and its next call land in the
  // other. This server holds state, so the port is its own: a second bind fails.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(receive_limit);
  builder.SetMaxSendMessageSize(send_limit);
  // Bounded streams and threads: one connection cannot open more than
  // max_concurrent_streams calls at once (HTTP/2 SETTINGS), and the sync server's handler
  // threads (the sync edge's calls, reflection on either edge) stop at max_threads (further
  // calls wait for one) instead of one per stream. The callback edge needs no thread per
  // call: its bodies run on edge_workers threads.
  if (options.max_concurrent_streams > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  }
  if (options.max_threads > 0) {
    grpc::ResourceQuota quota("decode-indexer");
    quota.SetMaxThreads(options.max_threads);
    builder.SetResourceQuota(quota);
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<StatusInterceptorFactory>());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  if (options.keepalive_time_ms > 0) {
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, options.keepalive_time_ms);
  }
  if (options.keepalive_timeout_ms > 0) {
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, options.keepalive_timeout_ms);
  }
  if (options.keepalive_min_ping_ms > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                               options.keepalive_min_ping_ms);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  if (options.grpc_edge == ServerOptions::GrpcEdge::kCallback) {
    server->edge_ = std::make_unique<CallbackEdge>(*server->service_, options.edge_workers);
    builder.RegisterService(server->edge_->methods());
    builder.RegisterCallbackGenericService(server->edge_.get());
  } else {
    builder.RegisterService(server->service_.get());
  }
  server->server_ = builder.BuildAndStart();
  // gRPC reports a bound socket as port 1 and a failed address as port 0.
  const auto failed = std::find(ports.begin(), ports.end(), 0);
  if (server->server_ == nullptr || failed != ports.end()) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    server->executor_->Shutdown();
    const ListenAddress& at = listen[failed == ports.end() ? 0 : failed - ports.begin()];
    // An abstract name takes no lock (no file to take over): a second bind of a name in use
    // fails with EADDRINUSE, which gRPC only logs; a bind of our own says so.
    if (at.kind == ListenAddress::Kind::kUnixAbstract && BindAbstractErrno(at.path) == EADDRINUSE) {
      return absl::AlreadyExistsError(absl::StrCat(
          "listen: ", EchoInput(at.address),
          ": another process holds the abstract name (bind: ", std::strerror(EADDRINUSE), ")"));
    }
    return absl::UnavailableError(absl::StrCat(
        "listen: cannot serve on ", EchoInput(at.address),
        at.is_unix() ? " (see gRPC's error above)" : " (address in use or not local?)"));
  }
  // --socket-mode on gRPC's socket files. gRPC binds and starts accepting inside BuildAndStart,
  // so from its bind until this chmod a socket has the mode the process umask gives it (0777
  // less the umask): a client the umask lets in can connect in that window, before the server
  // is announced (logged, reported to the caller). A mode narrower than the umask's is only
  // airtight with a matching umask or a directory only the intended users can enter.
  for (const ListenAddress& address : listen) {
    if (address.kind != ListenAddress::Kind::kUnixPath || options.socket_mode < 0) continue;
    if (absl::Status s = ApplySocketMode(address.path, options.socket_mode,
                                         absl::StrCat("listen: ", EchoInput(address.address)));
        !s.ok()) {
      server->server_->Shutdown();
      server->executor_->Shutdown();
      return s;
    }
  }
  for (size_t i = 0; i < listen.size(); ++i) {
    if (!listen[i].is_unix() && server->port_ == 0) server->port_ = ports[i];
    server->addresses_.push_back(ConnectAddress(listen[i], ports[i]));
  }
  server->drain_grace_ = options.drain_grace;
  if (options.metrics_auth && options.auth_token.empty()) {
    server->server_->Shutdown();
    server->executor_->Shutdown();
    return absl::InvalidArgumentError(
        "metrics-auth: needs the server's bearer token (--auth-token or DI_AUTH_TOKEN)");
  }
  if (!options.metrics_listen.empty()) {
    IndexerService* service = server->service_.get();
    MetricsHttpOptions http;
    http.listen = options.metrics_listen;
    if (options.metrics_auth) http.bearer_token = options.auth_token;
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics =
        MetricsHttpServer::Start(http, [service] { return service->RenderMetrics(); });
    if (!metrics.ok()) {
      server->server_->Shutdown();
      server->executor_->Shutdown();
      return metrics.status();
    }
    server->metrics_ = std::move(*metrics);
  }
  if (!options.snapshot_dir.empty()) {
    if (grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
    absl::StatusOr<std::optional<SnapshotInfo>> restored =
        RestoreSnapshot(*server->executor_, options.snapshot_dir);
    if (!restored.ok()) {
      server->server_->Shutdown(std::chrono::system_clock::now());
      server->executor_->Shutdown();
      server->shut_down_ = true;
      return restored.status();
    }
    if (restored->has_value()) {
      const SnapshotInfo& info = **restored;
      server->service_->SetInstanceId(info.instance_id);
      spdlog::info("snapshot: restored {} sequences ({} bytes) from {} in {:.3f} s; instance {}",
                   info.sequences, info.bytes, info.path, info.seconds, info.instance_id);
    } else {
      spdlog::info("snapshot: none in {}; starting empty as instance {}", options.snapshot_dir,
                   server->service_->instance_id());
    }
    server->service_->SetRestoring(false);
  }
  if (grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService()) {
    // By name too: a balancer may ask for the DecodeIndexer service rather than "".
    const bool healthy = server->executor_->Status().healthy;
    health->SetServingStatus(kHealthServiceName, healthy);
    health->SetServingStatus(healthy);
    // A device or collective fault later turns the whole server NOT_SERVING.
    server->service_->SetHealthSink([health](bool serving) { health->SetServingStatus(serving); });
  }
  return server;
}

Server::~Server() { Shutdown(std::chrono::seconds(2)); }

void Server::Shutdown(std::chrono::milliseconds deadline) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);  // every name, "" and kHealthServiceName
    }
    // Still serving, but reporting NOT_SERVING: balancers take this replica out first.
    if (drain_grace_.count() > 0) {
      spdlog::info("drain: health NOT_SERVING; still accepting for {} ms", drain_grace_.count());
      std::this_thread::sleep_for(drain_grace_);
    }
    // Stops accepting at once; in-flight calls get until the deadline, then are cancelled.
    // On the callback edge this also waits for every reactor (each finishes only after its
    // worker task): the edge's pool is idle once it returns, and goes with the Server.
    server_->Shutdown(std::chrono::system_clock::now() + deadline);
  }
  // The fast path's pollers too: after this nothing changes a sequence.
  if (service_ != nullptr) service_->StopStepRings();
  if (executor_ != nullptr && !snapshot_dir_.empty()) {
    // After the drain: no call can change a sequence any more.
    absl::StatusOr<SnapshotInfo> info =
        WriteSnapshot(*executor_, snapshot_dir_, service_->instance_id());
    if (info.ok()) {
      spdlog::info("snapshot: wrote {} sequences ({} bytes) to {} in {:.3f} s", info->sequences,
                   info->bytes, info->path, info->seconds);
    } else {
      snapshot_status_ = info.status();
      spdlog::error("snapshot: {}", info.status().ToString());
    }
  }
  if (executor_ != nullptr) executor_->Shutdown();
  metrics_.reset();
}

void Server::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace decode_indexer::service
