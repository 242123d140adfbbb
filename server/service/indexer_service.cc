#include "server/service/indexer_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/build_revision.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/version.h"
#include "server/service/auth.h"
#include "server/service/logging.h"
#include "server/service/request_decode.h"
#include "server/service/sequence_transfer.h"
#include "server/service/status_mapping.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::service {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// The client's x-request-id when it is 1..128 printable ASCII characters, else a fresh one.
std::string RequestIdOf(const CallContext& context) {
  const std::vector<std::string_view> ids = context.ClientMetadata(kRequestIdKey);
  if (!ids.empty() && !ids.front().empty() && ids.front().size() <= 128) {
    bool printable = true;
    for (char c : ids.front()) printable = printable && c > 0x20 && c < 0x7f;
    if (printable) return std::string(ids.front());
  }
  return NewRequestId();
}

// An unknown sequence id is what a client sees when the replica that held the sequence was
// lost (restarted, or left a balancer's pool so that its ids now hash to another replica):
// the message says so and how to recover.
absl::Status WithLostSequenceHint(absl::Status s) {
  const bool unknown_sequence =
      s.message().find("sequence_id: no sequence ") != absl::string_view::npos ||
      (absl::StartsWith(s.message(), "sequence_ids[") &&
       s.message().find("]: no sequence ") != absl::string_view::npos);  // a columnar step
  if (s.code() != absl::StatusCode::kNotFound || !unknown_sequence ||
      s.message().find(" idle") != absl::string_view::npos) {  // the idle release said why
    return s;
  }
  return absl::NotFoundError(absl::StrCat(
      s.message(),
      " on this server (if it was created, it may have been lost with the replica that held "
      "it: a changed ServerInfo.instance_id says the server restarted without its snapshot; "
      "re-create it and prefill it again)"));
}

// Echoes the call's request id in the initial and trailing metadata and makes it this
// thread's (log lines carry it).
struct RequestIdScope {
  explicit RequestIdScope(CallContext& context) : scope(RequestIdOf(context)) {
    context.AddInitialMetadata(kRequestIdKey, CurrentRequestId());
    context.AddTrailingMetadata(kRequestIdKey, CurrentRequestId());
  }
  ScopedRequestId scope;
};

v1::LayerRole ToProto(config::LayerRole role) {
  switch (role) {
    case config::LayerRole::kDense:
      return v1::LAYER_ROLE_DENSE;
    case config::LayerRole::kCandidateSource:
      return v1::LAYER_ROLE_CANDIDATE_SOURCE;
    case config::LayerRole::kCandidateConsumer:
      return v1::LAYER_ROLE_CANDIDATE_CONSUMER;
  }
  return v1::LAYER_ROLE_UNSPECIFIED;
}

v1::CacheFormat ToProto(kernels::CacheFormat format) {
  return format == kernels::CacheFormat::kFp8 ? v1::CACHE_FORMAT_FP8 : v1::CACHE_FORMAT_FP4;
}

const char* RopeStyleName(kernels::RopeStyle style) {
  switch (style) {
    case kernels::RopeStyle::kNeox:
      return "neox";
    case kernels::RopeStyle::kInterleaved:
      return "interleaved";
    default:
      return "none";
  }
}

// Bytes of a tensor sent with its data in shared memory (dtype and shape only on the wire);
// absurd shapes are refused before any multiplication can overflow.
absl::StatusOr<uint64_t> ShapeBytes(const v1::Tensor& t, const char* field) {
  uint64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0 || d > (int64_t{1} << 32) || n > (uint64_t{1} << 40) / (uint64_t(d) + 1)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape: out of range"));
    }
    n *= static_cast<uint64_t>(d);
  }
  switch (t.dtype()) {
    case v1::DTYPE_FP32:
    case v1::DTYPE_INT32:
      return n * 4;
    case v1::DTYPE_BF16:
      return n * 2;
    case v1::DTYPE_FP8_E4M3:
    case v1::DTYPE_UE8M0:
      return n;
    case v1::DTYPE_FP4_E2M1:
      return (n + 1) / 2;
    case v1::DTYPE_INT64:
      return n * 8;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: unsupported"));
  }
}

// Sizes `out` as int32 [rows, cols] and answers where its bytes lie, so the answer is
// written straight into the response (one copy from the device, none on the host).
int32_t* ResponseInt32(uint64_t rows, int64_t cols, v1::Tensor& out) {
  out.set_dtype(v1::DTYPE_INT32);
  out.add_shape(static_cast<int64_t>(rows));
  out.add_shape(cols);
  std::string* data = out.mutable_data();
  data->resize(rows * static_cast<uint64_t>(cols) * sizeof(int32_t));
  return reinterpret_cast<int32_t*>(data->data());
}

void SetShapeOnly(int64_t rows, int64_t cols, v1::Tensor& out) {
  out.set_dtype(v1::DTYPE_INT32);
  out.add_shape(rows);
  out.add_shape(cols);
}

// Bytes of a varint holding v.
uint64_t VarintBytes(uint64_t v) {
  uint64_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The most bytes a step's response can take on the wire: the answer (raw int32, or delta
// varints whose gaps are bounded by max_context), candidate blocks, lengths and the fixed
// fields. Computed before the step runs.
uint64_t ResponseBound(const v1::DecodeStepRequest& request, const config::Profile& profile,
                       uint64_t rows, bool answer_elsewhere) {
  const uint64_t k = static_cast<uint64_t>(profile.topk);
  uint64_t bytes = 160;  // step_id, timing, sharded, tensor and field headers (~120)
  bytes += static_cast<uint64_t>(StepRequestCount(request)) * 11;  // lengths
  if (answer_elsewhere) return bytes;
  if (request.answer_encoding() == v1::ANSWER_ENCODING_DELTA_VARINT) {
    bytes += rows * (VarintBytes(k) + k * VarintBytes(static_cast<uint64_t>(profile.max_context)));
  } else {
    bytes += rows * k * 4;
  }
  if (request.return_candidates()) {
    bytes += rows * static_cast<uint64_t>(profile.num_candidate_blocks) * 4;
  }
  return bytes;
}

// The call's side of a state-changing executor call (exec::CallCheck), asked right before it
// commits: a deadline that passed or a cancellation while it ran makes it commit nothing, so
// a failed call never leaves state behind (the caller would retry it on top).
exec::CallCheck CallCheckOf(const CallContext* context) {
  return [context]() -> absl::Status {
    // The deadline first: gRPC also cancels a call whose deadline passed.
    if (context->deadline() <= std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("the call's deadline passed while it ran");
    }
    if (context->IsCancelled()) return absl::CancelledError("the call was cancelled while it ran");
    return absl::OkStatus();
  };
}

// Handlers never let an exception (e.g. bad_alloc) escape into gRPC.
template <typename F>
absl::Status Guarded(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    return absl::InternalError("internal error");
  }
}

}  // namespace

void LatencyStats::Record(double latency_us, absl::StatusCode code) {
  const bool error = code != absl::StatusCode::kOk;
  int c = static_cast<int>(code);
  if (c < 0 || c >= kCodes) c = static_cast<int>(absl::StatusCode::kUnknown);
  // Bucket b holds latencies in (2^((b-1)/4), 2^(b/4)] µs; bucket 0 everything <= 1 µs.
  int b = latency_us <= 1.0 ? 0 : static_cast<int>(std::ceil(4.0 * std::log2(latency_us)));
  b = std::clamp(b, 0, kBuckets - 1);
  std::lock_guard<std::mutex> lock(mu_);
  ++count_;
  if (error) ++errors_;
  ++codes_[c];
  total_us_ += latency_us;
  max_us_ = std::max(max_us_, latency_us);
  ++buckets_[b];
}

double LatencyStats::Percentile(double q) const {
  if (count_ == 0) return 0;
  const uint64_t rank = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * count_)));
  uint64_t seen = 0;
  for (int b = 0; b < kBuckets; ++b) {
    seen += buckets_[b];
    if (seen >= rank) return std::min(std::exp2(b / 4.0), max_us_);
  }
  return max_us_;
}

std::array<uint64_t, LatencyStats::kCodes> LatencyStats::Codes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return codes_;
}

void LatencyStats::Fill(v1::RpcStatistics& out) const {
  std::lock_guard<std::mutex> lock(mu_);
  out.set_count(count_);
  out.set_errors(errors_);
  out.set_latency_us_total(total_us_);
  out.set_latency_us_max(max_us_);
  out.set_latency_us_p50(Percentile(0.50));
  out.set_latency_us_p99(Percentile(0.99));
}

IndexerService::IndexerService(exec::Executor& executor, std::string version,
                               ServiceOptions options)
    : executor_(executor), version_(std::move(version)), options_(std::move(options)) {
  auto& rpc = prometheus::BuildHistogram()
                  .Name("decode_indexer_rpc_duration_seconds")
                  .Help(
                      "Time in the handler of every answered RPC (DecodeStream: of each step), "
                      "by method.")
                  .Register(*registry_);
  for (int m = 0; m < kNumMethods; ++m) {
    rpc_seconds_[m] = &rpc.Add({{"method", MethodName(Method(m))}}, LatencyBuckets());
  }
  auto& step = prometheus::BuildHistogram()
                   .Name("decode_indexer_step_latency_seconds")
                   .Help(
                       "Server time of a successful decode step, from read to answer, by "
                       "layer kind.")
                   .Register(*registry_);
  static constexpr const char* kKinds[3] = {"dense", "source", "consumer"};
  for (int k = 0; k < 3; ++k) step_seconds_[k] = &step.Add({{"kind", kKinds[k]}}, LatencyBuckets());
  queue_seconds_ = &prometheus::BuildHistogram()
                        .Name("decode_indexer_queue_seconds")
                        .Help(
                            "Time a successful step waited before its computation started "
                            "(admission plus the executor's turn; ServerTiming.queue_us).")
                        .Register(*registry_)
                        .Add({}, LatencyBuckets());
  rows_per_step_ = &prometheus::BuildHistogram()
                        .Name("decode_indexer_rows_per_step")
                        .Help("Rows (decode_rows) of a successful step.")
                        .Register(*registry_)
                        .Add({}, RowBuckets());
  steps_in_flight_ = &prometheus::BuildGauge()
                          .Name("decode_indexer_steps_in_flight")
                          .Help("Decode steps read and not yet answered (waiting or running).")
                          .Register(*registry_)
                          .Add({});
}

absl::Status IndexerService::Authorize(const CallContext& context) const {
  // Before the request is read: on TLS the auth filter (auth.h), on the callback edge
  // AuthorizeBeforeRead. On the sync edge on plaintext this is the only check (after gRPC
  // read and parsed the request). Either way the handler checks it too.
  if (options_.auth_token.empty()) return absl::OkStatus();
  for (std::string_view value : context.ClientMetadata("authorization")) {
    if (BearerTokenMatches(value, options_.auth_token)) return absl::OkStatus();
  }
  return absl::UnauthenticatedError("missing or wrong bearer token (authorization metadata)");
}

absl::Status IndexerService::AuthorizeBeforeRead(Method method, CallContext& call) {
  absl::Status s = Authorize(call);
  if (s.ok()) return s;
  RequestIdScope request_id(call);
  auth_refused_.fetch_add(1, std::memory_order_relaxed);
  stats_[method].Record(0, s.code());
  rpc_seconds_[method]->Observe(0);
  return absl::UnauthenticatedError(
      absl::StrCat(s.message(), "; refused before the request was read"));
}

void IndexerService::SetHealthSink(std::function<void(bool serving)> sink) {
  std::lock_guard<std::mutex> lock(health_mu_);
  health_sink_ = std::move(sink);
}

void IndexerService::CheckHealth(const absl::Status& status) {
  // Validation errors cannot hurt the ranks; only look when the executor itself failed.
  if (status.ok() || status.code() == absl::StatusCode::kInvalidArgument ||
      status.code() == absl::StatusCode::kNotFound ||
      status.code() == absl::StatusCode::kAlreadyExists ||
      status.code() == absl::StatusCode::kResourceExhausted ||
      status.code() == absl::StatusCode::kFailedPrecondition ||
      status.code() == absl::StatusCode::kOutOfRange) {
    return;
  }
  const exec::ExecutorStatus st = executor_.Status();
  if (st.healthy) return;
  std::lock_guard<std::mutex> lock(health_mu_);
  if (reported_unhealthy_) return;
  reported_unhealthy_ = true;
  spdlog::error("executor unhealthy ({}): health NOT_SERVING", st.health_detail);
  if (health_sink_) health_sink_(false);
}

const char* IndexerService::MethodName(Method m) {
  static constexpr const char* kNames[] = {"GetServerInfo",
                                           "CreateSequence",
                                           "AppendKeys",
                                           "ReleaseSequence",
                                           "DecodeStep",
                                           "DecodeStream",
                                           "GetStatistics",
                                           "RegisterSharedMemory",
                                           "UnregisterSharedMemory",
                                           "RegisterCudaIpcMemory",
                                           "UnregisterCudaIpcMemory",
                                           "TruncateSequence",
                                           "ForkSequence",
                                           "GetSequence",
                                           "ExportSequence",
                                           "ImportSequence",
                                           "RegisterStepRing",
                                           "UnregisterStepRing",
                                           "RingStep"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kNumMethods);
  return kNames[m];
}

void IndexerService::FillServerInfo(v1::ServerInfo& info) const {
  const config::Profile& p = executor_.profile();
  const exec::ExecutorStatus st = executor_.Status();
  info.set_profile(p.name);
  info.set_num_heads(p.num_heads);
  info.set_head_dim(p.head_dim);
  info.set_topk(p.topk);
  info.set_page_size(p.page_size);
  info.set_max_context(p.max_context);
  info.set_num_ranks(st.num_ranks);
  info.set_backend(st.backend);
  info.set_version(version_);
  info.set_candidate_block_size(p.candidate_block_size);
  info.set_num_candidate_blocks(p.num_candidate_blocks);
  info.set_max_rows_per_sequence(p.max_rows_per_sequence);
  info.set_row_shard_min_requests(st.row_shard_min_requests);
  info.set_max_sequences(st.max_sequences);
  info.set_sequences(st.sequences);
  info.set_rope_style(RopeStyleName(p.rope.style));
  info.set_rope_dim_offset(p.rope.dim_offset);
  info.set_rope_dim(p.rope.rope_dim);
  info.set_hadamard(p.hadamard);
  info.set_healthy(st.healthy);
  info.set_health_detail(st.health_detail);
  info.set_collective(st.collective);
  if (shm_socket_) info.set_shm_socket(shm_socket_->path());
  info.set_instance_id(instance_id());
  info.set_profile_hash(config::CacheIdentityHash(p));
  info.set_idle_sequence_timeout_ms(st.idle_sequence_timeout_ms);
  for (const config::LayerSpec& l : p.layers) {
    v1::LayerInfo* li = info.add_layers();
    li->set_layer(l.layer);
    li->set_role(ToProto(l.role));
    li->set_cache_layer(l.cache_layer);
    li->set_cache_format(ToProto(l.cache_format));
  }
  int64_t total = 0, free = 0;
  for (const exec::CachePoolStatus& c : st.caches) {
    v1::CachePoolInfo* ci = info.add_caches();
    ci->set_cache_layer(c.cache_layer);
    ci->set_pages_total(c.pages_total);
    ci->set_pages_free(c.pages_free);
    total += c.pages_total;
    free += c.pages_free;
  }
  info.set_pages_total(total);
  info.set_pages_free(free);
}

template <typename F>
absl::Status IndexerService::Handle(Method method, CallContext& context, F&& body) {
  const auto start = Clock::now();
  RequestIdScope request_id(context);
  absl::Status s = Authorize(context);
  if (!s.ok()) refused_after_read_.fetch_add(1, std::memory_order_relaxed);
  if (s.ok() && restoring_) {
    s = absl::UnavailableError("the server is restoring its snapshot (health NOT_SERVING); retry");
  }
  if (s.ok()) s = WithLostSequenceHint(Guarded(std::forward<F>(body)));
  const double us = MicrosSince(start);
  stats_[method].Record(us, s.code());
  rpc_seconds_[method]->Observe(us * 1e-6);
  spdlog::debug("{} {} in {:.0f} us (request {}){}{}", MethodName(method),
                absl::StatusCodeToString(s.code()), us, CurrentRequestId(), s.ok() ? "" : ": ",
                std::string(s.message()));
  return s;
}

absl::Status IndexerService::DoGetServerInfo(CallContext& /*call*/,
                                             const v1::GetServerInfoRequest& /*request*/,
                                             v1::ServerInfo& response) {
  FillServerInfo(response);
  return absl::OkStatus();
}

absl::Status IndexerService::DoCreateSequence(CallContext& call,
                                              const v1::CreateSequenceRequest& request,
                                              v1::CreateSequenceResponse& /*response*/) {
  return executor_.CreateSequence(request.sequence_id(), CallCheckOf(&call));
}

absl::Status IndexerService::DoAppendKeys(CallContext& call, const v1::AppendKeysRequest& request,
                                          v1::AppendKeysResponse& response) {
  absl::StatusOr<DecodedAppend> decoded = DecodeAppendKeys(request, executor_.profile());
  if (!decoded.ok()) return decoded.status();
  absl::StatusOr<int64_t> length = executor_.AppendKeys(*decoded->append, CallCheckOf(&call));
  if (!length.ok()) {
    CheckHealth(length.status());
    return length.status();
  }
  response.set_length(*length);
  return absl::OkStatus();
}

absl::Status IndexerService::DoReleaseSequence(CallContext& call,
                                               const v1::ReleaseSequenceRequest& request,
                                               v1::ReleaseSequenceResponse& response) {
  absl::StatusOr<int64_t> freed =
      executor_.ReleaseSequence(request.sequence_id(), CallCheckOf(&call));
  if (!freed.ok()) return freed.status();
  response.set_pages_freed(*freed);
  return absl::OkStatus();
}

absl::Status IndexerService::RunStep(CallContext* context, const v1::DecodeStepRequest& request,
                                     v1::DecodeStepResponse& response,
                                     std::chrono::steady_clock::time_point read_at) {
  steps_in_flight_->Increment();
  struct InFlight {
    prometheus::Gauge* gauge;
    ~InFlight() { gauge->Decrement(); }
  } in_flight{steps_in_flight_};
  if (request.answer_cuda_ipc()) {
    return absl::UnimplementedError(
        "answer_cuda_ipc: superseded by cuda_ipc (register your own device buffer with "
        "RegisterCudaIpcMemory; the server copies the answer into it)");
  }
  if (const int requests = StepRequestCount(request);
      options_.max_sequences_per_step > 0 && requests > options_.max_sequences_per_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.sequences_size() > 0 ? "sequences: " : "sequence_ids: ", requests,
        " in one step exceed ", options_.max_sequences_per_step, " (--max-sequences-per-step)"));
  }
  if (request.timeout_us() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_us: must be >= 0 (0: none), got ", request.timeout_us()));
  }
  const config::Profile& profile = executor_.profile();
  // Shared memory: q / q_scales / weights are checked and read in place in the region (the
  // ranks copy them to the device from there; page-locked where the backend could pin it).
  std::shared_ptr<SharedMemoryRegion> region;
  ExternalStepBytes external;
  // A CUDA IPC buffer: the answer goes there, and (with cuda_ipc.q_offset) q, q_scales and
  // weights, (with cuda_ipc.new_keys_offset) the new keys and their scales are read from it
  // on the device.
  std::shared_ptr<CudaIpcRegion> ipc;
  if (request.has_cuda_ipc()) {
    absl::StatusOr<std::shared_ptr<CudaIpcRegion>> got =
        regions_.CudaIpc(request.cuda_ipc().region_id());
    if (!got.ok()) return got.status();
    ipc = *std::move(got);
  }
  const bool q_on_device = ipc != nullptr && request.cuda_ipc().has_q_offset();
  const bool keys_on_device = ipc != nullptr && request.cuda_ipc().has_new_keys_offset();
  // GPU-side ordering asks for the events the buffer was registered with.
  void* inputs_event = nullptr;
  void* answer_event = nullptr;
  if (ipc != nullptr) {
    const v1::CudaIpcStep& ci = request.cuda_ipc();
    if (ci.wait_inputs_event()) {
      if (!q_on_device && !keys_on_device) {
        return absl::InvalidArgumentError(
            "cuda_ipc.wait_inputs_event: needs cuda_ipc.q_offset or cuda_ipc.new_keys_offset "
            "(the event orders the inputs read from the device buffer)");
      }
      if (ipc->inputs_event() == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda_ipc.wait_inputs_event: region ", ci.region_id(),
            " was registered without an inputs event (RegisterCudaIpcMemoryRequest.inputs_event)"));
      }
      inputs_event = ipc->inputs_event();
    }
    if (ci.record_answer_event()) {
      if (ipc->answer_event() == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda_ipc.record_answer_event: region ", ci.region_id(),
            " was registered without an answer event (RegisterCudaIpcMemoryRequest.answer_event)"));
      }
      answer_event = ipc->answer_event();
    }
  }
  // A tensor's bytes in the CUDA IPC buffer (its Tensor carries dtype and shape only), where
  // `group` ("q_offset", "new_keys_offset") was set: the offset's alignment and the span's
  // room, checked here; the values, on the device.
  auto device_view = [&](const v1::Tensor& t, const char* field, const char* offset_field,
                         uint64_t offset, uint64_t align,
                         const char* group) -> absl::StatusOr<std::string_view> {
    if (!t.data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".data: must be empty when cuda_ipc.", group, " is set"));
    }
    if (offset % align != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc.", offset_field, ": ", offset, " is not a multiple of ", align));
    }
    absl::StatusOr<uint64_t> bytes = ShapeBytes(t, field);
    if (!bytes.ok()) return bytes.status();
    absl::StatusOr<uint8_t*> at = ipc->Span(offset_field, offset, *bytes);
    if (!at.ok()) return at.status();
    return std::string_view(reinterpret_cast<const char*>(*at), *bytes);
  };
  if (q_on_device) {
    const v1::CudaIpcStep& ci = request.cuda_ipc();
    absl::StatusOr<std::string_view> bytes =
        device_view(request.q(), "q", "q_offset", ci.q_offset(), 16, "q_offset");
    if (!bytes.ok()) return bytes.status();
    external.q = *bytes;
    if (request.q_scales().dtype() != v1::DTYPE_UNSPECIFIED) {
      if (!ci.has_q_scales_offset()) {
        return absl::InvalidArgumentError(
            "cuda_ipc.q_scales_offset: required for q_scales when cuda_ipc.q_offset is set");
      }
      bytes = device_view(request.q_scales(), "q_scales", "q_scales_offset", ci.q_scales_offset(),
                          16, "q_offset");
      if (!bytes.ok()) return bytes.status();
      external.q_scales = *bytes;
    }
    if (!ci.has_weights_offset()) {
      return absl::InvalidArgumentError(
          "cuda_ipc.weights_offset: required when cuda_ipc.q_offset is set");
    }
    bytes = device_view(request.weights(), "weights", "weights_offset", ci.weights_offset(), 4,
                        "q_offset");
    if (!bytes.ok()) return bytes.status();
    external.weights = *bytes;
    external.q_on_device = true;
  } else if (request.has_cuda_ipc() && (request.cuda_ipc().has_q_scales_offset() ||
                                        request.cuda_ipc().has_weights_offset())) {
    return absl::InvalidArgumentError(
        "cuda_ipc.q_offset: required with cuda_ipc.q_scales_offset / weights_offset (q, its "
        "scales and the weights are read from device memory together)");
  }
  // The new keys (columnar form) from the device buffer: pre-quantized codes at
  // new_keys_offset and their scales at new_key_scales_offset, both 16-byte aligned.
  if (keys_on_device) {
    const v1::CudaIpcStep& ci = request.cuda_ipc();
    if (request.sequences_size() > 0) {
      return absl::InvalidArgumentError(
          "cuda_ipc.new_keys_offset: only with the columnar form (sequence_ids and one "
          "new_keys tensor), not with sequences");
    }
    if (request.has_shared_memory() && (request.shared_memory().has_new_keys_offset() ||
                                        request.shared_memory().has_new_key_scales_offset())) {
      return absl::InvalidArgumentError(absl::StrCat(
          request.shared_memory().has_new_keys_offset() ? "shared_memory.new_keys_offset"
                                                        : "shared_memory.new_key_scales_offset",
          ": set together with cuda_ipc.new_keys_offset (a step's keys are read from one "
          "place)"));
    }
    const v1::DType kd = request.new_keys().dtype();
    if (kd != v1::DTYPE_FP8_E4M3 && kd != v1::DTYPE_FP4_E2M1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "new_keys.dtype: DTYPE_FP8_E4M3 or DTYPE_FP4_E2M1 (the cache's format, with "
          "new_key_scales) expected for keys in device memory (cuda_ipc.new_keys_offset), got ",
          v1::DType_Name(kd).empty() ? "DTYPE_<unknown>" : v1::DType_Name(kd),
          ": the server quantizes only keys it reads on the host (send them inline or in "
          "shared memory)"));
    }
    absl::StatusOr<std::string_view> bytes =
        device_view(request.new_keys(), "new_keys", "new_keys_offset", ci.new_keys_offset(), 16,
                    "new_keys_offset");
    if (!bytes.ok()) return bytes.status();
    external.new_keys = *bytes;
    const v1::Tensor& ks = request.new_key_scales();
    if (ks.dtype() != v1::DTYPE_UNSPECIFIED || ks.shape_size() > 0 || !ks.data().empty()) {
      if (!ci.has_new_key_scales_offset()) {
        return absl::InvalidArgumentError(
            "cuda_ipc.new_key_scales_offset: required for new_key_scales when "
            "cuda_ipc.new_keys_offset is set (the keys and their scales are read from device "
            "memory together)");
      }
      bytes = device_view(ks, "new_key_scales", "new_key_scales_offset", ci.new_key_scales_offset(),
                          16, "new_keys_offset");
      if (!bytes.ok()) return bytes.status();
      external.new_key_scales = *bytes;
    } else if (ci.has_new_key_scales_offset()) {
      return absl::InvalidArgumentError(
          "new_key_scales.dtype: required with cuda_ipc.new_key_scales_offset (dtype and "
          "shape; the bytes are read from the device buffer)");
    }
    external.keys_on_device = true;
  } else if (request.has_cuda_ipc() && request.cuda_ipc().has_new_key_scales_offset()) {
    return absl::InvalidArgumentError(
        "cuda_ipc.new_keys_offset: required with cuda_ipc.new_key_scales_offset (the keys and "
        "their scales are read from device memory together)");
  }
  if (request.has_shared_memory()) {
    const v1::SharedMemoryStep& sm = request.shared_memory();
    absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> got = regions_.SharedMemory(sm.region_id());
    if (!got.ok()) return got.status();
    region = *std::move(got);
    auto view = [&](const v1::Tensor& t, const char* field, const char* offset_field,
                    uint64_t offset) -> absl::StatusOr<std::string_view> {
      if (!t.data().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".data: must be empty when shared_memory is set"));
      }
      absl::StatusOr<uint64_t> bytes = ShapeBytes(t, field);
      if (!bytes.ok()) return bytes.status();
      absl::StatusOr<uint8_t*> at = region->Span(offset_field, offset, *bytes);
      if (!at.ok()) return at.status();
      return std::string_view(reinterpret_cast<const char*>(*at), *bytes);
    };
    absl::StatusOr<std::string_view> bytes;
    if (!q_on_device) {
      bytes = view(request.q(), "q", "q_offset", sm.q_offset());
      if (!bytes.ok()) return bytes.status();
      external.q = *bytes;
      if (request.q_scales().dtype() != v1::DTYPE_UNSPECIFIED) {
        bytes = view(request.q_scales(), "q_scales", "q_scales_offset", sm.q_scales_offset());
        if (!bytes.ok()) return bytes.status();
        external.q_scales = *bytes;
      }
      bytes = view(request.weights(), "weights", "weights_offset", sm.weights_offset());
      if (!bytes.ok()) return bytes.status();
      external.weights = *bytes;
    }
    // Optional: positions and (columnar) new keys read there too.
    if (sm.has_positions_offset()) {
      bytes = view(request.positions(), "positions", "positions_offset", sm.positions_offset());
      if (!bytes.ok()) return bytes.status();
      external.positions = *bytes;
    }
    if (sm.has_new_keys_offset()) {
      bytes = view(request.new_keys(), "new_keys", "new_keys_offset", sm.new_keys_offset());
      if (!bytes.ok()) return bytes.status();
      external.new_keys = *bytes;
    }
    if (sm.has_new_key_scales_offset()) {
      bytes = view(request.new_key_scales(), "new_key_scales", "new_key_scales_offset",
                   sm.new_key_scales_offset());
      if (!bytes.ok()) return bytes.status();
      external.new_key_scales = *bytes;
    }
  }
  absl::StatusOr<DecodedStep> decoded = DecodeStepRequest(request, profile, external);
  if (!decoded.ok()) return decoded.status();
  exec::ValidatedStep& validated = *decoded->validated;
  validated.set_inputs_ready_event(inputs_event);
  const exec::StepInput& step = validated.input();

  // Where the answer goes, resolved once into the sink the executor writes it into: a CUDA IPC
  // buffer (device to device), the shared-memory region (written there by the device-to-host
  // copy, straight where the region is page-locked), straight into the response's bytes (raw
  // encoding: no intermediate vector, no second copy), or row blocks to the delta encoder.
  // Room is checked before anything runs.
  const uint64_t rows = static_cast<uint64_t>(step.num_rows);
  const uint64_t answer_bytes = rows * static_cast<uint64_t>(profile.topk) * 4;
  const uint64_t cand_bytes = rows * static_cast<uint64_t>(profile.num_candidate_blocks) * 4;
  const bool delta = request.answer_encoding() == v1::ANSWER_ENCODING_DELTA_VARINT;
  exec::AnswerSink sink;
  if (ipc != nullptr) {
    const v1::CudaIpcStep& ci = request.cuda_ipc();
    absl::StatusOr<uint8_t*> at = ipc->Span("answer_offset", ci.answer_offset(), answer_bytes);
    if (!at.ok()) return at.status();
    int32_t* candidates = nullptr;
    if (request.return_candidates()) {
      absl::StatusOr<uint8_t*> c =
          ipc->Span("candidates_offset", ci.candidates_offset(), cand_bytes);
      if (!c.ok()) return c.status();
      candidates = reinterpret_cast<int32_t*>(*c);
    }
    sink = exec::AnswerSink::Device(reinterpret_cast<int32_t*>(*at), candidates, answer_event);
  } else if (region != nullptr) {
    const v1::SharedMemoryStep& sm = request.shared_memory();
    absl::StatusOr<uint8_t*> at = region->Span("answer_offset", sm.answer_offset(), answer_bytes);
    if (!at.ok()) return at.status();
    int32_t* candidates = nullptr;
    if (request.return_candidates()) {
      absl::StatusOr<uint8_t*> c =
          region->Span("candidates_offset", sm.candidates_offset(), cand_bytes);
      if (!c.ok()) return c.status();
      candidates = reinterpret_cast<int32_t*>(*c);
    }
    sink =
        exec::AnswerSink::Host(reinterpret_cast<int32_t*>(*at), candidates, region->page_locked());
  } else {
    int32_t* candidates = request.return_candidates()
                              ? ResponseInt32(rows, profile.num_candidate_blocks,
                                              *response.mutable_candidate_blocks())
                              : nullptr;
    if (delta) {
      std::string* out = response.mutable_topk_delta();
      out->reserve(rows * (static_cast<uint64_t>(profile.topk) + 5));
      const int32_t k = profile.topk;
      sink = exec::AnswerSink::Encoded(
          [out, k](std::span<const int32_t> topk, int32_t n) { EncodeTopkDelta(topk, n, k, *out); },
          candidates, /*page_locked=*/false);
    } else {
      sink = exec::AnswerSink::Host(ResponseInt32(rows, profile.topk, *response.mutable_topk()),
                                    candidates, /*page_locked=*/false);
    }
  }
  validated.set_answer(&sink);
  const bool answer_elsewhere = ipc != nullptr || region != nullptr;
  validated.set_host_memory_page_locked(region != nullptr && region->page_locked());
  // An answer the transport could not send would fail the call after the step committed
  // (a retry would append its keys twice): refuse it before anything runs.
  if (options_.max_send_message_bytes > 0) {
    const uint64_t bound = ResponseBound(request, profile, rows, answer_elsewhere);
    if (bound > static_cast<uint64_t>(options_.max_send_message_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "answer: up to ", bound, " bytes for ", rows, " rows would exceed the message limit of ",
          options_.max_send_message_bytes,
          " bytes; nothing was run (use answer_encoding DELTA_VARINT, shared memory or fewer "
          "rows per step)"));
    }
  }

  const auto queued = Clock::now();
  last_queued_deadline_.store(context->deadline().time_since_epoch().count());
  ++steps_waiting_;
  std::unique_lock<std::mutex> admitted(step_mu_);
  --steps_waiting_;
  const int64_t admission_us = static_cast<int64_t>(MicrosSince(queued));
  // Checked once admitted and before any state changes: an expired or abandoned step is
  // answered without touching the caches.
  if (context->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("deadline passed before the step ran");
  }
  if (request.timeout_us() > 0) {
    const double waited = MicrosSince(read_at);
    if (waited > static_cast<double>(request.timeout_us())) {
      return absl::DeadlineExceededError(
          absl::StrCat("timeout_us: ", request.timeout_us(), " us passed before the step ran (",
                       static_cast<int64_t>(waited), " us since it was read)"));
    }
  }
  if (context->IsCancelled()) return absl::CancelledError("cancelled before the step ran");
  // And once more right before the commit, in the executor: a deadline that passes while the
  // step runs leaves nothing committed.
  validated.set_call_check(CallCheckOf(context));
  absl::StatusOr<exec::StepResult> result = executor_.DecodeStep(validated);
  admitted.unlock();
  if (!result.ok()) {
    CheckHealth(result.status());
    // The executor names requests the `sequences` way; a columnar step hears its own fields.
    return NameColumnarFields(result.status(), request);
  }
  // An executor that ignores the sink (a test double) answers in its vectors.
  if (!result->topk_indices.empty()) {
    switch (sink.kind()) {
      case exec::AnswerSink::Kind::kHost:
        std::memcpy(sink.topk(), result->topk_indices.data(),
                    result->topk_indices.size() * sizeof(int32_t));
        break;
      case exec::AnswerSink::Kind::kEncoder:
        sink.encoder()(result->topk_indices, result->num_rows);
        break;
      case exec::AnswerSink::Kind::kDevice:
        return absl::InternalError(
            "the executor did not write the answer into the CUDA IPC buffer");
      case exec::AnswerSink::Kind::kVector:
        break;
    }
  }
  if (!result->candidate_blocks.empty() && sink.candidates() != nullptr) {
    if (sink.kind() == exec::AnswerSink::Kind::kDevice) {
      return absl::InternalError(
          "the executor did not write the candidates into the CUDA IPC buffer");
    }
    std::memcpy(sink.candidates(), result->candidate_blocks.data(),
                result->candidate_blocks.size() * sizeof(int32_t));
  }
  result->queue_us += admission_us;
  const config::LayerRole role = profile.layers.at(request.layer()).role;
  const int kind = role == config::LayerRole::kCandidateSource     ? 1
                   : role == config::LayerRole::kCandidateConsumer ? 2
                                                                   : 0;
  step_seconds_[kind]->Observe(MicrosSince(read_at) * 1e-6);
  queue_seconds_->Observe(static_cast<double>(result->queue_us) * 1e-6);
  queue_us_total_ += result->queue_us;
  rows_per_step_->Observe(result->num_rows);
  response.set_step_id(result->step_id);
  if (answer_elsewhere || delta) {
    SetShapeOnly(result->num_rows, result->topk, *response.mutable_topk());
  }
  if (request.return_candidates() && answer_elsewhere) {
    SetShapeOnly(result->num_rows, result->num_candidate_blocks,
                 *response.mutable_candidate_blocks());
  }
  response.mutable_timing()->set_queue_us(result->queue_us);
  response.mutable_timing()->set_compute_us(result->compute_us);
  response.set_sharded(result->sharded);
  for (int64_t len : result->lengths) response.add_lengths(len);
  return absl::OkStatus();
}

// The unary methods whose body is Do<Method> (DecodeStep's is RunStep, which takes the read
// time), as X(Method, request type, response type).
#define DI_UNARY_METHODS(X)                                                                        \
  X(GetServerInfo, v1::GetServerInfoRequest, v1::ServerInfo)                                       \
  X(CreateSequence, v1::CreateSequenceRequest, v1::CreateSequenceResponse)                         \
  X(AppendKeys, v1::AppendKeysRequest, v1::AppendKeysResponse)                                     \
  X(ReleaseSequence, v1::ReleaseSequenceRequest, v1::ReleaseSequenceResponse)                      \
  X(GetStatistics, v1::GetStatisticsRequest, v1::Statistics)                                       \
  X(RegisterSharedMemory, v1::RegisterSharedMemoryRequest, v1::RegisterSharedMemoryResponse)       \
  X(UnregisterSharedMemory, v1::UnregisterSharedMemoryRequest, v1::UnregisterSharedMemoryResponse) \
  X(RegisterCudaIpcMemory, v1::RegisterCudaIpcMemoryRequest, v1::RegisterCudaIpcMemoryResponse)    \
  X(UnregisterCudaIpcMemory, v1::UnregisterCudaIpcMemoryRequest,                                   \
    v1::UnregisterCudaIpcMemoryResponse)                                                           \
  X(TruncateSequence, v1::TruncateSequenceRequest, v1::TruncateSequenceResponse)                   \
  X(ForkSequence, v1::ForkSequenceRequest, v1::ForkSequenceResponse)                               \
  X(GetSequence, v1::GetSequenceRequest, v1::GetSequenceResponse)                                  \
  X(RegisterStepRing, v1::RegisterStepRingRequest, v1::RegisterStepRingResponse)                   \
  X(UnregisterStepRing, v1::UnregisterStepRingRequest, v1::UnregisterStepRingResponse)

absl::Status IndexerService::Unary(Method method, CallContext& call,
                                   const google::protobuf::Message& request,
                                   google::protobuf::Message& response,
                                   std::chrono::steady_clock::time_point read_at) {
  return Handle(method, call, [&]() -> absl::Status {
    // The edges hand each method its own messages (the sync service by type, the callback
    // edge by its method table).
    switch (method) {
#define DI_UNARY_CASE(M, Req, Resp) \
  case k##M:                        \
    return Do##M(call, static_cast<const Req&>(request), static_cast<Resp&>(response));
      DI_UNARY_METHODS(DI_UNARY_CASE)
#undef DI_UNARY_CASE
      case kDecodeStep:
        return RunStep(&call, static_cast<const v1::DecodeStepRequest&>(request),
                       static_cast<v1::DecodeStepResponse&>(response), read_at);
      default:
        return absl::InternalError(
            absl::StrCat(MethodName(method), " is not a unary method (an edge bug)"));
    }
  });
}

// The sync edge's unary overrides: the call's context, then Unary. gRPC has read and parsed
// the message when the handler starts: DecodeStep's timeout_us counts from here.
#define DI_SYNC_UNARY(M, Req, Resp)                                                \
  grpc::Status IndexerService::M(grpc::ServerContext* context, const Req* request, \
                                 Resp* response) {                                 \
    GrpcCallContext call(context);                                                 \
    return ToGrpcStatus(Unary(k##M, call, *request, *response, Clock::now()));     \
  }
DI_UNARY_METHODS(DI_SYNC_UNARY)
DI_SYNC_UNARY(DecodeStep, v1::DecodeStepRequest, v1::DecodeStepResponse)
#undef DI_SYNC_UNARY
#undef DI_UNARY_METHODS

absl::Status IndexerService::OpenStream(CallContext& call, std::string& request_id) {
  RequestIdScope scope(call);
  request_id = CurrentRequestId();
  absl::Status a = Authorize(call);
  if (!a.ok()) {
    refused_after_read_.fetch_add(1, std::memory_order_relaxed);
    stats_[kDecodeStream].Record(0, a.code());
  }
  return a;
}

absl::Status IndexerService::StreamStep(CallContext& call, const v1::DecodeStepRequest& request,
                                        v1::DecodeStepResponse& response,
                                        std::chrono::steady_clock::time_point read_at) {
  if (call.IsCancelled()) return absl::CancelledError("cancelled");
  absl::Status s =
      WithLostSequenceHint(Guarded([&] { return RunStep(&call, request, response, read_at); }));
  const double us = MicrosSince(read_at);
  stats_[kDecodeStream].Record(us, s.code());
  rpc_seconds_[kDecodeStream]->Observe(us * 1e-6);
  if (!s.ok()) {
    spdlog::debug("DecodeStream step {} (request {}): {}", request.step_id(), CurrentRequestId(),
                  s.ToString());
  }
  return s;
}

grpc::Status IndexerService::DecodeStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::DecodeStepResponse, v1::DecodeStepRequest>* stream) {
  GrpcCallContext call(context);
  std::string request_id;
  if (absl::Status a = OpenStream(call, request_id); !a.ok()) return ToGrpcStatus(a);
  ScopedRequestId scope(request_id);
  v1::DecodeStepRequest request;
  v1::DecodeStepResponse response;
  // One step at a time: each is answered before the next is read, so answers are in order.
  while (stream->Read(&request)) {
    const auto read_at = Clock::now();
    response.Clear();
    if (absl::Status s = StreamStep(call, request, response, read_at); !s.ok()) {
      return ToGrpcStatus(s);
    }
    if (!stream->Write(response)) {
      return ToGrpcStatus(absl::CancelledError("client went away"));
    }
  }
  return grpc::Status::OK;
}

void IndexerService::FillStatistics(v1::Statistics& out) const {
  for (int m = 0; m < kNumMethods; ++m) {
    v1::RpcStatistics* r = out.add_rpcs();
    r->set_method(MethodName(static_cast<Method>(m)));
    stats_[m].Fill(*r);
  }
  const exec::ExecutorStatus st = executor_.Status();
  out.set_steps(st.steps);
  out.set_steps_sharded(st.steps_sharded);
  out.set_steps_unsharded(st.steps_unsharded);
  int64_t total = 0, free = 0;
  for (const exec::CachePoolStatus& c : st.caches) {
    total += c.pages_total;
    free += c.pages_free;
  }
  out.set_pages_total(total);
  out.set_pages_in_use(total - free);
  out.set_rows_scored(st.rows_scored);
  // The same queue as each response's ServerTiming.queue_us (admission + executor turn).
  out.set_queue_us_total(static_cast<double>(queue_us_total_.load()));
  out.set_compute_us_total(st.compute_us_total);
  out.set_sequences(st.sequences);
  out.set_collective_us_total(st.collective_us_total);
  out.set_healthy(st.healthy);
  out.set_health_detail(st.health_detail);
  out.set_collective(st.collective);
  out.set_step_rings(static_cast<int64_t>(step_rings_.size()));
  for (int32_t r = 0; r < st.num_ranks; ++r) {
    out.add_device_memory_bytes(
        size_t(r) < st.device_memory_bytes.size() ? st.device_memory_bytes[r] : 0);
  }
}

absl::Status IndexerService::DoGetStatistics(CallContext& /*call*/,
                                             const v1::GetStatisticsRequest& /*request*/,
                                             v1::Statistics& response) {
  FillStatistics(response);
  return absl::OkStatus();
}

void IndexerService::PinRegion(SharedMemoryRegion& region) {
  // Page-lock the region with the answering rank's backend, so q is copied to the device
  // and the answer back by direct DMA; a region that cannot be pinned still works.
  absl::Status pinned = executor_.WithAnswerDevice(
      [&](kernels::Device& be) { return be.RegisterHostMemory(region.base(), region.size()); });
  if (!pinned.ok()) {
    spdlog::info("shared memory: region of {} bytes stays pageable: {}", region.size(),
                 pinned.ToString());
    return;
  }
  region.MarkPageLocked();
  region.SetReleaseHook([this, base = region.base()] {
    absl::Status s = executor_.WithAnswerDevice(
        [base](kernels::Device& be) { return be.UnregisterHostMemory(base); });
    if (!s.ok()) spdlog::warn("shared memory: unpinning a region: {}", s.ToString());
  });
}

absl::Status IndexerService::StartShmSocket(const std::string& path, SocketPathLock lock,
                                            int mode) {
  absl::StatusOr<std::unique_ptr<ShmSocketServer>> socket = ShmSocketServer::Start(
      path, regions_, [this](SharedMemoryRegion& r) { PinRegion(r); }, std::move(lock), mode);
  if (!socket.ok()) return socket.status();
  shm_socket_ = *std::move(socket);
  return absl::OkStatus();
}

absl::Status IndexerService::DoRegisterSharedMemory(
    CallContext& /*call*/, const v1::RegisterSharedMemoryRequest& request,
    v1::RegisterSharedMemoryResponse& /*response*/) {
  // A named POSIX object can be shrunk by whoever can open it, and a server reading a
  // shrunk mapping dies of SIGBUS; names can also be guessed and modes bypassed by a root
  // server. Only sealed memfds, handed over the Unix socket, are mapped.
  return absl::FailedPreconditionError(absl::StrCat(
      "name ", EchoInput(request.name()),
      ": POSIX shared-memory names are not mapped (the object could be shrunk under the "
      "server); send a sealed memfd over the server's shm socket (ServerInfo.shm_socket",
      shm_socket_ ? "" : "; this server has none: start it with --shm-socket", ")"));
}

absl::Status IndexerService::DoUnregisterSharedMemory(
    CallContext& /*call*/, const v1::UnregisterSharedMemoryRequest& request,
    v1::UnregisterSharedMemoryResponse& /*response*/) {
  return regions_.UnregisterSharedMemory(request.region_id());
}

absl::Status IndexerService::DoRegisterCudaIpcMemory(
    CallContext& /*call*/, const v1::RegisterCudaIpcMemoryRequest& request,
    v1::RegisterCudaIpcMemoryResponse& response) {
  if (request.handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("handle: expected ", kCudaIpcHandleBytes,
                                                   " bytes (a cudaIpcMemHandle_t), got ",
                                                   request.handle().size()));
  }
  // The optional events (cuda_ipc.wait_inputs_event / record_answer_event use them).
  const std::pair<const char*, const std::string*> event_handles[2] = {
      {"inputs_event", &request.inputs_event()}, {"answer_event", &request.answer_event()}};
  for (const auto& [field, handle] : event_handles) {
    if (!handle->empty() && handle->size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", kCudaIpcHandleBytes,
                                                     " bytes (a cudaIpcEventHandle_t), got ",
                                                     handle->size()));
    }
  }
  if (request.size() == 0 || request.size() > (uint64_t{1} << 48)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size: must be in [1, 2^48] bytes, got ", request.size()));
  }
  if (request.device() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: must be a device ordinal >= 0, got ", request.device()));
  }
  if (!regions_.HasRoomForCudaIpc()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("at most ", RegionRegistry::kMaxCudaIpcRegions, " CUDA IPC regions"));
  }
  void* opened = nullptr;
  absl::Status s = executor_.WithAnswerDevice([&](kernels::Device& be) -> absl::Status {
    absl::StatusOr<void*> ptr =
        be.OpenIpcMemory(request.handle(), request.size(), request.device());
    if (!ptr.ok()) return ptr.status();
    opened = *ptr;
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  // Closed by the answering rank's backend once unregistered and no step uses it.
  auto region = std::make_shared<CudaIpcRegion>(opened, request.size(), [this](void* ptr) {
    absl::Status c =
        executor_.WithAnswerDevice([ptr](kernels::Device& be) { return be.CloseIpcMemory(ptr); });
    if (!c.ok()) spdlog::warn("cuda ipc: closing a region: {}", c.ToString());
  });
  // The events, opened in the same backend and handed to the region as each opens: on a
  // failure the region (and what it holds) closes as it goes out of scope, nothing registered.
  void* events[2] = {nullptr, nullptr};
  auto close_event = [this](void* event) {
    absl::Status c = executor_.WithAnswerDevice(
        [event](kernels::Device& be) { return be.CloseIpcEvent(event); });
    if (!c.ok()) spdlog::warn("cuda ipc: closing an event: {}", c.ToString());
  };
  for (int i = 0; i < 2; ++i) {
    const auto& [field, handle] = event_handles[i];
    if (handle->empty()) continue;
    absl::Status e = executor_.WithAnswerDevice([&](kernels::Device& be) -> absl::Status {
      absl::StatusOr<void*> event = be.OpenIpcEvent(*handle, request.device());
      if (!event.ok()) return event.status();
      events[i] = *event;
      return absl::OkStatus();
    });
    if (!e.ok()) return absl::Status(e.code(), absl::StrCat(field, ": ", e.message()));
    region->SetEvents(events[0], events[1], close_event);
  }
  absl::StatusOr<uint64_t> id = regions_.AddCudaIpc(std::move(region));
  if (!id.ok()) return id.status();
  response.set_region_id(*id);
  return absl::OkStatus();
}

absl::Status IndexerService::DoUnregisterCudaIpcMemory(
    CallContext& /*call*/, const v1::UnregisterCudaIpcMemoryRequest& request,
    v1::UnregisterCudaIpcMemoryResponse& /*response*/) {
  return regions_.UnregisterCudaIpc(request.region_id());
}

std::string IndexerService::RenderMetrics() const {
  static constexpr const char* kCodeNames[LatencyStats::kCodes] = {"OK",
                                                                   "CANCELLED",
                                                                   "UNKNOWN",
                                                                   "INVALID_ARGUMENT",
                                                                   "DEADLINE_EXCEEDED",
                                                                   "NOT_FOUND",
                                                                   "ALREADY_EXISTS",
                                                                   "PERMISSION_DENIED",
                                                                   "RESOURCE_EXHAUSTED",
                                                                   "FAILED_PRECONDITION",
                                                                   "ABORTED",
                                                                   "OUT_OF_RANGE",
                                                                   "UNIMPLEMENTED",
                                                                   "INTERNAL",
                                                                   "UNAVAILABLE",
                                                                   "DATA_LOSS",
                                                                   "UNAUTHENTICATED"};
  using prometheus::MetricFamily;
  using prometheus::MetricType;
  std::vector<MetricFamily> out = registry_->Collect();
  auto family = [&out](const char* name, MetricType type, const char* help) -> MetricFamily& {
    out.push_back(MetricFamily{absl::StrCat("decode_indexer_", name), help, type, {}});
    return out.back();
  };
  auto sample = [](MetricFamily& f, std::vector<prometheus::ClientMetric::Label> labels,
                   double value) {
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    if (f.type == MetricType::Counter) {
      m.counter.value = value;
    } else {
      m.gauge.value = value;
    }
    f.metric.push_back(std::move(m));
  };
  MetricFamily& rpcs =
      family("rpcs_total", MetricType::Counter, "RPCs answered, by method and gRPC status code.");
  for (int m = 0; m < kNumMethods; ++m) {
    const std::array<uint64_t, LatencyStats::kCodes> codes = stats_[m].Codes();
    for (int c = 0; c < LatencyStats::kCodes; ++c) {
      if (codes[c] == 0 && c != 0) continue;
      sample(rpcs, {{"method", MethodName(Method(m))}, {"code", kCodeNames[c]}}, double(codes[c]));
    }
  }

  const exec::ExecutorStatus st = executor_.Status();
  sample(family("build_info", MetricType::Gauge,
                "1, labelled with the server's version, source revision, build type and "
                "backend."),
         {{"version", version_},
          {"revision", BuildRevision()},
          {"build_type", DI_BUILD_TYPE},
          {"cuda_built", DI_BUILT_WITH_CUDA},
          {"backend", st.backend}},
         1);
  sample(family("steps_total", MetricType::Counter, "Steps the executor ran."), {},
         double(st.steps));
  sample(family("auth_refused_total", MetricType::Counter,
                "Calls refused before their request was read: on TLS in gRPC's auth filter "
                "(missing or wrong bearer token, client certificate not for client use), on "
                "plaintext by the callback edge (missing or wrong bearer token)."),
         {}, double(auth_refused_.load()));
  sample(family("steps_sharded_total", MetricType::Counter, "Steps row-sharded across ranks."), {},
         double(st.steps_sharded));
  sample(family("steps_unsharded_total", MetricType::Counter, "Steps run whole on every rank."), {},
         double(st.steps_unsharded));
  sample(family("rows_scored_total", MetricType::Counter, "Rows scored."), {},
         double(st.rows_scored));
  {
    MetricFamily& graphs =
        family("step_graphs_total", MetricType::Counter,
               "CUDA graphs of a step's kernel section, summed over the ranks: captured, "
               "replayed, and evicted (a step shape dropped from a full table, "
               "--max-step-graphs; one that keeps climbing means the batches' shapes outgrow "
               "it).");
    sample(graphs, {{"event", "captured"}}, double(st.graph_captures));
    sample(graphs, {{"event", "replayed"}}, double(st.graph_replays));
    sample(graphs, {{"event", "evicted"}}, double(st.graph_evictions));
  }
  sample(family("compute_seconds_total", MetricType::Counter,
                "Executor compute time summed over steps."),
         {}, st.compute_us_total * 1e-6);
  sample(family("collective_seconds_total", MetricType::Counter, "Rank 0's time in all-gathers."),
         {}, st.collective_us_total * 1e-6);
  sample(family("sequences", MetricType::Gauge, "Live sequences."), {}, double(st.sequences));
  sample(family("max_sequences", MetricType::Gauge, "Live sequences at most (--max-sequences)."),
         {}, double(st.max_sequences));
  sample(family("healthy", MetricType::Gauge, "1 while the ranks are healthy."), {},
         st.healthy ? 1 : 0);
  sample(family("ranks", MetricType::Gauge, "Ranks (one per GPU on CUDA)."), {},
         double(st.num_ranks));
  MetricFamily& in_use =
      family("cache_pages_in_use", MetricType::Gauge, "Pages in use, per cache pool.");
  for (const exec::CachePoolStatus& c : st.caches) {
    sample(in_use, {{"cache_layer", std::to_string(c.cache_layer)}},
           double(c.pages_total - c.pages_free));
  }
  MetricFamily& pages =
      family("cache_pages", MetricType::Gauge, "Pages per cache pool (its capacity).");
  for (const exec::CachePoolStatus& c : st.caches) {
    sample(pages, {{"cache_layer", std::to_string(c.cache_layer)}}, double(c.pages_total));
  }
  // Device-wide bytes in use on each rank's GPU (cudaMemGetInfo), sampled by the executor;
  // host backends keep everything in host memory and report 0 with device="host".
  MetricFamily& device = family("device_memory_bytes", MetricType::Gauge,
                                "Device memory in use per rank (0 on host backends).");
  const std::string device_kind = st.backend == "cuda" ? "cuda" : "host";
  for (int r = 0; r < st.num_ranks; ++r) {
    const int64_t bytes =
        size_t(r) < st.device_memory_bytes.size() ? st.device_memory_bytes[r] : int64_t{0};
    sample(device, {{"rank", std::to_string(r)}, {"device", device_kind}}, double(bytes));
  }
  if (st.backend == "cuda") {
    std::call_once(gpu_utilization_once_,
                   [&] { gpu_utilization_ = std::make_unique<GpuUtilization>(st.num_ranks); });
    const std::vector<double> busy = gpu_utilization_->Sample();
    if (!busy.empty()) {
      MetricFamily& util =
          family("device_utilization_ratio", MetricType::Gauge,
                 "Fraction of NVML's last sample period in which a kernel ran on the rank's GPU.");
      for (size_t r = 0; r < busy.size(); ++r) {
        if (busy[r] >= 0) sample(util, {{"rank", std::to_string(r)}}, busy[r]);
      }
    }
  }
  for (MetricFamily& f : ProcessMetrics()) out.push_back(std::move(f));
  return SerializeMetrics(out);
}

}  // namespace decode_indexer::service

namespace decode_indexer::service {

absl::Status IndexerService::DoTruncateSequence(CallContext& call,
                                                const v1::TruncateSequenceRequest& request,
                                                v1::TruncateSequenceResponse& response) {
  absl::StatusOr<int64_t> freed =
      executor_.TruncateSequence(request.sequence_id(), request.length(), CallCheckOf(&call));
  if (!freed.ok()) return freed.status();
  response.set_pages_freed(*freed);
  return absl::OkStatus();
}

absl::Status IndexerService::DoForkSequence(CallContext& call,
                                            const v1::ForkSequenceRequest& request,
                                            v1::ForkSequenceResponse& /*response*/) {
  return executor_.ForkSequence(request.parent_id(), request.new_id(), request.length(),
                                CallCheckOf(&call));
}

absl::Status IndexerService::DoGetSequence(CallContext& /*call*/,
                                           const v1::GetSequenceRequest& request,
                                           v1::GetSequenceResponse& response) {
  absl::StatusOr<exec::SequenceInfo> info = executor_.GetSequence(request.sequence_id());
  if (!info.ok()) return info.status();
  for (const exec::SequenceCacheInfo& c : info->caches) {
    v1::SequenceCacheLength* out = response.add_caches();
    out->set_cache_layer(c.cache_layer);
    out->set_length(c.length);
    out->set_pages(c.pages);
    out->set_shared_pages(c.shared_pages);
  }
  for (const auto& [layer, length] : info->candidates) response.add_candidate_layers(layer);
  return absl::OkStatus();
}

grpc::Status IndexerService::ExportSequence(grpc::ServerContext* context,
                                            const v1::ExportSequenceRequest* request,
                                            grpc::ServerWriter<v1::SequenceChunk>* writer) {
  GrpcCallContext call(context);
  return ToGrpcStatus(Export(call, *request, [&](v1::SequenceChunk& chunk) {
    if (context->IsCancelled() || !writer->Write(chunk)) {
      return absl::CancelledError("the client went away");
    }
    return absl::OkStatus();
  }));
}

absl::Status IndexerService::Export(CallContext& call, const v1::ExportSequenceRequest& request,
                                    const std::function<absl::Status(v1::SequenceChunk&)>& emit) {
  return Handle(kExportSequence, call, [&]() -> absl::Status {
    if (request.chunk_bytes() < 0 || request.chunk_bytes() > (int64_t{64} << 20)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk_bytes: must be in [0, 64 MiB] (0: 1 MiB), got ", request.chunk_bytes()));
    }
    absl::StatusOr<exec::SequenceImage> image = executor_.ExportSequence(request.sequence_id());
    if (!image.ok()) {
      CheckHealth(image.status());
      return image.status();
    }
    return EmitSequenceChunks(*image, executor_.profile(), request.sequence_id(),
                              request.chunk_bytes(), emit);
  });
}

std::unique_ptr<IndexerService::ImportCall> IndexerService::ImportBegin(CallContext& call) {
  auto import = std::make_unique<ImportCall>(executor_.profile());
  import->start = Clock::now();
  RequestIdScope scope(call);
  import->request_id = CurrentRequestId();
  import->status = Authorize(call);
  if (!import->status.ok()) {
    refused_after_read_.fetch_add(1, std::memory_order_relaxed);
  } else if (restoring_) {
    import->status =
        absl::UnavailableError("the server is restoring its snapshot (health NOT_SERVING); retry");
  }
  return import;
}

// `state`, not `import`: clang-format 14 reads a line that starts with `import` as a C++20
// module import and mangles the function.
absl::Status IndexerService::ImportChunk(ImportCall& state,
                                         const v1::ImportSequenceRequest& request) {
  if (!state.status.ok()) return state.status;
  state.status = Guarded([&]() -> absl::Status {
    if (state.first) {
      state.id = request.sequence_id();
      state.first = false;
    } else if (request.sequence_id() != 0 && request.sequence_id() != state.id) {
      return absl::InvalidArgumentError("sequence_id: only the first message names the sequence");
    }
    return state.assembler.Add(request.chunk());
  });
  return state.status;
}

absl::Status IndexerService::ImportEnd(CallContext& call, ImportCall& import,
                                       v1::ImportSequenceResponse& response) {
  ScopedRequestId scope(import.request_id);
  absl::Status s = import.status;
  if (s.ok()) {
    s = WithLostSequenceHint(Guarded([&]() -> absl::Status {
      if (call.IsCancelled()) return absl::CancelledError("the client cancelled the import");
      absl::StatusOr<exec::SequenceImage> image = import.assembler.Finish();
      if (!image.ok()) return image.status();
      uint64_t id = import.id;
      if (id == 0) id = import.assembler.exported_id();
      if (absl::Status e = executor_.ImportSequence(id, *image, CallCheckOf(&call)); !e.ok()) {
        CheckHealth(e);
        return e;
      }
      response.set_sequence_id(id);
      for (const exec::CacheImage& c : image->caches) response.add_lengths(c.length);
      return absl::OkStatus();
    }));
  }
  const double us = MicrosSince(import.start);
  stats_[kImportSequence].Record(us, s.code());
  rpc_seconds_[kImportSequence]->Observe(us * 1e-6);
  spdlog::debug("ImportSequence {} in {:.0f} us (request {}){}{}",
                absl::StatusCodeToString(s.code()), us, CurrentRequestId(), s.ok() ? "" : ": ",
                std::string(s.message()));
  return s;
}

grpc::Status IndexerService::ImportSequence(grpc::ServerContext* context,
                                            grpc::ServerReader<v1::ImportSequenceRequest>* reader,
                                            v1::ImportSequenceResponse* response) {
  GrpcCallContext call(context);
  std::unique_ptr<ImportCall> import = ImportBegin(call);
  v1::ImportSequenceRequest request;
  // ImportChunk keeps the first failure in import->status; reading stops there.
  while (import->status.ok() && reader->Read(&request)) {
    if (!ImportChunk(*import, request).ok()) break;
  }
  return ToGrpcStatus(ImportEnd(call, *import, *response));
}

}  // namespace decode_indexer::service

namespace decode_indexer::service {

absl::Status IndexerService::DoRegisterStepRing(CallContext& /*call*/,
                                                const v1::RegisterStepRingRequest& request,
                                                v1::RegisterStepRingResponse& response) {
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> region =
      regions_.SharedMemory(request.region_id());
  if (!region.ok()) {
    return absl::NotFoundError(
        "region_id: no such shared-memory region (register the ring's memfd over the shm "
        "socket first)");
  }
  StepRingConfig config;
  config.region_id = request.region_id();
  config.slots = request.slots();
  config.slot_bytes = request.slot_bytes();
  config.spin_us = request.spin_us() == 0 ? 50 : request.spin_us();
  absl::StatusOr<v1::RegisterStepRingResponse> registered = step_rings_.Register(
      *std::move(region), config, executor_.profile(),
      [this](const v1::DecodeStepRequest& step, v1::DecodeStepResponse& answer,
             Clock::time_point taken) { return RunRingStep(step, answer, taken); },
      // The owner is gone: so is its region (the ring held the last use of it).
      [this](uint64_t region_id) { regions_.UnregisterSharedMemory(region_id).IgnoreError(); });
  if (!registered.ok()) return registered.status();
  response = *std::move(registered);
  return absl::OkStatus();
}

absl::Status IndexerService::DoUnregisterStepRing(CallContext& /*call*/,
                                                  const v1::UnregisterStepRingRequest& request,
                                                  v1::UnregisterStepRingResponse& response) {
  absl::StatusOr<uint64_t> steps = step_rings_.Unregister(request.ring_id());
  if (!steps.ok()) return steps.status();
  response.set_steps(*steps);
  return absl::OkStatus();
}

absl::Status IndexerService::RunRingStep(const v1::DecodeStepRequest& request,
                                         v1::DecodeStepResponse& response,
                                         Clock::time_point taken) {
  // RunStep asks its context for the call's deadline and cancellation: a ring step has
  // neither (an infinite deadline, never cancelled).
  NoCallContext no_call;
  absl::Status s = restoring_ ? absl::UnavailableError("the server is restoring its snapshot")
                              : WithLostSequenceHint(Guarded(
                                    [&] { return RunStep(&no_call, request, response, taken); }));
  const double us = MicrosSince(taken);
  stats_[kRingStep].Record(us, s.code());
  rpc_seconds_[kRingStep]->Observe(us * 1e-6);
  return s;
}

}  // namespace decode_indexer::service
