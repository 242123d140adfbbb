// decode-indexer-health: a grpc_health_probe stand-in for Docker and compose health checks.
// Calls grpc.health.v1.Health/Check once and exits 0 only when the answer is SERVING; 1 on
// NOT_SERVING or any RPC failure, 2 on a usage error. A draining server answers NOT_SERVING,
// so an orchestrator stops routing to it before it exits.
#include <chrono>
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "client/load/channel.h"
#include "common/cli.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace {

const char* ServingStatusName(grpc::health::v1::HealthCheckResponse::ServingStatus status) {
  using Response = grpc::health::v1::HealthCheckResponse;
  switch (status) {
    case Response::SERVING:
      return "SERVING";
    case Response::NOT_SERVING:
      return "NOT_SERVING";
    case Response::SERVICE_UNKNOWN:
      return "SERVICE_UNKNOWN";
    default:
      return "UNKNOWN";
  }
}

}  // namespace

int main(int argc, char** argv) {
  decode_indexer::load::ChannelConfig config;
  std::string service;
  double timeout_s = 2.0;
  bool quiet = false;
  CLI::App app{"Checks grpc.health.v1 of a decode-indexer server; exit 0 when SERVING."};
  // Every flag can come from the environment (the flag wins), so that a container's fixed
  // HEALTHCHECK command follows the deployment's address and TLS settings.
  app.add_option("--addr,--target", config.target, "server address host:port")
      ->envname("DI_HEALTH_ADDR")
      ->capture_default_str();
  app.add_option("--service", service, "service name to check (\"\": the whole server)")
      ->envname("DI_HEALTH_SERVICE");
  app.add_option("--timeout", timeout_s, "RPC deadline in seconds")->capture_default_str();
  app.add_option("--tls-ca", config.tls_ca, "CA certificate (PEM): use TLS")
      ->envname("DI_HEALTH_TLS_CA");
  app.add_option("--tls-cert", config.tls_cert, "client certificate (PEM) for mutual TLS")
      ->envname("DI_HEALTH_TLS_CERT");
  app.add_option("--tls-key", config.tls_key, "client key (PEM) for mutual TLS")
      ->envname("DI_HEALTH_TLS_KEY");
  app.add_option("--tls-server-name", config.tls_server_name, "name to verify in the cert")
      ->envname("DI_HEALTH_TLS_SERVER_NAME");
  app.add_option("--token", config.bearer_token, "bearer token");
  app.add_flag("-q,--quiet", quiet, "print nothing");
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);

  auto channel = decode_indexer::load::MakeChannel(config);
  if (!channel.ok()) {
    if (!quiet) std::fprintf(stderr, "%s\n", channel.status().ToString().c_str());
    return 2;
  }
  auto stub = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext context;
  decode_indexer::load::PrepareContext(config, &context);
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    if (!quiet) {
      std::fprintf(stderr, "%s: health check failed: %s: %s\n", config.target.c_str(),
                   decode_indexer::load::StatusCodeName(status.error_code()).c_str(),
                   status.error_message().c_str());
    }
    return 1;
  }
  if (!quiet) std::printf("%s\n", ServingStatusName(response.status()));
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}
