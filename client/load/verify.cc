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

#include "reference/reference.h"

namespace decode_indexer::load {
namespace {

// Bytes of one key row (and of its scales) of a keys tensor of `dtype` at head dim d.
size_t KeyRowBytes(v1::DType dtype, int32_t d) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return size_t(d) * 4;
    case v1::DTYPE_BF16:
      return size_t(d) * 2;
    case v1::DTYPE_FP4_E2M1:
      return size_t(d) / 2;
    default:
      return size_t(d);
  }
}

// A columnar step (--columnar) in the SequenceStep form the checks read: each request's keys
// cut out of the stacked tensor. Only the verifier pays this copy.
v1::DecodeStepRequest AsSequences(const v1::DecodeStepRequest& c, int32_t d) {
  v1::DecodeStepRequest out = c;
  out.clear_sequence_ids();
  out.clear_num_rows();
  out.clear_rows_per_sequence();
  out.clear_new_keys();
  out.clear_new_key_scales();
  out.clear_new_key_counts();
  out.clear_new_keys_positions();
  out.clear_row_lengths();
  const bool has_keys = c.has_new_keys() && c.new_keys().dtype() != v1::DTYPE_UNSPECIFIED;
  const bool has_scales = c.has_new_key_scales() && c.new_key_scales().dtype() != 0;
  const size_t row_bytes = KeyRowBytes(c.new_keys().dtype(), d);
  const size_t scale_bytes = c.new_key_scales().dtype() == v1::DTYPE_FP32 ? 4 : size_t(d) / 32;
  int64_t key_at = 0, row_at = 0;
  for (int i = 0; i < c.sequence_ids_size(); ++i) {
    v1::SequenceStep* s = out.add_sequences();
    s->set_sequence_id(c.sequence_ids(i));
    const int32_t rows = c.num_rows_size() > 0 ? c.num_rows(i) : c.rows_per_sequence();
    s->set_num_rows(rows);
    bool explicit_lengths = false;
    for (int32_t j = 0; j < rows && row_at + j < c.row_lengths_size(); ++j) {
      explicit_lengths = explicit_lengths || c.row_lengths(row_at + j) != 0;
    }
    for (int32_t j = 0; explicit_lengths && j < rows; ++j) {
      s->add_row_lengths(c.row_lengths(row_at + j));
    }
    row_at += rows;
    if (i < c.new_keys_positions_size() && c.new_keys_positions(i) >= 0) {
      s->set_new_keys_position(c.new_keys_positions(i));
    }
    const int32_t keys = c.new_key_counts_size() > 0 ? c.new_key_counts(i) : has_keys ? rows : 0;
    if (keys <= 0) continue;
    v1::Tensor* k = s->mutable_new_keys();
    k->set_dtype(c.new_keys().dtype());
    k->add_shape(keys);
    k->add_shape(d);
    k->set_data(c.new_keys().data().substr(key_at * row_bytes, keys * row_bytes));
    if (has_scales) {
      v1::Tensor* ks = s->mutable_new_key_scales();
      ks->set_dtype(c.new_key_scales().dtype());
      ks->add_shape(keys);
      if (c.new_key_scales().dtype() != v1::DTYPE_FP32) ks->add_shape(d / 32);
      ks->set_data(c.new_key_scales().data().substr(key_at * scale_bytes, keys * scale_bytes));
    }
    key_at += keys;
  }
  return out;
}

}  // namespace

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

namespace {

namespace ref = decode_indexer::reference;

std::string Preview(const int32_t* row, int32_t n) {
  std::vector<int32_t> head(row, row + std::min(n, 8));
  return absl::StrCat("[", absl::StrJoin(head, ","), n > 8 ? ",..." : "", "]");
}

float Bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 or bf16 tensor data as floats.
std::vector<float> Floats(const v1::Tensor& t) {
  if (t.dtype() == v1::DTYPE_BF16) {
    std::vector<float> out(t.data().size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, t.data().data() + 2 * i, 2);
      out[i] = Bf16(b);
    }
    return out;
  }
  std::vector<float> out(t.data().size() / 4);
  std::memcpy(out.data(), t.data().data(), out.size() * 4);
  return out;
}

// Checks answers with the independent reference (reference/reference.h): it shares no code
// with the server's backends, dequantizes the codes itself and scores in double.
class RefVerifier final : public Verifier {
 public:
  RefVerifier(const ServerModel& model, int32_t max_rows, double tolerance)
      : tolerance_(tolerance), model_(model), max_rows_(max_rows) {}

  void Track(uint64_t sequence_id) override { tracked_[sequence_id]; }
  bool Tracks(uint64_t sequence_id) const override { return tracked_.contains(sequence_id); }

  absl::Status AppendKeys(uint64_t sequence_id, int32_t cache_layer, const v1::Tensor& keys,
                          const v1::Tensor& key_scales) override {
    auto it = tracked_.find(sequence_id);
    if (it == tracked_.end()) return absl::OkStatus();
    ref::Cache& cache = CacheOf(it->second, cache_layer);
    const int32_t n = keys.shape_size() > 0 ? static_cast<int32_t>(keys.shape(0)) : 0;
    if (n == 0) return absl::OkStatus();
    const auto* k = reinterpret_cast<const uint8_t*>(keys.data().data());
    const auto* s = reinterpret_cast<const uint8_t*>(key_scales.data().data());
    const bool fp4 = cache.format() == ref::Format::kFp4;
    switch (keys.dtype()) {
      case v1::DTYPE_FP32:
      case v1::DTYPE_BF16: {
        const std::vector<float> f = Floats(keys);
        if (f.size() != size_t(n) * model_.head_dim) {
          return absl::InvalidArgumentError("verify: keys of the wrong size");
        }
        cache.AppendFloat(f.data(), n, model_.info.hadamard());
        break;
      }
      case v1::DTYPE_FP8_E4M3:
        if (fp4 || keys.data().size() != size_t(n) * model_.head_dim ||
            key_scales.data().size() != size_t(n) * 4) {
          return absl::InvalidArgumentError("verify: FP8 keys do not fit the cache");
        }
        cache.AppendFp8(k, s, n);
        break;
      case v1::DTYPE_FP4_E2M1:
        if (!fp4 || keys.data().size() != size_t(n) * model_.head_dim / 2 ||
            key_scales.data().size() != size_t(n) * model_.head_dim / 32) {
          return absl::InvalidArgumentError("verify: FP4 keys do not fit the cache");
        }
        cache.AppendFp4(k, s, n);
        break;
      default:
        return absl::InvalidArgumentError("verify: unsupported key dtype");
    }
    return absl::OkStatus();
  }

  void BeginTokenStep() override { candidates_.clear(); }

  absl::Status CheckStep(const v1::DecodeStepRequest& request,
                         const v1::DecodeStepResponse& response, bool score,
                         VerifyCounts* counts) override {
    if (request.sequences_size() == 0 && request.sequence_ids_size() > 0) {
      return CheckStep(AsSequences(request, model_.head_dim), response, score, counts);
    }
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
        if (layer->owns_cache && seq.has_new_keys_position()) {
          // The server cut the cache back to the position before writing (rollback).
          ref::Cache& cache = CacheOf(it->second, layer->cache_layer);
          if (seq.new_keys_position() > cache.size()) {
            return absl::InternalError("verify: the server took a step with a hole");
          }
          cache.Truncate(seq.new_keys_position());
        }
        if (layer->owns_cache && seq.has_new_keys()) {
          absl::Status s = AppendKeys(seq.sequence_id(), layer->cache_layer, seq.new_keys(),
                                      seq.new_key_scales());
          if (!s.ok()) return s;
        }
        if (score) {
          absl::Status s =
              CheckRows(*layer, it->first, it->second, request, response, i, row0, n, counts);
          if (!s.ok()) return s;
        }
      }
      row0 += n;
    }
    return absl::OkStatus();
  }

 private:
  struct Tracked {
    std::map<int32_t, ref::Cache> caches;  // cache layer -> the entries, dequantized
  };

  ref::Cache& CacheOf(Tracked& t, int32_t cache_layer) {
    auto it = t.caches.find(cache_layer);
    if (it != t.caches.end()) return it->second;
    const ref::Format f =
        FormatOf(cache_layer) == v1::CACHE_FORMAT_FP4 ? ref::Format::kFp4 : ref::Format::kFp8;
    return t.caches.emplace(cache_layer, ref::Cache(f, model_.head_dim)).first->second;
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

  // The section-6 tolerance: fp32 rounding of the exact logits (4 ulps of the row's largest),
  // widened by --verify-tolerance x |K-th| for a backend that sums in another order.
  double Tol(const std::vector<double>& exact, int32_t k) const {
    double t = ref::Tolerance(exact);
    if (tolerance_ > 0 && static_cast<int32_t>(exact.size()) > k) {
      std::vector<double> sorted = exact;
      std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(),
                       std::greater<double>());
      const double kth = sorted[k - 1];
      if (std::isfinite(kth)) t = std::max(t, tolerance_ * std::max(1e-6, std::fabs(kth)));
    }
    return t;
  }

  absl::Status CheckRows(const LayerStep& layer, uint64_t sequence_id, Tracked& tracked,
                         const v1::DecodeStepRequest& request,
                         const v1::DecodeStepResponse& response, int seq_index, int32_t row0,
                         int32_t n, VerifyCounts* counts) {
    if (n > max_rows_) return absl::InternalError("verify: more rows than configured");
    const ref::Cache& cache = CacheOf(tracked, layer.cache_layer);
    const int64_t length = cache.size();
    const int32_t h = model_.num_heads, d = model_.head_dim, topk = model_.topk;
    const bool fp4 = layer.format == v1::CACHE_FORMAT_FP4;
    const ref::Format format = fp4 ? ref::Format::kFp4 : ref::Format::kFp8;

    // Row lengths: explicit or causal (spec section 5).
    const v1::SequenceStep& mine = request.sequences(seq_index);
    std::vector<int32_t> row_length(n);
    for (int32_t j = 0; j < n; ++j) {
      row_length[j] = mine.row_lengths_size() == n ? mine.row_lengths(j)
                                                   : static_cast<int32_t>(length - n + j + 1);
      if (row_length[j] < 0 || row_length[j] > length) {
        return absl::InternalError("verify: a row longer than the mirrored sequence");
      }
    }
    if (layer.owns_cache && response.lengths(seq_index) != length) {
      counts->rows_mismatched += n;
      Mismatch(counts,
               absl::StrCat("layer ", layer.layer, " sequence ", sequence_id, ": server length ",
                            response.lengths(seq_index), ", expected ", length));
      return absl::OkStatus();
    }

    // q of these rows, dequantized (quantized first as the spec says, from fp32/bf16).
    const std::vector<float> weights = Floats(request.weights());
    std::vector<float> qf;
    const v1::DType qt = request.q().dtype();
    if (qt == v1::DTYPE_FP32 || qt == v1::DTYPE_BF16) qf = Floats(request.q());
    const auto* qb = reinterpret_cast<const uint8_t*>(request.q().data().data());
    const auto* qs = reinterpret_cast<const uint8_t*>(request.q_scales().data().data());
    std::vector<ref::Query> queries(n);
    for (int32_t j = 0; j < n; ++j) {
      const size_t v = (size_t(row0) + j) * h;
      if (weights.size() < v + h) return absl::InternalError("verify: weights too short");
      if (!qf.empty()) {
        queries[j] = ref::QueryFloat(qf.data() + v * d, weights.data() + v, h, d, format, nullptr,
                                     nullptr, 0, model_.info.hadamard());
      } else if (!fp4) {
        queries[j] = ref::QueryFp8(qb + v * d, weights.data() + v, h, d);
      } else {
        queries[j] = ref::QueryFp4(qb + v * d / 2, qs + v * d / 32, weights.data() + v, h, d);
      }
    }

    const int32_t* served =
        reinterpret_cast<const int32_t*>(response.topk().data().data()) + size_t(row0) * topk;
    const int32_t nb = model_.num_candidate_blocks, bs = model_.candidate_block_size;

    if (layer.role != Role::kConsumer) {
      std::vector<int32_t> used;
      const std::string& got = response.candidate_blocks().data();
      const bool has_blocks =
          layer.role == Role::kSource && got.size() >= (size_t(row0) + n) * nb * sizeof(int32_t);
      const int32_t* server_blocks =
          has_blocks ? reinterpret_cast<const int32_t*>(got.data()) + size_t(row0) * nb : nullptr;
      for (int32_t j = 0; j < n; ++j) {
        const std::vector<double> logits = ref::DenseLogits(queries[j], cache, row_length[j]);
        const std::vector<int32_t> expected = ref::NaiveTopK(logits, topk);
        CompareRow(layer, sequence_id, j, logits, nullptr, served + size_t(j) * topk, expected,
                   counts);
        if (layer.role != Role::kSource) continue;
        const std::vector<int32_t> ref_blocks = ref::CandidateBlocks(logits, nb, bs);
        if (server_blocks == nullptr) {
          used.insert(used.end(), ref_blocks.begin(), ref_blocks.end());
          continue;
        }
        // Consumers are checked against the candidates the server itself used (each layer's
        // answer on its own); the candidates are checked here.
        const int32_t* blocks = server_blocks + size_t(j) * nb;
        used.insert(used.end(), blocks, blocks + nb);
        counts->candidate_rows_checked++;
        if (std::equal(blocks, blocks + nb, ref_blocks.begin())) continue;
        if (ref::CheckCandidateRow(blocks, nb, bs, logits, Tol(logits, topk)).empty()) {
          counts->candidate_rows_near_tie++;
          continue;
        }
        counts->candidate_rows_mismatched++;
        Mismatch(counts, absl::StrCat("layer ", layer.layer, " sequence ", sequence_id, " row ", j,
                                      ": candidate blocks ", Preview(blocks, nb), " expected ",
                                      Preview(ref_blocks.data(), nb)));
      }
      if (layer.role == Role::kSource) candidates_[sequence_id] = std::move(used);
      return absl::OkStatus();
    }

    // A consumer: score the source's candidate blocks (from this token step) only.
    auto cand = candidates_.find(sequence_id);
    if (cand == candidates_.end()) return absl::OkStatus();  // source not scored this step
    if (cand->second.size() < size_t(n) * nb) {
      return absl::InternalError("verify: consumer rows differ from the source's");
    }
    for (int32_t j = 0; j < n; ++j) {
      const std::vector<int32_t> scored =
          ref::ExpandBlocks(cand->second.data() + size_t(j) * nb, nb, bs, row_length[j]);
      const std::vector<double> logits = ref::LogitsAt(queries[j], cache, scored);
      const std::vector<int32_t> expected = ref::NaiveTopK(logits, topk, &scored);
      CompareRow(layer, sequence_id, j, logits, &scored, served + size_t(j) * topk, expected,
                 counts);
    }
    return absl::OkStatus();
  }

  // The reference's exact top-k, else a near-tie difference within the spec's tolerance
  // (counted apart), else a mismatch.
  void CompareRow(const LayerStep& layer, uint64_t sequence_id, int32_t row,
                  const std::vector<double>& logits, const std::vector<int32_t>* scored,
                  const int32_t* served, const std::vector<int32_t>& expected,
                  VerifyCounts* counts) {
    const int32_t topk = model_.topk;
    counts->rows_checked++;
    if (std::equal(served, served + topk, expected.begin())) return;
    if (ref::CheckTopKRow(served, topk, logits, Tol(logits, topk), scored).empty()) {
      counts->rows_near_tie++;
      return;
    }
    counts->rows_mismatched++;
    Mismatch(counts, absl::StrCat("layer ", layer.layer, " (", RoleName(layer.role), ") sequence ",
                                  sequence_id, " row ", row, ": got ", Preview(served, topk),
                                  " expected ", Preview(expected.data(), topk)));
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
  return std::make_unique<RefVerifier>(model, max_rows_per_sequence, tolerance);
}

}  // namespace decode_indexer::load
