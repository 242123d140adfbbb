// Test-only (benchmarks): where a decode step's time goes, measured through the executor's
// StepObserver (server/exec/step_hooks.h), so the production path reads no clock for it.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "server/exec/executor.h"
#include "server/exec/step_hooks.h"

namespace decode_indexer::testing {

// Per rank, the last decode step's time (ns, host clock).
struct RankStepTimes {
  // Before its collectives: uploads, keys, q prep and scoring, up to the rank's own work
  // finishing (the whole step when unsharded).
  int64_t score_ns = 0;
  // In order: the uploads and key inserts issued, the kernel section issued (eager or a graph
  // replay), the answer copies issued (after any collective), and the final wait for the
  // device.
  int64_t uploads_ns = 0;
  int64_t launch_ns = 0;
  int64_t copies_ns = 0;
  int64_t wait_ns = 0;
};

// The executor's own share of the last decode step (ns): planning under the turn (checks,
// page reservation, the plan), the fan-out to the ranks and back (the rank jobs and the
// hand-offs), and the commit.
struct StepPhases {
  int64_t plan_ns = 0;
  int64_t ranks_ns = 0;
  int64_t commit_ns = 0;
};

class StepTimer final : public exec::StepObserver {
 public:
  explicit StepTimer(int32_t ranks);

  void OnStep(StepMark mark) override;
  void OnRank(int32_t rank, RankMark mark) override;

  // Of the last decode step that reached the ranks; read between steps.
  std::vector<RankStepTimes> LastRankStepTimes() const;
  StepPhases LastStepPhases() const { return phases_; }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kRankMarks = int(RankMark::kWaitEnd) + 1;
  struct RankClock {
    std::array<Clock::time_point, kRankMarks> at{};
    RankStepTimes times;
  };
  std::array<Clock::time_point, int(StepMark::kCommitted) + 1> step_at_{};
  StepPhases phases_;
  std::vector<RankClock> ranks_;  // each written only by its rank's thread
};

// A StepTimer on every later decode step of the executor (its observer; call between steps).
std::shared_ptr<StepTimer> InstallStepTimer(exec::Executor& executor);

}  // namespace decode_indexer::testing
