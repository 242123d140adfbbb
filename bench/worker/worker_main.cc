// decode-indexer-bench-worker: an attention worker as a serving stack runs it (issue 18 item 5).
//
// For each decode token, for each of --layers layers: the worker produces the layer's q, weights
// and new indexer keys on its GPU with a small kernel (deterministic from token and layer, FP8
// e4m3 codes), calls the indexer for that layer, waits for the answer, and runs a stand-in
// attention kernel on its stream that reads the answer (gathers 16 bytes of a device buffer at
// each top-k index of a row and reduces them); then the next layer. A token's time is the wall
// time of its layers to the last attention's end. Paths (--paths, side by side in one run):
//
//   unary     gRPC DecodeStep, columnar form; q copied to host, the answer back to the device
//   stream    one gRPC DecodeStream for the run, the same requests
//   shm       gRPC DecodeStep with q, weights, new keys and the answer in a registered memfd
//   ring      the step ring (client/fast_path.h): descriptor + doorbell, tensors and answer in
//             the ring's region (page-locked by the worker for its copies)
//   ring-ipc  the ring with q, weights and the answer in the worker's CUDA IPC buffer
//             (kInputsCudaIpc | kAnswerCudaIpc): q never leaves the device
//   ring-ipc-events  ring-ipc with CUDA IPC events (kWaitInputsEvent | kRecordAnswerEvent): the
//             worker records "inputs ready" after the kernel that makes q and rings at once,
//             its stream waits on "answer ready" before the attention: no host wait in the
//             layer loop but the completion (the new keys, made on the host, go through the
//             ring's region)
//   ring-ipc-keys  ring-ipc with the new keys and their scales read from the CUDA IPC buffer
//             too (kKeysCudaIpc): nothing of the layer's inputs goes through the host; the
//             worker waits for its stream before ringing (the kernels that make q and keys)
//   ring-ipc-keys-events  both: no copy and no host wait in the layer loop but the completion
//   inproc    the project's executor linked in, q and answer in device memory (QInput::on_device,
//             a device AnswerSink), the same loop: what the service costs over its kernels
//   (ring-spin, ring-ipc-spin: the ring with the server's poller and the worker spinning.)
//   The baseline (always run): the same loop with the indexer call replaced by nothing (q
//   production and the stand-in attention over a fixed answer); a path's per-token indexer
//   overhead = its token time - the baseline's (p50 and p90 over the timed tokens).
//
// Every step appends one new key per sequence at position context + token (new_keys_positions,
// the same in every path), so the cache a (token, layer) sees is the same in every path and the
// answers must be equal: each path's per-row attention results (sum of gathered words, a hash of
// the indices, counts of valid and out-of-range indices) are compared with the first path's,
// and an index outside [0, length) or a row with fewer than min(K, length) valid indices fails
// the run (exit 1). Without a GPU (or with --host) q production and attention run on the host
// (the same values) and the paths that need CUDA are skipped: the CPU smoke run.
//
// The prefill: --requests sequences x --context keys in each of --layers layers, one ring step
// per layer carrying all of the layer's keys from the ring's region (no gRPC per chunk); the
// in-process executor takes the same keys through AppendKeys. Both print their fill time.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/worker/worker_kernels.h"
#include "client/fast_path.h"
#include "client/indexer_client.h"
#include "common/cli.h"
#include "server/config/profile.h"
#include "server/exec/answer_sink.h"
#include "server/exec/executor.h"

namespace di = decode_indexer;
namespace bw = decode_indexer::bench_worker;

namespace {

using Clock = std::chrono::steady_clock;

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// A failure: thrown, so that one path's failure is reported (in the table and the JSON) and the
// other paths still run; main exits 1 when any failed.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void Die(const std::string& what) { throw Failure(what); }
void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(what + ": " + s.ToString());
}
// Page-locks a region for the worker's copies; a failure is not fatal (the copies are then
// pageable) and leaves no error behind for the next launch to pick up.
bool PageLock(void* p, size_t bytes) {
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}
void CudaCheck(int e, const char* what) {
  if (e != 0) Die(std::string(what) + ": " + cudaGetErrorString(static_cast<cudaError_t>(e)));
}

struct Options {
  std::string target;
  std::string profile = "v32";
  std::string inproc_backend = "auto";
  int layers = 61, requests = 64, tokens = 50, warmup = 5;
  int64_t context = 32768;
  int fill_chunk = 0;  // keys a sequence per fill step; 0: the whole context in one
  uint64_t first_id = 7000000;
  std::string paths =
      "unary,stream,shm,ring,ring-ipc,ring-ipc-events,ring-ipc-keys,ring-ipc-keys-events,inproc";
  std::string json;
  bool host = false;
  // Tests: PATH:range (an index past the length) or PATH:differ (another valid index) in that
  // path's answer of the last token's first layer, before the attention reads it (host mode).
  std::string corrupt;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

struct PathResult {
  std::string name;
  std::string note;  // why skipped, or what it did
  bool ran = false;
  std::vector<double> token_us;  // timed tokens
  std::vector<double> call_us;   // per layer: inputs ready on the host side to answer usable
};

// The worker's buffers. GPU mode: device memory and page-locked host staging; host mode: host
// memory for all (the "device" pointers are host pointers).
class Worker {
 public:
  Worker(const Options& o, bw::Shape s, bool gpu) : o_(o), s_(s), gpu_(gpu) {
    layout_ = bw::InputLayout::For(s);
    kv_len_ = o.context + o.warmup + o.tokens + 1;
    const size_t answer_bytes = size_t(s.rows) * s.topk * 4;
    const size_t kv_bytes = size_t(s.rows) * kv_len_ * 16;
    const size_t out_bytes = size_t(o.layers) * s.rows * sizeof(bw::AttnOut);
    // A fixed valid answer for the baseline: row r takes [0, K) (all < context + 1).
    std::vector<int32_t> fixed(size_t(s.rows) * s.topk);
    for (size_t i = 0; i < fixed.size(); ++i) {
      fixed[i] = static_cast<int32_t>(i % s.topk) < o.context ? int32_t(i % s.topk) : -1;
    }
    if (gpu_) {
      CudaCheck(cudaSetDevice(0), "cudaSetDevice");
      CudaCheck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
      CudaCheck(cudaMalloc(&inputs_, layout_.bytes), "malloc inputs");
      CudaCheck(cudaMalloc(&answer_, answer_bytes), "malloc answer");
      CudaCheck(cudaMalloc(&fixed_answer_, answer_bytes), "malloc answer");
      CudaCheck(cudaMalloc(&kv_, kv_bytes), "malloc kv");
      CudaCheck(cudaMalloc(&out_, out_bytes), "malloc out");
      CudaCheck(cudaMallocHost(&host_inputs_, layout_.bytes), "malloc host inputs");
      CudaCheck(cudaMallocHost(&host_out_, out_bytes), "malloc host out");
      CudaCheck(cudaMemcpy(fixed_answer_, fixed.data(), answer_bytes, cudaMemcpyHostToDevice),
                "copy fixed answer");
      fixed_host_ = fixed;
      CudaCheck(bw::LaunchFillKv(static_cast<uint32_t*>(kv_), s.rows, kv_len_, stream_), "fill kv");
      CudaCheck(cudaStreamSynchronize(stream_), "fill kv");
    } else {
      host_buffers_.resize(4);
      host_buffers_[0].resize(layout_.bytes);
      host_buffers_[1].resize(answer_bytes);
      host_buffers_[2].resize(kv_bytes);
      host_buffers_[3].resize(out_bytes);
      inputs_ = host_buffers_[0].data();
      host_inputs_ = inputs_;
      answer_ = host_buffers_[1].data();
      kv_ = host_buffers_[2].data();
      out_ = host_buffers_[3].data();
      host_out_ = out_;
      fixed_host_ = fixed;
      fixed_answer_ = fixed_host_.data();
      bw::FillKvHost(static_cast<uint32_t*>(kv_), s.rows, kv_len_);
    }
  }
  ~Worker() {
    if (!gpu_) return;
    for (void* p : {inputs_, answer_, fixed_answer_, kv_, out_}) cudaFree(p);
    cudaFreeHost(host_inputs_);
    cudaFreeHost(host_out_);
    cudaStreamDestroy(stream_);
  }

  bool gpu() const { return gpu_; }
  const bw::Shape& shape() const { return s_; }
  const bw::InputLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_; }
  uint8_t* inputs() { return static_cast<uint8_t*>(inputs_); }
  uint8_t* host_inputs() { return static_cast<uint8_t*>(host_inputs_); }
  int32_t* answer() { return static_cast<int32_t*>(answer_); }
  size_t answer_bytes() const { return size_t(s_.rows) * s_.topk * 4; }

  // q, weights, keys and scales of (token, layer) into `base` laid out as layout() says
  // (device memory in GPU mode: a launch on the stream; host memory otherwise).
  void Produce(int32_t token, int32_t layer, uint8_t* base) {
    auto* q = base + layout_.q;
    auto* w = reinterpret_cast<float*>(base + layout_.weights);
    auto* k = base + layout_.keys;
    auto* ks = reinterpret_cast<float*>(base + layout_.key_scales);
    if (gpu_) {
      CudaCheck(bw::LaunchProduce(s_, token, layer, q, w, k, ks, stream_), "produce");
    } else {
      bw::ProduceHost(s_, token, layer, q, w, k, ks);
    }
  }
  // Device (GPU mode) or host copies on the stream; `sync` waits for the stream.
  void CopyToHost(void* dst, const void* src, size_t bytes, bool sync) {
    if (gpu_) {
      CudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "copy to host");
      if (sync) CudaCheck(cudaStreamSynchronize(stream_), "sync");
    } else if (dst != src) {
      std::memcpy(dst, src, bytes);
    }
  }
  void CopyToDevice(void* dst, const void* src, size_t bytes) {
    if (gpu_) {
      CudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "copy to dev");
    } else if (dst != src) {
      std::memcpy(dst, src, bytes);
    }
  }
  void Sync() {
    if (gpu_) CudaCheck(cudaStreamSynchronize(stream_), "sync");
  }
  // The stand-in attention of `layer` over `answer` (device memory in GPU mode).
  void Attention(int32_t token, int32_t layer, const int32_t* answer) {
    if (!gpu_ && !corrupt_.empty() && corrupt_path_ == path_ && layer == 0 &&
        token == o_.warmup + o_.tokens - 1) {
      int32_t* a = const_cast<int32_t*>(answer);
      a[0] = corrupt_ == "range" ? static_cast<int32_t>(o_.context + token + 1)
                                 : static_cast<int32_t>((a[0] + 1) % (o_.context + token + 1));
    }
    auto* out = static_cast<bw::AttnOut*>(out_) + size_t(layer) * s_.rows;
    const int64_t length = o_.context + token + 1;
    if (gpu_) {
      CudaCheck(bw::LaunchAttention(s_, answer, static_cast<const uint32_t*>(kv_), kv_len_, length,
                                    out, stream_),
                "attention");
    } else {
      bw::AttentionHost(s_, answer, static_cast<const uint32_t*>(kv_), kv_len_, length, out);
    }
  }
  void SetPath(const std::string& path) { path_ = path; }
  void CorruptForTesting(const std::string& spec) {
    const size_t colon = spec.find(':');
    if (colon == std::string::npos) return;
    corrupt_path_ = spec.substr(0, colon);
    corrupt_ = spec.substr(colon + 1);
  }
  const int32_t* fixed_answer() const { return static_cast<const int32_t*>(fixed_answer_); }
  const std::vector<int32_t>& fixed_answer_host() const { return fixed_host_; }
  int64_t kv_len() const { return kv_len_; }
  // The token's attention results to the host (ends the token: waits for the stream).
  const bw::AttnOut* FinishToken() {
    const size_t bytes = size_t(o_.layers) * s_.rows * sizeof(bw::AttnOut);
    if (gpu_) {
      CudaCheck(cudaMemcpyAsync(host_out_, out_, bytes, cudaMemcpyDeviceToHost, stream_), "out");
      CudaCheck(cudaStreamSynchronize(stream_), "sync");
    }
    return static_cast<const bw::AttnOut*>(host_out_);
  }

 private:
  const Options& o_;
  bw::Shape s_;
  bool gpu_;
  bw::InputLayout layout_;
  int64_t kv_len_ = 0;
  cudaStream_t stream_ = nullptr;
  void *inputs_ = nullptr, *answer_ = nullptr, *fixed_answer_ = nullptr, *kv_ = nullptr,
       *out_ = nullptr;
  void *host_inputs_ = nullptr, *host_out_ = nullptr;
  std::vector<std::vector<uint8_t>> host_buffers_;
  std::vector<int32_t> fixed_host_;
  std::string path_, corrupt_path_, corrupt_;
};

// GPU mode: the kernels against their host twins (worker_host.cc) on one (token, layer), so
// the CPU smoke run plays the values the GPU run sends. Answers what differs (empty: none); the
// run goes on (its figures stand) and exits 1 at the end.
std::string SelfCheck(Worker& w, const Options& o) {
  const bw::Shape& s = w.shape();
  const bw::InputLayout& L = w.layout();
  const int32_t token = 3, layer = std::min(5, o.layers - 1);
  std::vector<uint8_t> host(L.bytes), dev(L.bytes);
  bw::ProduceHost(s, token, layer, host.data() + L.q,
                  reinterpret_cast<float*>(host.data() + L.weights), host.data() + L.keys,
                  reinterpret_cast<float*>(host.data() + L.key_scales));
  w.Produce(token, layer, w.inputs());
  w.CopyToHost(dev.data(), w.inputs(), L.bytes, true);
  const std::pair<uint64_t, uint64_t> parts[] = {{L.q, uint64_t(s.rows) * s.heads * s.dim},
                                                 {L.weights, uint64_t(s.rows) * s.heads * 4},
                                                 {L.keys, uint64_t(s.rows) * s.dim},
                                                 {L.key_scales, uint64_t(s.rows) * 4}};
  for (const auto& [at, bytes] : parts) {
    if (std::memcmp(host.data() + at, dev.data() + at, bytes) != 0) {
      return absl::StrCat("the produce kernel differs from its host twin at offset ", at);
    }
  }
  std::vector<uint32_t> kv(size_t(s.rows) * w.kv_len() * 4);
  bw::FillKvHost(kv.data(), s.rows, w.kv_len());
  std::vector<bw::AttnOut> want(s.rows);
  bw::AttentionHost(s, w.fixed_answer_host().data(), kv.data(), w.kv_len(), o.context + 1,
                    want.data());
  w.Attention(0, 0, w.fixed_answer());
  const bw::AttnOut* got = w.FinishToken();
  for (int r = 0; r < s.rows; ++r) {
    if (std::memcmp(&got[r], &want[r], sizeof(bw::AttnOut)) != 0) {
      return absl::StrCat("the attention kernel differs from its host twin at row ", r);
    }
  }
  return "";
}

// The prefill's keys, one sequence block after another: block b holds `context` keys. Layer l's
// sequence i takes block (i + l) % requests, so layers differ while the bytes are made once.
struct Prefill {
  std::vector<uint8_t> keys;
  std::vector<float> scales;
};

// Each path's per-(token, layer, row) attention results, against the first path that ran.
class AnswerCheck {
 public:
  AnswerCheck(const Options& o, const bw::Shape& s) : o_(o), s_(s) {}
  // Fails the run on an invalid answer or one that differs from the reference.
  void Token(const std::string& path, int32_t token, const bw::AttnOut* out) {
    const int64_t length = o_.context + token + 1;
    const uint32_t want_valid = static_cast<uint32_t>(std::min<int64_t>(s_.topk, length));
    for (int l = 0; l < o_.layers; ++l) {
      for (int r = 0; r < s_.rows; ++r) {
        const bw::AttnOut& a = out[size_t(l) * s_.rows + r];
        if (a.bad != 0 || a.valid != want_valid) {
          Die(absl::StrCat(path, ": token ", token, " layer ", l, " row ", r, ": ", a.bad,
                           " indices outside [0, ", length, "), ", a.valid, " valid of ",
                           want_valid, " expected"));
        }
        const auto key = std::make_tuple(token, l, r);
        auto it = ref_.find(key);
        if (it == ref_.end()) {
          ref_[key] = {a, path};
        } else if (it->second.first.hash != a.hash || it->second.first.sum != a.sum) {
          Die(absl::StrCat(path, ": token ", token, " layer ", l, " row ", r,
                           ": answer differs from ", it->second.second, "'s"));
        }
      }
    }
    ++checked_;
  }
  int64_t checked() const { return checked_; }

 private:
  const Options& o_;
  bw::Shape s_;
  std::map<std::tuple<int32_t, int, int>, std::pair<bw::AttnOut, std::string>> ref_;
  int64_t checked_ = 0;
};

// Where prefill key p of pool block b lies: chunk-major, so that a fill step of chunk c holds
// every request's keys of that chunk contiguously (block after block).
struct PrefillLayout {
  int64_t context = 0, chunk = 0;
  int32_t blocks = 0;
  int64_t ChunkKeys(int64_t start) const { return std::min(chunk, context - start); }
  // Index (in keys) of block b's key `start` (a chunk start) in the pool.
  int64_t At(int32_t b, int64_t start) const {
    return start * blocks + int64_t(b) * ChunkKeys(start);
  }
};

using Request = di::v1::DecodeStepRequest;

void ShapeOnly(di::v1::Tensor* t, di::v1::DType dtype, std::initializer_list<int64_t> shape) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
}

// One path's layer: (token, layer) -> the call's time in µs.
using LayerFn = std::function<double(int32_t token, int32_t layer)>;

PathResult RunPath(const std::string& name, const Options& o, Worker& w, AnswerCheck* check,
                   const LayerFn& layer_fn) {
  PathResult r;
  r.name = name;
  r.ran = true;
  w.SetPath(name);
  for (int32_t tok = 0; tok < o.warmup + o.tokens; ++tok) {
    const auto t0 = Clock::now();
    std::vector<double> calls;
    for (int32_t l = 0; l < o.layers; ++l) calls.push_back(layer_fn(tok, l));
    const bw::AttnOut* out = w.FinishToken();
    const auto t1 = Clock::now();
    if (check != nullptr) check->Token(name, tok, out);
    if (tok >= o.warmup) {
      r.token_us.push_back(Us(t0, t1));
      r.call_us.insert(r.call_us.end(), calls.begin(), calls.end());
    }
  }
  std::printf("# %-14s token p50 %9.1f us (%d tokens x %d layers)\n", name.c_str(),
              Percentile(r.token_us, 0.5), o.tokens, o.layers);
  std::fflush(stdout);
  return r;
}

struct Run {
  const Options& o;
  Worker& w;
  AnswerCheck& check;
  std::vector<uint64_t> ids;
  const Prefill& prefill;
  PrefillLayout pl;
  std::vector<PathResult> results;
  double server_fill_s = -1, inproc_fill_s = -1;
  uint64_t step_id = 1;
  bool failed = false;
  // Records a path that failed (after the worker's stream drained).
  void Failed(const std::string& path, const std::string& what) {
    std::fprintf(stderr, "bench-worker: %s\n", what.c_str());
    cudaError_t e = w.gpu() ? cudaStreamSynchronize(w.stream()) : cudaSuccess;
    (void)e;
    PathResult r;
    r.name = path;
    r.note = "FAILED: " + what;
    results.push_back(std::move(r));
    failed = true;
  }
};

// The server's paths. Fills the server first (one ring step a layer and chunk).
void ServerPaths(Run& run, const std::vector<std::string>& paths) {
  const Options& o = run.o;
  Worker& w = run.w;
  const bw::Shape& s = w.shape();
  const bw::InputLayout& L = w.layout();
  const int R = s.rows, H = s.heads, D = s.dim, K = s.topk;
  di::client::ClientOptions co;
  co.connect_timeout = std::chrono::seconds(60);
  co.timeout = std::chrono::seconds(600);
  absl::StatusOr<std::unique_ptr<di::client::IndexerClient>> client =
      di::client::IndexerClient::Connect(o.target, co);
  Check(client.status(), "connect " + o.target);
  di::client::IndexerClient& c = **client;
  for (uint64_t id : run.ids) Check(c.CreateSequence(id), "CreateSequence");

  // Prefill: the pool once into a ring's region, then one step a (chunk, layer).
  {
    const uint64_t key_bytes = run.prefill.keys.size(), scale_bytes = run.prefill.scales.size() * 4;
    const uint64_t q_at = bw::InputLayout::Align(key_bytes + scale_bytes);
    const uint64_t w_at = q_at + bw::InputLayout::Align(uint64_t(R) * H * D);
    const uint64_t a_at = w_at + bw::InputLayout::Align(uint64_t(R) * H * 4);
    di::client::FastPathOptions fo;
    fo.data_bytes = a_at + w.answer_bytes() + 4096;
    fo.slot_bytes = std::max<uint32_t>(16384, 256 + 24 * R + 64);
    absl::StatusOr<std::unique_ptr<di::client::FastPathRing>> ring =
        di::client::FastPathRing::Create(c, fo);
    Check(ring.status(), "fill ring");
    uint8_t* data = (*ring)->region() + (*ring)->data_offset();
    const auto t0 = Clock::now();
    std::memcpy(data, run.prefill.keys.data(), key_bytes);
    std::memcpy(data + key_bytes, run.prefill.scales.data(), scale_bytes);
    std::vector<uint64_t> order(R);
    std::vector<int32_t> counts(R);
    for (int64_t start = 0; start < o.context; start += run.pl.chunk) {
      const int64_t n = run.pl.ChunkKeys(start);
      std::fill(counts.begin(), counts.end(), static_cast<int32_t>(n));
      for (int32_t l = 0; l < o.layers; ++l) {
        // Request j takes block j: sequence (j - l) mod R, so sequence i holds block (i + l) % R.
        for (int j = 0; j < R; ++j) order[j] = run.ids[((j - l) % R + R) % R];
        di::client::RingStep st;
        auto& d = st.descriptor;
        d.step_id = run.step_id++;
        d.layer = l;
        d.rows_per_sequence = 1;
        d.q_dtype = di::v1::DTYPE_FP8_E4M3;
        d.weights_dtype = di::v1::DTYPE_FP32;
        d.new_keys_dtype = di::v1::DTYPE_FP8_E4M3;
        d.new_key_scales_dtype = di::v1::DTYPE_FP32;
        d.new_keys_rows = n * R;
        const uint64_t base = (*ring)->data_offset();
        d.new_keys_offset = base + uint64_t(run.pl.At(0, start)) * D;
        d.new_key_scales_offset = base + key_bytes + uint64_t(run.pl.At(0, start)) * 4;
        d.q_offset = base + q_at;
        d.weights_offset = base + w_at;
        d.answer_offset = base + a_at;
        st.sequence_ids = order;
        st.new_key_counts = counts;
        absl::StatusOr<di::client::RingCompletion> done =
            (*ring)->Step(st, std::chrono::seconds(600));
        Check(done.status(), "fill step");
        Check(done->status, absl::StrCat("fill step layer ", l));
      }
    }
    run.server_fill_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double gb = double(o.layers) * R * o.context * (D + 4) / 1e9;
    std::printf(
        "# server fill: %d layers x %d requests x %lld keys (%.2f GB) in %.2f s (%.2f GB/s)\n",
        o.layers, R, static_cast<long long>(o.context), gb, run.server_fill_s,
        gb / run.server_fill_s);
    std::fflush(stdout);
  }

  std::vector<int64_t> positions(R);
  auto set_positions = [&](int32_t tok) {
    std::fill(positions.begin(), positions.end(), o.context + tok);
  };
  auto check_answer = [&](const absl::StatusOr<di::client::StepAnswer>& a, const char* path,
                          bool in_shm) {
    Check(a.status(), std::string(path) + " step");
    if (a->rows != R || a->k != K || a->in_shared_memory != in_shm ||
        (!in_shm && a->topk.size() != size_t(R) * K)) {
      Die(absl::StrCat(path, ": answer of ", a->rows, " x ", a->k, " (", a->topk.size(),
                       " entries), expected ", R, " x ", K));
    }
  };
  auto columnar = [&](int32_t tok, int32_t l) {
    set_positions(tok);
    di::client::ColumnarStep cs;
    cs.layer = l;
    cs.step_id = run.step_id++;
    cs.sequence_ids = run.ids;
    cs.rows_per_sequence = 1;
    const uint8_t* h = w.host_inputs();
    cs.q = {
        di::v1::DTYPE_FP8_E4M3, {R, H, D}, std::span<const uint8_t>(h + L.q, size_t(R) * H * D)};
    cs.weights = {
        di::v1::DTYPE_FP32, {R, H}, std::span<const uint8_t>(h + L.weights, size_t(R) * H * 4)};
    cs.new_keys = {
        di::v1::DTYPE_FP8_E4M3, {R, D}, std::span<const uint8_t>(h + L.keys, size_t(R) * D)};
    cs.new_key_scales = {
        di::v1::DTYPE_FP32, {R}, std::span<const uint8_t>(h + L.key_scales, size_t(R) * 4)};
    cs.new_keys_positions = positions;
    return cs;
  };

  for (const std::string& path : paths) {
    try {
      if (path == "unary" || path == "stream") {
        const bool stream = path == "stream";
        std::unique_ptr<di::client::StepStream> st;
        if (stream) {
          absl::StatusOr<std::unique_ptr<di::client::StepStream>> opened = c.OpenStream();
          Check(opened.status(), "OpenStream");
          st = *std::move(opened);
        }
        run.results.push_back(RunPath(path, o, w, &run.check, [&](int32_t tok, int32_t l) {
          w.Produce(tok, l, w.inputs());
          w.CopyToHost(w.host_inputs(), w.inputs(), L.bytes, true);
          const auto t0 = Clock::now();
          const di::client::ColumnarStep cs = columnar(tok, l);
          absl::StatusOr<di::client::StepAnswer> a;
          if (stream) {
            Check(st->WriteColumnar(cs), "stream write");
            a = st->Read();
          } else {
            a = c.DecodeStepColumnar(cs);
          }
          check_answer(a, path.c_str(), false);
          const auto t1 = Clock::now();
          w.CopyToDevice(w.answer(), a->topk.data(), w.answer_bytes());
          w.Attention(tok, l, w.answer());
          return Us(t0, t1);
        }));
        if (stream) Check(st->Finish(), "stream finish");
      } else if (path == "shm") {
        const uint64_t a_at = L.bytes;
        const uint64_t bytes = (a_at + w.answer_bytes() + 4095) / 4096 * 4096;
        absl::StatusOr<std::unique_ptr<di::client::SharedMemory>> shm =
            di::client::SharedMemory::Create("di-bench-worker", bytes);
        Check(shm.status(), "shm");
        absl::StatusOr<uint64_t> region = c.RegisterSharedMemory(**shm);
        Check(region.status(), "RegisterSharedMemory (start the server with --shm-socket)");
        uint8_t* base = (*shm)->data();
        const bool pinned = w.gpu() && PageLock(base, bytes);
        Request req;
        for (uint64_t id : run.ids) req.add_sequence_ids(id);
        req.set_rows_per_sequence(1);
        for (int i = 0; i < R; ++i) req.add_new_keys_positions(0);
        ShapeOnly(req.mutable_q(), di::v1::DTYPE_FP8_E4M3, {R, H, D});
        ShapeOnly(req.mutable_weights(), di::v1::DTYPE_FP32, {R, H});
        ShapeOnly(req.mutable_new_keys(), di::v1::DTYPE_FP8_E4M3, {R, D});
        ShapeOnly(req.mutable_new_key_scales(), di::v1::DTYPE_FP32, {R});
        auto* sm = req.mutable_shared_memory();
        sm->set_region_id(*region);
        sm->set_q_offset(L.q);
        sm->set_weights_offset(L.weights);
        sm->set_new_keys_offset(L.keys);
        sm->set_new_key_scales_offset(L.key_scales);
        sm->set_answer_offset(a_at);
        PathResult r = RunPath(path, o, w, &run.check, [&](int32_t tok, int32_t l) {
          if (w.gpu()) {
            w.Produce(tok, l, w.inputs());
            w.CopyToHost(base, w.inputs(), L.bytes, true);
          } else {
            w.Produce(tok, l, base);
          }
          const auto t0 = Clock::now();
          req.set_layer(l);
          req.set_step_id(run.step_id++);
          for (int i = 0; i < R; ++i) req.set_new_keys_positions(i, o.context + tok);
          absl::StatusOr<di::client::StepAnswer> a = c.DecodeStep(req);
          check_answer(a, "shm", true);
          const auto t1 = Clock::now();
          w.CopyToDevice(w.answer(), base + a_at, w.answer_bytes());
          w.Attention(tok, l, w.gpu() ? w.answer() : reinterpret_cast<int32_t*>(base + a_at));
          return Us(t0, t1);
        });
        r.note = pinned ? "region page-locked by the worker" : "";
        run.results.push_back(std::move(r));
        w.Sync();
        if (pinned) cudaHostUnregister(base);
        Check(c.UnregisterSharedMemory(*region), "UnregisterSharedMemory");
      } else if (path.rfind("ring", 0) == 0) {
        const bool ipc = path.rfind("ring-ipc", 0) == 0;
        // ring-ipc-events: no host wait in the layer loop (CUDA IPC events order the streams).
        const bool events = path.find("-events") != std::string::npos;
        // ring-ipc-keys: the new keys read from the worker's buffer too (kKeysCudaIpc).
        const bool device_keys = path.find("-keys") != std::string::npos;
        const bool spin = path.size() > 5 && path.substr(path.size() - 5) == "-spin";
        if (ipc && !w.gpu()) {
          PathResult r;
          r.name = path;
          r.note = "skipped: needs a GPU (q and the answer in the worker's CUDA IPC buffer)";
          std::printf("# %-14s %s\n", path.c_str(), r.note.c_str());
          run.results.push_back(std::move(r));
          continue;
        }
        di::client::FastPathOptions fo;
        fo.data_bytes = L.bytes + w.answer_bytes() + 4096;
        fo.slot_bytes = std::max<uint32_t>(16384, 256 + 24 * R + 64);
        if (spin) {
          fo.server_spin_us = 1000;
          fo.client_spin_us = 5000;
        }
        absl::StatusOr<std::unique_ptr<di::client::FastPathRing>> ring =
            di::client::FastPathRing::Create(c, fo);
        Check(ring.status(), "ring");
        uint8_t* region = (*ring)->region();
        const uint64_t base = (*ring)->data_offset();
        const uint64_t a_at = base + L.bytes;
        const bool pinned = w.gpu() && PageLock(region, (*ring)->region_bytes());
        // ring-ipc: [inputs | answer] in a device buffer of the worker, exported once.
        uint8_t* dev = nullptr;
        uint64_t ipc_region = 0;
        cudaEvent_t inputs_event = nullptr, answer_event = nullptr;
        if (ipc) {
          const size_t bytes = L.bytes + w.answer_bytes();
          CudaCheck(cudaMalloc(&dev, bytes), "malloc ipc buffer");
          cudaIpcMemHandle_t handle;
          CudaCheck(cudaIpcGetMemHandle(&handle, dev), "cudaIpcGetMemHandle");
          std::string inputs_handle, answer_handle;
          if (events) {
            constexpr unsigned kFlags = cudaEventInterprocess | cudaEventDisableTiming;
            CudaCheck(cudaEventCreateWithFlags(&inputs_event, kFlags), "inputs event");
            CudaCheck(cudaEventCreateWithFlags(&answer_event, kFlags), "answer event");
            cudaIpcEventHandle_t h;
            CudaCheck(cudaIpcGetEventHandle(&h, inputs_event), "cudaIpcGetEventHandle");
            inputs_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
            CudaCheck(cudaIpcGetEventHandle(&h, answer_event), "cudaIpcGetEventHandle");
            answer_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
          }
          absl::StatusOr<uint64_t> id = c.RegisterCudaIpcMemory(
              std::string_view(reinterpret_cast<const char*>(&handle), sizeof(handle)), bytes, 0,
              inputs_handle, answer_handle);
          Check(id.status(), "RegisterCudaIpcMemory");
          ipc_region = *id;
        }
        di::client::RingStep st;
        auto& d = st.descriptor;
        d.rows_per_sequence = 1;
        d.q_dtype = di::v1::DTYPE_FP8_E4M3;
        d.weights_dtype = di::v1::DTYPE_FP32;
        d.new_keys_dtype = di::v1::DTYPE_FP8_E4M3;
        d.new_key_scales_dtype = di::v1::DTYPE_FP32;
        d.new_keys_rows = R;
        d.new_keys_offset = base + L.keys;
        d.new_key_scales_offset = base + L.key_scales;
        if (ipc) {
          d.flags = di::ring::kAnswerCudaIpc | di::ring::kInputsCudaIpc;
          if (events) d.flags |= di::ring::kWaitInputsEvent | di::ring::kRecordAnswerEvent;
          if (device_keys) {
            d.flags |= di::ring::kKeysCudaIpc;
            d.new_keys_offset = L.keys;  // in the device buffer, 256-byte aligned
            d.new_key_scales_offset = L.key_scales;
          }
          d.cuda_ipc_region_id = ipc_region;
          d.q_offset = L.q;
          d.weights_offset = L.weights;
          d.answer_offset = L.bytes;
        } else {
          d.q_offset = base + L.q;
          d.weights_offset = base + L.weights;
          d.answer_offset = a_at;
        }
        st.sequence_ids = run.ids;
        st.new_keys_positions = positions;
        PathResult r = RunPath(path, o, w, &run.check, [&](int32_t tok, int32_t l) {
          if (events) {
            // q and weights (and with -keys the keys) made on the device, else the keys on the
            // host into the ring's region; "inputs ready" recorded on the worker's stream, and
            // the step sent at once.
            w.Produce(tok, l, dev);
            if (!device_keys) {
              bw::ProduceKeysHost(s, tok, l, region + base + L.keys,
                                  reinterpret_cast<float*>(region + base + L.key_scales));
            }
            CudaCheck(cudaEventRecord(inputs_event, w.stream()), "record inputs event");
          } else if (ipc && device_keys) {
            // Everything stays on the device; the server reads it once the stream is done.
            w.Produce(tok, l, dev);
            w.Sync();
          } else if (ipc) {
            // q and weights stay on the device; the new keys go through the ring's region.
            w.Produce(tok, l, dev);
            w.CopyToHost(region + base + L.keys, dev + L.keys, L.bytes - L.keys, true);
          } else if (w.gpu()) {
            w.Produce(tok, l, w.inputs());
            w.CopyToHost(region + base, w.inputs(), L.bytes, true);
          } else {
            w.Produce(tok, l, region + base);
          }
          const auto t0 = Clock::now();
          set_positions(tok);
          d.layer = l;
          d.step_id = run.step_id++;
          absl::StatusOr<di::client::RingCompletion> done = (*ring)->Step(st);
          Check(done.status(), path + " step");
          Check(done->status, path + " step");
          if (done->lengths.size() != size_t(R)) Die(path + ": completion without every length");
          const auto t1 = Clock::now();
          // The attention's stream waits for the server's "answer ready" on the GPU.
          if (events) {
            CudaCheck(cudaStreamWaitEvent(w.stream(), answer_event, 0), "wait answer event");
          }
          if (ipc) {
            w.Attention(tok, l, reinterpret_cast<const int32_t*>(dev + L.bytes));
          } else {
            w.CopyToDevice(w.answer(), region + a_at, w.answer_bytes());
            w.Attention(tok, l, w.gpu() ? w.answer() : reinterpret_cast<int32_t*>(region + a_at));
          }
          return Us(t0, t1);
        });
        r.note = std::string(spin ? "poller and worker spinning" : "") +
                 (spin && pinned ? "; " : "") + (pinned ? "region page-locked by the worker" : "");
        run.results.push_back(std::move(r));
        w.Sync();
        Check((*ring)->Unregister(), "UnregisterStepRing");
        if (pinned) cudaHostUnregister(region);
        if (ipc) {
          Check(c.UnregisterCudaIpcMemory(ipc_region), "UnregisterCudaIpcMemory");
          cudaFree(dev);
          if (events) {
            cudaEventDestroy(inputs_event);
            cudaEventDestroy(answer_event);
          }
        }
      } else {
        Die("unknown path " + path +
            " (unary, stream, shm, ring, ring-ipc, ring-ipc-events, ring-ipc-keys, "
            "ring-ipc-keys-events, ring-spin, ring-ipc-spin, inproc)");
      }
    } catch (const Failure& f) {
      run.Failed(path, f.what());
    }
  }
}

// The project's executor in this process, the same loop, q and answer in device memory.
void InProcess(Run& run) {
  const Options& o = run.o;
  Worker& w = run.w;
  const bw::Shape& s = w.shape();
  const bw::InputLayout& L = w.layout();
  const int R = s.rows, D = s.dim;
  absl::StatusOr<di::config::Profile> profile = di::config::LoadProfile(o.profile);
  Check(profile.status(), "profile");
  di::exec::ExecutorOptions eo;
  eo.backend = o.inproc_backend == "auto" ? (w.gpu() ? "cuda" : "cpu") : o.inproc_backend;
  eo.ranks = 1;
  eo.max_sequences = R;
  eo.max_requests_per_step = std::max(R, 1);
  eo.cache_pages = int64_t(R) * ((o.context + o.warmup + o.tokens + 1 + profile->page_size - 1) /
                                     profile->page_size +
                                 1) +
                   16;
  absl::StatusOr<std::unique_ptr<di::exec::Executor>> made =
      di::exec::Executor::Create(*profile, eo);
  Check(made.status(), "executor");
  di::exec::Executor& e = **made;
  for (uint64_t id : run.ids) Check(e.CreateSequence(id), "CreateSequence (in process)");
  const auto t0 = Clock::now();
  for (int64_t start = 0; start < o.context; start += run.pl.chunk) {
    const int64_t n = run.pl.ChunkKeys(start);
    for (int32_t l = 0; l < o.layers; ++l) {
      for (int i = 0; i < R; ++i) {
        const int64_t at = run.pl.At((i + l) % R, start);
        di::exec::KeysInput k;
        k.type = di::kernels::ElemType::kFp8E4M3;
        k.count = static_cast<int32_t>(n);
        k.keys = run.prefill.keys.data() + at * D;
        k.scales = run.prefill.scales.data() + at;
        Check(e.AppendKeys(run.ids[i], l, k).status(), "AppendKeys (in process)");
      }
    }
  }
  run.inproc_fill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("# in-process fill (%s executor, AppendKeys): %.2f s\n", eo.backend.c_str(),
              run.inproc_fill_s);
  const di::exec::AnswerSink sink = w.gpu()
                                        ? di::exec::AnswerSink::Device(w.answer(), nullptr)
                                        : di::exec::AnswerSink::Host(w.answer(), nullptr, false);
  di::exec::StepInput in;
  in.num_rows = R;
  in.q.type = di::kernels::ElemType::kFp8E4M3;
  in.q.q = w.inputs() + L.q;
  in.q.weights = reinterpret_cast<const float*>(w.inputs() + L.weights);
  in.q.on_device = w.gpu();
  in.answer = &sink;
  for (int i = 0; i < R; ++i) {
    di::exec::SequenceStepInput sq;
    sq.sequence_id = run.ids[i];
    sq.num_rows = 1;
    sq.new_keys.type = di::kernels::ElemType::kFp8E4M3;
    sq.new_keys.count = 1;
    sq.new_keys.keys = w.host_inputs() + L.keys + size_t(i) * D;
    sq.new_keys.scales = reinterpret_cast<const float*>(w.host_inputs() + L.key_scales) + i;
    in.sequences.push_back(sq);
  }
  PathResult r = RunPath("inproc", o, w, &run.check, [&](int32_t tok, int32_t l) {
    w.Produce(tok, l, w.inputs());
    // The new keys are host bytes in the executor's API; q and weights stay on the device.
    w.CopyToHost(w.host_inputs() + L.keys, w.inputs() + L.keys, L.bytes - L.keys, true);
    const auto t0 = Clock::now();
    in.layer = l;
    in.step_id = run.step_id++;
    for (auto& sq : in.sequences) sq.new_keys.position = o.context + tok;
    absl::StatusOr<di::exec::StepResult> res = e.DecodeStep(in);
    Check(res.status(), "in-process step");
    const auto t1 = Clock::now();
    w.Attention(tok, l, w.answer());
    return Us(t0, t1);
  });
  r.note = eo.backend + " executor, " +
           (w.gpu() ? "q and answer in device memory (device-q)" : "host q and answer");
  run.results.push_back(std::move(r));
  e.Shutdown();
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"decode-indexer-bench-worker: an attention worker's decode token through each path"};
  app.add_option("--target", o.target, "host:port of a decode-indexer-server (the server paths)");
  app.add_option("--profile", o.profile, "profile of the in-process executor (the server's own)")
      ->capture_default_str();
  app.add_option("--inproc-backend", o.inproc_backend,
                 "auto (cuda with a GPU, else cpu), cuda, cpu")
      ->capture_default_str();
  app.add_option("--layers", o.layers, "layers a token (0 .. layers-1)")->capture_default_str();
  app.add_option("--requests", o.requests, "requests (one row each)")->capture_default_str();
  app.add_option("--context", o.context, "prefilled keys per sequence and layer")
      ->capture_default_str();
  app.add_option("--tokens", o.tokens, "timed tokens a path")->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed tokens a path first")->capture_default_str();
  app.add_option("--fill-chunk", o.fill_chunk, "prefill keys a sequence a step (0: all)")
      ->capture_default_str();
  app.add_option("--first-id", o.first_id, "first sequence id")->capture_default_str();
  app.add_option(
         "--paths", o.paths,
         "unary,stream,shm,ring,ring-ipc,ring-ipc-events,ring-ipc-keys,ring-ipc-keys-events,"
         "ring-spin,ring-ipc-spin,inproc (comma list)")
      ->capture_default_str();
  app.add_option("--json", o.json, "write the figures here");
  app.add_option("--corrupt-for-testing", o.corrupt,
                 "tests: PATH:range or PATH:differ spoils one answer of PATH (host mode)");
  app.add_flag("--host", o.host, "q production and attention on the host even with a GPU");
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  if (o.layers < 1 || o.requests < 1 || o.context < 1 || o.tokens < 1 || o.warmup < 0) {
    std::fprintf(stderr, "--layers, --requests, --context, --tokens must be >= 1\n");
    return 2;
  }
  std::vector<std::string> paths = absl::StrSplit(o.paths, ',', absl::SkipEmpty());
  std::vector<std::string> server_paths;
  bool inproc = false;
  for (const std::string& p : paths) {
    if (p == "inproc") {
      inproc = true;
    } else {
      server_paths.push_back(p);
    }
  }
  if (!server_paths.empty() && o.target.empty()) {
    std::fprintf(stderr, "--target is needed for the server paths\n");
    return 2;
  }

  int devices = 0;
  const bool gpu = !o.host && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  absl::StatusOr<di::config::Profile> profile = di::config::LoadProfile(o.profile);
  Check(profile.status(), "profile");
  if (o.layers > static_cast<int>(profile->layers.size())) Die("--layers past the profile's");
  bw::Shape s{o.requests, profile->num_heads, profile->head_dim, profile->topk};
  if (!o.target.empty()) {
    di::client::ClientOptions co;
    co.connect_timeout = std::chrono::seconds(60);
    absl::StatusOr<std::unique_ptr<di::client::IndexerClient>> c =
        di::client::IndexerClient::Connect(o.target, co);
    Check(c.status(), "connect");
    absl::StatusOr<di::v1::ServerInfo> info = (*c)->ServerInfo();
    Check(info.status(), "ServerInfo");
    if (info->num_heads() != s.heads || info->head_dim() != s.dim || info->topk() != s.topk) {
      Die("the server's profile differs from --profile " + o.profile);
    }
    std::printf("# server %s: %s backend\n", o.target.c_str(), info->backend().c_str());
  }
  std::printf(
      "# decode-indexer-bench-worker: %s, %d layers x %d requests x %lld context, next_n 1, H %d "
      "D %d K %d; %d timed tokens after %d; worker on the %s\n",
      o.profile.c_str(), o.layers, o.requests, static_cast<long long>(o.context), s.heads, s.dim,
      s.topk, o.tokens, o.warmup, gpu ? "GPU" : "host (no GPU: CPU smoke form)");
  std::fflush(stdout);

  Worker w(o, s, gpu);
  w.CorruptForTesting(o.corrupt);
  const std::string self_check = gpu ? SelfCheck(w, o) : "host mode";
  std::printf("# self-check (GPU kernels against their host twins): %s\n",
              self_check.empty() ? "equal" : self_check.c_str());
  AnswerCheck check(o, s);
  Prefill prefill;
  PrefillLayout pl;
  pl.context = o.context;
  pl.chunk = o.fill_chunk > 0 ? std::min<int64_t>(o.fill_chunk, o.context) : o.context;
  pl.blocks = o.requests;
  {
    const auto t0 = Clock::now();
    const int64_t keys = int64_t(o.requests) * o.context;
    prefill.keys.resize(size_t(keys) * s.dim);
    prefill.scales.resize(size_t(keys));
    bw::FillPrefillHost(0, keys, s.dim, prefill.keys.data(), prefill.scales.data());
    std::printf("# prefill keys made on the host: %lld keys in %.2f s\n",
                static_cast<long long>(keys),
                std::chrono::duration<double>(Clock::now() - t0).count());
  }
  Run run{o, w, check, {}, prefill, pl, {}, -1, -1, 1};
  for (int i = 0; i < o.requests; ++i) run.ids.push_back(o.first_id + i);

  // The baseline: no indexer call.
  run.results.push_back(RunPath("baseline", o, w, nullptr, [&](int32_t tok, int32_t l) {
    w.Produce(tok, l, w.inputs());
    w.Attention(tok, l, w.fixed_answer());
    return 0.0;
  }));
  run.results.back().note = "q production + stand-in attention, no indexer call";
  if (!server_paths.empty()) ServerPaths(run, server_paths);
  if (inproc) {
    try {
      InProcess(run);
    } catch (const Failure& f) {
      run.Failed("inproc", f.what());
    }
  }

  // The table and the JSON.
  const double base = Percentile(run.results[0].token_us, 0.5);
  std::printf(
      "\n| path | token p50 us | token p90 us | tokens/s | overhead p50 us | overhead p90 us | "
      "overhead / layer us | call p50 us | call p90 us | note |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  std::string json = absl::StrCat(
      "{\"bench\": \"decode-indexer-bench-worker\", \"profile\": \"", o.profile,
      "\", \"layers\": ", o.layers, ", \"requests\": ", o.requests, ", \"context\": ", o.context,
      ", \"next_n\": 1, \"tokens\": ", o.tokens, ", \"warmup\": ", o.warmup, ", \"worker\": \"",
      gpu ? "gpu" : "host", "\", \"server_fill_s\": ", run.server_fill_s,
      ", \"inproc_fill_s\": ", run.inproc_fill_s, ", \"self_check\": \"",
      self_check.empty() ? "equal" : self_check, "\"",
      ", \"answers_checked_tokens\": ", check.checked(), ", \"paths\": [");
  bool first = true;
  for (const PathResult& r : run.results) {
    if (!first) json += ", ";
    first = false;
    if (!r.ran) {
      std::printf("| %s | - | - | - | - | - | - | - | - | %s |\n", r.name.c_str(), r.note.c_str());
      json +=
          absl::StrCat("{\"path\": \"", r.name, "\", \"ran\": false, \"note\": \"", r.note, "\"}");
      continue;
    }
    std::vector<double> over;
    for (double t : r.token_us) over.push_back(t - base);
    const double p50 = Percentile(r.token_us, 0.5), p90 = Percentile(r.token_us, 0.9);
    const double o50 = Percentile(over, 0.5), o90 = Percentile(over, 0.9);
    const double c50 = Percentile(r.call_us, 0.5), c90 = Percentile(r.call_us, 0.9);
    std::printf("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s |\n",
                r.name.c_str(), p50, p90, 1e6 / p50, o50, o90, o50 / o.layers, c50, c90,
                r.note.c_str());
    json +=
        absl::StrCat("{\"path\": \"", r.name, "\", \"ran\": true, \"token_us_p50\": ", p50,
                     ", \"token_us_p90\": ", p90, ", \"tokens_per_s\": ", 1e6 / p50,
                     ", \"overhead_us_p50\": ", o50, ", \"overhead_us_p90\": ", o90,
                     ", \"overhead_per_layer_us\": ", o50 / o.layers, ", \"call_us_p50\": ", c50,
                     ", \"call_us_p90\": ", c90, ", \"note\": \"", r.note, "\"}");
  }
  json += "]}\n";
  std::printf("\n# answers checked: %lld path-tokens valid and equal across paths\n",
              static_cast<long long>(check.checked()));
  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) Die("cannot write " + o.json);
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  const bool self_check_failed = !self_check.empty() && self_check != "host mode";
  return run.failed || self_check_failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const Failure& f) {
    std::fprintf(stderr, "bench-worker: %s\n", f.what());
    return 1;
  }
}
