// decode-indexer-demo: a real session against a running server. Prints the server's info,
// creates sequences with different prefill lengths, prefills every cache-owning layer,
// runs decode steps through every layer (candidate source before its consumers), checks
// that every answer is well-formed, prints statistics and releases the sequences.
// Exits 0 only if every call succeeded and every answer was well-formed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/indexer_client.h"
#include "client/tensor.h"
#include "common/cli.h"

namespace dc = decode_indexer::client;
namespace v1 = decode_indexer::v1;

namespace {

struct Flags {
  std::string target = "127.0.0.1:50051";
  int sequences = 4;
  int steps = 3;
  int min_context = 300;
  int max_context = 3000;
  int layers_limit = 0;  // 0: every layer
  uint64_t seed = 1;
  uint64_t first_sequence_id = 0;  // 0: derived from the seed
};

std::vector<float> RandomNormal(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Row r's answer: ascending, in [0, length), -1 only at the end, and 0..L-1 when L <= K.
// Dense rows hold exactly min(L, K) positions; a consumer at most that many.
absl::Status CheckRow(std::span<const int32_t> row, int64_t length, bool consumer,
                      const std::string& where) {
  const int64_t k = static_cast<int64_t>(row.size());
  int64_t valid = 0;
  while (valid < k && row[valid] != -1) ++valid;
  for (int64_t i = valid; i < k; ++i) {
    if (row[i] != -1) return absl::InternalError(absl::StrCat(where, ": -1 padding not at end"));
  }
  for (int64_t i = 0; i < valid; ++i) {
    if (row[i] < 0 || row[i] >= length) {
      return absl::InternalError(
          absl::StrCat(where, ": position ", row[i], " outside [0, ", length, ")"));
    }
    if (i > 0 && row[i] <= row[i - 1]) {
      return absl::InternalError(absl::StrCat(where, ": not strictly ascending at ", i));
    }
  }
  const int64_t want = std::min(length, k);
  if (consumer ? valid > want : valid != want) {
    return absl::InternalError(
        absl::StrCat(where, ": ", valid, " positions, expected ", consumer ? "<= " : "", want));
  }
  // Ascending, distinct and in range with L entries means 0..L-1 exactly.
  if (length <= k && valid != length) {
    return absl::InternalError(absl::StrCat(where, ": L <= K must answer 0..L-1"));
  }
  return absl::OkStatus();
}

absl::Status Run(const Flags& flags) {
  absl::StatusOr<std::unique_ptr<dc::IndexerClient>> client_or =
      dc::IndexerClient::Connect(flags.target);
  if (!client_or.ok()) return client_or.status();
  dc::IndexerClient& client = **client_or;
  absl::StatusOr<v1::ServerInfo> info_or = client.ServerInfo();
  if (!info_or.ok()) return info_or.status();
  const v1::ServerInfo& info = *info_or;
  const int h = info.num_heads(), d = info.head_dim();
  std::printf(
      "server %s: profile %s (H=%d D=%d K=%d page=%d max_context=%lld), backend %s, %d rank(s), "
      "%d layers, %d cache pools, pages %lld/%lld free, rope %s, candidates %d x %d\n",
      info.version().c_str(), info.profile().c_str(), h, d, info.topk(), info.page_size(),
      static_cast<long long>(info.max_context()), info.backend().c_str(), info.num_ranks(),
      info.layers_size(), info.caches_size(), static_cast<long long>(info.pages_free()),
      static_cast<long long>(info.pages_total()), info.rope_style().c_str(),
      info.num_candidate_blocks(), info.candidate_block_size());

  std::mt19937_64 rng(flags.seed);
  const int n_seq = flags.sequences;
  const uint64_t first_id =
      flags.first_sequence_id != 0 ? flags.first_sequence_id : (rng() >> 16) + 1;
  std::vector<uint64_t> ids;
  std::vector<int64_t> lengths;
  for (int i = 0; i < n_seq; ++i) {
    ids.push_back(first_id + i);
    // Spread the prefill lengths over [min, max] so that some rows are below K, some above.
    const int64_t len =
        n_seq == 1
            ? flags.min_context
            : flags.min_context +
                  (static_cast<int64_t>(flags.max_context) - flags.min_context) * i / (n_seq - 1);
    lengths.push_back(len);
    if (absl::Status s = client.CreateSequence(ids.back()); !s.ok()) return s;
  }
  const int n_layers = flags.layers_limit > 0 ? std::min(flags.layers_limit, info.layers_size())
                                              : info.layers_size();
  std::vector<const v1::LayerInfo*> layers;
  for (int l = 0; l < n_layers; ++l) layers.push_back(&info.layers(l));
  // A consumer reads its source's candidates; without the source in range it cannot run.
  for (const v1::LayerInfo* layer : layers) {
    if (layer->role() == v1::LAYER_ROLE_CANDIDATE_CONSUMER && layer->cache_layer() >= n_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("--layers-limit ", n_layers, " cuts consumer layer ", layer->layer(),
                       " off its source layer ", layer->cache_layer()));
    }
  }
  auto owns_cache = [](const v1::LayerInfo& l) {
    return l.role() != v1::LAYER_ROLE_CANDIDATE_CONSUMER && l.cache_layer() == l.layer();
  };

  const auto prefill_start = std::chrono::steady_clock::now();
  int cache_layers = 0;
  for (const v1::LayerInfo* layer : layers) {
    if (!owns_cache(*layer)) continue;
    ++cache_layers;
    for (int i = 0; i < n_seq; ++i) {
      std::vector<float> keys = RandomNormal(rng, static_cast<size_t>(lengths[i]) * d);
      absl::StatusOr<int64_t> len = client.AppendKeys(ids[i], layer->layer(), keys, d);
      if (!len.ok()) return len.status();
      if (*len != lengths[i]) {
        return absl::InternalError(
            absl::StrCat("AppendKeys: length ", *len, ", expected ", lengths[i]));
      }
    }
  }
  std::printf(
      "prefilled %d sequences (lengths %s) into %d cache layers in %.0f ms\n", n_seq,
      absl::StrJoin(lengths, ", ").c_str(), cache_layers,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - prefill_start)
          .count());

  for (int step = 0; step < flags.steps; ++step) {
    const int next_n = step == 1 ? 2 : 1;  // one speculative step
    const int rows = n_seq * next_n;
    int64_t queue_us = 0, compute_us = 0, candidates = -1, candidates_last = -1;
    double client_us = 0;
    std::vector<int32_t> first_row;
    int sharded = 0;
    std::vector<int64_t> new_lengths = lengths;
    for (const v1::LayerInfo* layer : layers) {
      const bool owns = owns_cache(*layer);
      const bool consumer = layer->role() == v1::LAYER_ROLE_CANDIDATE_CONSUMER;
      const bool source = layer->role() == v1::LAYER_ROLE_CANDIDATE_SOURCE;
      v1::DecodeStepRequest req;
      req.set_layer(layer->layer());
      req.set_step_id(static_cast<uint64_t>(step) * 1000 + layer->layer());
      req.set_return_candidates(source);
      std::vector<int64_t> positions;
      for (int i = 0; i < n_seq; ++i) {
        v1::SequenceStep* s = req.add_sequences();
        s->set_sequence_id(ids[i]);
        s->set_num_rows(next_n);
        if (owns) {
          std::vector<float> keys = RandomNormal(rng, static_cast<size_t>(next_n) * d);
          *s->mutable_new_keys() = dc::F32Tensor(keys, {next_n, d});
        }
        // The rows' tokens sit at the sequence's new positions L .. L + n - 1.
        for (int j = 0; j < next_n; ++j) positions.push_back(lengths[i] + j);
      }
      std::vector<float> q = RandomNormal(rng, static_cast<size_t>(rows) * h * d);
      std::vector<float> w = RandomNormal(rng, static_cast<size_t>(rows) * h);
      *req.mutable_q() = dc::F32Tensor(q, {rows, h, d});
      *req.mutable_weights() = dc::F32Tensor(w, {rows, h});
      *req.mutable_positions() = dc::I64Tensor(positions, {rows});
      absl::StatusOr<dc::StepAnswer> ans = client.DecodeStep(req);
      const std::string where = absl::StrCat("step ", step, " layer ", layer->layer());
      if (!ans.ok()) {
        return absl::Status(ans.status().code(), absl::StrCat(where, ": ", ans.status().message()));
      }
      if (ans->rows != rows || ans->k != info.topk() || ans->lengths.size() != ids.size()) {
        return absl::InternalError(absl::StrCat(where, ": answer shape [", ans->rows, ", ", ans->k,
                                                "], ", ans->lengths.size(), " lengths"));
      }
      for (int i = 0; i < n_seq; ++i) {
        if (ans->lengths[i] != lengths[i] + next_n) {
          return absl::InternalError(absl::StrCat(where, ": sequence ", ids[i], " length ",
                                                  ans->lengths[i], ", expected ",
                                                  lengths[i] + next_n));
        }
        for (int j = 0; j < next_n; ++j) {
          const int r = i * next_n + j;
          const int64_t row_len = lengths[i] + j + 1;  // causal inside the step
          if (absl::Status s =
                  CheckRow(ans->Row(r), row_len, consumer, absl::StrCat(where, " row ", r));
              !s.ok()) {
            return s;
          }
        }
      }
      if (source) {
        if (ans->num_candidate_blocks != info.num_candidate_blocks()) {
          return absl::InternalError(
              absl::StrCat(where, ": ", ans->num_candidate_blocks, " candidate blocks per row"));
        }
        auto count = [&](int32_t r) {
          std::span<const int32_t> c = ans->CandidateRow(r);
          return std::count_if(c.begin(), c.end(), [](int32_t b) { return b >= 0; });
        };
        candidates = count(0);
        candidates_last = count(rows - 1);
      }
      if (first_row.empty()) {
        std::span<const int32_t> r0 = ans->Row(0);
        first_row.assign(r0.begin(), r0.begin() + std::min<size_t>(5, r0.size()));
      }
      queue_us += ans->queue_us;
      compute_us += ans->compute_us;
      client_us += ans->client_us;
      sharded += ans->sharded ? 1 : 0;
      new_lengths = ans->lengths;
    }
    lengths = new_lengths;
    std::printf(
        "step %d: next_n %d, %d rows x %d layers (%d sharded); row 0 first positions [%s]; "
        "candidate blocks at source (row 0 / last row) %s; server queue %lld us, compute %lld us; "
        "client %.0f us\n",
        step, next_n, rows, n_layers, sharded, absl::StrJoin(first_row, ", ").c_str(),
        candidates < 0 ? "-" : absl::StrCat(candidates, " / ", candidates_last).c_str(),
        static_cast<long long>(queue_us), static_cast<long long>(compute_us), client_us);
  }

  absl::StatusOr<v1::Statistics> stats = client.GetStatistics();
  if (!stats.ok()) return stats.status();
  std::printf("statistics: %llu steps (%llu sharded), %llu rows scored, %lld/%lld pages in use\n",
              static_cast<unsigned long long>(stats->steps()),
              static_cast<unsigned long long>(stats->steps_sharded()),
              static_cast<unsigned long long>(stats->rows_scored()),
              static_cast<long long>(stats->pages_in_use()),
              static_cast<long long>(stats->pages_total()));
  for (const v1::RpcStatistics& r : stats->rpcs()) {
    if (r.count() == 0) continue;
    std::printf("  %-16s count %6llu errors %llu p50 %8.0f us p99 %8.0f us max %8.0f us\n",
                r.method().c_str(), static_cast<unsigned long long>(r.count()),
                static_cast<unsigned long long>(r.errors()), r.latency_us_p50(), r.latency_us_p99(),
                r.latency_us_max());
  }
  int64_t freed = 0;
  for (uint64_t id : ids) {
    absl::StatusOr<int64_t> f = client.ReleaseSequence(id);
    if (!f.ok()) return f.status();
    freed += *f;
  }
  std::printf("released %d sequences (%lld pages)\n", n_seq, static_cast<long long>(freed));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"decode-indexer-demo: a short decode session against a running server"};
  app.add_option("--target", flags.target, "server address host:port");
  app.add_option("--sequences", flags.sequences, "sequences in the session")
      ->check(CLI::Range(1, 256));
  app.add_option("--steps", flags.steps, "decode steps (step 1 runs next_n 2)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--min-context", flags.min_context, "shortest prefill")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--max-context", flags.max_context, "longest prefill")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--layers-limit", flags.layers_limit, "drive only the first N layers (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", flags.seed, "random seed");
  app.add_option("--first-sequence-id", flags.first_sequence_id,
                 "id of the first sequence (0: derived from the seed)");
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  if (flags.max_context < flags.min_context) std::swap(flags.max_context, flags.min_context);
  const absl::Status s = Run(flags);
  if (!s.ok()) {
    std::fprintf(stderr, "decode-indexer-demo: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
