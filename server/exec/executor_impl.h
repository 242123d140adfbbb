// The executor's implementation class, shared by its two files: executor.cc (set-up, the
// turn, appends, steps, status) and executor_lifecycle.cc (truncate, fork, the idle release,
// export and import). Internal to server/exec.
#pragma once

#include "server/exec/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_set>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/rope.h"
#include "server/exec/bulk_copy.h"
#include "server/exec/candidate_overlap.h"
#include "server/exec/collective.h"
#include "server/exec/decode_rows.h"
#include "server/exec/executor_internal.h"
#include "server/exec/insert_keys.h"
#include "server/exec/page_table_mirror.h"
#include "server/exec/planner.h"
#ifdef DI_HAVE_NCCL
#include "server/exec/nccl_collective.h"
#endif
#include "server/exec/rank.h"
#include "server/exec/row_shard.h"
#include "server/exec/validated_step.h"
#include "server/state/page_allocator.h"
#include "server/state/sequence_table.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::exec::internal {

using config::LayerRole;
using config::LayerSpec;
using kernels::CacheFormat;
using kernels::ElemType;
using Clock = std::chrono::steady_clock;

inline int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls run in arrival order: each takes a ticket and waits until it is served.
class FifoTurns {
 public:
  class Turn {
   public:
    explicit Turn(FifoTurns* owner) : owner_(owner) {}
    Turn(const Turn&) = delete;
    ~Turn() {
      std::lock_guard lock(owner_->mu_);
      ++owner_->serving_;
      owner_->cv_.notify_all();
    }

   private:
    FifoTurns* owner_;
  };

  // Blocks until every earlier ticket has finished.
  Turn Wait() {
    std::unique_lock lock(mu_);
    const uint64_t ticket = next_++;
    cv_.wait(lock, [&] { return serving_ == ticket; });
    return Turn(this);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ = 0;
  uint64_t serving_ = 0;
};

// Asks the caller whether it still wants the call (CallCheck) right before the commit: its
// refusal is the call's failure, and nothing is committed.
inline absl::Status AskCaller(const CallCheck& call_check) {
  if (!call_check) return absl::OkStatus();
  absl::Status s = call_check();
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(s.message(), "; nothing was committed"));
}

inline int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

class ExecutorImpl final : public Executor {
 public:
  ExecutorImpl(const config::Profile& profile, const ExecutorOptions& options)
      : profile_(profile),
        options_(options),
        table_(static_cast<int32_t>(profile.CacheLayers().size()), options.max_sequences),
        expansions_(options.candidate_overlap),
        planner_(StepPlanner::HostState{
            profile_, options_, pool_of_layer_, pool_geometry_, table_, pools_, store_blocks_,
            mirror_, expansions_, next_candidate_version_,
            [this](const std::string& field, uint64_t id) { return NoSequence(field, id); }}) {}

  ~ExecutorImpl() override { Shutdown(); }

  absl::Status Init(int32_t num_ranks, const BackendFactory& factory);

  absl::Status CreateSequence(uint64_t sequence_id, const CallCheck& call_check) override;
  using Executor::AppendKeys;
  using Executor::DecodeStep;
  absl::StatusOr<int64_t> AppendKeys(const ValidatedAppend& append,
                                     const CallCheck& call_check) override;
  absl::StatusOr<int64_t> ReleaseSequence(uint64_t sequence_id,
                                          const CallCheck& call_check) override;
  absl::StatusOr<int64_t> TruncateSequence(uint64_t sequence_id, int64_t length,
                                           const CallCheck& call_check) override;
  absl::Status ForkSequence(uint64_t parent_id, uint64_t new_id, int64_t length,
                            const CallCheck& call_check) override;
  absl::StatusOr<SequenceInfo> GetSequence(uint64_t sequence_id) override;
  absl::StatusOr<SequenceImage> ExportSequence(uint64_t sequence_id) override;
  absl::Status ImportSequence(uint64_t sequence_id, const SequenceImage& image,
                              const CallCheck& call_check) override;
  std::vector<uint64_t> SequenceIds() const override;
  int64_t ReleaseIdleSequences(int64_t idle_ms) override;
  absl::StatusOr<StepResult> DecodeStep(const ValidatedStep& step) override;
  ExecutorStatus Status() const override;
  absl::Status WithAnswerDevice(const std::function<absl::Status(kernels::Device&)>& fn) override;
  const config::Profile& profile() const override { return profile_; }
  void Shutdown() override;

 private:
  absl::Status Unavailable() const { return absl::UnavailableError("the executor is shut down"); }
  // NOT_FOUND for an unknown id, saying so when the idle timeout released it. mu_ held.
  absl::Status NoSequence(const std::string& field, uint64_t id) const {
    if (idle_released_set_.contains(id)) {
      return absl::NotFoundError(absl::StrCat(
          field, ": no sequence ", id, " (it was released after ",
          options_.idle_sequence_timeout_ms / 1000.0, " s idle: --idle-sequence-timeout)"));
    }
    return absl::NotFoundError(absl::StrCat(field, ": no sequence ", id));
  }
  // Removes a sequence and lets go of everything it holds; answers the pages freed. mu_ held.
  int64_t RemoveLocked(uint64_t id) {
    state::SequenceState removed;
    if (!table_.Remove(id, &removed).ok()) return 0;
    int64_t freed = 0;
    for (size_t pool = 0; pool < removed.caches.size(); ++pool) {
      const int64_t before = pools_[pool].free();
      DropCache(removed.caches[pool], pools_[pool]);
      freed += pools_[pool].free() - before;
    }
    DropCandidatesOfPool(removed, -1);
    return freed;
  }
  // Drops the candidates of the sources whose cache is `pool` (-1: every source): they were
  // computed over entries that changed. mu_ held.
  void DropCandidatesOfPool(state::SequenceState& seq, int32_t pool) {
    for (auto it = seq.candidates.begin(); it != seq.candidates.end();) {
      const int32_t src_pool = pool_of_layer_[profile_.layers[it->first].cache_layer];
      if (pool >= 0 && src_pool != pool) {
        ++it;
        continue;
      }
      if (it->second.store_block >= 0) store_blocks_->Release({&it->second.store_block, 1});
      it = seq.candidates.erase(it);
    }
  }
  void IdleLoop();
  // The failing rank's status, or OK when every rank succeeded. A rank's own failure wins
  // over a copy of another rank's (Collective::Agree), so the answer names where it began.
  static absl::Status FirstError(const std::vector<absl::Status>& statuses) {
    for (bool peers : {false, true}) {
      for (size_t r = 0; r < statuses.size(); ++r) {
        if (!statuses[r].ok() && IsPeerFailure(statuses[r]) == peers) {
          return absl::Status(statuses[r].code(),
                              absl::StrCat("rank ", r, ": ", statuses[r].message()));
        }
      }
    }
    return absl::OkStatus();
  }
  // Runs the job on every rank, keeps the statuses (for tests) and notes faults.
  std::vector<absl::Status> RunOnAllRanks(const Rank::Job& job) {
    std::vector<absl::Status> statuses = RunOnRanks(ranks_, job);
    NoteFaults(statuses);
    std::lock_guard lock(mu_);
    last_rank_statuses_ = statuses;
    return statuses;
  }
  // A device error (INTERNAL from a CUDA backend) may be sticky and leaves the replicas in an
  // unknown state; an aborted collective cannot be used again. Either way the executor stops
  // taking work. A CPU backend's failure is an ordinary, recoverable step failure.
  void NoteFaults(const std::vector<absl::Status>& statuses) {
    absl::Status fault;
    if (collective_->aborted()) {
      fault = FirstError(statuses);
      if (fault.ok()) fault = absl::InternalError("the collective was aborted");
    } else if (backend_name_ == "cuda") {
      for (size_t r = 0; r < statuses.size() && fault.ok(); ++r) {
        if (statuses[r].code() == absl::StatusCode::kInternal && !IsPeerFailure(statuses[r])) {
          fault = absl::Status(statuses[r].code(),
                               absl::StrCat("rank ", r, ": ", statuses[r].message()));
        }
      }
    }
    if (fault.ok()) return;
    collective_->Abort(fault);  // ncclCommAbort: nobody may wait on it again
    std::lock_guard lock(mu_);
    if (!healthy_) return;
    healthy_ = false;
    stats_.healthy = false;
    stats_.health_detail = std::string(fault.message());
    spdlog::error("executor: unhealthy after a fault: {}", stats_.health_detail);
  }
  absl::Status CheckHealthy() const {
    std::lock_guard lock(mu_);
    if (healthy_) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("the executor is unhealthy after a fault: ", stats_.health_detail));
  }
  // A deferred answer (StepPlan::defer_topk / defer_candidates): the ranks' readback pieces in
  // element order into `pieces`; they must tile [0, total) exactly.
  absl::Status CollectDeferred(bool candidates, size_t total,
                               std::vector<const Rank::ReadbackPiece*>& pieces) const {
    pieces.clear();
    for (const auto& r : ranks_) {
      for (const Rank::ReadbackPiece& piece : r->last_step().readback) {
        if (piece.candidates == candidates) pieces.push_back(&piece);
      }
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const auto* a, const auto* b) { return a->elem_offset < b->elem_offset; });
    size_t at = 0;
    for (const Rank::ReadbackPiece* piece : pieces) {
      if (piece->elem_offset != static_cast<int64_t>(at) || at + piece->elems > total) {
        return absl::InternalError("deferred answer rows do not tile the answer");
      }
      at += piece->elems;
    }
    if (at != total) {
      return absl::InternalError(
          absl::StrCat("deferred answer: ", at, " of ", total, " entries came back"));
    }
    return absl::OkStatus();
  }
  // The collected pieces into a vector, in one pass that appends (no zero-filled resize first:
  // measured, the resize and a split copy cost more than this serial copy,
  // docs/results/step-host.md).
  static void AssembleDeferred(const std::vector<const Rank::ReadbackPiece*>& pieces, size_t total,
                               std::vector<int32_t>& out) {
    out.clear();
    out.reserve(total);
    for (const Rank::ReadbackPiece* piece : pieces) {
      out.insert(out.end(), piece->data, piece->data + piece->elems);
    }
  }
  absl::StatusOr<StepResult> DecodeStepLocked(const ValidatedStep& step, StepPlan& plan);
  absl::Status CollectAnswer(const StepPlan& plan);
  void DeliverAnswer(const StepInput& step, const StepPlan& plan, PlannedStep& planned);
  void AbandonStep(PlannedStep& planned);
  void CommitStep(const StepInput& step, const StepPlan& plan, PlannedStep& planned);
  void TakeStepHooks(StepPlan& plan);
  void Observe(StepObserver::StepMark mark) {
    if (observer_ != nullptr) observer_->OnStep(mark);
  }

  friend void ::decode_indexer::exec::SetFaultHooks(Executor& executor,
                                                    std::shared_ptr<FaultHooks> hooks);
  friend void ::decode_indexer::exec::SetStepObserver(Executor& executor,
                                                      std::shared_ptr<StepObserver> observer);
  friend std::vector<double>(::decode_indexer::exec::LastScoringUs)(const Executor& executor);
  friend std::vector<absl::Status>(::decode_indexer::exec::LastRankStatuses)(
      const Executor& executor);
  friend void(::decode_indexer::exec::SetScoringTiming)(Executor& executor, bool on);
  friend std::vector<absl::StatusOr<kernels::BenchClocks::OverlapTiming>>(
      ::decode_indexer::exec::LastOverlapTimings)(const Executor& executor);

  const config::Profile profile_;
  const ExecutorOptions options_;
  std::string backend_name_;
  std::string backend_desc_;
  std::vector<int32_t> pool_of_layer_;  // cache layer -> pool index (-1: owns none)
  std::vector<kernels::CacheGeometry> pool_geometry_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<Collective> collective_;

  FifoTurns turns_;
  std::atomic<bool> shut_down_{false};
  StepPlan plan_;  // reused by every step (under the turn)
  // The host side of the ranks' resident page tables (page_table_mirror.h): every change of
  // a sequence's page list is recorded here and applied by the next job on that pool.
  PageTableMirror mirror_;
  // A failed step's table edits may have reached some ranks: record the committed pages over
  // the entries it touched.
  void RestoreTable(int32_t pool, const state::SequenceState& seq, const state::CacheWrite& w) {
    const std::vector<int32_t>& pages = seq.caches[pool].pages;
    const size_t end = std::min(pages.size(), w.keep + w.tail.size());
    if (end > w.keep) {
      mirror_.Record(pool, seq.slot, int64_t(w.keep),
                     std::span<const int32_t>(pages.data() + w.keep, end - w.keep));
    }
  }
  // All of a sequence's pages in `pool` (a fork, an import).
  void RecordTable(int32_t pool, const state::SequenceState& seq, size_t from = 0) {
    const std::vector<int32_t>& pages = seq.caches[pool].pages;
    if (pages.size() > from) {
      mirror_.Record(pool, seq.slot, int64_t(from),
                     std::span<const int32_t>(pages.data() + from, pages.size() - from));
    }
  }
  // Reused by every step (under the turn): the deferred answer's pieces.
  std::vector<const Rank::ReadbackPiece*> topk_pieces_, cand_pieces_;

  // Host truth. Changed only by the call holding the turn, under mu_ so Status() can read.
  mutable std::mutex mu_;
  std::vector<state::PageAllocator> pools_;
  std::optional<state::PageAllocator> store_blocks_;
  state::SequenceTable table_;
  ExpansionLedger expansions_;
  uint64_t next_candidate_version_ = 1;
  ExecutorStatus stats_;
  bool healthy_ = true;
  // Ids the idle timeout released (the most recent kIdleMemory), for NOT_FOUND's message.
  static constexpr size_t kIdleMemory = 65536;
  std::deque<uint64_t> idle_released_;
  std::unordered_set<uint64_t> idle_released_set_;
  // The idle timeout's thread (ExecutorOptions::idle_sequence_timeout_ms > 0).
  std::thread idle_thread_;
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  bool idle_stop_ = false;
  std::vector<absl::Status> last_rank_statuses_;
  uint64_t steps_to_ranks_ = 0;  // decode steps that reached the ranks
  // The test seam (step_hooks.h; SetFaultHooks, SetStepObserver): null in production. The
  // fault hooks' steps are counted from hooks_since_.
  std::shared_ptr<FaultHooks> fault_hooks_;
  uint64_t hooks_since_ = 0;
  std::shared_ptr<StepObserver> observer_;
  // ExecutorStatus::device_memory_bytes: sampled by the turn holder (a query per rank, so at
  // most once a second) and read by Status() from stats_.
  Clock::time_point memory_sampled_{};
  void SampleDeviceMemory() {  // holding the turn and mu_
    const Clock::time_point now = Clock::now();
    if (!stats_.device_memory_bytes.empty() && now - memory_sampled_ < std::chrono::seconds(1)) {
      return;
    }
    memory_sampled_ = now;
    stats_.device_memory_bytes.resize(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      stats_.device_memory_bytes[r] = ranks_[r]->device().DeviceMemoryBytes();
    }
  }
  // The step's plan (planner.h): reads and reserves from the host truth above, under mu_.
  StepPlanner planner_;
};

}  // namespace decode_indexer::exec::internal
