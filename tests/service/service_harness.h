// Shared by the service suites: an in-process Server (127.0.0.1:0) driven through
// di_client, random request builders for every q and key form, and a step runner that
// checks the server's answer against the ServiceOracle.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "client/indexer_client.h"
#include "client/tensor.h"
#include "server/config/profile.h"
#include "server/service/server.h"
#include "tests/service/service_oracle.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {

// A test profile file, found relative to the test binary, not at a path baked in when it was
// built: $DI_TEST_DATA_DIR/NAME if set (the GPU runner points it at the checkout's
// tests/service/profiles), else profiles/NAME beside the binary (the build copies them
// there), else the checkout's tests/service/profiles from the current directory.
inline std::string TestProfilePath(const std::string& name) {
  std::vector<std::filesystem::path> dirs;
  if (const char* env = std::getenv("DI_TEST_DATA_DIR"); env != nullptr && *env)
    dirs.push_back(env);
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(exe.parent_path() / "profiles");
  dirs.push_back(std::filesystem::current_path(ec) / "tests/service/profiles");
  for (const std::filesystem::path& d : dirs) {
    if (std::filesystem::exists(d / name, ec)) return (d / name).string();
  }
  ADD_FAILURE() << "test profile " << name << " not found (set DI_TEST_DATA_DIR to the "
                << "checkout's tests/service/profiles)";
  return name;
}
inline std::string TinyProfilePath() { return TestProfilePath("v41-tiny.toml"); }

inline config::Profile LoadOrDie(const std::string& name) {
  absl::StatusOr<config::Profile> p = config::LoadProfile(name);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : config::Profile{};
}

struct Session {
  config::Profile profile;
  std::unique_ptr<service::Server> server;
  std::unique_ptr<client::IndexerClient> client;
};

inline exec::ExecutorOptions CpuOptions(int ranks = 1, int64_t cache_pages = 256) {
  exec::ExecutorOptions o;
  o.backend = "cpu";
  o.ranks = ranks;
  o.cache_pages = cache_pages;
  o.row_shard_min_requests = 2;
  o.max_sequences = 64;
  o.cpu_threads = 1;  // CI has 2 cores, shared
  return o;
}

// The gRPC edge the suites' servers use: $DI_TEST_GRPC_EDGE ("sync" or "callback"), else the
// server's default. ctest runs the suites that drive the edge on both (tests/service's
// CMakeLists: the "sync_edge." tests).
inline service::ServerOptions::GrpcEdge TestEdge() {
  const char* env = std::getenv("DI_TEST_GRPC_EDGE");
  const std::string edge = env != nullptr ? env : "";
  if (edge == "sync") return service::ServerOptions::GrpcEdge::kSync;
  if (edge == "callback") return service::ServerOptions::GrpcEdge::kCallback;
  return service::ServerOptions().grpc_edge;
}

// `tweak` (optional) adjusts the server's options before it starts; the session's client
// connects with `client_options`.
inline std::unique_ptr<Session> StartSession(
    const config::Profile& profile, const exec::ExecutorOptions& options,
    const std::function<void(service::ServerOptions&)>& tweak = nullptr,
    const client::ClientOptions& client_options = client::ClientOptions()) {
  auto s = std::make_unique<Session>();
  s->profile = profile;
  service::ServerOptions so;
  so.listen = {"127.0.0.1:0"};
  so.profile = profile;
  so.executor = options;
  so.grpc_edge = TestEdge();
  if (tweak) tweak(so);
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(so);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  s->server = std::move(*server);
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(s->server->address(), client_options);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  s->client = std::move(*c);
  return s;
}

enum class KeyForm { kF32, kBF16, kQuantized };
enum class QForm { kF32Rope, kF32NoRope, kBF16Rope, kQuantized };

inline const char* Name(QForm f) {
  switch (f) {
    case QForm::kF32Rope:
      return "fp32+positions";
    case QForm::kF32NoRope:
      return "fp32";
    case QForm::kBF16Rope:
      return "bf16+positions";
    default:
      return "pre-quantized";
  }
}

// Fresh random inputs (never zeros).
class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  std::mt19937_64& rng() { return rng_; }

  std::vector<float> Normal(size_t n, float sigma = 1.0f) {
    std::normal_distribution<float> d(0.0f, sigma);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::vector<uint8_t> Fp8Codes(size_t n) {
    std::vector<uint8_t> v(n);
    for (uint8_t& b : v) {
      b = static_cast<uint8_t>(rng_());
      if ((b & 0x7F) == 0x7F) b ^= 0x01;  // never the NaN code
    }
    return v;
  }
  std::vector<uint8_t> Bytes(size_t n) {
    std::vector<uint8_t> v(n);
    for (uint8_t& b : v) b = static_cast<uint8_t>(rng_());
    return v;
  }
  std::vector<uint8_t> Ue8m0(size_t n) {
    std::vector<uint8_t> v(n);
    for (uint8_t& b : v) b = static_cast<uint8_t>(118 + rng_() % 14);
    return v;
  }

  // Keys [n, D] in `form` for a cache of `format`: {keys, key_scales}.
  std::pair<v1::Tensor, v1::Tensor> Keys(KeyForm form, int n, kernels::CacheFormat format, int D) {
    switch (form) {
      case KeyForm::kF32:
        return {client::F32Tensor(Normal(size_t(n) * D), {n, D}), {}};
      case KeyForm::kBF16:
        return {client::Bf16Tensor(Normal(size_t(n) * D), {n, D}), {}};
      default:
        break;
    }
    if (format == kernels::CacheFormat::kFp8) {
      std::vector<float> s(n);
      for (float& x : s) x = std::ldexp(1.0f, -static_cast<int>(2 + rng_() % 8));
      return {client::CodesTensor(v1::DTYPE_FP8_E4M3, Fp8Codes(size_t(n) * D), {n, D}),
              client::F32Tensor(s, {n})};
    }
    return {client::CodesTensor(v1::DTYPE_FP4_E2M1, Bytes(size_t(n) * D / 2), {n, D}),
            client::CodesTensor(v1::DTYPE_UE8M0, Ue8m0(size_t(n) * D / 32), {n, D / 32})};
  }

  // q, q_scales, weights and positions of `rows` rows in `form`.
  void FillQ(v1::DecodeStepRequest& req, QForm form, int rows, const config::Profile& p,
             kernels::CacheFormat format, const std::vector<int64_t>& positions) {
    const int H = p.num_heads, D = p.head_dim;
    const size_t n = size_t(rows) * H * D;
    switch (form) {
      case QForm::kF32Rope:
      case QForm::kF32NoRope:
        *req.mutable_q() = client::F32Tensor(Normal(n), {rows, H, D});
        break;
      case QForm::kBF16Rope:
        *req.mutable_q() = client::Bf16Tensor(Normal(n), {rows, H, D});
        break;
      case QForm::kQuantized:
        if (format == kernels::CacheFormat::kFp8) {
          *req.mutable_q() = client::CodesTensor(v1::DTYPE_FP8_E4M3, Fp8Codes(n), {rows, H, D});
        } else {
          *req.mutable_q() = client::CodesTensor(v1::DTYPE_FP4_E2M1, Bytes(n / 2), {rows, H, D});
          *req.mutable_q_scales() =
              client::CodesTensor(v1::DTYPE_UE8M0, Ue8m0(n / 32), {rows, H, D / 32});
        }
        break;
    }
    // bf16 weights on the bf16 form, fp32 otherwise.
    std::vector<float> w = Normal(size_t(rows) * H);
    *req.mutable_weights() = form == QForm::kBF16Rope ? client::Bf16Tensor(w, {rows, H})
                                                      : client::F32Tensor(w, {rows, H});
    if (form == QForm::kF32Rope) {
      *req.mutable_positions() = client::I64Tensor(positions, {rows});
    } else if (form == QForm::kBF16Rope) {
      std::vector<int32_t> p32(positions.begin(), positions.end());
      *req.mutable_positions() = client::I32Tensor(p32, {rows});
    }
  }

 private:
  std::mt19937_64 rng_;
};

// `n` sequences for a bit-for-bit comparison of two servers: ids from `base` (distinct, in
// random hundreds) and lengths below K, around it and above it.
inline void RandomSequences(Gen& gen, const config::Profile& p, int n, uint64_t base,
                            std::vector<uint64_t>& ids, std::vector<int64_t>& lengths) {
  auto& rng = gen.rng();
  ids.resize(n);
  lengths.resize(n);
  for (int i = 0; i < n; ++i) {
    ids[i] = base + rng() % 1000 * 100 + i;
    lengths[i] = std::max<int64_t>(3, p.topk / 2 + static_cast<int64_t>(rng() % (2 * p.topk)));
  }
}

// Cache pages a pool needs for `n` RandomSequences (each at most topk / 2 + 2 topk keys) and
// `steps` later steps of up to `rows` keys a request (at least 320).
inline int64_t RandomSequencesPages(const config::Profile& p, int n, int steps, int rows) {
  const int64_t longest = p.topk / 2 + 2 * int64_t{p.topk} + int64_t{steps} * std::max(1, rows);
  return std::max<int64_t>(320, n * (longest / p.page_size + 2) + 16);
}

// The layers such a comparison steps: v32's first layers (each has its own cache); a small
// profile's every layer in plan order, so a consumer follows its source.
inline std::vector<int> ComparedLayers(const config::Profile& p) {
  std::vector<int> layers;
  if (p.layers.size() > 8) {
    layers = {0, 1, 2};
  } else {
    layers.resize(p.layers.size());
    std::iota(layers.begin(), layers.end(), 0);
  }
  return layers;
}

// A decode step of `next_n` rows per sequence at `layer`: keys at cache-owning layers.
inline v1::DecodeStepRequest MakeStep(Gen& gen, const config::Profile& p, int layer,
                                      const std::vector<uint64_t>& ids,
                                      const std::vector<int64_t>& lengths_before, int next_n,
                                      QForm qform, KeyForm kform, uint64_t step_id) {
  const config::LayerSpec& spec = p.layers.at(layer);
  const bool owns = spec.role != config::LayerRole::kCandidateConsumer;
  v1::DecodeStepRequest req;
  req.set_layer(layer);
  req.set_step_id(step_id);
  req.set_return_candidates(spec.role == config::LayerRole::kCandidateSource);
  std::vector<int64_t> positions;
  for (size_t i = 0; i < ids.size(); ++i) {
    v1::SequenceStep* s = req.add_sequences();
    s->set_sequence_id(ids[i]);
    s->set_num_rows(next_n);
    if (owns) {
      auto [k, ks] = gen.Keys(kform, next_n, spec.cache_format, p.head_dim);
      *s->mutable_new_keys() = std::move(k);
      if (ks.dtype() != v1::DTYPE_UNSPECIFIED) *s->mutable_new_key_scales() = std::move(ks);
    }
    for (int j = 0; j < next_n; ++j) positions.push_back(lengths_before[i] + j);
  }
  gen.FillQ(req, qform, static_cast<int>(ids.size()) * next_n, p, spec.cache_format, positions);
  return req;
}

// Runs `req` on the server and the oracle; expects the server's answer to be the reference's
// by the spec's section-6 rule. Answers the server's.
inline client::StepAnswer StepAndCompare(Session& s, ServiceOracle& oracle,
                                         const v1::DecodeStepRequest& req,
                                         const std::string& what) {
  absl::StatusOr<client::StepAnswer> got = s.client->DecodeStep(req);
  EXPECT_TRUE(got.ok()) << what << ": " << got.status();
  absl::StatusOr<OracleAnswer> want = oracle.Step(req);
  EXPECT_TRUE(want.ok()) << what << ": oracle: " << want.status();
  if (!got.ok() || !want.ok()) return {};
  EXPECT_EQ(got->step_id, req.step_id()) << what;
  EXPECT_EQ(got->rows, want->rows) << what;
  EXPECT_EQ(got->k, want->k) << what;
  EXPECT_EQ(got->lengths, want->lengths) << what;
  EXPECT_TRUE(
      want->Matches(got->topk, req.return_candidates() ? got->candidates : std::vector<int32_t>{}))
      << what;
  if (req.return_candidates()) {
    EXPECT_EQ(got->candidates.size(), want->candidates.size()) << what << ": candidate blocks";
    oracle.AdoptCandidates(req, got->candidates);
  }
  return *got;
}

// Creates `ids` and prefills `lengths` keys into every cache-owning layer in `layers`, on the
// server and the oracle; keys alternate forms by layer.
inline void Prefill(Session& s, ServiceOracle& oracle, Gen& gen, const std::vector<uint64_t>& ids,
                    const std::vector<int64_t>& lengths, const std::vector<int>& layers) {
  for (uint64_t id : ids) {
    ASSERT_TRUE(s.client->CreateSequence(id).ok());
    oracle.Create(id);
  }
  int form = 0;
  for (int layer : layers) {
    const config::LayerSpec& spec = s.profile.layers.at(layer);
    if (spec.role == config::LayerRole::kCandidateConsumer) continue;
    for (size_t i = 0; i < ids.size(); ++i) {
      const KeyForm kf = static_cast<KeyForm>(form++ % 3);
      auto [k, ks] =
          gen.Keys(kf, static_cast<int>(lengths[i]), spec.cache_format, s.profile.head_dim);
      absl::StatusOr<int64_t> got = s.client->AppendKeys(ids[i], layer, k, ks);
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<int64_t> want = oracle.Append(ids[i], layer, k, ks);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(*got, *want);
    }
  }
}

// Scatters the server's free pages: fillers take interleaved pages of every cache layer in
// `layers`, then every other one is released, so later sequences get non-contiguous pages.
inline void ScatterPages(Session& s, Gen& gen, const std::vector<int>& layers, uint64_t first_id,
                         int fillers = 4, int chunks = 3) {
  const int P = s.profile.page_size, D = s.profile.head_dim;
  for (int f = 0; f < fillers; ++f) ASSERT_TRUE(s.client->CreateSequence(first_id + f).ok());
  for (int layer : layers) {
    const config::LayerSpec& spec = s.profile.layers.at(layer);
    if (spec.role == config::LayerRole::kCandidateConsumer) continue;
    for (int c = 0; c < chunks; ++c) {
      for (int f = 0; f < fillers; ++f) {
        auto [k, ks] = gen.Keys(KeyForm::kF32, P, spec.cache_format, D);
        ASSERT_TRUE(s.client->AppendKeys(first_id + f, layer, k, ks).ok());
      }
    }
  }
  for (int f = 1; f < fillers; f += 2) {
    ASSERT_TRUE(s.client->ReleaseSequence(first_id + f).ok());
  }
}

}  // namespace decode_indexer::testing
