// Decode through the API equals the kernels' CPU reference computed directly (ServiceOracle):
// v32 and a small v41 file profile, next_n 1/2/4, contexts below and above K, scattered
// pages, every q form and key form, candidates, ranks 1/2/4 and DecodeStream.
#include <gtest/gtest.h>

#include <random>

#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

// The test's seed (tests/test_seed.h): printed when the test fails; DI_TEST_SEED replays it.
uint64_t Seed() { return TestSeed(); }

TEST(DecodeTest, V32MatchesReferenceForEveryForm) {
  SCOPED_TRACE(::testing::Message() << "seed " << Seed());
  const config::Profile p = LoadOrDie("v32");
  auto s = StartSession(p, CpuOptions(1, 96));
  ASSERT_NE(s, nullptr);
  Gen gen(Seed());
  const std::vector<int> layers = {0, 1};
  ScatterPages(*s, gen, layers, 900);
  ServiceOracle oracle(p, 96, Seed() + 1);
  const std::vector<uint64_t> ids = {11, 12, 13};
  // Below K, just above K, above K (K = 2048).
  std::vector<int64_t> lengths = {int64_t(200 + gen.rng()() % 300),
                                  int64_t(p.topk + gen.rng()() % 40),
                                  int64_t(p.topk + 150 + gen.rng()() % 200)};
  Prefill(*s, oracle, gen, ids, lengths, layers);
  const QForm qforms[] = {QForm::kF32Rope, QForm::kBF16Rope, QForm::kQuantized, QForm::kF32NoRope};
  const int next_ns[] = {1, 2, 4, 1};
  for (int step = 0; step < 4; ++step) {
    // Layer 0 every step; layer 1 on one step (each layer has its own cache and length).
    for (int layer : step == 2 ? std::vector<int>{0, 1} : std::vector<int>{0}) {
      std::vector<int64_t> before;
      for (uint64_t id : ids) before.push_back(oracle.Length(id, layer));
      const KeyForm kf = static_cast<KeyForm>(step % 3);
      v1::DecodeStepRequest req =
          MakeStep(gen, p, layer, ids, before, next_ns[step], qforms[step], kf, 100 + step);
      StepAndCompare(*s, oracle, req,
                     absl::StrCat("step ", step, " layer ", layer, " q ", Name(qforms[step]),
                                  " next_n ", next_ns[step]));
    }
  }
}

class V41TinyTest : public ::testing::Test {
 protected:
  void SetUp() override { p_ = LoadOrDie(TinyProfilePath()); }
  config::Profile p_;
};

// Every layer of the profile in order (dense FP8, dense FP4, source, consumers), every form.
TEST_F(V41TinyTest, MatchesReferenceThroughEveryLayer) {
  SCOPED_TRACE(::testing::Message() << "seed " << Seed());
  auto s = StartSession(p_, CpuOptions(1, 256));
  ASSERT_NE(s, nullptr);
  Gen gen(Seed() + 7);
  std::vector<int> all(p_.layers.size());
  std::iota(all.begin(), all.end(), 0);
  ScatterPages(*s, gen, all, 900);
  ServiceOracle oracle(p_, 256, Seed() + 8);
  const std::vector<uint64_t> ids = {21, 22, 23, 24};
  // Below K (48), around it, above it, and beyond every candidate block's reach (12 x 8).
  std::vector<int64_t> lengths = {int64_t(5 + gen.rng()() % 30), int64_t(p_.topk + 1),
                                  int64_t(150 + gen.rng()() % 200),
                                  int64_t(900 + gen.rng()() % 400)};
  Prefill(*s, oracle, gen, ids, lengths, all);
  const int next_ns[] = {1, 2, 4};
  int form = 0;
  for (int step = 0; step < 3; ++step) {
    for (int layer : all) {
      std::vector<int64_t> before;
      for (uint64_t id : ids) before.push_back(oracle.Length(id, p_.layers[layer].cache_layer));
      const QForm qf = static_cast<QForm>(form % 4);
      const KeyForm kf = static_cast<KeyForm>(form % 3);
      ++form;
      v1::DecodeStepRequest req =
          MakeStep(gen, p_, layer, ids, before, next_ns[step], qf, kf, step * 100 + layer);
      client::StepAnswer a = StepAndCompare(*s, oracle, req,
                                            absl::StrCat("step ", step, " layer ", layer, " q ",
                                                         Name(qf), " next_n ", next_ns[step]));
      if (p_.layers[layer].role == config::LayerRole::kCandidateSource) {
        EXPECT_EQ(a.num_candidate_blocks, p_.num_candidate_blocks);
      }
    }
  }
  // Explicit row lengths at a dense layer (with keys) and the consumers after the source.
  std::vector<int64_t> before;
  for (uint64_t id : ids) before.push_back(oracle.Length(id, 2));
  // Consumers read the source's candidates, so they must bring the source's row lengths.
  std::vector<int32_t> row_lengths;
  for (int64_t b : before) {
    row_lengths.push_back(static_cast<int32_t>(1 + gen.rng()() % (b + 1)));
    row_lengths.push_back(static_cast<int32_t>(b + 2));
  }
  for (int layer : {2, 3, 4}) {
    v1::DecodeStepRequest req =
        MakeStep(gen, p_, layer, ids, before, 2, QForm::kF32Rope, KeyForm::kF32, 900 + layer);
    for (int i = 0; i < req.sequences_size(); ++i) {
      req.mutable_sequences(i)->add_row_lengths(row_lengths[2 * i]);
      req.mutable_sequences(i)->add_row_lengths(row_lengths[2 * i + 1]);
    }
    StepAndCompare(*s, oracle, req, absl::StrCat("row_lengths layer ", layer));
  }
}

// The same session on 1, 2 and 4 ranks answers bit-identically (and as the reference), and
// uniform steps of >= row_shard_min_requests requests run sharded.
TEST_F(V41TinyTest, RanksAgree) {
  SCOPED_TRACE(::testing::Message() << "seed " << Seed());
  const int rank_counts[] = {1, 2, 4};
  std::vector<std::unique_ptr<Session>> sessions;
  for (int r : rank_counts) {
    sessions.push_back(StartSession(p_, CpuOptions(r, 128)));
    ASSERT_NE(sessions.back(), nullptr);
  }
  std::vector<std::unique_ptr<ServiceOracle>> oracles;
  for (size_t i = 0; i < sessions.size(); ++i) {
    oracles.push_back(std::make_unique<ServiceOracle>(p_, 128, Seed() + i));
  }
  const std::vector<uint64_t> ids = {31, 32, 33, 34};
  std::vector<int64_t> lengths = {int64_t(20 + Seed() % 20), 70, int64_t(200 + Seed() % 100), 400};
  std::vector<int> all(p_.layers.size());
  std::iota(all.begin(), all.end(), 0);
  for (size_t i = 0; i < sessions.size(); ++i) {
    Gen gen(Seed() + 99);  // same inputs for every rank count
    Prefill(*sessions[i], *oracles[i], gen, ids, lengths, all);
  }
  // next_n 2 x 4 requests: 8 rows, an even count per rank for 2 and 4 ranks. Then a
  // non-uniform step (unsharded).
  for (int step = 0; step < 3; ++step) {
    for (int layer : all) {
      std::vector<client::StepAnswer> answers;
      for (size_t i = 0; i < sessions.size(); ++i) {
        Gen gen(Seed() * 31 + step * 7 + layer);
        std::vector<int64_t> before;
        for (uint64_t id : ids)
          before.push_back(oracles[i]->Length(id, p_.layers[layer].cache_layer));
        v1::DecodeStepRequest req = MakeStep(gen, p_, layer, ids, before, 2,
                                             static_cast<QForm>(step % 4), KeyForm::kF32, step);
        if (step == 2) {
          // Non-uniform: the first request brings one row.
          req.mutable_sequences(0)->set_num_rows(1);
          if (req.sequences(0).has_new_keys()) {
            auto* k = req.mutable_sequences(0)->mutable_new_keys();
            k->set_shape(0, 1);
            k->mutable_data()->resize(k->data().size() / 2);
          }
          auto trim = [](v1::Tensor* t) {
            if (t->dtype() == v1::DTYPE_UNSPECIFIED) return;
            // Drop row 1 (the first request's second row).
            const size_t width = t->data().size() / t->shape(0);
            t->mutable_data()->erase(width, width);
            t->set_shape(0, t->shape(0) - 1);
          };
          trim(req.mutable_q());
          trim(req.mutable_q_scales());
          trim(req.mutable_weights());
          trim(req.mutable_positions());
        }
        answers.push_back(
            StepAndCompare(*sessions[i], *oracles[i], req,
                           absl::StrCat(rank_counts[i], " ranks step ", step, " layer ", layer)));
      }
      for (size_t i = 1; i < answers.size(); ++i) {
        EXPECT_EQ(answers[i].topk, answers[0].topk)
            << rank_counts[i] << " ranks vs 1, step " << step << " layer " << layer;
        EXPECT_EQ(answers[i].candidates, answers[0].candidates);
        EXPECT_EQ(answers[i].sharded, step != 2) << rank_counts[i] << " ranks, step " << step;
      }
      EXPECT_FALSE(answers[0].sharded);
    }
  }
  absl::StatusOr<v1::Statistics> st = sessions[2]->client->GetStatistics();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->steps_sharded(), 2 * p_.layers.size());
  EXPECT_EQ(st->steps_unsharded(), p_.layers.size());
}

// DecodeStream answers in order; a failing step ends the stream with its status and leaves
// no trace (nor do the steps written after it).
TEST_F(V41TinyTest, StreamAnswersInOrderAndStopsAtFirstFailure) {
  SCOPED_TRACE(::testing::Message() << "seed " << Seed());
  auto s = StartSession(p_, CpuOptions(1, 128));
  ASSERT_NE(s, nullptr);
  Gen gen(Seed() + 3);
  ServiceOracle oracle(p_, 128, Seed() + 4);
  const std::vector<uint64_t> ids = {41, 42};
  std::vector<int> all(p_.layers.size());
  std::iota(all.begin(), all.end(), 0);
  Prefill(*s, oracle, gen, ids, {30, int64_t(100 + Seed() % 100)}, all);

  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = s->client->OpenStream();
  ASSERT_TRUE(stream.ok());
  std::vector<v1::DecodeStepRequest> reqs;
  std::vector<OracleAnswer> wants;
  for (int layer : all) {
    std::vector<int64_t> before;
    for (uint64_t id : ids) before.push_back(oracle.Length(id, p_.layers[layer].cache_layer));
    reqs.push_back(
        MakeStep(gen, p_, layer, ids, before, 2, QForm::kF32Rope, KeyForm::kBF16, 5000 + layer));
    // The oracle advances as the server will, so later requests see the right lengths.
    absl::StatusOr<OracleAnswer> want = oracle.Step(reqs.back());
    ASSERT_TRUE(want.ok()) << want.status();
    wants.push_back(*want);
  }
  // Write every step before reading any answer: answers still come back in order.
  for (const auto& r : reqs) ASSERT_TRUE((*stream)->Write(r).ok());
  for (size_t i = 0; i < reqs.size(); ++i) {
    absl::StatusOr<client::StepAnswer> a = (*stream)->Read();
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->step_id, reqs[i].step_id());
    EXPECT_TRUE(wants[i].Matches(a->topk, a->candidates)) << "stream step " << i;
    EXPECT_EQ(a->lengths, wants[i].lengths) << "stream step " << i;
  }
  EXPECT_TRUE((*stream)->Finish().ok());

  // A stream whose second step is bad: one answer, then the bad step's status.
  const int64_t pages_free = s->client->ServerInfo()->pages_free();
  absl::StatusOr<std::unique_ptr<client::StepStream>> bad = s->client->OpenStream();
  ASSERT_TRUE(bad.ok());
  std::vector<int64_t> before;
  for (uint64_t id : ids) before.push_back(oracle.Length(id, 0));
  v1::DecodeStepRequest good =
      MakeStep(gen, p_, 0, ids, before, 1, QForm::kF32Rope, KeyForm::kF32, 1);
  std::vector<int64_t> after = before;
  for (int64_t& x : after) x += 1;
  v1::DecodeStepRequest broken =
      MakeStep(gen, p_, 0, ids, after, 1, QForm::kF32Rope, KeyForm::kF32, 2);
  broken.mutable_q()->mutable_data()->pop_back();
  v1::DecodeStepRequest never =
      MakeStep(gen, p_, 0, ids, after, 1, QForm::kF32Rope, KeyForm::kF32, 3);
  absl::StatusOr<client::StepAnswer> a1 = (*bad)->Step(good);
  ASSERT_TRUE(a1.ok()) << a1.status();
  ASSERT_TRUE(oracle.Step(good).ok());
  (void)(*bad)->Write(broken);
  (void)(*bad)->Write(never);  // may already fail: the server ended the stream
  absl::StatusOr<client::StepAnswer> a2 = (*bad)->Read();
  ASSERT_FALSE(a2.ok());
  EXPECT_EQ(a2.status().code(), absl::StatusCode::kInvalidArgument) << a2.status();
  EXPECT_NE(a2.status().message().find("q.data"), absl::string_view::npos) << a2.status();
  EXPECT_EQ((*bad)->Finish().code(), absl::StatusCode::kInvalidArgument);
  // Only `good` moved the lengths: a valid step now answers as the oracle says.
  v1::DecodeStepRequest next =
      MakeStep(gen, p_, 0, ids, after, 1, QForm::kF32Rope, KeyForm::kF32, 4);
  StepAndCompare(*s, oracle, next, "after the failed stream");
  EXPECT_LE(s->client->ServerInfo()->pages_free(), pages_free);
}

}  // namespace
}  // namespace decode_indexer::testing
