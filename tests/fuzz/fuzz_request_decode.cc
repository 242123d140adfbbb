// Request decoding and validation (server/service/request_decode.cc) on arbitrary bytes: the
// first byte picks the profile and the message (DecodeStepRequest or AppendKeysRequest, with
// q / weights "in shared memory" or not); the rest is parsed as that message. Decoding must
// never crash, refuse only with a non-empty INVALID_ARGUMENT message, and a decoded step must
// be consistent with its request (rows, pointers, ids, and the lifecycle's explicit key
// positions: AppendKeysRequest.position, SequenceStep.new_keys_position, and in the columnar
// form sequence_ids / new_keys_positions). TruncateSequence and ForkSequence carry only ids
// and a length, which the executor checks: fuzz_sequence_image runs them against an executor.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "server/config/profile.h"
#include "server/service/request_decode.h"

namespace {

using decode_indexer::config::Profile;
namespace service = decode_indexer::service;
namespace v1 = decode_indexer::v1;

void Check(bool ok) {
  if (!ok) std::abort();
}

void CheckRefusal(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kInvalidArgument || s.message().empty() ||
      s.message().size() > 4096) {  // bounded: no echo of unbounded input
    std::fprintf(stderr, "bad refusal (%zu bytes): %.300s\n", s.message().size(),
                 s.ToString().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Profile v32 = *decode_indexer::config::BuiltinProfile("v32");
  static const Profile v41 = *decode_indexer::config::BuiltinProfile("v41");
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const Profile& profile = (mode & 1) ? v41 : v32;
  ++data;
  --size;
  if (mode & 2) {
    v1::AppendKeysRequest request;
    if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
    absl::StatusOr<service::DecodedAppend> decoded = service::DecodeAppendKeys(request, profile);
    if (!decoded.ok()) {
      CheckRefusal(decoded.status());
      return 0;
    }
    // Keys to write, or (with a position and no keys) a cut back that writes nothing.
    const bool cut_back_only = decoded->keys().count == 0 && decoded->keys().keys == nullptr &&
                               decoded->keys().position.has_value() &&
                               *decoded->keys().position >= 0;
    Check(cut_back_only || (decoded->keys().count > 0 && decoded->keys().keys != nullptr));
    Check(decoded->keys().count <= profile.max_context);
    // AppendKeysRequest.position (lifecycle: a rewrite or cut back from there) is passed on
    // exactly when it was set, and never negative.
    Check(decoded->keys().position.has_value() == request.has_position());
    Check(!request.has_position() ||
          (*decoded->keys().position == request.position() && request.position() >= 0));
    Check(decoded->sequence_id() == request.sequence_id() && decoded->layer() == request.layer());
    return 0;
  }
  v1::DecodeStepRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  // Shared memory: the tensors' bytes come from elsewhere (here: copies of their data fields,
  // which the request then must not carry).
  service::ExternalStepBytes external;
  std::string q, w;
  if (mode & 4) {
    q = request.q().data();
    w = request.weights().data();
    request.mutable_q()->clear_data();
    request.mutable_weights()->clear_data();
    external.q = q;
    external.weights = w;
  }
  absl::StatusOr<service::DecodedStep> decoded =
      service::DecodeStepRequest(request, profile, external);
  if (!decoded.ok()) {
    CheckRefusal(decoded.status());
    return 0;
  }
  // The requests come in one of two forms: `sequences` messages, or the columnar fields
  // (sequence_ids, new_keys_positions, ...); never both.
  const bool columnar = request.sequence_ids_size() > 0;
  Check(!columnar || request.sequences_size() == 0);
  const int n = columnar ? request.sequence_ids_size() : request.sequences_size();
  Check(static_cast<int>(decoded->step().sequences.size()) == n);
  Check(!columnar || request.new_keys_positions_size() == 0 ||
        request.new_keys_positions_size() == n);
  const bool consumer =
      profile.layers[request.layer()].role == decode_indexer::config::LayerRole::kCandidateConsumer;
  int64_t rows = 0;
  for (int i = 0; i < n; ++i) {
    const auto& s = decoded->step().sequences[i];
    Check(s.num_rows >= 1 && s.num_rows <= profile.max_rows_per_sequence);
    Check(s.row_lengths.empty() || static_cast<int32_t>(s.row_lengths.size()) == s.num_rows);
    // The explicit key position of a retried step (new_keys_position; columnar:
    // new_keys_positions, -1 for none) is passed on exactly when given, never negative, and
    // only where the layer owns a cache.
    std::optional<int64_t> position;
    if (columnar) {
      Check(s.sequence_id == request.sequence_ids(i));
      if (request.new_keys_positions_size() > 0 && request.new_keys_positions(i) != -1) {
        position = request.new_keys_positions(i);
      }
    } else {
      const v1::SequenceStep& in = request.sequences(i);
      Check(s.sequence_id == in.sequence_id());
      if (in.has_new_keys_position()) position = in.new_keys_position();
    }
    Check(s.new_keys.position == position);
    Check(!position.has_value() || (*position >= 0 && !consumer));
    Check(s.new_keys.count >= 0 && (s.new_keys.count == 0 || s.new_keys.keys != nullptr));
    rows += s.num_rows;
  }
  Check(rows == decoded->step().num_rows);
  Check(decoded->step().q.q != nullptr && decoded->step().q.weights != nullptr);
  return 0;
}
