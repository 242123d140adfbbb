// The executor: a FIFO of state-changing calls, each checked against the sequence table,
// planned on the host, run on every rank and committed only when every rank succeeded.
// (The class: executor_impl.h; the sequence lifecycle calls: executor_lifecycle.cc.)
#include "server/exec/executor.h"

#include "server/exec/executor_impl.h"

namespace decode_indexer::exec {
namespace internal {

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
  sizes.max_step_graphs = options_.max_step_graphs;
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

  std::vector<kernels::Device*> devices_of_ranks;  // the collectives' view of each rank
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
    devices_of_ranks.push_back(&backend->device());
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
        MakeNcclCollective(devices_of_ranks, std::move(devices), timeout);
    if (!nccl.ok()) return nccl.status();
    collective_ = *std::move(nccl);
#else
    spdlog::warn("executor: built without NCCL; the cuda ranks gather through host memory");
#endif
  }
  if (collective_ == nullptr) {
    collective_ = MakeInProcessCollective(devices_of_ranks, gather_bytes, timeout);
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

absl::StatusOr<int64_t> ExecutorImpl::AppendKeys(const ValidatedAppend& append,
                                                 const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;

  // The layer owns its cache and the keys' form fits it (ValidateAppend); what is left needs
  // the sequence table.
  const uint64_t sequence_id = append.sequence_id();
  const int32_t layer = append.layer();
  const KeysInput& keys = append.keys();
  std::unique_lock lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  const int32_t pool = pool_of_layer_[layer];
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
    if (writes.empty()) return rank.device().Synchronize();
    // Bulk prefill crosses NVLink once per rank (broadcast from rank 0) where the collective
    // can; otherwise every rank copies the keys from host memory.
    const absl::Status s =
        ranks_.size() > 1 && collective_->device_broadcast()
            ? BroadcastInsertKeysOnRank(rank, pool, writes, profile_.hadamard, *collective_)
            : InsertKeysOnRank(rank, pool, writes, profile_.hadamard);
    if (!s.ok()) return s;
    return rank.device().Synchronize();
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

absl::StatusOr<StepResult> ExecutorImpl::DecodeStep(const ValidatedStep& validated) {
  const StepInput& step = validated.input();
  if (shut_down_) return Unavailable();
  const Clock::time_point arrived = Clock::now();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;
  const Clock::time_point started = Clock::now();

  // Only the turn holder touches the reused plan.
  StepPlan& plan = plan_;
  plan.Reset();
  absl::StatusOr<StepResult> result = DecodeStepLocked(validated, plan);
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
absl::StatusOr<StepResult> ExecutorImpl::DecodeStepLocked(const ValidatedStep& validated,
                                                          StepPlan& plan) {
  const StepInput& step = validated.input();
  Observe(StepObserver::StepMark::kPlan);
  std::unique_lock lock(mu_);
  PlannedStep planned;
  if (absl::Status s = planner_.Plan(validated, plan, planned); !s.ok()) return s;
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
    stats_.graph_evictions += r->last_step().graph_evicted;
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

absl::Status ExecutorImpl::WithAnswerDevice(
    const std::function<absl::Status(kernels::Device&)>& fn) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  return fn(ranks_[0]->device());
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

}  // namespace internal

using internal::ExecutorImpl;

absl::StatusOr<int64_t> Executor::AppendKeys(uint64_t sequence_id, int32_t layer,
                                             const KeysInput& keys, const CallCheck& call_check) {
  absl::StatusOr<ValidatedAppend> append = ValidateAppend(profile(), sequence_id, layer, keys);
  if (!append.ok()) return append.status();
  return AppendKeys(*append, call_check);
}

absl::StatusOr<StepResult> Executor::DecodeStep(const StepInput& step) {
  absl::StatusOr<ValidatedStep> validated = ValidateStep(profile(), step);
  if (!validated.ok()) return validated.status();
  return DecodeStep(*validated);
}

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
    kernels::BenchClocks* clocks = kernels::ClocksOf(r->ops());
    const absl::StatusOr<double> scoring = clocks == nullptr || r->last_step().graph_replayed
                                               ? absl::StatusOr<double>(-1.0)
                                               : clocks->LastScoringUs();
    out.push_back(scoring.ok() ? *scoring : -1.0);
  }
  return out;
}

std::vector<absl::StatusOr<kernels::BenchClocks::OverlapTiming>> LastOverlapTimings(
    const Executor& executor) {
  const auto& e = dynamic_cast<const ExecutorImpl&>(executor);
  std::vector<absl::StatusOr<kernels::BenchClocks::OverlapTiming>> out;
  // Between steps no rank thread touches its backend.
  for (const auto& r : e.ranks_) {
    kernels::BenchClocks* clocks = kernels::ClocksOf(r->ops());
    out.push_back(clocks != nullptr ? clocks->LastOverlapTiming()
                                    : absl::UnimplementedError("this backend has no side stream"));
  }
  return out;
}

void SetScoringTiming(Executor& executor, bool on) {
  auto& e = dynamic_cast<ExecutorImpl&>(executor);
  for (const auto& r : e.ranks_) {
    if (kernels::BenchClocks* clocks = kernels::ClocksOf(r->ops())) clocks->SetScoringTiming(on);
  }
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
