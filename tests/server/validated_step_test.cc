// Validation once (server/exec/validated_step.h) for a caller that builds a StepInput in
// process: every stateless fault is refused by ValidateStep with INVALID_ARGUMENT naming the
// field, before anything reaches an executor; a StepValidator hands out a ValidatedStep only
// when every stage ran for every request of the input it is given.
#include "server/exec/validated_step.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/server/exec_harness.h"

namespace decode_indexer::testing {
namespace {

using exec::StepInput;
using exec::ValidatedStep;
using kernels::ElemType;

class ValidatedStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = FreshSeed();
    h_ = std::make_unique<Harness>(SmallV41(), seed_);
  }

  // A valid step at `layer` (v41-style: 0 dense, 1 the source, 2 and 3 its consumers): three
  // requests of 1, 2 and 1 rows, keys where the layer owns its cache.
  std::unique_ptr<StepData> Valid(int32_t layer) {
    const bool consumer = h_->profile().layers[layer].role == config::LayerRole::kCandidateConsumer;
    const int32_t keys = consumer ? 0 : 1;
    return h_->MakeStep(layer, {{11, 1, keys, {}}, {12, 2, 2 * keys, {}}, {13, 1, keys, {}}});
  }

  // ValidateStep refuses the mutated step with INVALID_ARGUMENT, its message starting with
  // `field` + ":".
  void ExpectRefused(int32_t layer, const std::function<void(StepData&)>& mutate,
                     const std::string& field) {
    std::unique_ptr<StepData> step = Valid(layer);
    ASSERT_TRUE(exec::ValidateStep(h_->profile(), step->input).ok());
    mutate(*step);
    absl::StatusOr<ValidatedStep> v = exec::ValidateStep(h_->profile(), step->input);
    ASSERT_FALSE(v.ok()) << "accepted; expected a complaint about " << field;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
    EXPECT_EQ(std::string(v.status().message()).rfind(field + ":", 0), 0u)
        << "message does not start with \"" << field << ":\": " << v.status().message();
  }

  uint64_t seed_ = 0;
  std::unique_ptr<Harness> h_;
};

TEST_F(ValidatedStepTest, AcceptsValidStepsOfEveryRole) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  for (int32_t layer = 0; layer < 4; ++layer) {
    std::unique_ptr<StepData> step = Valid(layer);
    absl::StatusOr<ValidatedStep> v = exec::ValidateStep(h_->profile(), step->input);
    ASSERT_TRUE(v.ok()) << "layer " << layer << ": " << v.status();
    EXPECT_EQ(&v->spec(), &h_->profile().layers[layer]);
    EXPECT_EQ(v->input().num_rows, 4);
    EXPECT_EQ(v->input().sequences.size(), 3u);
    EXPECT_EQ(v->input().q.q, step->input.q.q);  // a view of the caller's buffers
  }
}

TEST_F(ValidatedStepTest, RefusesEveryStatelessFaultNamingTheField) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const config::Profile& p = h_->profile();
  const int32_t M = p.max_rows_per_sequence;
  // The layer and what it takes.
  ExpectRefused(
      0, [](StepData& s) { s.input.layer = 9; }, "layer");
  ExpectRefused(
      0, [](StepData& s) { s.input.layer = -1; }, "layer");
  ExpectRefused(
      0, [](StepData& s) { s.input.return_candidates = true; }, "return_candidates");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences.clear(); }, "sequences");
  // Ids and rows.
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[2].sequence_id = 11; }, "sequences[2].sequence_id");
  ExpectRefused(
      0,
      [](StepData& s) {
        s.input.sequences[1].num_rows = 0;
        s.input.num_rows -= 2;
      },
      "sequences[1].num_rows");
  ExpectRefused(
      0,
      [M](StepData& s) {
        s.input.sequences[0].num_rows = M + 1;
        s.input.num_rows += M;
      },
      "sequences[0].num_rows");
  ExpectRefused(
      0, [](StepData& s) { s.input.num_rows = 5; }, "num_rows");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[1].row_lengths = {4}; }, "sequences[1].row_lengths");
  ExpectRefused(
      0,
      [](StepData& s) {
        s.input.sequences[1].row_lengths = {4, 0};
      },
      "sequences[1].row_lengths[1]");
  const int32_t too_long = static_cast<int32_t>(p.max_context) + 1;
  ExpectRefused(
      0, [too_long](StepData& s) { s.input.sequences[0].row_lengths = {too_long}; },
      "sequences[0].row_lengths[0]");
  // Keys: none at a consumer, and their form.
  ExpectRefused(
      2,
      [&](StepData& s) {
        s.input.sequences[1].new_keys = Valid(0)->input.sequences[0].new_keys;
        s.input.sequences[1].new_keys.keys = s.q.data();  // any bytes: never read
      },
      "sequences[1].new_keys");
  ExpectRefused(
      3, [](StepData& s) { s.input.sequences[0].new_keys.position = 4; },
      "sequences[0].new_keys_position");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[2].new_keys.position = -1; },
      "sequences[2].new_keys_position");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[0].new_keys.count = -1; }, "sequences[0].new_keys");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[0].new_keys.keys = nullptr; },
      "sequences[0].new_keys");
  ExpectRefused(
      0,
      [](StepData& s) {
        s.input.sequences[1].new_keys.type = ElemType::kFp8E4M3;  // an FP4 cache
        s.input.sequences[1].new_keys.scales = s.weights.data();
      },
      "sequences[1].new_keys.dtype");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[1].new_keys.type = ElemType::kI32; },
      "sequences[1].new_keys.dtype");
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[1].new_keys.type = ElemType::kFp4E2M1; },
      "sequences[1].new_key_scales");  // FP4 keys without their scales
  ExpectRefused(
      0, [](StepData& s) { s.input.sequences[0].new_keys.scales = s.weights.data(); },
      "sequences[0].new_key_scales");  // scales with fp32 keys
  // q, its scales, weights and positions.
  ExpectRefused(
      0, [](StepData& s) { s.input.q.q = nullptr; }, "q");
  ExpectRefused(
      0, [](StepData& s) { s.input.q.weights = nullptr; }, "weights");
  ExpectRefused(
      0,
      [](StepData& s) {
        s.input.q.type = ElemType::kFp8E4M3;  // an FP4 layer
        s.input.q.positions = nullptr;
      },
      "q.dtype");
  ExpectRefused(
      0, [](StepData& s) { s.input.q.type = ElemType::kI64; }, "q.dtype");
  ExpectRefused(
      0,
      [](StepData& s) {
        s.input.q.type = ElemType::kFp4E2M1;
        s.input.q.positions = nullptr;
      },
      "q_scales");
  ExpectRefused(
      0, [](StepData& s) { s.input.q.scales = s.q.data(); }, "q_scales");  // with fp32 q
  ExpectRefused(
      0,
      [](StepData& s) {
        s.input.q.type = ElemType::kFp4E2M1;
        s.input.q.scales = s.q.data();
      },
      "positions");  // RoPE needs the unrotated q
  ExpectRefused(
      0, [](StepData& s) { s.positions[3] = -1; }, "positions[3]");
  const int64_t max_context = p.max_context;
  ExpectRefused(
      0, [max_context](StepData& s) { s.positions[0] = max_context; }, "positions[0]");
}

// The edge runs the stages itself: a ValidatedStep comes out only when each ran for every
// request of the very input handed to Finish.
TEST_F(ValidatedStepTest, FinishNeedsEveryStageForEveryRequest) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  std::unique_ptr<StepData> step = Valid(0);
  const StepInput& in = step->input;
  enum Skip { kNone, kRows, kRowLengths, kKeys, kQ, kLastRequest };
  for (Skip skip : {kNone, kRows, kRowLengths, kKeys, kQ, kLastRequest}) {
    SCOPED_TRACE(absl::StrCat("skipped stage ", int(skip)));
    exec::StepValidator v(h_->profile());
    ASSERT_TRUE(v.Layer(in.layer, in.return_candidates).ok());
    const int32_t n = static_cast<int32_t>(in.sequences.size()) - (skip == kLastRequest ? 1 : 0);
    int32_t rows = 0;
    for (int32_t i = 0; i < n; ++i) {
      const exec::SequenceStepInput& s = in.sequences[i];
      if (skip != kRows) {
        ASSERT_TRUE(v.Rows(i, s.sequence_id, s.num_rows).ok());
      }
      if (skip != kRowLengths) {
        ASSERT_TRUE(v.RowLengths(i, s).ok());
      }
      if (skip != kKeys) {
        ASSERT_TRUE(v.Keys(i, s.new_keys).ok());
      }
      rows += s.num_rows;
    }
    if (skip != kQ) {
      ASSERT_TRUE(v.Q(in.q, skip == kRows ? 0 : rows).ok());
    }
    absl::StatusOr<ValidatedStep> done = v.Finish(in);
    if (skip == kNone) {
      EXPECT_TRUE(done.ok()) << done.status();
    } else {
      ASSERT_FALSE(done.ok());
      EXPECT_EQ(done.status().code(), absl::StatusCode::kInternal) << done.status();
    }
  }
  // Another input than the one the stages saw: another layer.
  exec::StepValidator v(h_->profile());
  ASSERT_TRUE(v.Layer(in.layer, false).ok());
  for (int32_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(v.Rows(i, in.sequences[i].sequence_id, in.sequences[i].num_rows).ok());
    ASSERT_TRUE(v.RowLengths(i, in.sequences[i]).ok());
    ASSERT_TRUE(v.Keys(i, in.sequences[i].new_keys).ok());
  }
  ASSERT_TRUE(v.Q(in.q, in.num_rows).ok());
  StepInput other = in;
  other.layer = 1;
  EXPECT_EQ(v.Finish(other).status().code(), absl::StatusCode::kInternal);
}

// AppendKeys' checks: the layer owns its cache, the keys' form fits it.
TEST_F(ValidatedStepTest, ValidateAppendRefusesWithTheField) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  std::vector<uint8_t> keys, scales;
  exec::KeysInput in;
  h_->RandomKeys(1, 3, KeyForm::kQuantized, &keys, &scales, &in.type);
  in.count = 3;
  in.keys = keys.data();
  in.scales = scales.data();
  absl::StatusOr<exec::ValidatedAppend> ok = exec::ValidateAppend(h_->profile(), 7, 1, in);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->sequence_id(), 7u);
  EXPECT_EQ(ok->layer(), 1);
  EXPECT_EQ(ok->keys().keys, keys.data());
  auto refused = [&](int32_t layer, const exec::KeysInput& k, const std::string& field) {
    absl::StatusOr<exec::ValidatedAppend> r = exec::ValidateAppend(h_->profile(), 7, layer, k);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_EQ(std::string(r.status().message()).rfind(field + ":", 0), 0u) << r.status();
  };
  refused(4, in, "layer");
  refused(2, in, "layer");  // a consumer
  exec::KeysInput bad = in;
  bad.scales = nullptr;
  refused(1, bad, "key_scales");
  bad = in;
  bad.type = ElemType::kFp8E4M3;
  refused(1, bad, "keys.dtype");
  bad = in;
  bad.position = -3;
  refused(1, bad, "position");
  bad = in;
  bad.count = -1;
  refused(1, bad, "keys");
}

}  // namespace
}  // namespace decode_indexer::testing
