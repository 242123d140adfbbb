// The executor's sequence lifecycle calls (docs/lifecycle.md): truncate, fork, the idle
// release, export and import, each under the executor's turn like every state change.
#include "server/exec/executor_impl.h"

namespace decode_indexer::exec::internal {
namespace {

// An imported cache's entries [0, length): FP8 codes other than the NaN S.1111.111, fp32
// scales positive and finite; FP4 ue8m0 scales other than the NaN 0xFF.
absl::Status CheckCacheImage(const CacheImage& c, const kernels::CacheGeometry& g,
                             const std::string& field) {
  const int64_t P = g.page_size, V = g.value_bytes(), S = g.scale_bytes();
  const bool fp8 = g.format == CacheFormat::kFp8;
  // Whether any of n bytes is an FP8 NaN code (S.1111.111) / a UE8M0 NaN (0xFF): branch-free,
  // so that the compiler vectorizes the scan of a page's values (restores read every byte).
  auto any_fp8_nan = [](const uint8_t* p, int64_t n) {
    uint8_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint8_t>(((p[i] & 0x7F) + 1) >> 7);
    return bad != 0;
  };
  auto any_ff = [](const uint8_t* p, int64_t n) {
    uint8_t all = 0xFF;
    uint8_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint8_t>(p[i] == all);
    return bad != 0;
  };
  for (int64_t first = 0; first < c.length; first += P) {
    const uint8_t* page =
        reinterpret_cast<const uint8_t*>(c.pages.data()) + (first / P) * g.page_bytes();
    const int64_t n = std::min(P, c.length - first);  // the page's entries below the length
    const uint8_t* scales = page + P * V;
    if (fp8) {
      if (any_fp8_nan(page, n * V)) {
        for (int64_t o = 0; o < n; ++o) {
          if (any_fp8_nan(page + o * V, V)) {
            return absl::InvalidArgumentError(
                absl::StrCat(field, ": entry ", first + o, " holds an FP8 NaN code"));
          }
        }
      }
      for (int64_t o = 0; o < n; ++o) {
        float f;
        std::memcpy(&f, scales + o * S, sizeof(f));
        if (!(f > 0) || !std::isfinite(f)) {
          return absl::InvalidArgumentError(absl::StrCat(field, ": entry ", first + o, "'s scale ",
                                                         f, " is not positive and finite"));
        }
      }
    } else if (any_ff(scales, n * S)) {
      for (int64_t o = 0; o < n; ++o) {
        if (any_ff(scales + o * S, S)) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ": entry ", first + o, " holds a NaN scale (0xFF)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

// Calls fn(k, first page id, n) for each run of consecutive page ids pages[k..k+n) (id, id +
// 1, ...), so that an export or import copies a run in one call instead of page by page (a
// cache filled in one go holds its pages in a few runs; on a GPU each call is a DMA).
template <typename F>
absl::Status ForEachPageRun(const std::vector<int32_t>& pages, F&& fn) {
  for (size_t k = 0; k < pages.size();) {
    size_t n = 1;
    while (k + n < pages.size() && int64_t{pages[k + n]} == int64_t{pages[k]} + int64_t(n)) ++n;
    if (absl::Status s = fn(k, pages[k], n); !s.ok()) return s;
    k += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ExecutorImpl::TruncateSequence(uint64_t sequence_id, int64_t length,
                                                       const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("length: must be >= 0, got ", length));
  }
  if (absl::Status s = AskCaller(call_check); !s.ok()) return s;
  seq->last_used_ms = NowMs();
  int64_t freed = 0;
  for (size_t pool = 0; pool < seq->caches.size(); ++pool) {
    state::CachePages& cp = seq->caches[pool];
    if (cp.length <= length) continue;
    const int64_t before = pools_[pool].free();
    TruncateCache(cp, length, profile_.page_size, pools_[pool]);
    freed += pools_[pool].free() - before;
    DropCandidatesOfPool(*seq, static_cast<int32_t>(pool));
  }
  return freed;
}

absl::Status ExecutorImpl::ForkSequence(uint64_t parent_id, uint64_t new_id, int64_t length,
                                        const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  state::SequenceState* parent = table_.Find(parent_id);
  if (parent == nullptr) return NoSequence("parent_id", parent_id);
  if (table_.Find(new_id) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("new_id: sequence ", new_id, " exists"));
  }
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("length: must be >= 0, got ", length));
  }
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  for (size_t pool = 0; pool < parent->caches.size(); ++pool) {
    if (parent->caches[pool].length < length) {
      return absl::OutOfRangeError(absl::StrCat("length: ", length, " is past parent ", parent_id,
                                                "'s length ", parent->caches[pool].length,
                                                " in layer ", cache_layers[pool], "'s cache"));
    }
  }
  if (absl::Status s = table_.CanCreate(new_id); !s.ok()) return s;
  if (absl::Status s = AskCaller(call_check); !s.ok()) return s;
  if (absl::Status s = table_.Create(new_id); !s.ok()) return s;
  idle_released_set_.erase(new_id);
  parent = table_.Find(parent_id);  // Create may have rehashed the table
  state::SequenceState* child = table_.Find(new_id);
  for (size_t pool = 0; pool < parent->caches.size(); ++pool) {
    ShareCache(parent->caches[pool], length, profile_.page_size, pools_[pool], child->caches[pool]);
    RecordTable(static_cast<int32_t>(pool), *child);
  }
  parent->last_used_ms = child->last_used_ms = NowMs();
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> ExecutorImpl::GetSequence(uint64_t sequence_id) {
  if (shut_down_) return Unavailable();
  std::lock_guard lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  seq->last_used_ms = NowMs();
  SequenceInfo info;
  info.sequence_id = sequence_id;
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  for (size_t pool = 0; pool < seq->caches.size(); ++pool) {
    const state::CachePages& cp = seq->caches[pool];
    int64_t shared = 0;
    for (int32_t page : cp.pages) shared += pools_[pool].holders(page) > 1;
    info.caches.push_back({cache_layers[pool], cp.length, int64_t(cp.pages.size()), shared});
  }
  for (const auto& [layer, rec] : seq->candidates) info.candidates.emplace_back(layer, rec.length);
  return info;
}

std::vector<uint64_t> ExecutorImpl::SequenceIds() const {
  std::lock_guard lock(mu_);
  std::vector<uint64_t> ids = table_.Ids();
  std::sort(ids.begin(), ids.end());
  return ids;
}

int64_t ExecutorImpl::ReleaseIdleSequences(int64_t idle_ms) {
  if (shut_down_) return 0;
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return 0;
  std::lock_guard lock(mu_);
  const int64_t now = NowMs();
  int64_t released = 0;
  for (uint64_t id : table_.Ids()) {
    if (now - table_.Find(id)->last_used_ms < idle_ms) continue;
    RemoveLocked(id);
    ++released;
    if (idle_released_set_.insert(id).second) idle_released_.push_back(id);
    while (idle_released_.size() > kIdleMemory) {
      idle_released_set_.erase(idle_released_.front());
      idle_released_.pop_front();
    }
    spdlog::info("sequence {} released after {} ms idle", id, idle_ms);
  }
  return released;
}

absl::StatusOr<SequenceImage> ExecutorImpl::ExportSequence(uint64_t sequence_id) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;
  std::unique_lock lock(mu_);
  state::SequenceState* seq = table_.Find(sequence_id);
  if (seq == nullptr) return NoSequence("sequence_id", sequence_id);
  seq->last_used_ms = NowMs();
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  const int32_t M = profile_.max_rows_per_sequence;
  const int32_t NB = profile_.num_candidate_blocks;
  SequenceImage image;
  image.caches.resize(seq->caches.size());
  for (size_t pool = 0; pool < seq->caches.size(); ++pool) {
    const state::CachePages& cp = seq->caches[pool];
    image.caches[pool].cache_layer = cache_layers[pool];
    image.caches[pool].length = cp.length;
    image.caches[pool].pages.resize(cp.pages.size() * pool_geometry_[pool].page_bytes());
  }
  for (const auto& [layer, rec] : seq->candidates) {
    CandidateImage c;
    c.source_layer = layer;
    c.length = rec.length;
    c.row_lengths = rec.row_lengths;
    c.blocks.resize(size_t(rec.rows) * NB);
    image.candidates.push_back(std::move(c));
  }
  // The caches are read from rank 0's replica (every rank holds the same); the turn keeps any
  // step from changing them meanwhile.
  const state::SequenceState& s = *seq;
  lock.unlock();
  absl::Status status = FirstError(RunOnAllRanks([&](Rank& rank) -> absl::Status {
    if (rank.index() != 0) return absl::OkStatus();
    if (absl::Status st = rank.overlap().Join(); !st.ok()) return st;
    for (size_t pool = 0; pool < s.caches.size(); ++pool) {
      const kernels::CacheView& cache = rank.buffers().caches[pool];
      const int64_t bytes = cache.geometry.page_bytes();
      char* out = image.caches[pool].pages.data();
      if (absl::Status st = ForEachPageRun(s.caches[pool].pages,
                                           [&](size_t k, int32_t page, size_t n) {
                                             return rank.device().CopyToHost(
                                                 out + k * bytes, cache.base + page * bytes,
                                                 n * bytes);
                                           });
          !st.ok()) {
        return st;
      }
    }
    size_t c = 0;
    for (const auto& [layer, rec] : s.candidates) {
      int32_t* store = rank.buffers().candidate_store + int64_t{rec.store_block} * M * NB;
      if (absl::Status st = rank.device().CopyToHost(image.candidates[c++].blocks.data(), store,
                                                     size_t(rec.rows) * NB * sizeof(int32_t));
          !st.ok()) {
        return st;
      }
    }
    return rank.device().Synchronize();
  }));
  if (!status.ok()) return status;
  // The slots past the length hold whatever was there before: zero them, so an image says
  // only what the sequence holds.
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    const kernels::CacheGeometry& g = pool_geometry_[pool];
    const int64_t used = image.caches[pool].length % g.page_size;
    if (used == 0) continue;
    char* last = image.caches[pool].pages.data() + image.caches[pool].pages.size() - g.page_bytes();
    const int64_t V = g.value_bytes(), S = g.scale_bytes(), P = g.page_size;
    std::memset(last + used * V, 0, (P - used) * V);
    std::memset(last + P * V + used * S, 0, (P - used) * S);
  }
  return image;
}

absl::Status ExecutorImpl::ImportSequence(uint64_t sequence_id, const SequenceImage& image,
                                          const CallCheck& call_check) {
  if (shut_down_) return Unavailable();
  FifoTurns::Turn turn = turns_.Wait();
  if (shut_down_) return Unavailable();
  if (absl::Status s = CheckHealthy(); !s.ok()) return s;
  std::unique_lock lock(mu_);
  const std::vector<int32_t> cache_layers = profile_.CacheLayers();
  const int32_t P = profile_.page_size;
  const int32_t M = profile_.max_rows_per_sequence;
  const int32_t NB = profile_.num_candidate_blocks;
  if (table_.Find(sequence_id) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("sequence_id: sequence ", sequence_id, " exists"));
  }
  if (image.caches.size() != cache_layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "caches: ", image.caches.size(), " caches for a profile with ", cache_layers.size()));
  }
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    const CacheImage& c = image.caches[pool];
    const std::string field = absl::StrCat("caches[", pool, "]");
    if (c.cache_layer != cache_layers[pool]) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".cache_layer: ", c.cache_layer, ", expected ", cache_layers[pool]));
    }
    if (c.length < 0 || c.length > profile_.max_context) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".length: ", c.length, " is out of [0, ", profile_.max_context, "]"));
    }
    const int64_t want = CeilDiv(c.length, P) * pool_geometry_[pool].page_bytes();
    if (int64_t(c.pages.size()) != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".pages: ", c.pages.size(), " bytes, expected ", want, " for length ", c.length));
    }
  }
  // The bytes must be what a write could have left (an image is not trusted because its
  // checksums agree): no NaN codes or scales, positive finite FP8 scales.
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    if (absl::Status s = CheckCacheImage(image.caches[pool], pool_geometry_[pool],
                                         absl::StrCat("caches[", pool, "].pages"));
        !s.ok()) {
      return s;
    }
  }
  std::set<int32_t> sources;
  for (size_t i = 0; i < image.candidates.size(); ++i) {
    const CandidateImage& c = image.candidates[i];
    const std::string field = absl::StrCat("candidates[", i, "]");
    const LayerSpec* spec = profile_.FindLayer(c.source_layer);
    if (spec == nullptr || spec->role != LayerRole::kCandidateSource ||
        !sources.insert(c.source_layer).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".source_layer: ", c.source_layer, " is not a (new) source layer"));
    }
    const int64_t rows = int64_t(c.row_lengths.size());
    if (rows < 1 || rows > M || int64_t(c.blocks.size()) != rows * NB ||
        c.length != image.caches[pool_of_layer_[spec->cache_layer]].length) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": rows, blocks or length do not fit the profile and the caches"));
    }
    // Each row: ascending block ids below its length's blocks, then -1 (spec section 7), as a
    // consumer reads them without checking.
    for (int64_t j = 0; j < rows; ++j) {
      const int32_t rl = c.row_lengths[j];
      if (rl < 1 || rl > c.length) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".row_lengths[", j, "]: ", rl, " is out of [1, ", c.length, "]"));
      }
      const int64_t blocks = CeilDiv(rl, profile_.candidate_block_size);
      int64_t prev = -1;
      bool padding = false;
      for (int32_t b = 0; b < NB; ++b) {
        const int32_t v = c.blocks[j * NB + b];
        const bool ok = v == -1 ? (padding = true) : (!padding && v > prev && v < blocks);
        if (!ok) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".blocks: row ", j, " entry ", b, " (", v,
                           ") is not an ascending block id below ", blocks, " or -1 padding"));
        }
        if (v != -1) prev = v;
      }
    }
  }
  // Reserve all-or-nothing.
  std::vector<std::vector<int32_t>> pages(image.caches.size());
  std::vector<int32_t> blocks;
  auto give_back = [&] {
    for (size_t pool = 0; pool < pages.size(); ++pool) pools_[pool].Release(pages[pool]);
    if (!blocks.empty()) store_blocks_->Release(blocks);
  };
  for (size_t pool = 0; pool < image.caches.size(); ++pool) {
    absl::StatusOr<std::vector<int32_t>> got =
        pools_[pool].Reserve(CeilDiv(image.caches[pool].length, P));
    if (!got.ok()) {
      give_back();
      return got.status();
    }
    pages[pool] = *std::move(got);
  }
  if (!image.candidates.empty()) {
    absl::StatusOr<std::vector<int32_t>> got = store_blocks_->Reserve(image.candidates.size());
    if (!got.ok()) {
      give_back();
      return got.status();
    }
    blocks = *std::move(got);
  }
  if (absl::Status s = table_.CanCreate(sequence_id); !s.ok()) {
    give_back();
    return s;
  }
  lock.unlock();
  absl::Status status = FirstError(RunOnAllRanks([&](Rank& rank) -> absl::Status {
    if (absl::Status st = rank.overlap().Join(); !st.ok()) return st;
    for (size_t pool = 0; pool < pages.size(); ++pool) {
      const kernels::CacheView& cache = rank.buffers().caches[pool];
      const int64_t bytes = cache.geometry.page_bytes();
      const char* in = image.caches[pool].pages.data();
      if (absl::Status st = ForEachPageRun(pages[pool],
                                           [&](size_t k, int32_t page, size_t n) {
                                             return rank.device().CopyToDevice(
                                                 cache.base + page * bytes, in + k * bytes,
                                                 n * bytes);
                                           });
          !st.ok()) {
        return st;
      }
    }
    for (size_t c = 0; c < blocks.size(); ++c) {
      int32_t* store = rank.buffers().candidate_store + int64_t{blocks[c]} * M * NB;
      if (absl::Status st =
              rank.device().CopyToDevice(store, image.candidates[c].blocks.data(),
                                         image.candidates[c].blocks.size() * sizeof(int32_t));
          !st.ok()) {
        return st;
      }
    }
    return rank.device().Synchronize();
  }));
  if (status.ok()) status = AskCaller(call_check);
  lock.lock();
  if (!status.ok()) {
    give_back();
    return status;
  }
  if (absl::Status s = table_.Create(sequence_id); !s.ok()) {
    give_back();
    return s;
  }
  idle_released_set_.erase(sequence_id);
  state::SequenceState* seq = table_.Find(sequence_id);
  seq->last_used_ms = NowMs();
  for (size_t pool = 0; pool < pages.size(); ++pool) {
    AdoptCache(seq->caches[pool], std::move(pages[pool]), image.caches[pool].length);
    RecordTable(static_cast<int32_t>(pool), *seq);
  }
  for (size_t c = 0; c < blocks.size(); ++c) {
    const CandidateImage& ci = image.candidates[c];
    state::CandidateRecord& rec = seq->candidates[ci.source_layer];
    rec.version = next_candidate_version_++;
    rec.length = ci.length;
    rec.rows = static_cast<int32_t>(ci.row_lengths.size());
    rec.row_lengths = ci.row_lengths;
    rec.store_block = blocks[c];
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::exec::internal
