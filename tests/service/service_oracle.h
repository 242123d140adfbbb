// The service tests' oracle: what a fresh server must answer, computed directly with the
// kernels' CPU reference free functions (decode_indexer/kernels/cpu_reference.h) over the
// test's own paged caches (its own page allocation, shuffled), from the same proto requests.
// It knows nothing of the server's executor, state or edge.
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
#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/rope.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "server/config/profile.h"

namespace decode_indexer::testing {

struct OracleAnswer {
  int32_t rows = 0;
  int32_t k = 0;
  std::vector<int32_t> topk;        // [rows, k]
  std::vector<int32_t> candidates;  // [rows, num_candidate_blocks] at a source layer
  std::vector<int64_t> lengths;     // per sequence after the step
  // Per row: the positions it scored and their logits (dense: 0..L-1), for near-tie checks.
  std::vector<std::vector<int32_t>> positions;
  std::vector<std::vector<double>> logits;
};

class ServiceOracle {
 public:
  ServiceOracle(const config::Profile& profile, int64_t pages_per_pool, uint64_t seed)
      : p_(profile), pages_per_pool_(pages_per_pool), rng_(seed) {
    inv_freq_ = kernels::ComputeInvFreq(p_.rope);
  }

  void Create(uint64_t id) { seqs_[id]; }
  void Release(uint64_t id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    for (auto& [layer, pages] : it->second.pages) {
      for (int32_t pg : pages) pools_[layer].free_pages.push_back(pg);
    }
    seqs_.erase(it);
  }
  int64_t Length(uint64_t id, int32_t cache_layer) const {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return -1;
    auto l = it->second.length.find(cache_layer);
    return l == it->second.length.end() ? 0 : l->second;
  }

  absl::StatusOr<int64_t> Append(uint64_t id, int32_t layer, const v1::Tensor& keys,
                                 const v1::Tensor& scales) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return absl::NotFoundError("oracle: unknown sequence");
    absl::Status s = Insert(it->second, p_.layers.at(layer).cache_layer, keys, scales);
    if (!s.ok()) return s;
    return it->second.length[p_.layers.at(layer).cache_layer];
  }

  absl::StatusOr<OracleAnswer> Step(const v1::DecodeStepRequest& req) {
    using namespace kernels;
    const config::LayerSpec& spec = p_.layers.at(req.layer());
    const int32_t cl = spec.cache_layer;
    const int32_t H = p_.num_heads, D = p_.head_dim;
    Pool& pool = PoolOf(cl);
    // Keys first: a row sees its own key.
    for (const v1::SequenceStep& s : req.sequences()) {
      if (s.new_keys().dtype() == v1::DTYPE_UNSPECIFIED) continue;
      absl::Status st = Insert(seqs_.at(s.sequence_id()), cl, s.new_keys(), s.new_key_scales());
      if (!st.ok()) return st;
    }
    OracleAnswer ans;
    std::vector<int32_t> row_request, row_length;
    int32_t stride = 1;
    for (const v1::SequenceStep& s : req.sequences()) {
      stride = std::max<int32_t>(stride, seqs_.at(s.sequence_id()).pages[cl].size());
    }
    std::vector<int32_t> page_table(static_cast<size_t>(req.sequences_size()) * stride, 0);
    int32_t max_len = 0;
    for (int b = 0; b < req.sequences_size(); ++b) {
      const v1::SequenceStep& s = req.sequences(b);
      Seq& seq = seqs_.at(s.sequence_id());
      const int64_t L = seq.length[cl];
      const int n = s.num_rows() == 0 ? s.row_lengths_size() : s.num_rows();
      for (int j = 0; j < n; ++j) {
        row_request.push_back(b);
        const int64_t len = s.row_lengths_size() ? s.row_lengths(j) : L - n + j + 1;
        row_length.push_back(static_cast<int32_t>(len));
        max_len = std::max<int32_t>(max_len, len);
      }
      std::copy(seq.pages[cl].begin(), seq.pages[cl].end(), page_table.begin() + b * stride);
      ans.lengths.push_back(L);
    }
    const int32_t rows = static_cast<int32_t>(row_request.size());
    RowBatch batch;
    batch.num_rows = rows;
    batch.row_request = row_request.data();
    batch.row_length = row_length.data();
    batch.page_table = page_table.data();
    batch.page_table_stride = stride;
    batch.num_requests = req.sequences_size();
    batch.max_row_length = max_len;

    // q: the server's rope_quant_q for unquantized q, else the codes as sent.
    const CacheFormat fmt = spec.cache_format;
    const int32_t vbytes = fmt == CacheFormat::kFp8 ? D : D / 2;
    std::vector<uint8_t> q_codes(static_cast<size_t>(rows) * H * vbytes);
    std::vector<uint8_t> q_scales(static_cast<size_t>(rows) * H * (D / 32));
    std::vector<float> weights(static_cast<size_t>(rows) * H);
    std::vector<float> w_raw = Floats(req.weights());
    QView qv;
    qv.num_heads = H;
    const v1::DType qt = req.q().dtype();
    if (qt == v1::DTYPE_FP32 || qt == v1::DTYPE_BF16) {
      std::vector<uint8_t> q_bytes(req.q().data().begin(), req.q().data().end());
      std::vector<int64_t> positions;
      if (req.positions().dtype() == v1::DTYPE_INT64) {
        positions = *client::ParseI64(req.positions());
      } else if (req.positions().dtype() == v1::DTYPE_INT32) {
        // Keep the StatusOr alive: a range-for over *temporary would dangle.
        const absl::StatusOr<std::vector<int32_t>> p32 = client::ParseI32(req.positions());
        positions.assign(p32->begin(), p32->end());
      }
      QPrepArgs a;
      a.num_rows = rows;
      a.num_heads = H;
      a.head_dim = D;
      a.q_type = qt == v1::DTYPE_FP32 ? ElemType::kF32 : ElemType::kBF16;
      a.q = q_bytes.data();
      a.weights_raw = w_raw.data();
      a.positions = positions.empty() ? nullptr : positions.data();
      a.rope = RopeConfig{p_.rope.style, p_.rope.dim_offset, p_.rope.rope_dim, inv_freq_.data()};
      a.hadamard = p_.hadamard;
      a.format = fmt;
      a.q_codes = q_codes.data();
      a.q_scales = q_scales.data();
      a.weights_out = weights.data();
      absl::Status st = cpu::RopeQuantQ(a);
      if (!st.ok()) return st;
    } else {
      q_codes.assign(req.q().data().begin(), req.q().data().end());
      if (qt == v1::DTYPE_FP4_E2M1) {
        q_scales.assign(req.q_scales().data().begin(), req.q_scales().data().end());
      }
      weights = w_raw;
    }
    qv.codes = q_codes.data();
    qv.scales = fmt == CacheFormat::kFp4 ? q_scales.data() : nullptr;
    qv.weights = weights.data();

    const CacheView cache = pool.View();
    const int32_t K = p_.topk;
    ans.rows = rows;
    ans.k = K;
    ans.topk.assign(static_cast<size_t>(rows) * K, -7);
    ans.positions.resize(rows);
    ans.logits.resize(rows);
    if (spec.role != config::LayerRole::kCandidateConsumer) {
      DenseArgs a;
      a.cache = cache;
      a.rows = batch;
      a.q = qv;
      a.topk = K;
      a.topk_out = ans.topk.data();
      if (spec.role == config::LayerRole::kCandidateSource) {
        ans.candidates.assign(static_cast<size_t>(rows) * p_.num_candidate_blocks, -7);
        a.candidates_out = ans.candidates.data();
        a.num_candidate_blocks = p_.num_candidate_blocks;
        a.candidate_block_size = p_.candidate_block_size;
      }
      absl::Status st = cpu::DenseTopK(a);
      if (!st.ok()) return st;
      for (int32_t r = 0; r < rows; ++r) {
        std::vector<float> lg = cpu::RowLogits(cache, batch, qv, r);
        ans.logits[r].assign(lg.begin(), lg.end());
        ans.positions[r].resize(row_length[r]);
        std::iota(ans.positions[r].begin(), ans.positions[r].end(), 0);
      }
      if (spec.role == config::LayerRole::kCandidateSource) {
        // Consumers of this step read these, per sequence.
        int32_t r = 0;
        for (int b = 0; b < req.sequences_size(); ++b) {
          Seq& seq = seqs_.at(req.sequences(b).sequence_id());
          seq.candidates.clear();
          seq.candidate_length = seq.length[cl];
          const int n = static_cast<int>(std::count(row_request.begin(), row_request.end(), b));
          for (int j = 0; j < n; ++j, ++r) {
            seq.candidates.insert(seq.candidates.end(),
                                  ans.candidates.begin() + r * p_.num_candidate_blocks,
                                  ans.candidates.begin() + (r + 1) * p_.num_candidate_blocks);
          }
        }
      }
    } else {
      const int32_t nb = p_.num_candidate_blocks, bs = p_.candidate_block_size;
      std::vector<int32_t> cand;
      for (int b = 0; b < req.sequences_size(); ++b) {
        const Seq& seq = seqs_.at(req.sequences(b).sequence_id());
        if (seq.candidate_length != seq.length.at(cl)) {
          return absl::FailedPreconditionError("oracle: no candidates for the current length");
        }
        cand.insert(cand.end(), seq.candidates.begin(), seq.candidates.end());
      }
      if (static_cast<int64_t>(cand.size()) != int64_t{rows} * nb) {
        return absl::FailedPreconditionError("oracle: consumer rows differ from the source's");
      }
      std::vector<int32_t> positions(static_cast<size_t>(rows) * nb * bs), counts(rows);
      ExpandArgs e;
      e.num_rows = rows;
      e.candidates = cand.data();
      e.row_length = row_length.data();
      e.num_candidate_blocks = nb;
      e.candidate_block_size = bs;
      e.out = CandidateExpansion{positions.data(), counts.data(), nb * bs};
      absl::Status st = cpu::ExpandCandidates(e);
      if (!st.ok()) return st;
      SparseArgs a;
      a.cache = cache;
      a.rows = batch;
      a.q = qv;
      a.positions = positions.data();
      a.counts = counts.data();
      a.max_positions = nb * bs;
      a.topk = K;
      a.topk_out = ans.topk.data();
      st = cpu::SparseTopK(a);
      if (!st.ok()) return st;
      for (int32_t r = 0; r < rows; ++r) {
        const int32_t* pr = positions.data() + static_cast<size_t>(r) * nb * bs;
        ans.positions[r].assign(pr, pr + counts[r]);
        std::vector<float> lg(counts[r]);
        cpu::RowLogitsAt(cache, batch, qv, r, pr, counts[r], lg.data());
        ans.logits[r].assign(lg.begin(), lg.end());
      }
    }
    return ans;
  }

 private:
  struct Pool {
    kernels::CacheGeometry geometry;
    std::vector<uint8_t> mem;
    std::vector<int32_t> free_pages;
    kernels::CacheView View() {
      return kernels::CacheView{mem.data(),
                                static_cast<int64_t>(mem.size() / geometry.page_bytes()), geometry};
    }
  };
  struct Seq {
    std::map<int32_t, std::vector<int32_t>> pages;
    std::map<int32_t, int64_t> length;
    std::vector<int32_t> candidates;  // the source's last answer, rows x blocks
    int64_t candidate_length = -1;
  };

  Pool& PoolOf(int32_t cache_layer) {
    auto it = pools_.find(cache_layer);
    if (it != pools_.end()) return it->second;
    Pool& pool = pools_[cache_layer];
    pool.geometry =
        kernels::CacheGeometry{p_.layers.at(cache_layer).cache_format, p_.head_dim, p_.page_size};
    pool.mem.assign(static_cast<size_t>(pages_per_pool_ * pool.geometry.page_bytes()), 0);
    pool.free_pages.resize(pages_per_pool_);
    std::iota(pool.free_pages.begin(), pool.free_pages.end(), 0);
    std::shuffle(pool.free_pages.begin(), pool.free_pages.end(), rng_);  // scattered pages
    return pool;
  }

  static std::vector<float> Floats(const v1::Tensor& t) {
    if (t.dtype() == v1::DTYPE_FP32) return *client::ParseF32(t);
    std::vector<float> out(t.data().size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, t.data().data() + 2 * i, 2);
      out[i] = client::Bf16ToFloat(b);
    }
    return out;
  }

  absl::Status Insert(Seq& seq, int32_t cl, const v1::Tensor& keys, const v1::Tensor& scales) {
    using namespace kernels;
    Pool& pool = PoolOf(cl);
    const int32_t n = static_cast<int32_t>(keys.shape(0));
    int64_t& len = seq.length[cl];
    std::vector<int32_t>& pages = seq.pages[cl];
    std::vector<int64_t> slots(n);
    for (int32_t i = 0; i < n; ++i) {
      const int64_t pos = len + i;
      while (static_cast<int64_t>(pages.size()) <= pos / p_.page_size) {
        if (pool.free_pages.empty()) return absl::ResourceExhaustedError("oracle: out of pages");
        pages.push_back(pool.free_pages.back());
        pool.free_pages.pop_back();
      }
      slots[i] = int64_t{pages[pos / p_.page_size]} * p_.page_size + pos % p_.page_size;
    }
    std::vector<uint8_t> kbytes(keys.data().begin(), keys.data().end());
    std::vector<uint8_t> sbytes(scales.data().begin(), scales.data().end());
    KeyInsertArgs a;
    a.cache = pool.View();
    a.num_keys = n;
    switch (keys.dtype()) {
      case v1::DTYPE_FP32:
        a.key_type = ElemType::kF32;
        break;
      case v1::DTYPE_BF16:
        a.key_type = ElemType::kBF16;
        break;
      case v1::DTYPE_FP8_E4M3:
        a.key_type = ElemType::kFp8E4M3;
        break;
      default:
        a.key_type = ElemType::kFp4E2M1;
        break;
    }
    a.keys = kbytes.data();
    a.key_scales = sbytes.empty() ? nullptr : sbytes.data();
    a.slots = slots.data();
    a.hadamard = p_.hadamard;
    absl::Status s = cpu::InsertKeys(a);
    if (!s.ok()) return s;
    len += n;
    return absl::OkStatus();
  }

  config::Profile p_;
  int64_t pages_per_pool_;
  std::mt19937_64 rng_;
  std::vector<double> inv_freq_;
  std::map<int32_t, Pool> pools_;
  std::map<uint64_t, Seq> seqs_;
};

}  // namespace decode_indexer::testing
