// What the executor hands every rank for one step: the plan (StepPlan) the planner fills
// (planner.h) and every rank runs (decode_rows.h), and the key writes it carries.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "decode_indexer/kernels/types.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/exec/page_table_mirror.h"
#include "server/exec/row_shard.h"
#include "server/exec/step_hooks.h"

namespace decode_indexer::exec {

// One sequence's new keys and the cache slots they go to.
struct KeyWrite {
  kernels::ElemType type = kernels::ElemType::kF32;
  int32_t count = 0;
  const void* keys = nullptr;
  const void* scales = nullptr;
  const int64_t* slots = nullptr;  // [count] page * page_size + slot
  // keys / scales are device addresses (KeysInput::on_device): copied device to device, never
  // read on the host.
  bool on_device = false;
};

struct StepPlan {
  config::LayerRole role = config::LayerRole::kDense;
  int32_t pool = 0;  // the cache pool the layer reads (and writes, unless a consumer)
  int32_t num_rows = 0;
  int32_t num_requests = 0;
  std::vector<int32_t> row_request;  // [rows]
  std::vector<int32_t> row_length;   // [rows]
  int32_t max_row_length = 0;
  // The resident page tables (page_table_mirror.h): the requests' sequence slots (the kernels
  // read request b's pages from row request_slot[b] of the pool's table), the pool's edits
  // recorded since a job last applied them, and the pages this step's writes add or replace,
  // applied after those. Nothing of the size of a page table travels per step.
  std::vector<int32_t> request_slot;  // [requests]
  const TableEdits* pending_edits = nullptr;
  TableEdits table_edits;
  std::vector<KeyWrite> key_writes;
  // (src, dst) pages of `pool` copied before the keys are written: copy-on-write of a page
  // another sequence holds, or of a page a cut-back rewrites (state::PlanCacheWrite).
  std::vector<std::pair<int32_t, int32_t>> page_copies;
  bool hadamard = false;
  QInput q;
  // Some key write reads device memory (KeyWrite::on_device): checked on the device.
  bool keys_on_device = false;
  // StepInput::inputs_ready_event: waited on by every rank before it reads device inputs.
  void* inputs_ready_event = nullptr;
  // Whether the step reads inputs from device memory (q or keys), whose values the ranks
  // check on their devices (step_io.h DeviceChecks).
  bool device_inputs() const { return q.on_device || keys_on_device; }
  kernels::RopeConfig rope;  // inv_freq filled in per rank
  // row_shard_bounds, evaluated once by the planner: whether the step is row-sharded, and
  // then the rows [start, end) each rank scores (by rank index). Unsharded, every rank scores
  // every row.
  bool sharded = false;
  std::vector<RowRange> rank_rows;
  RowRange RowsOf(int32_t rank) const { return sharded ? rank_rows[rank] : RowRange{0, num_rows}; }
  // ExecutorOptions::direct_answers: a sharded step's ranks copy their own rows to the host
  // answer, with no all-gather of the top-k (DecodeRowsOnRank says when one still runs).
  bool direct_answers = false;
  // ExecutorOptions::answer_in_place (decode_schedule.h TopKInPlace).
  bool answer_in_place = false;
  // Candidate store rows of the step's rows: where a source writes, where a consumer reads.
  std::vector<int32_t> store_rows;
  bool masked_consumer = false;
  bool reuse_expansion = false;  // consumer: every rank's expansion already holds these rows
  bool fork_expansion = false;   // source: fork the expansion after writing candidates
  // The test seam (step_hooks.h): this step's faults and the observer its ranks tell where
  // their time goes; null in production.
  std::shared_ptr<const StepFaults> faults;
  std::shared_ptr<StepObserver> observer;
  // Host outputs, written by the answering rank.
  int32_t answer_rank = 0;
  int32_t* topk_out = nullptr;        // [rows, topk]
  int32_t* candidates_out = nullptr;  // [rows, NB] or null
  // StepInput::host_memory_page_locked: q is uploaded with no staging copy.
  bool q_page_locked = false;
  // topk_out / candidates_out lie in page-locked memory (AnswerSink::page_locked): the ranks'
  // device-to-host copies land there directly, with no readback space and no host copy.
  bool topk_page_locked = false;
  bool candidates_page_locked = false;
  // Deferred answers (StepResult's vectors or an AnswerSink's encoder, every rank with
  // page-locked readback space): topk_out / candidates_out stay null, each rank leaves its
  // rows in its readback space (Rank::StepRecord::readback) and the executor takes them from there
  // after the join: no zero-filled vector, no second host copy.
  bool defer_topk = false;
  bool defer_candidates = false;
  // Instead of topk_out / candidates_out: memory of the answering rank's backend (a client's
  // CUDA IPC buffer), with no host copy: the top-k written there by the scoring itself where
  // decode_schedule.h TopKInPlace says so, else (and the candidates) device to device.
  int32_t* topk_device_out = nullptr;        // [rows, topk]
  int32_t* candidates_device_out = nullptr;  // [rows, NB] or null
  // AnswerSink::done_event: recorded on the answering rank's stream after those writes.
  void* answer_event = nullptr;

  // Back to an empty plan, keeping the vectors' capacity: the executor reuses one plan for
  // every step, so the per-step path does not reallocate its host arrays.
  void Reset();
};

}  // namespace decode_indexer::exec
