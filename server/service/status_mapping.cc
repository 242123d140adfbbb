#include "server/service/status_mapping.h"

#include <algorithm>
#include <string>
#include <utility>

namespace decode_indexer::service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // grpc::StatusCode stops at UNAUTHENTICATED (16); never send a code a client cannot name.
  const grpc::StatusCode grpc_code =
      (code >= 1 && code <= 16) ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
  std::string message(status.message());
  if (message.size() > kMaxStatusMessage) {
    message.resize(kMaxStatusMessage - 3);
    message += "...";
  }
  return grpc::Status(grpc_code, std::move(message));
}

absl::Status UnparseableRequestError(std::string_view method) {
  return absl::InvalidArgumentError("request: the bytes do not parse as the request message of " +
                                    EchoInput(method) + " (protobuf)");
}

std::string EchoInput(std::string_view input, size_t max) {
  std::string out = "\"";
  const size_t n = std::min(input.size(), max);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(input[i]);
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  out += "\"";
  if (input.size() > max) out += "... (" + std::to_string(input.size()) + " bytes)";
  return out;
}

}  // namespace decode_indexer::service
