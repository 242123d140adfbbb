#include "tests/server/exec_harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "gtest/gtest.h"
#include "reference/reference.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

using config::LayerRole;
using kernels::CacheFormat;
using kernels::ElemType;

uint16_t ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

uint64_t FreshSeed() { return TestSeed(); }

config::Profile SmallV41() {
  config::Profile p = *config::BuiltinProfile("v41");
  p.name = "v41-test";
  p.num_heads = 4;
  p.topk = 24;
  p.page_size = 16;
  p.max_context = 1024;
  p.candidate_block_size = 4;
  p.num_candidate_blocks = 10;
  p.max_rows_per_sequence = 4;
  p.layers.clear();
  p.layers.push_back({0, LayerRole::kDense, 0, CacheFormat::kFp4});
  p.layers.push_back({1, LayerRole::kCandidateSource, 1, CacheFormat::kFp4});
  p.layers.push_back({2, LayerRole::kCandidateConsumer, 1, CacheFormat::kFp4});
  p.layers.push_back({3, LayerRole::kCandidateConsumer, 1, CacheFormat::kFp4});
  return p;
}

config::Profile FullWidthV32(int64_t max_context) {
  config::Profile p = *config::BuiltinProfile("v32");
  p.max_context = max_context;
  p.layers.resize(2);
  return p;
}

config::Profile FullWidthV41(int64_t max_context) {
  config::Profile p = *config::BuiltinProfile("v41");
  p.max_context = max_context;
  p.num_candidate_blocks = 256;
  p.layers.resize(6);
  p.layers[0] = {0, config::LayerRole::kDense, 0, kernels::CacheFormat::kFp4};
  p.layers[1] = {1, config::LayerRole::kCandidateSource, 1, kernels::CacheFormat::kFp4};
  for (int32_t i = 2; i < 6; ++i) {
    p.layers[i] = {i, config::LayerRole::kCandidateConsumer, 1, kernels::CacheFormat::kFp4};
  }
  return p;
}

config::Profile SmallV32() {
  config::Profile p = *config::BuiltinProfile("v32");
  p.name = "v32-test";
  p.num_heads = 4;
  p.topk = 32;
  p.page_size = 16;
  p.max_context = 1024;
  p.max_rows_per_sequence = 4;
  p.hadamard = true;
  p.layers.resize(2);
  return p;
}

exec::ExecutorOptions CpuOptions(int32_t ranks) {
  exec::ExecutorOptions o;
  o.backend = "cpu";
  o.ranks = ranks;
  o.cache_pages = 512;
  o.row_shard_min_requests = 2;
  o.max_sequences = 64;
  o.max_requests_per_step = 16;
  o.cpu_threads = 1;
  return o;
}

Harness::Harness(config::Profile profile, uint64_t seed)
    : profile_(std::move(profile)), rng_(seed), rope_(RefRope(profile_)) {
  inv_freq_ = reference::InvFreq(rope_);
}

void Harness::RandomKeys(int32_t layer, int32_t count, KeyForm form, std::vector<uint8_t>* keys,
                         std::vector<uint8_t>* scales, ElemType* type) {
  const int32_t D = profile_.head_dim;
  const CacheFormat format = profile_.layers[layer].cache_format;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> magnitude(0.25f, 4.0f);
  std::vector<float> values(size_t(count) * D);
  for (int32_t i = 0; i < count; ++i) {
    // Keys of different magnitudes, so the quantization scales differ between keys.
    const float m = magnitude(rng_);
    for (int32_t d = 0; d < D; ++d) values[size_t(i) * D + d] = normal(rng_) * m;
  }
  scales->clear();
  switch (form) {
    case KeyForm::kF32:
      *type = ElemType::kF32;
      keys->resize(values.size() * 4);
      std::memcpy(keys->data(), values.data(), keys->size());
      break;
    case KeyForm::kBF16: {
      *type = ElemType::kBF16;
      keys->resize(values.size() * 2);
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t b = ToBF16(values[i]);
        std::memcpy(keys->data() + 2 * i, &b, 2);
      }
      break;
    }
    case KeyForm::kQuantized:
      if (format == CacheFormat::kFp8) {
        *type = ElemType::kFp8E4M3;
        keys->resize(size_t(count) * D);
        scales->resize(size_t(count) * 4);
        for (int32_t i = 0; i < count; ++i) {
          const float s =
              reference::QuantizeFp8(&values[size_t(i) * D], D, keys->data() + size_t(i) * D);
          std::memcpy(scales->data() + 4 * size_t(i), &s, 4);
        }
      } else {
        *type = ElemType::kFp4E2M1;
        keys->resize(size_t(count) * D / 2);
        scales->resize(size_t(count) * D / 32);
        for (int32_t i = 0; i < count; ++i) {
          reference::QuantizeFp4(&values[size_t(i) * D], D, keys->data() + size_t(i) * D / 2,
                                 scales->data() + size_t(i) * D / 32);
        }
      }
      break;
  }
}

std::unique_ptr<StepData> Harness::MakeStep(int32_t layer, const std::vector<SeqPlan>& seqs,
                                            QForm q_form, KeyForm key_form, bool with_positions) {
  auto step = std::make_unique<StepData>();
  const int32_t H = profile_.num_heads;
  const int32_t D = profile_.head_dim;
  const int32_t cache_layer = profile_.layers[layer].cache_layer;
  const CacheFormat format = profile_.layers[layer].cache_format;
  exec::StepInput& in = step->input;
  in.layer = layer;
  in.step_id = rng_();
  step->keys.resize(seqs.size());
  step->scales.resize(seqs.size());
  int32_t rows = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    exec::SequenceStepInput s;
    s.sequence_id = seqs[i].id;
    s.num_rows = seqs[i].rows;
    s.row_lengths = seqs[i].row_lengths;
    if (seqs[i].new_keys > 0) {
      RandomKeys(cache_layer, seqs[i].new_keys, key_form, &step->keys[i], &step->scales[i],
                 &s.new_keys.type);
      s.new_keys.count = seqs[i].new_keys;
      s.new_keys.keys = step->keys[i].data();
      s.new_keys.scales = step->scales[i].empty() ? nullptr : step->scales[i].data();
    }
    rows += seqs[i].rows;
    in.sequences.push_back(std::move(s));
  }
  in.num_rows = rows;

  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> weight(-1.0f, 2.0f);
  std::uniform_int_distribution<int64_t> position(0, profile_.max_context - 1);
  std::vector<float> q(size_t(rows) * H * D);
  for (float& v : q) v = normal(rng_);
  step->weights.resize(size_t(rows) * H);
  for (float& w : step->weights) w = weight(rng_);
  if (with_positions) {
    step->positions.resize(rows);
    for (int64_t& p : step->positions) p = position(rng_);
  }
  switch (q_form) {
    case QForm::kF32:
      step->q.resize(q.size() * 4);
      std::memcpy(step->q.data(), q.data(), step->q.size());
      in.q.type = ElemType::kF32;
      in.q.positions = with_positions ? step->positions.data() : nullptr;
      break;
    case QForm::kBF16:
      step->q.resize(q.size() * 2);
      for (size_t i = 0; i < q.size(); ++i) {
        const uint16_t b = ToBF16(q[i]);
        std::memcpy(step->q.data() + 2 * i, &b, 2);
      }
      in.q.type = ElemType::kBF16;
      in.q.positions = with_positions ? step->positions.data() : nullptr;
      break;
    case QForm::kQuantized: {
      // Quantized by the client with the independent reference: RoPE, Hadamard, codes and
      // the folded weights (spec sections 2 and 3).
      const bool fp8 = format == CacheFormat::kFp8;
      step->q.resize(size_t(rows) * H * (fp8 ? D : D / 2));
      step->q_scales.resize(fp8 ? 0 : size_t(rows) * H * D / 32);
      std::vector<float> folded(size_t(rows) * H);
      const float c = static_cast<float>(1.0 / std::sqrt(double(H) * D));
      std::vector<float> x(D);
      for (int32_t r = 0; r < rows; ++r) {
        for (int32_t hh = 0; hh < H; ++hh) {
          const size_t v = size_t(r) * H + hh;
          std::copy(q.begin() + v * D, q.begin() + (v + 1) * D, x.begin());
          if (with_positions) reference::ApplyRope(x.data(), step->positions[r], rope_, inv_freq_);
          if (profile_.hadamard) reference::Hadamard(x.data(), D);
          if (fp8) {
            const float s = reference::QuantizeFp8(x.data(), D, step->q.data() + v * D);
            folded[v] = (step->weights[v] * c) * s;
          } else {
            reference::QuantizeFp4(x.data(), D, step->q.data() + v * D / 2,
                                   step->q_scales.data() + v * D / 32);
            folded[v] = step->weights[v] * c;
          }
        }
      }
      step->weights = folded;
      in.q.type = fp8 ? ElemType::kFp8E4M3 : ElemType::kFp4E2M1;
      in.q.scales = fp8 ? nullptr : step->q_scales.data();
      in.q.positions = nullptr;
      break;
    }
  }
  in.q.q = step->q.data();
  in.q.weights = step->weights.data();
  return step;
}

void Harness::RecordAppend(uint64_t id, int32_t layer, const exec::KeysInput& keys) {
  const int32_t D = profile_.head_dim;
  const int64_t vb = keys.type == ElemType::kF32       ? 4 * D
                     : keys.type == ElemType::kBF16    ? 2 * D
                     : keys.type == ElemType::kFp8E4M3 ? D
                                                       : D / 2;
  const int64_t sb = keys.type == ElemType::kFp8E4M3   ? 4
                     : keys.type == ElemType::kFp4E2M1 ? D / 32
                                                       : 0;
  KeyBatch b{keys.type, keys.count, {}, {}};
  const auto* k = static_cast<const uint8_t*>(keys.keys);
  b.keys.assign(k, k + vb * keys.count);
  if (sb > 0) {
    const auto* s = static_cast<const uint8_t*>(keys.scales);
    b.scales.assign(s, s + sb * keys.count);
  }
  SeqModel& m = model_[id];
  m.inserts[layer].push_back(std::move(b));
  m.length[layer] += keys.count;
}

void Harness::RecordStep(const StepData& step) {
  const int32_t cache_layer = profile_.layers[step.input.layer].cache_layer;
  for (const exec::SequenceStepInput& s : step.input.sequences) {
    if (s.new_keys.count > 0) RecordAppend(s.sequence_id, cache_layer, s.new_keys);
  }
}

int64_t Harness::Length(uint64_t id, int32_t cache_layer) const {
  auto it = model_.find(id);
  if (it == model_.end()) return 0;
  auto l = it->second.length.find(cache_layer);
  return l == it->second.length.end() ? 0 : l->second;
}

Harness::Answer Harness::Oracle(const StepData& step) {
  const exec::StepInput& in = step.input;
  const config::LayerSpec& spec = profile_.layers[in.layer];
  const int32_t H = profile_.num_heads;
  const int32_t D = profile_.head_dim;
  const int32_t K = profile_.topk;
  const int32_t NB = profile_.num_candidate_blocks;
  const int32_t BS = profile_.candidate_block_size;
  const reference::Format format = RefFormat(spec.cache_format);
  const bool fp8 = format == reference::Format::kFp8;
  const int32_t rows = in.num_rows;
  const bool source = spec.role == LayerRole::kCandidateSource;

  Answer out;
  out.rows = rows;
  out.k = K;
  out.num_candidate_blocks = NB;
  out.candidate_block_size = BS;
  out.topk.assign(size_t(rows) * K, -2);
  out.positions.resize(rows);
  out.logits.resize(rows);
  if (source) out.candidates.assign(size_t(rows) * NB, -2);
  int32_t row0 = 0;
  for (const exec::SequenceStepInput& s : in.sequences) {
    SeqModel& m = model_[s.sequence_id];
    const int64_t L = m.length[spec.cache_layer];
    // The sequence's entries, dequantized, from every accepted insert in order (the inserts
    // not yet applied since the last call).
    auto [it, fresh] = m.entries.try_emplace(spec.cache_layer, format, D);
    reference::Cache& cache = it->second;
    size_t& applied = m.applied[spec.cache_layer];
    const std::vector<KeyBatch>& inserts = m.inserts[spec.cache_layer];
    for (; applied < inserts.size(); ++applied) {
      const KeyBatch& b = inserts[applied];
      switch (b.type) {
        case ElemType::kF32:
          cache.AppendFloat(reinterpret_cast<const float*>(b.keys.data()), b.count,
                            profile_.hadamard);
          break;
        case ElemType::kBF16: {
          std::vector<float> f(size_t(b.count) * D);
          for (size_t i = 0; i < f.size(); ++i) {
            uint16_t u;
            std::memcpy(&u, b.keys.data() + 2 * i, 2);
            f[i] = Bf16Bits(u);
          }
          cache.AppendFloat(f.data(), b.count, profile_.hadamard);
          break;
        }
        case ElemType::kFp8E4M3:
          cache.AppendFp8(b.keys.data(), b.scales.data(), b.count);
          break;
        default:
          cache.AppendFp4(b.keys.data(), b.scales.data(), b.count);
          break;
      }
    }
    EXPECT_EQ(cache.size(), L);
    for (int32_t j = 0; j < s.num_rows; ++j) {
      const int32_t r = row0 + j;
      const int32_t len =
          s.row_lengths.empty() ? static_cast<int32_t>(L - s.num_rows + j + 1) : s.row_lengths[j];
      const size_t v = size_t(r) * H;
      reference::Query q;
      if (in.q.type == ElemType::kF32 || in.q.type == ElemType::kBF16) {
        std::vector<float> qf(size_t(H) * D);
        if (in.q.type == ElemType::kF32) {
          std::memcpy(qf.data(), static_cast<const float*>(in.q.q) + v * D, qf.size() * 4);
        } else {
          const auto* b16 = static_cast<const uint16_t*>(in.q.q) + v * D;
          for (size_t i = 0; i < qf.size(); ++i) qf[i] = Bf16Bits(b16[i]);
        }
        const bool rope = in.q.positions != nullptr && rope_.style != reference::RopeStyle::kNone;
        q = reference::QueryFloat(qf.data(), in.q.weights + v, H, D, format,
                                  rope ? &rope_ : nullptr, &inv_freq_, rope ? in.q.positions[r] : 0,
                                  profile_.hadamard);
      } else if (fp8) {
        q = reference::QueryFp8(static_cast<const uint8_t*>(in.q.q) + v * D, in.q.weights + v, H,
                                D);
      } else {
        q = reference::QueryFp4(static_cast<const uint8_t*>(in.q.q) + v * D / 2,
                                in.q.scales + v * D / 32, in.q.weights + v, H, D);
      }
      int32_t* topk = out.topk.data() + size_t(r) * K;
      if (spec.role == LayerRole::kCandidateConsumer) {
        EXPECT_EQ(m.candidates.size(), size_t(s.num_rows) * NB);
        if (m.candidates.size() < size_t(j + 1) * NB) continue;
        out.positions[r] =
            reference::ExpandBlocks(m.candidates.data() + size_t(j) * NB, NB, BS, len);
        out.logits[r] = reference::LogitsAt(q, cache, out.positions[r]);
        const std::vector<int32_t> top = reference::NaiveTopK(out.logits[r], K, &out.positions[r]);
        std::copy(top.begin(), top.end(), topk);
      } else {
        out.logits[r] = reference::DenseLogits(q, cache, len);
        out.positions[r].resize(len);
        std::iota(out.positions[r].begin(), out.positions[r].end(), 0);
        const std::vector<int32_t> top = reference::NaiveTopK(out.logits[r], K);
        std::copy(top.begin(), top.end(), topk);
        if (source) {
          const std::vector<int32_t> blocks = reference::CandidateBlocks(out.logits[r], NB, BS);
          std::copy(blocks.begin(), blocks.end(), out.candidates.begin() + size_t(r) * NB);
        }
      }
    }
    if (source) {
      m.candidates.assign(out.candidates.begin() + size_t(row0) * NB,
                          out.candidates.begin() + size_t(row0 + s.num_rows) * NB);
    }
    row0 += s.num_rows;
  }
  return out;
}

void Harness::AdoptCandidates(const StepData& step, const std::vector<int32_t>& blocks) {
  const int32_t NB = profile_.num_candidate_blocks;
  size_t at = 0;
  for (const exec::SequenceStepInput& s : step.input.sequences) {
    const size_t n = size_t(s.num_rows) * NB;
    if (at + n > blocks.size()) return;
    model_[s.sequence_id].candidates.assign(blocks.begin() + at, blocks.begin() + at + n);
    at += n;
  }
}

::testing::AssertionResult Harness::Check(const StepData& step, const exec::StepResult& result) {
  const Answer want = Oracle(step);
  const bool source = profile_.layers[step.input.layer].role == LayerRole::kCandidateSource;
  ::testing::AssertionResult ok = want.Matches(
      result.topk_indices,
      source && step.input.return_candidates ? result.candidate_blocks : std::vector<int32_t>{});
  if (ok && source && step.input.return_candidates) {
    if (result.candidate_blocks.size() != want.candidates.size()) {
      return ::testing::AssertionFailure() << "candidate blocks: " << result.candidate_blocks.size()
                                           << " entries, expected " << want.candidates.size();
    }
    AdoptCandidates(step, result.candidate_blocks);
  }
  return ok;
}

}  // namespace decode_indexer::testing
