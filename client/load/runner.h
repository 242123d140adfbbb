// The load run: a serving frontend's traffic against one decode-indexer server.
//
// `concurrency` workers each own `requests_per_step` sequences, prefilled once. A token step
// sends one DecodeStep per layer of the server's plan (new keys at the cache-owning layers),
// the way a model's forward pass visits its layers. Closed loop: every worker starts its
// next token step as soon as the last one ends. Open loop (rate > 0): token steps are
// scheduled at a constant or Poisson rate and handed to free workers; a step's latency runs
// from its intended start, so a server that falls behind shows it in the tail instead of
// quietly slowing the client down (coordinated omission).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/load/channel.h"
#include "client/load/payload.h"
#include "client/load/report.h"

namespace decode_indexer::load {

struct LoadOptions {
  ChannelConfig channel;
  int32_t channels = 1;       // connections; workers are spread over them
  int32_t concurrency = 1;    // workers (closed loop) or most steps in flight (open loop)
  double rate = 0;            // token steps per second; 0: closed loop
  bool poisson = false;       // open loop: exponential gaps instead of constant ones
  double duration_s = 0;      // measured time, or
  int64_t steps = 0;          // measured token steps (over all workers)
  int64_t warmup_steps = -1;  // discarded token steps first; -1: one per worker
  bool streaming = false;     // DecodeStream per worker instead of unary DecodeStep
  // Steps in the columnar form (sequence_ids, rows_per_sequence, one stacked new_keys,
  // new_keys_positions) instead of a SequenceStep message per request.
  bool columnar = false;
  // 0: none. Unary: the RPC's gRPC deadline. Streaming: each step's timeout_us (a stream's
  // gRPC deadline would cover the whole stream, not a step).
  double deadline_ms = 0;
  v1::AnswerEncoding answer_encoding = v1::ANSWER_ENCODING_RAW;
  // Each worker creates and registers its own POSIX shared-memory region; q, q_scales and
  // weights go there instead of into the request, and the server writes the answer there.
  // The server must run on this host.
  bool shared_memory = false;
  // Each worker registers a step ring (client/fast_path.h) and steps through it instead of
  // gRPC: the same-host fast path. Implies the columnar form; the server must run on this
  // host with --shm-socket; plaintext channel (the token is sent on the control calls).
  bool fast_path = false;
  int32_t requests_per_step = 8;
  int32_t next_n = 1;
  // Speculative decoding (needs next_n > 1): each draft token (rows 2..next_n of a request) is
  // rejected with this probability, and the drafts after a rejected one with it; the next
  // token step writes its keys at the accepted position (new_keys_position), which rolls the
  // rejected drafts' keys back in every cache. 0: off (keys always append).
  double draft_reject = 0;
  int64_t context = 4096;       // mean prefill length (entries)
  double context_spread = 0.3;  // lengths uniform in [1-s, 1+s] x context
  int32_t max_layers = 0;       // 0: every layer of the profile
  PayloadFormat q_format = PayloadFormat::kQuantized;
  PayloadFormat key_format = PayloadFormat::kQuantized;
  bool positions = false;  // send positions (server applies RoPE); needs fp32 q
  int32_t prefill_chunk = 8192;
  uint64_t seed = 0;              // 0: from the clock
  uint64_t sequence_id_base = 0;  // 0: random
  bool keep_sequences = false;
  bool verify = false;
  int32_t verify_sequences = 2;    // tracked sequences (spread over workers)
  int32_t verify_every = 1;        // score every n-th token step of a tracked worker
  double verify_tolerance = 1e-4;  // near-tie slack (relative to the K-th logit); 0: exact
  bool progress = false;           // live line on stderr
  // After a failed token step a worker waits BackoffDelayMs (doubling from backoff_initial_ms
  // up to backoff_max_ms, with jitter) before its next one; a success resets it.
  double backoff_initial_ms = 10;
  double backoff_max_ms = 2000;
};

// The wait after the `failures`-th failure in a row (1, 2, ...): min(max, initial *
// 2^(failures-1)) scaled by `jitter` in [0, 1) into [50%, 100%) of that ("equal jitter"), so
// that workers failing together spread out.
double BackoffDelayMs(int failures, double initial_ms, double max_ms, double jitter);

// The metadata key that carries a sequence id on every RPC naming sequences, so that a
// balancer can route all calls for a sequence to the replica that holds it.
inline constexpr const char* kSequenceIdKey = "x-di-sequence-id";

// Runs the whole load (connect, prefill, warm-up, measure, release) and reports. An error
// only where the run could not take place (no server, prefill refused, bad options); RPC
// failures during the run are counted in the report.
absl::StatusOr<Report> RunLoad(const LoadOptions& options);

}  // namespace decode_indexer::load
