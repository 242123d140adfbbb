// Who may call: the bearer token and, on TLS, the client certificate's intended use, checked in
// gRPC's auth filter (an AuthMetadataProcessor) before a call reaches its handler.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <grpcpp/security/auth_metadata_processor.h>

#include "absl/status/status.h"

namespace decode_indexer::service {

// The gRPC methods that need the token (when one is set): every DecodeIndexer RPC. The others
// (grpc.health.v1.Health, grpc.reflection when served) stay open for probes.
inline constexpr std::string_view kTokenGuardedPrefix = "/decode_indexer.v1.DecodeIndexer/";

// Whether an authorization metadata value is "Bearer <token>", in time independent of where
// the bytes differ.
bool BearerTokenMatches(std::string_view authorization, std::string_view token);

// Whether a client's PEM certificate (which the TLS handshake has verified against the client
// CA) may serve as a client identity: UNAUTHENTICATED when it is the server's own certificate
// (`server_pem`, when given), when it has an extendedKeyUsage extension without clientAuth or
// anyExtendedKeyUsage (a certificate issued for something else, e.g. a server), or when it
// does not parse. No extendedKeyUsage extension at all is unrestricted (RFC 5280 4.2.1.12):
// OK. (OpenSSL's handshake applies the same extendedKeyUsage rule on its own: this is the
// second line, and the place where the server's own certificate is told apart.)
absl::Status CheckClientCertificateUse(std::string_view pem, std::string_view server_pem = {});

struct AuthOptions {
  std::string token;  // empty: no token checked
  // Check the peer certificate with CheckClientCertificateUse (mutual TLS), against the
  // server's own certificate (PEM).
  bool check_client_certificate = false;
  std::string server_certificate_pem;
};

// The processor a TLS server installs on its credentials (SslServerCredentials have no
// certificate-verify hook in gRPC 1.51; the processor sees the peer's certificate in the
// AuthContext, property "x509_pem_cert"). Non-blocking: it runs inline in the auth filter, so
// it adds no thread. A refused call ends there: its handler never runs and its message is
// never handed to the application. `refused` counts the calls it refused.
std::shared_ptr<grpc::AuthMetadataProcessor> MakeAuthProcessor(AuthOptions options,
                                                               std::atomic<uint64_t>* refused);

}  // namespace decode_indexer::service
