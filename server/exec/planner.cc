#include "server/exec/planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/exec/row_shard.h"

namespace decode_indexer::exec {

using config::LayerRole;
using config::LayerSpec;
using kernels::CacheFormat;
using kernels::ElemType;

// A position for keys (KeysInput::position, not negative: validated): at most the cache's
// committed length.
absl::Status CheckPosition(const std::optional<int64_t>& position, int64_t length,
                           int32_t cache_layer, FieldName field) {
  if (!position.has_value()) return absl::OkStatus();
  if (*position > length) {
    return absl::InvalidArgumentError(absl::StrCat(
        field(), ": ", *position, " is past the sequence's length ", length, " in layer ",
        cache_layer, "'s cache (it would leave a hole); positions must be <= the length"));
  }
  return absl::OkStatus();
}

// An imported cache's entries [0, length): FP8 codes other than the NaN S.1111.111, fp32

void StepPlan::Reset() {
  request_slot.clear();
  table_edits.clear();
  std::vector<int32_t> keep_slot = std::move(request_slot);
  TableEdits keep_edits = std::move(table_edits);
  row_request.clear();
  row_length.clear();
  key_writes.clear();
  store_rows.clear();
  page_copies.clear();
  std::vector<int32_t> keep_request = std::move(row_request);
  std::vector<int32_t> keep_length = std::move(row_length);
  std::vector<KeyWrite> keep_writes = std::move(key_writes);
  std::vector<int32_t> keep_store = std::move(store_rows);
  std::vector<std::pair<int32_t, int32_t>> keep_copies = std::move(page_copies);
  rank_rows.clear();
  std::vector<RowRange> keep_ranges = std::move(rank_rows);
  *this = StepPlan{};
  request_slot = std::move(keep_slot);
  table_edits = std::move(keep_edits);
  page_copies = std::move(keep_copies);
  row_request = std::move(keep_request);
  row_length = std::move(keep_length);
  key_writes = std::move(keep_writes);
  store_rows = std::move(keep_store);
  rank_rows = std::move(keep_ranges);
}

void StepPlanner::Init(int32_t world_size, bool defer_answers) {
  world_size_ = world_size;
  defer_answers_ = defer_answers;
}

void StepPlanner::Abandon(PlannedStep& planned) {
  for (state::CacheWrite& w : planned.writes) AbortCacheWrite(w, host_.pools[planned.pool]);
  planned.writes.clear();
  if (planned.source) host_.store_blocks->Release(planned.new_blocks);
  planned.new_blocks.clear();
}

absl::Status StepPlanner::Plan(const ValidatedStep& validated, StepPlan& plan, PlannedStep& out) {
  // The layer, ids, rows, row lengths and the keys' and q's form were checked once, before the
  // step reached the executor (validated_step.h); what is checked here needs the sequence table.
  const StepInput& step = validated.input();
  const config::Profile& p = host_.profile;
  const LayerSpec* spec = &validated.spec();
  const bool source = spec->role == LayerRole::kCandidateSource;
  const bool consumer = spec->role == LayerRole::kCandidateConsumer;
  const int32_t pool = host_.pool_of_layer[spec->cache_layer];
  out.spec = spec;
  out.source = source;
  out.consumer = consumer;
  out.pool = pool;
  const int32_t num_requests = static_cast<int32_t>(step.sequences.size());
  if (const AnswerSink* sink = step.answer;
      sink != nullptr && sink->topk() == nullptr &&
      (sink->kind() == AnswerSink::Kind::kHost || sink->kind() == AnswerSink::Kind::kDevice)) {
    return absl::InternalError("the answer sink has no top-k span");
  }
  if (step.answer != nullptr && step.answer->kind() == AnswerSink::Kind::kEncoder &&
      !step.answer->encoder()) {
    return absl::InternalError("the answer sink has no encoder");
  }
  // The executor's capacity (its rank buffers), not the profile's.
  if (num_requests > host_.options.max_requests_per_step) {
    return absl::InvalidArgumentError(absl::StrCat("sequences: at most ",
                                                   host_.options.max_requests_per_step,
                                                   " sequences a step, got ", num_requests));
  }
  const QInput& q = step.q;

  const int32_t P = p.page_size;
  const int32_t M = p.max_rows_per_sequence;
  int32_t num_rows = 0;
  std::vector<state::SequenceState*>& seqs = out.seqs;
  std::vector<int64_t>& lengths = out.lengths;
  seqs.assign(num_requests, nullptr);
  lengths.assign(num_requests, 0);
  plan.row_length.clear();
  std::vector<ExpansionRow>& expansion = out.expansion;
  expansion.clear();
  for (int32_t i = 0; i < num_requests; ++i) {
    const SequenceStepInput& in = step.sequences[i];
    auto field = [i](const char* suffix = "") {
      return absl::StrCat("sequences[", i, "]", suffix);
    };
    state::SequenceState* seq = host_.table.Find(in.sequence_id);
    if (seq == nullptr) return host_.no_sequence(field(".sequence_id"), in.sequence_id);
    seqs[i] = seq;
    const state::CachePages& cp = seq->caches[pool];
    if (absl::Status s = CheckPosition(in.new_keys.position, cp.length, spec->cache_layer,
                                       [&] { return field(".new_keys_position"); });
        !s.ok()) {
      return s;
    }
    const int64_t L = in.new_keys.position.value_or(cp.length) + in.new_keys.count;
    if (L > p.max_context) {
      return absl::OutOfRangeError(absl::StrCat(field(), ".new_keys: length ", L,
                                                " would exceed max_context ", p.max_context));
    }
    lengths[i] = L;
    const size_t first_row = plan.row_length.size();
    if (in.row_lengths.empty()) {
      if (in.num_rows > L) {
        return absl::InvalidArgumentError(absl::StrCat(
            field(), ".num_rows: more rows than context (", in.num_rows, " rows, length ", L, ")"));
      }
      for (int32_t j = 0; j < in.num_rows; ++j) {
        plan.row_length.push_back(static_cast<int32_t>(L - in.num_rows + j + 1));
      }
    } else {
      for (int32_t j = 0; j < in.num_rows; ++j) {
        const int32_t rl = in.row_lengths[j];
        if (rl < 1 || rl > L) {
          return absl::InvalidArgumentError(
              absl::StrCat(field(), ".row_lengths[", j, "]: must be in [1, ", L, "], got ", rl));
        }
        plan.row_length.push_back(rl);
      }
    }
    if (consumer) {
      // A view of the rows just planned (no per-sequence copy: this runs for every sequence
      // of every consumer step).
      const int32_t* row_lengths = plan.row_length.data() + first_row;
      const int32_t src_layer = spec->cache_layer;
      auto it = seq->candidates.find(src_layer);
      if (it == seq->candidates.end() || it->second.length != L ||
          !std::equal(it->second.row_lengths.begin(), it->second.row_lengths.end(), row_lengths,
                      row_lengths + in.num_rows)) {
        return absl::FailedPreconditionError(
            absl::StrCat(field(), ": no candidates for sequence ", in.sequence_id, " at length ", L,
                         "; run the source layer ", src_layer, " first"));
      }
      for (int32_t j = 0; j < in.num_rows; ++j) {
        plan.store_rows.push_back(it->second.store_block * M + j);
        expansion.push_back({in.sequence_id, j, it->second.version, row_lengths[j]});
      }
    }
    for (int32_t j = 0; j < in.num_rows; ++j) plan.row_request.push_back(i);
    num_rows += in.num_rows;
  }
  // Reserve all-or-nothing: a step that does not fit leaves no trace. Each sequence's write
  // (a cut back to its position, then its keys) lands in fresh pages wherever it would touch a
  // shared page or committed entries, so a failed step leaves the committed state intact.
  std::vector<state::CacheWrite>& writes = out.writes;
  std::vector<int32_t>& new_blocks = out.new_blocks;
  writes.clear();
  new_blocks.clear();
  auto abort_writes = [&] {
    for (state::CacheWrite& w : writes) AbortCacheWrite(w, host_.pools[pool]);
    writes.clear();
  };
  writes.reserve(num_requests);
  for (int32_t i = 0; i < num_requests; ++i) {
    const state::CachePages& cp = seqs[i]->caches[pool];
    const KeysInput& keys = step.sequences[i].new_keys;
    absl::StatusOr<state::CacheWrite> w = state::PlanCacheWrite(
        cp, keys.position.value_or(cp.length), keys.count, P, host_.pools[pool]);
    if (!w.ok()) {
      abort_writes();
      return w.status();
    }
    writes.push_back(*std::move(w));
  }
  if (source) {
    absl::StatusOr<std::vector<int32_t>> blocks = host_.store_blocks->Reserve(num_requests);
    if (!blocks.ok()) {
      abort_writes();
      return blocks.status();
    }
    new_blocks = *std::move(blocks);
  }

  // The plan: page tables with the fresh pages, key slots, store rows.
  plan.role = spec->role;
  plan.pool = pool;
  plan.num_rows = num_rows;
  plan.num_requests = num_requests;
  plan.max_row_length = *std::max_element(plan.row_length.begin(), plan.row_length.end());
  // The pages every rank's resident table lacks: edits recorded since a job last applied the
  // pool's (a prefill, a fork, a failed step's restore), then below the pages this step's
  // writes add or replace.
  plan.pending_edits = &host_.mirror.Pending(pool);
  plan.hadamard = p.hadamard;
  plan.q = q;
  plan.inputs_ready_event = step.inputs_ready_event;
  plan.rope.style = p.rope.style;
  plan.rope.dim_offset = p.rope.dim_offset;
  plan.rope.rope_dim = p.rope.rope_dim;
  plan.direct_answers = host_.options.direct_answers;
  plan.answer_in_place = host_.options.answer_in_place;
  plan.masked_consumer = host_.options.masked_consumer;
  // Every request's key slots in one buffer, sized before any KeyWrite points into it.
  int64_t total_keys = 0;
  for (const SequenceStepInput& in : step.sequences) total_keys += in.new_keys.count;
  step_slots_.resize(size_t(total_keys));
  int64_t* slots = step_slots_.data();
  std::vector<uint64_t>& versions = out.versions;
  versions.assign(num_requests, 0);
  int32_t row = 0;
  for (int32_t i = 0; i < num_requests; ++i) {
    const SequenceStepInput& in = step.sequences[i];
    const state::CachePages& cp = seqs[i]->caches[pool];
    const state::CacheWrite& w = writes[i];
    // The write's tail (pages written in place, copies, fresh ones): only the entries that
    // differ from the committed pages are edits (a decode step adds one every page_size
    // tokens).
    plan.request_slot.push_back(seqs[i]->slot);
    for (size_t j = 0; j < w.tail.size(); ++j) {
      const size_t at = w.keep + j;
      if (at >= cp.pages.size() || cp.pages[at] != w.tail[j]) {
        plan.table_edits.push_back(host_.mirror.Index(seqs[i]->slot, int64_t(at)), w.tail[j]);
      }
    }
    for (const state::PageCopy& c : w.copies) plan.page_copies.push_back({c.src, c.dst});
    if (in.new_keys.count > 0) {
      for (int32_t k = 0; k < in.new_keys.count; ++k) slots[k] = w.Slot(cp, w.position + k, P);
      plan.key_writes.push_back({in.new_keys.type, in.new_keys.count, in.new_keys.keys,
                                 in.new_keys.scales, slots, in.new_keys.on_device});
      plan.keys_on_device = plan.keys_on_device || in.new_keys.on_device;
      slots += in.new_keys.count;
    }
    if (source) {
      versions[i] = host_.next_candidate_version++;
      for (int32_t j = 0; j < in.num_rows; ++j) {
        plan.store_rows.push_back(new_blocks[i] * M + j);
        expansion.push_back({in.sequence_id, j, versions[i], plan.row_length[row + j]});
      }
    }
    row += in.num_rows;
  }
  // row_shard_bounds, once: the gate reads only counts every rank shares.
  for (int32_t r = 0; r < world_size_; ++r) {
    std::optional<RowRange> bounds = RowShardBounds(num_rows, num_requests, world_size_, r,
                                                    host_.options.row_shard_min_requests);
    if (!bounds) break;
    plan.rank_rows.push_back(*bounds);
  }
  plan.sharded = !plan.rank_rows.empty();
  plan.reuse_expansion =
      consumer && !host_.options.masked_consumer && host_.expansions.Holds(expansion);
  plan.fork_expansion = source && host_.expansions.enabled() && !host_.options.masked_consumer;

  StepResult& result = out.result;
  result = StepResult{};
  result.step_id = step.step_id;
  result.num_rows = num_rows;
  result.topk = p.topk;
  result.sharded = plan.sharded;
  // Where the answer goes: the caller's sink (resolved at the edge), else the result's vectors.
  const AnswerSink* sink = step.answer;
  const AnswerSink::Kind sink_kind = sink != nullptr ? sink->kind() : AnswerSink::Kind::kVector;
  out.sink_kind = sink_kind;
  plan.q_page_locked = step.host_memory_page_locked;
  switch (sink_kind) {
    case AnswerSink::Kind::kDevice:
      plan.topk_device_out = sink->topk();
      plan.answer_event = sink->done_event();
      break;
    case AnswerSink::Kind::kHost:
      plan.topk_out = sink->topk();
      plan.topk_page_locked = sink->page_locked();
      break;
    case AnswerSink::Kind::kEncoder:
      if (defer_answers_) {
        plan.defer_topk = true;
      } else {  // no readback space: the rows land in the executor's own scratch
        encode_scratch_.resize(size_t(num_rows) * p.topk);
        plan.topk_out = encode_scratch_.data();
      }
      break;
    case AnswerSink::Kind::kVector:
      if (defer_answers_) {
        plan.defer_topk = true;
      } else {
        result.topk_indices.resize(size_t(num_rows) * p.topk);
        plan.topk_out = result.topk_indices.data();
      }
      break;
  }
  if (step.return_candidates) {
    result.num_candidate_blocks = p.num_candidate_blocks;
    int32_t* span = sink != nullptr ? sink->candidates() : nullptr;
    if (span != nullptr && sink_kind == AnswerSink::Kind::kDevice) {
      plan.candidates_device_out = span;
    } else if (span != nullptr) {
      plan.candidates_out = span;
      plan.candidates_page_locked = sink->page_locked();
    } else if (defer_answers_) {
      plan.defer_candidates = true;
    } else {
      result.candidate_blocks.resize(size_t(num_rows) * p.num_candidate_blocks);
      plan.candidates_out = result.candidate_blocks.data();
    }
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::exec
