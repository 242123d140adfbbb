// The columnar step form (DecodeStepRequest.sequence_ids, num_rows / rows_per_sequence, one
// stacked new_keys, new_key_counts, new_keys_positions, row_lengths) through a real server
// on the CPU backend: two servers given the same prefill and the same random steps, one in
// the `sequences` form and one in the columnar form (through the C++ client's
// ColumnarStep, unary and on a stream), must answer bit for bit alike and keep the same
// lengths; bad columnar input is INVALID_ARGUMENT naming the field and changes nothing.
#include <gtest/gtest.h>

#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tests/service/columnar.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

client::TensorView ViewOf(const v1::Tensor& t) {
  client::TensorView v;
  v.dtype = t.dtype();
  v.shape.assign(t.shape().begin(), t.shape().end());
  v.data =
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.data().data()), t.data().size());
  return v;
}

template <typename T>
std::span<const T> SpanOf(const google::protobuf::RepeatedField<T>& f) {
  return std::span<const T>(f.data(), f.size());
}

// The client's ColumnarStep for a request already in the columnar form (views of its bytes).
client::ColumnarStep StepOf(const v1::DecodeStepRequest& c) {
  client::ColumnarStep s;
  s.layer = c.layer();
  s.step_id = c.step_id();
  s.sequence_ids = SpanOf(c.sequence_ids());
  s.num_rows = SpanOf(c.num_rows());
  s.rows_per_sequence = c.rows_per_sequence();
  if (c.has_new_keys()) s.new_keys = ViewOf(c.new_keys());
  if (c.has_new_key_scales()) s.new_key_scales = ViewOf(c.new_key_scales());
  s.new_key_counts = SpanOf(c.new_key_counts());
  s.new_keys_positions = SpanOf(c.new_keys_positions());
  s.row_lengths = SpanOf(c.row_lengths());
  s.q = ViewOf(c.q());
  if (c.has_q_scales()) s.q_scales = ViewOf(c.q_scales());
  s.weights = ViewOf(c.weights());
  if (c.has_positions()) s.positions = ViewOf(c.positions());
  s.return_candidates = c.return_candidates();
  s.answer_encoding = c.answer_encoding();
  s.timeout_us = c.timeout_us();
  return s;
}

struct Twin {
  std::unique_ptr<Session> seq;                        // answers the `sequences` form
  std::unique_ptr<Session> col;                        // answers the columnar form
  std::map<std::pair<int, uint64_t>, int64_t> length;  // (cache layer, id) -> length
  // Each request's rows (num_rows, row_lengths) at the last source step: a consumer step
  // must bring the same rows (its candidates are per row).
  std::map<uint64_t, v1::SequenceStep> source_rows;
};

// Both servers get the same sequences and the same prefill of every cache `layers` use.
void PrefillBoth(Twin& t, Gen& gen, const std::vector<uint64_t>& ids,
                 const std::vector<int64_t>& lengths, const std::vector<int>& layers) {
  const config::Profile& p = t.seq->profile;
  for (uint64_t id : ids) {
    ASSERT_TRUE(t.seq->client->CreateSequence(id).ok());
    ASSERT_TRUE(t.col->client->CreateSequence(id).ok());
  }
  int form = 0;
  for (int layer : layers) {
    const config::LayerSpec& spec = p.layers.at(layer);
    if (spec.role == config::LayerRole::kCandidateConsumer || spec.cache_layer != spec.layer) {
      continue;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      auto [k, ks] = gen.Keys(static_cast<KeyForm>(form++ % 3), static_cast<int>(lengths[i]),
                              spec.cache_format, p.head_dim);
      absl::StatusOr<int64_t> a = t.seq->client->AppendKeys(ids[i], spec.layer, k, ks);
      absl::StatusOr<int64_t> b = t.col->client->AppendKeys(ids[i], spec.layer, k, ks);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      ASSERT_EQ(*a, *b);
      t.length[{spec.layer, ids[i]}] = *a;
    }
  }
}

// A random step at `layer` in the `sequences` form: next_n rows a request (0: 1..max at
// random), keys in one form (some requests without), sometimes a position that rolls the
// cache back, sometimes explicit row lengths; q in `qform`.
v1::DecodeStepRequest RandomStep(Gen& gen, Twin& t, int layer, const std::vector<uint64_t>& ids,
                                 int next_n, QForm qform, KeyForm kform, bool keys,
                                 uint64_t step_id) {
  const config::Profile& p = t.seq->profile;
  const config::LayerSpec& spec = p.layers.at(layer);
  const bool owns = spec.role != config::LayerRole::kCandidateConsumer;
  auto& rng = gen.rng();
  v1::DecodeStepRequest req;
  req.set_layer(layer);
  req.set_step_id(step_id);
  req.set_return_candidates(spec.role == config::LayerRole::kCandidateSource);
  std::vector<int64_t> positions;
  for (uint64_t id : ids) {
    const int64_t len = t.length.at({spec.cache_layer, id});
    v1::SequenceStep* s = req.add_sequences();
    s->set_sequence_id(id);
    if (!owns) {  // a consumer: the source's rows
      const v1::SequenceStep& src = t.source_rows.at(id);
      s->set_num_rows(src.num_rows());
      *s->mutable_row_lengths() = src.row_lengths();
      for (int j = 0; j < src.num_rows(); ++j) positions.push_back(len - src.num_rows() + j);
      continue;
    }
    const int rows = next_n > 0 ? next_n : 1 + static_cast<int>(rng() % p.max_rows_per_sequence);
    s->set_num_rows(rows);
    int64_t after = len;
    if (owns && keys && rng() % 5 != 0) {
      int64_t start = len;
      if (rng() % 3 == 0) {  // roll back up to 2 entries first (or write exactly at the end)
        start = len - static_cast<int64_t>(rng() % 3);
        s->set_new_keys_position(start);
      }
      auto [k, ks] = gen.Keys(kform, rows, spec.cache_format, p.head_dim);
      *s->mutable_new_keys() = std::move(k);
      if (ks.dtype() != v1::DTYPE_UNSPECIFIED) *s->mutable_new_key_scales() = std::move(ks);
      after = start + rows;
    }
    if (rng() % 4 == 0) {
      for (int j = 0; j < rows; ++j) {
        s->add_row_lengths(1 + static_cast<int32_t>(rng() % static_cast<uint64_t>(after)));
      }
    }
    for (int j = 0; j < rows; ++j) positions.push_back(std::max<int64_t>(0, after - rows + j));
    if (spec.role == config::LayerRole::kCandidateSource) {
      v1::SequenceStep& src = t.source_rows[id];
      src.set_num_rows(rows);
      *src.mutable_row_lengths() = s->row_lengths();
    }
  }
  int total = 0;
  for (const v1::SequenceStep& s : req.sequences()) total += s.num_rows();
  gen.FillQ(req, qform, total, p, spec.cache_format, positions);
  return req;
}

void ExpectSameAnswer(const client::StepAnswer& a, const client::StepAnswer& b,
                      const std::string& what) {
  EXPECT_EQ(a.step_id, b.step_id) << what;
  EXPECT_EQ(a.rows, b.rows) << what;
  EXPECT_EQ(a.k, b.k) << what;
  EXPECT_EQ(a.topk, b.topk) << what << ": topk differs";
  EXPECT_EQ(a.num_candidate_blocks, b.num_candidate_blocks) << what;
  EXPECT_EQ(a.candidates, b.candidates) << what << ": candidate blocks differ";
  EXPECT_EQ(a.lengths, b.lengths) << what << ": lengths differ";
}

struct Shape {
  const char* profile;  // "v32" or the tiny v41 file
  int requests;
  int next_n;  // 0: mixed rows per request
};

class ColumnarTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ColumnarTest, AnswersAsSequencesBitForBit) {
  const Shape shape = GetParam();
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  const config::Profile p =
      LoadOrDie(std::string(shape.profile) == "v32" ? std::string("v32") : TinyProfilePath());
  Twin t;
  // Room for the longest draws (some seeds drew past a fixed 320 pages at 5 v32 requests).
  const int64_t pages = RandomSequencesPages(
      p, shape.requests, 4, shape.next_n > 0 ? shape.next_n : p.max_rows_per_sequence);
  t.seq = StartSession(p, CpuOptions(1, pages));
  t.col = StartSession(p, CpuOptions(1, pages));
  ASSERT_NE(t.seq, nullptr);
  ASSERT_NE(t.col, nullptr);
  Gen gen(TestSeed());
  auto& rng = gen.rng();
  std::vector<uint64_t> ids;
  std::vector<int64_t> lengths;
  RandomSequences(gen, p, shape.requests, 1000, ids, lengths);
  const std::vector<int> layers = ComparedLayers(p);
  PrefillBoth(t, gen, ids, lengths, layers);
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = t.col->client->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  uint64_t step_id = 1;
  int compared = 0;
  for (int round = 0; round < 4; ++round) {
    for (int layer : layers) {
      const QForm qf = static_cast<QForm>(rng() % 4);
      const KeyForm kf = static_cast<KeyForm>(rng() % 3);
      const bool keys = round != 1;  // one round without new keys
      const v1::DecodeStepRequest req =
          RandomStep(gen, t, layer, ids, shape.next_n, qf, kf, keys, step_id++);
      ColumnarOptions o;
      o.uniform_rows = rng() % 2;
      o.explicit_counts = rng() % 3 == 0;
      o.explicit_positions = rng() % 3 == 0;
      const v1::DecodeStepRequest col = ToColumnar(req, o);
      const std::string what = absl::StrCat("round ", round, " layer ", layer, " q ", Name(qf),
                                            " keys ", static_cast<int>(kf), keys ? "" : " (none)");
      // The client's builder gives exactly this request.
      const client::ColumnarStep view = StepOf(col);
      EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(
          client::BuildColumnarRequest(view), col))
          << what;

      absl::StatusOr<client::StepAnswer> a = t.seq->client->DecodeStep(req);
      ASSERT_TRUE(a.ok()) << what << ": " << a.status();
      absl::StatusOr<client::StepAnswer> b;
      if (rng() % 2 == 0) {
        b = t.col->client->DecodeStepColumnar(view);
      } else {
        ASSERT_TRUE((*stream)->WriteColumnar(view).ok()) << what;
        b = (*stream)->Read();
      }
      ASSERT_TRUE(b.ok()) << what << ": " << b.status();
      ExpectSameAnswer(*a, *b, what);
      ++compared;
      const int cache = p.layers.at(layer).cache_layer;
      for (size_t i = 0; i < ids.size() && i < a->lengths.size(); ++i) {
        t.length[{cache, ids[i]}] = a->lengths[i];
      }
    }
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  EXPECT_GT(compared, 0);
  // And each cache of each sequence ends at the same length on both servers.
  for (uint64_t id : ids) {
    absl::StatusOr<v1::GetSequenceResponse> a = t.seq->client->GetSequence(id);
    absl::StatusOr<v1::GetSequenceResponse> b = t.col->client->GetSequence(id);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*a, *b))
        << a->ShortDebugString() << "\nvs\n"
        << b->ShortDebugString();
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ColumnarTest,
                         ::testing::Values(Shape{"v32", 3, 1}, Shape{"v32", 5, 2},
                                           Shape{"v41-tiny", 4, 1}, Shape{"v41-tiny", 6, 2},
                                           Shape{"v41-tiny", 5, 0}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return absl::StrCat(info.param.profile[1] == '3' ? "v32" : "v41tiny",
                                               "_", info.param.requests, "x",
                                               info.param.next_n == 0
                                                   ? std::string("mixed")
                                                   : absl::StrCat("next", info.param.next_n));
                         });

// The README's usage: a frontend's own arrays (FP8 q codes, folded weights, one FP8 key a
// request) through ColumnarStep, unary and on a stream, as the SequenceStep form answers.
TEST(ColumnarClientTest, BuildsFromTheFrontendsArrays) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  const config::Profile p = LoadOrDie("v32");
  Twin t;
  t.seq = StartSession(p, CpuOptions(1, 160));
  t.col = StartSession(p, CpuOptions(1, 160));
  ASSERT_NE(t.seq, nullptr);
  ASSERT_NE(t.col, nullptr);
  Gen gen(TestSeed() + 2);
  const std::vector<uint64_t> ids = {41, 42, 43, 44};
  PrefillBoth(t, gen, ids, {2100, 2500, 1900, 3000}, {0});
  const int64_t n = static_cast<int64_t>(ids.size()), H = p.num_heads, D = p.head_dim;
  const std::vector<uint8_t> q_codes = gen.Fp8Codes(size_t(n * H * D));
  const std::vector<float> weights = gen.Normal(size_t(n * H), 0.05f);
  const std::vector<uint8_t> key_codes = gen.Fp8Codes(size_t(n * D));
  const std::vector<float> key_scales(size_t(n), 1.0f / 64);

  namespace dic = decode_indexer::client;
  dic::ColumnarStep step;
  step.layer = 0;
  step.step_id = 9;
  step.sequence_ids = ids;
  step.rows_per_sequence = 1;
  step.q = dic::TensorView::Of<uint8_t>(v1::DTYPE_FP8_E4M3, q_codes, {n, H, D});
  step.weights = dic::TensorView::Of<float>(v1::DTYPE_FP32, weights, {n, H});
  step.new_keys = dic::TensorView::Of<uint8_t>(v1::DTYPE_FP8_E4M3, key_codes, {n, D});
  step.new_key_scales = dic::TensorView::Of<float>(v1::DTYPE_FP32, key_scales, {n});
  absl::StatusOr<dic::StepAnswer> got = t.col->client->DecodeStepColumnar(step);
  ASSERT_TRUE(got.ok()) << got.status();

  v1::DecodeStepRequest req;  // the same step, a SequenceStep a request
  req.set_layer(0);
  req.set_step_id(9);
  for (int64_t i = 0; i < n; ++i) {
    v1::SequenceStep* s = req.add_sequences();
    s->set_sequence_id(ids[i]);
    s->set_num_rows(1);
    *s->mutable_new_keys() = client::CodesTensor(
        v1::DTYPE_FP8_E4M3, std::span<const uint8_t>(key_codes).subspan(i * D, D), {1, D});
    *s->mutable_new_key_scales() = client::F32Tensor(std::span(key_scales).subspan(i, 1), {1});
  }
  *req.mutable_q() = client::CodesTensor(v1::DTYPE_FP8_E4M3, q_codes, {n, H, D});
  *req.mutable_weights() = client::F32Tensor(weights, {n, H});
  absl::StatusOr<dic::StepAnswer> want = t.seq->client->DecodeStep(req);
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectSameAnswer(*want, *got, "unary");
  EXPECT_EQ(got->lengths, (std::vector<int64_t>{2101, 2501, 1901, 3001}));
  EXPECT_EQ(got->Row(3).size(), static_cast<size_t>(p.topk));

  // On a stream, twice (the stream's request is reused).
  absl::StatusOr<std::unique_ptr<dic::StepStream>> stream = t.col->client->OpenStream(ids[0]);
  ASSERT_TRUE(stream.ok());
  for (int k = 0; k < 2; ++k) {
    step.step_id = 10 + k;
    req.set_step_id(10 + k);
    ASSERT_TRUE((*stream)->WriteColumnar(step).ok());
    absl::StatusOr<dic::StepAnswer> a = (*stream)->Read();
    absl::StatusOr<dic::StepAnswer> b = t.seq->client->DecodeStep(req);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " / " << b.status();
    ExpectSameAnswer(*b, *a, absl::StrCat("stream step ", k));
  }
  EXPECT_TRUE((*stream)->Finish().ok());
}

// --max-sequences-per-step is the one limit on a step's sequences: a server allowed 300 (more
// than the executor's own default capacity of 256) answers a 300-sequence step in both forms
// alike, and refuses 301 at the edge, naming the flag.
TEST(ColumnarLimitTest, MaxSequencesPerStepIsTheExecutorsCapacityToo) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  const config::Profile p = LoadOrDie(TinyProfilePath());
  constexpr int kRequests = 300;
  static_assert(kRequests > exec::ExecutorOptions{}.max_requests_per_step);
  auto allow = [](service::ServerOptions& o) { o.max_sequences_per_step = kRequests; };
  exec::ExecutorOptions cpu = CpuOptions(1, 1024);
  cpu.max_sequences = kRequests + 1;
  Twin t;
  t.seq = StartSession(p, cpu, allow);
  t.col = StartSession(p, cpu, allow);
  ASSERT_NE(t.seq, nullptr);
  ASSERT_NE(t.col, nullptr);
  Gen gen(TestSeed());
  std::vector<uint64_t> ids;
  std::vector<int64_t> lengths;
  for (int i = 0; i < kRequests; ++i) {
    ids.push_back(5000 + i);
    lengths.push_back(8 + int64_t(gen.rng()() % 40));
  }
  PrefillBoth(t, gen, ids, lengths, {0});
  const v1::DecodeStepRequest req =
      RandomStep(gen, t, 0, ids, 1, QForm::kQuantized, KeyForm::kQuantized, true, 1);
  absl::StatusOr<client::StepAnswer> a = t.seq->client->DecodeStep(req);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<client::StepAnswer> b = t.col->client->DecodeStep(ToColumnar(req));
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSameAnswer(*a, *b, "300 sequences");
  EXPECT_EQ(a->lengths.size(), size_t(kRequests));

  ASSERT_TRUE(t.col->client->CreateSequence(9999).ok());
  v1::DecodeStepRequest more = ToColumnar(req);
  more.add_sequence_ids(9999);
  absl::StatusOr<client::StepAnswer> refused = t.col->client->DecodeStep(more);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("--max-sequences-per-step"), std::string::npos)
      << refused.status();
}

// Bad columnar input: INVALID_ARGUMENT naming the field, and no cache changes its length
// (the later valid step answers as a server that never saw the bad ones).
TEST(ColumnarBadInputTest, IsRefusedAndChangesNothing) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  const config::Profile p = LoadOrDie(TinyProfilePath());
  Twin t;
  t.seq = StartSession(p, CpuOptions(1, 128));
  t.col = StartSession(p, CpuOptions(1, 128),
                       [](service::ServerOptions& o) { o.max_sequences_per_step = 3; });
  ASSERT_NE(t.seq, nullptr);
  ASSERT_NE(t.col, nullptr);
  Gen gen(TestSeed() + 1);
  const std::vector<uint64_t> ids = {71, 72, 73};
  PrefillBoth(t, gen, ids, {40, 70, 100}, {0, 1, 2});
  auto state = [&](Session& s) {
    std::string out;
    for (uint64_t id : ids) {
      absl::StatusOr<v1::GetSequenceResponse> r = s.client->GetSequence(id);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) out += r->ShortDebugString() + "\n";
    }
    return out;
  };
  const std::string before = state(*t.col);

  // Layer 0 (dense FP8): fp32 keys, one a row, the last request rolled back by one.
  v1::DecodeStepRequest req =
      RandomStep(gen, t, 0, ids, 2, QForm::kF32Rope, KeyForm::kF32, true, 5);
  for (v1::SequenceStep& s : *req.mutable_sequences()) {
    if (!s.has_new_keys()) {
      auto [k, ks] = gen.Keys(KeyForm::kF32, 2, p.layers[0].cache_format, p.head_dim);
      *s.mutable_new_keys() = std::move(k);
    }
    s.clear_row_lengths();
  }
  req.mutable_sequences(2)->set_new_keys_position(t.length.at({0, ids[2]}) - 1);
  const v1::DecodeStepRequest good = ToColumnar(req);
  ASSERT_EQ(good.new_keys().shape(0), 6);

  struct Bad {
    const char* field;
    std::function<void(v1::DecodeStepRequest&)> spoil;
  };
  const Bad bad[] = {
      {"sequence_ids[2]", [&](auto& r) { r.set_sequence_ids(2, ids[0]); }},
      {"sequence_ids", [&](auto& r) { r.add_sequence_ids(99); }},  // 4 > --max-sequences-per-step
      {"num_rows", [](auto& r) { r.add_num_rows(2); }},
      {"num_rows[2]", [](auto& r) { r.set_num_rows(2, 0); }},
      {"rows_per_sequence", [](auto& r) { r.set_rows_per_sequence(2); }},
      {"new_key_counts", [](auto& r) { r.add_new_key_counts(2); }},
      {"new_key_counts[2]",
       [](auto& r) {
         for (int32_t c : {2, 2, -1}) r.add_new_key_counts(c);
       }},
      {"new_keys_positions[2]", [](auto& r) { r.set_new_keys_positions(2, -7); }},
      {"new_keys_positions", [](auto& r) { r.add_new_keys_positions(-1); }},
      {"row_lengths", [](auto& r) { r.add_row_lengths(3); }},
      {"row_lengths[5]",
       [](auto& r) {
         for (int32_t l : {3, 4, 0, 0, 5, 0}) r.add_row_lengths(l);
       }},
      {"new_keys.shape", [](auto& r) { r.mutable_new_keys()->set_shape(0, 5); }},
      {"new_keys.data",
       [](auto& r) {
         // A NaN in the last request's last key.
         std::string* d = r.mutable_new_keys()->mutable_data();
         const uint32_t nan = 0x7FC00000u;
         std::memcpy(d->data() + d->size() - 4, &nan, 4);
       }},
      {"new_key_scales",
       [](auto& r) {
         *r.mutable_new_key_scales() = client::F32Tensor(std::vector<float>(6, 1.0f), {6});
       }},
      {"sequence_ids", [](auto& r) { r.add_sequences()->set_sequence_id(5); }},  // mixed forms
  };
  for (const Bad& b : bad) {
    v1::DecodeStepRequest r = good;
    b.spoil(r);
    absl::StatusOr<client::StepAnswer> got = t.col->client->DecodeStep(r);
    ASSERT_FALSE(got.ok()) << b.field << ": accepted";
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
        << b.field << ": " << got.status();
    const std::string message(got.status().message());
    EXPECT_EQ(message.rfind(std::string(b.field) + ":", 0), 0u)
        << "expected the message to name " << b.field << ": " << message;
    EXPECT_EQ(state(*t.col), before) << b.field << " changed the server's state";
  }
  // What only the executor can check (state) is named the columnar way too.
  struct Stateful {
    absl::StatusCode code;
    const char* field;
    std::function<void(v1::DecodeStepRequest&)> spoil;
  };
  const Stateful stateful[] = {
      {absl::StatusCode::kNotFound, "sequence_ids[2]",
       [](auto& r) { r.set_sequence_ids(2, 4242); }},
      {absl::StatusCode::kInvalidArgument, "new_keys_positions[1]",
       [&](auto& r) {
         r.set_new_keys_positions(1, t.length.at({0, ids[1]}) + 1);
       }},  // a hole
      {absl::StatusCode::kInvalidArgument, "row_lengths[3]",
       [&](auto& r) {
         for (int32_t l : {0, 0, 0, 0, 0, 0}) r.add_row_lengths(l);
         r.set_row_lengths(2, 1);  // request 1's rows (2 and 3): 1, then past its length
         r.set_row_lengths(3, static_cast<int32_t>(t.length.at({0, ids[1]})) + 50);
       }},
  };
  for (const Stateful& b : stateful) {
    v1::DecodeStepRequest r = good;
    b.spoil(r);
    absl::StatusOr<client::StepAnswer> got = t.col->client->DecodeStep(r);
    ASSERT_FALSE(got.ok()) << b.field << ": accepted";
    EXPECT_EQ(got.status().code(), b.code) << b.field << ": " << got.status();
    const std::string message(got.status().message());
    EXPECT_EQ(message.rfind(std::string(b.field) + ":", 0), 0u)
        << "expected the message to name " << b.field << ": " << message;
    EXPECT_EQ(state(*t.col), before) << b.field << " changed the server's state";
  }

  // Also on a stream: the bad step ends it with the same error, and nothing changed.
  {
    absl::StatusOr<std::unique_ptr<client::StepStream>> stream = t.col->client->OpenStream();
    ASSERT_TRUE(stream.ok());
    v1::DecodeStepRequest r = good;
    r.set_new_keys_positions(1, -3);
    (void)(*stream)->Write(r);
    absl::StatusOr<client::StepAnswer> got = (*stream)->Read();
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_EQ(std::string(got.status().message()).rfind("new_keys_positions[1]:", 0), 0u)
        << got.status();
    EXPECT_EQ(state(*t.col), before);
  }

  // The valid step answers as the server that saw none of the bad ones.
  absl::StatusOr<client::StepAnswer> a = t.seq->client->DecodeStep(req);
  absl::StatusOr<client::StepAnswer> b = t.col->client->DecodeStepColumnar(StepOf(good));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSameAnswer(*a, *b, "the valid step after the bad ones");
  EXPECT_EQ(state(*t.col), state(*t.seq));
}

}  // namespace
}  // namespace decode_indexer::testing
