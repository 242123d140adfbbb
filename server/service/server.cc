#include "server/service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

#include "decode_indexer/version.h"

namespace decode_indexer::service {
namespace {

std::string ConnectAddress(const std::string& listen, int port) {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "localhost") {
    host = "127.0.0.1";
  }
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::string> ReadFile(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
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

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (options.listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen: expected host:port, got \"", options.listen, "\""));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = MakeCredentials(options);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<Server> server(new Server());
  absl::StatusOr<std::unique_ptr<exec::Executor>> executor =
      exec::Executor::Create(options.profile, options.executor);
  if (!executor.ok()) return executor.status();
  server->executor_ = std::move(*executor);
  ServiceOptions service_options;
  service_options.auth_token = options.auth_token;
  server->service_ =
      std::make_unique<IndexerService>(*server->executor_, DI_VERSION_STRING, service_options);

  // Both are process-wide switches read when the builder is made.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
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
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    server->executor_->Shutdown();
    return absl::UnavailableError(absl::StrCat("listen: cannot serve on ", options.listen));
  }
  server->address_ = ConnectAddress(options.listen, server->port_);
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
    server_->Shutdown(std::chrono::system_clock::now() + deadline);
  }
  if (executor_ != nullptr) executor_->Shutdown();
  metrics_.reset();
}

void Server::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace decode_indexer::service
