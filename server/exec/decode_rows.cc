#include "server/exec/decode_rows.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/exec/bulk_copy.h"
#include "server/exec/candidate_overlap.h"
#include "server/exec/row_shard.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::exec {
namespace {

using kernels::CacheFormat;
using kernels::ElemType;

int64_t InputElemBytes(ElemType type) { return type == ElemType::kBF16 ? 2 : 4; }

int64_t NanosBetween(std::chrono::steady_clock::time_point a,
                     std::chrono::steady_clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// Host staging for one step's uploads (the rank's HostArena, page-locked on a GPU backend
// unless pinned staging is off). Upload copies the bytes into the arena first, so the device
// copy is a true asynchronous DMA that never waits for the stream; with a plain arena it
// copies straight from the source, as before. Reserve hands out arena space; when a step has
// used it all (only a step with more keys than one staging chunk) it waits for the copies
// queued so far, which read the arena, before reusing it. Every step starts with an empty
// arena: the previous one ended in a Synchronize.
class Staging {
 public:
  explicit Staging(Rank& rank) : be_(rank.backend()), arena_(rank.host_arena()) { arena_.used = 0; }

  absl::StatusOr<uint8_t*> Reserve(size_t bytes) {
    const size_t aligned = (bytes + 63) / 64 * 64;
    if (aligned > arena_.capacity) {
      return absl::InternalError(absl::StrCat("host staging of ", bytes, " bytes exceeds the ",
                                              arena_.capacity, "-byte arena"));
    }
    if (arena_.used + aligned > arena_.capacity) {
      if (absl::Status s = be_.Synchronize(); !s.ok()) return s;
      arena_.used = 0;
    }
    uint8_t* p = arena_.base + arena_.used;
    arena_.used += aligned;
    return p;
  }

  absl::Status Upload(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (!arena_.pinned) return be_.CopyToDevice(dst, src, bytes);
    return UploadStaged(dst, src, bytes);
  }
  // From device memory (QInput::on_device): a copy on the device.
  absl::Status UploadFromDevice(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return be_.CopyDeviceToDevice(dst, src, bytes);
  }
  // Upload from memory that is page-locked already (StepInput::host_memory_page_locked):
  // a direct DMA, no staging copy.
  absl::Status UploadPageLocked(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return be_.CopyToDevice(dst, src, bytes);
  }

 private:
  absl::Status UploadStaged(void* dst, const void* src, size_t bytes) {
    absl::StatusOr<uint8_t*> host = Reserve(bytes);
    if (!host.ok()) return host.status();
    BulkCopy(*host, src, bytes);
    return be_.CopyToDevice(dst, *host, bytes);
  }

  kernels::Backend& be_;
  HostArena& arena_;
};

// The step's device-to-host answer copies. To pageable memory (a gRPC response) the driver
// bounces a copy through its own buffer in pieces, each waiting for the stream; so the copy
// lands in the rank's page-locked readback space (one DMA) and Finish, after the step's
// Synchronize, moves it on with a memcpy (each rank its own rows, in parallel). Page-locked
// destinations, and ranks without readback space, copy directly. Deferred answers (the
// executor's own vectors: StepPlan::defer_topk / defer_candidates) stay in the readback space
// and Finish hands them to the executor (Rank::last_readback).
class Readback {
 public:
  enum class Answer { kTopK, kCandidates };

  Readback(Rank& rank, const StepPlan& plan)
      : rank_(rank), be_(rank.backend()), space_(rank.readback()), plan_(plan) {
    space_.used = 0;
    rank_.last_readback.clear();
  }

  // `bytes` of answer `which` from element `elem_offset` on.
  absl::Status Copy(Answer which, int64_t elem_offset, const int32_t* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    const bool candidates = which == Answer::kCandidates;
    const bool defer = candidates ? plan_.defer_candidates : plan_.defer_topk;
    int32_t* dst = defer ? nullptr : (candidates ? plan_.candidates_out : plan_.topk_out);
    const size_t aligned = (bytes + 63) / 64 * 64;
    const bool fits = space_.pinned && space_.used + aligned <= space_.capacity;
    const bool page_locked = candidates ? plan_.candidates_page_locked : plan_.topk_page_locked;
    if (!defer && (page_locked || !fits)) {
      return be_.CopyToHost(dst + elem_offset, src, bytes);
    }
    if (!fits) {  // the executor defers only where every rank has room for every row
      return absl::InternalError("a deferred answer does not fit the readback space");
    }
    uint8_t* landing = space_.base + space_.used;
    space_.used += aligned;
    if (absl::Status s = be_.CopyToHost(landing, src, bytes); !s.ok()) return s;
    pending_.push_back({candidates, elem_offset, dst == nullptr ? nullptr : dst + elem_offset,
                        reinterpret_cast<const int32_t*>(landing), bytes});
    return absl::OkStatus();
  }

  // After the Synchronize that completed the copies.
  void Finish() {
    for (const Pending& p : pending_) {
      if (p.dst != nullptr) {
        BulkCopy(p.dst, p.landing, p.bytes);
      } else {
        rank_.last_readback.push_back(
            {p.candidates, p.elem_offset, p.landing, p.bytes / sizeof(int32_t)});
      }
    }
    pending_.clear();
  }

 private:
  struct Pending {
    bool candidates;
    int64_t elem_offset;
    int32_t* dst;  // null: deferred
    const int32_t* landing;
    size_t bytes;
  };
  Rank& rank_;
  kernels::Backend& be_;
  HostArena& space_;
  const StepPlan& plan_;
  std::vector<Pending> pending_;
};

// The step's new keys (a few per sequence), gathered into one staging chunk per run of writes
// of one key type: three copies and one InsertKeys call per chunk instead of per sequence.
absl::Status InsertStepKeys(Rank& rank, Staging& staging, int32_t pool,
                            const std::vector<KeyWrite>& writes, bool hadamard) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  const int32_t chunk = rank.sizes().key_chunk;
  size_t wi = 0;       // the write being gathered
  int32_t offset = 0;  // its keys gathered so far
  while (wi < writes.size()) {
    const ElemType type = writes[wi].type;
    const int64_t vb = KeyValueBytes(type, D);
    const int64_t sb = KeyScaleBytes(type, D);
    int32_t total = 0;
    for (size_t j = wi, o = offset; j < writes.size() && writes[j].type == type && total < chunk;
         ++j, o = 0) {
      total += std::min<int32_t>(writes[j].count - static_cast<int32_t>(o), chunk - total);
    }
    if (total == 0) {  // only empty writes left in this run
      ++wi;
      offset = 0;
      continue;
    }
    // One reservation for the three, so they never straddle an arena reuse.
    const size_t slot_bytes = size_t(total) * sizeof(int64_t);
    const size_t value_bytes = (size_t(total) * vb + 7) / 8 * 8;
    absl::StatusOr<uint8_t*> slots =
        staging.Reserve(slot_bytes + value_bytes + size_t(total) * std::max<int64_t>(sb, 1));
    if (!slots.ok()) return slots.status();
    uint8_t* const keys = *slots + slot_bytes;
    uint8_t* const scales = keys + value_bytes;
    for (int32_t filled = 0; filled < total;) {
      const KeyWrite& w = writes[wi];
      const int32_t c = std::min(w.count - offset, total - filled);
      std::memcpy(keys + size_t(filled) * vb, static_cast<const uint8_t*>(w.keys) + offset * vb,
                  size_t(c) * vb);
      if (sb > 0) {
        std::memcpy(scales + size_t(filled) * sb,
                    static_cast<const uint8_t*>(w.scales) + offset * sb, size_t(c) * sb);
      }
      std::memcpy(*slots + size_t(filled) * sizeof(int64_t), w.slots + offset,
                  size_t(c) * sizeof(int64_t));
      filled += c;
      offset += c;
      if (offset == w.count) {
        ++wi;
        offset = 0;
      }
    }
    DI_RETURN_IF_ERROR(be.CopyToDevice(b.keys, keys, size_t(total) * vb));
    if (sb > 0) DI_RETURN_IF_ERROR(be.CopyToDevice(b.key_scales, scales, size_t(total) * sb));
    DI_RETURN_IF_ERROR(be.CopyToDevice(b.slots, *slots, size_t(total) * sizeof(int64_t)));
    kernels::KeyInsertArgs args;
    args.cache = b.caches[pool];
    args.num_keys = total;
    args.key_type = type;
    args.keys = b.keys;
    args.key_scales = sb > 0 ? b.key_scales : nullptr;
    args.slots = b.slots;
    args.hadamard = hadamard;
    DI_RETURN_IF_ERROR(be.InsertKeys(args));
  }
  return absl::OkStatus();
}

// The step's rows between the rank's candidate buffer and the per-sequence candidate store
// (rows plan.store_rows): a source scatters its new candidates into the store, a consumer
// gathers its source's from it.
absl::Status CopyStoreRows(Rank& rank, Staging& staging, const StepPlan& plan, bool into_store) {
  RankBuffers& b = rank.buffers();
  DI_RETURN_IF_ERROR(
      staging.Upload(b.store_index, plan.store_rows.data(), plan.num_rows * sizeof(int32_t)));
  kernels::CopyRowsArgs copy;
  copy.num_rows = plan.num_rows;
  copy.row_elems = rank.sizes().num_candidate_blocks;
  if (into_store) {
    copy.dst = b.candidate_store;
    copy.dst_index = b.store_index;
    copy.src = b.candidates;
  } else {
    copy.dst = b.candidates;
    copy.src = b.candidate_store;
    copy.src_index = b.store_index;
  }
  return rank.backend().CopyRows(copy);
}

// Runs the step's kernel section through the rank's step graphs (seed: warm): eager at a
// shape's first sighting, captured at its second, replayed after. A capture that fails (an
// unsupported call while capturing) leaves the stream as it was: the shape stays eager and
// the section runs eagerly now.
absl::Status RunKernelSection(Rank& rank, const StepShape& shape,
                              const std::function<absl::Status()>& launch) {
  kernels::Backend& be = rank.backend();
  if (!rank.graphs_enabled()) return launch();
  StepGraphs::Entry* entry = nullptr;
  switch (rank.graphs().Next(shape, &entry)) {
    case StepGraphs::Use::kEager:
      return launch();
    case StepGraphs::Use::kReplay: {
      absl::StatusOr<bool> replayed = be.Replay(entry->key);
      if (!replayed.ok()) return replayed.status();
      if (*replayed) {
        rank.last_graph_replayed = true;
        return absl::OkStatus();
      }
      entry->captured = false;  // the backend lost it: run eager, capture again next time
      entry->sightings = 1;
      return launch();
    }
    case StepGraphs::Use::kCapture:
      break;
  }
  absl::Status status = be.BeginCapture();
  if (status.ok()) {
    status = launch();
    if (status.ok()) {
      status = be.EndCapture(entry->key);
    } else {
      be.AbortCapture();
    }
  }
  if (!status.ok()) {
    entry->failed = true;
    spdlog::warn("rank {}: step graph capture failed ({}); this shape runs eagerly", rank.index(),
                 status.ToString());
    return launch();
  }
  entry->captured = true;
  rank.last_graph_captured = true;
  absl::StatusOr<bool> replayed = be.Replay(entry->key);
  if (!replayed.ok()) return replayed.status();
  if (!*replayed) return absl::InternalError("a step graph just captured was not found");
  return absl::OkStatus();
}

// Sets the entries of `edits` in `pool`'s resident table (page_table_mirror.h), in stream order
// before whatever the rank issues next: one scatter per chunk of the rank's edit buffers.
absl::Status ApplyTableEdits(Rank& rank, Staging& staging, int32_t pool, const TableEdits& edits) {
  RankBuffers& b = rank.buffers();
  const size_t chunk = static_cast<size_t>(rank.sizes().table_edit_chunk);
  for (size_t done = 0; done < edits.size(); done += chunk) {
    const int32_t n = static_cast<int32_t>(std::min(chunk, edits.size() - done));
    // The previous chunk's scatter read these buffers; the uploads follow it on the stream.
    DI_RETURN_IF_ERROR(
        staging.Upload(b.edit_index, edits.index.data() + done, size_t(n) * sizeof(int32_t)));
    DI_RETURN_IF_ERROR(
        staging.Upload(b.edit_pages, edits.page.data() + done, size_t(n) * sizeof(int32_t)));
    kernels::CopyRowsArgs scatter;
    scatter.num_rows = n;
    scatter.row_elems = 1;
    scatter.dst = b.page_tables[pool];
    scatter.dst_index = b.edit_index;
    scatter.src = b.edit_pages;
    DI_RETURN_IF_ERROR(rank.backend().CopyRows(scatter));
  }
  return absl::OkStatus();
}

// Device-resident q (QInput::on_device): the rank's copies of its rows are checked on its
// device; the flag word lands in the rank's host word with the step's last copies and is
// read after its Synchronize (DeviceInputsStatus).
constexpr uint32_t kQBit = 1, kQScalesBit = 2, kWeightsBit = 4;
absl::Status CheckDeviceInputs(Rank& rank, kernels::ValueCheck q, kernels::ValueCheck q_scales,
                               kernels::ValueCheck weights) {
  kernels::ValueCheckArgs args;
  for (const kernels::ValueCheck& c : {q, q_scales, weights}) {
    if (c.data != nullptr && c.count > 0) args.checks[args.num_checks++] = c;
  }
  args.flags = rank.buffers().value_flags;
  return rank.backend().CheckValues(args);
}

absl::Status DeviceInputsStatus(uint32_t flags) {
  if (flags == 0) return absl::OkStatus();
  const char* field = (flags & kQBit)         ? "q.data"
                      : (flags & kQScalesBit) ? "q_scales.data"
                                              : "weights.data";
  return absl::InvalidArgumentError(absl::StrCat(
      field,
      ": NaN or Inf (FP8: a NaN code; UE8M0: 0xFF) in the device buffer, found by the check "
      "on the device; the step committed nothing"));
}

// Uploads the step's inputs, inserts its keys, prepares q and scores rows [range) into the
// rank's topk (and candidates at a source). Everything before the collectives. The uploads,
// key inserts, the consumer's candidate gather and its inline expansion run eagerly (their
// sizes vary, or they use the side stream); rope_quant_q and the scoring call are the kernel
// section, which replays a captured graph when the step's shape was seen before.
absl::Status ScoreRows(Rank& rank, Staging& staging, const StepPlan& plan, RowRange range) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const kernels::CacheView& cache = b.caches[plan.pool];
  const CacheFormat format = cache.geometry.format;
  const int32_t H = s.num_heads;
  const int32_t D = s.head_dim;
  const int32_t n = range.end - range.start;
  rank.last_graph_captured = false;
  rank.last_graph_replayed = false;
  const auto entered = std::chrono::steady_clock::now();

  DI_RETURN_IF_ERROR(
      staging.Upload(b.row_request, plan.row_request.data(), plan.num_rows * sizeof(int32_t)));
  DI_RETURN_IF_ERROR(
      staging.Upload(b.row_length, plan.row_length.data(), plan.num_rows * sizeof(int32_t)));
  // Every rank keeps every pool's resident table in step, whatever rows it scores: first the
  // edits recorded since a job last applied them, then this step's own.
  if (plan.pending_edits != nullptr) {
    DI_RETURN_IF_ERROR(ApplyTableEdits(rank, staging, plan.pool, *plan.pending_edits));
  }
  DI_RETURN_IF_ERROR(ApplyTableEdits(rank, staging, plan.pool, plan.table_edits));
  DI_RETURN_IF_ERROR(staging.Upload(b.request_slot, plan.request_slot.data(),
                                    plan.num_requests * sizeof(int32_t)));
  // Keys go into every replica whatever rows this rank scores; pages they share with another
  // sequence (or that a cut-back rewrites) are copied first.
  DI_RETURN_IF_ERROR(CopyPagesOnRank(rank, plan.pool, plan.page_copies));
  DI_RETURN_IF_ERROR(InsertStepKeys(rank, staging, plan.pool, plan.key_writes, plan.hadamard));

  // q of this rank's rows only, at the rows' own offsets in the staging buffers.
  const int64_t hd = int64_t{H} * D;
  const int64_t code_bytes = format == CacheFormat::kFp8 ? hd : hd / 2;
  const int64_t scale_bytes = hd / 32;
  uint8_t* q_codes = b.q_codes + range.start * code_bytes;
  uint8_t* q_scales = b.q_scales + range.start * scale_bytes;
  float* weights = b.weights + int64_t{range.start} * H;
  const QInput& q = plan.q;
  const bool unquantized = q.type == ElemType::kF32 || q.type == ElemType::kBF16;
  kernels::QPrepArgs prep;
  if (unquantized) {
    const int64_t eb = InputElemBytes(q.type);
    uint8_t* q_raw = b.q_raw + range.start * hd * eb;
    float* w_raw = b.weights_raw + int64_t{range.start} * H;
    auto upload = [&](void* dst, const void* src, size_t bytes) {
      return q.on_device ? staging.UploadFromDevice(dst, src, bytes)
                         : staging.Upload(dst, src, bytes);
    };
    DI_RETURN_IF_ERROR(
        upload(q_raw, static_cast<const uint8_t*>(q.q) + range.start * hd * eb, n * hd * eb));
    DI_RETURN_IF_ERROR(
        upload(w_raw, q.weights + int64_t{range.start} * H, int64_t{n} * H * sizeof(float)));
    if (q.on_device) {
      DI_RETURN_IF_ERROR(CheckDeviceInputs(rank, {q_raw, int64_t{n} * hd, q.type, kQBit}, {},
                                           {w_raw, int64_t{n} * H, ElemType::kF32, kWeightsBit}));
    }
    prep.num_rows = n;
    prep.num_heads = H;
    prep.head_dim = D;
    prep.q_type = q.type;
    prep.q = q_raw;
    prep.weights_raw = w_raw;
    if (q.positions != nullptr) {
      DI_RETURN_IF_ERROR(staging.Upload(b.positions + range.start, q.positions + range.start,
                                        n * sizeof(int64_t)));
      prep.positions = b.positions + range.start;
    }
    prep.rope = plan.rope;
    prep.rope.inv_freq = b.inv_freq;
    prep.hadamard = plan.hadamard;
    prep.format = format;
    prep.q_codes = q_codes;
    prep.q_scales = q_scales;
    prep.weights_out = weights;
  } else {
    // From a page-locked client region, straight to the device; else through the staging.
    // From the client's device buffer, device to device.
    auto upload = [&](void* dst, const void* src, size_t bytes) {
      if (q.on_device) return staging.UploadFromDevice(dst, src, bytes);
      return plan.q_page_locked ? staging.UploadPageLocked(dst, src, bytes)
                                : staging.Upload(dst, src, bytes);
    };
    DI_RETURN_IF_ERROR(upload(q_codes, static_cast<const uint8_t*>(q.q) + range.start * code_bytes,
                              n * code_bytes));
    if (format == CacheFormat::kFp4) {
      DI_RETURN_IF_ERROR(upload(q_scales, q.scales + range.start * scale_bytes, n * scale_bytes));
    }
    DI_RETURN_IF_ERROR(
        upload(weights, q.weights + int64_t{range.start} * H, int64_t{n} * H * sizeof(float)));
    if (q.on_device) {
      const bool fp4 = format == CacheFormat::kFp4;
      // FP4 codes are all finite; their UE8M0 scales are not.
      DI_RETURN_IF_ERROR(CheckDeviceInputs(
          rank, {fp4 ? nullptr : q_codes, fp4 ? 0 : int64_t{n} * hd, q.type, kQBit},
          {fp4 ? q_scales : nullptr, fp4 ? int64_t{n} * scale_bytes : 0, ElemType::kUE8M0,
           kQScalesBit},
          {weights, int64_t{n} * H, ElemType::kF32, kWeightsBit}));
    }
  }

  const int32_t NB = s.num_candidate_blocks;
  const bool consumer = plan.role == config::LayerRole::kCandidateConsumer;
  if (consumer) {
    const bool need_candidates = plan.masked_consumer || !plan.reuse_expansion;
    if (need_candidates) {
      // The source's candidates for these rows, from the per-sequence store.
      DI_RETURN_IF_ERROR(CopyStoreRows(rank, staging, plan, /*into_store=*/false));
    }
    // Fork and join (the side stream): outside any graph.
    if (!plan.masked_consumer && !plan.reuse_expansion) {
      DI_RETURN_IF_ERROR(BuildExpansionInline(rank, plan.num_rows));
    }
  }

  const bool graphs = rank.graphs_enabled();
  kernels::RowBatch rows;
  rows.num_rows = n;
  rows.row_request = b.row_request + range.start;
  rows.row_length = b.row_length + range.start;
  rows.page_table = b.page_tables[plan.pool];
  rows.page_table_stride = s.max_pages_per_sequence;
  rows.request_slot = b.request_slot;
  rows.num_requests = plan.num_requests;
  // With graphs the bound is bucketed, for eager runs too, so a replay launches exactly what
  // an eager run of the same step would.
  rows.max_row_length =
      graphs ? BucketRowLength(plan.max_row_length, s.max_context) : plan.max_row_length;
  // The most rows one request has in this rank's slice (rows of a request are adjacent).
  for (int32_t r = range.start, run = 0; r < range.end; ++r) {
    run = r > range.start && plan.row_request[r] == plan.row_request[r - 1] ? run + 1 : 1;
    rows.rows_per_request = std::max(rows.rows_per_request, run);
  }
  kernels::QView qv;
  qv.codes = q_codes;
  qv.scales = format == CacheFormat::kFp4 ? q_scales : nullptr;
  qv.weights = weights;
  qv.num_heads = H;
  int32_t* topk_out = b.topk + int64_t{range.start} * s.topk;
  const bool source = plan.role == config::LayerRole::kCandidateSource;

  auto launch = [&]() -> absl::Status {
    if (unquantized) DI_RETURN_IF_ERROR(be.RopeQuantQ(prep));
    switch (plan.role) {
      case config::LayerRole::kDense:
      case config::LayerRole::kCandidateSource: {
        kernels::DenseArgs args;
        args.cache = cache;
        args.rows = rows;
        args.q = qv;
        args.topk = s.topk;
        args.topk_out = topk_out;
        if (source) {
          args.candidates_out = b.candidates + int64_t{range.start} * NB;
          args.num_candidate_blocks = NB;
          args.candidate_block_size = s.candidate_block_size;
        }
        return be.DenseTopK(args);
      }
      case config::LayerRole::kCandidateConsumer: {
        if (plan.masked_consumer) {
          kernels::MaskedArgs args;
          args.cache = cache;
          args.rows = rows;
          args.q = qv;
          args.candidates = b.candidates + int64_t{range.start} * NB;
          args.num_candidate_blocks = NB;
          args.candidate_block_size = s.candidate_block_size;
          args.topk = s.topk;
          args.topk_out = topk_out;
          return be.MaskedTopK(args);
        }
        const int32_t max_positions = NB * s.candidate_block_size;
        kernels::SparseArgs args;
        args.cache = cache;
        args.rows = rows;
        args.q = qv;
        args.positions = b.expansion_positions + int64_t{range.start} * max_positions;
        args.counts = b.expansion_counts + range.start;
        args.max_positions = max_positions;
        args.topk = s.topk;
        args.topk_out = topk_out;
        return be.SparseTopK(args);
      }
    }
    return absl::InternalError("unknown layer role");
  };
  const auto launched = std::chrono::steady_clock::now();
  rank.last_phases.uploads_ns = NanosBetween(entered, launched);
  // The kernel section's issue time (eager launches or a graph replay).
  auto timed = [&](absl::Status status) {
    rank.last_phases.launch_ns = NanosBetween(launched, std::chrono::steady_clock::now());
    return status;
  };
  if (!graphs) return timed(launch());
  StepShape shape;
  shape.pool = plan.pool;
  shape.role = static_cast<int32_t>(plan.role);
  shape.masked = consumer && plan.masked_consumer;
  shape.candidates = source;
  shape.range_start = range.start;
  shape.rows = n;
  shape.requests = plan.num_requests;
  shape.q_type = static_cast<int32_t>(q.type);
  shape.positions = unquantized && q.positions != nullptr;
  shape.hadamard = unquantized && plan.hadamard;
  shape.max_row_length = rows.max_row_length;
  shape.rows_per_request = rows.rows_per_request;
  return timed(RunKernelSection(rank, shape, launch));
}

}  // namespace

absl::Status CopyPagesOnRank(Rank& rank, int32_t pool,
                             std::span<const std::pair<int32_t, int32_t>> copies) {
  const kernels::CacheView& cache = rank.buffers().caches[pool];
  const int64_t bytes = cache.geometry.page_bytes();
  for (const auto& [src, dst] : copies) {
    DI_RETURN_IF_ERROR(rank.backend().CopyDeviceToDevice(cache.base + dst * bytes,
                                                         cache.base + src * bytes, bytes));
  }
  return absl::OkStatus();
}

int64_t KeyValueBytes(ElemType type, int32_t head_dim) {
  switch (type) {
    case ElemType::kF32:
      return int64_t{head_dim} * 4;
    case ElemType::kBF16:
      return int64_t{head_dim} * 2;
    case ElemType::kFp8E4M3:
      return head_dim;
    case ElemType::kFp4E2M1:
      return head_dim / 2;
    default:
      return 0;
  }
}

int64_t KeyScaleBytes(ElemType type, int32_t head_dim) {
  if (type == ElemType::kFp8E4M3) return 4;
  if (type == ElemType::kFp4E2M1) return head_dim / 32;
  return 0;
}

absl::Status InsertKeysOnRank(Rank& rank, int32_t pool, const std::vector<KeyWrite>& writes,
                              bool hadamard) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  const int32_t chunk = rank.sizes().key_chunk;
  for (const KeyWrite& w : writes) {
    const int64_t vb = KeyValueBytes(w.type, D);
    const int64_t sb = KeyScaleBytes(w.type, D);
    for (int32_t done = 0; done < w.count; done += chunk) {
      const int32_t c = std::min(chunk, w.count - done);
      DI_RETURN_IF_ERROR(
          be.CopyToDevice(b.keys, static_cast<const uint8_t*>(w.keys) + done * vb, c * vb));
      if (sb > 0) {
        DI_RETURN_IF_ERROR(be.CopyToDevice(
            b.key_scales, static_cast<const uint8_t*>(w.scales) + done * sb, c * sb));
      }
      DI_RETURN_IF_ERROR(be.CopyToDevice(b.slots, w.slots + done, c * sizeof(int64_t)));
      kernels::KeyInsertArgs args;
      args.cache = b.caches[pool];
      args.num_keys = c;
      args.key_type = w.type;
      args.keys = b.keys;
      args.key_scales = sb > 0 ? b.key_scales : nullptr;
      args.slots = b.slots;
      args.hadamard = hadamard;
      DI_RETURN_IF_ERROR(be.InsertKeys(args));
    }
  }
  return absl::OkStatus();
}

absl::Status BroadcastInsertKeysOnRank(Rank& rank, int32_t pool,
                                       const std::vector<KeyWrite>& writes, bool hadamard,
                                       Collective& collective) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const int32_t D = rank.sizes().head_dim;
  const int32_t chunk = rank.sizes().key_chunk;
  const bool root = rank.index() == 0;
  for (const KeyWrite& w : writes) {
    const int64_t vb = KeyValueBytes(w.type, D);
    const int64_t sb = KeyScaleBytes(w.type, D);
    for (int32_t done = 0; done < w.count; done += chunk) {
      const int32_t c = std::min(chunk, w.count - done);
      absl::Status st;
      if (root) {
        st = be.CopyToDevice(b.keys, static_cast<const uint8_t*>(w.keys) + done * vb, c * vb);
        if (st.ok() && sb > 0) {
          st = be.CopyToDevice(b.key_scales, static_cast<const uint8_t*>(w.scales) + done * sb,
                               c * sb);
        }
      }
      // The slots are small (8 bytes a key): every rank copies them itself.
      if (st.ok()) st = be.CopyToDevice(b.slots, w.slots + done, c * sizeof(int64_t));
      // The previous chunk's insert has read the staging buffers the broadcast overwrites.
      if (st.ok()) st = be.Synchronize();
      DI_RETURN_IF_ERROR(collective.Agree(rank.index(), st));
      DI_RETURN_IF_ERROR(collective.Broadcast(rank.index(), b.keys, size_t(c) * vb));
      if (sb > 0) {
        DI_RETURN_IF_ERROR(collective.Broadcast(rank.index(), b.key_scales, size_t(c) * sb));
      }
      kernels::KeyInsertArgs args;
      args.cache = b.caches[pool];
      args.num_keys = c;
      args.key_type = w.type;
      args.keys = b.keys;
      args.key_scales = sb > 0 ? b.key_scales : nullptr;
      args.slots = b.slots;
      args.hadamard = hadamard;
      DI_RETURN_IF_ERROR(be.InsertKeys(args));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeRowsOnRank(Rank& rank, const StepPlan& plan, Collective& collective) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const int32_t world = collective.world_size();
  // A step that fails the gate runs unsharded on every rank: each rank computes every row, so
  // every rank holds the whole answer (and, at a source, every candidate for its store)
  // without a collective.
  const auto step_start = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                t)
        .count();
  };
  const RowRange range = plan.RowsOf(rank.index());
  rank.last_phases = Rank::Phases{};
  absl::Status status = JoinExpansion(rank);
  const bool source = plan.role == config::LayerRole::kCandidateSource;
  const int32_t NB = s.num_candidate_blocks;

  const bool injected = plan.fault_rank == rank.index();
  if (injected && plan.fault == StepPlan::Fault::kError && status.ok()) {
    status = absl::InternalError(absl::StrCat("injected fault on rank ", rank.index()));
  }
  // The step's host staging; the previous step's copies from it have finished (every step
  // ends in a Synchronize, a failed one too).
  Staging staging(rank);
  Readback readback(rank, plan);
  if (status.ok() && injected && plan.fault == StepPlan::Fault::kPause && plan.fault_pause) {
    plan.fault_pause();
  }
  if (status.ok()) status = ScoreRows(rank, staging, plan, range);
  rank.last_collective_ns = 0;
  rank.last_collectives = 0;
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
    ++rank.last_collectives;
    if (status.ok() && injected && plan.fault == StepPlan::Fault::kHang) {
      return absl::InternalError(
          absl::StrCat("injected hang: rank ", rank.index(), " skipped the all-gather"));
    }
    // The rank's own work, so the time below is the collectives' alone. A device error found
    // here comes after the others agreed: abort, so that none waits in the all-gather for
    // this rank (the collective then stays aborted, as for any device fault).
    if (status.ok()) {
      status = injected && plan.fault == StepPlan::Fault::kDevice
                   ? absl::InternalError(absl::StrCat("injected device fault on rank ",
                                                      rank.index(), " after the agreement"))
                   : be.Synchronize();
      if (!status.ok()) collective.Abort(status);
    }
    const auto gather_start = std::chrono::steady_clock::now();
    rank.last_score_ns = since(step_start);
    const int32_t rows_per_rank = plan.num_rows / world;
    if (status.ok() && gather_topk) {
      status = collective.AllGather(rank.index(), b.topk + int64_t{range.start} * s.topk, b.topk,
                                    size_t(rows_per_rank) * s.topk * sizeof(int32_t));
      ++rank.last_collectives;
    }
    if (status.ok() && source) {
      status = collective.AllGather(rank.index(), b.candidates + int64_t{range.start} * NB,
                                    b.candidates, size_t(rows_per_rank) * NB * sizeof(int32_t));
      ++rank.last_collectives;
    }
    rank.last_collective_ns = since(gather_start);
  }
  if (status.ok() && injected &&
      (plan.fault == StepPlan::Fault::kHang || plan.fault == StepPlan::Fault::kDevice)) {
    // No collective in this step to stay away from: the injected fault is a plain failure.
    status = absl::InternalError(
        absl::StrCat("injected fault: rank ", rank.index(), " (a step with no collective)"));
  }
  if (!status.ok()) {
    // Copies queued before the failure may still read the host staging the next step reuses.
    (void)be.Synchronize();
    return status;
  }

  const auto copies_start = std::chrono::steady_clock::now();
  if (source) {
    // Into fresh store rows; the executor retires the old ones only on commit, so a failed
    // step leaves the sequence's published candidates intact.
    DI_RETURN_IF_ERROR(CopyStoreRows(rank, staging, plan, /*into_store=*/true));
    if (plan.fork_expansion) DI_RETURN_IF_ERROR(ForkExpansion(rank, plan.num_rows));
  }
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
      DI_RETURN_IF_ERROR(be.CopyDeviceToDevice(plan.topk_device_out, b.topk, topk_bytes));
    } else {
      DI_RETURN_IF_ERROR(readback.Copy(Readback::Answer::kTopK, 0, b.topk, topk_bytes));
    }
    if (plan.candidates_device_out != nullptr) {
      DI_RETURN_IF_ERROR(
          be.CopyDeviceToDevice(plan.candidates_device_out, b.candidates, cand_bytes));
    } else if (plan.candidates_out != nullptr || plan.defer_candidates) {
      DI_RETURN_IF_ERROR(readback.Copy(Readback::Answer::kCandidates, 0, b.candidates, cand_bytes));
    }
  }
  if (plan.q.on_device) {
    DI_RETURN_IF_ERROR(be.CopyToHost(rank.value_flags_host(), b.value_flags, sizeof(uint32_t)));
  }
  const auto wait_start = std::chrono::steady_clock::now();
  rank.last_phases.copies_ns = NanosBetween(copies_start, wait_start);
  absl::Status done = be.Synchronize();
  rank.last_phases.wait_ns = since(wait_start);
  if (done.ok() && plan.q.on_device) done = DeviceInputsStatus(*rank.value_flags_host());
  if (done.ok()) readback.Finish();
  if (!plan.sharded || direct) rank.last_score_ns = since(step_start);
  return done;
}

#undef DI_RETURN_IF_ERROR

}  // namespace decode_indexer::exec
