// Validation once: a decode step's (and a prefill's) stateless checks, in one place, into a
// ValidatedStep (ValidatedAppend) the executor trusts.
//
// What is checked here needs no state, only the Profile: the layer and what it takes
// (return_candidates at a source, keys and key positions only where the layer owns its
// cache), each request's id (no duplicates), rows and row lengths, its keys' form (type against
// the cache format, data and scales present, count and position not negative), q's form (type
// against the cache format, an FP4 q's scales, positions only with unquantized q and in
// [0, max_context)), and that the rows add up. What needs the sequence table (unknown
// sequence, lengths, pages, candidates) is the planner's (planner.h). Byte counts, shapes as
// sent, NaN/Inf in host bytes and the request's wire form (columns, tensors) are checked where
// the bytes are decoded: the gRPC edge (server/service/request_decode.h), or the caller that
// built the StepInput from its own buffers.
//
// Messages name the request field the proto way ("sequences[1].num_rows: ..."), so the edge
// passes them through (renamed for the columnar form by service::NameColumnarFields).
//
// Two ways in, one set of checks: ValidateStep (a StepInput built in process: tests,
// benchmarks, the in-process worker) runs every stage of a StepValidator in order; the edge's
// decoder runs the same stages itself, each where the bytes it decodes need it (the rows
// before q's expected shape, the keys after their tensor), and Finish hands out the
// ValidatedStep only when every stage ran for every request.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"

namespace decode_indexer::exec {

class StepValidator;

// A decode step that passed the stateless checks. Only a StepValidator makes one. It owns
// its StepInput (whose pointers still point into the caller's buffers, which must outlive
// the call); what the checks read cannot change afterwards. The call's delivery, which the
// checks do not read, may be set after validation: where the answer goes, the caller's
// check, whether q's host memory is page-locked, the device inputs' ready event, the step id.
class ValidatedStep {
 public:
  const StepInput& input() const { return input_; }
  // The step's layer in the profile (looked up once).
  const config::LayerSpec& spec() const { return *spec_; }

  void set_answer(const AnswerSink* answer) { input_.answer = answer; }
  void set_call_check(CallCheck check) { input_.call_check = std::move(check); }
  void set_host_memory_page_locked(bool page_locked) {
    input_.host_memory_page_locked = page_locked;
  }
  void set_inputs_ready_event(void* event) { input_.inputs_ready_event = event; }
  void set_step_id(uint64_t step_id) { input_.step_id = step_id; }

 private:
  friend class StepValidator;
  ValidatedStep(StepInput input, const config::LayerSpec* spec)
      : input_(std::move(input)), spec_(spec) {}

  StepInput input_;
  const config::LayerSpec* spec_;
};

// A prefill (AppendKeys) that passed the stateless checks: the layer owns a cache, the keys'
// form fits it. Only ValidateAppend makes one.
class ValidatedAppend {
 public:
  uint64_t sequence_id() const { return sequence_id_; }
  int32_t layer() const { return spec_->layer; }
  const KeysInput& keys() const { return keys_; }
  const config::LayerSpec& spec() const { return *spec_; }

 private:
  friend absl::StatusOr<ValidatedAppend> ValidateAppend(const config::Profile& profile,
                                                        uint64_t sequence_id, int32_t layer,
                                                        const KeysInput& keys);
  ValidatedAppend(uint64_t sequence_id, const config::LayerSpec* spec, const KeysInput& keys)
      : sequence_id_(sequence_id), keys_(keys), spec_(spec) {}

  uint64_t sequence_id_;
  KeysInput keys_;
  const config::LayerSpec* spec_;
};

// The stages of a step's checks, run in this order: Layer once; then, per request i in
// order, Rows, RowLengths and Keys (a request's stages may interleave with other requests',
// as long as each runs once for each request); Q once, after every request's Rows; then
// Finish. Each check runs once: the edge calls the stages in place of checks of its own.
class StepValidator {
 public:
  explicit StepValidator(const config::Profile& profile) : profile_(profile) {}

  // The layer exists in the profile, and return_candidates only at a candidate source.
  absl::Status Layer(int32_t layer, bool return_candidates);
  // After Layer: the step's layer.
  const config::LayerSpec& spec() const { return *spec_; }
  bool owns_cache() const;

  // Request i's id (not an earlier request's) and num_rows in [1, max_rows_per_sequence].
  absl::Status Rows(int32_t i, uint64_t sequence_id, int32_t num_rows);
  // Request i's row_lengths: none (causal) or one per row, each in [1, max_context].
  absl::Status RowLengths(int32_t i, const SequenceStepInput& in);
  // Request i's keys (SequenceStepInput::new_keys): none at a layer that reads another
  // layer's cache, the form of CheckKeysForm.
  absl::Status Keys(int32_t i, const KeysInput& keys);
  // q, its scales and weights present, its type the cache format's (or fp32 / bf16), an FP4
  // q's scales, positions only with unquantized q and each in [0, max_context); `num_rows`
  // is the step's.
  absl::Status Q(const QInput& q, int32_t num_rows);

  // The step, once every stage ran for each of its requests and its rows add up.
  absl::StatusOr<ValidatedStep> Finish(StepInput input);

 private:
  const config::Profile& profile_;
  const config::LayerSpec* spec_ = nullptr;
  int32_t layer_ = 0;
  bool return_candidates_ = false;
  absl::flat_hash_map<uint64_t, int32_t> seen_;  // sequence id -> first request
  int32_t rows_checked_ = 0;
  int32_t row_lengths_checked_ = 0;
  int32_t keys_checked_ = 0;
  int64_t rows_ = 0;  // the rows of the requests whose Rows passed
  bool q_checked_ = false;
};

// Field names for CheckKeysForm: AppendKeys' ("keys", "key_scales", "position") or a
// step request's ("sequences[i].new_keys", ...).
struct KeyFields {
  std::string keys;
  std::string scales;
  std::string position;
};
// A key input's form against the cache it goes to: count and position not negative, data
// with a count, pre-quantized keys in the cache's format with their scales, scales only with
// pre-quantized keys, keys in device memory pre-quantized.
absl::Status CheckKeysForm(const KeysInput& keys, kernels::CacheFormat format,
                           const KeyFields& fields);

// Every stage of a StepValidator over a StepInput built in process, in order.
absl::StatusOr<ValidatedStep> ValidateStep(const config::Profile& profile, StepInput input);

// A prefill's checks: the layer exists and owns its cache, the keys' form (CheckKeysForm),
// host keys (KeysInput::on_device is a step's only).
absl::StatusOr<ValidatedAppend> ValidateAppend(const config::Profile& profile, uint64_t sequence_id,
                                               int32_t layer, const KeysInput& keys);

}  // namespace decode_indexer::exec
