// decode-indexer-bench-data-plane: the cost of moving one decode step through the service.
//
// Echo mode (default): the real IndexerService (edge decoding/validation, admission, answer
// encoding, statistics) runs over loopback gRPC in front of an EchoExecutor that answers
// each row with K sorted positions drawn from a `--context`-long cache (as a real step over
// 32K keys would), so the numbers are transport + (de)serialization + edge work only; then
// the pieces of the unary path are timed one by one in process (--pieces).
// Modes: unary and stream, raw and delta-varint answers, default and tuned HTTP/2 windows,
// and the shared-memory path.
//
// Server mode (--target host:port): a real decode-indexer-server (e.g. --backend cuda).
// `--requests` sequences of `--context` keys are prefilled on the first dense layer, then
// each path runs decode steps (one row and one new key per sequence) and reports the
// client's round trip next to the server's compute_us (the step's device work, key insert
// to answer copy): unary/stream x raw/delta, shared memory, and, where this binary has CUDA,
// the answer left in a CUDA IPC buffer of this process, q read from it too (cuda_ipc.q_offset),
// and the same-host step ring (client/fast_path.h: no gRPC per step) with q and the answer in
// the ring's region or in the CUDA IPC buffer, each at the ring's default spins and with the
// server's poller and the client spinning (--ring-spin: a worker that owns a core). Last, the
// worker modes (--worker-copy-mb): a worker whose stream does other GPU work before q, ordered
// with the server by a host wait or by CUDA IPC events (RunWorkerModes).
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <unistd.h>
#ifdef DI_BENCH_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/fast_path.h"
#include "client/indexer_client.h"
#include "client/tensor.h"
#include "common/cli.h"
#include "common/malloc_tuning.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/validated_step.h"
#include "server/service/callback_edge.h"
#include "server/service/indexer_service.h"
#include "server/service/request_decode.h"

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
  absl::Status CreateSequence(uint64_t, const di::exec::CallCheck&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> AppendKeys(const di::exec::ValidatedAppend& append,
                                     const di::exec::CallCheck&) override {
    return append.keys().count;
  }
  absl::StatusOr<int64_t> ReleaseSequence(uint64_t, const di::exec::CallCheck&) override {
    return 0;
  }
  // The echo bench times the step's transport only; it has no cache to cut, fork or move.
  absl::StatusOr<int64_t> TruncateSequence(uint64_t, int64_t, const di::exec::CallCheck&) override {
    return Unused();
  }
  absl::Status ForkSequence(uint64_t, uint64_t, int64_t, const di::exec::CallCheck&) override {
    return Unused();
  }
  absl::StatusOr<di::exec::SequenceInfo> GetSequence(uint64_t) override { return Unused(); }
  absl::StatusOr<di::exec::SequenceImage> ExportSequence(uint64_t) override { return Unused(); }
  absl::Status ImportSequence(uint64_t, const di::exec::SequenceImage&,
                              const di::exec::CallCheck&) override {
    return Unused();
  }
  std::vector<uint64_t> SequenceIds() const override { return {}; }
  int64_t ReleaseIdleSequences(int64_t) override { return 0; }
  absl::StatusOr<di::exec::StepResult> DecodeStep(
      const di::exec::ValidatedStep& validated) override {
    const di::exec::StepInput& step = validated.input();
    di::exec::StepResult r;
    r.step_id = step.step_id;
    r.num_rows = step.num_rows;
    r.topk = profile_.topk;
    // Like the real executor: straight into the service's target when it names one.
    int32_t* out = step.answer != nullptr ? step.answer->topk() : nullptr;
    if (out == nullptr) {
      r.topk_indices.resize(static_cast<size_t>(step.num_rows) * r.topk);
      out = r.topk_indices.data();
    }
    for (int32_t i = 0; i < step.num_rows; ++i) {
      const size_t src = static_cast<size_t>((i + next_++) % kPool) * r.topk;
      std::memcpy(out + static_cast<size_t>(i) * r.topk, &pool_[src], r.topk * 4);
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
  static absl::Status Unused() {
    return absl::UnimplementedError("the echo executor keeps no sequences");
  }
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

using Stub = di::v1::DecodeIndexer::Stub;
using Request = di::v1::DecodeStepRequest;
using Response = di::v1::DecodeStepResponse;

// Per-mode result: client round trip and the server's compute time, both in µs.
struct ModeResult {
  std::vector<double> client_us;
  std::vector<double> compute_us;
  std::vector<double> queue_us;
  size_t response_bytes = 0;
  // Server mode: the server's mean handler time of these steps (GetStatistics), from the
  // message read to the answer encoded: the client's round trip minus this is the transport.
  double handler_mean_us = 0;
};

// Runs `iters` timed steps after `warmup` (unary or one stream); `prepare(i)` may change the
// request before step i (e.g. fresh keys); `check` sees every response. Exits on failure.
template <typename Prepare>
ModeResult RunMode(Stub& stub, const char* name, Request& r, bool stream, int warmup, int iters,
                   Prepare&& prepare) {
  ModeResult out;
  grpc::ClientContext sctx;
  std::unique_ptr<grpc::ClientReaderWriter<Request, Response>> st;
  if (stream) st = stub.DecodeStream(&sctx);
  Response resp;
  for (int i = 0; i < warmup + iters; ++i) {
    prepare(i);
    resp.Clear();
    const auto t0 = std::chrono::steady_clock::now();
    bool ok;
    std::string why;
    if (stream) {
      ok = st->Write(r) && st->Read(&resp);
    } else {
      grpc::ClientContext ctx;
      grpc::Status gs = stub.DecodeStep(&ctx, r, &resp);
      ok = gs.ok();
      why = gs.error_message();
    }
    // The client's parse (and delta decode) is part of the cost.
    absl::StatusOr<di::client::StepAnswer> a = di::client::ParseStepResponse(resp);
    const double t =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (!ok || !a.ok()) {
      if (stream && !ok) why = st->Finish().error_message();
      std::fprintf(stderr, "%s: step failed: %s %s\n", name, why.c_str(),
                   a.ok() ? "" : a.status().ToString().c_str());
      std::exit(1);
    }
    out.response_bytes = resp.ByteSizeLong();
    if (i >= warmup) {
      out.client_us.push_back(t);
      out.compute_us.push_back(static_cast<double>(resp.timing().compute_us()));
      out.queue_us.push_back(static_cast<double>(resp.timing().queue_us()));
    }
  }
  if (stream) {
    st->WritesDone();
    (void)st->Finish();
  }
  return out;
}

// A stream kept `depth` steps ahead: a writer thread sends while this thread reads, so one
// step's request crosses the connection while the previous one is served and answered.
// Answers payload GB/s (request + response bytes of `count` steps over the wall time).
double RunPipelined(Stub& stub, const Request& r, int depth, int count) {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<Request, Response>> st = stub.DecodeStream(&ctx);
  std::mutex mu;
  std::condition_variable cv;
  int received = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread writer([&] {
    for (int i = 0; i < count; ++i) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return i - received < depth; });
      lock.unlock();
      if (!st->Write(r)) break;
    }
    st->WritesDone();
  });
  Response resp;
  size_t bytes = 0;
  for (int i = 0; i < count; ++i) {
    if (!st->Read(&resp) || !di::client::ParseStepResponse(resp).ok()) {
      std::fprintf(stderr, "pipelined stream: step %d failed\n", i);
      std::exit(1);
    }
    bytes += resp.ByteSizeLong() + r.ByteSizeLong();
    std::lock_guard<std::mutex> lock(mu);
    ++received;
    cv.notify_one();
  }
  writer.join();
  (void)st->Finish();
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(bytes) / us / 1000.0;
}

void PrintHeader(bool with_compute) {
  if (with_compute) {
    std::printf("%-30s %8s %8s %8s %8s %8s %8s %6s %9s\n", "mode", "p50_us", "p99_us", "mean_us",
                "handler", "queue50", "comp50", "ratio", "resp_B");
  } else {
    std::printf("%-34s %10s %10s %10s %12s\n", "mode", "p50_us", "p99_us", "mean_us", "answer_B");
  }
}

void PrintRow(const std::string& name, const ModeResult& m, bool with_compute) {
  const Figures f = Summarize(m.client_us);
  if (with_compute) {
    const Figures c = Summarize(m.compute_us);
    const Figures q = Summarize(m.queue_us);
    std::printf("%-30s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %6.2f %9zu\n", name.c_str(), f.p50,
                f.p99, f.mean, m.handler_mean_us, q.p50, c.p50, c.p50 > 0 ? f.p50 / c.p50 : 0.0,
                m.response_bytes);
  } else {
    std::printf("%-34s %10.1f %10.1f %10.1f %12zu\n", name.c_str(), f.p50, f.p99, f.mean,
                m.response_bytes);
  }
  std::fflush(stdout);
}

// Moves q / q_scales / weights of `req` into the region (4 KiB aligned) and points the request
// there; answers the first free offset (where the answer goes).
uint64_t MoveToShared(Request& req, uint8_t* base, uint64_t region_id) {
  uint64_t at = 0;
  auto place = [&](di::v1::Tensor* t) {
    const uint64_t off = at;
    std::memcpy(base + off, t->data().data(), t->data().size());
    at += (t->data().size() + 4095) / 4096 * 4096;
    t->clear_data();
    return off;
  };
  auto* sm = req.mutable_shared_memory();
  sm->set_region_id(region_id);
  sm->set_q_offset(place(req.mutable_q()));
  if (req.has_q_scales()) sm->set_q_scales_offset(place(req.mutable_q_scales()));
  sm->set_weights_offset(place(req.mutable_weights()));
  sm->set_answer_offset(at);
  return at;
}

template <typename F>
double TimeUs(int iters, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         iters;
}

// The unary path's pieces, each timed alone in this process (mean µs): what the edge and
// protobuf cost, so the rest of a round trip is gRPC's transport.
void TimePieces(const Request& req, const di::config::Profile& profile, int64_t context,
                int iters) {
  std::printf("\n# pieces of one unary raw step, timed alone (mean us over %d)\n", iters);
  std::string wire;
  const double ser_req = TimeUs(iters, [&] {
    wire.clear();
    req.SerializeToString(&wire);
  });
  Request parsed;
  const double parse_req = TimeUs(iters, [&] { parsed.ParseFromString(wire); });
  const double decode = TimeUs(iters, [&] {
    absl::StatusOr<di::service::DecodedStep> d = di::service::DecodeStepRequest(parsed, profile);
    if (!d.ok()) std::exit(1);
  });
  EchoExecutor echo(profile, context, 7);
  absl::StatusOr<di::service::DecodedStep> decoded =
      di::service::DecodeStepRequest(parsed, profile);
  if (!decoded.ok()) std::exit(1);
  di::exec::ValidatedStep& input = *decoded->validated;
  const int32_t num_rows = input.input().num_rows;
  Response resp;
  const double answer = TimeUs(iters, [&] {
    resp.Clear();
    di::v1::Tensor* t = resp.mutable_topk();
    t->set_dtype(di::v1::DTYPE_INT32);
    t->add_shape(num_rows);
    t->add_shape(profile.topk);
    std::string* data = t->mutable_data();
    data->resize(size_t(num_rows) * profile.topk * 4);
    const di::exec::AnswerSink sink = di::exec::AnswerSink::Host(
        reinterpret_cast<int32_t*>(data->data()), nullptr, /*page_locked=*/false);
    input.set_answer(&sink);
    (void)echo.DecodeStep(input);
    input.set_answer(nullptr);
  });
  std::string out_wire;
  const double ser_resp = TimeUs(iters, [&] {
    out_wire.clear();
    resp.SerializeToString(&out_wire);
  });
  Response back;
  const double parse_resp = TimeUs(iters, [&] { back.ParseFromString(out_wire); });
  const double client_parse = TimeUs(iters, [&] {
    absl::StatusOr<di::client::StepAnswer> a = di::client::ParseStepResponse(back);
    if (!a.ok()) std::exit(1);
  });
  std::vector<uint8_t> a(wire.size() + out_wire.size()), b(a.size());
  const double copy = TimeUs(iters, [&] { std::memcpy(b.data(), a.data(), a.size()); });
  std::printf("%-44s %10.1f\n", "client: serialize request", ser_req);
  std::printf("%-44s %10.1f\n", "server: parse request", parse_req);
  std::printf("%-44s %10.1f\n", "server: edge decode + validate (NaN scan)", decode);
  std::printf("%-44s %10.1f\n", "server: answer into the response (echo)", answer);
  std::printf("%-44s %10.1f\n", "server: serialize response", ser_resp);
  std::printf("%-44s %10.1f\n", "client: parse response", parse_resp);
  std::printf("%-44s %10.1f\n", "client: ParseStepResponse", client_parse);
  std::printf("%-44s %10.1f\n", "sum of the pieces",
              ser_req + parse_req + decode + answer + ser_resp + parse_resp + client_parse);
  std::printf("%-44s %10.1f  (%zu B: one memcpy of request + response)\n", "reference: memcpy",
              copy, a.size());
}

// Echo mode: the service in process over loopback, no compute.
// `edges`: "sync", "callback" or "both" (each mode on each edge, in the same run).
// --serve ADDR: the echo service alone, on the default (callback) edge with the server's
// message limits and a shared-memory socket at --serve-socket, until SIGINT / SIGTERM; for
// clients in other processes (bench/data_plane/py_vs_cpp.sh: the Python and the C++ client
// against one echo server, so their difference is the clients' own transport cost). --serve
// may be repeated, e.g. a TCP address and a Unix socket: one server on both, so that the two
// transports are compared against the same process.
int ServeEcho(const di::config::Profile& profile, int64_t context,
              const std::vector<std::string>& listen, const std::string& socket_path,
              int edge_workers) {
  EchoExecutor echo(profile, context, 1234);
  di::service::IndexerService service(echo, "bench-echo");
  if (!socket_path.empty()) {
    if (absl::Status s = service.StartShmSocket(socket_path); !s.ok()) {
      std::fprintf(stderr, "shm socket: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before gRPC's threads start: they inherit it
  di::service::CallbackEdge edge(service, edge_workers);
  grpc::ServerBuilder builder;
  std::vector<int> ports(listen.size(), 0);
  for (size_t i = 0; i < listen.size(); ++i) {
    builder.AddListeningPort(listen[i], grpc::InsecureServerCredentials(), &ports[i]);
  }
  builder.SetMaxReceiveMessageSize(512 << 20);
  builder.SetMaxSendMessageSize(512 << 20);
  builder.RegisterService(edge.methods());
  builder.RegisterCallbackGenericService(&edge);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || std::count(ports.begin(), ports.end(), 0) > 0) {
    std::fprintf(stderr, "cannot listen on every --serve address\n");
    return 1;
  }
  // One line an address; py_vs_cpp.sh reads the TCP port from the first form (gRPC reports a
  // bound Unix socket as port 1).
  for (size_t i = 0; i < listen.size(); ++i) {
    if (listen[i].rfind("unix", 0) == 0) {
      std::printf("serving echo on %s\n", listen[i].c_str());
    } else {
      std::printf("serving echo on port %d\n", ports[i]);
    }
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  service.StopStepRings();
  server->Shutdown();
  return 0;
}

int RunEcho(const di::config::Profile& profile, const Request& req, int64_t context, int warmup,
            int iters, bool pieces, const std::string& edges, int edge_workers) {
  EchoExecutor echo(profile, context, 1234);
  di::service::IndexerService service(echo, "bench");
  const std::string socket_path = "/tmp/di-bench-" + std::to_string(getpid()) + ".sock";
  if (absl::Status s = service.StartShmSocket(socket_path); !s.ok()) {
    std::fprintf(stderr, "shm socket: %s\n", s.ToString().c_str());
    return 1;
  }
  PrintHeader(false);
  std::vector<bool> callback_edges;
  if (edges != "callback") callback_edges.push_back(false);
  if (edges != "sync") callback_edges.push_back(true);
  for (bool callback : callback_edges) {
    for (bool tuned : {false, true}) {
      // Outlives the grpc::Server below (its reactors run until the server shut down).
      std::unique_ptr<di::service::CallbackEdge> edge;
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
      if (callback) {
        edge = std::make_unique<di::service::CallbackEdge>(service, edge_workers);
        builder.RegisterService(edge->methods());
        builder.RegisterCallbackGenericService(edge.get());
      } else {
        builder.RegisterService(&service);
      }
      std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
      const std::string target = "127.0.0.1:" + std::to_string(port);
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(512 << 20);
      args.SetMaxSendMessageSize(512 << 20);
      if (tuned) Tune(args);
      auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
      auto stub = di::v1::DecodeIndexer::NewStub(channel);
      const std::string suffix =
          std::string(tuned ? " tuned" : " default") + (callback ? " callback" : " sync");
      auto none = [](int) {};
      auto mode = [&](const char* name, Request r, bool stream) {
        PrintRow(name + suffix, RunMode(*stub, name, r, stream, warmup, iters, none), false);
      };
      Request delta = req;
      delta.set_answer_encoding(di::v1::ANSWER_ENCODING_DELTA_VARINT);
      mode("unary raw", req, false);
      mode("unary delta", delta, false);
      mode("stream raw", req, true);
      mode("stream delta", delta, true);
      for (int depth : {1, 2, 4}) {
        std::printf("%-34s %10.2f GB/s of payload (request + response)\n",
                    ("stream raw pipelined x" + std::to_string(depth) + suffix).c_str(),
                    RunPipelined(*stub, req, depth, warmup + iters));
      }

      // Shared memory: q and weights in the region, the answer written back there.
      const std::string name = "/di-bench-" + std::to_string(getpid());
      const uint64_t size = 64 << 20;
      auto shm = di::client::SharedMemory::Create(name, size);
      if (!shm.ok()) {
        std::fprintf(stderr, "shm: %s\n", shm.status().ToString().c_str());
        return 1;
      }
      absl::StatusOr<uint64_t> region = di::client::RegisterMemfd(socket_path, (*shm)->fd(), size);
      if (!region.ok()) {
        std::fprintf(stderr, "shm: %s\n", region.status().ToString().c_str());
        return 1;
      }
      Request shared = req;
      MoveToShared(shared, (*shm)->data(), *region);
      mode("unary shm", shared, false);
      mode("stream shm", shared, true);
      server->Shutdown();
    }
  }
  if (pieces) TimePieces(req, profile, context, std::max(50, iters));
  return 0;
}

// Ring steps: `step` as given (its tensors already where its offsets say), `warmup` untimed
// then `iters` timed calls (Submit to completion seen). Exits on failure.
ModeResult RunRing(di::client::FastPathRing& ring, di::client::RingStep step, int warmup, int iters,
                   uint64_t& step_id) {
  ModeResult out;
  for (int i = 0; i < warmup + iters; ++i) {
    step.descriptor.step_id = step_id++;
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<di::client::RingCompletion> done = ring.Step(step);
    const auto t1 = std::chrono::steady_clock::now();
    if (!done.ok() || !done->status.ok()) {
      std::fprintf(stderr, "ring step: %s\n",
                   (done.ok() ? done->status : done.status()).ToString().c_str());
      std::exit(1);
    }
    if (i < warmup) continue;
    out.client_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    out.compute_us.push_back(double(done->compute_us));
    out.queue_us.push_back(double(done->queue_us));
    out.handler_mean_us += double(done->server_us) / iters;  // the poller's time, mean
  }
  return out;
}

#ifdef DI_BENCH_CUDA
// A worker whose q is produced on its GPU: each step its stream does `copy_mb` of other work
// (a device-to-device copy, standing in for the attention and projections before q) and then
// writes q and the weights into the buffer (a device-to-device copy from a second copy of
// them), then the step goes through the ring with q and the answer in the buffer. Two ways
// of ordering it: the host waits for the worker's stream before the descriptor (no events),
// or the worker records the inputs event and rings at once, and its stream waits on the
// answer event (kWaitInputsEvent | kRecordAnswerEvent): the server's host work then overlaps
// the worker's GPU work. Per step: the mean over the timed steps of the whole loop.
void RunWorkerModes(di::client::IndexerClient& control, const di::v1::DecodeStepRequest& device_q,
                    uint64_t ipc_region, void* buffer, cudaEvent_t inputs_event,
                    cudaEvent_t answer_event, int copy_mb, int warmup, int iters,
                    uint64_t& step_id) {
  const auto& ci = device_q.cuda_ipc();
  const size_t q_bytes = size_t(ci.weights_offset() - ci.q_offset());
  const size_t w_bytes = size_t(device_q.weights().shape(0)) * device_q.weights().shape(1) * 4;
  const size_t work_bytes = size_t(copy_mb) << 20;
  void* work = nullptr;
  void* q_source = nullptr;  // q and weights as the worker's kernels would leave them
  cudaStream_t stream = nullptr;
  if (cudaMalloc(&work, 2 * work_bytes) != cudaSuccess ||
      cudaMalloc(&q_source, q_bytes + w_bytes) != cudaSuccess ||
      cudaMemcpy(q_source, static_cast<char*>(buffer) + ci.q_offset(), q_bytes + w_bytes,
                 cudaMemcpyDeviceToDevice) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "cuda: cannot set up the worker modes\n");
    std::exit(1);
  }
  for (const bool events : {false, true}) {
    di::client::FastPathOptions fo;
    fo.data_bytes = uint64_t{1} << 20;
    absl::StatusOr<std::unique_ptr<di::client::FastPathRing>> ring =
        di::client::FastPathRing::Create(control, fo);
    if (!ring.ok()) {
      std::fprintf(stderr, "ring: %s\n", ring.status().ToString().c_str());
      std::exit(1);
    }
    std::vector<uint64_t> ids;
    for (const auto& seq : device_q.sequences()) ids.push_back(seq.sequence_id());
    di::client::RingStep step;
    step.descriptor.layer = device_q.layer();
    step.descriptor.flags = di::ring::kAnswerCudaIpc | di::ring::kInputsCudaIpc;
    if (events) step.descriptor.flags |= di::ring::kWaitInputsEvent | di::ring::kRecordAnswerEvent;
    step.descriptor.cuda_ipc_region_id = ipc_region;
    step.descriptor.rows_per_sequence = 1;
    step.descriptor.q_dtype = device_q.q().dtype();
    step.descriptor.weights_dtype = di::v1::DTYPE_FP32;
    step.descriptor.q_offset = ci.q_offset();
    step.descriptor.weights_offset = ci.weights_offset();
    step.descriptor.answer_offset = 0;
    step.sequence_ids = ids;
    ModeResult out;
    std::chrono::steady_clock::time_point timed_start;
    for (int i = 0; i < warmup + iters; ++i) {
      if (i == warmup) {
        cudaStreamSynchronize(stream);
        timed_start = std::chrono::steady_clock::now();
      }
      const auto t0 = std::chrono::steady_clock::now();
      cudaMemcpyAsync(static_cast<char*>(work) + work_bytes, work, work_bytes,
                      cudaMemcpyDeviceToDevice, stream);
      cudaMemcpyAsync(static_cast<char*>(buffer) + ci.q_offset(), q_source, q_bytes + w_bytes,
                      cudaMemcpyDeviceToDevice, stream);
      if (events) {
        cudaEventRecord(inputs_event, stream);
      } else {
        cudaStreamSynchronize(stream);
      }
      step.descriptor.step_id = step_id++;
      absl::StatusOr<di::client::RingCompletion> done = (*ring)->Step(step);
      if (!done.ok() || !done->status.ok()) {
        std::fprintf(stderr, "worker ring step: %s\n",
                     (done.ok() ? done->status : done.status()).ToString().c_str());
        std::exit(1);
      }
      // The worker's next kernels read the answer: its stream waits for it on the GPU.
      if (events) cudaStreamWaitEvent(stream, answer_event, 0);
      const auto t1 = std::chrono::steady_clock::now();
      if (i < warmup) continue;
      out.client_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      out.compute_us.push_back(double(done->compute_us));
      out.queue_us.push_back(double(done->queue_us));
      out.handler_mean_us += double(done->server_us) / iters;
    }
    cudaStreamSynchronize(stream);
    const double per_step =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - timed_start)
            .count() /
        iters;
    const std::string name = std::string("worker ") + std::to_string(copy_mb) + " MB + ring " +
                             (events ? "ipc events" : "host sync");
    PrintRow(name, out, true);
    std::printf("%-30s %9.1f us a step (the loop's mean, worker GPU work included)\n", name.c_str(),
                per_step);
    std::fflush(stdout);
    (void)(*ring)->Unregister();
  }
  // The same worker work with no indexer call: what the loop costs without it.
  cudaStreamSynchronize(stream);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    cudaMemcpyAsync(static_cast<char*>(work) + work_bytes, work, work_bytes,
                    cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(static_cast<char*>(buffer) + ci.q_offset(), q_source, q_bytes + w_bytes,
                    cudaMemcpyDeviceToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  std::printf(
      "%-30s %9.1f us a step (worker GPU work alone)\n",
      (std::string("worker ") + std::to_string(copy_mb) + " MB alone").c_str(),
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
          iters);
  cudaStreamDestroy(stream);
  cudaFree(work);
  cudaFree(q_source);
}
#endif

// Server mode: a real server at `target`.
int RunServer(const std::string& target, int requests, int64_t context, int warmup, int iters,
              uint64_t first_id, std::mt19937_64& rng, [[maybe_unused]] int worker_copy_mb,
              const std::vector<std::string>& modes, bool fixed_key_position) {
  // --modes: run only the modes named (every mode when empty).
  auto wanted = [&](const std::string& name) {
    return modes.empty() || std::find(modes.begin(), modes.end(), name) != modes.end();
  };
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(512 << 20);
  args.SetMaxSendMessageSize(512 << 20);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(60))) {
    std::fprintf(stderr, "cannot connect to %s\n", target.c_str());
    return 1;
  }
  auto stub = di::v1::DecodeIndexer::NewStub(channel);
  di::v1::ServerInfo info;
  {
    grpc::ClientContext ctx;
    if (!stub->GetServerInfo(&ctx, di::v1::GetServerInfoRequest(), &info).ok()) return 1;
  }
  const int H = info.num_heads(), D = info.head_dim();
  int layer = -1;
  for (const auto& l : info.layers()) {
    if (l.role() == di::v1::LAYER_ROLE_DENSE && l.cache_format() == di::v1::CACHE_FORMAT_FP8) {
      layer = l.layer();
      break;
    }
  }
  if (layer < 0) {
    std::fprintf(stderr, "the server's profile has no FP8 dense layer\n");
    return 1;
  }
  auto fp8_codes = [&](size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) {
      b = static_cast<uint8_t>(rng());
      if ((b & 0x7F) == 0x7F) b ^= 1;  // never the NaN code
    }
    return v;
  };
  auto scales = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = 0.01f + 0.001f * static_cast<float>(rng() % 1000);
    return v;
  };
  // Prefill: pre-quantized FP8 keys, in chunks of 8K keys a call.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < requests; ++i) {
    const uint64_t id = first_id + i;
    grpc::ClientContext cctx;
    di::v1::CreateSequenceRequest creq;
    creq.set_sequence_id(id);
    di::v1::CreateSequenceResponse cresp;
    grpc::Status cs = stub->CreateSequence(&cctx, creq, &cresp);
    if (!cs.ok()) {
      std::fprintf(stderr, "CreateSequence: %s\n", cs.error_message().c_str());
      return 1;
    }
    for (int64_t done = 0; done < context; done += 8192) {
      const int64_t n = std::min<int64_t>(8192, context - done);
      di::v1::AppendKeysRequest areq;
      areq.set_sequence_id(id);
      areq.set_layer(layer);
      *areq.mutable_keys() =
          di::client::CodesTensor(di::v1::DTYPE_FP8_E4M3, fp8_codes(size_t(n) * D), {n, D});
      *areq.mutable_key_scales() = di::client::F32Tensor(scales(size_t(n)), {n});
      grpc::ClientContext actx;
      di::v1::AppendKeysResponse aresp;
      grpc::Status as = stub->AppendKeys(&actx, areq, &aresp);
      if (!as.ok()) {
        std::fprintf(stderr, "AppendKeys: %s\n", as.error_message().c_str());
        return 1;
      }
    }
  }
  std::printf("# server %s (%s), layer %d: %d requests x %lld keys prefilled in %.1f s\n",
              target.c_str(), info.backend().c_str(), layer, requests,
              static_cast<long long>(context),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  // The step: one row and one new key per sequence, FP8 q (weights folded) in the request.
  Request req;
  req.set_layer(layer);
  for (int i = 0; i < requests; ++i) {
    di::v1::SequenceStep* seq = req.add_sequences();
    seq->set_sequence_id(first_id + i);
    seq->set_num_rows(1);
  }
  *req.mutable_q() = di::client::CodesTensor(di::v1::DTYPE_FP8_E4M3,
                                             fp8_codes(size_t(requests) * H * D), {requests, H, D});
  std::vector<float> w(size_t(requests) * H);
  for (auto& x : w) x = std::normal_distribution<float>()(rng);
  *req.mutable_weights() = di::client::F32Tensor(w, {requests, H});
  // Fresh key bytes each step would cost the client time that is not the data plane's: one
  // set of new keys, reused (the cache grows by one key per sequence a step either way).
  for (int i = 0; i < requests; ++i) {
    di::v1::SequenceStep* seq = req.mutable_sequences(i);
    *seq->mutable_new_keys() =
        di::client::CodesTensor(di::v1::DTYPE_FP8_E4M3, fp8_codes(D), {1, D});
    *seq->mutable_new_key_scales() = di::client::F32Tensor(scales(1), {1});
    if (fixed_key_position) seq->set_new_keys_position(context);
  }
  std::printf(
      "# request %zu B; %d timed steps per mode after %d warm-up. p50/p99/mean: client round "
      "trip; handler: the server's mean time from read to answer (GetStatistics); queue50 / "
      "comp50: the executor's queue_us / compute_us p50; ratio = p50 / comp50\n",
      req.ByteSizeLong(), iters, warmup);
  PrintHeader(true);
  uint64_t step_id = 1;
  // The server's handler time of one method so far: {count, total µs}.
  auto handler = [&](const char* method) {
    grpc::ClientContext ctx;
    di::v1::Statistics st;
    std::pair<double, double> out{0, 0};
    if (!stub->GetStatistics(&ctx, di::v1::GetStatisticsRequest(), &st).ok()) return out;
    for (const auto& r : st.rpcs()) {
      if (r.method() == method) out = {double(r.count()), r.latency_us_total()};
    }
    return out;
  };
  auto mode = [&](const std::string& name, Request r, bool stream) {
    if (!wanted(name)) return;
    const char* method = stream ? "DecodeStream" : "DecodeStep";
    const auto before = handler(method);
    ModeResult m = RunMode(*stub, name.c_str(), r, stream, warmup, iters,
                           [&](int) { r.set_step_id(step_id++); });
    const auto after = handler(method);
    if (after.first > before.first) {
      m.handler_mean_us = (after.second - before.second) / (after.first - before.first);
    }
    PrintRow(name, m, true);
  };
  Request columnar;  // the step's columnar form: its tensors are staged into each ring
  columnar.set_layer(layer);
  for (int i = 0; i < requests; ++i) columnar.add_sequence_ids(first_id + i);
  columnar.set_rows_per_sequence(1);
  *columnar.mutable_q() = req.q();
  *columnar.mutable_weights() = req.weights();
  {
    std::string keys, key_scales;
    for (const auto& seq : req.sequences()) {
      keys += seq.new_keys().data();
      key_scales += seq.new_key_scales().data();
    }
    *columnar.mutable_new_keys() = di::client::CodesTensor(
        di::v1::DTYPE_FP8_E4M3, std::vector<uint8_t>(keys.begin(), keys.end()), {requests, D});
    columnar.mutable_new_key_scales()->set_dtype(di::v1::DTYPE_FP32);
    columnar.mutable_new_key_scales()->add_shape(requests);
    columnar.mutable_new_key_scales()->set_data(key_scales);
    for (int i = 0; fixed_key_position && i < requests; ++i) {
      columnar.add_new_keys_positions(context);
    }
  }
  Request delta = req;
  delta.set_answer_encoding(di::v1::ANSWER_ENCODING_DELTA_VARINT);
  mode("unary raw", req, false);
  mode("unary delta", delta, false);
  mode("stream raw", req, true);
  mode("stream delta", delta, true);
  // The columnar form of the same step (what the Python client sends).
  mode("unary columnar raw", columnar, false);
  mode("stream columnar raw", columnar, true);
  for (int depth : {1, 4}) {
    if (!wanted("stream raw pipelined")) break;
    std::printf("%-30s %9.2f GB/s of payload (request + response)\n",
                ("stream raw pipelined x" + std::to_string(depth)).c_str(),
                RunPipelined(*stub, req, depth, warmup + iters));
    std::fflush(stdout);
  }

  // The modes below need the server's shared-memory socket.
  if (!wanted("unary shm") && !wanted("ring")) return 0;
  const std::string name = "/di-bench-" + std::to_string(getpid());
  const uint64_t size = 64 << 20;
  auto shm = di::client::SharedMemory::Create(name, size);
  if (!shm.ok()) {
    std::fprintf(stderr, "shm: %s\n", shm.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<uint64_t> region =
      di::client::RegisterMemfd(info.shm_socket(), (*shm)->fd(), size);
  if (!region.ok()) {
    std::fprintf(stderr, "RegisterSharedMemory (start the server with --shm-socket): %s\n",
                 region.status().ToString().c_str());
    return 1;
  }
  Request shared = req;
  MoveToShared(shared, (*shm)->data(), *region);
  mode("unary shm", shared, false);
  mode("stream shm", shared, true);

  // The step ring: one descriptor per step, the tensors written into the ring's data area
  // once (a worker writes them in place), at the default spins and spinning.
  absl::StatusOr<std::unique_ptr<di::client::IndexerClient>> control =
      di::client::IndexerClient::Connect(target);
  if (!control.ok()) {
    std::fprintf(stderr, "connect: %s\n", control.status().ToString().c_str());
    return 1;
  }
  // `device`: q / weights / answer in the CUDA IPC buffer `device` describes (cuda_ipc).
  auto ring_modes = [&](const Request* device, uint64_t ipc_region) {
    if (!wanted("ring")) return;
    for (const bool spin : {false, true}) {
      di::client::FastPathOptions fo;
      fo.data_bytes = uint64_t{8} << 20;
      if (spin) {
        fo.server_spin_us = 1000;
        fo.client_spin_us = 5000;
      }
      absl::StatusOr<std::unique_ptr<di::client::FastPathRing>> ring =
          di::client::FastPathRing::Create(**control, fo);
      if (!ring.ok()) {
        std::fprintf(stderr, "ring: %s\n", ring.status().ToString().c_str());
        std::exit(1);
      }
      absl::StatusOr<di::client::StagedStep> staged = di::client::StageRequest(
          columnar, std::span<uint8_t>((*ring)->region(), (*ring)->region_bytes()),
          (*ring)->data_offset(), info.topk(), info.num_candidate_blocks());
      if (!staged.ok()) {
        std::fprintf(stderr, "stage: %s\n", staged.status().ToString().c_str());
        std::exit(1);
      }
      di::client::RingStep step = staged->step;
      std::string name = "ring shm q + shm answer";
      if (device != nullptr) {
        const auto& ci = device->cuda_ipc();
        step.descriptor.flags |= di::ring::kAnswerCudaIpc | di::ring::kInputsCudaIpc;
        step.descriptor.cuda_ipc_region_id = ipc_region;
        step.descriptor.q_offset = ci.q_offset();
        step.descriptor.weights_offset = ci.weights_offset();
        step.descriptor.answer_offset = 0;
        name = "ring ipc q + ipc answer";
      }
      if (spin) name += " spin";
      PrintRow(name, RunRing(**ring, step, warmup, iters, step_id), true);
    }
  };
  ring_modes(nullptr, 0);
#ifdef DI_BENCH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 && info.backend() == "cuda") {
    void* buffer = nullptr;
    const size_t bytes = size_t(requests) * info.topk() * 4;
    const size_t buffer_bytes = (bytes + 4095) / 4096 * 4096 +
                                (req.q().data().size() + 4095) / 4096 * 4096 +
                                req.weights().data().size();
    cudaIpcMemHandle_t handle;
    // The worker's "inputs ready" / "answer ready" events (the event modes below).
    cudaEvent_t inputs_event = nullptr, answer_event = nullptr;
    cudaIpcEventHandle_t inputs_handle, answer_handle;
    constexpr unsigned kIpcEvent = cudaEventInterprocess | cudaEventDisableTiming;
    if (cudaSetDevice(0) != cudaSuccess || cudaMalloc(&buffer, buffer_bytes) != cudaSuccess ||
        cudaIpcGetMemHandle(&handle, buffer) != cudaSuccess ||
        cudaEventCreateWithFlags(&inputs_event, kIpcEvent) != cudaSuccess ||
        cudaEventCreateWithFlags(&answer_event, kIpcEvent) != cudaSuccess ||
        cudaIpcGetEventHandle(&inputs_handle, inputs_event) != cudaSuccess ||
        cudaIpcGetEventHandle(&answer_handle, answer_event) != cudaSuccess) {
      std::fprintf(stderr, "cuda: cannot export a buffer and its events\n");
      return 1;
    }
    grpc::ClientContext ictx;
    di::v1::RegisterCudaIpcMemoryRequest ireq;
    ireq.set_handle(&handle, sizeof(handle));
    ireq.set_size(buffer_bytes);
    ireq.set_device(0);
    ireq.set_inputs_event(&inputs_handle, sizeof(inputs_handle));
    ireq.set_answer_event(&answer_handle, sizeof(answer_handle));
    di::v1::RegisterCudaIpcMemoryResponse iresp;
    if (grpc::Status is = stub->RegisterCudaIpcMemory(&ictx, ireq, &iresp); !is.ok()) {
      std::fprintf(stderr, "RegisterCudaIpcMemory: %s\n", is.error_message().c_str());
      return 1;
    }
    Request ipc = req;
    ipc.mutable_cuda_ipc()->set_region_id(iresp.region_id());
    mode("unary ipc (q in request)", ipc, false);
    mode("stream ipc (q in request)", ipc, true);
    Request both = shared;
    both.mutable_cuda_ipc()->set_region_id(iresp.region_id());
    mode("unary shm q + ipc answer", both, false);
    mode("stream shm q + ipc answer", both, true);
    // q and the weights in the device buffer too (what a worker whose q is on its GPU sends).
    Request device_q = req;
    {
      auto* ci = device_q.mutable_cuda_ipc();
      ci->set_region_id(iresp.region_id());
      const uint64_t q_at = (bytes + 4095) / 4096 * 4096;
      ci->set_q_offset(q_at);
      const uint64_t w_at = q_at + (req.q().data().size() + 4095) / 4096 * 4096;
      ci->set_weights_offset(w_at);
      if (cudaMemcpy(static_cast<char*>(buffer) + q_at, req.q().data().data(),
                     req.q().data().size(), cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaMemcpy(static_cast<char*>(buffer) + w_at, req.weights().data().data(),
                     req.weights().data().size(), cudaMemcpyHostToDevice) != cudaSuccess) {
        std::fprintf(stderr, "cuda: cannot fill the buffer\n");
        return 1;
      }
      device_q.mutable_q()->clear_data();
      device_q.mutable_weights()->clear_data();
    }
    mode("unary ipc q + ipc answer", device_q, false);
    mode("stream ipc q + ipc answer", device_q, true);
    ring_modes(&device_q, iresp.region_id());
    if (worker_copy_mb > 0) {
      RunWorkerModes(**control, device_q, iresp.region_id(), buffer, inputs_event, answer_event,
                     worker_copy_mb, warmup, iters, step_id);
    }
    cudaEventDestroy(inputs_event);
    cudaEventDestroy(answer_event);
    cudaFree(buffer);
  } else {
    std::printf("# ipc modes skipped: no GPU here or the server is not on cuda\n");
  }
#else
  std::printf("# ipc modes skipped: built without CUDA\n");
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string profile_name = "v32";
  std::string target;
  int requests = 64, iters = 200, warmup = 20;
  int64_t context = 32768;
  uint64_t first_id = 1000000;
  bool pieces = true;
  bool fixed_key_position = false;
  std::string edges = "both";
  int edge_workers = 0;
  int worker_copy_mb = 128;
  std::vector<std::string> serve;
  std::string serve_socket;
  int64_t malloc_keep_mb = 64;
  std::vector<std::string> modes;
  CLI::App app{"decode-indexer-bench-data-plane: per-step transport cost"};
  app.add_option("--profile", profile_name, "built-in profile or file (echo mode)")
      ->capture_default_str();
  app.add_option("--target", target,
                 "host:port or unix:PATH of a running decode-indexer-server (server mode); "
                 "empty: echo mode");
  app.add_option("--requests", requests, "requests (rows) per step")->capture_default_str();
  app.add_option("--context", context,
                 "keys per sequence (server mode) / cache the echoed answers come from")
      ->capture_default_str();
  app.add_option("--iters", iters, "timed steps per mode")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps per mode")->capture_default_str();
  app.add_option("--first-id", first_id, "first sequence id (server mode)")->capture_default_str();
  app.add_option("--worker-copy-mb", worker_copy_mb,
                 "server mode on a GPU: the worker modes' GPU work a step (a device-to-device "
                 "copy of this many MB; 0: no worker modes)")
      ->capture_default_str();
  app.add_flag("!--no-pieces", pieces, "skip timing the pieces (echo mode)");
  app.add_flag("--fixed-key-position", fixed_key_position,
               "server mode: every step writes its new keys at position --context (as "
               "bench/worker/py_client_cpu.py does), so the caches and the compute stay the same "
               "size however many steps run; default: appended, the caches grow a key a step");
  app.add_option("--grpc-edge", edges,
                 "echo mode: the service's gRPC edge, sync, callback or both (in one run)")
      ->check(CLI::IsMember({"sync", "callback", "both"}))
      ->capture_default_str();
  app.add_option("--edge-workers", edge_workers,
                 "echo mode: the callback edge's worker threads (0: the server's default)")
      ->capture_default_str();
  app.add_option("--modes", modes,
                 "server mode: only these modes (e.g. \"unary raw\" \"unary columnar raw\" "
                 "\"stream columnar raw\" \"stream raw pipelined\" \"unary shm\" ring)");
  app.add_option("--serve", serve,
                 "echo mode: serve the echo service on this host:port (port 0: any; printed) "
                 "or Unix socket (unix:PATH), repeatable, until SIGINT / SIGTERM, for clients "
                 "in other processes")
      ->excludes("--target");
  app.add_option("--serve-socket", serve_socket, "with --serve: the shared-memory socket's path");
  app.add_option("--malloc-keep-mb", malloc_keep_mb,
                 "this process's allocator keeps this much freed heap for reuse, as the server "
                 "and the clients do by default (0: glibc's defaults; common/malloc_tuning.h)")
      ->capture_default_str();
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  if (malloc_keep_mb > 0 && !di::KeepFreedMemory(malloc_keep_mb)) {
    std::fprintf(stderr, "# --malloc-keep-mb not applied (not glibc's malloc)\n");
  }
  std::mt19937_64 rng(42);
  if (!target.empty()) {
    return RunServer(target, requests, context, warmup, iters, first_id, rng, worker_copy_mb, modes,
                     fixed_key_position);
  }

  absl::StatusOr<di::config::Profile> profile = di::config::LoadProfile(profile_name);
  if (!profile.ok()) {
    std::fprintf(stderr, "%s\n", profile.status().ToString().c_str());
    return 2;
  }
  if (!serve.empty()) return ServeEcho(*profile, context, serve, serve_socket, edge_workers);
  const int H = profile->num_heads, D = profile->head_dim, K = profile->topk;
  int dense = 0;
  while (profile->layers[dense].role != di::config::LayerRole::kDense) ++dense;
  const bool fp8 = profile->layers[dense].cache_format == di::kernels::CacheFormat::kFp8;

  // The request: `requests` sequences, one row each, pre-quantized q in the cache format.
  Request req;
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
  return RunEcho(*profile, req, context, warmup, iters, pieces, edges, edge_workers);
}
