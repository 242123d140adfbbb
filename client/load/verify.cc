#include "client/load/verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#ifdef DI_LOAD_HAVE_VERIFY
#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/types.h"
#endif

namespace decode_indexer::load {

bool TopKWithinTolerance(const std::vector<float>& logits, const std::vector<int32_t>& positions,
                         const int32_t* answer, int32_t topk, double tol) {
  const size_t n = positions.size();
  // The answer's form: ascending distinct positions, then -1 to the end.
  std::set<int32_t> chosen;
  bool padding = false;
  for (int32_t i = 0; i < topk; ++i) {
    if (answer[i] < 0) {
      if (answer[i] != -1) return false;
      padding = true;
      continue;
    }
    if (padding || (i > 0 && answer[i] <= answer[i - 1])) return false;
    chosen.insert(answer[i]);
  }
  if (chosen.size() != std::min<size_t>(n, size_t(topk))) return false;
  if (n <= size_t(topk)) {
    return std::equal(chosen.begin(), chosen.end(), positions.begin());
  }
  std::vector<float> sorted = logits;
  std::nth_element(sorted.begin(), sorted.begin() + (topk - 1), sorted.end(),
                   std::greater<float>());
  const double kth = sorted[topk - 1];
  const double slack = tol * std::max(1e-6, std::fabs(kth));
  for (size_t i = 0; i < n; ++i) {
    const bool in = chosen.contains(positions[i]);
    if (in && logits[i] < kth - slack) return false;
    if (!in && logits[i] > kth + slack) return false;
  }
  // Positions outside the scored set can never be chosen.
  for (int32_t p : chosen) {
    if (!std::binary_search(positions.begin(), positions.end(), p)) return false;
  }
  return true;
}

#ifndef DI_LOAD_HAVE_VERIFY

absl::StatusOr<std::unique_ptr<Verifier>> Verifier::Create(const ServerModel&, int32_t, double) {
  return absl::UnimplementedError("--verify: this build has no CPU reference (di_kernels)");
}

#else

namespace {

namespace k = decode_indexer::kernels;

absl::StatusOr<k::ElemType> KeyType(const v1::Tensor& keys) {
  switch (keys.dtype()) {
    case v1::DTYPE_FP32:
      return k::ElemType::kF32;
    case v1::DTYPE_BF16:
      return k::ElemType::kBF16;
    case v1::DTYPE_FP8_E4M3:
      return k::ElemType::kFp8E4M3;
    case v1::DTYPE_FP4_E2M1:
      return k::ElemType::kFp4E2M1;
    default:
      return absl::InvalidArgumentError("verify: unsupported key dtype");
  }
}

// One sequence's copy of one cache: pages 0..n-1 in order (identity page table).
struct MirrorCache {
  std::vector<uint8_t> storage;
  k::CacheView view;
  std::vector<int32_t> page_table;
  int64_t length = 0;

  void Reserve(int64_t entries) {
    const int64_t page = view.geometry.page_size;
    const int64_t need = (entries + page - 1) / page;
    if (need <= view.num_pages) return;
    const int64_t pages = std::max<int64_t>(need, 2 * view.num_pages);
    storage.resize(size_t(pages) * view.geometry.page_bytes());
    view.base = storage.data();
    view.num_pages = pages;
    page_table.resize(pages);
    for (int64_t p = 0; p < pages; ++p) page_table[p] = static_cast<int32_t>(p);
  }
};

std::string Preview(const int32_t* row, int32_t n) {
  std::vector<int32_t> head(row, row + std::min(n, 8));
  return absl::StrCat("[", absl::StrJoin(head, ","), n > 8 ? ",..." : "", "]");
}

class CpuVerifier final : public Verifier {
 public:
  CpuVerifier(const ServerModel& model, int32_t max_rows, double tolerance)
      : tolerance_(tolerance), model_(model), max_rows_(max_rows) {}

  void Track(uint64_t sequence_id) override { tracked_[sequence_id]; }
  bool Tracks(uint64_t sequence_id) const override { return tracked_.contains(sequence_id); }

  absl::Status AppendKeys(uint64_t sequence_id, int32_t cache_layer, const v1::Tensor& keys,
                          const v1::Tensor& key_scales) override {
    auto it = tracked_.find(sequence_id);
    if (it == tracked_.end()) return absl::OkStatus();
    MirrorCache& cache = CacheOf(it->second, cache_layer);
    auto type = KeyType(keys);
    if (!type.ok()) return type.status();
    const int32_t n = keys.shape_size() > 0 ? static_cast<int32_t>(keys.shape(0)) : 0;
    if (n == 0) return absl::OkStatus();
    cache.Reserve(cache.length + n);
    std::vector<int64_t> slots(n);
    for (int32_t i = 0; i < n; ++i) slots[i] = cache.length + i;
    k::KeyInsertArgs args;
    args.cache = cache.view;
    args.num_keys = n;
    args.key_type = *type;
    args.keys = keys.data().data();
    args.key_scales = key_scales.data().empty() ? nullptr : key_scales.data().data();
    args.slots = slots.data();
    args.hadamard = model_.info.hadamard();
    if (absl::Status s = k::cpu::InsertKeys(args); !s.ok()) return s;
    cache.length += n;
    return absl::OkStatus();
  }

  void BeginTokenStep() override { candidates_.clear(); }

  absl::Status CheckStep(const v1::DecodeStepRequest& request,
                         const v1::DecodeStepResponse& response, bool score,
                         VerifyCounts* counts) override {
    const LayerStep* layer = nullptr;
    for (const LayerStep& l : model_.plan) {
      if (l.layer == request.layer()) layer = &l;
    }
    if (layer == nullptr) return absl::InternalError("verify: step of an unknown layer");
    int32_t row0 = 0;
    for (int i = 0; i < request.sequences_size(); ++i) {
      const v1::SequenceStep& seq = request.sequences(i);
      const int32_t n = seq.num_rows() > 0 ? seq.num_rows() : seq.row_lengths_size();
      auto it = tracked_.find(seq.sequence_id());
      if (it != tracked_.end()) {
        if (layer->owns_cache && seq.has_new_keys()) {
          absl::Status s = AppendKeys(seq.sequence_id(), layer->cache_layer, seq.new_keys(),
                                      seq.new_key_scales());
          if (!s.ok()) return s;
        }
        if (score) {
          absl::Status s =
              CheckRows(*layer, it->first, it->second, request, response, row0, n, counts);
          if (!s.ok()) return s;
        }
      }
      row0 += n;
    }
    return absl::OkStatus();
  }

 private:
  struct Tracked {
    std::map<int32_t, MirrorCache> caches;  // cache layer -> mirror
  };

  MirrorCache& CacheOf(Tracked& t, int32_t cache_layer) {
    auto [it, inserted] = t.caches.try_emplace(cache_layer);
    if (inserted) {
      MirrorCache& c = it->second;
      c.view.geometry.format = FormatOf(cache_layer) == v1::CACHE_FORMAT_FP4 ? k::CacheFormat::kFp4
                                                                             : k::CacheFormat::kFp8;
      c.view.geometry.head_dim = model_.head_dim;
      c.view.geometry.page_size = model_.page_size;
      c.Reserve(model_.page_size);
    }
    return it->second;
  }

  v1::CacheFormat FormatOf(int32_t layer) const {
    for (const LayerStep& l : model_.plan) {
      if (l.layer == layer) return l.format;
    }
    return v1::CACHE_FORMAT_FP8;
  }

  void Mismatch(VerifyCounts* counts, std::string what) {
    if (counts->first_mismatches.size() < 4) counts->first_mismatches.push_back(std::move(what));
  }

  absl::Status CheckRows(const LayerStep& layer, uint64_t sequence_id, Tracked& tracked,
                         const v1::DecodeStepRequest& request,
                         const v1::DecodeStepResponse& response, int32_t row0, int32_t n,
                         VerifyCounts* counts) {
    if (n > max_rows_) return absl::InternalError("verify: more rows than configured");
    MirrorCache& cache = CacheOf(tracked, layer.cache_layer);
    const int64_t length = cache.length;
    const int32_t h = model_.num_heads, d = model_.head_dim, topk = model_.topk;
    const bool fp4 = layer.format == v1::CACHE_FORMAT_FP4;

    // Row lengths: explicit or causal (spec section 5).
    std::vector<int32_t> row_length(n), row_request(n, 0);
    int seq_index = -1;
    for (int i = 0; i < request.sequences_size(); ++i) {
      if (request.sequences(i).sequence_id() == sequence_id) seq_index = i;
    }
    const v1::SequenceStep& mine = request.sequences(seq_index);
    for (int32_t j = 0; j < n; ++j) {
      row_length[j] = mine.row_lengths_size() == n ? mine.row_lengths(j)
                                                   : static_cast<int32_t>(length - n + j + 1);
    }
    if (layer.owns_cache && response.lengths(seq_index) != length) {
      counts->rows_mismatched += n;
      Mismatch(counts,
               absl::StrCat("layer ", layer.layer, " sequence ", sequence_id, ": server length ",
                            response.lengths(seq_index), ", expected ", length));
      return absl::OkStatus();
    }

    // q of these rows, quantized as the server would.
    const int32_t value_bytes = fp4 ? d / 2 : d;
    std::vector<uint8_t> codes(size_t(n) * h * value_bytes);
    std::vector<uint8_t> scales(fp4 ? size_t(n) * h * d / 32 : 0);
    std::vector<float> weights(size_t(n) * h);
    const float* raw_weights =
        reinterpret_cast<const float*>(request.weights().data().data()) + size_t(row0) * h;
    if (request.q().dtype() == v1::DTYPE_FP32) {
      k::QPrepArgs prep;
      prep.num_rows = n;
      prep.num_heads = h;
      prep.head_dim = d;
      prep.q_type = k::ElemType::kF32;
      prep.q = reinterpret_cast<const float*>(request.q().data().data()) + size_t(row0) * h * d;
      prep.weights_raw = raw_weights;
      prep.hadamard = model_.info.hadamard();
      prep.format = fp4 ? k::CacheFormat::kFp4 : k::CacheFormat::kFp8;
      prep.q_codes = codes.data();
      prep.q_scales = fp4 ? scales.data() : nullptr;
      prep.weights_out = weights.data();
      if (absl::Status s = k::cpu::RopeQuantQ(prep); !s.ok()) return s;
    } else {
      std::memcpy(codes.data(), request.q().data().data() + size_t(row0) * h * value_bytes,
                  codes.size());
      if (fp4) {
        std::memcpy(scales.data(), request.q_scales().data().data() + size_t(row0) * h * d / 32,
                    scales.size());
      }
      std::memcpy(weights.data(), raw_weights, weights.size() * sizeof(float));
    }

    k::RowBatch rows;
    rows.num_rows = n;
    rows.row_request = row_request.data();
    rows.row_length = row_length.data();
    rows.page_table = cache.page_table.data();
    rows.page_table_stride = static_cast<int32_t>(cache.page_table.size());
    rows.num_requests = 1;
    rows.max_row_length = *std::max_element(row_length.begin(), row_length.end());
    k::QView q;
    q.codes = codes.data();
    q.scales = fp4 ? scales.data() : nullptr;
    q.weights = weights.data();
    q.num_heads = h;

    const int32_t* served =
        reinterpret_cast<const int32_t*>(response.topk().data().data()) + size_t(row0) * topk;
    std::vector<int32_t> expected(size_t(n) * topk);
    const int32_t nb = model_.num_candidate_blocks, bs = model_.candidate_block_size;

    if (layer.role != Role::kConsumer) {
      std::vector<int32_t> ref_candidates(layer.role == Role::kSource ? size_t(n) * nb : 0);
      k::DenseArgs dense;
      dense.cache = cache.view;
      dense.rows = rows;
      dense.q = q;
      dense.topk = topk;
      dense.topk_out = expected.data();
      if (layer.role == Role::kSource) {
        dense.candidates_out = ref_candidates.data();
        dense.num_candidate_blocks = nb;
        dense.candidate_block_size = bs;
      }
      if (absl::Status s = k::cpu::DenseTopK(dense); !s.ok()) return s;
      for (int32_t j = 0; j < n; ++j) {
        std::vector<int32_t> all(row_length[j]);
        for (int32_t p = 0; p < row_length[j]; ++p) all[p] = p;
        CompareRow(layer, sequence_id, j, rows, q, all, served + size_t(j) * topk,
                   expected.data() + size_t(j) * topk, counts);
      }
      if (layer.role == Role::kSource) {
        // Consumers are checked against the candidates the server itself used (each
        // layer's answer on its own); the candidates are checked here.
        std::vector<int32_t> used = ref_candidates;
        const std::string& got = response.candidate_blocks().data();
        if (got.size() >= (size_t(row0) + n) * nb * sizeof(int32_t)) {
          const int32_t* server_blocks =
              reinterpret_cast<const int32_t*>(got.data()) + size_t(row0) * nb;
          used.assign(server_blocks, server_blocks + size_t(n) * nb);
          for (int32_t j = 0; j < n; ++j) {
            counts->candidate_rows_checked++;
            const int32_t* mine = server_blocks + size_t(j) * nb;
            if (std::equal(mine, mine + nb, ref_candidates.begin() + size_t(j) * nb)) continue;
            if (tolerance_ > 0 &&
                BlocksWithinTolerance(cache.view, rows, q, j, row_length[j], mine)) {
              counts->candidate_rows_near_tie++;
              continue;
            }
            {
              counts->candidate_rows_mismatched++;
              Mismatch(
                  counts,
                  absl::StrCat("layer ", layer.layer, " sequence ", sequence_id, " row ", j,
                               ": candidate blocks ", Preview(server_blocks + size_t(j) * nb, nb),
                               " expected ", Preview(ref_candidates.data() + size_t(j) * nb, nb)));
            }
          }
        }
        candidates_[sequence_id] = std::move(used);
      }
      return absl::OkStatus();
    }

    // A consumer: score the source's candidate blocks (from this token step) only.
    auto cand = candidates_.find(sequence_id);
    if (cand == candidates_.end()) return absl::OkStatus();  // source not scored this step
    const int32_t max_positions = nb * bs;
    std::vector<int32_t> positions(size_t(n) * max_positions), pos_counts(n);
    k::ExpandArgs expand;
    expand.num_rows = n;
    expand.candidates = cand->second.data();
    expand.row_length = row_length.data();
    expand.num_candidate_blocks = nb;
    expand.candidate_block_size = bs;
    expand.out.positions = positions.data();
    expand.out.counts = pos_counts.data();
    expand.out.max_positions = max_positions;
    if (absl::Status s = k::cpu::ExpandCandidates(expand); !s.ok()) return s;
    k::SparseArgs sparse;
    sparse.cache = cache.view;
    sparse.rows = rows;
    sparse.q = q;
    sparse.positions = positions.data();
    sparse.counts = pos_counts.data();
    sparse.max_positions = max_positions;
    sparse.topk = topk;
    sparse.topk_out = expected.data();
    if (absl::Status s = k::cpu::SparseTopK(sparse); !s.ok()) return s;
    for (int32_t j = 0; j < n; ++j) {
      const int32_t* p = positions.data() + size_t(j) * max_positions;
      std::vector<int32_t> scored(p, p + pos_counts[j]);
      CompareRow(layer, sequence_id, j, rows, q, scored, served + size_t(j) * topk,
                 expected.data() + size_t(j) * topk, counts);
    }
    return absl::OkStatus();
  }

  // Exact match, else a near-tie difference within the spec's tolerance, else a mismatch.
  void CompareRow(const LayerStep& layer, uint64_t sequence_id, int32_t row,
                  const k::RowBatch& rows, const k::QView& q, const std::vector<int32_t>& scored,
                  const int32_t* served, const int32_t* expected, VerifyCounts* counts) {
    const int32_t topk = model_.topk;
    counts->rows_checked++;
    if (std::equal(served, served + topk, expected)) return;
    if (tolerance_ > 0) {
      std::vector<float> logits(scored.size());
      k::cpu::RowLogitsAt(CacheViewFor(layer, sequence_id), rows, q, row, scored.data(),
                          static_cast<int32_t>(scored.size()), logits.data());
      if (TopKWithinTolerance(logits, scored, served, topk, tolerance_)) {
        counts->rows_near_tie++;
        return;
      }
    }
    counts->rows_mismatched++;
    Mismatch(counts, absl::StrCat("layer ", layer.layer, " (", RoleName(layer.role), ") sequence ",
                                  sequence_id, " row ", row, ": got ", Preview(served, topk),
                                  " expected ", Preview(expected, topk)));
  }

  // Candidate blocks that differ from the reference only at near-tied block scores.
  bool BlocksWithinTolerance(const k::CacheView& cache, const k::RowBatch& rows, const k::QView& q,
                             int32_t row, int32_t length, const int32_t* served) {
    const int32_t bs = model_.candidate_block_size;
    const std::vector<float> logits = k::cpu::RowLogits(cache, rows, q, row);
    const int32_t blocks = (length + bs - 1) / bs;
    std::vector<float> scores(blocks, -std::numeric_limits<float>::infinity());
    std::vector<int32_t> ids(blocks);
    for (int32_t b = 0; b < blocks; ++b) {
      ids[b] = b;
      for (int32_t p = b * bs; p < std::min(length, (b + 1) * bs); ++p) {
        scores[b] = std::max(scores[b], logits[p]);
      }
    }
    scores[blocks - 1] = std::numeric_limits<float>::infinity();  // the newest block
    return TopKWithinTolerance(scores, ids, served, model_.num_candidate_blocks, tolerance_);
  }

  k::CacheView CacheViewFor(const LayerStep& layer, uint64_t sequence_id) {
    return CacheOf(tracked_[sequence_id], layer.cache_layer).view;
  }

  const double tolerance_;
  const ServerModel model_;
  const int32_t max_rows_;
  std::map<uint64_t, Tracked> tracked_;
  // The source's candidate blocks of the current token step, per tracked sequence.
  std::map<uint64_t, std::vector<int32_t>> candidates_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Verifier>> Verifier::Create(const ServerModel& model,
                                                           int32_t max_rows_per_sequence,
                                                           double tolerance) {
  return std::make_unique<CpuVerifier>(model, max_rows_per_sequence, tolerance);
}

#endif  // DI_LOAD_HAVE_VERIFY

}  // namespace decode_indexer::load
