// The server: an executor behind the gRPC edge, with health and reflection. Usable
// in-process (tests start one on 127.0.0.1:0) and by decode-indexer-server.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/service/callback_edge.h"
#include "server/service/indexer_service.h"
#include "server/service/listen_address.h"
#include "server/service/metrics.h"

namespace decode_indexer::service {

struct ServerOptions {
  // Every address to serve on (listen_address.h): host:port (port 0 picks a free port,
  // reported by Server::port()), or a Unix socket, unix:PATH / unix-abstract:NAME, for
  // clients on this host (no TCP stack between them and the server). All of them share the
  // same credentials, token and limits.
  std::vector<std::string> listen = {"0.0.0.0:50051"};
  config::Profile profile;
  exec::ExecutorOptions executor;
  // The receive (and, unless max_send_message_bytes, send) limit; 0: sized from the profile
  // (DefaultMaxMessageBytes), so an unauthenticated client cannot make the server buffer
  // more than the largest legal request.
  int max_message_bytes = 0;
  // The send limit when > 0 (else max_message_bytes): answers are checked against it before
  // a step runs.
  int max_send_message_bytes = 0;
  // HTTP/2 streams one connection may have open at once, and the most threads the server's
  // sync handlers may use (a grpc::ResourceQuota); 0 leaves gRPC's default.
  int max_concurrent_streams = 0;
  int max_threads = 0;
  // The DecodeIndexer edge (callback_edge.h): kCallback serves it through a generic callback
  // reactor per call (the token checked before a request is read, on plaintext too; open
  // streams cost no thread; method bodies on a fixed pool of edge_workers threads, 0:
  // DefaultEdgeWorkers); kSync through gRPC's sync typed service (a thread per running call,
  // bounded by max_threads; on plaintext the token is checked after the request was read).
  enum class GrpcEdge { kCallback, kSync };
  GrpcEdge grpc_edge = GrpcEdge::kCallback;
  int edge_workers = 0;
  // Unix socket for sealed-memfd shared-memory registration; empty: no shared memory. Its
  // path is checked and locked before anything is allocated, as --listen's are.
  std::string shm_socket;
  // --socket-mode: the file mode (0..0777) every socket file the server creates is given right
  // after its bind (the unix: paths of `listen` and shm_socket); -1 leaves them as created (a
  // unix: socket: 0777 less the process umask; shm_socket: 0600).
  int socket_mode = -1;
  // Sequences one DecodeStep may carry (INVALID_ARGUMENT beyond): what bounds the largest
  // legal request, and so the default message limit; the executor's per-step capacity
  // (ExecutorOptions::max_requests_per_step) is set to it.
  int max_sequences_per_step = 256;
  // Serve grpc.reflection (decode-indexer-server turns it off when a token is set).
  bool reflection = true;
  // host:port of the Prometheus /metrics HTTP endpoint; empty: none (port 0 picks one).
  std::string metrics_listen;
  // Bearer token every DecodeIndexer call must carry; empty: no authentication. On TLS it is
  // checked in gRPC's auth filter before the request is read (auth.h), and by the handler.
  std::string auth_token;
  // Whether GET /metrics also demands "Authorization: Bearer <auth_token>" (needs a token).
  bool metrics_auth = false;
  // Health NOT_SERVING this long before a drain stops accepting calls, so that balancers
  // watching grpc.health.v1 stop routing here first (0: stop at once).
  std::chrono::milliseconds drain_grace{0};
  // PEM files. cert + key: TLS; plus client_ca: mutual TLS (clients must present a
  // certificate signed by it and meant for clients: auth.h's CheckClientCertificateUse). All
  // empty: plaintext.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // HTTP/2 keepalive: ping an idle connection every keepalive_time_ms, drop it when the ack
  // takes longer than keepalive_timeout_ms; clients may ping no more often than
  // keepalive_min_ping_ms. 0 leaves gRPC's default.
  int keepalive_time_ms = 0;
  int keepalive_timeout_ms = 0;
  int keepalive_min_ping_ms = 0;
  // --snapshot-dir: on Shutdown, after the drain, every sequence is written to
  // DIR/snapshot.bin (service/snapshot.h); Start restores it before health reports SERVING
  // (the instance id is kept) and refuses to start on a torn, corrupt or mismatched file.
  std::string snapshot_dir;
};

// The default message limit: the largest legal DecodeStep of `profile` (`max_sequences`
// sequences at max_rows_per_sequence rows, fp32 q), or a 64 MiB prefill chunk, whichever is
// larger, plus slack.
int DefaultMaxMessageBytes(const config::Profile& profile, int64_t max_sequences);

class Server {
 public:
  // Builds the executor, then starts serving (health SERVING).
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  // Shutdown with a short deadline if not done yet.

  // The port of the first TCP address (0 when every address is a Unix socket).
  int port() const { return port_; }
  // The /metrics port, 0 without --metrics-listen.
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  IndexerService& service() { return *service_; }
  // The callback edge; null on the sync edge.
  CallbackEdge* callback_edge() const { return edge_.get(); }
  // What a client on this host dials, one per listen address in order: "127.0.0.1:<port>"
  // for a wildcard or loopback host, else the host with the bound port; a socket as given.
  const std::vector<std::string>& addresses() const { return addresses_; }
  // The first of them.
  std::string address() const { return addresses_.front(); }
  const exec::Executor& executor() const { return *executor_; }
  exec::Executor& executor() { return *executor_; }

  // The name health reports for the DecodeIndexer service ("" covers the whole server).
  static constexpr const char* kHealthServiceName = "decode_indexer.v1.DecodeIndexer";

  // Drains: health NOT_SERVING (every service name), wait drain_grace while still serving,
  // stop accepting, let in-flight calls finish until `deadline`
  // (then cancel them), then shut the executor down. Idempotent; thread-safe.
  void Shutdown(std::chrono::milliseconds deadline = std::chrono::seconds(10));
  // Blocks until Shutdown() has completed.
  void Wait();
  // What Shutdown's snapshot came to (OK without --snapshot-dir).
  absl::Status snapshot_status() const {
    std::lock_guard<std::mutex> lock(shutdown_mu_);
    return snapshot_status_;
  }

 private:
  Server() = default;

  // The locks of the unix: paths of `listen` (listen_address.h's SocketPathLock), declared first
  // so they go last: a path stays the server's until gRPC has removed its socket file.
  std::vector<SocketPathLock> socket_locks_;
  std::unique_ptr<exec::Executor> executor_;
  std::unique_ptr<IndexerService> service_;
  // Outlives server_ (declared before it): gRPC's threads run its reactors until the
  // server has shut down; Shutdown then joins its workers.
  std::unique_ptr<CallbackEdge> edge_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> metrics_;
  int port_ = 0;
  std::vector<std::string> addresses_;
  std::chrono::milliseconds drain_grace_{0};
  mutable std::mutex shutdown_mu_;
  bool shut_down_ = false;
  std::string snapshot_dir_;
  absl::Status snapshot_status_;
};

}  // namespace decode_indexer::service
