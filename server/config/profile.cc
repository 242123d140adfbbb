// The built-in profiles, the layer-plan queries and ValidateProfile.
#include "server/config/profile.h"

#include <limits>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace decode_indexer::config {
namespace {

using kernels::CacheFormat;
using kernels::RopeStyle;

Profile V32() {
  Profile p;
  p.name = "v32";
  p.num_heads = 64;
  p.head_dim = 128;
  p.topk = 2048;
  p.page_size = 64;
  p.max_context = 163840;
  p.candidate_block_size = 0;
  p.num_candidate_blocks = 0;
  p.max_rows_per_sequence = 8;
  p.hadamard = false;
  p.rope.style = RopeStyle::kNeox;
  p.rope.dim_offset = 0;
  p.rope.rope_dim = 64;
  p.rope.theta = 10000.0;
  p.rope.yarn = true;
  p.rope.yarn_factor = 40.0;
  p.rope.yarn_original_max_position = 4096;
  p.rope.yarn_beta_fast = 32.0;
  p.rope.yarn_beta_slow = 1.0;
  for (int32_t i = 0; i < 61; ++i) {
    p.layers.push_back({i, LayerRole::kDense, i, CacheFormat::kFp8});
  }
  return p;
}

Profile V41() {
  Profile p;
  p.name = "v41";
  p.num_heads = 32;
  p.head_dim = 128;
  p.topk = 512;
  p.page_size = 64;
  p.max_context = 1048576;
  p.candidate_block_size = 8;
  p.num_candidate_blocks = 2048;
  p.max_rows_per_sequence = 8;
  p.hadamard = false;
  p.rope.style = RopeStyle::kInterleaved;
  p.rope.dim_offset = 64;
  p.rope.rope_dim = 64;
  p.rope.theta = 10000.0;
  p.rope.yarn = false;
  // The layer plan. We keep V3.2's 61-layer depth; the spec's V4.1 description has one
  // candidate source whose cache every consumer reads, so there is exactly one; and the first
  // layers stay dense with their own caches because the early layers' attention is broad
  // (their top-k is not well predicted by another layer's candidates). Layers 0-2 dense,
  // layer 3 the source, layers 4-60 consumers of layer 3.
  for (int32_t i = 0; i < 61; ++i) {
    LayerSpec l{i, LayerRole::kDense, i, CacheFormat::kFp4};
    if (i == 3) l.role = LayerRole::kCandidateSource;
    if (i > 3) {
      l.role = LayerRole::kCandidateConsumer;
      l.cache_layer = 3;
    }
    p.layers.push_back(l);
  }
  return p;
}

bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

std::vector<int32_t> Profile::CacheLayers() const {
  std::vector<int32_t> out;
  for (const LayerSpec& l : layers) {
    if (l.role != LayerRole::kCandidateConsumer) out.push_back(l.layer);
  }
  return out;
}

const LayerSpec* Profile::FindLayer(int32_t layer) const {
  if (layer < 0 || layer >= static_cast<int32_t>(layers.size())) return nullptr;
  return &layers[layer];
}

int32_t Profile::SourceLayerOf(int32_t consumer_layer) const {
  const LayerSpec* l = FindLayer(consumer_layer);
  return l == nullptr ? -1 : l->cache_layer;
}

absl::StatusOr<Profile> BuiltinProfile(const std::string& name) {
  if (name == "v32") return V32();
  if (name == "v41") return V41();
  return absl::NotFoundError(
      absl::StrCat("no built-in profile \"", name, "\" (built-ins: v32, v41)"));
}

absl::Status ValidateProfile(const Profile& p) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("profile \"", p.name, "\": ", parts...));
  };
  if (p.name.empty()) return absl::InvalidArgumentError("profile: name must not be empty");
  if (p.num_heads < 1 || p.num_heads > 1024) {
    return bad("num_heads must be in [1, 1024], got ", p.num_heads);
  }
  // FP4 keeps one scale per 32 dims and the FP8 path is tested at D = 128; every D the
  // kernels take is a multiple of 32.
  if (p.head_dim < 32 || p.head_dim > 1024 || p.head_dim % 32 != 0) {
    return bad("head_dim must be a multiple of 32 in [32, 1024], got ", p.head_dim);
  }
  if (p.hadamard && !IsPowerOfTwo(p.head_dim)) {
    return bad("hadamard needs a power-of-two head_dim, got ", p.head_dim);
  }
  if (p.topk < 1 || p.topk > 65536) return bad("topk must be in [1, 65536], got ", p.topk);
  if (p.page_size < 1 || p.page_size > 4096) {
    return bad("page_size must be in [1, 4096], got ", p.page_size);
  }
  // Row lengths and positions travel as int32.
  if (p.max_context < 1 || p.max_context > std::numeric_limits<int32_t>::max()) {
    return bad("max_context must be in [1, 2^31 - 1], got ", p.max_context);
  }
  if (p.max_rows_per_sequence < 1 || p.max_rows_per_sequence > 64) {
    return bad("max_rows_per_sequence must be in [1, 64], got ", p.max_rows_per_sequence);
  }
  if ((p.candidate_block_size == 0) != (p.num_candidate_blocks == 0)) {
    return bad("candidate_block_size and num_candidate_blocks must be both 0 or both > 0, got ",
               p.candidate_block_size, " and ", p.num_candidate_blocks);
  }
  if (p.candidate_block_size < 0 || p.num_candidate_blocks < 0) {
    return bad("candidate_block_size and num_candidate_blocks must not be negative");
  }
  if (int64_t{p.candidate_block_size} * p.num_candidate_blocks >
      std::numeric_limits<int32_t>::max() / 2) {
    return bad("candidate_block_size * num_candidate_blocks is too large");
  }

  const kernels::RopeParams& r = p.rope;
  if (r.style != RopeStyle::kNone) {
    if (r.rope_dim < 2 || r.rope_dim % 2 != 0) {
      return bad("rope.dim must be even and >= 2, got ", r.rope_dim);
    }
    if (r.dim_offset < 0 || r.dim_offset + r.rope_dim > p.head_dim) {
      return bad("rope span [", r.dim_offset, ", ", r.dim_offset + r.rope_dim,
                 ") must lie inside [0, head_dim = ", p.head_dim, ")");
    }
    if (!(r.theta > 1.0)) return bad("rope.theta must be > 1, got ", r.theta);
    if (r.yarn) {
      if (!(r.yarn_factor >= 1.0)) {
        return bad("rope.yarn.factor must be >= 1, got ", r.yarn_factor);
      }
      if (r.yarn_original_max_position < 1) {
        return bad("rope.yarn.original_max_position must be >= 1, got ",
                   r.yarn_original_max_position);
      }
      if (!(r.yarn_beta_fast > r.yarn_beta_slow) || !(r.yarn_beta_slow > 0)) {
        return bad("rope.yarn needs beta_fast > beta_slow > 0, got ", r.yarn_beta_fast, " and ",
                   r.yarn_beta_slow);
      }
    }
  }

  if (p.layers.empty()) return bad("layers: the plan has no layers");
  if (p.layers.size() > 4096) return bad("layers: at most 4096 layers, got ", p.layers.size());
  bool has_candidates = false;
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const LayerSpec& l = p.layers[i];
    if (l.layer != static_cast<int32_t>(i)) {
      return bad("layers[", i, "]: layer ids must be 0..n-1 in order, got ", l.layer);
    }
    if (l.cache_format != CacheFormat::kFp8 && l.cache_format != CacheFormat::kFp4) {
      return bad("layers[", i, "]: unknown cache_format");
    }
    switch (l.role) {
      case LayerRole::kDense:
      case LayerRole::kCandidateSource:
        if (l.cache_layer != l.layer) {
          return bad("layers[", i, "]: a dense or source layer owns its cache (cache_layer ",
                     l.layer, "), got cache_layer ", l.cache_layer);
        }
        has_candidates |= l.role == LayerRole::kCandidateSource;
        break;
      case LayerRole::kCandidateConsumer: {
        has_candidates = true;
        const LayerSpec* src = p.FindLayer(l.cache_layer);
        if (src == nullptr || src->role != LayerRole::kCandidateSource) {
          return bad("layers[", i, "]: a consumer's cache_layer must be a candidate source, got ",
                     l.cache_layer);
        }
        if (src->cache_format != l.cache_format) {
          return bad("layers[", i, "]: a consumer reads layer ", l.cache_layer,
                     "'s cache, so its cache_format must match that layer's");
        }
        break;
      }
      default:
        return bad("layers[", i, "]: unknown role");
    }
  }
  if (has_candidates && p.candidate_block_size == 0) {
    return bad("candidate layers need candidate_block_size and num_candidate_blocks > 0");
  }
  return absl::OkStatus();
}

uint64_t CacheIdentityHash(const Profile& p) {
  std::string text = absl::StrCat("di-cache-identity-1;head_dim=", p.head_dim,
                                  ";page_size=", p.page_size, ";hadamard=", p.hadamard ? 1 : 0,
                                  ";candidate_block_size=", p.candidate_block_size,
                                  ";num_candidate_blocks=", p.num_candidate_blocks,
                                  ";max_rows_per_sequence=", p.max_rows_per_sequence,
                                  ";max_context=", p.max_context, ";layers=");
  for (const LayerSpec& l : p.layers) {
    absl::StrAppend(&text, l.layer, ":", static_cast<int>(l.role), ":", l.cache_layer, ":",
                    static_cast<int>(l.cache_format), ",");
  }
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace decode_indexer::config
