#include "server/service/auth.h"

#include <grpc/grpc_security_constants.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <mutex>
#include <unordered_map>
#include <utility>

namespace decode_indexer::service {
namespace {

std::string_view View(const grpc::string_ref& s) { return std::string_view(s.data(), s.size()); }

X509* ReadPem(std::string_view pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  X509* cert = bio ? PEM_read_bio_X509(bio, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(bio);
  return cert;
}

class AuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  AuthProcessor(AuthOptions options, std::atomic<uint64_t>* refused)
      : options_(std::move(options)), refused_(refused) {}

  // Inline in the auth filter: no thread of gRPC's pool per call.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    grpc::Status s = Check(metadata, context);
    if (!s.ok() && refused_ != nullptr) refused_->fetch_add(1, std::memory_order_relaxed);
    return s;
  }

 private:
  grpc::Status Check(const InputMetadata& metadata, const grpc::AuthContext* context) {
    if (options_.check_client_certificate && context != nullptr) {
      // The handshake verified the chain; its use is checked here (once per certificate).
      const std::vector<grpc::string_ref> pems =
          context->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME);
      if (pems.empty()) {
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            "mutual TLS: the client presented no certificate");
      }
      if (absl::Status s = CachedUse(View(pems.front())); !s.ok()) {
        return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(s.message()));
      }
    }
    if (options_.token.empty()) return grpc::Status::OK;
    // Health and reflection stay open (probes); every DecodeIndexer method needs the token. A
    // call without a path (none is expected) is held to the token.
    auto path = metadata.find(":path");
    if (path != metadata.end() && !View(path->second).starts_with(kTokenGuardedPrefix)) {
      return grpc::Status::OK;
    }
    auto range = metadata.equal_range("authorization");
    for (auto it = range.first; it != range.second; ++it) {
      if (BearerTokenMatches(View(it->second), options_.token)) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing or wrong bearer token (authorization metadata); refused before "
                        "the request was read");
  }

  absl::Status CachedUse(std::string_view pem) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = verdicts_.find(std::string(pem));
    if (it != verdicts_.end()) return it->second;
    absl::Status s = CheckClientCertificateUse(pem, options_.server_certificate_pem);
    if (verdicts_.size() >= kMaxVerdicts) verdicts_.clear();
    verdicts_.emplace(std::string(pem), s);
    return s;
  }

  static constexpr size_t kMaxVerdicts = 256;
  const AuthOptions options_;
  std::atomic<uint64_t>* refused_;
  std::mutex mu_;
  std::unordered_map<std::string, absl::Status> verdicts_;  // by PEM
};

}  // namespace

bool BearerTokenMatches(std::string_view authorization, std::string_view token) {
  constexpr std::string_view kScheme = "Bearer ";
  if (authorization.size() != kScheme.size() + token.size()) return false;
  // Constant time in the token's bytes: no early exit a timing probe could read.
  unsigned char diff = 0;
  for (size_t i = 0; i < authorization.size(); ++i) {
    const char want = i < kScheme.size() ? kScheme[i] : token[i - kScheme.size()];
    diff |= static_cast<unsigned char>(authorization[i] ^ want);
  }
  return diff == 0;
}

absl::Status CheckClientCertificateUse(std::string_view pem, std::string_view server_pem) {
  X509* cert = ReadPem(pem);
  X509* server = server_pem.empty() ? nullptr : ReadPem(server_pem);
  absl::Status status = absl::OkStatus();
  if (cert == nullptr) {
    status = absl::UnauthenticatedError("mutual TLS: the client certificate does not parse");
  } else if (server != nullptr && X509_cmp(cert, server) == 0) {
    status = absl::UnauthenticatedError(
        "mutual TLS: the client presented the server's own certificate (give clients "
        "certificates of their own)");
  } else {
    const uint32_t flags = X509_get_extension_flags(cert);
    const uint32_t usage = X509_get_extended_key_usage(cert);
    if ((flags & EXFLAG_INVALID) != 0) {
      status =
          absl::UnauthenticatedError("mutual TLS: the client certificate has invalid extensions");
    } else if ((flags & EXFLAG_XKUSAGE) != 0 && (usage & (XKU_SSL_CLIENT | XKU_ANYEKU)) == 0) {
      // No extension: unrestricted (RFC 5280 4.2.1.12). An extension without clientAuth (or
      // anyExtendedKeyUsage): a certificate issued for something else, e.g. a server's.
      status = absl::UnauthenticatedError(
          "mutual TLS: the client certificate lacks extendedKeyUsage clientAuth (it is not "
          "meant for TLS clients, e.g. a server certificate)");
    }
  }
  ERR_clear_error();
  X509_free(cert);
  X509_free(server);
  return status;
}

std::shared_ptr<grpc::AuthMetadataProcessor> MakeAuthProcessor(AuthOptions options,
                                                               std::atomic<uint64_t>* refused) {
  return std::make_shared<AuthProcessor>(std::move(options), refused);
}

}  // namespace decode_indexer::service
