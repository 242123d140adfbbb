#include "client/load/runner.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <latch>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/fast_path.h"
#include "client/indexer_client.h"
#include "client/load/server_model.h"
#include "client/load/verify.h"
#include "client/tensor.h"
#include "decode_indexer/v1/indexer.grpc.pb.h"

namespace decode_indexer::load {
namespace {

using Clock = std::chrono::steady_clock;
using Stream = grpc::ClientReaderWriter<v1::DecodeStepRequest, v1::DecodeStepResponse>;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

absl::Status FromGrpc(const grpc::Status& status, const std::string& what) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

// Counters the progress line reads while workers run, and a log-bucketed histogram of step
// latencies (four buckets an octave from 1 us) for its percentiles.
struct Live {
  static constexpr int kBuckets = 128;
  std::atomic<uint64_t> steps{0};
  std::atomic<uint64_t> failed{0};
  std::atomic<uint64_t> rpcs{0};
  std::atomic<uint64_t> step_us_total{0};
  std::array<std::atomic<uint64_t>, kBuckets> step_buckets{};

  static int Bucket(double us) {
    const int b = us <= 1.0 ? 0 : static_cast<int>(std::ceil(4.0 * std::log2(us)));
    return std::clamp(b, 0, kBuckets - 1);
  }
  static double BucketUpperUs(int b) { return std::exp2(b / 4.0); }
};

// The q-quantile of a bucket histogram (bucket upper bounds, in us).
double BucketQuantileUs(const std::array<uint64_t, Live::kBuckets>& counts, double q) {
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  if (total == 0) return 0;
  const uint64_t rank = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * total)));
  uint64_t seen = 0;
  for (int b = 0; b < Live::kBuckets; ++b) {
    seen += counts[b];
    if (seen >= rank) return Live::BucketUpperUs(b);
  }
  return Live::BucketUpperUs(Live::kBuckets - 1);
}

// The routing key every call of a worker carries: its first sequence's id, for all of its
// sequences, so that a balancer hashing on the header puts a worker's sequences on one
// replica and its batches stay replica-affine.
void AddSequenceId(grpc::ClientContext* context, uint64_t sequence_id) {
  context->AddMetadata(kSequenceIdKey, std::to_string(sequence_id));
}

// Where a step's tensors lie in a worker's shared-memory region (--shared-memory), sized for
// the largest step of the plan. Offsets are 64-byte aligned.
struct RegionLayout {
  uint64_t q = 0, q_scales = 0, weights = 0, answer = 0, candidates = 0;
  uint64_t size = 0;
};

RegionLayout LayoutRegion(const LoadOptions& o, const ServerModel& model) {
  const uint64_t rows = uint64_t(o.requests_per_step) * o.next_n;
  const uint64_t elems = rows * model.num_heads * model.head_dim;
  // fp32 q is 4 bytes an element; FP8 codes one, packed FP4 half of one.
  const uint64_t q_bytes = o.q_format == PayloadFormat::kFp32 ? elems * 4 : elems;
  RegionLayout layout;
  uint64_t at = 0;
  auto take = [&](uint64_t bytes) {
    const uint64_t offset = at;
    at += (bytes + 63) / 64 * 64;
    return offset;
  };
  layout.q = take(q_bytes);
  layout.q_scales = take(elems / 32);
  layout.weights = take(rows * model.num_heads * sizeof(float));
  layout.answer = take(rows * model.topk * sizeof(int32_t));
  layout.candidates =
      take(rows * static_cast<uint64_t>(std::max(0, model.num_candidate_blocks)) * 4);
  layout.size = std::max<uint64_t>(at, 64);
  return layout;
}

struct Sequence {
  uint64_t id = 0;
  int64_t length = 0;  // entries in the first cache, for positions and row lengths
  // --draft-reject: where this token step writes its keys (the previous step's accepted
  // length), -1 before the first step (append).
  int64_t write_at = -1;
};

struct Worker {
  int32_t index = 0;
  std::unique_ptr<v1::DecodeIndexer::Stub> stub;
  std::vector<Sequence> sequences;
  std::mt19937_64 rng;
  std::unique_ptr<Verifier> verifier;  // null unless it tracks sequences
  uint64_t verify_steps = 0;
  Samples samples;
  VerifyCounts verify;
  std::unique_ptr<grpc::ClientContext> stream_context;
  std::unique_ptr<Stream> stream;
  std::vector<v1::DecodeStepRequest> requests;  // one per layer, reused every step
  // --shared-memory: the region (unlinked on destruction) and its server-side id.
  std::unique_ptr<client::SharedMemory> shm;
  uint64_t region_id = 0;
  bool region_registered = false;
  // Bytes of q, q_scales and weights the current step put in the region (for --verify).
  size_t region_bytes[3] = {0, 0, 0};
  // --fast-path: the worker's control client and its step ring.
  std::unique_ptr<client::IndexerClient> control;
  std::unique_ptr<client::FastPathRing> ring;
  uint64_t next_step_id = 0;
  int failures_in_a_row = 0;  // for the backoff
  Clock::time_point last_done;
  absl::Status fatal;  // set when prefill fails
};

class LoadRun {
 public:
  LoadRun(const LoadOptions& options, ServerModel model, PayloadPool pool)
      : options_(options),
        model_(std::move(model)),
        pool_(std::move(pool)),
        layout_(LayoutRegion(options_, model_)) {}

  // --shared-memory: creates the worker's region and registers it with the server.
  // --fast-path: the worker's step ring, with room for its biggest step's data.
  absl::Status SetUpFastPath(Worker& w) {
    client::ClientOptions co;
    co.auth_token = options_.channel.bearer_token;
    absl::StatusOr<std::unique_ptr<client::IndexerClient>> control =
        client::IndexerClient::Connect(options_.channel.target, co);
    if (!control.ok()) return control.status();
    w.control = *std::move(control);
    client::FastPathOptions fo;
    // q (fp32 at most) + weights + positions + keys (fp32 at most) + answer + candidates.
    const uint64_t rows = uint64_t(options_.requests_per_step) * options_.next_n;
    fo.data_bytes =
        rows * (uint64_t(model_.num_heads) * model_.head_dim * 4 + uint64_t(model_.num_heads) * 8 +
                8 + uint64_t(model_.head_dim) * 4 + 8 + uint64_t(model_.topk) * 4 +
                uint64_t(std::max(0, model_.num_candidate_blocks)) * 4) +
        (1 << 16);
    fo.slot_bytes = 16384;
    while (fo.slot_bytes < (1u << 20) &&
           uint64_t(fo.slot_bytes) < 512 + uint64_t(options_.requests_per_step) * 64) {
      fo.slot_bytes *= 2;
    }
    absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring =
        client::FastPathRing::Create(*w.control, fo);
    if (!ring.ok()) {
      return absl::Status(ring.status().code(),
                          absl::StrCat("--fast-path (the server must run on this host with "
                                       "--shm-socket): ",
                                       ring.status().message()));
    }
    w.ring = *std::move(ring);
    return absl::OkStatus();
  }

  absl::Status SetUpSharedMemory(Worker& w) {
    if (options_.fast_path) return SetUpFastPath(w);
    if (!options_.shared_memory) return absl::OkStatus();
    // pid + worker + seed bits: unique on this host even next to a stale object left by a
    // killed run with a recycled pid.
    const std::string name = absl::StrCat("/di-load-", getpid(), "-", w.index, "-",
                                          absl::Hex(options_.seed & 0xffffffffu));
    auto shm = client::SharedMemory::Create(name.substr(1), layout_.size);
    if (!shm.ok()) return shm.status();
    w.shm = *std::move(shm);
    // The region is a sealed memfd handed over the server's shm socket (ServerInfo says
    // where; the server must run on this host).
    grpc::ClientContext context;
    PrepareContext(options_.channel, &context);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ServerInfo info;
    grpc::Status status = w.stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
    if (!status.ok()) return FromGrpc(status, "GetServerInfo");
    if (info.shm_socket().empty()) {
      return absl::FailedPreconditionError(
          "--shared-memory: the server has no --shm-socket (ServerInfo.shm_socket is empty)");
    }
    absl::StatusOr<uint64_t> region =
        client::RegisterMemfd(info.shm_socket(), w.shm->fd(), layout_.size);
    if (!region.ok()) {
      return absl::Status(region.status().code(),
                          absl::StrCat("registering shared memory over ", info.shm_socket(),
                                       " (--shared-memory needs the server on this host): ",
                                       region.status().message()));
    }
    w.region_id = *region;
    w.region_registered = true;
    return absl::OkStatus();
  }

  void TearDownSharedMemory(Worker& w) {
    if (w.ring) {
      w.ring->Unregister().IgnoreError();
      w.ring.reset();
      w.control.reset();
    }
    if (w.region_registered) {
      grpc::ClientContext context;
      PrepareContext(options_.channel, &context);
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::UnregisterSharedMemoryRequest request;
      request.set_region_id(w.region_id);
      v1::UnregisterSharedMemoryResponse response;
      w.stub->UnregisterSharedMemory(&context, request, &response);  // best effort
      w.region_registered = false;
    }
    w.shm.reset();
  }

  absl::Status Prefill(Worker& w) {
    std::uniform_real_distribution<double> spread(1.0 - options_.context_spread,
                                                  1.0 + options_.context_spread);
    for (Sequence& seq : w.sequences) {
      {
        grpc::ClientContext context;
        PrepareContext(options_.channel, &context);
        AddSequenceId(&context, w.sequences.front().id);
        v1::CreateSequenceRequest request;
        request.set_sequence_id(seq.id);
        v1::CreateSequenceResponse response;
        grpc::Status status = w.stub->CreateSequence(&context, request, &response);
        if (!status.ok()) {
          return FromGrpc(status, absl::StrCat("CreateSequence ", seq.id));
        }
      }
      const int64_t length =
          std::max<int64_t>(1, std::llround(double(options_.context) * spread(w.rng)));
      for (int32_t layer : model_.cache_layers) {
        const v1::CacheFormat format = FormatOf(layer);
        for (int64_t done = 0; done < length; done += options_.prefill_chunk) {
          const int32_t n =
              static_cast<int32_t>(std::min<int64_t>(options_.prefill_chunk, length - done));
          grpc::ClientContext context;
          PrepareContext(options_.channel, &context);
          AddSequenceId(&context, w.sequences.front().id);
          v1::AppendKeysRequest request;
          request.set_sequence_id(seq.id);
          request.set_layer(layer);
          FillKeys(pool_, w.rng, model_, format, options_.key_format, n, request.mutable_keys(),
                   request.mutable_key_scales());
          v1::AppendKeysResponse response;
          grpc::Status status = w.stub->AppendKeys(&context, request, &response);
          if (!status.ok()) {
            return FromGrpc(status, absl::StrCat("AppendKeys sequence ", seq.id, " layer ", layer));
          }
          if (w.verifier && w.verifier->Tracks(seq.id)) {
            absl::Status s =
                w.verifier->AppendKeys(seq.id, layer, request.keys(), request.key_scales());
            if (!s.ok()) return s;
          }
        }
      }
      seq.length = length;
    }
    return absl::OkStatus();
  }

  // One token step through every layer of the plan; false when an RPC failed.
  bool TokenStep(Worker& w, bool measured, Clock::time_point intended_start) {
    const bool verifying = w.verifier != nullptr;
    bool score = false;
    if (verifying) {
      w.verifier->BeginTokenStep();
      score = w.verify_steps++ % std::max(1, options_.verify_every) == 0;
    }
    const int32_t rows_per_seq = options_.next_n;
    const int32_t rows = rows_per_seq * static_cast<int32_t>(w.sequences.size());
    if (options_.draft_reject > 0) {
      // The previous step's drafts were judged: write this step's keys after the accepted ones
      // (position < length when a draft was rejected: the server rolls it back).
      for (Sequence& seq : w.sequences) {
        if (seq.write_at < 0) continue;
        int64_t accepted = 1;  // the first row's token is not a draft
        std::uniform_real_distribution<double> u(0.0, 1.0);
        while (accepted < options_.next_n && u(w.rng) >= options_.draft_reject) ++accepted;
        seq.write_at = seq.length - options_.next_n + accepted;
        if (measured) {
          w.samples.drafts_rejected += options_.next_n - accepted;
          w.samples.drafts += options_.next_n - 1;
        }
      }
    }
    for (size_t li = 0; li < model_.plan.size(); ++li) {
      const LayerStep& layer = model_.plan[li];
      v1::DecodeStepRequest& request = w.requests[li];
      grpc::Status status = BuildStep(w, layer, rows, verifying && score, &request);

      // What crosses gRPC (shared-memory bytes do not), before anything is decoded.
      const size_t request_bytes = w.ring ? 0 : request.ByteSizeLong();
      v1::DecodeStepResponse response;
      const Clock::time_point sent = Clock::now();
      if (status.ok()) status = Call(w, request, &response);
      const size_t response_bytes = w.ring ? 0 : response.ByteSizeLong();
      // A delta answer is decoded before the clock stops: a frontend can use it only then.
      if (status.ok()) status = DecodeDeltaAnswer(&response);
      const Clock::time_point answered = Clock::now();
      if (status.ok()) status = CheckShape(request, response, rows);
      // The verifier reads the tensors from the messages: copy the region's bytes back in.
      if (status.ok() && w.verifier && request.has_shared_memory()) {
        RestoreFromRegion(w, &request, &response, rows);
      }
      if (!status.ok()) {
        if (measured) {
          w.samples.rpcs_failed++;
          w.samples.steps_failed++;
          w.samples.errors[StatusCodeName(status.error_code())]++;
        }
        live_.failed++;
        LogFirstError(status);
        if (verifying) {
          // The server may or may not have taken the step's keys: the mirror is stale.
          w.verifier.reset();
          w.verify.groups_abandoned++;
        }
        return false;
      }
      live_.rpcs++;
      if (measured) {
        Samples& s = w.samples;
        const double us = Micros(answered - sent);
        s.rpc_us[RoleName(layer.role)].push_back(us);
        s.rows += rows;
        s.request_bytes += request_bytes;
        s.response_bytes += response_bytes;
        s.server_queue_us += double(response.timing().queue_us());
        s.server_compute_us += double(response.timing().compute_us());
        s.client_rpc_us += us;
        s.timed_rpcs++;
        if (response.sharded()) s.sharded_rpcs++;
      }
      if (layer.owns_cache && layer.layer == model_.cache_layers.front()) {
        for (int i = 0; i < response.lengths_size(); ++i) {
          w.sequences[i].length = response.lengths(i);
        }
      }
      if (li + 1 == model_.plan.size() && options_.draft_reject > 0) {
        for (Sequence& seq : w.sequences) seq.write_at = seq.length;
      }
      if (w.verifier) {
        absl::Status s = w.verifier->CheckStep(request, response, score, &w.verify);
        if (!s.ok()) {
          LogFirstError(grpc::Status(grpc::StatusCode::INTERNAL, s.ToString()));
          w.verifier.reset();
          w.verify.groups_abandoned++;
        }
      }
    }
    const Clock::time_point done = Clock::now();
    w.last_done = done;
    live_.steps++;
    live_.step_us_total += static_cast<uint64_t>(Micros(done - intended_start));
    live_.step_buckets[Live::Bucket(Micros(done - intended_start))]++;
    if (measured) w.samples.step_us.push_back(Micros(done - intended_start));
    return true;
  }

  void ClosedLoop(Worker& w) {
    while (true) {
      const int64_t ticket = tickets_.fetch_add(1);
      const bool measured = ticket >= warmup_;
      if (measured) {
        MarkMeasureStart();
        if (options_.steps > 0 && ticket >= warmup_ + options_.steps) return;
        if (options_.duration_s > 0 && Clock::now() >= MeasureEnd()) return;
      }
      const Clock::time_point start = Clock::now();
      if (!TokenStep(w, measured, start)) {
        Backoff(w, measured);
      } else {
        w.failures_in_a_row = 0;
      }
    }
  }

  // Waits after a failed step (see BackoffDelayMs), never past the measured window's end.
  void Backoff(Worker& w, bool measured) {
    ++w.failures_in_a_row;
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const double ms = BackoffDelayMs(w.failures_in_a_row, options_.backoff_initial_ms,
                                     options_.backoff_max_ms, unit(w.rng));
    if (ms <= 0) return;
    Clock::time_point until =
        Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1e3));
    if (options_.duration_s > 0 && measure_started()) until = std::min(until, MeasureEnd());
    std::this_thread::sleep_until(until);
    if (measured) {
      w.samples.backoff_waits++;
      w.samples.backoff_ms += ms;
    }
  }

  void OpenLoop(Worker& w) {
    while (true) {
      int64_t index;
      Clock::time_point intended;
      {
        std::lock_guard<std::mutex> lock(schedule_mu_);
        index = schedule_index_++;
        intended = schedule_next_;
        schedule_next_ += NextGap();
      }
      const bool measured = index >= warmup_;
      if (measured) {
        MarkMeasureStart(intended);
        if (options_.steps > 0 && index >= warmup_ + options_.steps) return;
        if (options_.duration_s > 0 && intended >= MeasureEnd()) return;
      }
      std::this_thread::sleep_until(intended);
      const double lag = Micros(Clock::now() - intended);
      // A start more than a millisecond behind schedule had to wait for a free worker.
      if (measured && lag > 1000) w.samples.late_starts++;
      if (measured) w.samples.max_start_lag_us = std::max(w.samples.max_start_lag_us, lag);
      if (!TokenStep(w, measured, intended)) {
        Backoff(w, measured);
      } else {
        w.failures_in_a_row = 0;
      }
    }
  }

  void StartSchedule() {
    schedule_next_ = Clock::now();
    schedule_rng_.seed(options_.seed ^ 0x5bd1e995u);
  }

  void set_warmup(int64_t warmup) { warmup_ = warmup; }
  Live& live() { return live_; }
  Clock::time_point measure_start() const { return measure_start_.load(); }
  bool measure_started() const { return measure_started_.load(); }

  void ReleaseAll(Worker& w) {
    for (const Sequence& seq : w.sequences) {
      grpc::ClientContext context;
      PrepareContext(options_.channel, &context);
      AddSequenceId(&context, w.sequences.front().id);
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::ReleaseSequenceRequest request;
      request.set_sequence_id(seq.id);
      v1::ReleaseSequenceResponse response;
      w.stub->ReleaseSequence(&context, request, &response);  // best effort
    }
  }

  void CloseStream(Worker& w) {
    if (!w.stream) return;
    w.stream->WritesDone();
    w.stream->Finish();
    w.stream.reset();
    w.stream_context.reset();
  }

  std::string first_error() {
    std::lock_guard<std::mutex> lock(error_mu_);
    return first_error_;
  }

 private:
  v1::CacheFormat FormatOf(int32_t layer) const {
    for (const LayerStep& step : model_.plan) {
      if (step.layer == layer) return step.format;
    }
    return v1::CACHE_FORMAT_FP8;
  }

  grpc::Status BuildStep(Worker& w, const LayerStep& layer, int32_t rows, bool want_candidates,
                         v1::DecodeStepRequest* request) {
    request->set_layer(layer.layer);
    request->set_answer_encoding(options_.answer_encoding);
    if (options_.streaming && options_.deadline_ms > 0) {
      // At least 1 us: 0 would mean no deadline at all.
      request->set_timeout_us(std::max<int64_t>(1, std::llround(options_.deadline_ms * 1e3)));
    }
    request->set_step_id((uint64_t(w.index) << 40) | w.next_step_id++);
    request->set_return_candidates(want_candidates && layer.role == Role::kSource);
    const int n = static_cast<int>(w.sequences.size());
    if (options_.columnar) {
      BuildColumnar(w, layer, request);
    } else {
      BuildSequences(w, layer, request);
    }
    FillQuery(pool_, w.rng, model_, layer.format, options_.q_format, rows, request);
    if (options_.positions) {
      v1::Tensor* positions = request->mutable_positions();
      positions->set_dtype(v1::DTYPE_INT64);
      positions->clear_shape();
      positions->add_shape(rows);
      std::string* data = positions->mutable_data();
      data->resize(size_t(rows) * sizeof(int64_t));
      int64_t* out = reinterpret_cast<int64_t*>(data->data());
      for (int i = 0; i < n; ++i) {
        // The new tokens follow the sequence's current (accepted) length.
        const int64_t first =
            w.sequences[i].write_at >= 0 ? w.sequences[i].write_at : w.sequences[i].length;
        for (int j = 0; j < options_.next_n; ++j) *out++ = first + j;
      }
    } else {
      request->clear_positions();
    }
    if (w.shm) return MoveToRegion(w, request);
    request->clear_shared_memory();
    return grpc::Status::OK;
  }

  // A SequenceStep per request, each with its next_n keys at cache-owning layers.
  void BuildSequences(Worker& w, const LayerStep& layer, v1::DecodeStepRequest* request) {
    const int n = static_cast<int>(w.sequences.size());
    while (request->sequences_size() < n) request->add_sequences();
    for (int i = 0; i < n; ++i) {
      v1::SequenceStep* seq = request->mutable_sequences(i);
      seq->set_sequence_id(w.sequences[i].id);
      seq->set_num_rows(options_.next_n);
      if (layer.owns_cache) {
        FillKeys(pool_, w.rng, model_, layer.format, options_.key_format, options_.next_n,
                 seq->mutable_new_keys(), seq->mutable_new_key_scales());
      } else {
        seq->clear_new_keys();
        seq->clear_new_key_scales();
      }
      if (layer.owns_cache && w.sequences[i].write_at >= 0) {
        seq->set_new_keys_position(w.sequences[i].write_at);
      } else {
        seq->clear_new_keys_position();
      }
    }
  }

  // --columnar: the requests as columns, their keys (next_n a request, one a row) stacked
  // into one tensor, the rollback positions as one column (-1: append).
  void BuildColumnar(Worker& w, const LayerStep& layer, v1::DecodeStepRequest* request) {
    request->clear_sequence_ids();
    for (const Sequence& seq : w.sequences) request->add_sequence_ids(seq.id);
    request->set_rows_per_sequence(options_.next_n);
    request->clear_new_keys_positions();
    if (!layer.owns_cache) {
      request->clear_new_keys();
      request->clear_new_key_scales();
      return;
    }
    const int32_t keys = options_.next_n * static_cast<int32_t>(w.sequences.size());
    FillKeys(pool_, w.rng, model_, layer.format, options_.key_format, keys,
             request->mutable_new_keys(), request->mutable_new_key_scales());
    bool any_position = false;
    for (const Sequence& seq : w.sequences) any_position = any_position || seq.write_at >= 0;
    if (any_position) {
      for (const Sequence& seq : w.sequences) request->add_new_keys_positions(seq.write_at);
    }
  }

  // --shared-memory: q, q_scales and weights leave the request for the worker's region (the
  // request keeps dtype and shape); the answer and candidate blocks will be written there.
  grpc::Status MoveToRegion(Worker& w, v1::DecodeStepRequest* request) {
    const uint64_t limits[3] = {layout_.q_scales - layout_.q, layout_.weights - layout_.q_scales,
                                layout_.answer - layout_.weights};
    const uint64_t offsets[3] = {layout_.q, layout_.q_scales, layout_.weights};
    v1::Tensor* tensors[3] = {request->mutable_q(),
                              request->has_q_scales() ? request->mutable_q_scales() : nullptr,
                              request->mutable_weights()};
    for (int i = 0; i < 3; ++i) {
      w.region_bytes[i] = 0;
      if (tensors[i] == nullptr) continue;
      std::string* data = tensors[i]->mutable_data();
      if (data->size() > limits[i]) {
        return grpc::Status(grpc::StatusCode::INTERNAL,
                            absl::StrCat("shared memory: ", data->size(), " bytes do not fit ",
                                         limits[i], " of the region layout"));
      }
      std::memcpy(w.shm->data() + offsets[i], data->data(), data->size());
      w.region_bytes[i] = data->size();
      data->clear();  // keeps the capacity for the next step's payload
    }
    v1::SharedMemoryStep* sm = request->mutable_shared_memory();
    sm->set_region_id(w.region_id);
    sm->set_q_offset(layout_.q);
    sm->set_q_scales_offset(layout_.q_scales);
    sm->set_weights_offset(layout_.weights);
    sm->set_answer_offset(layout_.answer);
    sm->set_candidates_offset(layout_.candidates);
    return grpc::Status::OK;
  }

  // The inverse for --verify: the request's tensors and the response's answer get their
  // bytes from the region again (the next step's BuildStep overwrites them anyway).
  void RestoreFromRegion(Worker& w, v1::DecodeStepRequest* request,
                         v1::DecodeStepResponse* response, int32_t rows) const {
    const uint8_t* base = w.shm->data();
    request->mutable_q()->set_data(base + layout_.q, w.region_bytes[0]);
    if (request->has_q_scales()) {
      request->mutable_q_scales()->set_data(base + layout_.q_scales, w.region_bytes[1]);
    }
    request->mutable_weights()->set_data(base + layout_.weights, w.region_bytes[2]);
    response->mutable_topk()->set_data(base + layout_.answer,
                                       size_t(rows) * model_.topk * sizeof(int32_t));
    if (response->has_candidate_blocks()) {
      response->mutable_candidate_blocks()->set_data(
          base + layout_.candidates, size_t(rows) * model_.num_candidate_blocks * sizeof(int32_t));
    }
  }

  // ANSWER_ENCODING_DELTA_VARINT: the positions into topk's bytes, as a raw answer has them.
  static grpc::Status DecodeDeltaAnswer(v1::DecodeStepResponse* response) {
    if (response->topk_delta().empty()) return grpc::Status::OK;
    const v1::Tensor& topk = response->topk();
    if (topk.shape_size() != 2 || !topk.data().empty()) {
      return grpc::Status(grpc::StatusCode::DATA_LOSS,
                          "topk_delta with a topk that is not shape-only [rows, k]");
    }
    absl::StatusOr<std::vector<int32_t>> positions =
        client::DecodeTopkDelta(response->topk_delta(), topk.shape(0), topk.shape(1));
    if (!positions.ok()) {
      return grpc::Status(grpc::StatusCode::DATA_LOSS, std::string(positions.status().message()));
    }
    response->mutable_topk()->set_data(positions->data(), positions->size() * sizeof(int32_t));
    response->clear_topk_delta();
    return grpc::Status::OK;
  }

  grpc::Status Call(Worker& w, const v1::DecodeStepRequest& request,
                    v1::DecodeStepResponse* response) {
    if (w.ring) {
      // The tensors are copied into the ring's data area, the answer comes back from it.
      absl::StatusOr<v1::DecodeStepResponse> got = w.ring->StepRequest(request);
      if (!got.ok()) {
        return grpc::Status(static_cast<grpc::StatusCode>(got.status().code()),
                            std::string(got.status().message()));
      }
      *response = *std::move(got);
      return grpc::Status::OK;
    }
    if (!options_.streaming) {
      grpc::ClientContext context;
      PrepareContext(options_.channel, &context);
      // A batch is replica-affine: routed by its first sequence.
      if (request.sequences_size() > 0) {
        AddSequenceId(&context, request.sequences(0).sequence_id());
      } else if (request.sequence_ids_size() > 0) {
        AddSequenceId(&context, request.sequence_ids(0));
      }
      if (options_.deadline_ms > 0) {
        context.set_deadline(
            std::chrono::system_clock::now() +
            std::chrono::microseconds(static_cast<int64_t>(options_.deadline_ms * 1e3)));
      }
      return w.stub->DecodeStep(&context, request, response);
    }
    if (!w.stream) {
      w.stream_context = std::make_unique<grpc::ClientContext>();
      PrepareContext(options_.channel, w.stream_context.get());
      // A stream is routed once, at its start: by the worker's first sequence (every step of
      // the stream must name sequences of that one replica).
      if (!w.sequences.empty()) AddSequenceId(w.stream_context.get(), w.sequences[0].id);
      w.stream = w.stub->DecodeStream(w.stream_context.get());
    }
    if (w.stream->Write(request) && w.stream->Read(response)) return grpc::Status::OK;
    // The stream ended: its status says why; the next step opens a new one.
    w.stream->WritesDone();
    grpc::Status status = w.stream->Finish();
    w.stream.reset();
    w.stream_context.reset();
    if (status.ok()) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream closed without an answer");
    }
    return status;
  }

  grpc::Status CheckShape(const v1::DecodeStepRequest& request,
                          const v1::DecodeStepResponse& response, int32_t rows) const {
    const v1::Tensor& topk = response.topk();
    // Through shared memory the answer is in the region and topk carries its shape only.
    const size_t want =
        request.has_shared_memory() ? 0 : size_t(rows) * model_.topk * sizeof(int32_t);
    const bool shape_ok =
        topk.shape_size() == 2 && topk.shape(0) == rows && topk.shape(1) == model_.topk;
    if (response.step_id() != request.step_id() || !shape_ok || topk.data().size() != want ||
        response.lengths_size() !=
            std::max(request.sequences_size(), request.sequence_ids_size())) {
      return grpc::Status(grpc::StatusCode::DATA_LOSS,
                          absl::StrCat("malformed answer to step ", request.step_id(), ": ",
                                       topk.data().size(), " topk bytes, expected ", want));
    }
    return grpc::Status::OK;
  }

  void LogFirstError(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (first_error_.empty()) {
      first_error_ =
          absl::StrCat(StatusCodeName(status.error_code()), ": ", status.error_message());
    }
  }

  Clock::duration NextGap() {
    double seconds = 1.0 / options_.rate;
    if (options_.poisson)
      seconds = std::exponential_distribution<double>(options_.rate)(schedule_rng_);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }

  void MarkMeasureStart(Clock::time_point at = Clock::now()) {
    bool expected = false;
    if (measure_started_.compare_exchange_strong(expected, true)) measure_start_.store(at);
  }
  Clock::time_point MeasureEnd() const {
    return measure_start_.load() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options_.duration_s));
  }

  const LoadOptions& options_;
  const ServerModel model_;
  const PayloadPool pool_;
  const RegionLayout layout_;
  Live live_;
  int64_t warmup_ = 0;
  std::atomic<int64_t> tickets_{0};
  std::atomic<bool> measure_started_{false};
  std::atomic<Clock::time_point> measure_start_{Clock::time_point{}};
  std::mutex schedule_mu_;
  int64_t schedule_index_ = 0;
  Clock::time_point schedule_next_;
  std::mt19937_64 schedule_rng_;
  std::mutex error_mu_;
  std::string first_error_;
};

nlohmann::json StatisticsJson(const v1::Statistics& s) {
  nlohmann::json rpcs = nlohmann::json::object();
  for (const v1::RpcStatistics& r : s.rpcs()) {
    rpcs[r.method()] = {
        {"count", r.count()}, {"errors", r.errors()}, {"latency_us_total", r.latency_us_total()}};
  }
  return {{"steps", s.steps()},
          {"steps_sharded", s.steps_sharded()},
          {"rows_scored", s.rows_scored()},
          {"queue_us_total", s.queue_us_total()},
          {"compute_us_total", s.compute_us_total()},
          {"rpcs", rpcs}};
}

// after - before, field by field (counts and totals only).
nlohmann::json StatisticsDelta(const nlohmann::json& before, const nlohmann::json& after) {
  nlohmann::json delta = after;
  for (const char* key : {"steps", "steps_sharded", "rows_scored"}) {
    delta[key] = after[key].get<uint64_t>() - before[key].get<uint64_t>();
  }
  for (const char* key : {"queue_us_total", "compute_us_total"}) {
    delta[key] = after[key].get<double>() - before[key].get<double>();
  }
  for (auto& [method, r] : delta["rpcs"].items()) {
    if (!before["rpcs"].contains(method)) continue;
    const auto& b = before["rpcs"][method];
    r["count"] = r["count"].get<uint64_t>() - b["count"].get<uint64_t>();
    r["errors"] = r["errors"].get<uint64_t>() - b["errors"].get<uint64_t>();
    r["latency_us_total"] =
        r["latency_us_total"].get<double>() - b["latency_us_total"].get<double>();
    const double count = r["count"].get<double>();
    r["latency_us_mean"] = count > 0 ? r["latency_us_total"].get<double>() / count : 0.0;
  }
  return delta;
}

absl::StatusOr<nlohmann::json> FetchStatistics(v1::DecodeIndexer::Stub& stub,
                                               const ChannelConfig& channel) {
  grpc::ClientContext context;
  PrepareContext(channel, &context);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::Statistics stats;
  grpc::Status status = stub.GetStatistics(&context, v1::GetStatisticsRequest(), &stats);
  if (!status.ok()) return FromGrpc(status, "GetStatistics");
  return StatisticsJson(stats);
}

absl::Status CheckOptions(const LoadOptions& o) {
  if (o.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be >= 1");
  if (o.channels < 1) return absl::InvalidArgumentError("--channels must be >= 1");
  if (o.requests_per_step < 1) {
    return absl::InvalidArgumentError("--requests-per-step must be >= 1");
  }
  if (o.next_n < 1) return absl::InvalidArgumentError("--next-n must be >= 1");
  if (o.draft_reject < 0 || o.draft_reject > 1) {
    return absl::InvalidArgumentError("--draft-reject must be in [0, 1]");
  }
  if (o.draft_reject > 0 && o.next_n < 2) {
    return absl::InvalidArgumentError("--draft-reject needs --next-n >= 2 (drafts to reject)");
  }
  if (o.context < 1) return absl::InvalidArgumentError("--context must be >= 1");
  if (o.context_spread < 0 || o.context_spread >= 1) {
    return absl::InvalidArgumentError("--context-spread must be in [0, 1)");
  }
  if ((o.steps > 0) == (o.duration_s > 0)) {
    return absl::InvalidArgumentError("give exactly one of --steps and --duration");
  }
  if (o.rate < 0) return absl::InvalidArgumentError("--rate must be >= 0");
  if (o.positions && o.q_format != PayloadFormat::kFp32) {
    return absl::InvalidArgumentError("--positions needs --q-format fp32 (RoPE before quant)");
  }
  if (o.verify && o.positions) {
    return absl::InvalidArgumentError(
        "--verify cannot mirror the server's RoPE (its frequencies are not in ServerInfo); "
        "drop --positions");
  }
  if (o.prefill_chunk < 1) return absl::InvalidArgumentError("--prefill-chunk must be >= 1");
  if (o.shared_memory && o.answer_encoding != v1::ANSWER_ENCODING_RAW) {
    return absl::InvalidArgumentError(
        "--answer-encoding delta has no effect with --shared-memory (the server writes the "
        "answer into the region as int32)");
  }
  if (o.deadline_ms < 0) return absl::InvalidArgumentError("--deadline must be >= 0");
  if (o.fast_path && (o.shared_memory || o.streaming)) {
    return absl::InvalidArgumentError(
        "--fast-path is its own path: drop --shared-memory / --streaming");
  }
  if (o.fast_path && o.answer_encoding != v1::ANSWER_ENCODING_RAW) {
    return absl::InvalidArgumentError("--fast-path answers int32 (--answer-encoding raw)");
  }
  if (o.fast_path && !o.channel.tls_ca.empty()) {
    return absl::InvalidArgumentError(
        "--fast-path: use the server's plaintext address (same host)");
  }
  return absl::OkStatus();
}

}  // namespace

double BackoffDelayMs(int failures, double initial_ms, double max_ms, double jitter) {
  if (failures <= 0 || initial_ms <= 0 || max_ms <= 0) return 0;
  const double ceiling = std::min(max_ms, initial_ms * std::exp2(std::min(failures - 1, 60)));
  return ceiling * (0.5 + 0.5 * std::clamp(jitter, 0.0, 1.0));
}

absl::StatusOr<Report> RunLoad(const LoadOptions& options_in) {
  LoadOptions options = options_in;
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  if (options.fast_path) options.columnar = true;  // a descriptor is the columnar form
  if (options.seed == 0) {
    options.seed = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  }
  std::mt19937_64 seeder(options.seed);
  if (options.sequence_id_base == 0) {
    // High bits random so that runs sharing a server do not collide.
    options.sequence_id_base = (seeder() | 1) << 20;
  }

  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int32_t i = 0; i < options.channels; ++i) {
    ChannelConfig config = options.channel;
    config.channel_index = i;
    auto channel = MakeChannel(config);
    if (!channel.ok()) return channel.status();
    channels.push_back(*std::move(channel));
  }
  auto control = v1::DecodeIndexer::NewStub(channels[0]);

  v1::ServerInfo info;
  {
    grpc::ClientContext context;
    PrepareContext(options.channel, &context);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status status = control->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
    if (!status.ok()) {
      return FromGrpc(status, absl::StrCat("GetServerInfo from ", options.channel.target));
    }
  }
  auto model = BuildServerModel(info, options.max_layers);
  if (!model.ok()) return model.status();
  if (info.max_rows_per_sequence() > 0 && options.next_n > info.max_rows_per_sequence()) {
    return absl::InvalidArgumentError(absl::StrCat("--next-n ", options.next_n,
                                                   " exceeds the server's max_rows_per_sequence ",
                                                   info.max_rows_per_sequence()));
  }
  // Refuse a run that cannot fit: every cache pool holds every sequence's prefill.
  const int64_t sequences = int64_t{options.concurrency} * options.requests_per_step;
  const int64_t longest = std::llround(double(options.context) * (1 + options.context_spread));
  const int64_t pages_each = (longest + model->page_size - 1) / model->page_size + 1;
  const int64_t pools = std::max<int64_t>(1, info.caches_size());
  const int64_t pool_pages = info.pages_total() / pools;
  if (pool_pages > 0 && sequences * pages_each > pool_pages) {
    return absl::ResourceExhaustedError(
        absl::StrCat(sequences, " sequences of up to ", longest, " entries need about ",
                     sequences * pages_each, " pages per cache; the server has ", pool_pages,
                     " (raise --cache-pages on the server or lower --context/--concurrency)"));
  }

  const size_t q_bytes =
      size_t(options.requests_per_step) * options.next_n * model->num_heads * model->head_dim * 4;
  PayloadPool pool(seeder(), std::max<size_t>(q_bytes + (1 << 20), 4 << 20));
  LoadRun run(options, *model, std::move(pool));
  run.set_warmup(options.warmup_steps >= 0 ? options.warmup_steps : options.concurrency);

  std::vector<std::unique_ptr<Worker>> workers;
  int32_t tracked = 0;
  for (int32_t i = 0; i < options.concurrency; ++i) {
    auto w = std::make_unique<Worker>();
    w->index = i;
    w->stub = v1::DecodeIndexer::NewStub(channels[i % channels.size()]);
    w->rng.seed(seeder());
    for (int32_t r = 0; r < options.requests_per_step; ++r) {
      w->sequences.push_back(
          {options.sequence_id_base + uint64_t(i) * options.requests_per_step + uint64_t(r), 0});
    }
    w->requests.resize(model->plan.size());
    w->verify.enabled = options.verify;
    workers.push_back(std::move(w));
  }
  if (options.verify) {
    // Tracked sequences spread over workers: sequence 0 of worker 0, 1, ... then sequence 1.
    for (int32_t t = 0; t < options.verify_sequences; ++t) {
      Worker& w = *workers[t % workers.size()];
      const size_t slot = t / workers.size();
      if (slot >= w.sequences.size()) break;
      if (!w.verifier) {
        auto verifier = Verifier::Create(*model, options.next_n, options.verify_tolerance);
        if (!verifier.ok()) return verifier.status();
        w.verifier = *std::move(verifier);
      }
      w.verifier->Track(w.sequences[slot].id);
      ++tracked;
    }
  }

  nlohmann::json stats_before;
  std::latch prefilled(options.concurrency);
  std::latch go(1);
  std::atomic<bool> abort{false};
  std::vector<std::thread> threads;
  for (auto& wp : workers) {
    threads.emplace_back([&, w = wp.get()] {
      w->fatal = run.SetUpSharedMemory(*w);
      if (w->fatal.ok()) w->fatal = run.Prefill(*w);
      if (!w->fatal.ok()) abort = true;
      prefilled.count_down();
      go.wait();
      if (!abort) {
        if (options.rate > 0) {
          run.OpenLoop(*w);
        } else {
          run.ClosedLoop(*w);
        }
        run.CloseStream(*w);
      }
      run.TearDownSharedMemory(*w);
    });
  }
  prefilled.wait();
  if (auto before = FetchStatistics(*control, options.channel); before.ok()) {
    stats_before = *before;
  }
  run.StartSchedule();
  const Clock::time_point started = Clock::now();
  const double started_unix =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  go.count_down();

  // The live line: elapsed, steps done, rate and mean step latency since the last line.
  std::atomic<bool> finished{false};
  std::thread progress;
  if (options.progress && !abort) {
    progress = std::thread([&] {
      uint64_t last_steps = 0, last_us = 0;
      std::array<uint64_t, Live::kBuckets> last_buckets{};
      Clock::time_point last = Clock::now();
      while (!finished) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        const uint64_t steps = run.live().steps, us = run.live().step_us_total;
        // Percentiles over the steps since the last line (bucket bounds: within 19%).
        std::array<uint64_t, Live::kBuckets> now_buckets{}, window{};
        for (int b = 0; b < Live::kBuckets; ++b) {
          now_buckets[b] = run.live().step_buckets[b].load();
          window[b] = now_buckets[b] - last_buckets[b];
        }
        const Clock::time_point now = Clock::now();
        const double dt = std::chrono::duration<double>(now - last).count();
        const uint64_t ds = steps - last_steps;
        std::fprintf(stderr,
                     "\r[%7.1fs] steps %-8llu %8.1f steps/s  step ms mean %7.3f p50 %7.3f "
                     "p90 %7.3f p99 %7.3f  rpcs %-9llu errors %-6llu",
                     std::chrono::duration<double>(now - started).count(),
                     static_cast<unsigned long long>(steps), dt > 0 ? ds / dt : 0.0,
                     ds ? double(us - last_us) / ds / 1e3 : 0.0,
                     BucketQuantileUs(window, 0.50) / 1e3, BucketQuantileUs(window, 0.90) / 1e3,
                     BucketQuantileUs(window, 0.99) / 1e3,
                     static_cast<unsigned long long>(run.live().rpcs.load()),
                     static_cast<unsigned long long>(run.live().failed.load()));
        std::fflush(stderr);
        last_steps = steps;
        last_us = us;
        last_buckets = now_buckets;
        last = now;
      }
      std::fprintf(stderr, "\n");
    });
  }
  for (std::thread& t : threads) t.join();
  finished = true;
  if (progress.joinable()) progress.join();

  Report report;
  report.started_unix_s = started_unix;
  report.started_at = IsoTimeUtc(started_unix);
  report.finished_at = IsoTimeUtc(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  for (auto& w : workers) {
    if (!w->fatal.ok()) {
      for (auto& other : workers) run.ReleaseAll(*other);
      return w->fatal;
    }
  }
  Clock::time_point last_done = started;
  for (auto& w : workers) {
    report.samples.Merge(w->samples);
    last_done = std::max(last_done, w->last_done);
    report.verify.enabled = options.verify;
    report.verify.rows_checked += w->verify.rows_checked;
    report.verify.rows_mismatched += w->verify.rows_mismatched;
    report.verify.rows_near_tie += w->verify.rows_near_tie;
    report.verify.candidate_rows_near_tie += w->verify.candidate_rows_near_tie;
    report.verify.candidate_rows_checked += w->verify.candidate_rows_checked;
    report.verify.candidate_rows_mismatched += w->verify.candidate_rows_mismatched;
    report.verify.groups_abandoned += w->verify.groups_abandoned;
    for (const std::string& m : w->verify.first_mismatches) {
      if (report.verify.first_mismatches.size() < 8) report.verify.first_mismatches.push_back(m);
    }
  }
  if (run.measure_started()) {
    report.measured_s =
        std::max(0.0, std::chrono::duration<double>(last_done - run.measure_start()).count());
  }
  if (auto after = FetchStatistics(*control, options.channel);
      after.ok() && !stats_before.is_null()) {
    report.server_statistics = StatisticsDelta(stats_before, *after);
  }
  if (!options.keep_sequences) {
    for (auto& w : workers) run.ReleaseAll(*w);
  }

  report.config = {
      {"target", options.channel.target},
      {"concurrency", options.concurrency},
      {"channels", options.channels},
      {"rate", options.rate},
      {"poisson", options.poisson},
      {"duration_s", options.duration_s},
      {"steps", options.steps},
      {"warmup_steps", options.warmup_steps >= 0 ? options.warmup_steps : options.concurrency},
      {"streaming", options.streaming},
      {"request_form", options.columnar ? "columnar" : "sequences"},
      {"deadline_ms", options.deadline_ms},
      // Where the deadline applies: the unary RPC's, or each streamed step's timeout_us.
      {"deadline_scope", options.streaming ? "step" : "rpc"},
      {"answer_encoding",
       options.answer_encoding == v1::ANSWER_ENCODING_DELTA_VARINT ? "delta" : "raw"},
      {"shared_memory", options.shared_memory},
      {"fast_path", options.fast_path},
      {"requests_per_step", options.requests_per_step},
      {"next_n", options.next_n},
      {"draft_reject", options.draft_reject},
      {"context", options.context},
      {"sequences", sequences},
      {"layers", model->plan.size()},
      {"q_format", options.q_format == PayloadFormat::kFp32 ? "fp32" : "quantized"},
      {"key_format", options.key_format == PayloadFormat::kFp32 ? "fp32" : "quantized"},
      {"verify_sequences", tracked},
      {"backoff_initial_ms", options.backoff_initial_ms},
      {"backoff_max_ms", options.backoff_max_ms},
      {"seed", options.seed}};
  report.server = {{"profile", info.profile()},     {"backend", info.backend()},
                   {"num_ranks", info.num_ranks()}, {"num_heads", info.num_heads()},
                   {"head_dim", info.head_dim()},   {"topk", info.topk()},
                   {"layers", info.layers_size()},  {"version", info.version()}};
  report.first_error = run.first_error();
  return report;
}

}  // namespace decode_indexer::load
