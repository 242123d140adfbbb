// The service tests' oracle: what a fresh server must answer, computed with the independent
// reference (reference/reference.h, di_reference: its own decoders, encoders, RoPE, double
// logits and naive top-k; no code shared with kernels/, the backends under test), from the
// same proto requests. It keeps each sequence's entries dequantized per cache layer and knows
// nothing of the server's executor, state, pages or edge. Answers are compared by the spec's
// section-6 rule (OracleAnswer::Matches): exactly the reference's top-k up to near-ties of
// 4 fp32 ulps of the row's largest logit, and nothing more.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/tensor.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "reference/reference.h"
#include "server/config/profile.h"
#include "tests/reference/profile_reference.h"

namespace decode_indexer::testing {

// The reference's answer of a step (RefAnswer: rows, k, topk, candidates, per-row positions
// and exact logits, Matches) and the sequences' lengths after it.
struct OracleAnswer : RefAnswer {
  std::vector<int64_t> lengths;  // per sequence after the step
};

class ServiceOracle {
 public:
  ServiceOracle(const config::Profile& profile, int64_t pages_per_pool, uint64_t seed)
      : p_(profile), pages_per_pool_(pages_per_pool), rng_(seed), rope_(RefRope(profile)) {
    inv_freq_ = reference::InvFreq(rope_);
  }

  // Also give every answer's fp8_bound (spec section 6): for the rows the GPU's fp8
  // tensor-core kernel may score (dense and source rows of FP8 caches with 64 heads), the
  // largest fp8-accumulation bound of the row's logits; 0 for the others (exact kernels).
  void set_fp8_bounds(bool on) { fp8_bounds_ = on; }

  void Create(uint64_t id) { seqs_[id]; }
  void Release(uint64_t id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    for (auto& [layer, cache] : it->second.caches) pages_used_[layer] -= Pages(cache.size());
    seqs_.erase(it);
  }
  int64_t Length(uint64_t id, int32_t cache_layer) const {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return -1;
    auto l = it->second.caches.find(cache_layer);
    return l == it->second.caches.end() ? 0 : l->second.size();
  }

  absl::StatusOr<int64_t> Append(uint64_t id, int32_t layer, const v1::Tensor& keys,
                                 const v1::Tensor& scales) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return absl::NotFoundError("oracle: unknown sequence");
    const int32_t cl = p_.layers.at(layer).cache_layer;
    absl::Status s = Insert(it->second, cl, keys, scales);
    if (!s.ok()) return s;
    return it->second.caches.at(cl).size();
  }

  // The server's candidate blocks of a source step (after they passed Matches): later
  // consumers score the blocks the server chose, which may legally differ at near-ties.
  void AdoptCandidates(const v1::DecodeStepRequest& req, const std::vector<int32_t>& blocks) {
    const int32_t nb = p_.num_candidate_blocks;
    size_t r = 0;
    for (const v1::SequenceStep& s : req.sequences()) {
      const int n = s.num_rows() == 0 ? s.row_lengths_size() : s.num_rows();
      Seq& seq = seqs_.at(s.sequence_id());
      if (r + size_t(n) * nb > blocks.size()) return;
      seq.candidates.assign(blocks.begin() + r, blocks.begin() + r + size_t(n) * nb);
      r += size_t(n) * nb;
    }
  }

  absl::StatusOr<OracleAnswer> Step(const v1::DecodeStepRequest& req) {
    const config::LayerSpec& spec = p_.layers.at(req.layer());
    const int32_t cl = spec.cache_layer;
    const int32_t H = p_.num_heads, D = p_.head_dim, K = p_.topk;
    const int32_t nb = p_.num_candidate_blocks, bs = p_.candidate_block_size;
    const reference::Format fmt = RefFormat(spec.cache_format);
    // Keys first: a row sees its own key.
    for (const v1::SequenceStep& s : req.sequences()) {
      if (s.new_keys().dtype() == v1::DTYPE_UNSPECIFIED) continue;
      absl::Status st = Insert(seqs_.at(s.sequence_id()), cl, s.new_keys(), s.new_key_scales());
      if (!st.ok()) return st;
    }
    OracleAnswer ans;
    ans.k = K;
    ans.num_candidate_blocks = nb;
    ans.candidate_block_size = bs;
    // Rows: (sequence, length) per spec section 5.
    std::vector<int> row_seq;
    std::vector<int64_t> row_length;
    for (int b = 0; b < req.sequences_size(); ++b) {
      const v1::SequenceStep& s = req.sequences(b);
      const int64_t L = CacheOf(seqs_.at(s.sequence_id()), cl).size();
      const int n = s.num_rows() == 0 ? s.row_lengths_size() : s.num_rows();
      for (int j = 0; j < n; ++j) {
        row_seq.push_back(b);
        row_length.push_back(s.row_lengths_size() ? s.row_lengths(j) : L - n + j + 1);
      }
      ans.lengths.push_back(L);
    }
    const int32_t rows = static_cast<int32_t>(row_seq.size());
    ans.rows = rows;
    ans.topk.assign(static_cast<size_t>(rows) * K, -7);
    ans.positions.resize(rows);
    ans.logits.resize(rows);
    const bool source = spec.role == config::LayerRole::kCandidateSource;
    const bool consumer = spec.role == config::LayerRole::kCandidateConsumer;
    if (source) ans.candidates.assign(static_cast<size_t>(rows) * nb, -7);
    const bool fp8_rows = fp8_bounds_ && !consumer && fmt == reference::Format::kFp8 && H == 64;
    if (fp8_bounds_) ans.fp8_bound.assign(rows, 0.0);

    // q: quantized here from fp32/bf16 (RoPE at the given positions), or the codes as sent.
    const std::vector<float> w = Floats(req.weights());
    const v1::DType qt = req.q().dtype();
    std::vector<float> qf;
    if (qt == v1::DTYPE_FP32 || qt == v1::DTYPE_BF16) qf = Floats(req.q());
    std::vector<int64_t> positions;
    if (req.positions().dtype() == v1::DTYPE_INT64) {
      positions = *client::ParseI64(req.positions());
    } else if (req.positions().dtype() == v1::DTYPE_INT32) {
      const absl::StatusOr<std::vector<int32_t>> p32 = client::ParseI32(req.positions());
      positions.assign(p32->begin(), p32->end());
    }
    const auto* qbytes = reinterpret_cast<const uint8_t*>(req.q().data().data());
    const auto* qsbytes = reinterpret_cast<const uint8_t*>(req.q_scales().data().data());
    std::map<int, size_t> seq_row;  // rows of this step seen so far per sequence
    for (int32_t r = 0; r < rows; ++r) {
      const size_t rh = static_cast<size_t>(r) * H;
      reference::Query q;
      if (!qf.empty()) {
        const bool rope = !positions.empty() && rope_.style != reference::RopeStyle::kNone;
        q = reference::QueryFloat(qf.data() + rh * D, w.data() + rh, H, D, fmt,
                                  rope ? &rope_ : nullptr, &inv_freq_,
                                  positions.empty() ? 0 : positions[r], p_.hadamard);
      } else if (fmt == reference::Format::kFp8) {
        q = reference::QueryFp8(qbytes + rh * D, w.data() + rh, H, D);
      } else {
        q = reference::QueryFp4(qbytes + rh * D / 2, qsbytes + rh * D / 32, w.data() + rh, H, D);
      }
      Seq& seq = seqs_.at(req.sequences(row_seq[r]).sequence_id());
      const reference::Cache& cache = CacheOf(seq, cl);
      if (row_length[r] < 0 || row_length[r] > cache.size()) {
        return absl::InvalidArgumentError("oracle: a row longer than its sequence");
      }
      const int32_t L = static_cast<int32_t>(row_length[r]);
      int32_t* out = ans.topk.data() + static_cast<size_t>(r) * K;
      if (!consumer) {
        ans.logits[r] = reference::DenseLogits(q, cache, L);
        if (fp8_rows) {
          double worst = 0.0;
          for (int32_t t = 0; t < L; ++t) {
            worst = std::max(worst, reference::Fp8AccumulationBound(q, cache.At(t)));
          }
          ans.fp8_bound[r] = worst;
        }
        ans.positions[r].resize(L);
        std::iota(ans.positions[r].begin(), ans.positions[r].end(), 0);
        const std::vector<int32_t> top = reference::NaiveTopK(ans.logits[r], K);
        std::copy(top.begin(), top.end(), out);
        if (source) {
          const std::vector<int32_t> blocks = reference::CandidateBlocks(ans.logits[r], nb, bs);
          std::copy(blocks.begin(), blocks.end(), ans.candidates.begin() + size_t(r) * nb);
        }
      } else {
        const size_t j = seq_row[row_seq[r]]++;
        if (seq.candidate_length != cache.size() || seq.candidates.size() < (j + 1) * nb) {
          return absl::FailedPreconditionError("oracle: no candidates for the current length");
        }
        ans.positions[r] = reference::ExpandBlocks(seq.candidates.data() + j * nb, nb, bs, L);
        ans.logits[r] = reference::LogitsAt(q, cache, ans.positions[r]);
        const std::vector<int32_t> top = reference::NaiveTopK(ans.logits[r], K, &ans.positions[r]);
        std::copy(top.begin(), top.end(), out);
      }
    }
    if (source) {
      // Consumers of this step read these, per sequence.
      size_t r = 0;
      for (int b = 0; b < req.sequences_size(); ++b) {
        Seq& seq = seqs_.at(req.sequences(b).sequence_id());
        const size_t n = static_cast<size_t>(std::count(row_seq.begin(), row_seq.end(), b));
        seq.candidates.assign(ans.candidates.begin() + r * nb,
                              ans.candidates.begin() + (r + n) * nb);
        seq.candidate_length = CacheOf(seq, cl).size();
        r += n;
      }
    }
    return ans;
  }

 private:
  bool fp8_bounds_ = false;
  struct Seq {
    std::map<int32_t, reference::Cache> caches;  // by cache layer
    std::vector<int32_t> candidates;             // the source's last answer, rows x blocks
    int64_t candidate_length = -1;
  };

  int64_t Pages(int64_t entries) const { return (entries + p_.page_size - 1) / p_.page_size; }

  reference::Cache& CacheOf(Seq& seq, int32_t cache_layer) {
    auto it = seq.caches.find(cache_layer);
    if (it != seq.caches.end()) return it->second;
    return seq.caches
        .emplace(cache_layer,
                 reference::Cache(RefFormat(p_.layers.at(cache_layer).cache_format), p_.head_dim))
        .first->second;
  }

  static std::vector<float> Floats(const v1::Tensor& t) {
    if (t.dtype() == v1::DTYPE_FP32) return *client::ParseF32(t);
    std::vector<float> out(t.data().size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, t.data().data() + 2 * i, 2);
      out[i] = Bf16Bits(b);
    }
    return out;
  }

  absl::Status Insert(Seq& seq, int32_t cl, const v1::Tensor& keys, const v1::Tensor& scales) {
    reference::Cache& cache = CacheOf(seq, cl);
    const int32_t n = static_cast<int32_t>(keys.shape(0));
    // The server's pool: pages of page_size entries, pages_per_pool of them per cache layer.
    const int64_t extra = Pages(cache.size() + n) - Pages(cache.size());
    if (pages_used_[cl] + extra > pages_per_pool_) {
      return absl::ResourceExhaustedError("oracle: out of pages");
    }
    pages_used_[cl] += extra;
    const auto* k = reinterpret_cast<const uint8_t*>(keys.data().data());
    const auto* s = reinterpret_cast<const uint8_t*>(scales.data().data());
    switch (keys.dtype()) {
      case v1::DTYPE_FP32:
      case v1::DTYPE_BF16: {
        const std::vector<float> f = Floats(keys);
        cache.AppendFloat(f.data(), n, p_.hadamard);
        break;
      }
      case v1::DTYPE_FP8_E4M3:
        cache.AppendFp8(k, s, n);
        break;
      default:
        cache.AppendFp4(k, s, n);
        break;
    }
    return absl::OkStatus();
  }

  config::Profile p_;
  int64_t pages_per_pool_;
  std::mt19937_64 rng_;  // kept for the constructor's seed (the page shuffle is the server's)
  reference::Rope rope_;
  std::vector<double> inv_freq_;
  std::map<int32_t, int64_t> pages_used_;
  std::map<uint64_t, Seq> seqs_;
};

}  // namespace decode_indexer::testing
