#include "server/testing/step_timer.h"

#include "server/exec/executor_internal.h"

namespace decode_indexer::testing {
namespace {

int64_t NanosBetween(std::chrono::steady_clock::time_point a,
                     std::chrono::steady_clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

}  // namespace

StepTimer::StepTimer(int32_t ranks) : ranks_(size_t(ranks)) {}

void StepTimer::OnStep(StepMark mark) {
  const Clock::time_point now = Clock::now();
  step_at_[int(mark)] = now;
  switch (mark) {
    case StepMark::kPlan:
    case StepMark::kFanOut:
      break;
    case StepMark::kJoined:
      phases_.plan_ns =
          NanosBetween(step_at_[int(StepMark::kPlan)], step_at_[int(StepMark::kFanOut)]);
      phases_.ranks_ns = NanosBetween(step_at_[int(StepMark::kFanOut)], now);
      break;
    case StepMark::kCommitted:
      phases_.commit_ns = NanosBetween(step_at_[int(StepMark::kJoined)], now);
      break;
  }
}

void StepTimer::OnRank(int32_t rank, RankMark mark) {
  const Clock::time_point now = Clock::now();
  RankClock& r = ranks_[size_t(rank)];
  r.at[int(mark)] = now;
  auto since = [&](RankMark from) { return NanosBetween(r.at[int(from)], now); };
  switch (mark) {
    case RankMark::kStepBegin:
      // A step that fails early reports no phases (the score time stays the last measured).
      r.times.uploads_ns = r.times.launch_ns = r.times.copies_ns = r.times.wait_ns = 0;
      break;
    case RankMark::kLaunchBegin:
      r.times.uploads_ns = since(RankMark::kUploadsBegin);
      break;
    case RankMark::kLaunchEnd:
      r.times.launch_ns = since(RankMark::kLaunchBegin);
      break;
    case RankMark::kScored:
      r.times.score_ns = since(RankMark::kStepBegin);
      break;
    case RankMark::kWaitBegin:
      r.times.copies_ns = since(RankMark::kCopiesBegin);
      break;
    case RankMark::kWaitEnd:
      r.times.wait_ns = since(RankMark::kWaitBegin);
      break;
    case RankMark::kUploadsBegin:
    case RankMark::kCopiesBegin:
      break;
  }
}

std::vector<RankStepTimes> StepTimer::LastRankStepTimes() const {
  std::vector<RankStepTimes> out;
  out.reserve(ranks_.size());
  for (const RankClock& r : ranks_) out.push_back(r.times);
  return out;
}

std::shared_ptr<StepTimer> InstallStepTimer(exec::Executor& executor) {
  auto timer = std::make_shared<StepTimer>(executor.Status().num_ranks);
  exec::SetStepObserver(executor, timer);
  return timer;
}

}  // namespace decode_indexer::testing
