#include "client/load/channel.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace decode_indexer::load {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ChannelConfig& config) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (config.tls_ca.empty()) {
    if (!config.tls_cert.empty() || !config.tls_key.empty()) {
      return absl::InvalidArgumentError("--tls-cert/--tls-key need --tls-ca");
    }
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    auto ca = ReadFile(config.tls_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    if (config.tls_cert.empty() != config.tls_key.empty()) {
      return absl::InvalidArgumentError("mutual TLS needs both --tls-cert and --tls-key");
    }
    if (!config.tls_cert.empty()) {
      auto cert = ReadFile(config.tls_cert);
      if (!cert.ok()) return cert.status();
      auto key = ReadFile(config.tls_key);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(config.max_message_bytes);
  args.SetMaxSendMessageSize(config.max_message_bytes);
  // A distinct argument value gives each channel its own subchannel, hence its own
  // connection: --channels N really opens N connections.
  args.SetInt("decode_indexer.load.channel_index", config.channel_index);
  if (!config.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(config.tls_server_name);
  }
  return grpc::CreateCustomChannel(config.target, credentials, args);
}

void PrepareContext(const ChannelConfig& config, grpc::ClientContext* context) {
  if (!config.bearer_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", config.bearer_token));
  }
}

std::string StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return absl::StrCat("CODE_", static_cast<int>(code));
  }
}

}  // namespace decode_indexer::load
