#include "server/service/status_mapping.h"

#include <string>

namespace decode_indexer::service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // grpc::StatusCode stops at UNAUTHENTICATED (16); never send a code a client cannot name.
  const grpc::StatusCode grpc_code =
      (code >= 1 && code <= 16) ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
  return grpc::Status(grpc_code, std::string(status.message()));
}

}  // namespace decode_indexer::service
