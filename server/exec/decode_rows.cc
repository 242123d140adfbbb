#include "server/exec/decode_rows.h"

#include <algorithm>
#include <chrono>

#include "common/status_macros.h"
#include "server/exec/candidate_overlap.h"
#include "server/exec/decode_schedule.h"
#include "server/exec/insert_keys.h"
#include "server/exec/row_shard.h"
#include "server/exec/step_graphs.h"
#include "server/exec/step_io.h"

namespace decode_indexer::exec {
namespace {

int64_t NanosBetween(std::chrono::steady_clock::time_point a,
                     std::chrono::steady_clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// Everything before the collectives: upload -> insert keys -> q of rows [range) ->
// decode_schedule -> the kernel section (the packed keys' insert with the step's page-table
// edits, device q's check, rope_quant_q and the scoring call; q read in place from a client's
// device buffer on the answering rank) into the rank's topk (or, TopKInPlace, the answer's
// device span) and candidates at a source. The uploads, keys that are not packed, edits that
// the section does not make and a consumer's schedule run eagerly (their sizes vary, or they
// use the side stream); the kernel section replays a captured graph when the step's shape was
// seen before (step_graphs.h). (A consumer carries no keys, so its schedule never reads a
// table the section has yet to edit.)
absl::Status ScoreRows(Rank& rank, Staging& staging, const StepPlan& plan, RowRange range,
                       StepUploads& packed, DeviceChecks& checks) {
  kernels::IndexerOps& ops = rank.ops();
  Rank::StepRecord& record = rank.step_record();
  record.graph_captured = false;
  record.graph_replayed = false;
  record.graph_evicted = false;
  StepObserver* observer = plan.observer.get();  // the test seam: null in production
  using Mark = StepObserver::RankMark;
  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kUploadsBegin);

  // The step's small arrays in one upload into a ring slot (StepUploads says which).
  absl::StatusOr<StepUploads> uploads = PackStepUploads(rank, staging, plan, range);
  if (!uploads.ok()) return uploads.status();
  packed = *std::move(uploads);
  DI_RETURN_IF_ERROR(UploadStepRows(rank, staging, plan, packed));
  // Keys go into every replica whatever rows this rank scores; pages they share with another
  // sequence (or that a cut-back rewrites) are copied first.
  DI_RETURN_IF_ERROR(CopyPagesOnRank(rank, plan.pool, plan.page_copies));
  DI_RETURN_IF_ERROR(
      InsertStepKeys(rank, staging, plan.pool, plan.key_writes, plan.hadamard, packed, checks));
  absl::StatusOr<QRows> q = UploadQ(rank, staging, plan, range, packed);
  if (!q.ok()) return q.status();
  // The last key run's checks, still queued (their counts vary: eager); q's go with the
  // kernel section, their arguments fixed for its shape (the flag words, and q's addresses,
  // in place or staged).
  DI_RETURN_IF_ERROR(checks.Flush());
  DI_RETURN_IF_ERROR(checks.ForSection(q->checks));
  DI_RETURN_IF_ERROR(DecodeSchedule(rank, staging, plan, packed));
  const ScoringCall scoring(rank, plan, range, *q, packed);
  StepShape shape = scoring.shape();
  if (packed.keys) {
    const size_t base = size_t(packed.key_base - rank.staging_ring().slot(packed.slot));
    for (const KeyRun& run : packed.key_runs) {
      shape.key_runs.push_back({static_cast<int32_t>(run.type), run.count, run.has_scales,
                                static_cast<uint32_t>(base + run.keys_offset),
                                static_cast<uint32_t>(base + run.scales_offset),
                                static_cast<uint32_t>(base + run.slots_offset)});
    }
    shape.key_hadamard = plan.hadamard;
  }
  auto kernel_section = [&]() -> absl::Status {
    // The packed keys and the step's page-table edits, before anything reads the cache.
    if (packed.keys) DI_RETURN_IF_ERROR(InsertPackedKeys(rank, plan.pool, plan.hadamard, packed));
    // Device q's check, on what rope_quant_q and the scoring read (captured into the graph).
    if (q->checks.num_checks > 0) DI_RETURN_IF_ERROR(ops.CheckValues(q->checks));
    if (q->unquantized) DI_RETURN_IF_ERROR(ops.RopeQuantQ(q->prep));  // rope_quant_q
    return scoring.Launch(ops);
  };

  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kLaunchBegin);
  absl::Status status = RunKernelSection(rank, shape, kernel_section);
  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kLaunchEnd);
  return status;
}

// The answer: a direct (sharded, host-bound) step's rank copies its own rows to their place in
// the host answer (see gather_topk in DecodeRowsOnRank); otherwise the answering rank copies
// every row, to the host or device to device into the answer's device span, unless its
// scoring wrote the top-k there in place (TopKInPlace).
absl::Status CopyAnswer(Rank& rank, const StepPlan& plan, RowRange range, bool direct,
                        Readback& readback) {
  kernels::Device& be = rank.device();
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const int32_t NB = s.num_candidate_blocks;
  if (direct) {
    // This rank's rows only, to their place in the host answer (see gather_topk above); the
    // candidates too, though every rank holds them all, so the copies split across devices.
    const int32_t n = range.end - range.start;
    DI_RETURN_IF_ERROR(readback.Copy(Readback::Answer::kTopK, int64_t{range.start} * s.topk,
                                     b.topk + int64_t{range.start} * s.topk,
                                     size_t(n) * s.topk * sizeof(int32_t)));
    if (plan.candidates_device_out != nullptr && rank.index() == plan.answer_rank) {
      DI_RETURN_IF_ERROR(be.CopyDeviceToDevice(plan.candidates_device_out, b.candidates,
                                               size_t(plan.num_rows) * NB * sizeof(int32_t)));
    } else if (plan.candidates_out != nullptr || plan.defer_candidates) {
      DI_RETURN_IF_ERROR(readback.Copy(Readback::Answer::kCandidates, int64_t{range.start} * NB,
                                       b.candidates + int64_t{range.start} * NB,
                                       size_t(n) * NB * sizeof(int32_t)));
    }
  } else if (rank.index() == plan.answer_rank) {
    const size_t topk_bytes = size_t(plan.num_rows) * s.topk * sizeof(int32_t);
    const size_t cand_bytes = size_t(plan.num_rows) * NB * sizeof(int32_t);
    if (plan.topk_device_out != nullptr) {
      // Already there where the scoring wrote it in place (ScoringCall, TopKInPlace).
      if (!TopKInPlace(rank, plan)) {
        DI_RETURN_IF_ERROR(be.CopyDeviceToDevice(plan.topk_device_out, b.topk, topk_bytes));
      }
    } else {
      DI_RETURN_IF_ERROR(readback.Copy(Readback::Answer::kTopK, 0, b.topk, topk_bytes));
    }
    if (plan.candidates_device_out != nullptr) {
      DI_RETURN_IF_ERROR(
          be.CopyDeviceToDevice(plan.candidates_device_out, b.candidates, cand_bytes));
    } else if (plan.candidates_out != nullptr || plan.defer_candidates) {
      DI_RETURN_IF_ERROR(readback.Copy(Readback::Answer::kCandidates, 0, b.candidates, cand_bytes));
    }
    // "Answer ready" for the client's stream, after everything that writes its buffer: the
    // kernel section (a top-k written in place) and the copies above, all on this stream.
    if (plan.answer_event != nullptr) DI_RETURN_IF_ERROR(be.RecordEvent(plan.answer_event));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeRowsOnRank(Rank& rank, const StepPlan& plan, Collective& collective) {
  kernels::Device& be = rank.device();
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const int32_t world = collective.world_size();
  // A step that fails the gate runs unsharded on every rank: each rank computes every row, so
  // every rank holds the whole answer (and, at a source, every candidate for its store)
  // without a collective.
  // The test seam (step_hooks.h): null in production.
  const StepFaults* faults = plan.faults.get();
  StepObserver* observer = plan.observer.get();
  using Mark = StepObserver::RankMark;
  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kStepBegin);
  const RowRange range = plan.RowsOf(rank.index());
  Rank::StepRecord& record = rank.step_record();
  absl::Status status = rank.overlap().Join();
  const bool source = plan.role == config::LayerRole::kCandidateSource;
  const int32_t NB = s.num_candidate_blocks;

  // The step's host staging; the previous step's copies from it have finished (every step
  // ends in a Synchronize, a failed one too).
  Staging staging(rank);
  Readback readback(rank, plan);
  if (status.ok() && faults != nullptr) status = faults->BeforeScoring(rank.index());
  // q or keys in the client's device buffer, written on its stream: this rank's stream waits
  // for the client's "inputs ready" record on the GPU before anything of the step reads them.
  if (status.ok() && plan.device_inputs() && plan.inputs_ready_event != nullptr) {
    status = be.WaitEvent(plan.inputs_ready_event);
  }
  StepUploads packed;
  DeviceChecks checks(rank);
  if (status.ok()) status = ScoreRows(rank, staging, plan, range, packed, checks);
  record.collective_ns = 0;
  record.collectives = 0;
  // Which sharded steps still need a collective. An answer bound for host memory does not:
  // each rank copies its own rows straight from its device to their place in the host answer
  // (direct_answers), so a sharded dense or consumer step runs with no all-gather and no host
  // agreement: the ranks never wait for one another, and a rank's failure fails the step
  // through the executor's join (its own status), not through a peer's copy of it. What still
  // gathers: a source's candidate blocks (every rank's candidate store needs every row, for
  // the consumers that follow), and an answer that must end in the answering rank's device
  // memory (a client's CUDA IPC buffer, written device to device from the gathered rows).
  const bool gather_topk =
      plan.sharded && (!plan.direct_answers || plan.topk_device_out != nullptr);
  const bool gather_candidates = plan.sharded && source;
  const bool direct = plan.sharded && !gather_topk;
  if (gather_topk || gather_candidates) {
    // Every rank reaches the agreement whatever happened above, and all skip the all-gathers
    // if any failed: a device collective would otherwise wait for the failed rank. The
    // agreement is on what the host knows (every launch went in) and runs while the kernels
    // do: its hand-off costs nothing then.
    status = collective.Agree(rank.index(), status);
    ++record.collectives;
    StepFaults::AfterAgreement fault;
    if (status.ok() && faults != nullptr) fault = faults->AfterTheAgreement(rank.index());
    if (fault.kind == StepFaults::AfterAgreement::Kind::kSkipGather) return fault.status;
    // The rank's own work, so the time below is the collectives' alone. A device error found
    // here comes after the others agreed: abort, so that none waits in the all-gather for
    // this rank (the collective then stays aborted, as for any device fault).
    if (status.ok()) {
      status = fault.kind == StepFaults::AfterAgreement::Kind::kFailSynchronize ? fault.status
                                                                                : be.Synchronize();
      if (!status.ok()) collective.Abort(status);
    }
    const auto gather_start = std::chrono::steady_clock::now();
    if (observer != nullptr) observer->OnRank(rank.index(), Mark::kScored);
    const int32_t rows_per_rank = plan.num_rows / world;
    if (status.ok() && gather_topk) {
      status = collective.AllGather(rank.index(), b.topk + int64_t{range.start} * s.topk, b.topk,
                                    size_t(rows_per_rank) * s.topk * sizeof(int32_t));
      ++record.collectives;
    }
    if (status.ok() && source) {
      status = collective.AllGather(rank.index(), b.candidates + int64_t{range.start} * NB,
                                    b.candidates, size_t(rows_per_rank) * NB * sizeof(int32_t));
      ++record.collectives;
    }
    record.collective_ns = NanosBetween(gather_start, std::chrono::steady_clock::now());
  } else if (status.ok() && faults != nullptr) {
    status = faults->WithoutCollective(rank.index());
  }
  if (!status.ok()) {
    // Copies queued before the failure may still read the host staging the next step reuses.
    if (be.Synchronize().ok()) rank.Settled();
    return status;
  }

  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kCopiesBegin);
  if (source) {
    // Into fresh store rows; the executor retires the old ones only on commit, so a failed
    // step leaves the sequence's published candidates intact.
    DI_RETURN_IF_ERROR(CopyStoreRows(rank, staging, plan, /*into_store=*/true, packed));
    if (plan.fork_expansion) {
      DI_RETURN_IF_ERROR(rank.overlap().Fork(plan.num_rows, packed.row_length));
    }
  }
  DI_RETURN_IF_ERROR(CopyAnswer(rank, plan, range, direct, readback));
  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kWaitBegin);
  absl::Status done = be.Synchronize();
  // The step's ring slot is read no more (the side stream's expansion aside: see StagingRing);
  // its checks have written their flag words, read here in place (mapped host memory).
  if (done.ok()) rank.Settled();
  if (observer != nullptr) observer->OnRank(rank.index(), Mark::kWaitEnd);
  if (done.ok() && checks.issued()) {
    done = DeviceInputsStatus(kernels::ValueFlagsMask(rank.value_flags_host()));
  }
  if (done.ok()) readback.Finish();
  if (observer != nullptr && (!plan.sharded || direct)) {
    observer->OnRank(rank.index(), Mark::kScored);
  }
  return done;
}

}  // namespace decode_indexer::exec
