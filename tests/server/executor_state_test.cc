// The executor's state rules: every rejected call leaves lengths, pages and candidates as they
// were (later steps answer as if it never happened); release frees pages; sequence limits;
// shutdown.
#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/exec/executor.h"
#include "server/exec/executor_internal.h"
#include "server/exec/page_table_mirror.h"
#include "tests/server/checking_backend.h"
#include "tests/server/exec_harness.h"

namespace decode_indexer::testing {
namespace {

using config::LayerRole;
using exec::Executor;
using exec::ExecutorOptions;
using exec::KeysInput;
using exec::StepResult;
using ::testing::HasSubstr;

std::unique_ptr<Executor> MakeExecutor(const config::Profile& profile,
                                       const ExecutorOptions& options) {
  absl::StatusOr<std::unique_ptr<Executor>> e = Executor::Create(profile, options);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

struct Snapshot {
  int64_t sequences = 0;
  std::vector<int64_t> pages_free;
  uint64_t steps = 0;
  bool operator==(const Snapshot&) const = default;
};

Snapshot Take(const Executor& e) {
  exec::ExecutorStatus s = e.Status();
  Snapshot out{s.sequences, {}, s.steps};
  for (const exec::CachePoolStatus& c : s.caches) out.pages_free.push_back(c.pages_free);
  return out;
}

class ExecutorState : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = FreshSeed();
    h_ = std::make_unique<Harness>(SmallV41(), seed_);
    ExecutorOptions o = CpuOptions(2);
    o.cache_pages = 64;  // 1024 entries a pool: small enough to exhaust
    // Backends that check every kernel pointer and can fail one rank on demand.
    absl::StatusOr<std::unique_ptr<Executor>> e = exec::CreateExecutorWithBackends(
        h_->profile(), o,
        [this](int32_t rank, const kernels::BackendLimits& limits)
            -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
          return MakeCheckingBackend(kernels::MakeCpuBackend(limits, 1), &violations_, rank,
                                     &fail_rank_, &pause_);
        });
    ASSERT_TRUE(e.ok()) << e.status();
    e_ = *std::move(e);
  }
  void TearDown() override { EXPECT_EQ(violations_.load(), 0); }

  void Append(uint64_t id, int32_t layer, int32_t count) {
    std::vector<uint8_t> keys, scales;
    KeysInput in;
    h_->RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
    in.count = count;
    in.keys = keys.data();
    absl::StatusOr<int64_t> len = e_->AppendKeys(id, layer, in);
    ASSERT_TRUE(len.ok()) << len.status();
    h_->RecordAppend(id, layer, in);
  }

  // A valid step, checked against the oracle.
  void Step(int32_t layer, const std::vector<SeqPlan>& plans) {
    std::unique_ptr<StepData> step = h_->MakeStep(layer, plans);
    step->input.return_candidates = h_->profile().layers[layer].role == LayerRole::kCandidateSource;
    absl::StatusOr<StepResult> r = e_->DecodeStep(step->input);
    ASSERT_TRUE(r.ok()) << r.status();
    h_->RecordStep(*step);
    const int32_t cache_layer = h_->profile().layers[layer].cache_layer;
    ASSERT_EQ(r->lengths.size(), plans.size());
    for (size_t i = 0; i < plans.size(); ++i) {
      EXPECT_EQ(r->lengths[i], h_->Length(plans[i].id, cache_layer)) << "sequence " << plans[i].id;
    }
    EXPECT_TRUE(h_->Check(*step, *r));
  }

  // A rejected step: its code, its message, and no change of state.
  void Reject(int32_t layer, const std::vector<SeqPlan>& plans, absl::StatusCode code,
              const std::string& message, KeyForm key_form = KeyForm::kF32) {
    std::unique_ptr<StepData> step = h_->MakeStep(layer, plans, QForm::kF32, key_form);
    RejectStep(*step, code, message);
  }
  void RejectStep(const StepData& step, absl::StatusCode code, const std::string& message) {
    SCOPED_TRACE(absl::StrCat("expecting: ", message));
    const Snapshot before = Take(*e_);
    absl::StatusOr<StepResult> r = e_->DecodeStep(step.input);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(message));
    EXPECT_EQ(Take(*e_), before);
  }

  // One full round over every layer for these sequences, checked against the oracle.
  void Round(const std::vector<uint64_t>& ids, int32_t n) {
    std::vector<SeqPlan> plans;
    for (uint64_t id : ids) plans.push_back({id, n, n, {}});
    std::vector<SeqPlan> consumer = plans;
    for (SeqPlan& p : consumer) p.new_keys = 0;
    for (const config::LayerSpec& l : h_->profile().layers) {
      SCOPED_TRACE(absl::StrCat("layer ", l.layer));
      Step(l.layer, l.role == LayerRole::kCandidateConsumer ? consumer : plans);
    }
  }

  uint64_t seed_ = 0;
  std::atomic<int64_t> violations_{0};
  std::atomic<int32_t> fail_rank_{-1};
  // Set only between steps (the ranks read it inside one).
  std::function<void()> pause_;
  std::unique_ptr<Harness> h_;
  std::unique_ptr<Executor> e_;
};

TEST_F(ExecutorState, RejectedCallsChangeNothing) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const config::Profile& p = h_->profile();
  for (uint64_t id = 1; id <= 4; ++id) {
    ASSERT_TRUE(e_->CreateSequence(id).ok());
    for (int32_t layer : p.CacheLayers()) Append(id, layer, 30 + int32_t(h_->rng()() % 90));
  }
  // Consumers before any source step.
  Reject(2, {{1, 1, 0, {}}}, absl::StatusCode::kFailedPrecondition,
         "sequences[0]: no candidates for sequence 1 at length");
  Reject(2, {{1, 1, 0, {}}}, absl::StatusCode::kFailedPrecondition, "run the source layer 1");
  Round({1, 2, 3, 4}, 2);

  // A good sequence followed by an unknown one: the good one's keys must not land.
  Reject(0, {{1, 2, 2, {}}, {77, 1, 1, {}}}, absl::StatusCode::kNotFound,
         "sequences[1].sequence_id");
  Reject(0, {{1, 2, 2, {}}, {1, 1, 1, {}}}, absl::StatusCode::kInvalidArgument,
         "sequences[1].sequence_id: 1 appears twice");
  Reject(0, {{1, p.max_rows_per_sequence + 1, 1, {}}}, absl::StatusCode::kInvalidArgument,
         "sequences[0].num_rows");
  // Past max_context.
  const int64_t L1 = h_->Length(1, 0);
  Reject(0, {{2, 1, 1, {}}, {1, 1, int32_t(p.max_context - L1 + 1), {}}},
         absl::StatusCode::kOutOfRange, "sequences[1].new_keys: length");
  // More rows than context: a sequence with one key.
  ASSERT_TRUE(e_->CreateSequence(5).ok());
  Append(5, 0, 1);
  Reject(0, {{5, 3, 0, {}}}, absl::StatusCode::kInvalidArgument, "more rows than context");
  Reject(0, {{5, 3, 1, {}}}, absl::StatusCode::kInvalidArgument, "more rows than context");
  // Row lengths out of [1, L].
  const int32_t L2 = int32_t(h_->Length(2, 0)) + 1;
  Reject(0, {{2, 2, 1, {3, 0}}}, absl::StatusCode::kInvalidArgument,
         "sequences[0].row_lengths[1]: must be in [1, ");
  Reject(0, {{2, 1, 1, {L2 + 1}}}, absl::StatusCode::kInvalidArgument,
         "sequences[0].row_lengths[0]");
  // Pages: one sequence asking for more than the pool holds.
  Reject(0, {{3, 1, 900, {}}}, absl::StatusCode::kResourceExhausted, "cache layer 0: need");
  // Keys at a consumer, and keys in the wrong quantized format.
  Reject(2, {{1, 2, 2, {}}}, absl::StatusCode::kInvalidArgument,
         "sequences[0].new_keys: layer 2 reads layer 1's cache");
  {
    std::unique_ptr<StepData> step = h_->MakeStep(0, {{1, 1, 1, {}}});
    step->input.sequences[0].new_keys.type = kernels::ElemType::kFp8E4M3;  // FP4 cache
    RejectStep(*step, absl::StatusCode::kInvalidArgument, "cache's format");
  }
  {
    // A good sequence followed by one whose keys are in the wrong format: refused at
    // sequences[1], and sequence 1's keys must not land either. A step of sequence 1 alone
    // then answers at its old length (Step checks the lengths and the answer).
    std::unique_ptr<StepData> step = h_->MakeStep(0, {{1, 2, 2, {}}, {2, 1, 1, {}}});
    step->input.sequences[1].new_keys.type = kernels::ElemType::kFp8E4M3;  // FP4 cache
    RejectStep(*step, absl::StatusCode::kInvalidArgument,
               "sequences[1].new_keys.dtype: pre-quantized");
    Step(0, {{1, 1, 1, {}}});
  }
  // return_candidates away from the source.
  {
    std::unique_ptr<StepData> step = h_->MakeStep(0, {{1, 1, 1, {}}});
    step->input.return_candidates = true;
    RejectStep(*step, absl::StatusCode::kInvalidArgument, "not a candidate source");
  }
  // Consumers whose rows differ from the source's last step (2 rows a sequence).
  Reject(3, {{1, 1, 0, {}}}, absl::StatusCode::kFailedPrecondition, "no candidates");
  Reject(3, {{1, 2, 0, {5, 6}}}, absl::StatusCode::kFailedPrecondition, "no candidates");
  // AppendKeys to a consumer layer, to an unknown sequence, past max_context.
  {
    const Snapshot before = Take(*e_);
    std::vector<uint8_t> keys, scales;
    KeysInput in;
    h_->RandomKeys(1, 4, KeyForm::kF32, &keys, &scales, &in.type);
    in.count = 4;
    in.keys = keys.data();
    absl::StatusOr<int64_t> r = e_->AppendKeys(1, 2, in);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("layer 2 is a candidate consumer"));
    r = e_->AppendKeys(99, 1, in);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
    r = e_->AppendKeys(1, 7, in);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(Take(*e_), before);
  }
  // The consumers still see the candidates of the last good source step ...
  for (int32_t layer : {2, 3}) Step(layer, {{2, 2, 0, {}}, {4, 2, 0, {}}, {1, 2, 0, {}}});
  // ... until the source's cache grows: then the candidates are stale.
  Append(1, 1, 3);
  Reject(2, {{1, 2, 0, {}}}, absl::StatusCode::kFailedPrecondition,
         "no candidates for sequence 1 at length");
  // And everything answers as if the rejected calls never happened.
  Round({4, 3, 2, 1}, 1);
  Round({1, 2, 3, 4}, 4);
}

// A rank failing after the step's keys were written (in the scoring, the candidate scatter
// or the expansion): the step fails on every layer role, sharded or not, without a hang;
// lengths, pages and candidates stay; later steps answer as if it never ran.
TEST_F(ExecutorState, RankFailureAfterKeysChangesNothing) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const config::Profile& p = h_->profile();
  std::vector<uint64_t> ids;
  for (uint64_t id = 1; id <= 8; ++id) {
    ASSERT_TRUE(e_->CreateSequence(id).ok());
    for (int32_t layer : p.CacheLayers()) Append(id, layer, 20 + int32_t(h_->rng()() % 60));
    ids.push_back(id);
  }
  Round(ids, 2);
  for (int32_t failing : {1, 0}) {
    for (bool sharded : {true, false}) {
      SCOPED_TRACE(absl::StrCat("failing rank ", failing, sharded ? " sharded" : " unsharded"));
      std::vector<SeqPlan> plans;
      // Sharded: 8 requests of 2 rows. Unsharded: one sequence brings 1 row.
      for (uint64_t id : ids) plans.push_back({id, 2, 2, {}});
      if (!sharded) plans.back() = {ids.back(), 1, 1, {}};
      for (const config::LayerSpec& l : p.layers) {
        SCOPED_TRACE(absl::StrCat("layer ", l.layer));
        std::vector<SeqPlan> step_plans = plans;
        if (l.role == LayerRole::kCandidateConsumer) {
          // Rows as the last good source step had them, so the step passes validation.
          step_plans.clear();
          for (uint64_t id : ids) step_plans.push_back({id, 2, 0, {}});
        }
        std::unique_ptr<StepData> step = h_->MakeStep(l.layer, step_plans);
        fail_rank_ = failing;
        RejectStep(*step, absl::StatusCode::kInternal, "injected fault");
        fail_rank_ = -1;
      }
    }
  }
  // The consumers still read the candidates of the last good source step.
  std::vector<SeqPlan> consumer_plans;
  for (uint64_t id : ids) consumer_plans.push_back({id, 2, 0, {}});
  for (int32_t layer : {2, 3}) Step(layer, consumer_plans);
  Round(ids, 2);
  Round(ids, 1);
}

// A failed step's page-table edits reach the ranks that ran before it failed: every rank's
// resident table must get the committed pages back, or a later step reads a page that now
// belongs to another sequence. Here a cut-back rewrites a committed page into a fresh one on
// rank 0 (the answering rank) while rank 1 fails; another sequence then takes every free page,
// that fresh one included, and writes its own keys there.
TEST_F(ExecutorState, FailedStepLeavesNoStalePageInTheTables) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const config::Profile& p = h_->profile();
  const int32_t P = p.page_size;
  ASSERT_EQ(p.layers[0].role, LayerRole::kDense);
  ASSERT_TRUE(e_->CreateSequence(1).ok());
  Append(1, 0, 10 * P);
  Step(0, {{1, 2, 0, {}}});  // the table holds the ten pages on every rank

  std::unique_ptr<StepData> cut = h_->MakeStep(0, {{1, 1, 1, {}}});
  cut->input.sequences[0].new_keys.position = 8 * P + 3;  // rewrites page 8
  fail_rank_ = 1;
  RejectStep(*cut, absl::StatusCode::kInternal, "injected fault");
  fail_rank_ = -1;

  ASSERT_TRUE(e_->CreateSequence(2).ok());
  const int64_t free_pages = e_->Status().caches[0].pages_free;
  ASSERT_GT(free_pages, 0);
  Append(2, 0, static_cast<int32_t>(free_pages * P));
  ASSERT_EQ(e_->Status().caches[0].pages_free, 0);
  // Rows that see page 8 and little else past the top-k's reach of the others.
  Step(0, {{1, 4, 0, {8 * P + 4, 8 * P + 9, 9 * P, 10 * P}}});
  Step(0, {{1, 1, 0, {}}, {2, 1, 0, {}}});
}

TEST(PageTableMirror, PendingKeepsTheLastEditOfEachEntry) {
  exec::PageTableMirror m(/*num_pools=*/2, /*stride=*/8);
  EXPECT_TRUE(m.Pending(0).empty());
  const std::vector<int32_t> a = {5, 6, 7};
  const std::vector<int32_t> b = {9};
  m.Record(0, /*slot=*/3, /*first=*/1, a);  // entries 25, 26, 27
  m.Record(0, /*slot=*/3, /*first=*/2, b);  // entry 26 again
  m.Record(1, /*slot=*/0, /*first=*/0, b);
  const exec::TableEdits& e = m.Pending(0);
  EXPECT_EQ(e.index, (std::vector<int32_t>{25, 26, 27}));
  EXPECT_EQ(e.page, (std::vector<int32_t>{5, 9, 7}));
  m.Applied(0);
  EXPECT_TRUE(m.Pending(0).empty());
  EXPECT_EQ(m.Pending(1).index, (std::vector<int32_t>{0}));
  EXPECT_EQ(m.Pending(1).page, (std::vector<int32_t>{9}));
}

// A caller whose deadline passes while its step or append runs (the kernels take longer than
// the deadline allows) is answered DEADLINE_EXCEEDED with nothing committed, at every layer
// role, with the ranks sharded or not: lengths, pages and candidates stay, and the same call
// retried commits once. (The old executor committed such a call; the edge then answered
// DEADLINE_EXCEEDED, so a client's retry appended its keys twice.)
TEST_F(ExecutorState, DeadlinePassingMidCallCommitsNothing) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  using Clock = std::chrono::steady_clock;
  const config::Profile& p = h_->profile();
  std::vector<uint64_t> ids;
  for (uint64_t id = 1; id <= 8; ++id) {
    ASSERT_TRUE(e_->CreateSequence(id).ok());
    for (int32_t layer : p.CacheLayers()) Append(id, layer, 20 + int32_t(h_->rng()() % 60));
    ids.push_back(id);
  }
  Round(ids, 2);
  Clock::time_point deadline;
  const exec::CallCheck call_check = [&]() -> absl::Status {
    if (Clock::now() < deadline) return absl::OkStatus();
    return absl::DeadlineExceededError("the test's deadline passed");
  };
  // Every kernel waits until the deadline has passed: the call is then mid-run by
  // construction, whatever the machine's speed.
  auto slow_kernels = [&] {
    deadline = Clock::now() + std::chrono::milliseconds(20);
    pause_ = [&] { std::this_thread::sleep_until(deadline + std::chrono::milliseconds(1)); };
  };
  auto lengths = [&] {
    std::vector<int64_t> out;
    for (uint64_t id : ids) {
      absl::StatusOr<exec::SequenceInfo> info = e_->GetSequence(id);
      EXPECT_TRUE(info.ok()) << info.status();
      if (!info.ok()) continue;
      for (const exec::SequenceCacheInfo& c : info->caches) out.push_back(c.length);
      for (const auto& [layer, at] : info->candidates) out.push_back(-1000 * layer - at);
    }
    return out;
  };
  for (bool sharded : {true, false}) {
    SCOPED_TRACE(sharded ? "sharded" : "unsharded");
    std::vector<SeqPlan> plans;
    for (uint64_t id : ids) plans.push_back({id, 2, 2, {}});
    if (!sharded) plans = {{ids.back(), 1, 1, {}}};
    for (const config::LayerSpec& l : p.layers) {
      SCOPED_TRACE(absl::StrCat("layer ", l.layer));
      std::vector<SeqPlan> step_plans = plans;
      if (l.role == LayerRole::kCandidateConsumer) {
        for (SeqPlan& sp : step_plans) sp.new_keys = 0;  // rows as the source's last step
      }
      std::unique_ptr<StepData> step = h_->MakeStep(l.layer, step_plans);
      step->input.return_candidates = l.role == LayerRole::kCandidateSource;
      step->input.call_check = call_check;
      const Snapshot before = Take(*e_);
      const std::vector<int64_t> lengths_before = lengths();
      slow_kernels();
      absl::StatusOr<StepResult> r = e_->DecodeStep(step->input);
      pause_ = nullptr;
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr("nothing was committed"));
      EXPECT_EQ(Take(*e_), before);
      EXPECT_EQ(lengths(), lengths_before);
      // The retry (no deadline now) commits once and answers as the oracle says.
      step->input.call_check = nullptr;
      r = e_->DecodeStep(step->input);
      ASSERT_TRUE(r.ok()) << r.status();
      h_->RecordStep(*step);
      for (size_t i = 0; i < step_plans.size(); ++i) {
        EXPECT_EQ(r->lengths[i], h_->Length(step_plans[i].id, l.cache_layer));
      }
      EXPECT_TRUE(h_->Check(*step, *r));
    }
  }
  // AppendKeys: keys, and a cut back to an explicit position.
  for (int32_t layer : p.CacheLayers()) {
    SCOPED_TRACE(absl::StrCat("append to layer ", layer));
    std::vector<uint8_t> keys, scales;
    KeysInput in;
    h_->RandomKeys(layer, 5, KeyForm::kF32, &keys, &scales, &in.type);
    in.count = 5;
    in.keys = keys.data();
    const Snapshot before = Take(*e_);
    const std::vector<int64_t> lengths_before = lengths();
    slow_kernels();
    absl::StatusOr<int64_t> r = e_->AppendKeys(ids[0], layer, in, call_check);
    pause_ = nullptr;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("nothing was committed"));
    EXPECT_EQ(Take(*e_), before);
    EXPECT_EQ(lengths(), lengths_before);
    r = e_->AppendKeys(ids[0], layer, in);
    ASSERT_TRUE(r.ok()) << r.status();
    h_->RecordAppend(ids[0], layer, in);
    EXPECT_EQ(*r, h_->Length(ids[0], layer));
  }
  Round(ids, 1);
}

// The other state-changing calls ask the caller right before they commit too (the lifecycle
// calls run on the host in microseconds, but may wait for their turn behind a long step): a
// caller that has gone changes nothing, and a refusal for another reason is still answered.
TEST_F(ExecutorState, AbandonedLifecycleCallsChangeNothing) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const config::Profile& p = h_->profile();
  const std::vector<uint64_t> ids = {1, 2, 3};
  for (uint64_t id : ids) {
    ASSERT_TRUE(e_->CreateSequence(id).ok());
    for (int32_t layer : p.CacheLayers()) Append(id, layer, 20 + int32_t(h_->rng()() % 60));
  }
  Round(ids, 2);
  absl::StatusOr<exec::SequenceImage> image = e_->ExportSequence(2);
  ASSERT_TRUE(image.ok()) << image.status();
  const exec::CallCheck gone = [] { return absl::CancelledError("the test's caller went away"); };
  const Snapshot before = Take(*e_);
  auto cancelled = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_THAT(s.message(), HasSubstr("nothing was committed"));
  };
  cancelled(e_->CreateSequence(9, gone));
  cancelled(e_->ReleaseSequence(1, gone).status());
  cancelled(e_->TruncateSequence(1, 3, gone).status());
  cancelled(e_->ForkSequence(1, 10, 3, gone));
  cancelled(e_->ImportSequence(11, *image, gone));
  EXPECT_EQ(e_->CreateSequence(1, gone).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Take(*e_), before);
  for (uint64_t id : {9, 10, 11}) {
    EXPECT_EQ(e_->GetSequence(id).status().code(), absl::StatusCode::kNotFound) << id;
  }
  for (uint64_t id : ids) {
    absl::StatusOr<exec::SequenceInfo> info = e_->GetSequence(id);
    ASSERT_TRUE(info.ok()) << info.status();
    for (const exec::SequenceCacheInfo& c : info->caches) {
      EXPECT_EQ(c.length, h_->Length(id, c.cache_layer)) << "sequence " << id;
    }
  }
  Round(ids, 1);
}

// An import checks every entry below each cache's length (an FP8 NaN code anywhere in an
// entry, a scale that is not positive and finite, an FP4 NaN scale) and names the entry; the
// bytes of a last page's slots past the length are not entries and are not checked.
TEST(ExecutorImport, ChecksEveryEntryBelowTheLengthAndNoneAbove) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  config::Profile p = SmallV41();
  p.layers[0].cache_format = kernels::CacheFormat::kFp8;  // one FP8 and one FP4 cache
  Harness h(p, seed);
  ExecutorOptions o = CpuOptions(1);
  o.cache_pages = 64;
  std::unique_ptr<Executor> e_ = MakeExecutor(p, o);
  ASSERT_NE(e_, nullptr);
  const std::vector<int32_t> cache_layers = p.CacheLayers();
  ASSERT_TRUE(e_->CreateSequence(1).ok());
  for (int32_t layer : cache_layers) {
    // Lengths that end inside a page, so that every last page has slots past the length.
    const int32_t count = 33 + 16 * int32_t(h.rng()() % 4) + int32_t(h.rng()() % 15);
    std::vector<uint8_t> keys, scales;
    KeysInput in;
    h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
    in.count = count;
    in.keys = keys.data();
    ASSERT_TRUE(e_->AppendKeys(1, layer, in).ok());
  }
  absl::StatusOr<exec::SequenceImage> image = e_->ExportSequence(1);
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_TRUE(e_->ImportSequence(2, *image).ok()) << "the untouched image imports";
  ASSERT_TRUE(e_->ReleaseSequence(2).ok());
  auto& rng = h.rng();
  std::set<kernels::CacheFormat> formats;
  for (int trial = 0; trial < 60; ++trial) {
    const size_t pool = rng() % image->caches.size();
    const exec::CacheImage& c = image->caches[pool];
    const kernels::CacheGeometry g{p.layers[c.cache_layer].cache_format, p.head_dim, p.page_size};
    formats.insert(g.format);
    const bool past = trial % 4 == 3;  // a slot past the length: not checked
    const int64_t slots = (c.length + g.page_size - 1) / g.page_size * g.page_size;
    ASSERT_LT(c.length, slots);
    const int64_t e =
        past ? c.length + int64_t(rng() % (slots - c.length)) : int64_t(rng() % c.length);
    exec::SequenceImage bad = *image;
    uint8_t* page = reinterpret_cast<uint8_t*>(bad.caches[pool].pages.data()) +
                    (e / g.page_size) * g.page_bytes();
    const int64_t o = e % g.page_size;
    uint8_t* scale = page + int64_t{g.page_size} * g.value_bytes() + o * g.scale_bytes();
    std::string what;
    if (g.format == kernels::CacheFormat::kFp8 && rng() % 2 == 0) {
      page[o * g.value_bytes() + int64_t(rng() % g.value_bytes())] = (rng() % 2) ? 0xFF : 0x7F;
      what = "NaN code";
    } else if (g.format == kernels::CacheFormat::kFp8) {
      const float bad_scales[] = {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                                  std::numeric_limits<float>::quiet_NaN()};
      std::memcpy(scale, &bad_scales[rng() % 4], sizeof(float));
      what = "scale";
    } else {
      scale[rng() % g.scale_bytes()] = 0xFF;
      what = "NaN scale";
    }
    SCOPED_TRACE(absl::StrCat("trial ", trial, ": pool ", pool, " entry ", e, " of ", c.length,
                              " (", what, ")"));
    const Snapshot before = Take(*e_);
    const absl::Status s = e_->ImportSequence(100 + trial, bad);
    if (past) {
      EXPECT_TRUE(s.ok()) << s;
      if (s.ok()) {
        ASSERT_TRUE(e_->ReleaseSequence(100 + trial).ok());
      }
      continue;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("caches[", pool, "].pages: entry ", e)));
    EXPECT_THAT(s.message(), HasSubstr(what));
    EXPECT_EQ(Take(*e_), before);
  }
  EXPECT_EQ(formats.size(), 2u) << "both cache formats corrupted at least once";
}

// A sequence whose caches were each filled in one call holds one run of pages a cache: its
// export copies each cache in one call, and its import writes each in one call a rank (a
// GPU's DMAs were one a page: 2M of them for 64 x 32K x 61 caches). Answers after the round
// trip are checked by the lifecycle and snapshot suites; this counts the copies.
TEST(ExecutorImport, ExportAndImportCopyARunOfPagesInOneCall) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  config::Profile p = SmallV41();
  p.layers[0].cache_format = kernels::CacheFormat::kFp8;
  Harness h(p, seed);
  ExecutorOptions o = CpuOptions(2);
  o.cache_pages = 64;
  std::atomic<int64_t> violations{0};
  std::vector<CheckingDevice*> devices(2, nullptr);
  absl::StatusOr<std::unique_ptr<Executor>> made = exec::CreateExecutorWithBackends(
      p, o,
      [&](int32_t rank, const kernels::BackendLimits& limits)
          -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
        return MakeCheckingBackend(kernels::MakeCpuBackend(limits, 1), &violations, rank, nullptr,
                                   nullptr, &devices[rank]);
      });
  ASSERT_TRUE(made.ok()) << made.status();
  Executor& e = **made;
  const std::vector<int32_t> cache_layers = p.CacheLayers();
  ASSERT_TRUE(e.CreateSequence(1).ok());
  for (int32_t layer : cache_layers) {
    const int32_t count = 100 + int32_t(h.rng()() % 300);  // several pages each
    std::vector<uint8_t> keys, scales;
    KeysInput in;
    h.RandomKeys(layer, count, KeyForm::kF32, &keys, &scales, &in.type);
    in.count = count;
    in.keys = keys.data();
    ASSERT_TRUE(e.AppendKeys(1, layer, in).ok());
  }
  std::atomic<int64_t> to_host{0}, to_device{0};
  for (CheckingDevice* d : devices) {
    d->CountCopiesToHost(&to_host);
    d->CountCopiesToDevice(&to_device);
  }
  absl::StatusOr<exec::SequenceImage> image = e.ExportSequence(1);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(to_host.load(), int64_t(cache_layers.size()));  // no candidates yet
  ASSERT_TRUE(e.ImportSequence(2, *image).ok());
  EXPECT_EQ(to_device.load(), 2 * int64_t(cache_layers.size()));  // each rank, each cache
  to_host = 0;
  absl::StatusOr<exec::SequenceImage> again = e.ExportSequence(2);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(to_host.load(), int64_t(cache_layers.size()));
  for (size_t i = 0; i < image->caches.size(); ++i) {
    EXPECT_EQ(again->caches[i].length, image->caches[i].length);
    EXPECT_EQ(again->caches[i].pages, image->caches[i].pages) << "cache " << i;
  }
  for (CheckingDevice* d : devices) {
    d->CountCopiesToHost(nullptr);
    d->CountCopiesToDevice(nullptr);
  }
  EXPECT_EQ(violations.load(), 0);
}

TEST_F(ExecutorState, ReleaseFreesPagesAndCandidates) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const Snapshot empty = Take(*e_);
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(e_->CreateSequence(id).ok());
    for (int32_t layer : h_->profile().CacheLayers()) Append(id, layer, 1 + h_->rng()() % 100);
  }
  Round({1, 2, 3}, 2);
  const Snapshot used = Take(*e_);
  EXPECT_NE(used.pages_free, empty.pages_free);
  int64_t freed = 0;
  for (uint64_t id = 1; id <= 3; ++id) {
    absl::StatusOr<int64_t> r = e_->ReleaseSequence(id);
    ASSERT_TRUE(r.ok()) << r.status();
    freed += *r;
    h_->Release(id);
  }
  int64_t used_pages = 0;
  for (size_t i = 0; i < used.pages_free.size(); ++i) {
    used_pages += empty.pages_free[i] - used.pages_free[i];
  }
  EXPECT_EQ(freed, used_pages);
  Snapshot after = Take(*e_);
  EXPECT_EQ(after.pages_free, empty.pages_free);
  EXPECT_EQ(after.sequences, 0);
  EXPECT_EQ(e_->ReleaseSequence(1).status().code(), absl::StatusCode::kNotFound);
  // A re-created sequence starts empty, without candidates.
  ASSERT_TRUE(e_->CreateSequence(2).ok());
  EXPECT_EQ(e_->CreateSequence(2).code(), absl::StatusCode::kAlreadyExists);
  Append(2, 1, 10);
  Reject(2, {{2, 1, 0, {}}}, absl::StatusCode::kFailedPrecondition, "no candidates");
  Append(2, 0, 12);
  Round({2}, 1);
}

// Many sequences coming and going: the candidate store and the pools never leak.
TEST_F(ExecutorState, ChurnDoesNotLeak) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const Snapshot empty = Take(*e_);
  for (int cycle = 0; cycle < 3; ++cycle) {
    std::vector<uint64_t> ids;
    for (uint64_t id = 10 * cycle + 1; id <= uint64_t(10 * cycle + 5); ++id) {
      ASSERT_TRUE(e_->CreateSequence(id).ok());
      for (int32_t layer : h_->profile().CacheLayers()) Append(id, layer, 1 + h_->rng()() % 40);
      ids.push_back(id);
    }
    Round(ids, 1 + cycle);
    Round(ids, 1);
    for (uint64_t id : ids) {
      ASSERT_TRUE(e_->ReleaseSequence(id).ok());
      h_->Release(id);
    }
    EXPECT_EQ(Take(*e_).pages_free, empty.pages_free);
  }
}

TEST(ExecutorLimits, SequencesAndShutdown) {
  ExecutorOptions o = CpuOptions(1);
  o.max_sequences = 2;
  std::unique_ptr<Executor> e = MakeExecutor(SmallV32(), o);
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(e->CreateSequence(1).ok());
  EXPECT_TRUE(e->CreateSequence(2).ok());
  EXPECT_EQ(e->CreateSequence(3).code(), absl::StatusCode::kResourceExhausted);
  exec::ExecutorStatus s = e->Status();
  EXPECT_EQ(s.backend, "cpu");
  EXPECT_EQ(s.num_ranks, 1);
  EXPECT_EQ(s.sequences, 2);
  EXPECT_EQ(s.caches.size(), 2u);
  e->Shutdown();
  e->Shutdown();
  EXPECT_EQ(e->CreateSequence(4).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(e->ReleaseSequence(1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(e->Status().sequences, 2);
}

TEST(ExecutorLimits, BadOptions) {
  ExecutorOptions o = CpuOptions(1);
  o.backend = "tpu";
  EXPECT_EQ(Executor::Create(SmallV32(), o).status().code(), absl::StatusCode::kInvalidArgument);
  o = CpuOptions(1);
  o.cache_pages = 0;
  EXPECT_EQ(Executor::Create(SmallV32(), o).status().code(), absl::StatusCode::kInvalidArgument);
  config::Profile p = SmallV32();
  p.head_dim = 100;
  EXPECT_EQ(Executor::Create(p, CpuOptions(1)).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace decode_indexer::testing
