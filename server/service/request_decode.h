// The edge's decoding: proto requests -> the executor's validated structs
// (exec::ValidatedStep / ValidatedAppend, server/exec/validated_step.h). The decoder checks
// what only the wire form has (dtypes, shapes, byte counts, NaN/Inf of host bytes, the
// request's form and columns) and runs the validator's stages for the rest of what needs no
// state (layer ids, ids, row counts, row lengths, the keys' and q's form against the cache),
// each once, where the bytes need them. What needs state (unknown sequence, lengths, pages,
// candidates) is the executor's to check.
//
// Zero-copy where possible: the decoded structs point into the request's bytes, so the
// request must outlive them. Only what must change form (bf16 weights -> fp32, int32
// positions -> int64, a misaligned fp32/int64 buffer) is copied into storage the decoded
// object owns. Error messages name the field the proto way:
// "sequences[1].new_keys.shape: expected [n, 128], got [3, 64]".
//
// A step's requests come as `sequences` (a message per request) or in the columnar form
// (sequence_ids, num_rows / rows_per_sequence, one stacked new_keys tensor with
// new_key_counts, new_keys_positions, row_lengths): both decode into the same StepInput,
// the columnar one without a loop over messages (each request's keys point into the one
// tensor). A request mixing the forms is refused.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/validated_step.h"

namespace decode_indexer::service {

// A decoded AppendKeys request. Its keys point into the request (or into the storage here).
struct DecodedAppend {
  std::optional<exec::ValidatedAppend> append;  // set on success
  std::vector<float> scale_storage;             // realigned fp32 key scales where needed
  std::vector<std::vector<uint8_t>> realigned;  // realigned unquantized keys where needed

  uint64_t sequence_id() const { return append->sequence_id(); }
  int32_t layer() const { return append->layer(); }
  const exec::KeysInput& keys() const { return append->keys(); }
};

// A decoded DecodeStep request. Movable: the pointers into owned storage stay valid because
// they point into vector buffers, which a move does not relocate.
struct DecodedStep {
  std::optional<exec::ValidatedStep> validated;  // set on success
  const exec::StepInput& step() const { return validated->input(); }
  std::vector<float> weights;      // fp32 weights when converted or realigned
  std::vector<int64_t> positions;  // int64 positions (always owned)
  // Realigned fp32 key scales: per sequence, or one entry for the columnar form's new_keys.
  std::vector<std::vector<float>> key_scales;
  std::vector<std::vector<uint8_t>> realigned;  // realigned fp32 q / keys where needed
};

absl::StatusOr<DecodedAppend> DecodeAppendKeys(const v1::AppendKeysRequest& request,
                                               const config::Profile& profile);

// Bytes of q / q_scales / weights / positions (and, in the columnar form, new_keys /
// new_key_scales) that live outside the request (a client's shared-memory region, or for q and
// the keys a CUDA IPC buffer): those
// Tensors then carry dtype and shape only, and are checked and read in place here, so the
// decoded step points into the region (no staging copy). The fast path's descriptors
// (server/service/step_ring.cc) decode through here too: one set of checks for both.
struct ExternalStepBytes {
  std::optional<std::string_view> q;
  std::optional<std::string_view> q_scales;
  std::optional<std::string_view> weights;
  std::optional<std::string_view> positions;
  std::optional<std::string_view> new_keys;
  std::optional<std::string_view> new_key_scales;
  // q / q_scales / weights above are device addresses (a CUDA IPC buffer): their sizes are
  // checked here, their values on the device (exec::QInput::on_device); weights must be fp32
  // (nothing is converted on the host).
  bool q_on_device = false;
  // new_keys / new_key_scales above are device addresses (cuda_ipc.new_keys_offset): their
  // dtypes, shapes and sizes are checked here, their values on the device
  // (exec::KeysInput::on_device); they must be pre-quantized (FP8 codes + fp32 scales, FP4
  // codes + UE8M0 scales) and are never read, realigned or converted on the host.
  bool keys_on_device = false;
};

absl::StatusOr<DecodedStep> DecodeStepRequest(const v1::DecodeStepRequest& request,
                                              const config::Profile& profile,
                                              const ExternalStepBytes& external = {});

// The requests a step names, in either form (`sequences` or sequence_ids).
inline int StepRequestCount(const v1::DecodeStepRequest& request) {
  return request.sequences_size() > 0 ? request.sequences_size() : request.sequence_ids_size();
}

// An executor's error about a step names the request the `sequences` way
// ("sequences[2].row_lengths[1]: ..."); for a step sent in the columnar form this answers
// the same status naming the columnar field ("row_lengths[5]: ...", "sequence_ids[2]: ...",
// "new_keys_positions[2]: ..."). Other statuses, and steps in the `sequences` form, pass
// unchanged.
absl::Status NameColumnarFields(const absl::Status& status, const v1::DecodeStepRequest& request);

// "[3, 64]" — shapes in messages.
std::string ShapeString(const v1::Tensor& tensor);

}  // namespace decode_indexer::service
