#include "server/service/indexer_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/service/request_decode.h"
#include "server/service/status_mapping.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::service {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

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

void SetInt32Tensor(const std::vector<int32_t>& values, int64_t rows, int64_t cols,
                    v1::Tensor& out) {
  out.set_dtype(v1::DTYPE_INT32);
  out.add_shape(rows);
  out.add_shape(cols);
  out.set_data(values.data(), values.size() * sizeof(int32_t));
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

void LatencyStats::Record(double latency_us, bool error) {
  // Bucket b holds latencies in (2^((b-1)/4), 2^(b/4)] µs; bucket 0 everything <= 1 µs.
  int b = latency_us <= 1.0 ? 0 : static_cast<int>(std::ceil(4.0 * std::log2(latency_us)));
  b = std::clamp(b, 0, kBuckets - 1);
  std::lock_guard<std::mutex> lock(mu_);
  ++count_;
  if (error) ++errors_;
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

void LatencyStats::Fill(v1::RpcStatistics& out) const {
  std::lock_guard<std::mutex> lock(mu_);
  out.set_count(count_);
  out.set_errors(errors_);
  out.set_latency_us_total(total_us_);
  out.set_latency_us_max(max_us_);
  out.set_latency_us_p50(Percentile(0.50));
  out.set_latency_us_p99(Percentile(0.99));
}

IndexerService::IndexerService(exec::Executor& executor, std::string version)
    : executor_(executor), version_(std::move(version)) {}

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
  static constexpr const char* kNames[] = {"GetServerInfo",   "CreateSequence", "AppendKeys",
                                           "ReleaseSequence", "DecodeStep",     "DecodeStream",
                                           "GetStatistics"};
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

grpc::Status IndexerService::GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*,
                                           v1::ServerInfo* response) {
  const auto start = Clock::now();
  absl::Status s = Guarded([&] {
    FillServerInfo(*response);
    return absl::OkStatus();
  });
  stats_[kGetServerInfo].Record(MicrosSince(start), !s.ok());
  return ToGrpcStatus(s);
}

grpc::Status IndexerService::CreateSequence(grpc::ServerContext*,
                                            const v1::CreateSequenceRequest* request,
                                            v1::CreateSequenceResponse*) {
  const auto start = Clock::now();
  absl::Status s = Guarded([&] { return executor_.CreateSequence(request->sequence_id()); });
  stats_[kCreateSequence].Record(MicrosSince(start), !s.ok());
  return ToGrpcStatus(s);
}

grpc::Status IndexerService::AppendKeys(grpc::ServerContext*, const v1::AppendKeysRequest* request,
                                        v1::AppendKeysResponse* response) {
  const auto start = Clock::now();
  absl::Status s = Guarded([&]() -> absl::Status {
    absl::StatusOr<DecodedAppend> decoded = DecodeAppendKeys(*request, executor_.profile());
    if (!decoded.ok()) return decoded.status();
    absl::StatusOr<int64_t> length =
        executor_.AppendKeys(decoded->sequence_id, decoded->layer, decoded->keys);
    if (!length.ok()) {
      CheckHealth(length.status());
      return length.status();
    }
    response->set_length(*length);
    return absl::OkStatus();
  });
  stats_[kAppendKeys].Record(MicrosSince(start), !s.ok());
  return ToGrpcStatus(s);
}

grpc::Status IndexerService::ReleaseSequence(grpc::ServerContext*,
                                             const v1::ReleaseSequenceRequest* request,
                                             v1::ReleaseSequenceResponse* response) {
  const auto start = Clock::now();
  absl::Status s = Guarded([&]() -> absl::Status {
    absl::StatusOr<int64_t> freed = executor_.ReleaseSequence(request->sequence_id());
    if (!freed.ok()) return freed.status();
    response->set_pages_freed(*freed);
    return absl::OkStatus();
  });
  stats_[kReleaseSequence].Record(MicrosSince(start), !s.ok());
  return ToGrpcStatus(s);
}

absl::Status IndexerService::RunStep(const v1::DecodeStepRequest& request,
                                     v1::DecodeStepResponse& response) {
  return Guarded([&]() -> absl::Status {
    absl::StatusOr<DecodedStep> decoded = DecodeStepRequest(request, executor_.profile());
    if (!decoded.ok()) return decoded.status();
    absl::StatusOr<exec::StepResult> result = executor_.DecodeStep(decoded->step);
    if (!result.ok()) {
      CheckHealth(result.status());
      return result.status();
    }
    response.set_step_id(result->step_id);
    SetInt32Tensor(result->topk_indices, result->num_rows, result->topk, *response.mutable_topk());
    if (request.return_candidates()) {
      SetInt32Tensor(result->candidate_blocks, result->num_rows, result->num_candidate_blocks,
                     *response.mutable_candidate_blocks());
    }
    response.mutable_timing()->set_queue_us(result->queue_us);
    response.mutable_timing()->set_compute_us(result->compute_us);
    response.set_sharded(result->sharded);
    for (int64_t len : result->lengths) response.add_lengths(len);
    return absl::OkStatus();
  });
}

grpc::Status IndexerService::DecodeStep(grpc::ServerContext*, const v1::DecodeStepRequest* request,
                                        v1::DecodeStepResponse* response) {
  const auto start = Clock::now();
  absl::Status s = RunStep(*request, *response);
  stats_[kDecodeStep].Record(MicrosSince(start), !s.ok());
  if (!s.ok()) spdlog::debug("DecodeStep {}: {}", request->step_id(), s.ToString());
  return ToGrpcStatus(s);
}

grpc::Status IndexerService::DecodeStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::DecodeStepResponse, v1::DecodeStepRequest>* stream) {
  v1::DecodeStepRequest request;
  v1::DecodeStepResponse response;
  // One step at a time: each is answered before the next is read, so answers are in order.
  while (stream->Read(&request)) {
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    const auto start = Clock::now();
    response.Clear();
    absl::Status s = RunStep(request, response);
    stats_[kDecodeStream].Record(MicrosSince(start), !s.ok());
    if (!s.ok()) {
      spdlog::debug("DecodeStream step {}: {}", request.step_id(), s.ToString());
      return ToGrpcStatus(s);
    }
    if (!stream->Write(response)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status IndexerService::GetStatistics(grpc::ServerContext*, const v1::GetStatisticsRequest*,
                                           v1::Statistics* response) {
  const auto start = Clock::now();
  for (int m = 0; m < kNumMethods; ++m) {
    v1::RpcStatistics* r = response->add_rpcs();
    r->set_method(MethodName(static_cast<Method>(m)));
    stats_[m].Fill(*r);
  }
  const exec::ExecutorStatus st = executor_.Status();
  response->set_steps(st.steps);
  response->set_steps_sharded(st.steps_sharded);
  response->set_steps_unsharded(st.steps_unsharded);
  int64_t total = 0, free = 0;
  for (const exec::CachePoolStatus& c : st.caches) {
    total += c.pages_total;
    free += c.pages_free;
  }
  response->set_pages_total(total);
  response->set_pages_in_use(total - free);
  response->set_rows_scored(st.rows_scored);
  response->set_queue_us_total(st.queue_us_total);
  response->set_compute_us_total(st.compute_us_total);
  response->set_sequences(st.sequences);
  stats_[kGetStatistics].Record(MicrosSince(start), false);
  return grpc::Status::OK;
}

}  // namespace decode_indexer::service
