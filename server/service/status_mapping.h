// THE one translation from the server's absl::Status to the wire's grpc::Status. Every
// handler answers through it, so a code means the same thing on every RPC.
#pragma once

#include <grpcpp/support/status.h>

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace decode_indexer::service {

// absl and gRPC share the canonical code numbering; the message passes through unchanged
// (it names the request field at fault). Codes outside the canonical set become UNKNOWN.
// Messages longer than kMaxStatusMessage bytes are cut (with "...") so every error stays
// deliverable in the trailers.
grpc::Status ToGrpcStatus(const absl::Status& status);

inline constexpr size_t kMaxStatusMessage = 1024;

// A request whose bytes do not parse as `method`'s request message (the full path, e.g.
// "/decode_indexer.v1.DecodeIndexer/DecodeStep"): INVALID_ARGUMENT naming it. The sync edge's
// interceptor turns gRPC's bare INTERNAL into this; the callback edge parses itself.
absl::Status UnparseableRequestError(std::string_view method);

// Client input echoed in an error message: quoted, at most `max` bytes of it (then "..."
// and the full length), non-printable bytes as \xNN, so a 10 kB or binary name cannot
// swell or garble the message.
std::string EchoInput(std::string_view input, size_t max = 100);

}  // namespace decode_indexer::service
