// The server: an executor behind the gRPC edge, with health and reflection. Usable
// in-process (tests start one on 127.0.0.1:0) and by decode-indexer-server.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/service/indexer_service.h"

namespace decode_indexer::service {

struct ServerOptions {
  // host:port; port 0 picks a free port (reported by Server::port()).
  std::string listen = "0.0.0.0:50051";
  config::Profile profile;
  exec::ExecutorOptions executor;
  // Explicit, both ways: a v32 prefill of 128K fp32 keys is 64 MiB.
  int max_message_bytes = 512 << 20;
};

class Server {
 public:
  // Builds the executor, then starts serving (health SERVING).
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  // Shutdown with a short deadline if not done yet.

  int port() const { return port_; }
  // "127.0.0.1:<port>" when listening on a wildcard or loopback address, else the listen host.
  std::string address() const { return address_; }
  const exec::Executor& executor() const { return *executor_; }
  exec::Executor& executor() { return *executor_; }

  // Drains: health NOT_SERVING, stop accepting, let in-flight calls finish until `deadline`
  // (then cancel them), then shut the executor down. Idempotent; thread-safe.
  void Shutdown(std::chrono::milliseconds deadline = std::chrono::seconds(10));
  // Blocks until Shutdown() has completed.
  void Wait();

 private:
  Server() = default;

  std::unique_ptr<exec::Executor> executor_;
  std::unique_ptr<IndexerService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace decode_indexer::service
