// The executor: a FIFO of state-changing calls, each checked against the sequence table,
// planned on the host, run on every rank and committed only when every rank succeeded.
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
#include "server/state/page_allocator.h"
#include "server/state/sequence_table.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::exec {
namespace {

using config::LayerRole;
using config::LayerSpec;
using kernels::CacheFormat;
using kernels::ElemType;
using Clock = std::chrono::steady_clock;

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// An imported cache's entries [0, length): FP8 codes other than the NaN S.1111.111, fp32
// scales positive and finite; FP4 ue8m0 scales other than the NaN 0xFF.
absl::Status CheckCacheImage(const CacheImage& c, const kernels::CacheGeometry& g,
                             const std::string& field) {
  const int64_t P = g.page_size, V = g.value_bytes(), S = g.scale_bytes();
  const bool fp8 = g.format == CacheFormat::kFp8;
  for (int64_t e = 0; e < c.length; ++e) {
    const uint8_t* page =
        reinterpret_cast<const uint8_t*>(c.pages.data()) + (e / P) * g.page_bytes();
    const int64_t o = e % P;
    const uint8_t* scale = page + P * V + o * S;
    if (fp8) {
      const uint8_t* v = page + o * V;
      for (int64_t i = 0; i < V; ++i) {
        if ((v[i] & 0x7F) == 0x7F) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ": entry ", e, " holds an FP8 NaN code"));
        }
      }
      float f;
      std::memcpy(&f, scale, sizeof(f));
      if (!(f > 0) || !std::isfinite(f)) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": entry ", e, "'s scale ", f, " is not positive and finite"));
      }
    } else {
      for (int64_t i = 0; i < S; ++i) {
        if (scale[i] == 0xFF) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ": entry ", e, " holds a NaN scale (0xFF)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

// Asks the caller whether it still wants the call (CallCheck) right before the commit: its
// refusal is the call's failure, and nothing is committed.
absl::Status AskCaller(const CallCheck& call_check) {
  if (!call_check) return absl::OkStatus();
  absl::Status s = call_check();
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(s.message(), "; nothing was committed"));
}

int64_t NowMs() {
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
  absl::StatusOr<int64_t> AppendKeys(uint64_t sequence_id, int32_t layer, const KeysInput& keys,
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
  absl::StatusOr<StepResult> DecodeStep(const StepInput& step) override;
  ExecutorStatus Status() const override;
  absl::Status WithAnswerBackend(const std::function<absl::Status(kernels::Backend&)>& fn) override;
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
  absl::StatusOr<StepResult> DecodeStepLocked(const StepInput& step, StepPlan& plan);
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
  friend std::vector<absl::StatusOr<kernels::Backend::OverlapTiming>>(
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
      stats_.device_memory_bytes[r] = ranks_[r]->backend().DeviceMemoryBytes();
    }
  }
  // The step's plan (planner.h): reads and reserves from the host truth above, under mu_.
  StepPlanner planner_;
};

absl::Status ExecutorImpl::Init(int32_t num_ranks, const BackendFactory& factory) {
  const config::Profile& p = profile_;
  const int32_t M = p.max_rows_per_sequence;
  pool_of_layer_.assign(p.layers.size(), -1);
  for (int32_t layer : p.CacheLayers()) {
    pool_of_layer_[layer] = static_cast<int32_t>(pool_geometry_.size());
    pool_geometry_.push_back({p.layers[layer].cache_format, p.head_dim, p.page_size});
    pools_.emplace_back(absl::StrCat("cache layer ", layer), "pages", options_.cache_pages);
  }
  int32_t num_sources = 0;
  for (const LayerSpec& l : p.layers) num_sources += l.role == LayerRole::kCandidateSource;
  int64_t store_blocks = 0;
  if (num_sources > 0) {
    // One block of M rows per (sequence, source), plus room for one step's fresh blocks: a
    // source writes new candidates into fresh blocks and retires the old ones on commit.
    store_blocks = int64_t{num_sources} * options_.max_sequences + options_.max_requests_per_step;
    store_blocks_.emplace("candidate store", "blocks", store_blocks);
  }

  RankSizes sizes;
  sizes.max_rows = options_.max_requests_per_step * M;
  sizes.max_requests = options_.max_requests_per_step;
  sizes.max_pages_per_sequence = static_cast<int32_t>(CeilDiv(p.max_context, p.page_size));
  sizes.max_sequences = options_.max_sequences;
  if (sizes.max_sequences * sizes.max_pages_per_sequence > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "executor options: max_sequences ", sizes.max_sequences, " x ",
        sizes.max_pages_per_sequence, " pages of max_context exceed the resident page tables' ",
        "2^31 entries; at most ", INT32_MAX / sizes.max_pages_per_sequence, " sequences"));
  }
  // A decode step edits at most a few entries a request; a prefill or a fork, more (chunked).
  sizes.table_edit_chunk = std::max(4 * options_.max_requests_per_step, 16384);
  mirror_ =
      PageTableMirror(static_cast<int32_t>(pool_geometry_.size()), sizes.max_pages_per_sequence);
  sizes.num_heads = p.num_heads;
  sizes.head_dim = p.head_dim;
  sizes.topk = p.topk;
  sizes.num_candidate_blocks = p.num_candidate_blocks;
  sizes.candidate_block_size = p.candidate_block_size;
  sizes.candidate_store_rows = store_blocks * M;
  sizes.key_chunk = std::max(sizes.max_rows, 4096);
  sizes.pools = pool_geometry_;
  sizes.pages_per_pool = options_.cache_pages;
  if (p.rope.style != kernels::RopeStyle::kNone) sizes.inv_freq = kernels::ComputeInvFreq(p.rope);
  sizes.max_context = p.max_context;
  sizes.step_graphs = options_.cuda_graphs;
  sizes.pinned_staging = options_.pinned_staging;
  // Two slots: the second serves a step that follows one which returned before its
  // Synchronize (StagingRing); otherwise every step uses the first.
  sizes.staging_slots = options_.packed_uploads ? 2 : 0;

  kernels::BackendLimits limits;
  limits.max_rows = sizes.max_rows;
  limits.max_requests = sizes.max_requests;
  limits.max_context = p.max_context;
  limits.num_heads = p.num_heads;
  limits.head_dim = p.head_dim;
  limits.max_topk = p.topk;
  limits.max_candidate_positions = p.num_candidate_blocks * p.candidate_block_size;

  std::vector<kernels::Backend*> backends;
  for (int32_t r = 0; r < num_ranks; ++r) {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> made = factory(r, limits);
    if (!made.ok()) {
      return absl::Status(made.status().code(),
                          absl::StrCat("backend for rank ", r, ": ", made.status().message()));
    }
    std::unique_ptr<kernels::Backend> backend = *std::move(made);
    if (backend == nullptr) return absl::InternalError(absl::StrCat("no backend for rank ", r));
    if (r == 0) {
      backend_name_ = std::string(backend->name());
      backend_desc_ = backend->description();
    }
    backends.push_back(backend.get());
    absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Create(r, std::move(backend), sizes);
    if (!rank.ok()) return rank.status();
    ranks_.push_back(*std::move(rank));
  }
  const size_t gather_bytes =
      size_t(sizes.max_rows) * std::max(sizes.topk, sizes.num_candidate_blocks) * sizeof(int32_t);
  const std::chrono::milliseconds timeout(std::max(1, options_.collective_timeout_ms));
  if (options_.backend == "cuda" && num_ranks > 1) {
#ifdef DI_HAVE_NCCL
    std::vector<int> devices(num_ranks);
    for (int32_t r = 0; r < num_ranks; ++r) devices[r] = r;  // the factory's rank -> device
    absl::StatusOr<std::unique_ptr<Collective>> nccl =
        MakeNcclCollective(backends, std::move(devices), timeout);
    if (!nccl.ok()) return nccl.status();
    collective_ = *std::move(nccl);
#else
    spdlog::warn("executor: built without NCCL; the cuda ranks gather through host memory");
#endif
  }
  if (collective_ == nullptr) {
    collective_ = MakeInProcessCollective(backends, gather_bytes, timeout);
  }
  // The result's own answer vectors are built after the join from the ranks' readback space
  // (StepPlan::defer_topk / defer_candidates): where every rank has one (a device backend
  // with page-locked staging).
  planner_.Init(num_ranks, std::all_of(ranks_.begin(), ranks_.end(),
                                       [](const auto& r) { return r->readback().pinned; }));

  stats_.backend = backend_name_;
  stats_.backend_desc = backend_desc_;
  stats_.num_ranks = num_ranks;
  stats_.collective = std::string(collective_->name());
  stats_.row_shard_min_requests = options_.row_shard_min_requests;
  stats_.max_sequences = options_.max_sequences;
  stats_.idle_sequence_timeout_ms = options_.idle_sequence_timeout_ms;
  SampleDeviceMemory();
  spdlog::info(
      "executor: profile {} ({} layers, {} cache pools), backend {} x{} ranks ({} collective), "
      "{} pages per pool, candidate overlap {}, {} consumers, cuda graphs {}, pinned staging {}",
      p.name, p.layers.size(), pools_.size(), backend_desc_, num_ranks, collective_->name(),
      options_.cache_pages, options_.candidate_overlap ? "on" : "off",
      options_.masked_consumer ? "masked" : "sparse",
      options_.cuda_graphs && ranks_[0]->graphs_enabled() ? "on" : "off",
      options_.pinned_staging && ranks_[0]->host_arena().pinned ? "on" : "off");
  if (options_.idle_sequence_timeout_ms > 0) idle_thread_ = std::thread([this] { IdleLoop(); });
  return absl::OkStatus();
}

void ExecutorImpl::IdleLoop() {
  const int64_t timeout = options_.idle_sequence_timeout_ms;
  const auto period = std::chrono::milliseconds(std::clamp<int64_t>(timeout / 4, 1, 1000));
  std::unique_lock lock(idle_mu_);
  while (!idle_cv_.wait_for(lock, period, [&] { return idle_stop_; })) {
    lock.unlock();
    ReleaseIdleSequences(timeout);
    lock.lock();
  }
}

absl::Status ExecutorImpl::CreateSequence(uint64_t sequence_id, const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  if (absl::Status s = table_.CanCreate(sequence_id); !s.ok()) return s;
  if (absl::Status s = AskCaller(call_check); !s.ok()) return s;
  if (absl::Status s = table_.Create(sequence_id); !s.ok()) return s;
  table_.Find(sequence_id)->last_used_ms = NowMs();
  idle_released_set_.erase(sequence_id);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ExecutorImpl::AppendKeys(uint64_t sequence_id, int32_t layer,
                                                 const KeysInput& keys,
                                                 const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;

  std::unique_lock lock(mu_);
  const LayerSpec* spec = profile_.FindLayer(layer);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: no layer ", layer, " (the profile has ", profile_.layers.size(), ")"));
  }
  if (spec->role == LayerRole::kCandidateConsumer) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: layer ", layer, " is a candidate consumer and reads layer ",
                     spec->cache_layer, "'s cache; append keys to layer ", spec->cache_layer));
  }
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  const int32_t pool = pool_of_layer_[layer];
  if (absl::Status s = CheckKeys(keys, spec->cache_format, [] { return std::string("keys"); });
      !s.ok())
    return s;
  state::CachePages& cp = seq->caches[pool];
  if (absl::Status s =
          CheckPosition(keys.position, cp.length, layer, [] { return std::string("position"); });
      !s.ok()) {
    return s;
  }
  const int64_t start = keys.position.value_or(cp.length);
  const int64_t new_length = start + keys.count;
  if (new_length > profile_.max_context) {
    return absl::OutOfRangeError(absl::StrCat("keys: length ", new_length,
                                              " would exceed max_context ", profile_.max_context));
  }
  seq->last_used_ms = NowMs();
  if (new_length == cp.length && keys.count == 0) return cp.length;
  const int32_t P = profile_.page_size;
  absl::StatusOr<state::CacheWrite> planned =
      state::PlanCacheWrite(cp, start, keys.count, P, pools_[pool]);
  if (!planned.ok()) return planned.status();
  state::CacheWrite w = *std::move(planned);
  std::vector<int64_t> slots(keys.count);
  for (int64_t i = 0; i < keys.count; ++i) slots[i] = w.Slot(cp, start + i, P);
  std::vector<KeyWrite> writes;
  if (keys.count > 0)
    writes.push_back({keys.type, keys.count, keys.keys, keys.scales, slots.data()});
  std::vector<std::pair<int32_t, int32_t>> copies;
  for (const state::PageCopy& c : w.copies) copies.emplace_back(c.src, c.dst);
  lock.unlock();
  absl::Status status = FirstError(RunOnAllRanks([&](Rank& rank) -> absl::Status {
    if (absl::Status s = rank.overlap().Join(); !s.ok()) return s;
    if (absl::Status s = CopyPagesOnRank(rank, pool, copies); !s.ok()) return s;
    if (writes.empty()) return rank.backend().Synchronize();
    // Bulk prefill crosses NVLink once per rank (broadcast from rank 0) where the collective
    // can; otherwise every rank copies the keys from host memory.
    const absl::Status s =
        ranks_.size() > 1 && collective_->device_broadcast()
            ? BroadcastInsertKeysOnRank(rank, pool, writes, profile_.hadamard, *collective_)
            : InsertKeysOnRank(rank, pool, writes, profile_.hadamard);
    if (!s.ok()) return s;
    return rank.backend().Synchronize();
  }));
  // A caller that gave up while the keys were written gets nothing committed.
  if (status.ok()) status = AskCaller(call_check);
  lock.lock();
  if (!status.ok()) {
    // The keys written lie beyond the committed length or in fresh pages, handed back.
    AbortCacheWrite(w, pools_[pool]);
    return status;
  }
  const size_t keep = w.keep;
  CommitCacheWrite(cp, w, pools_[pool]);
  RecordTable(pool, *seq, keep);  // applied by the next step on this pool
  // The source's candidates were computed over the entries just replaced.
  DropCandidatesOfPool(*seq, pool);
  spdlog::debug("append: sequence {} layer {} +{} keys -> {}", sequence_id, layer, keys.count,
                new_length);
  return new_length;
}

absl::StatusOr<int64_t> ExecutorImpl::ReleaseSequence(uint64_t sequence_id,
                                                      const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  if (table_.Find(sequence_id) == nullptr) return NoSequence("sequence_id", sequence_id);
  if (absl::Status s = AskCaller(call_check); !s.ok()) return s;
  return RemoveLocked(sequence_id);
}

absl::StatusOr<StepResult> ExecutorImpl::DecodeStep(const StepInput& step) {
  if (shut_down_) return Unavailable();
  const Clock::time_point arrived = Clock::now();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;
  const Clock::time_point started = Clock::now();

  // Only the turn holder touches the reused plan.
  StepPlan& plan = plan_;
  plan.Reset();
  absl::StatusOr<StepResult> result = DecodeStepLocked(step, plan);
  if (result.ok()) {
    result->queue_us = Micros(started - arrived);
    result->compute_us = Micros(Clock::now() - started);
    std::lock_guard lock(mu_);
    stats_.queue_us_total += double(result->queue_us);
    stats_.compute_us_total += double(result->compute_us);
    spdlog::debug("step {}: layer {} {} rows {} requests {} queue {}us compute {}us", step.step_id,
                  step.layer, plan.num_rows, plan.num_requests,
                  result->sharded ? "sharded" : "unsharded", result->queue_us, result->compute_us);
  }
  return result;
}

// A decode step: plan (checks, reservation, the StepPlan) -> run on every rank -> commit, or
// abandon what the plan reserved.
absl::StatusOr<StepResult> ExecutorImpl::DecodeStepLocked(const StepInput& step, StepPlan& plan) {
  Observe(StepObserver::StepMark::kPlan);
  std::unique_lock lock(mu_);
  PlannedStep planned;
  if (absl::Status s = planner_.Plan(step, plan, planned); !s.ok()) return s;
  TakeStepHooks(plan);
  ++steps_to_ranks_;

  lock.unlock();
  Observe(StepObserver::StepMark::kFanOut);
  absl::Status status = FirstError(
      RunOnAllRanks([&](Rank& rank) { return DecodeRowsOnRank(rank, plan, *collective_); }));
  Observe(StepObserver::StepMark::kJoined);
  lock.lock();
  for (const auto& r : ranks_) {
    stats_.graph_captures += r->last_step().graph_captured;
    stats_.graph_replays += r->last_step().graph_replayed;
  }
  if (status.ok()) status = CollectAnswer(plan);
  // A caller whose deadline passed (or who went away) while the ranks ran gets nothing
  // committed: the step fails as if a rank had.
  if (status.ok()) status = AskCaller(step.call_check);
  if (!status.ok()) {
    AbandonStep(planned);
    spdlog::debug("step {}: layer {} failed: {}", step.step_id, step.layer, status.ToString());
    return status;
  }
  DeliverAnswer(step, plan, planned);
  CommitStep(step, plan, planned);
  Observe(StepObserver::StepMark::kCommitted);
  return std::move(planned.result);
}

// The deferred answers (StepPlan::defer_topk / defer_candidates): every rank's pieces, which
// must tile the answer.
absl::Status ExecutorImpl::CollectAnswer(const StepPlan& plan) {
  const config::Profile& p = profile_;
  if (plan.defer_topk) {
    DI_RETURN_IF_ERROR(
        CollectDeferred(/*candidates=*/false, size_t(plan.num_rows) * p.topk, topk_pieces_));
  }
  if (plan.defer_candidates) {
    DI_RETURN_IF_ERROR(CollectDeferred(
        /*candidates=*/true, size_t(plan.num_rows) * p.num_candidate_blocks, cand_pieces_));
  }
  return absl::OkStatus();
}

// The answer's last move, now that the step stands: into the result's vectors, or row blocks
// to the sink's encoder.
void ExecutorImpl::DeliverAnswer(const StepInput& step, const StepPlan& plan,
                                 PlannedStep& planned) {
  const config::Profile& p = profile_;
  const size_t topk_total = size_t(plan.num_rows) * p.topk;
  const size_t cand_total = size_t(plan.num_rows) * p.num_candidate_blocks;
  StepResult& result = planned.result;
  if (plan.defer_topk && planned.sink_kind == AnswerSink::Kind::kVector) {
    AssembleDeferred(topk_pieces_, topk_total, result.topk_indices);
  } else if (planned.sink_kind == AnswerSink::Kind::kEncoder) {
    const AnswerSink::Encoder& encode = step.answer->encoder();
    if (plan.defer_topk) {
      for (const Rank::ReadbackPiece* piece : topk_pieces_) {
        encode(std::span<const int32_t>(piece->data, piece->elems),
               int32_t(piece->elems / size_t(p.topk)));
      }
    } else {
      encode(planner_.encode_scratch().first(topk_total), plan.num_rows);
    }
  }
  if (plan.defer_candidates) AssembleDeferred(cand_pieces_, cand_total, result.candidate_blocks);
}

// A failed step: nothing of it is committed.
void ExecutorImpl::AbandonStep(PlannedStep& planned) {
  // Some ranks may have applied the step's table edits: put the committed pages back (the
  // pending edits stay pending: a rank may have failed before applying them).
  for (size_t i = 0; i < planned.seqs.size(); ++i) {
    RestoreTable(planned.pool, *planned.seqs[i], planned.writes[i]);
  }
  planner_.Abandon(planned);
  // The ranks may have rewritten their expansion buffers.
  if (planned.source || planned.consumer) expansions_.Invalidate();
}

// Every rank succeeded (and applied the pool's pending and own table edits): the lengths move.
void ExecutorImpl::CommitStep(const StepInput& step, const StepPlan& plan, PlannedStep& planned) {
  const int32_t pool = planned.pool;
  const int32_t num_requests = static_cast<int32_t>(planned.seqs.size());
  std::vector<state::SequenceState*>& seqs = planned.seqs;
  mirror_.Applied(pool);
  const int64_t now_ms = NowMs();
  for (int32_t i = 0; i < num_requests; ++i) {
    CommitCacheWrite(seqs[i]->caches[pool], planned.writes[i], pools_[pool]);
    seqs[i]->last_used_ms = now_ms;
  }
  planned.writes.clear();
  if (planned.source) {
    int32_t row = 0;
    for (int32_t i = 0; i < num_requests; ++i) {
      const int32_t n = step.sequences[i].num_rows;
      state::CandidateRecord& rec = seqs[i]->candidates[step.layer];
      if (rec.store_block >= 0) store_blocks_->Release({&rec.store_block, 1});
      rec.version = planned.versions[i];
      rec.length = planned.lengths[i];
      rec.rows = n;
      rec.row_lengths.assign(plan.row_length.begin() + row, plan.row_length.begin() + row + n);
      rec.store_block = planned.new_blocks[i];
      row += n;
    }
    if (plan.fork_expansion) expansions_.Commit(std::move(planned.expansion));
  } else if (planned.consumer && !options_.masked_consumer && !plan.reuse_expansion) {
    expansions_.Commit(std::move(planned.expansion));
  }
  planned.result.lengths = planned.lengths;
  ++stats_.steps;
  ++(plan.sharded ? stats_.steps_sharded : stats_.steps_unsharded);
  stats_.collective_us_total += double(ranks_[0]->last_step().collective_ns) / 1000.0;
  stats_.collectives_total += uint64_t(ranks_[0]->last_step().collectives);
  stats_.rows_scored += uint64_t(plan.num_rows);
  SampleDeviceMemory();
}

// The test seam (step_hooks.h): the faults the hooks give the step, if any, and the observer.
void ExecutorImpl::TakeStepHooks(StepPlan& plan) {
  if (fault_hooks_ != nullptr) plan.faults = fault_hooks_->ForStep(steps_to_ranks_ - hooks_since_);
  plan.observer = observer_;
}

absl::StatusOr<int64_t> ExecutorImpl::TruncateSequence(uint64_t sequence_id, int64_t length,
                                                       const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("length: must be >= 0, got ", length));
  }
  if (absl::Status s = AskCaller(call_check); !s.ok()) return s;
  seq->last_used_ms = NowMs();
  int64_t freed = 0;
  for (size_t pool = 0; pool < seq->caches.size(); ++pool) {
    state::CachePages& cp = seq->caches[pool];
    if (cp.length <= length) continue;
    const int64_t before = pools_[pool].free();
    TruncateCache(cp, length, profile_.page_size, pools_[pool]);
    freed += pools_[pool].free() - before;
    DropCandidatesOfPool(*seq, static_cast<int32_t>(pool));
  }
  return freed;
}

absl::Status ExecutorImpl::ForkSequence(uint64_t parent_id, uint64_t new_id, int64_t length,
                                        const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  state::SequenceState* parent = table_.Find(parent_id);
  if (parent == nullptr) return NoSequence("parent_id", parent_id);
  if (table_.Find(new_id) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("new_id: sequence ", new_id, " exists"));
  }
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("length: must be >= 0, got ", length));
  }
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  for (size_t pool = 0; pool < parent->caches.size(); ++pool) {
    if (parent->caches[pool].length < length) {
      return absl::OutOfRangeError(absl::StrCat("length: ", length, " is past parent ", parent_id,
                                                "'s length ", parent->caches[pool].length,
                                                " in layer ", cache_layers[pool], "'s cache"));
    }
  }
  if (absl::Status s = table_.CanCreate(new_id); !s.ok()) return s;
  if (absl::Status s = AskCaller(call_check); !s.ok()) return s;
  if (absl::Status s = table_.Create(new_id); !s.ok()) return s;
  idle_released_set_.erase(new_id);
  parent = table_.Find(parent_id);  // Create may have rehashed the table
  state::SequenceState* child = table_.Find(new_id);
  for (size_t pool = 0; pool < parent->caches.size(); ++pool) {
    ShareCache(parent->caches[pool], length, profile_.page_size, pools_[pool], child->caches[pool]);
    RecordTable(static_cast<int32_t>(pool), *child);
  }
  parent->last_used_ms = child->last_used_ms = NowMs();
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> ExecutorImpl::GetSequence(uint64_t sequence_id) {
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  seq->last_used_ms = NowMs();
  SequenceInfo info;
  info.sequence_id = sequence_id;
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  for (size_t pool = 0; pool < seq->caches.size(); ++pool) {
    const state::CachePages& cp = seq->caches[pool];
    int64_t shared = 0;
    for (int32_t page : cp.pages) shared += pools_[pool].holders(page) > 1;
    info.caches.push_back({cache_layers[pool], cp.length, int64_t(cp.pages.size()), shared});
  }
  for (const auto& [layer, rec] : seq->candidates) info.candidates.emplace_back(layer, rec.length);
  return info;
}

std::vector<uint64_t> ExecutorImpl::SequenceIds() const {
  std::lock_guard lock(mu_);
  std::vector<uint64_t> ids = table_.Ids();
  std::sort(ids.begin(), ids.end());
  return ids;
}

int64_t ExecutorImpl::ReleaseIdleSequences(int64_t idle_ms) {
  if (shut_down_) return 0;
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return 0;
  std::lock_guard lock(mu_);
  const int64_t now = NowMs();
  int64_t released = 0;
  for (uint64_t id : table_.Ids()) {
    if (now - table_.Find(id)->last_used_ms < idle_ms) continue;
    RemoveLocked(id);
    ++released;
    if (idle_released_set_.insert(id).second) idle_released_.push_back(id);
    while (idle_released_.size() > kIdleMemory) {
      idle_released_set_.erase(idle_released_.front());
      idle_released_.pop_front();
    }
    spdlog::info("sequence {} released after {} ms idle", id, idle_ms);
  }
  return released;
}

absl::StatusOr<SequenceImage> ExecutorImpl::ExportSequence(uint64_t sequence_id) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;
  std::unique_lock lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  seq->last_used_ms = NowMs();
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  const int32_t M = profile_.max_rows_per_sequence;
  const int32_t NB = profile_.num_candidate_blocks;
  SequenceImage image;
  image.caches.resize(seq->caches.size());
  for (size_t pool = 0; pool < seq->caches.size(); ++pool) {
    const state::CachePages& cp = seq->caches[pool];
    image.caches[pool].cache_layer = cache_layers[pool];
    image.caches[pool].length = cp.length;
    image.caches[pool].pages.resize(cp.pages.size() * pool_geometry_[pool].page_bytes());
  }
  for (const auto& [layer, rec] : seq->candidates) {
    CandidateImage c;
    c.source_layer = layer;
    c.length = rec.length;
    c.row_lengths = rec.row_lengths;
    c.blocks.resize(size_t(rec.rows) * NB);
    image.candidates.push_back(std::move(c));
  }
  // The caches are read from rank 0's replica (every rank holds the same); the turn keeps any
  // step from changing them meanwhile.
  const state::SequenceState& s = *seq;
  lock.unlock();
  absl::Status status = FirstError(RunOnAllRanks([&](Rank& rank) -> absl::Status {
    if (rank.index() != 0) return absl::OkStatus();
    if (absl::Status st = rank.overlap().Join(); !st.ok()) return st;
    for (size_t pool = 0; pool < s.caches.size(); ++pool) {
      const kernels::CacheView& cache = rank.buffers().caches[pool];
      const int64_t bytes = cache.geometry.page_bytes();
      char* out = image.caches[pool].pages.data();
      for (size_t k = 0; k < s.caches[pool].pages.size(); ++k) {
        if (absl::Status st = rank.backend().CopyToHost(
                out + k * bytes, cache.base + s.caches[pool].pages[k] * bytes, bytes);
            !st.ok()) {
          return st;
        }
      }
    }
    size_t c = 0;
    for (const auto& [layer, rec] : s.candidates) {
      int32_t* store = rank.buffers().candidate_store + int64_t{rec.store_block} * M * NB;
      if (absl::Status st = rank.backend().CopyToHost(image.candidates[c++].blocks.data(), store,
                                                      size_t(rec.rows) * NB * sizeof(int32_t));
          !st.ok()) {
        return st;
      }
    }
    return rank.backend().Synchronize();
  }));
  if (!status.ok()) return status;
  // The slots past the length hold whatever was there before: zero them, so an image says
  // only what the sequence holds.
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    const kernels::CacheGeometry& g = pool_geometry_[pool];
    const int64_t used = image.caches[pool].length % g.page_size;
    if (used == 0) continue;
    char* last = image.caches[pool].pages.data() + image.caches[pool].pages.size() - g.page_bytes();
    const int64_t V = g.value_bytes(), S = g.scale_bytes(), P = g.page_size;
    std::memset(last + used * V, 0, (P - used) * V);
    std::memset(last + P * V + used * S, 0, (P - used) * S);
  }
  return image;
}

absl::Status ExecutorImpl::ImportSequence(uint64_t sequence_id, const SequenceImage& image,
                                          const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;
  std::unique_lock lock(mu_);
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  const int32_t P = profile_.page_size;
  const int32_t M = profile_.max_rows_per_sequence;
  const int32_t NB = profile_.num_candidate_blocks;
  if (table_.Find(sequence_id) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("sequence_id: sequence ", sequence_id, " exists"));
  }
  if (image.caches.size() != cache_layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "caches: ", image.caches.size(), " caches for a profile with ", cache_layers.size()));
  }
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    const CacheImage& c = image.caches[pool];
    const std::string field = absl::StrCat("caches[", pool, "]");
    if (c.cache_layer != cache_layers[pool]) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".cache_layer: ", c.cache_layer, ", expected ", cache_layers[pool]));
    }
    if (c.length < 0 || c.length > profile_.max_context) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".length: ", c.length, " is out of [0, ", profile_.max_context, "]"));
    }
    const int64_t want = CeilDiv(c.length, P) * pool_geometry_[pool].page_bytes();
    if (int64_t(c.pages.size()) != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".pages: ", c.pages.size(), " bytes, expected ", want, " for length ", c.length));
    }
  }
  // The bytes must be what a write could have left (an image is not trusted because its
  // checksums agree): no NaN codes or scales, positive finite FP8 scales.
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    if (absl::Status s = CheckCacheImage(image.caches[pool], pool_geometry_[pool],
                                         absl::StrCat("caches[", pool, "].pages"));
        !s.ok()) {
      return s;
    }
  }
  std::set<int32_t> sources;
  for (size_t i = 0; i < image.candidates.size(); ++i) {
    const CandidateImage& c = image.candidates[i];
    const std::string field = absl::StrCat("candidates[", i, "]");
    const LayerSpec* spec = profile_.FindLayer(c.source_layer);
    if (spec == nullptr || spec->role != LayerRole::kCandidateSource ||
        !sources.insert(c.source_layer).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".source_layer: ", c.source_layer, " is not a (new) source layer"));
    }
    const int64_t rows = int64_t(c.row_lengths.size());
    if (rows < 1 || rows > M || int64_t(c.blocks.size()) != rows * NB ||
        c.length != image.caches[pool_of_layer_[spec->cache_layer]].length) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": rows, blocks or length do not fit the profile and the caches"));
    }
    // Each row: ascending block ids below its length's blocks, then -1 (spec section 7), as a
    // consumer reads them without checking.
    for (int64_t j = 0; j < rows; ++j) {
      const int32_t rl = c.row_lengths[j];
      if (rl < 1 || rl > c.length) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".row_lengths[", j, "]: ", rl, " is out of [1, ", c.length, "]"));
      }
      const int64_t blocks = CeilDiv(rl, profile_.candidate_block_size);
      int64_t prev = -1;
      bool padding = false;
      for (int32_t b = 0; b < NB; ++b) {
        const int32_t v = c.blocks[j * NB + b];
        const bool ok = v == -1 ? (padding = true) : (!padding && v > prev && v < blocks);
        if (!ok) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".blocks: row ", j, " entry ", b, " (", v,
                           ") is not an ascending block id below ", blocks, " or -1 padding"));
        }
        if (v != -1) prev = v;
      }
    }
  }
  // Reserve all-or-nothing.
  std::vector<std::vector<int32_t>> pages(image.caches.size());
  std::vector<int32_t> blocks;
  auto give_back = [&] {
    for (size_t pool = 0; pool < pages.size(); ++pool) pools_[pool].Release(pages[pool]);
    if (!blocks.empty()) store_blocks_->Release(blocks);
  };
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    absl::StatusOr<std::vector<int32_t>> got =
        pools_[pool].Reserve(CeilDiv(image.caches[pool].length, P));
    if (!got.ok()) {
      give_back();
      return got.status();
    }
    pages[pool] = *std::move(got);
  }
  if (!image.candidates.empty()) {
    absl::StatusOr<std::vector<int32_t>> got = store_blocks_->Reserve(image.candidates.size());
    if (!got.ok()) {
      give_back();
      return got.status();
    }
    blocks = *std::move(got);
  }
  if (absl::Status s = table_.CanCreate(sequence_id); !s.ok()) {
    give_back();
    return s;
  }
  lock.unlock();
  absl::Status status = FirstError(RunOnAllRanks([&](Rank& rank) -> absl::Status {
    if (absl::Status st = rank.overlap().Join(); !st.ok()) return st;
    for (size_t pool = 0; pool < pages.size(); ++pool) {
      const kernels::CacheView& cache = rank.buffers().caches[pool];
      const int64_t bytes = cache.geometry.page_bytes();
      const char* in = image.caches[pool].pages.data();
      for (size_t k = 0; k < pages[pool].size(); ++k) {
        if (absl::Status st = rank.backend().CopyToDevice(cache.base + pages[pool][k] * bytes,
                                                          in + k * bytes, bytes);
            !st.ok()) {
          return st;
        }
      }
    }
    for (size_t c = 0; c < blocks.size(); ++c) {
      int32_t* store = rank.buffers().candidate_store + int64_t{blocks[c]} * M * NB;
      if (absl::Status st =
              rank.backend().CopyToDevice(store, image.candidates[c].blocks.data(),
                                          image.candidates[c].blocks.size() * sizeof(int32_t));
          !st.ok()) {
        return st;
      }
    }
    return rank.backend().Synchronize();
  }));
  if (status.ok()) status = AskCaller(call_check);
  lock.lock();
  if (!status.ok()) {
    give_back();
    return status;
  }
  if (absl::Status s = table_.Create(sequence_id); !s.ok()) {
    give_back();
    return s;
  }
  idle_released_set_.erase(sequence_id);
  state::SequenceState* seq = table_.Find(sequence_id);
  seq->last_used_ms = NowMs();
  for (size_t pool = 0; pool < pages.size(); ++pool) {
    AdoptCache(seq->caches[pool], std::move(pages[pool]), image.caches[pool].length);
    RecordTable(static_cast<int32_t>(pool), *seq);
  }
  for (size_t c = 0; c < blocks.size(); ++c) {
    const CandidateImage& ci = image.candidates[c];
    state::CandidateRecord& rec = seq->candidates[ci.source_layer];
    rec.version = next_candidate_version_++;
    rec.length = ci.length;
    rec.rows = static_cast<int32_t>(ci.row_lengths.size());
    rec.row_lengths = ci.row_lengths;
    rec.store_block = blocks[c];
  }
  return absl::OkStatus();
}

ExecutorStatus ExecutorImpl::Status() const {
  std::lock_guard lock(mu_);
  ExecutorStatus s = stats_;
  s.sequences = table_.size();
  for (const LayerSpec& l : profile_.layers) {
    const int32_t pool = pool_of_layer_[l.layer];
    if (l.role == LayerRole::kCandidateConsumer || pool < 0) continue;
    s.caches.push_back({l.layer, pools_[pool].total(), pools_[pool].free()});
  }
  return s;
}

absl::Status ExecutorImpl::WithAnswerBackend(
    const std::function<absl::Status(kernels::Backend&)>& fn) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  return fn(ranks_[0]->backend());
}

void ExecutorImpl::Shutdown() {
  if (shut_down_.exchange(true)) return;
  if (idle_thread_.joinable()) {
    {
      std::lock_guard lock(idle_mu_);
      idle_stop_ = true;
    }
    idle_cv_.notify_all();
    idle_thread_.join();
  }
  // Calls that already hold tickets finish first; later ones see shut_down_.
  FifoTurns::Turn turn = turns_.Wait();
  collective_.reset();
  ranks_.clear();  // joins the rank threads and frees their memory
  spdlog::info("executor: shut down");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Executor>> Executor::Create(const config::Profile& profile,
                                                           const ExecutorOptions& options) {
  if (absl::Status s = config::ValidateProfile(profile); !s.ok()) return s;
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("executor options: ", parts...));
  };
  if (options.logits_precision != "default" && options.logits_precision != "exact" &&
      options.logits_precision != "fp8") {
    return bad("logits_precision \"", options.logits_precision,
               "\": expected default, exact or fp8");
  }
  if (options.cache_pages < 1 || options.cache_pages > INT32_MAX) {
    return bad("cache_pages must be in [1, 2^31 - 1], got ", options.cache_pages);
  }
  if (options.max_sequences < 1) return bad("max_sequences must be >= 1");
  if (options.max_requests_per_step < 1 || options.max_requests_per_step > 65536) {
    return bad("max_requests_per_step must be in [1, 65536], got ", options.max_requests_per_step);
  }
  if (options.ranks < 0 || options.ranks > 64) {
    return bad("ranks must be in [0, 64], got ", options.ranks);
  }
  std::string backend = options.backend;
  if (backend == "auto") backend = kernels::CudaBackendAvailable() ? "cuda" : "cpu";
  if (backend != "cpu" && backend != "cuda") {
    return bad("backend must be auto, cpu or cuda, got \"", options.backend, "\"");
  }
  int32_t ranks = options.ranks;
  if (backend == "cuda") {
    // Refuse at start-up what the CUDA kernels cannot run, rather than failing the first step.
    // --backend auto stays on cuda: a silent CPU fallback would hide a large slowdown.
    const char* why =
        options.backend == "auto"
            ? "; --backend auto picked cuda (a GPU is visible) and does not fall back to cpu: "
              "pass --backend cpu or change the profile"
            : "; pass --backend cpu or change the profile";
    const std::vector<int32_t> cache_layers = profile.CacheLayers();
    for (size_t i = 0; i < cache_layers.size(); ++i) {
      const config::LayerSpec& l = profile.layers[cache_layers[i]];
      const kernels::CacheGeometry geometry{l.cache_format, profile.head_dim, profile.page_size};
      if (absl::Status s = kernels::CudaSupportsGeometry(geometry, profile.num_heads,
                                                         profile.candidate_block_size,
                                                         absl::StrCat("cache[", i, "]"));
          !s.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("profile ", profile.name, " ", s.message(), why));
      }
    }
    if (options.ranks > 0) {
      if (absl::Status s = kernels::CudaSupportsRanks(options.ranks); !s.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("executor options ", s.message()));
      }
    }
    if (!kernels::CudaBackendAvailable()) {
      return absl::FailedPreconditionError(
          "executor options: backend cuda, but this build has no CUDA backend or no GPU");
    }
    const int32_t devices = kernels::CudaDeviceCount();
    if (ranks == 0) ranks = devices;
    if (absl::Status s = kernels::CudaSupportsRanks(ranks); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("executor options ", s.message(), ": ", devices,
                       " GPUs are visible; pass --ranks 16 or fewer"));
    }
    if (ranks > devices) {
      return bad(ranks, " cuda ranks, but only ", devices, " GPUs are visible");
    }
  } else if (ranks == 0) {
    ranks = 1;
  }
  int32_t threads = options.cpu_threads;
  if (threads <= 0) {
    threads = std::max(1, static_cast<int32_t>(std::thread::hardware_concurrency()) / ranks);
  }
  ExecutorOptions resolved = options;
  resolved.backend = backend;
  resolved.ranks = ranks;
  BackendFactory factory;
  if (backend == "cuda") {
    const kernels::LogitsPrecision precision =
        options.logits_precision == "exact" ? kernels::LogitsPrecision::kExact
        : options.logits_precision == "fp8" ? kernels::LogitsPrecision::kFp8
                                            : kernels::LogitsPrecision::kDefault;
    factory = [precision](int32_t rank, const kernels::BackendLimits& limits) {
      kernels::BackendLimits with_precision = limits;
      with_precision.logits_precision = precision;
      return kernels::MakeCudaBackend(with_precision, rank);
    };
  } else {
    factory = [threads](int32_t, const kernels::BackendLimits& limits)
        -> absl::StatusOr<std::unique_ptr<kernels::Backend>> {
      return kernels::MakeCpuBackend(limits, threads);
    };
  }
  return CreateExecutorWithBackends(profile, resolved, std::move(factory));
}

void SetFaultHooks(Executor& executor, std::shared_ptr<FaultHooks> hooks) {
  auto& e = dynamic_cast<ExecutorImpl&>(executor);
  std::lock_guard lock(e.mu_);
  e.fault_hooks_ = std::move(hooks);
  e.hooks_since_ = e.steps_to_ranks_;
}

void SetStepObserver(Executor& executor, std::shared_ptr<StepObserver> observer) {
  auto& e = dynamic_cast<ExecutorImpl&>(executor);
  std::lock_guard lock(e.mu_);
  e.observer_ = std::move(observer);
}

std::vector<double> LastScoringUs(const Executor& executor) {
  const auto& e = dynamic_cast<const ExecutorImpl&>(executor);
  std::vector<double> out;
  // Written by the rank threads inside a step; read between steps.
  for (const auto& r : e.ranks_) {
    const absl::StatusOr<double> scoring =
        r->last_step().graph_replayed ? absl::StatusOr<double>(-1.0) : r->backend().LastScoringUs();
    out.push_back(scoring.ok() ? *scoring : -1.0);
  }
  return out;
}

std::vector<absl::StatusOr<kernels::Backend::OverlapTiming>> LastOverlapTimings(
    const Executor& executor) {
  const auto& e = dynamic_cast<const ExecutorImpl&>(executor);
  std::vector<absl::StatusOr<kernels::Backend::OverlapTiming>> out;
  // Between steps no rank thread touches its backend.
  for (const auto& r : e.ranks_) out.push_back(r->backend().LastOverlapTiming());
  return out;
}

void SetScoringTiming(Executor& executor, bool on) {
  auto& e = dynamic_cast<ExecutorImpl&>(executor);
  for (const auto& r : e.ranks_) r->backend().SetScoringTiming(on);
}

std::vector<absl::Status> LastRankStatuses(const Executor& executor) {
  const auto& e = dynamic_cast<const ExecutorImpl&>(executor);
  std::lock_guard lock(e.mu_);
  return e.last_rank_statuses_;
}

absl::StatusOr<std::unique_ptr<Executor>> CreateExecutorWithBackends(const config::Profile& profile,
                                                                     const ExecutorOptions& options,
                                                                     BackendFactory factory) {
  if (absl::Status s = config::ValidateProfile(profile); !s.ok()) return s;
  if (options.ranks < 1) return absl::InvalidArgumentError("executor options: ranks must be >= 1");
  auto executor = std::make_unique<ExecutorImpl>(profile, options);
  if (absl::Status s = executor->Init(options.ranks, factory); !s.ok()) return s;
  return executor;
}

}  // namespace decode_indexer::exec
