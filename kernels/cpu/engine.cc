#include "kernels/cpu/engine.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/quant.h"
#include "kernels/cpu/dot_tile.h"

namespace decode_indexer::kernels::cpu::internal {
namespace {

// Code value tables, built once from the shared quantizers.
struct DecodeTables {
  std::array<double, 256> e4m3;
  std::array<double, 16> e2m1;
  DecodeTables() {
    for (int c = 0; c < 256; ++c) e4m3[c] = DecodeE4M3(static_cast<uint8_t>(c));
    for (int c = 0; c < 16; ++c) e2m1[c] = DecodeE2M1(static_cast<uint8_t>(c));
  }
};

const DecodeTables& Tables() {
  static const DecodeTables tables;
  return tables;
}

template <typename T>
void GrowTo(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// FP8 scoring of one chunk for every loaded row. The dot of two e4m3 code values is a sum of
// products with at most 8 significant bits each, all within [2^-18, 2^18], so it is exact in
// double whatever the order; accumulating kKeyChunk keys side by side lets the compiler
// vectorize without reassociating anything.
void ScoreChunkFp8(const LoadedQ& q, int32_t count, ThreadScratch& s) {
  const int32_t d_dim = q.head_dim;
  const double* tile = s.key_tile.data();
  double dots[2 * kKeyChunk];
  for (int32_t r = 0; r < q.num_rows; ++r) {
    double logit[kKeyChunk] = {};
    for (int32_t h0 = 0; h0 < q.num_heads; h0 += 2) {
      const int32_t nh = std::min(2, q.num_heads - h0);
      const int64_t rh0 = static_cast<int64_t>(r) * q.num_heads + h0;
      DotTile(q.values.data() + rh0 * d_dim, d_dim, nh, tile, 0, d_dim, dots);
      // Heads ascending: the double sum is rounded in this order everywhere.
      for (int32_t i = 0; i < nh; ++i) {
        const double w = q.weights[rh0 + i];
        const double* dot = dots + i * kKeyChunk;
        for (int32_t t = 0; t < kKeyChunk; ++t) logit[t] += w * (dot[t] > 0.0 ? dot[t] : 0.0);
      }
    }
    float* out = s.chunk_out.data() + static_cast<int64_t>(r) * kKeyChunk;
    for (int32_t t = 0; t < count; ++t) {
      out[t] = static_cast<float>(logit[t] * s.key_scales[t]);
    }
  }
}

// FP4 scoring: per 32-dim group the exact dot (e2m1 products are multiples of 1/4) times
// q_scale * k_scale, summed over groups ascending, relu, times w, summed over heads.
void ScoreChunkFp4(const LoadedQ& q, int32_t count, ThreadScratch& s) {
  const int32_t d_dim = q.head_dim;
  const int32_t groups = d_dim / 32;
  const double* tile = s.key_tile.data();
  double dots[2 * kKeyChunk];
  for (int32_t r = 0; r < q.num_rows; ++r) {
    double logit[kKeyChunk] = {};
    for (int32_t h0 = 0; h0 < q.num_heads; h0 += 2) {
      const int32_t nh = std::min(2, q.num_heads - h0);
      const int64_t rh0 = static_cast<int64_t>(r) * q.num_heads + h0;
      double head[2][kKeyChunk] = {};
      for (int32_t g = 0; g < groups; ++g) {
        DotTile(q.values.data() + rh0 * d_dim, d_dim, nh, tile, g * 32, g * 32 + 32, dots);
        const double* ks = s.key_scales.data() + static_cast<int64_t>(g) * kKeyChunk;
        for (int32_t i = 0; i < nh; ++i) {
          const double qs = q.scales[(rh0 + i) * groups + g];
          const double* dot = dots + i * kKeyChunk;
          for (int32_t t = 0; t < kKeyChunk; ++t) head[i][t] += dot[t] * (qs * ks[t]);
        }
      }
      for (int32_t i = 0; i < nh; ++i) {
        const double w = q.weights[rh0 + i];
        for (int32_t t = 0; t < kKeyChunk; ++t) {
          logit[t] += w * (head[i][t] > 0.0 ? head[i][t] : 0.0);
        }
      }
    }
    float* out = s.chunk_out.data() + static_cast<int64_t>(r) * kKeyChunk;
    for (int32_t t = 0; t < count; ++t) out[t] = static_cast<float>(logit[t]);
  }
}

absl::Status CheckCommon(const CacheView& cache, const QView& q, int32_t topk) {
  const CacheGeometry& g = cache.geometry;
  if (cache.base == nullptr || cache.num_pages <= 0) {
    return absl::InvalidArgumentError("cache: no pages");
  }
  if (g.page_size <= 0 || g.head_dim <= 0 ||
      (g.format == CacheFormat::kFp4 && g.head_dim % 32 != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache geometry: page_size ", g.page_size, ", head_dim ", g.head_dim));
  }
  if (q.num_heads <= 0 || q.codes == nullptr || q.weights == nullptr ||
      (g.format == CacheFormat::kFp4 && q.scales == nullptr)) {
    return absl::InvalidArgumentError("q: missing codes, scales or weights");
  }
  if (topk <= 0) return absl::InvalidArgumentError(absl::StrCat("topk ", topk));
  return absl::OkStatus();
}

// Every page a request's positions [0, length) use must exist.
absl::Status CheckPages(const CacheView& cache, const RowBatch& rows, int32_t request,
                        int64_t length) {
  const int64_t pages = CeilDiv(length, cache.geometry.page_size);
  if (pages > rows.page_table_stride) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request, ": length ", length, " exceeds its page table"));
  }
  const int32_t* table = rows.page_table + PageRowOffset(rows, request);
  for (int64_t i = 0; i < pages; ++i) {
    if (table[i] < 0 || table[i] >= cache.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_table[", request, "][", i, "] = ", table[i], " is not a page"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRow(const RowBatch& rows, int32_t r) {
  const int32_t b = rows.row_request[r];
  if (b < 0 || b >= rows.num_requests) {
    return absl::InvalidArgumentError(absl::StrCat("row ", r, ": request ", b));
  }
  if (rows.row_length[r] < 1) {
    return absl::InvalidArgumentError(absl::StrCat("row ", r, ": length ", rows.row_length[r]));
  }
  return absl::OkStatus();
}

// Candidate blocks of a row: each -1 or a block below ceil(length / block_size), the valid
// ones strictly ascending, every -1 after them.
absl::Status CheckCandidates(const int32_t* candidates, int32_t num_blocks, int32_t block_size,
                             int32_t length, int32_t row) {
  const int64_t blocks = CeilDiv(length, block_size);
  int64_t prev = -1;
  bool padding = false;
  for (int32_t i = 0; i < num_blocks; ++i) {
    const int32_t c = candidates[i];
    if (c == -1) {
      padding = true;
      continue;
    }
    if (padding || c < 0 || c >= blocks || c <= prev) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", row, ": candidate block ", i, " = ", c, " is invalid"));
    }
    prev = c;
  }
  return absl::OkStatus();
}

}  // namespace

// ---- The scoring core ----------------------------------------------------------------------

void LoadQ(const QView& q, CacheFormat format, int32_t head_dim, int32_t row_begin,
           int32_t num_rows, LoadedQ& out) {
  const DecodeTables& tables = Tables();
  out.format = format;
  out.num_rows = num_rows;
  out.num_heads = q.num_heads;
  out.head_dim = head_dim;
  const int64_t vectors = static_cast<int64_t>(num_rows) * q.num_heads;
  GrowTo(out.values, vectors * head_dim);
  GrowTo(out.weights, vectors);
  const int64_t first = static_cast<int64_t>(row_begin) * q.num_heads;
  for (int64_t v = 0; v < vectors; ++v) out.weights[v] = q.weights[first + v];
  if (format == CacheFormat::kFp8) {
    const uint8_t* codes = q.codes + first * head_dim;
    for (int64_t i = 0; i < vectors * head_dim; ++i) out.values[i] = tables.e4m3[codes[i]];
    return;
  }
  const int32_t groups = head_dim / 32;
  GrowTo(out.scales, vectors * groups);
  const uint8_t* packed = q.codes + first * (head_dim / 2);
  for (int64_t i = 0; i < vectors * head_dim; i += 2) {
    const uint8_t byte = packed[i / 2];  // element 2j low nibble, 2j + 1 high nibble
    out.values[i] = tables.e2m1[byte & 0xF];
    out.values[i + 1] = tables.e2m1[byte >> 4];
  }
  const uint8_t* scales = q.scales + first * groups;
  for (int64_t i = 0; i < vectors * groups; ++i) out.scales[i] = DecodeUE8M0(scales[i]);
}

void ScoreChunk(const CacheView& cache, const LoadedQ& q, const int64_t* slots, int32_t count,
                ThreadScratch& s) {
  const DecodeTables& tables = Tables();
  const CacheGeometry& g = cache.geometry;
  const int32_t d_dim = g.head_dim;
  GrowTo(s.key_tile, static_cast<size_t>(d_dim) * kKeyChunk);
  GrowTo(s.key_scales, static_cast<size_t>(std::max(1, d_dim / 32)) * kKeyChunk);
  GrowTo(s.chunk_out, static_cast<size_t>(kMaxGroupRows) * kKeyChunk);
  double* tile = s.key_tile.data();
  const int64_t page_bytes = g.page_bytes();
  const int64_t scale_base = static_cast<int64_t>(g.page_size) * g.value_bytes();
  for (int32_t t = 0; t < kKeyChunk; ++t) {
    if (t >= count) {
      // Padding entries score zeros and are never read back.
      for (int32_t d = 0; d < d_dim; ++d) tile[static_cast<int64_t>(d) * kKeyChunk + t] = 0.0;
      if (g.format == CacheFormat::kFp8) {
        s.key_scales[t] = 0.0;
      } else {
        for (int32_t gi = 0; gi < d_dim / 32; ++gi) s.key_scales[gi * kKeyChunk + t] = 0.0;
      }
      continue;
    }
    const int64_t page = slots[t] / g.page_size;
    const int64_t slot = slots[t] % g.page_size;
    const uint8_t* page_base = cache.base + page * page_bytes;
    const uint8_t* values = page_base + slot * g.value_bytes();
    const uint8_t* scale = page_base + scale_base + slot * g.scale_bytes();
    if (g.format == CacheFormat::kFp8) {
      for (int32_t d = 0; d < d_dim; ++d) {
        tile[static_cast<int64_t>(d) * kKeyChunk + t] = tables.e4m3[values[d]];
      }
      float ks;
      std::memcpy(&ks, scale, sizeof(ks));
      s.key_scales[t] = ks;
    } else {
      for (int32_t d = 0; d < d_dim; d += 2) {
        const uint8_t byte = values[d / 2];
        tile[static_cast<int64_t>(d) * kKeyChunk + t] = tables.e2m1[byte & 0xF];
        tile[static_cast<int64_t>(d + 1) * kKeyChunk + t] = tables.e2m1[byte >> 4];
      }
      for (int32_t gi = 0; gi < d_dim / 32; ++gi) {
        s.key_scales[gi * kKeyChunk + t] = DecodeUE8M0(scale[gi]);
      }
    }
  }
  if (g.format == CacheFormat::kFp8) {
    ScoreChunkFp8(q, count, s);
  } else {
    ScoreChunkFp4(q, count, s);
  }
}

void ScoreSpan(const CacheView& cache, const RowBatch& rows, int32_t request, const LoadedQ& q,
               const int32_t* lengths, int64_t begin, int64_t end, float* out, int64_t stride,
               ThreadScratch& s) {
  const int32_t page_size = cache.geometry.page_size;
  const int32_t* table = rows.page_table + PageRowOffset(rows, request);
  GrowTo(s.slots, kKeyChunk);
  for (int64_t p0 = begin; p0 < end; p0 += kKeyChunk) {
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(kKeyChunk, end - p0));
    for (int32_t t = 0; t < count; ++t) {
      const int64_t p = p0 + t;
      s.slots[t] = static_cast<int64_t>(table[p / page_size]) * page_size + p % page_size;
    }
    ScoreChunk(cache, q, s.slots.data(), count, s);
    for (int32_t r = 0; r < q.num_rows; ++r) {
      const int64_t n = std::min<int64_t>(count, lengths[r] - p0);
      const float* src = s.chunk_out.data() + static_cast<int64_t>(r) * kKeyChunk;
      for (int64_t t = 0; t < n; ++t) out[r * stride + p0 + t] = src[t];
    }
  }
}

void ScorePositions(const CacheView& cache, const RowBatch& rows, int32_t request, const LoadedQ& q,
                    const int32_t* positions, int32_t count, float* out, ThreadScratch& s) {
  const int32_t page_size = cache.geometry.page_size;
  const int32_t* table = rows.page_table + PageRowOffset(rows, request);
  GrowTo(s.slots, kKeyChunk);
  for (int32_t i0 = 0; i0 < count; i0 += kKeyChunk) {
    const int32_t n = std::min(kKeyChunk, count - i0);
    for (int32_t t = 0; t < n; ++t) {
      const int64_t p = positions[i0 + t];
      s.slots[t] = static_cast<int64_t>(table[p / page_size]) * page_size + p % page_size;
    }
    ScoreChunk(cache, q, s.slots.data(), n, s);
    for (int32_t t = 0; t < n; ++t) out[i0 + t] = s.chunk_out[t];
  }
}

// ---- Selection -----------------------------------------------------------------------------

// A logit's rank in the selection: NaN ranks as -inf, below every number. A NaN logit is
// reachable (finite q and weights whose scores overflow to inf - inf; q rewritten in a
// client's shared memory after the edge checked it) and compares false both ways: left as it
// is, nth_element's order is unspecified and the selection below fills fewer than k places,
// leaving the rest of `out` as it was: the rank's top-k buffer, i.e. an earlier step's
// answer, maybe another client's, sent as this step's; and candidate blocks that are not
// ascending block ids (which a snapshot restore refuses).
inline float SelectionRank(float v) { return v != v ? -std::numeric_limits<float>::infinity() : v; }

void TopKAtWith(const float* logits, const int32_t* positions, int32_t count, int32_t k,
                int32_t* out, std::vector<float>& work) {
  if (k <= 0) return;
  if (count <= k) {
    for (int32_t i = 0; i < count; ++i) out[i] = positions ? positions[i] : i;
    for (int32_t i = std::max(count, 0); i < k; ++i) out[i] = -1;
    return;
  }
  // The K-th largest value; everything above it is in, and the first (by position) of the
  // entries equal to it fill the remaining places. Scanning in position order yields the
  // answer already ascending. Ranked by SelectionRank: a strict weak order, so exactly k.
  GrowTo(work, count);
  std::transform(logits, logits + count, work.begin(), SelectionRank);
  std::nth_element(work.begin(), work.begin() + (k - 1), work.begin() + count,
                   std::greater<float>());
  const float kth = work[k - 1];
  int32_t above = 0;
  for (int32_t i = 0; i < count; ++i) above += SelectionRank(logits[i]) > kth ? 1 : 0;
  int32_t ties_left = k - above;
  int32_t n = 0;
  for (int32_t i = 0; i < count && n < k; ++i) {
    const float v = SelectionRank(logits[i]);
    if (v > kth || (v == kth && ties_left > 0)) {
      if (!(v > kth)) --ties_left;
      out[n++] = positions ? positions[i] : i;
    }
  }
  for (; n < k; ++n) out[n] = -1;  // never reached with a strict weak order; never stale
}

void TopKWith(const float* logits, int32_t length, int32_t k, int32_t* out,
              std::vector<float>& work) {
  TopKAtWith(logits, nullptr, length, k, out, work);
}

void SelectCandidateBlocksWith(const float* logits, int32_t length, int32_t num_blocks,
                               int32_t block_size, int32_t* out, std::vector<float>& scores,
                               std::vector<float>& work) {
  if (length <= 0 || block_size <= 0) {
    for (int32_t i = 0; i < num_blocks; ++i) out[i] = -1;
    return;
  }
  const int32_t blocks = static_cast<int32_t>(CeilDiv(length, block_size));
  GrowTo(scores, blocks);
  for (int32_t j = 0; j < blocks; ++j) {
    const int32_t p_end = std::min(length, (j + 1) * block_size);
    float m = logits[j * block_size];
    for (int32_t p = j * block_size + 1; p < p_end; ++p) m = std::max(m, logits[p]);
    scores[j] = m;
  }
  // The newest block always wins: the row's own key lives there.
  scores[blocks - 1] = std::numeric_limits<float>::infinity();
  const int32_t keep = std::min(num_blocks, blocks);
  TopKWith(scores.data(), blocks, keep, out, work);
  for (int32_t i = keep; i < num_blocks; ++i) out[i] = -1;
}

int32_t ExpandRow(const int32_t* candidates, int32_t num_blocks, int32_t block_size, int32_t length,
                  int32_t* positions) {
  int32_t n = 0;
  for (int32_t i = 0; i < num_blocks; ++i) {
    const int32_t c = candidates[i];
    if (c < 0) continue;
    const int64_t p_end = std::min<int64_t>(length, static_cast<int64_t>(c + 1) * block_size);
    for (int64_t p = static_cast<int64_t>(c) * block_size; p < p_end; ++p) {
      positions[n++] = static_cast<int32_t>(p);
    }
  }
  return n;
}

// ---- Engine --------------------------------------------------------------------------------

Engine::Engine(ThreadPool* pool) : pool_(pool), scratch_(pool ? pool->size() : 1) {}

void Engine::Reserve(const BackendLimits& limits) {
  const int64_t context = std::max<int64_t>(limits.max_context, 1);
  const int64_t positions = std::max<int64_t>(limits.max_candidate_positions, 1);
  // A group never holds more rows than a step has.
  const int64_t group_rows = std::clamp<int64_t>(limits.max_rows, 1, kMaxGroupRows);
  for (ThreadScratch& s : scratch_) {
    LoadedQ& q = s.q;
    const int64_t vectors = static_cast<int64_t>(kMaxGroupRows) * limits.num_heads;
    GrowTo(q.values, vectors * limits.head_dim);
    GrowTo(q.scales, vectors * (limits.head_dim / 32));
    GrowTo(q.weights, vectors);
    GrowTo(s.key_tile, static_cast<size_t>(limits.head_dim) * kKeyChunk);
    GrowTo(s.key_scales, static_cast<size_t>(std::max(1, limits.head_dim / 32)) * kKeyChunk);
    GrowTo(s.chunk_out, static_cast<size_t>(kMaxGroupRows) * kKeyChunk);
    GrowTo(s.slots, kKeyChunk);
    GrowTo(s.logits, group_rows * context);
    GrowTo(s.select, std::max(context, positions));
    GrowTo(s.gathered, positions);
    GrowTo(s.positions, positions);
    GrowTo(s.block_scores, context);
  }
}

void Engine::ParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (pool_ == nullptr) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
  } else {
    pool_->ParallelFor(n, fn);
  }
}

absl::Status Engine::BuildGroups(const CacheView& cache, const RowBatch& rows) {
  groups_.clear();
  int64_t max_length = 0;
  for (int32_t r = 0; r < rows.num_rows; ++r) {
    if (absl::Status st = CheckRow(rows, r); !st.ok()) return st;
    const int32_t b = rows.row_request[r];
    if (absl::Status st = CheckPages(cache, rows, b, rows.row_length[r]); !st.ok()) return st;
    max_length = std::max<int64_t>(max_length, rows.row_length[r]);
    RowGroup* last = groups_.empty() ? nullptr : &groups_.back();
    if (last && last->request == b && last->end == r && last->end - last->begin < kMaxGroupRows) {
      last->end = r + 1;
      last->max_length = std::max(last->max_length, rows.row_length[r]);
    } else {
      groups_.push_back({r, r + 1, b, rows.row_length[r]});
    }
  }
  logits_stride_ = max_length;
  int64_t group_rows = 0;
  for (const RowGroup& g : groups_) group_rows = std::max<int64_t>(group_rows, g.end - g.begin);
  // Grows only past the limits given at start-up (then once).
  for (ThreadScratch& s : scratch_) GrowTo(s.logits, group_rows * max_length);
  return absl::OkStatus();
}

void Engine::GroupLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                         const RowGroup& group, ThreadScratch& owner, bool split_positions) {
  const int32_t n = group.end - group.begin;
  LoadQ(q, cache.geometry.format, cache.geometry.head_dim, group.begin, n, owner.q);
  const int32_t* lengths = rows.row_length + group.begin;
  float* out = owner.logits.data();
  if (!split_positions) {
    ScoreSpan(cache, rows, group.request, owner.q, lengths, 0, group.max_length, out,
              logits_stride_, owner);
    return;
  }
  // Spans of whole chunks; each thread writes its own positions of the shared buffer.
  constexpr int64_t kSpan = 64 * kKeyChunk;
  const int64_t spans = CeilDiv(group.max_length, kSpan);
  ParallelFor(spans, [&](int64_t i, int t) {
    const int64_t begin = i * kSpan;
    const int64_t end = std::min<int64_t>(group.max_length, begin + kSpan);
    ScoreSpan(cache, rows, group.request, owner.q, lengths, begin, end, out, logits_stride_,
              scratch_[t]);
  });
}

template <typename RowFn>
void Engine::ForGroups(const CacheView& cache, const RowBatch& rows, const QView& q, RowFn row_fn) {
  const int threads = num_threads();
  const int64_t num_groups = static_cast<int64_t>(groups_.size());
  if (threads == 1 || num_groups >= threads) {
    ParallelFor(num_groups, [&](int64_t gi, int t) {
      const RowGroup& group = groups_[gi];
      ThreadScratch& s = scratch_[t];
      GroupLogits(cache, rows, q, group, s, /*split_positions=*/false);
      for (int32_t r = group.begin; r < group.end; ++r) {
        row_fn(r, s.logits.data() + (r - group.begin) * logits_stride_, s);
      }
    });
    return;
  }
  // Fewer groups than threads (long rows, few requests): split each group's positions.
  for (const RowGroup& group : groups_) {
    ThreadScratch& owner = scratch_[0];
    GroupLogits(cache, rows, q, group, owner, /*split_positions=*/true);
    ParallelFor(group.end - group.begin, [&](int64_t i, int t) {
      row_fn(group.begin + static_cast<int32_t>(i), owner.logits.data() + i * logits_stride_,
             scratch_[t]);
    });
  }
}

absl::Status Engine::DenseTopK(const DenseArgs& args) {
  if (absl::Status st = CheckCommon(args.cache, args.q, args.topk); !st.ok()) return st;
  if (args.topk_out == nullptr) return absl::InvalidArgumentError("topk_out is null");
  if (args.candidates_out != nullptr &&
      (args.num_candidate_blocks <= 0 || args.candidate_block_size <= 0)) {
    return absl::InvalidArgumentError("candidates_out needs a block count and size");
  }
  if (absl::Status st = BuildGroups(args.cache, args.rows); !st.ok()) return st;
  ForGroups(args.cache, args.rows, args.q, [&](int32_t r, const float* logits, ThreadScratch& s) {
    const int32_t length = args.rows.row_length[r];
    TopKWith(logits, length, args.topk, args.topk_out + static_cast<int64_t>(r) * args.topk,
             s.select);
    if (args.candidates_out != nullptr) {
      SelectCandidateBlocksWith(
          logits, length, args.num_candidate_blocks, args.candidate_block_size,
          args.candidates_out + static_cast<int64_t>(r) * args.num_candidate_blocks, s.block_scores,
          s.select);
    }
  });
  return absl::OkStatus();
}

absl::Status Engine::MaskedTopK(const MaskedArgs& args) {
  if (absl::Status st = CheckCommon(args.cache, args.q, args.topk); !st.ok()) return st;
  if (args.topk_out == nullptr || args.candidates == nullptr || args.num_candidate_blocks <= 0 ||
      args.candidate_block_size <= 0) {
    return absl::InvalidArgumentError("masked: missing output or candidates");
  }
  if (absl::Status st = BuildGroups(args.cache, args.rows); !st.ok()) return st;
  for (int32_t r = 0; r < args.rows.num_rows; ++r) {
    if (absl::Status st = CheckCandidates(
            args.candidates + static_cast<int64_t>(r) * args.num_candidate_blocks,
            args.num_candidate_blocks, args.candidate_block_size, args.rows.row_length[r], r);
        !st.ok()) {
      return st;
    }
  }
  const int64_t max_positions =
      static_cast<int64_t>(args.num_candidate_blocks) * args.candidate_block_size;
  for (ThreadScratch& s : scratch_) {
    GrowTo(s.positions, max_positions);
    GrowTo(s.gathered, max_positions);
  }
  ForGroups(args.cache, args.rows, args.q, [&](int32_t r, const float* logits, ThreadScratch& s) {
    // Positions outside the candidate blocks do not exist for the row: gather the candidate
    // positions' logits and select among them, exactly as the sparse consumer does.
    const int32_t count =
        ExpandRow(args.candidates + static_cast<int64_t>(r) * args.num_candidate_blocks,
                  args.num_candidate_blocks, args.candidate_block_size, args.rows.row_length[r],
                  s.positions.data());
    for (int32_t i = 0; i < count; ++i) s.gathered[i] = logits[s.positions[i]];
    TopKAtWith(s.gathered.data(), s.positions.data(), count, args.topk,
               args.topk_out + static_cast<int64_t>(r) * args.topk, s.select);
  });
  return absl::OkStatus();
}

absl::Status Engine::SparseTopK(const SparseArgs& args) {
  if (absl::Status st = CheckCommon(args.cache, args.q, args.topk); !st.ok()) return st;
  if (args.topk_out == nullptr || args.positions == nullptr || args.counts == nullptr ||
      args.max_positions < 0) {
    return absl::InvalidArgumentError("sparse: missing output or positions");
  }
  const RowBatch& rows = args.rows;
  for (int32_t r = 0; r < rows.num_rows; ++r) {
    if (absl::Status st = CheckRow(rows, r); !st.ok()) return st;
    const int32_t length = rows.row_length[r];
    if (absl::Status st = CheckPages(args.cache, rows, rows.row_request[r], length); !st.ok()) {
      return st;
    }
    const int32_t count = args.counts[r];
    if (count < 0 || count > args.max_positions) {
      return absl::InvalidArgumentError(absl::StrCat("row ", r, ": position count ", count));
    }
    const int32_t* pos = args.positions + static_cast<int64_t>(r) * args.max_positions;
    for (int32_t i = 0; i < count; ++i) {
      // Ascending order is what makes "ties to the lower position" an index order.
      if (pos[i] < 0 || pos[i] >= length || (i > 0 && pos[i] <= pos[i - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("row ", r, ": position ", i, " = ", pos[i], " is invalid"));
      }
    }
  }
  for (ThreadScratch& s : scratch_) GrowTo(s.gathered, args.max_positions);
  ParallelFor(rows.num_rows, [&](int64_t r, int t) {
    ThreadScratch& s = scratch_[t];
    LoadQ(args.q, args.cache.geometry.format, args.cache.geometry.head_dim, static_cast<int32_t>(r),
          1, s.q);
    const int32_t* pos = args.positions + r * args.max_positions;
    ScorePositions(args.cache, rows, rows.row_request[r], s.q, pos, args.counts[r],
                   s.gathered.data(), s);
    TopKAtWith(s.gathered.data(), pos, args.counts[r], args.topk, args.topk_out + r * args.topk,
               s.select);
  });
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels::cpu::internal
