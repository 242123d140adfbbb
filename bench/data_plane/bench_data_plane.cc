// decode-indexer-bench-data-plane: the cost of moving one decode step through the service,
// without the compute. The real IndexerService (edge decoding/validation, admission, answer
// encoding, statistics) runs over loopback gRPC in front of an EchoExecutor that answers
// each row with K sorted positions drawn from a `--context`-long cache (as a real step over
// 32K keys would), so the numbers are transport + (de)serialization + edge work only.
// Modes: unary and stream, raw and delta-varint answers, default and tuned HTTP/2 windows,
// and the shared-memory path.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/indexer_client.h"
#include "client/tensor.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/service/indexer_service.h"

namespace di = decode_indexer;

namespace {

// Answers every step with precomputed random sorted positions; changes nothing.
class EchoExecutor final : public di::exec::Executor {
 public:
  EchoExecutor(di::config::Profile profile, int64_t context, uint64_t seed)
      : profile_(std::move(profile)) {
    std::mt19937_64 rng(seed);
    const int k = profile_.topk;
    std::vector<int32_t> all(static_cast<size_t>(context));
    std::iota(all.begin(), all.end(), 0);
    for (int r = 0; r < kPool; ++r) {
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> row(all.begin(), all.begin() + std::min<int64_t>(k, context));
      std::sort(row.begin(), row.end());
      row.resize(k, -1);
      pool_.insert(pool_.end(), row.begin(), row.end());
    }
  }
  absl::Status CreateSequence(uint64_t) override { return absl::OkStatus(); }
  absl::StatusOr<int64_t> AppendKeys(uint64_t, int32_t, const di::exec::KeysInput& k) override {
    return k.count;
  }
  absl::StatusOr<int64_t> ReleaseSequence(uint64_t) override { return 0; }
  absl::StatusOr<di::exec::StepResult> DecodeStep(const di::exec::StepInput& step) override {
    di::exec::StepResult r;
    r.step_id = step.step_id;
    r.num_rows = step.num_rows;
    r.topk = profile_.topk;
    r.topk_indices.resize(static_cast<size_t>(step.num_rows) * r.topk);
    for (int32_t i = 0; i < step.num_rows; ++i) {
      const size_t src = static_cast<size_t>((i + next_++) % kPool) * r.topk;
      std::memcpy(&r.topk_indices[static_cast<size_t>(i) * r.topk], &pool_[src], r.topk * 4);
    }
    r.lengths.assign(step.sequences.size(), 1);
    return r;
  }
  di::exec::ExecutorStatus Status() const override {
    di::exec::ExecutorStatus s;
    s.backend = "echo";
    s.num_ranks = 1;
    s.collective = "in-process";
    return s;
  }
  const di::config::Profile& profile() const override { return profile_; }
  void Shutdown() override {}

 private:
  static constexpr int kPool = 97;
  di::config::Profile profile_;
  std::vector<int32_t> pool_;
  uint64_t next_ = 0;
};

struct Figures {
  double p50 = 0, p99 = 0, mean = 0;
};

Figures Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Figures f;
  f.p50 = us[us.size() / 2];
  f.p99 = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  f.mean = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  return f;
}

void Tune(grpc::ChannelArguments& args) {
  // Loopback answers of ~0.5 MiB: open the HTTP/2 flow-control windows up front instead of
  // letting BDP probing grow them, so no round trip waits for a WINDOW_UPDATE.
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 4 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  std::string profile_name = "v32";
  int requests = 64, iters = 200, warmup = 20;
  int64_t context = 32768;
  CLI::App app{"decode-indexer-bench-data-plane: per-step transport cost (echo executor)"};
  app.add_option("--profile", profile_name, "built-in profile or file")->capture_default_str();
  app.add_option("--requests", requests, "requests (rows) per step")->capture_default_str();
  app.add_option("--context", context, "cache length the echoed answers are drawn from")
      ->capture_default_str();
  app.add_option("--iters", iters, "timed steps per mode")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  absl::StatusOr<di::config::Profile> profile = di::config::LoadProfile(profile_name);
  if (!profile.ok()) {
    std::fprintf(stderr, "%s\n", profile.status().ToString().c_str());
    return 2;
  }
  const int H = profile->num_heads, D = profile->head_dim, K = profile->topk;
  int dense = 0;
  while (profile->layers[dense].role != di::config::LayerRole::kDense) ++dense;
  const bool fp8 = profile->layers[dense].cache_format == di::kernels::CacheFormat::kFp8;

  EchoExecutor echo(*profile, context, 1234);
  di::service::IndexerService service(echo, "bench");

  // The request: `requests` sequences, one row each, pre-quantized q in the cache format.
  std::mt19937_64 rng(42);
  di::v1::DecodeStepRequest req;
  req.set_layer(dense);
  for (int i = 0; i < requests; ++i) {
    di::v1::SequenceStep* seq = req.add_sequences();
    seq->set_sequence_id(i + 1);
    seq->set_num_rows(1);
  }
  const int64_t q_bytes = fp8 ? int64_t(requests) * H * D : int64_t(requests) * H * D / 2;
  std::vector<uint8_t> q(q_bytes);
  for (auto& b : q) b = static_cast<uint8_t>(rng() & 0x77);
  *req.mutable_q() = di::client::CodesTensor(fp8 ? di::v1::DTYPE_FP8_E4M3 : di::v1::DTYPE_FP4_E2M1,
                                             q, {requests, H, D});
  if (!fp8) {
    std::vector<uint8_t> s(size_t(requests) * H * D / 32, 127);
    *req.mutable_q_scales() =
        di::client::CodesTensor(di::v1::DTYPE_UE8M0, s, {requests, H, D / 32});
  }
  std::vector<float> w(size_t(requests) * H);
  for (auto& x : w) x = std::normal_distribution<float>()(rng);
  *req.mutable_weights() = di::client::F32Tensor(w, {requests, H});

  std::printf("# profile %s: %d requests x (H=%d, D=%d, %s q), K=%d, answers over %lld keys\n",
              profile->name.c_str(), requests, H, D, fp8 ? "fp8" : "fp4", K,
              static_cast<long long>(context));
  std::printf("# request %zu B; %d timed steps per mode after %d warm-up\n", req.ByteSizeLong(),
              iters, warmup);
  std::printf("%-34s %10s %10s %10s %12s\n", "mode", "p50_us", "p99_us", "mean_us", "answer_B");

  for (bool tuned : {false, true}) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(512 << 20);
    builder.SetMaxSendMessageSize(512 << 20);
    if (tuned) {
      builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
      builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
      builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
      builder.AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 4 << 20);
    }
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    const std::string target = "127.0.0.1:" + std::to_string(port);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(512 << 20);
    args.SetMaxSendMessageSize(512 << 20);
    if (tuned) Tune(args);
    auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    auto stub = di::v1::DecodeIndexer::NewStub(channel);

    auto run = [&](const char* name, di::v1::DecodeStepRequest r, bool stream) {
      std::vector<double> us;
      size_t answer_bytes = 0;
      grpc::ClientContext sctx;
      std::unique_ptr<
          grpc::ClientReaderWriter<di::v1::DecodeStepRequest, di::v1::DecodeStepResponse>>
          st;
      if (stream) st = stub->DecodeStream(&sctx);
      for (int i = 0; i < warmup + iters; ++i) {
        di::v1::DecodeStepResponse resp;
        const auto t0 = std::chrono::steady_clock::now();
        bool ok;
        std::string why;
        if (stream) {
          ok = st->Write(r) && st->Read(&resp);
        } else {
          grpc::ClientContext ctx;
          grpc::Status gs = stub->DecodeStep(&ctx, r, &resp);
          ok = gs.ok();
          why = gs.error_message();
        }
        // The client's parse (and delta decode) is part of the cost.
        absl::StatusOr<di::client::StepAnswer> a = di::client::ParseStepResponse(resp);
        const double t =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count();
        if (!ok || !a.ok()) {
          std::fprintf(stderr, "%s: step failed: %s %s\n", name, why.c_str(),
                       a.ok() ? "" : a.status().ToString().c_str());
          std::exit(1);
        }
        answer_bytes = resp.ByteSizeLong();
        if (i >= warmup) us.push_back(t);
      }
      if (stream) {
        st->WritesDone();
        (void)st->Finish();
      }
      const Figures f = Summarize(us);
      std::printf("%-34s %10.1f %10.1f %10.1f %12zu\n",
                  (std::string(name) + (tuned ? " tuned" : " default")).c_str(), f.p50, f.p99,
                  f.mean, answer_bytes);
    };
    di::v1::DecodeStepRequest delta = req;
    delta.set_answer_encoding(di::v1::ANSWER_ENCODING_DELTA_VARINT);
    run("unary raw", req, false);
    run("unary delta", delta, false);
    run("stream raw", req, true);
    run("stream delta", delta, true);

    // Shared memory: q and weights in the region, the answer written back there.
    const std::string name = "/di-bench-" + std::to_string(getpid());
    const uint64_t size = 64 << 20;
    auto shm = di::client::SharedMemory::Create(name, size);
    if (!shm.ok()) {
      std::fprintf(stderr, "shm: %s\n", shm.status().ToString().c_str());
      return 1;
    }
    grpc::ClientContext rctx;
    di::v1::RegisterSharedMemoryRequest rreq;
    rreq.set_name(name);
    rreq.set_size(size);
    di::v1::RegisterSharedMemoryResponse rresp;
    if (!stub->RegisterSharedMemory(&rctx, rreq, &rresp).ok()) return 1;
    di::v1::DecodeStepRequest shared = req;
    uint64_t at = 0;
    auto place = [&](di::v1::Tensor* t) {
      const uint64_t off = at;
      std::memcpy((*shm)->data() + off, t->data().data(), t->data().size());
      at += (t->data().size() + 4095) / 4096 * 4096;
      t->clear_data();
      return off;
    };
    auto* sm = shared.mutable_shared_memory();
    sm->set_region_id(rresp.region_id());
    sm->set_q_offset(place(shared.mutable_q()));
    if (shared.has_q_scales()) sm->set_q_scales_offset(place(shared.mutable_q_scales()));
    sm->set_weights_offset(place(shared.mutable_weights()));
    sm->set_answer_offset(at);
    run("unary shm", shared, false);
    run("stream shm", shared, true);
    server->Shutdown();
  }
  return 0;
}
