// THE one translation from the server's absl::Status to the wire's grpc::Status. Every
// handler answers through it, so a code means the same thing on every RPC.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace decode_indexer::service {

// absl and gRPC share the canonical code numbering; the message passes through unchanged
// (it names the request field at fault). Codes outside the canonical set become UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace decode_indexer::service
