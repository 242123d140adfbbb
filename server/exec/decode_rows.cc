#include "server/exec/decode_rows.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "server/exec/candidate_overlap.h"
#include "server/exec/row_shard.h"

namespace decode_indexer::exec {
namespace {

using kernels::CacheFormat;
using kernels::ElemType;

#define DI_RETURN_IF_ERROR(expr)                       \
  do {                                                 \
    if (absl::Status _s = (expr); !_s.ok()) return _s; \
  } while (0)

int64_t InputElemBytes(ElemType type) { return type == ElemType::kBF16 ? 2 : 4; }

// Uploads the step's inputs, inserts its keys, prepares q and scores rows [range) into the
// rank's topk (and candidates at a source). Everything before the collectives.
absl::Status ScoreRows(Rank& rank, const StepPlan& plan, RowRange range) {
  kernels::Backend& be = rank.backend();
  RankBuffers& b = rank.buffers();
  const RankSizes& s = rank.sizes();
  const kernels::CacheView& cache = b.caches[plan.pool];
  const CacheFormat format = cache.geometry.format;
  const int32_t H = s.num_heads;
  const int32_t D = s.head_dim;
  const int32_t n = range.end - range.start;

  DI_RETURN_IF_ERROR(
      be.CopyToDevice(b.row_request, plan.row_request.data(), plan.num_rows * sizeof(int32_t)));
  DI_RETURN_IF_ERROR(
      be.CopyToDevice(b.row_length, plan.row_length.data(), plan.num_rows * sizeof(int32_t)));
  DI_RETURN_IF_ERROR(be.CopyToDevice(b.page_table, plan.page_table.data(),
                                     plan.page_table.size() * sizeof(int32_t)));
  // Keys go into every replica whatever rows this rank scores.
  DI_RETURN_IF_ERROR(InsertKeysOnRank(rank, plan.pool, plan.key_writes, plan.hadamard));

  // q of this rank's rows only, at the rows' own offsets in the staging buffers.
  const int64_t hd = int64_t{H} * D;
  const int64_t code_bytes = format == CacheFormat::kFp8 ? hd : hd / 2;
  const int64_t scale_bytes = hd / 32;
  uint8_t* q_codes = b.q_codes + range.start * code_bytes;
  uint8_t* q_scales = b.q_scales + range.start * scale_bytes;
  float* weights = b.weights + int64_t{range.start} * H;
  const QInput& q = plan.q;
  if (q.type == ElemType::kF32 || q.type == ElemType::kBF16) {
    const int64_t eb = InputElemBytes(q.type);
    uint8_t* q_raw = b.q_raw + range.start * hd * eb;
    float* w_raw = b.weights_raw + int64_t{range.start} * H;
    DI_RETURN_IF_ERROR(be.CopyToDevice(
        q_raw, static_cast<const uint8_t*>(q.q) + range.start * hd * eb, n * hd * eb));
    DI_RETURN_IF_ERROR(be.CopyToDevice(w_raw, q.weights + int64_t{range.start} * H,
                                       int64_t{n} * H * sizeof(float)));
    kernels::QPrepArgs prep;
    prep.num_rows = n;
    prep.num_heads = H;
    prep.head_dim = D;
    prep.q_type = q.type;
    prep.q = q_raw;
    prep.weights_raw = w_raw;
    if (q.positions != nullptr) {
      DI_RETURN_IF_ERROR(be.CopyToDevice(b.positions + range.start, q.positions + range.start,
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
    DI_RETURN_IF_ERROR(be.RopeQuantQ(prep));
  } else {
    DI_RETURN_IF_ERROR(be.CopyToDevice(
        q_codes, static_cast<const uint8_t*>(q.q) + range.start * code_bytes, n * code_bytes));
    if (format == CacheFormat::kFp4) {
      DI_RETURN_IF_ERROR(
          be.CopyToDevice(q_scales, q.scales + range.start * scale_bytes, n * scale_bytes));
    }
    DI_RETURN_IF_ERROR(be.CopyToDevice(weights, q.weights + int64_t{range.start} * H,
                                       int64_t{n} * H * sizeof(float)));
  }

  kernels::RowBatch rows;
  rows.num_rows = n;
  rows.row_request = b.row_request + range.start;
  rows.row_length = b.row_length + range.start;
  rows.page_table = b.page_table;
  rows.page_table_stride = plan.page_table_stride;
  rows.num_requests = plan.num_requests;
  rows.max_row_length = plan.max_row_length;
  kernels::QView qv;
  qv.codes = q_codes;
  qv.scales = format == CacheFormat::kFp4 ? q_scales : nullptr;
  qv.weights = weights;
  qv.num_heads = H;
  const int32_t NB = s.num_candidate_blocks;
  int32_t* topk_out = b.topk + int64_t{range.start} * s.topk;

  switch (plan.role) {
    case config::LayerRole::kDense:
    case config::LayerRole::kCandidateSource: {
      kernels::DenseArgs args;
      args.cache = cache;
      args.rows = rows;
      args.q = qv;
      args.topk = s.topk;
      args.topk_out = topk_out;
      if (plan.role == config::LayerRole::kCandidateSource) {
        args.candidates_out = b.candidates + int64_t{range.start} * NB;
        args.num_candidate_blocks = NB;
        args.candidate_block_size = s.candidate_block_size;
      }
      return be.DenseTopK(args);
    }
    case config::LayerRole::kCandidateConsumer: {
      const bool need_candidates = plan.masked_consumer || !plan.reuse_expansion;
      if (need_candidates) {
        // The source's candidates for these rows, from the per-sequence store.
        DI_RETURN_IF_ERROR(be.CopyToDevice(b.store_index, plan.store_rows.data(),
                                           plan.num_rows * sizeof(int32_t)));
        kernels::CopyRowsArgs gather;
        gather.num_rows = plan.num_rows;
        gather.row_elems = NB;
        gather.dst = b.candidates;
        gather.src = b.candidate_store;
        gather.src_index = b.store_index;
        DI_RETURN_IF_ERROR(be.CopyRows(gather));
      }
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
      if (!plan.reuse_expansion) DI_RETURN_IF_ERROR(BuildExpansionInline(rank, plan.num_rows));
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
}

}  // namespace

void StepPlan::Reset() {
  row_request.clear();
  row_length.clear();
  page_table.clear();
  key_writes.clear();
  store_rows.clear();
  std::vector<int32_t> keep_request = std::move(row_request);
  std::vector<int32_t> keep_length = std::move(row_length);
  std::vector<int32_t> keep_table = std::move(page_table);
  std::vector<KeyWrite> keep_writes = std::move(key_writes);
  std::vector<int32_t> keep_store = std::move(store_rows);
  *this = StepPlan{};
  row_request = std::move(keep_request);
  row_length = std::move(keep_length);
  page_table = std::move(keep_table);
  key_writes = std::move(keep_writes);
  store_rows = std::move(keep_store);
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
  RowRange range{0, plan.num_rows};
  absl::Status status = JoinExpansion(rank);
  if (plan.sharded) {
    std::optional<RowRange> bounds = RowShardBounds(plan.num_rows, plan.num_requests, world,
                                                    rank.index(), plan.row_shard_min_requests);
    // Cannot happen (the executor asked the same gate), but a rank must still reach the
    // collectives below, so this is a status rather than an early return.
    if (bounds) {
      range = *bounds;
    } else if (status.ok()) {
      status = absl::InternalError("a sharded plan failed the row_shard_bounds gate");
    }
  }
  const bool source = plan.role == config::LayerRole::kCandidateSource;
  const int32_t NB = s.num_candidate_blocks;

  const bool injected = plan.fault_rank == rank.index();
  if (injected && plan.fault == StepPlan::Fault::kError && status.ok()) {
    status = absl::InternalError(absl::StrCat("injected fault on rank ", rank.index()));
  }
  if (status.ok()) status = ScoreRows(rank, plan, range);
  rank.last_collective_ns = 0;
  if (plan.sharded) {
    // The rank's own work first, so the time below is the collectives' alone.
    if (status.ok()) status = be.Synchronize();
    const auto gather_start = std::chrono::steady_clock::now();
    rank.last_score_ns = since(step_start);
    // Every rank reaches the agreement whatever happened above, and all skip the all-gathers
    // if any failed: a device collective would otherwise wait for the failed rank.
    status = collective.Agree(rank.index(), status);
    if (status.ok() && injected && plan.fault == StepPlan::Fault::kHang) {
      return absl::InternalError(
          absl::StrCat("injected hang: rank ", rank.index(), " skipped the all-gather"));
    }
    const int32_t rows_per_rank = plan.num_rows / world;
    if (status.ok()) {
      status = collective.AllGather(rank.index(), b.topk + int64_t{range.start} * s.topk, b.topk,
                                    size_t(rows_per_rank) * s.topk * sizeof(int32_t));
    }
    if (status.ok() && source) {
      status = collective.AllGather(rank.index(), b.candidates + int64_t{range.start} * NB,
                                    b.candidates, size_t(rows_per_rank) * NB * sizeof(int32_t));
    }
    rank.last_collective_ns = since(gather_start);
  }
  if (!status.ok()) return status;

  if (source) {
    // Into fresh store rows; the executor retires the old ones only on commit, so a failed
    // step leaves the sequence's published candidates intact.
    DI_RETURN_IF_ERROR(
        be.CopyToDevice(b.store_index, plan.store_rows.data(), plan.num_rows * sizeof(int32_t)));
    kernels::CopyRowsArgs scatter;
    scatter.num_rows = plan.num_rows;
    scatter.row_elems = NB;
    scatter.dst = b.candidate_store;
    scatter.dst_index = b.store_index;
    scatter.src = b.candidates;
    DI_RETURN_IF_ERROR(be.CopyRows(scatter));
    if (plan.fork_expansion) DI_RETURN_IF_ERROR(ForkExpansion(rank, plan.num_rows));
  }
  if (rank.index() == plan.answer_rank) {
    DI_RETURN_IF_ERROR(
        be.CopyToHost(plan.topk_out, b.topk, size_t(plan.num_rows) * s.topk * sizeof(int32_t)));
    if (plan.candidates_out != nullptr) {
      DI_RETURN_IF_ERROR(be.CopyToHost(plan.candidates_out, b.candidates,
                                       size_t(plan.num_rows) * NB * sizeof(int32_t)));
    }
  }
  absl::Status done = be.Synchronize();
  if (!plan.sharded) rank.last_score_ns = since(step_start);
  return done;
}

#undef DI_RETURN_IF_ERROR

}  // namespace decode_indexer::exec
