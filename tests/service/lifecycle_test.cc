// Sequence lifecycle through the gRPC service on the CPU backend (spec section 10): keys at
// explicit positions (rollback, holes, idempotent retries), TruncateSequence, ForkSequence with
// copy-on-write pages, ExportSequence / ImportSequence between two servers, GetSequence, the
// idle timeout and the instance id. Every check compares against a sequence built
// independently on the same kind of server (never against hard-coded answers), at 1, 2 and 4
// ranks, and every refused call is checked to leave the state as it was.
#include <gtest/gtest.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <cstring>
#include <optional>

#include "server/service/sequence_transfer.h"
#include "server/testing/fault_injection.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

using client::StepAnswer;

// One sequence of a step: rows, optional fp32 keys [n, D] and their position.
struct Part {
  uint64_t id = 0;
  int rows = 1;
  std::vector<float> keys;  // empty: none
  std::optional<int64_t> position;
};

class Lifecycle : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    profile_ = LoadOrDie(TinyProfilePath());
    a_ = Start();
    ASSERT_NE(a_, nullptr);
  }
  std::unique_ptr<Session> Start(int ranks = -1, int64_t pages = 256) {
    exec::ExecutorOptions o = CpuOptions(ranks < 0 ? GetParam() : ranks, pages);
    o.idle_sequence_timeout_ms = 3600 * 1000;  // named in messages; never reached in a test
    return StartSession(profile_, o);
  }
  int D() const { return profile_.head_dim; }
  std::vector<float> Keys(int n, uint64_t seed) { return Gen(seed).Normal(size_t(n) * D()); }
  std::vector<float> Slice(const std::vector<float>& k, int from, int n) {
    return std::vector<float>(k.begin() + size_t(from) * D(), k.begin() + size_t(from + n) * D());
  }

  // A step at `layer` over `parts`, fp32 q from `q_seed`. Source layers return candidates.
  v1::DecodeStepRequest Step(int layer, const std::vector<Part>& parts, uint64_t q_seed) {
    const config::LayerSpec& spec = profile_.layers.at(layer);
    v1::DecodeStepRequest req;
    req.set_layer(layer);
    req.set_return_candidates(spec.role == config::LayerRole::kCandidateSource);
    int rows = 0;
    for (const Part& p : parts) {
      v1::SequenceStep* s = req.add_sequences();
      s->set_sequence_id(p.id);
      s->set_num_rows(p.rows);
      if (!p.keys.empty()) {
        const int n = int(p.keys.size() / D());
        *s->mutable_new_keys() = client::F32Tensor(p.keys, {n, D()});
      }
      if (p.position) s->set_new_keys_position(*p.position);
      rows += p.rows;
    }
    Gen(q_seed).FillQ(req, QForm::kF32NoRope, rows, profile_, spec.cache_format, {});
    return req;
  }
  StepAnswer Run(Session& s, const v1::DecodeStepRequest& req) {
    absl::StatusOr<StepAnswer> a = s.client->DecodeStep(req);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? *a : StepAnswer{};
  }
  // Every cache's (length, pages) of a sequence.
  std::vector<std::pair<int64_t, int64_t>> Lengths(Session& s, uint64_t id) {
    absl::StatusOr<v1::GetSequenceResponse> r = s.client->GetSequence(id);
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<std::pair<int64_t, int64_t>> out;
    if (r.ok()) {
      for (const auto& c : r->caches()) out.emplace_back(c.length(), c.pages());
    }
    return out;
  }
  int64_t PagesFree(Session& s) {
    absl::StatusOr<v1::ServerInfo> info = s.client->ServerInfo();
    EXPECT_TRUE(info.ok());
    return info.ok() ? info->pages_free() : -1;
  }
  // Creates `id` with the same `n` keys (from `seed`) in every cache-owning layer.
  void Prefill(Session& s, uint64_t id, int n, uint64_t seed) {
    ASSERT_TRUE(s.client->CreateSequence(id).ok());
    for (int layer : profile_.CacheLayers()) {
      absl::StatusOr<int64_t> len = s.client->AppendKeys(id, layer, Keys(n, seed + layer), D());
      ASSERT_TRUE(len.ok()) << len.status();
      ASSERT_EQ(*len, n);
    }
  }
  // Steps every layer once (the source before its consumers), one new key per cache layer
  // from `seed`, q from `seed`: the answers of each layer, in order.
  std::vector<StepAnswer> Round(Session& s, uint64_t id, uint64_t seed) {
    std::vector<StepAnswer> out;
    for (const config::LayerSpec& l : profile_.layers) {
      Part part{id, 1, {}, std::nullopt};
      if (l.role != config::LayerRole::kCandidateConsumer)
        part.keys = Keys(1, seed * 100 + l.layer);
      out.push_back(Run(s, Step(l.layer, {part}, seed * 1000 + l.layer)));
    }
    return out;
  }
  static void ExpectSameAnswers(const std::vector<StepAnswer>& a, const std::vector<StepAnswer>& b,
                                const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].topk, b[i].topk) << what << ": layer " << i;
      EXPECT_EQ(a[i].candidates, b[i].candidates) << what << ": layer " << i;
      EXPECT_EQ(a[i].lengths, b[i].lengths) << what << ": layer " << i;
    }
  }

  config::Profile profile_;
  std::unique_ptr<Session> a_;
};

// A speculative step inserts 3 keys; 2 drafts are rejected and the next step writes at the
// accepted position: the same answers and lengths as a sequence that never saw the drafts.
TEST_P(Lifecycle, RollbackByPositionMatchesASequenceThatNeverSawTheDrafts) {
  Session& s = *a_;
  // Longer than top-k (48) and the candidate blocks (12 x 8), so every answer depends on the
  // cache's contents; not a page multiple: the cut lands inside a page.
  const int n = 181;
  Prefill(s, 1, n, 7);
  Prefill(s, 2, n, 7);
  const std::vector<float> drafts = Keys(3, 99), next = Keys(2, 98);
  const int layer = 0;
  StepAnswer spec = Run(s, Step(layer, {{1, 3, drafts, std::nullopt}}, 5));
  EXPECT_EQ(spec.lengths, std::vector<int64_t>{n + 3});
  // Sequence 2 accepted the first token only.
  Run(s, Step(layer, {{2, 1, Slice(drafts, 0, 1), std::nullopt}}, 6));
  // Both now write two keys from position n + 1.
  StepAnswer a = Run(s, Step(layer, {{1, 2, next, n + 1}}, 8));
  StepAnswer b = Run(s, Step(layer, {{2, 2, next, std::nullopt}}, 8));
  EXPECT_EQ(a.lengths, std::vector<int64_t>{n + 3});
  EXPECT_EQ(a.topk, b.topk);
  EXPECT_EQ(Lengths(s, 1), Lengths(s, 2));
  // And they stay equal afterwards, in every layer.
  ExpectSameAnswers(Round(s, 1, 3), Round(s, 2, 3), "after the rollback");
  // A pure cut (a position with no keys) through AppendKeys, then the same append on both.
  const int64_t pages_before = Lengths(s, 1)[0].second, free_before = PagesFree(s);
  ASSERT_TRUE(s.client->AppendKeysAt(1, layer, n - 5, {}, D()).ok());
  const int P = profile_.page_size;
  EXPECT_EQ(Lengths(s, 1)[0], std::make_pair(int64_t{n - 5}, int64_t{(n - 5 + P - 1) / P}));
  EXPECT_EQ(PagesFree(s) - free_before, pages_before - Lengths(s, 1)[0].second);
  ASSERT_TRUE(s.client->TruncateSequence(2, n + 10).ok());  // no cache is that long: no-op
  ASSERT_TRUE(s.client->AppendKeysAt(2, layer, n - 5, {}, D()).ok());
  EXPECT_EQ(Lengths(s, 1), Lengths(s, 2));
  EXPECT_EQ(Run(s, Step(layer, {{1, 1, Keys(1, 4), std::nullopt}}, 9)).topk,
            Run(s, Step(layer, {{2, 1, Keys(1, 4), std::nullopt}}, 9)).topk);
}

// The same step sent twice with its positions leaves the same state and answers the same.
TEST_P(Lifecycle, RetriedStepWithPositionsIsIdempotent) {
  Session& s = *a_;
  const int n = 190;
  Prefill(s, 1, n, 3);
  Prefill(s, 2, n, 3);
  const int64_t free_before = PagesFree(s);
  const v1::DecodeStepRequest once = Step(2, {{1, 2, Keys(2, 11), n}}, 12);
  StepAnswer first = Run(s, once);
  const auto after_first = Lengths(s, 1);
  const int64_t free_after_first = PagesFree(s);
  StepAnswer again = Run(s, once);
  EXPECT_EQ(first.topk, again.topk);
  EXPECT_EQ(first.candidates, again.candidates);
  EXPECT_EQ(first.lengths, again.lengths);
  EXPECT_EQ(Lengths(s, 1), after_first);
  EXPECT_EQ(PagesFree(s), free_after_first) << "a retry leaks or frees pages";
  EXPECT_LE(PagesFree(s), free_before);
  // The retried sequence equals one that got the step once, consumers included.
  Run(s, Step(2, {{2, 2, Keys(2, 11), n}}, 12));
  ExpectSameAnswers(Round(s, 1, 5), Round(s, 2, 5), "after a retry");
  // AppendKeys at a position, twice.
  absl::StatusOr<int64_t> l1 = s.client->AppendKeysAt(1, 0, 10, Keys(4, 13), D());
  absl::StatusOr<int64_t> l2 = s.client->AppendKeysAt(1, 0, 10, Keys(4, 13), D());
  ASSERT_TRUE(l1.ok() && l2.ok());
  EXPECT_EQ(*l1, 14);
  EXPECT_EQ(*l2, 14);
}

// A hole is refused naming the field, and a refused step (a hole in one of its sequences, or
// a rank failing after another rank wrote its keys) changes nothing: lengths, pages, the cut.
TEST_P(Lifecycle, HolesAndFailedStepsChangeNothing) {
  Session& s = *a_;
  const int n = 170;
  Prefill(s, 1, n, 21);
  Prefill(s, 2, n, 21);
  Prefill(s, 3, n, 21);
  for (uint64_t id : {20, 21, 22}) Prefill(s, id, n, 21);
  const auto before = Lengths(s, 1);
  const int64_t free_before = PagesFree(s);
  absl::StatusOr<StepAnswer> hole = s.client->DecodeStep(Step(0, {{1, 1, Keys(1, 1), n + 1}}, 1));
  ASSERT_FALSE(hole.ok());
  EXPECT_EQ(hole.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(hole.status().message().find("sequences[0].new_keys_position"), std::string::npos)
      << hole.status();
  // Sequence 1 asks for a cut back to 3, sequence 2 for a hole: neither applies.
  absl::StatusOr<StepAnswer> mixed =
      s.client->DecodeStep(Step(0, {{1, 1, Keys(1, 1), 3}, {2, 1, Keys(1, 1), n + 5}}, 1));
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.status().message().find("sequences[1].new_keys_position"), std::string::npos);
  absl::StatusOr<int64_t> append_hole = s.client->AppendKeysAt(1, 1, n + 1, Keys(1, 1), D());
  ASSERT_FALSE(append_hole.ok());
  EXPECT_EQ(append_hole.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(append_hole.status().message().find("position"), std::string::npos);
  v1::AppendKeysRequest negative;
  negative.set_sequence_id(1);
  negative.set_layer(0);
  negative.set_position(-1);
  EXPECT_EQ(s.client->AppendKeys(negative).status().code(), absl::StatusCode::kInvalidArgument);
  // A position on a consumer (it takes no keys).
  absl::StatusOr<StepAnswer> consumer = s.client->DecodeStep(Step(3, {{1, 1, {}, 2}}, 1));
  EXPECT_EQ(consumer.status().code(), absl::StatusCode::kInvalidArgument);
  // A cut-back whose step fails on rank 0 after the other ranks wrote their keys.
  InjectFault(s.server->executor(), {.rank = 0});
  absl::StatusOr<StepAnswer> faulted = s.client->DecodeStep(Step(0, {{1, 2, Keys(2, 5), 5}}, 1));
  ASSERT_FALSE(faulted.ok());
  EXPECT_EQ(Lengths(s, 1), before);
  EXPECT_EQ(PagesFree(s), free_before) << "a failed step leaked or freed pages";
  // Sequence 1 still answers as 3, which saw none of it, on the last rank too: a step of four
  // requests of two rows is row-sharded and puts the last request there. Sequences 20-22
  // fill the other places (written at the same position twice: the same state).
  const std::vector<float> k = Keys(2, 77);
  StepAnswer x = Run(s, Step(0,
                             {{20, 2, k, std::nullopt},
                              {21, 2, k, std::nullopt},
                              {22, 2, k, std::nullopt},
                              {1, 2, k, std::nullopt}},
                             31));
  StepAnswer y =
      Run(s, Step(0, {{20, 2, k, n}, {21, 2, k, n}, {22, 2, k, n}, {3, 2, k, std::nullopt}}, 31));
  EXPECT_EQ(x.sharded, GetParam() > 1);
  EXPECT_EQ(x.topk, y.topk);
  ExpectSameAnswers(Round(s, 1, 9), Round(s, 3, 9), "after refused steps");
}

TEST_P(Lifecycle, TruncateMatchesAShorterPrefillAndFreesPages) {
  Session& s = *a_;
  const int n = 250, cut = 137;
  Prefill(s, 1, n, 4);
  ASSERT_TRUE(s.client->CreateSequence(2).ok());
  for (int layer : profile_.CacheLayers()) {
    ASSERT_TRUE(s.client->AppendKeys(2, layer, Slice(Keys(n, 4 + layer), 0, cut), D()).ok());
  }
  const int64_t free_before = PagesFree(s);
  absl::StatusOr<int64_t> freed = s.client->TruncateSequence(1, cut);
  ASSERT_TRUE(freed.ok()) << freed.status();
  const int P = profile_.page_size;
  const int64_t per_cache = (n + P - 1) / P - (cut + P - 1) / P;
  EXPECT_EQ(*freed, per_cache * int64_t(profile_.CacheLayers().size()));
  EXPECT_EQ(PagesFree(s), free_before + *freed);
  EXPECT_EQ(Lengths(s, 1), Lengths(s, 2));
  ExpectSameAnswers(Round(s, 1, 2), Round(s, 2, 2), "after truncate");
  // Bad input changes nothing.
  const auto before = Lengths(s, 1);
  EXPECT_EQ(s.client->TruncateSequence(1, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.client->TruncateSequence(99, 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Lengths(s, 1), before);
}

// A fork answers exactly as a separately built copy, shares its pages (counted once),
// copies a shared page before writing into it, and releasing either frees only its own.
TEST_P(Lifecycle, ForkMatchesAnIndependentCopyAndSharesPages) {
  Session& s = *a_;
  const int n = 205, m = 157;  // both inside a page
  const int P = profile_.page_size;
  const int64_t caches = int64_t(profile_.CacheLayers().size());
  Prefill(s, 1, n, 8);                            // the parent
  Prefill(s, 2, n, 8);                            // a parent that is never forked
  ASSERT_TRUE(s.client->CreateSequence(3).ok());  // the fork, built by hand
  for (int layer : profile_.CacheLayers()) {
    ASSERT_TRUE(s.client->AppendKeys(3, layer, Slice(Keys(n, 8 + layer), 0, m), D()).ok());
  }
  // The parent ran its source layer: the fork has no candidates until its own source runs.
  Run(s, Step(2, {{1, 1, Keys(1, 50), std::nullopt}}, 51));
  Run(s, Step(2, {{2, 1, Keys(1, 50), std::nullopt}}, 51));
  const int64_t free_before = PagesFree(s);
  ASSERT_TRUE(s.client->ForkSequence(1, 4, m).ok());
  EXPECT_EQ(PagesFree(s), free_before) << "a fork copies no page";
  absl::StatusOr<v1::GetSequenceResponse> info = s.client->GetSequence(4);
  ASSERT_TRUE(info.ok());
  for (const auto& c : info->caches()) {
    EXPECT_EQ(c.length(), m);
    EXPECT_EQ(c.shared_pages(), (m + P - 1) / P);
  }
  EXPECT_EQ(info->candidate_layers_size(), 0);
  absl::StatusOr<StepAnswer> early = s.client->DecodeStep(Step(3, {{4, 1, {}, std::nullopt}}, 1));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  // The fork writes into the shared partial page: one copy per cache, nothing else.
  std::vector<StepAnswer> fork = Round(s, 4, 6);
  EXPECT_EQ(PagesFree(s), free_before - caches) << "copy-on-write of the shared last page";
  ExpectSameAnswers(fork, Round(s, 3, 6), "fork vs a separate copy");
  // The parent was not disturbed by its fork's copy-on-write.
  ExpectSameAnswers(Round(s, 1, 7), Round(s, 2, 7), "parent vs a parent never forked");
  // A fork at the parents' shortest cache length shares their partial last pages; the forks
  // and then the parents write into them (each side copies first).
  ASSERT_TRUE(s.client->ForkSequence(1, 6, n + 1).ok());
  ASSERT_TRUE(s.client->ForkSequence(2, 7, n + 1).ok());
  ExpectSameAnswers(Round(s, 6, 8), Round(s, 7, 8), "full-length forks");
  ExpectSameAnswers(Round(s, 1, 9), Round(s, 2, 9), "their parents");
  // Release the parent: the pages the forks still hold stay.
  const auto fork_lengths = Lengths(s, 4);
  int64_t parent_pages = 0, shared_with_forks = 0;
  {
    absl::StatusOr<v1::GetSequenceResponse> p = s.client->GetSequence(1);
    ASSERT_TRUE(p.ok());
    for (const auto& c : p->caches()) {
      parent_pages += c.pages();
      shared_with_forks += c.shared_pages();
    }
  }
  const int64_t free_pre_release = PagesFree(s);
  absl::StatusOr<int64_t> freed = s.client->ReleaseSequence(1);
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, parent_pages - shared_with_forks);
  EXPECT_EQ(PagesFree(s), free_pre_release + *freed);
  EXPECT_EQ(Lengths(s, 4), fork_lengths);
  ExpectSameAnswers(Round(s, 4, 10), Round(s, 3, 10), "the fork after its parent left");
  // Bad forks change nothing.
  const int64_t free_now = PagesFree(s);
  EXPECT_EQ(s.client->ForkSequence(1, 20, 1).code(), absl::StatusCode::kNotFound);
  absl::Status past = s.client->ForkSequence(2, 20, 10000);
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(past.message().find("length"), std::string::npos) << past;
  EXPECT_EQ(s.client->ForkSequence(2, 3, 1).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(s.client->ForkSequence(2, 21, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.client->GetSequence(20).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(PagesFree(s), free_now);
}

// A rolled-back fork (a cut into the shared region, then a write) copies before writing and
// leaves the parent untouched.
TEST_P(Lifecycle, CutBackIntoASharedRegionCopiesFirst) {
  Session& s = *a_;
  const int n = 208;
  Prefill(s, 1, n, 12);
  Prefill(s, 2, n, 12);
  ASSERT_TRUE(s.client->ForkSequence(1, 3, n).ok());
  ASSERT_TRUE(s.client->ForkSequence(2, 4, n).ok());
  // Sequence 3 rewrites from position 120 (inside a page): parent 1 must not see it.
  Run(s, Step(0, {{3, 2, Keys(2, 40), 120}}, 41));
  Run(s, Step(0, {{4, 2, Keys(2, 40), 120}}, 41));
  ExpectSameAnswers(Round(s, 1, 11), Round(s, 2, 11), "parents after a fork's rewrite");
  ExpectSameAnswers(Round(s, 3, 12), Round(s, 4, 12), "the rewritten forks");
}

// Export from one server, import into another (with another rank count): the importer
// answers exactly as the exporter, candidates included; bad streams change nothing.
TEST_P(Lifecycle, ExportImportAcrossServers) {
  Session& s = *a_;
  std::unique_ptr<Session> b = Start(GetParam() == 1 ? 2 : 1);
  ASSERT_NE(b, nullptr);
  const int n = 193;
  Prefill(s, 1, n, 14);
  Round(s, 1, 1);  // candidates published, lengths n + 1
  absl::StatusOr<std::vector<v1::SequenceChunk>> chunks = s.client->ExportSequence(1, 4096);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_GT(chunks->size(), 2u);
  const int64_t free_b = PagesFree(*b);

  auto refused = [&](std::vector<v1::SequenceChunk> stream, absl::StatusCode code,
                     const std::string& why, const std::string& what) {
    absl::StatusOr<uint64_t> got = b->client->ImportSequence(1, stream);
    ASSERT_FALSE(got.ok()) << what;
    EXPECT_EQ(got.status().code(), code) << what << ": " << got.status();
    EXPECT_NE(got.status().message().find(why), std::string::npos) << what << ": " << got.status();
    EXPECT_EQ(b->client->GetSequence(1).status().code(), absl::StatusCode::kNotFound) << what;
    EXPECT_EQ(PagesFree(*b), free_b) << what;
  };
  {
    std::vector<v1::SequenceChunk> t = *chunks;
    t.pop_back();
    refused(t, absl::StatusCode::kDataLoss, "truncated", "a truncated stream");
  }
  {
    std::vector<v1::SequenceChunk> t = *chunks;
    std::string* data = t[1].mutable_data();
    (*data)[data->size() / 2] ^= 0x10;
    refused(t, absl::StatusCode::kDataLoss, "CRC", "a corrupt chunk");
  }
  {
    std::vector<v1::SequenceChunk> t = *chunks;
    std::swap(t[1], t[2]);
    refused(t, absl::StatusCode::kDataLoss, "out of order", "chunks out of order");
  }
  {
    std::vector<v1::SequenceChunk> t = *chunks;
    (*t[0].mutable_header()->mutable_candidates(0)->mutable_blocks())[0] ^= 1;
    refused(t, absl::StatusCode::kDataLoss, "header", "a corrupt header");
  }
  {
    // Checksums that agree do not make the bytes trusted: a NaN code is refused.
    std::vector<v1::SequenceChunk> t = *chunks;
    (*t[1].mutable_data())[0] = char(0x7F);  // cache 0 is FP8: entry 0's first code
    t[1].set_crc32(service::Crc32(t[1].data()));
    refused(t, absl::StatusCode::kInvalidArgument, "NaN", "a NaN code with a good CRC");
    std::vector<v1::SequenceChunk> u = *chunks;
    v1::SequenceCandidates* c = u[0].mutable_header()->mutable_candidates(0);
    int32_t first;
    std::memcpy(&first, c->blocks().data(), 4);
    first = 1 << 20;  // far past the blocks that exist
    std::memcpy(c->mutable_blocks()->data(), &first, 4);
    u[0].set_crc32(0);
    // Re-sign the header as the exporter would (its deterministic serialization).
    std::string bytes;
    {
      google::protobuf::io::StringOutputStream out(&bytes);
      google::protobuf::io::CodedOutputStream coded(&out);
      coded.SetSerializationDeterministic(true);
      u[0].header().SerializeToCodedStream(&coded);
    }
    u[0].set_crc32(service::Crc32(bytes));
    refused(u, absl::StatusCode::kInvalidArgument, "blocks", "a candidate block out of range");
  }
  // Into another profile: the same constants but another layer plan.
  {
    config::Profile other = profile_;
    other.layers[1].cache_format = kernels::CacheFormat::kFp8;
    std::unique_ptr<Session> c = StartSession(other, CpuOptions(1, 256));
    ASSERT_NE(c, nullptr);
    absl::StatusOr<uint64_t> got = c->client->ImportSequence(1, *chunks);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
    EXPECT_NE(got.status().message().find("profile"), std::string::npos) << got.status();
    EXPECT_EQ(c->client->GetSequence(1).status().code(), absl::StatusCode::kNotFound);
  }
  // The whole stream, as id 9 (then again: ALREADY_EXISTS, nothing changes).
  absl::StatusOr<uint64_t> id = b->client->ImportSequence(9, *chunks);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, 9u);
  const int64_t free_after = PagesFree(*b);
  const int P = profile_.page_size;
  EXPECT_EQ(free_b - free_after, int64_t(Lengths(s, 1).size()) * ((n + 1 + P - 1) / P));
  absl::StatusOr<uint64_t> twice = b->client->ImportSequence(9, *chunks);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(PagesFree(*b), free_after);
  EXPECT_EQ(Lengths(*b, 9), Lengths(s, 1));
  // Consumers first: the candidates came along.
  EXPECT_EQ(Run(*b, Step(3, {{9, 1, {}, std::nullopt}}, 61)).topk,
            Run(s, Step(3, {{1, 1, {}, std::nullopt}}, 61)).topk);
  ExpectSameAnswers(Round(*b, 9, 4), Round(s, 1, 4), "importer vs exporter");
  // MigrateSequence streams chunk by chunk.
  absl::StatusOr<uint64_t> moved = s.client->MigrateSequence(1, *b->client, 10);
  ASSERT_TRUE(moved.ok()) << moved.status();
  ExpectSameAnswers(Round(*b, 10, 5), Round(s, 1, 5), "migrated vs exporter");
  EXPECT_EQ(s.client->MigrateSequence(404, *b->client).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(Lifecycle, IdleReleaseInstanceIdAndLengths) {
  Session& s = *a_;
  Prefill(s, 1, 5, 1);
  absl::StatusOr<v1::ServerInfo> info = s.client->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->instance_id().size(), 32u);
  EXPECT_NE(info->profile_hash(), 0u);
  EXPECT_EQ(info->idle_sequence_timeout_ms(), 3600 * 1000);
  std::unique_ptr<Session> other = Start(1);
  ASSERT_NE(other, nullptr);
  absl::StatusOr<v1::ServerInfo> other_info = other->client->ServerInfo();
  ASSERT_TRUE(other_info.ok());
  EXPECT_NE(other_info->instance_id(), info->instance_id());
  EXPECT_EQ(other_info->profile_hash(), info->profile_hash());
  const auto lengths = Lengths(s, 1);
  ASSERT_EQ(lengths.size(), profile_.CacheLayers().size());
  for (const auto& [len, pages] : lengths) EXPECT_EQ(len, 5);
  // Everything untouched for at least 0 ms is idle.
  EXPECT_EQ(s.server->executor().ReleaseIdleSequences(0), 1);
  absl::StatusOr<v1::GetSequenceResponse> gone = s.client->GetSequence(1);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("idle"), std::string::npos) << gone.status();
  EXPECT_EQ(PagesFree(s), info->pages_total());
  // Created again, it is an ordinary sequence.
  ASSERT_TRUE(s.client->CreateSequence(1).ok());
  EXPECT_EQ(s.client->ReleaseSequence(1).status().code(), absl::StatusCode::kOk);
  EXPECT_EQ(s.client->ReleaseSequence(1).status().message().find("idle"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Lifecycle, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "ranks" + std::to_string(info.param); });

}  // namespace
}  // namespace decode_indexer::testing
