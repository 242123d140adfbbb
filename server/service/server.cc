#include "server/service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

#ifndef DI_VERSION
#define DI_VERSION "unknown"
#endif

namespace decode_indexer::service {
namespace {

std::string ConnectAddress(const std::string& listen, int port) {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "localhost") {
    host = "127.0.0.1";
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (options.listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen: expected host:port, got \"", options.listen, "\""));
  }
  std::unique_ptr<Server> server(new Server());
  absl::StatusOr<std::unique_ptr<exec::Executor>> executor =
      exec::Executor::Create(options.profile, options.executor);
  if (!executor.ok()) return executor.status();
  server->executor_ = std::move(*executor);
  server->service_ = std::make_unique<IndexerService>(*server->executor_, DI_VERSION);

  // Both are process-wide switches read when the builder is made.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &server->port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    server->executor_->Shutdown();
    return absl::UnavailableError(absl::StrCat("listen: cannot serve on ", options.listen));
  }
  server->address_ = ConnectAddress(options.listen, server->port_);
  if (grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService()) {
    health->SetServingStatus(server->executor_->Status().healthy);
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
      health->SetServingStatus(false);
    }
    // Stops accepting at once; in-flight calls get until the deadline, then are cancelled.
    server_->Shutdown(std::chrono::system_clock::now() + deadline);
  }
  if (executor_ != nullptr) executor_->Shutdown();
}

void Server::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace decode_indexer::service
