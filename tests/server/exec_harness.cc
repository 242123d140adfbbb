#include "tests/server/exec_harness.h"

#include <algorithm>
#include <cstring>

#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/rope.h"
#include "gtest/gtest.h"

namespace decode_indexer::testing {
namespace {

using config::LayerRole;
using kernels::CacheFormat;
using kernels::ElemType;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint16_t ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

uint64_t FreshSeed() {
  return std::random_device{}() * 0x9E3779B97F4A7C15ull ^ std::random_device{}();
}

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
    : profile_(std::move(profile)), rng_(seed) {
  if (profile_.rope.style != kernels::RopeStyle::kNone) {
    inv_freq_ = kernels::ComputeInvFreq(profile_.rope);
  }
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
              kernels::cpu::QuantizeFp8(&values[size_t(i) * D], D, keys->data() + size_t(i) * D);
          std::memcpy(scales->data() + 4 * size_t(i), &s, 4);
        }
      } else {
        *type = ElemType::kFp4E2M1;
        keys->resize(size_t(count) * D / 2);
        scales->resize(size_t(count) * D / 32);
        for (int32_t i = 0; i < count; ++i) {
          kernels::cpu::QuantizeFp4(&values[size_t(i) * D], D, keys->data() + size_t(i) * D / 2,
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
      // Quantized by the reference itself: the client-side rope_quant_q.
      const bool fp8 = format == CacheFormat::kFp8;
      step->q.resize(size_t(rows) * H * (fp8 ? D : D / 2));
      step->q_scales.resize(fp8 ? 0 : size_t(rows) * H * D / 32);
      std::vector<float> folded(size_t(rows) * H);
      kernels::QPrepArgs prep;
      prep.num_rows = rows;
      prep.num_heads = H;
      prep.head_dim = D;
      prep.q_type = ElemType::kF32;
      prep.q = q.data();
      prep.weights_raw = step->weights.data();
      prep.positions = with_positions ? step->positions.data() : nullptr;
      prep.rope = {profile_.rope.style, profile_.rope.dim_offset, profile_.rope.rope_dim,
                   inv_freq_.data()};
      prep.hadamard = profile_.hadamard;
      prep.format = format;
      prep.q_codes = step->q.data();
      prep.q_scales = fp8 ? nullptr : step->q_scales.data();
      prep.weights_out = folded.data();
      EXPECT_TRUE(kernels::cpu::RopeQuantQ(prep).ok());
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
  const int32_t P = profile_.page_size;
  const int32_t NB = profile_.num_candidate_blocks;
  const CacheFormat format = spec.cache_format;
  const kernels::CacheGeometry geometry{format, D, P};
  const int32_t rows = in.num_rows;

  // q exactly as the server must prepare it.
  std::vector<uint8_t> codes;
  std::vector<uint8_t> qscales;
  std::vector<float> weights;
  const bool fp8 = format == CacheFormat::kFp8;
  if (in.q.type == ElemType::kF32 || in.q.type == ElemType::kBF16) {
    codes.resize(size_t(rows) * H * (fp8 ? D : D / 2));
    qscales.resize(size_t(rows) * H * D / 32);
    weights.resize(size_t(rows) * H);
    kernels::QPrepArgs prep;
    prep.num_rows = rows;
    prep.num_heads = H;
    prep.head_dim = D;
    prep.q_type = in.q.type;
    prep.q = in.q.q;
    prep.weights_raw = in.q.weights;
    prep.positions = in.q.positions;
    prep.rope = {profile_.rope.style, profile_.rope.dim_offset, profile_.rope.rope_dim,
                 inv_freq_.data()};
    prep.hadamard = profile_.hadamard;
    prep.format = format;
    prep.q_codes = codes.data();
    prep.q_scales = fp8 ? nullptr : qscales.data();
    prep.weights_out = weights.data();
    EXPECT_TRUE(kernels::cpu::RopeQuantQ(prep).ok());
  } else {
    const auto* c = static_cast<const uint8_t*>(in.q.q);
    codes.assign(c, c + size_t(rows) * H * (fp8 ? D : D / 2));
    if (!fp8) qscales.assign(in.q.scales, in.q.scales + size_t(rows) * H * D / 32);
    weights.assign(in.q.weights, in.q.weights + size_t(rows) * H);
  }

  Answer out;
  out.topk.assign(size_t(rows) * K, -2);
  if (spec.role == LayerRole::kCandidateSource) out.candidates.assign(size_t(rows) * NB, -2);
  int32_t row0 = 0;
  for (const exec::SequenceStepInput& s : in.sequences) {
    SeqModel& m = model_[s.sequence_id];
    const int64_t L = m.length[spec.cache_layer];
    // The sequence's cache, contiguous: position p in page p / P.
    const int64_t pages = std::max<int64_t>(1, CeilDiv(L, P));
    std::vector<uint8_t> buffer(size_t(pages * geometry.page_bytes()));
    kernels::CacheView cache{buffer.data(), pages, geometry};
    int64_t at = 0;
    for (const KeyBatch& b : m.inserts[spec.cache_layer]) {
      std::vector<int64_t> slots(b.count);
      for (int32_t i = 0; i < b.count; ++i) slots[i] = at + i;
      kernels::KeyInsertArgs ins;
      ins.cache = cache;
      ins.num_keys = b.count;
      ins.key_type = b.type;
      ins.keys = b.keys.data();
      ins.key_scales = b.scales.empty() ? nullptr : b.scales.data();
      ins.slots = slots.data();
      ins.hadamard = profile_.hadamard;
      EXPECT_TRUE(kernels::cpu::InsertKeys(ins).ok());
      at += b.count;
    }
    std::vector<int32_t> page_table(pages);
    for (int64_t i = 0; i < pages; ++i) page_table[i] = static_cast<int32_t>(i);
    std::vector<int32_t> row_request(s.num_rows, 0);
    std::vector<int32_t> row_length(s.num_rows);
    for (int32_t j = 0; j < s.num_rows; ++j) {
      row_length[j] =
          s.row_lengths.empty() ? static_cast<int32_t>(L - s.num_rows + j + 1) : s.row_lengths[j];
    }
    kernels::RowBatch batch;
    batch.num_rows = s.num_rows;
    batch.row_request = row_request.data();
    batch.row_length = row_length.data();
    batch.page_table = page_table.data();
    batch.page_table_stride = static_cast<int32_t>(pages);
    batch.num_requests = 1;
    batch.max_row_length = *std::max_element(row_length.begin(), row_length.end());
    kernels::QView qv;
    qv.codes = codes.data() + size_t(row0) * H * (fp8 ? D : D / 2);
    qv.scales = fp8 ? nullptr : qscales.data() + size_t(row0) * H * D / 32;
    qv.weights = weights.data() + size_t(row0) * H;
    qv.num_heads = H;
    int32_t* topk = out.topk.data() + size_t(row0) * K;
    if (spec.role == LayerRole::kCandidateConsumer) {
      // The masked consumer as the oracle: independent of the expansion the executor uses.
      kernels::MaskedArgs a;
      a.cache = cache;
      a.rows = batch;
      a.q = qv;
      a.candidates = m.candidates.data();
      a.num_candidate_blocks = NB;
      a.candidate_block_size = profile_.candidate_block_size;
      a.topk = K;
      a.topk_out = topk;
      EXPECT_EQ(m.candidates.size(), size_t(s.num_rows) * NB);
      EXPECT_TRUE(kernels::cpu::MaskedTopK(a).ok());
    } else {
      kernels::DenseArgs a;
      a.cache = cache;
      a.rows = batch;
      a.q = qv;
      a.topk = K;
      a.topk_out = topk;
      if (spec.role == LayerRole::kCandidateSource) {
        a.candidates_out = out.candidates.data() + size_t(row0) * NB;
        a.num_candidate_blocks = NB;
        a.candidate_block_size = profile_.candidate_block_size;
      }
      EXPECT_TRUE(kernels::cpu::DenseTopK(a).ok());
      if (spec.role == LayerRole::kCandidateSource) {
        m.candidates.assign(out.candidates.begin() + size_t(row0) * NB,
                            out.candidates.begin() + size_t(row0 + s.num_rows) * NB);
      }
    }
    row0 += s.num_rows;
  }
  return out;
}

}  // namespace decode_indexer::testing
