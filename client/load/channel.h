// Channel set-up shared by decode-indexer-load and decode-indexer-health: plaintext or TLS
// (optionally mutual), an optional bearer token, and explicit message-size limits so a large
// decode step is never rejected by a client-side default.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace decode_indexer::load {

struct ChannelConfig {
  std::string target = "127.0.0.1:50051";
  // TLS when tls_ca is set (PEM file of the CA that signed the server); mutual TLS when
  // tls_cert and tls_key (PEM) are set as well.
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  // Overrides the name checked against the server certificate (tests use "localhost").
  std::string tls_server_name;
  // Sent as "authorization: Bearer <token>" on every call when non-empty.
  std::string bearer_token;
  int32_t max_message_bytes = 256 << 20;
  // Distinct channels never share a TCP connection (gRPC would otherwise pool them).
  int32_t channel_index = 0;
};

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ChannelConfig& config);

// Adds the per-call metadata (the bearer token) the config asks for.
void PrepareContext(const ChannelConfig& config, grpc::ClientContext* context);

// "DEADLINE_EXCEEDED" for grpc::StatusCode::DEADLINE_EXCEEDED, and so on.
std::string StatusCodeName(grpc::StatusCode code);

}  // namespace decode_indexer::load
