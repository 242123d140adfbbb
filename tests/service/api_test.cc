// The API surface: ServerInfo for every profile, health and reflection, statistics, and every
// bad-input case rejected with its code and field while the state stays unchanged.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <random>
#include <variant>

#include "health_subset.grpc.pb.h"
#include "reflection_subset.pb.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

// The test's seed (tests/test_seed.h): printed when the test fails; DI_TEST_SEED replays it.
uint64_t Seed() { return TestSeed(); }

void ExpectInfoMatches(const v1::ServerInfo& info, const config::Profile& p, int64_t pages,
                       int ranks) {
  EXPECT_EQ(info.profile(), p.name);
  EXPECT_EQ(info.num_heads(), p.num_heads);
  EXPECT_EQ(info.head_dim(), p.head_dim);
  EXPECT_EQ(info.topk(), p.topk);
  EXPECT_EQ(info.page_size(), p.page_size);
  EXPECT_EQ(info.max_context(), p.max_context);
  EXPECT_EQ(info.num_ranks(), ranks);
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.version(), DI_TEST_VERSION);
  EXPECT_EQ(info.candidate_block_size(), p.candidate_block_size);
  EXPECT_EQ(info.num_candidate_blocks(), p.num_candidate_blocks);
  EXPECT_EQ(info.max_rows_per_sequence(), p.max_rows_per_sequence);
  EXPECT_EQ(info.hadamard(), p.hadamard);
  EXPECT_EQ(info.rope_dim(), p.rope.rope_dim);
  EXPECT_EQ(info.rope_dim_offset(), p.rope.dim_offset);
  EXPECT_EQ(info.rope_style(), p.rope.style == kernels::RopeStyle::kNeox          ? "neox"
                               : p.rope.style == kernels::RopeStyle::kInterleaved ? "interleaved"
                                                                                  : "none");
  ASSERT_EQ(info.layers_size(), static_cast<int>(p.layers.size()));
  for (int i = 0; i < info.layers_size(); ++i) {
    EXPECT_EQ(info.layers(i).layer(), p.layers[i].layer);
    EXPECT_EQ(static_cast<int>(info.layers(i).role()), static_cast<int>(p.layers[i].role));
    EXPECT_EQ(info.layers(i).cache_layer(), p.layers[i].cache_layer);
    EXPECT_EQ(static_cast<int>(info.layers(i).cache_format()),
              static_cast<int>(p.layers[i].cache_format));
  }
  const std::vector<int32_t> cache_layers = p.CacheLayers();
  ASSERT_EQ(info.caches_size(), static_cast<int>(cache_layers.size()));
  for (int i = 0; i < info.caches_size(); ++i) {
    EXPECT_EQ(info.caches(i).cache_layer(), cache_layers[i]);
    EXPECT_EQ(info.caches(i).pages_total(), pages);
    EXPECT_EQ(info.caches(i).pages_free(), pages);
  }
  EXPECT_EQ(info.pages_total(), pages * static_cast<int64_t>(cache_layers.size()));
  EXPECT_EQ(info.pages_free(), info.pages_total());
  EXPECT_EQ(info.sequences(), 0);
}

TEST(ApiTest, ServerInfoForEveryProfile) {
  for (const std::string& name : {std::string("v32"), std::string("v41"), TinyProfilePath()}) {
    SCOPED_TRACE(name);
    const config::Profile p = LoadOrDie(name);
    const int ranks = name == "v32" ? 1 : 2;
    exec::ExecutorOptions o = CpuOptions(ranks, 4);
    o.row_shard_min_requests = 3;
    auto s = StartSession(p, o);
    ASSERT_NE(s, nullptr);
    absl::StatusOr<v1::ServerInfo> info = s->client->ServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ExpectInfoMatches(*info, p, 4, ranks);
    EXPECT_EQ(info->row_shard_min_requests(), 3);
    EXPECT_EQ(info->max_sequences(), o.max_sequences);
  }
}

TEST(ApiTest, HealthServingAndReflectionRegistered) {
  auto s = StartSession(LoadOrDie(TinyProfilePath()), CpuOptions(1, 4));
  ASSERT_NE(s, nullptr);
  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel(s->server->address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(ch);
  grpc::ClientContext hctx;
  grpc::health::v1::HealthCheckResponse hres;
  grpc::Status hs = health->Check(&hctx, grpc::health::v1::HealthCheckRequest(), &hres);
  ASSERT_TRUE(hs.ok()) << hs.error_message();
  EXPECT_EQ(hres.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  using di_test::reflection::ServerReflectionRequest;
  using di_test::reflection::ServerReflectionResponse;
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING, ch);
  grpc::ClientContext rctx;
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>>
      stream(grpc::internal::ClientReaderWriterFactory<
             ServerReflectionRequest, ServerReflectionResponse>::Create(ch.get(), method, &rctx));
  ServerReflectionRequest rreq;
  rreq.set_list_services("*");
  ASSERT_TRUE(stream->Write(rreq));
  stream->WritesDone();
  ServerReflectionResponse rres;
  ASSERT_TRUE(stream->Read(&rres));
  std::vector<std::string> names;
  for (const auto& svc : rres.list_services_response().service()) names.push_back(svc.name());
  EXPECT_NE(std::find(names.begin(), names.end(), "decode_indexer.v1.DecodeIndexer"), names.end());
  while (stream->Read(&rres)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// Every bad input of the issue: the right code, a message naming the field, and no change of
// state (pages, sequences, lengths; a later valid step answers as on a fresh server).
class BadInputTest : public ::testing::Test {
 protected:
  using Op = std::variant<v1::AppendKeysRequest, v1::DecodeStepRequest>;

  void SetUp() override {
    p_ = LoadOrDie(TinyProfilePath());
    s_ = StartSession(p_, CpuOptions(1, 64));
    ASSERT_NE(s_, nullptr);
    oracle_ = std::make_unique<ServiceOracle>(p_, 64, Seed());
  }

  // Valid operations are logged so a fresh server can replay them.
  void Create(uint64_t id) {
    ASSERT_TRUE(s_->client->CreateSequence(id).ok());
    oracle_->Create(id);
    creates_.push_back(id);
  }
  void Append(uint64_t id, int layer, int n) {
    auto [k, ks] = gen_.Keys(KeyForm::kF32, n, p_.layers[layer].cache_format, p_.head_dim);
    v1::AppendKeysRequest r;
    r.set_sequence_id(id);
    r.set_layer(layer);
    *r.mutable_keys() = k;
    absl::StatusOr<int64_t> got = s_->client->AppendKeys(r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *oracle_->Append(id, layer, k, ks));
    log_.push_back(r);
  }
  void Step(const v1::DecodeStepRequest& r) {
    log_.push_back(r);
    answers_.push_back(
        StepAndCompare(*s_, *oracle_, r, absl::StrCat("valid step at layer ", r.layer())));
  }
  v1::DecodeStepRequest Valid(int layer, const std::vector<uint64_t>& ids, int next_n = 1) {
    std::vector<int64_t> before;
    for (uint64_t id : ids) before.push_back(oracle_->Length(id, p_.layers[layer].cache_layer));
    return MakeStep(gen_, p_, layer, ids, before, next_n, QForm::kF32Rope, KeyForm::kF32,
                    gen_.rng()());
  }
  void ExpectRejected(const v1::DecodeStepRequest& r, absl::StatusCode code,
                      const std::string& field) {
    absl::StatusOr<client::StepAnswer> a = s_->client->DecodeStep(r);
    ++failed_steps_;
    ASSERT_FALSE(a.ok()) << "accepted; expected " << field;
    EXPECT_EQ(a.status().code(), code) << a.status();
    EXPECT_EQ(std::string(a.status().message()).rfind(field, 0), 0u)
        << "message does not name " << field << ": " << a.status().message();
  }

  config::Profile p_;
  std::unique_ptr<Session> s_;
  std::unique_ptr<ServiceOracle> oracle_;
  Gen gen_{Seed() + 17};
  std::vector<uint64_t> creates_;
  std::vector<Op> log_;
  std::vector<client::StepAnswer> answers_;  // of the logged steps, in order
  int failed_steps_ = 0;
};

TEST_F(BadInputTest, RejectedWithoutTrace) {
  SCOPED_TRACE(::testing::Message() << "seed " << Seed());
  const std::vector<uint64_t> ids = {51, 52};
  for (uint64_t id : ids) Create(id);
  for (int layer : {0, 1, 2}) {
    Append(51, layer, 10 + static_cast<int>(gen_.rng()() % 30));
    Append(52, layer, 100 + static_cast<int>(gen_.rng()() % 60));
  }
  Create(53);  // never goes through the source: consumers have no candidates for it
  for (int layer : {0, 1, 2}) Append(53, layer, 20);
  for (int layer = 0; layer < 5; ++layer) Step(Valid(layer, ids));

  const v1::ServerInfo before = *s_->client->ServerInfo();
  using C = absl::StatusCode;
  v1::DecodeStepRequest r;

  r = Valid(0, ids);
  r.mutable_q()->set_dtype(v1::DTYPE_INT32);
  ExpectRejected(r, C::kInvalidArgument, "q.dtype");
  r = Valid(0, ids);
  r.mutable_q()->set_shape(2, 64);
  ExpectRejected(r, C::kInvalidArgument, "q.shape");
  r = Valid(0, ids);
  r.mutable_q()->mutable_data()->resize(r.q().data().size() - 4);
  ExpectRejected(r, C::kInvalidArgument, "q.data");
  r = Valid(1, ids);
  r.mutable_sequences(1)->mutable_new_keys()->set_dtype(v1::DTYPE_INT64);
  ExpectRejected(r, C::kInvalidArgument, "sequences[1].new_keys.dtype");
  r = Valid(1, ids);
  r.mutable_sequences(1)->mutable_new_keys()->set_shape(1, 64);
  ExpectRejected(r, C::kInvalidArgument, "sequences[1].new_keys.shape");
  r = Valid(0, ids);
  r.mutable_sequences(1)->set_sequence_id(4242);
  ExpectRejected(r, C::kNotFound, "sequences[1].sequence_id");
  r = Valid(0, ids);
  r.set_layer(static_cast<int>(p_.layers.size()) + 2);
  ExpectRejected(r, C::kInvalidArgument, "layer");

  // NaN / Inf in q, weights and keys.
  auto poison = [&](v1::Tensor* t, float v) {
    const size_t n = t->data().size() / 4;
    const size_t i = gen_.rng()() % n;
    std::memcpy(t->mutable_data()->data() + 4 * i, &v, 4);
  };
  r = Valid(0, ids);
  poison(r.mutable_q(), std::numeric_limits<float>::quiet_NaN());
  ExpectRejected(r, C::kInvalidArgument, "q.data");
  r = Valid(0, ids);
  poison(r.mutable_weights(), std::numeric_limits<float>::infinity());
  ExpectRejected(r, C::kInvalidArgument, "weights.data");
  r = Valid(1, ids);
  poison(r.mutable_sequences(0)->mutable_new_keys(), -std::numeric_limits<float>::infinity());
  ExpectRejected(r, C::kInvalidArgument, "sequences[0].new_keys.data");

  // Row counts not matching q: the sequences say 3 rows, q has 2.
  r = Valid(0, ids);
  r.mutable_sequences(0)->set_num_rows(2);
  ExpectRejected(r, C::kInvalidArgument, "q.shape");

  // Keys at a consumer; a consumer without candidates for the current length.
  r = Valid(3, ids);
  auto [k, ks] = gen_.Keys(KeyForm::kF32, 1, kernels::CacheFormat::kFp4, p_.head_dim);
  *r.mutable_sequences(0)->mutable_new_keys() = k;
  ExpectRejected(r, C::kInvalidArgument, "sequences[0].new_keys");
  r = Valid(4, {51, 53});
  ExpectRejected(r, C::kFailedPrecondition, "sequences[1]");

  // More rows than context; row lengths beyond the length; a sequence twice.
  Create(54);
  Append(54, 0, 1);
  r = Valid(0, {54}, 3);
  r.mutable_sequences(0)->mutable_new_keys()->set_shape(0, 1);
  r.mutable_sequences(0)->mutable_new_keys()->mutable_data()->resize(4 * p_.head_dim);
  ExpectRejected(r, C::kInvalidArgument, "sequences[0].num_rows");
  r = Valid(0, ids);
  r.mutable_sequences(1)->add_row_lengths(static_cast<int32_t>(oracle_->Length(52, 0) + 2));
  ExpectRejected(r, C::kInvalidArgument, "sequences[1].row_lengths[0]");
  r = Valid(0, ids);
  r.mutable_sequences(1)->set_sequence_id(51);
  ExpectRejected(r, C::kInvalidArgument, "sequences[1].sequence_id");

  // Positions out of range; candidates asked of a dense layer.
  r = Valid(0, ids);
  r.mutable_positions()->mutable_data()->replace(
      8, 8, std::string("\xff\xff\xff\xff\xff\xff\xff\xff", 8));
  ExpectRejected(r, C::kInvalidArgument, "positions[1]");
  r = Valid(1, ids);
  r.set_return_candidates(true);
  ExpectRejected(r, C::kInvalidArgument, "return_candidates");

  // Out of pages: one step's keys need more pages than the pool has left.
  r = Valid(0, ids);
  {
    const int n = static_cast<int>(64 * p_.page_size);
    auto [big, bs] = gen_.Keys(KeyForm::kF32, n, kernels::CacheFormat::kFp8, p_.head_dim);
    *r.mutable_sequences(1)->mutable_new_keys() = big;
  }
  // The executor names the pool that ran out ("cache layer 0: need ... pages").
  ExpectRejected(r, C::kResourceExhausted, "cache layer 0");

  // The same through AppendKeys, and the other calls' errors.
  {
    auto [big, bs] =
        gen_.Keys(KeyForm::kF32, 64 * p_.page_size, kernels::CacheFormat::kFp4, p_.head_dim);
    absl::StatusOr<int64_t> a = s_->client->AppendKeys(52, 1, big, bs);
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), C::kResourceExhausted) << a.status();
    EXPECT_NE(a.status().message().find("pages"), absl::string_view::npos) << a.status();
    auto [one, os] = gen_.Keys(KeyForm::kF32, 1, kernels::CacheFormat::kFp4, p_.head_dim);
    a = s_->client->AppendKeys(99, 1, one, os);
    EXPECT_EQ(a.status().code(), C::kNotFound) << a.status();
    a = s_->client->AppendKeys(51, 3, one, os);
    EXPECT_EQ(a.status().code(), C::kInvalidArgument) << a.status();
    EXPECT_EQ(std::string(a.status().message()).rfind("layer", 0), 0u) << a.status();
  }
  absl::Status twice = s_->client->CreateSequence(51);
  EXPECT_EQ(twice.code(), C::kAlreadyExists) << twice;
  EXPECT_EQ(s_->client->ReleaseSequence(4242).status().code(), C::kNotFound);

  // Nothing moved: pages, sequences (54 was created on purpose), lengths.
  const v1::ServerInfo after = *s_->client->ServerInfo();
  ASSERT_EQ(after.caches_size(), before.caches_size());
  for (int i = 0; i < after.caches_size(); ++i) {
    const int64_t used54 = i == 0 ? 1 : 0;  // 54's one key took one page of layer 0's pool
    EXPECT_EQ(after.caches(i).pages_free(), before.caches(i).pages_free() - used54) << i;
  }
  EXPECT_EQ(after.sequences(), before.sequences() + 1);
  Append(51, 1, 1);  // its length is the oracle's: no rejected step left keys behind
  for (int layer = 0; layer < 5; ++layer) Step(Valid(layer, ids, 2));

  // A fresh server fed only the valid operations answers the last steps identically.
  auto fresh = StartSession(p_, CpuOptions(1, 64));
  ASSERT_NE(fresh, nullptr);
  for (uint64_t id : creates_) ASSERT_TRUE(fresh->client->CreateSequence(id).ok());
  size_t step_index = 0;
  for (const Op& op : log_) {
    if (const auto* a = std::get_if<v1::AppendKeysRequest>(&op)) {
      ASSERT_TRUE(fresh->client->AppendKeys(*a).ok());
      continue;
    }
    const auto& step = std::get<v1::DecodeStepRequest>(op);
    absl::StatusOr<client::StepAnswer> x = fresh->client->DecodeStep(step);
    ASSERT_TRUE(x.ok()) << x.status();
    const client::StepAnswer& here = answers_[step_index++];
    EXPECT_EQ(x->topk, here.topk) << "step " << step_index << " at layer " << step.layer();
    EXPECT_EQ(x->candidates, here.candidates);
    EXPECT_EQ(x->lengths, here.lengths);
  }
  EXPECT_EQ(step_index, answers_.size());

  // Statistics saw every failed step.
  absl::StatusOr<v1::Statistics> st = s_->client->GetStatistics();
  ASSERT_TRUE(st.ok());
  for (const v1::RpcStatistics& m : st->rpcs()) {
    if (m.method() == "DecodeStep") {
      EXPECT_EQ(m.errors(), static_cast<uint64_t>(failed_steps_));
      EXPECT_GE(m.count(), m.errors() + 10);
      EXPECT_GE(m.latency_us_max(), m.latency_us_p99());
      EXPECT_GE(m.latency_us_p99(), m.latency_us_p50());
      EXPECT_GT(m.latency_us_p50(), 0);
    }
  }
  EXPECT_EQ(st->sequences(), after.sequences());
}

}  // namespace
}  // namespace decode_indexer::testing
