// --verify: recomputes sampled answers with the independent reference (reference/reference.h,
// di_reference: it shares no code with the server's backends) and compares them with the
// server's: the reference's exact top-k, or a near-tie difference (spec section 6).
//
// Near-ties: fp32 rounding of the exact logits (4 ulps of the row's largest) always; with
// tolerance > 0 also within tolerance x |K-th logit| of the K-th (a backend that accumulates
// in another order, CUDA). Such rows are counted apart (rows_near_tie), so a CPU server can be
// held to zero of them.
//
// A Verifier follows a few tracked sequences of one worker: it mirrors every key the server
// accepted for them (dequantized, quantizing fp32/bf16 keys itself as the spec says), so it
// can score any later step of theirs exactly as the server should.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/load/report.h"
#include "client/load/server_model.h"
#include "decode_indexer/v1/indexer.pb.h"

namespace decode_indexer::load {

// Spec section 6: whether `answer` (topk entries: distinct positions, then -1 padding) is an
// acceptable top-k of the scored `positions` (ascending) whose exact logits are `logits`:
// every chosen logit within tol x |K-th largest| below the K-th, no left-out one above it by
// more; all of them when there are at most topk.
bool TopKWithinTolerance(const std::vector<float>& logits, const std::vector<int32_t>& positions,
                         const int32_t* answer, int32_t topk, double tol);

class Verifier {
 public:
  static absl::StatusOr<std::unique_ptr<Verifier>> Create(const ServerModel& model,
                                                          int32_t max_rows_per_sequence,
                                                          double tolerance);
  virtual ~Verifier() = default;

  virtual void Track(uint64_t sequence_id) = 0;
  virtual bool Tracks(uint64_t sequence_id) const = 0;
  // Prefill keys the server accepted (AppendKeys answered OK).
  virtual absl::Status AppendKeys(uint64_t sequence_id, int32_t cache_layer, const v1::Tensor& keys,
                                  const v1::Tensor& key_scales) = 0;
  // A step the server answered OK: mirrors its new keys and, when `score`, checks the
  // tracked rows (and candidate blocks when the response carries them). A candidate
  // consumer is checked only if its source was scored in the same token step.
  virtual absl::Status CheckStep(const v1::DecodeStepRequest& request,
                                 const v1::DecodeStepResponse& response, bool score,
                                 VerifyCounts* counts) = 0;
  // A new token step begins: forget the previous step's reference candidates.
  virtual void BeginTokenStep() = 0;
};

}  // namespace decode_indexer::load
