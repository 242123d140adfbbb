// A model profile: every constant of spec section 1, immutable once loaded.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_indexer/kernels/rope.h"
#include "decode_indexer/kernels/types.h"

namespace decode_indexer::config {

enum class LayerRole { kDense = 1, kCandidateSource = 2, kCandidateConsumer = 3 };

struct LayerSpec {
  int32_t layer = 0;
  LayerRole role = LayerRole::kDense;
  // The layer whose cache it reads (itself if it owns one).
  int32_t cache_layer = 0;
  kernels::CacheFormat cache_format = kernels::CacheFormat::kFp8;
};

struct Profile {
  std::string name;
  int32_t num_heads = 64;
  int32_t head_dim = 128;
  int32_t topk = 2048;
  int32_t page_size = 64;
  int64_t max_context = 163840;
  int32_t candidate_block_size = 0;  // 0: the profile has no candidate layers
  int32_t num_candidate_blocks = 0;
  int32_t max_rows_per_sequence = 8;
  bool hadamard = false;
  kernels::RopeParams rope;
  std::vector<LayerSpec> layers;  // indexed by layer id, 0..n-1

  // Layers that own a cache, in layer order.
  std::vector<int32_t> CacheLayers() const;
  const LayerSpec* FindLayer(int32_t layer) const;
  // The layer whose cache a consumer reads and that publishes its candidates.
  int32_t SourceLayerOf(int32_t consumer_layer) const;
};

// Built-in "v32" or "v41".
absl::StatusOr<Profile> BuiltinProfile(const std::string& name);
// --profile: a built-in name, or a path to a .toml, .yaml/.yml or .json file. A file may
// start from a built-in (`base = "v41"`) and override any constant, the layer plan included.
absl::StatusOr<Profile> LoadProfile(const std::string& name_or_path);
// The same from a document's text; `format` is "toml", "yaml" or "json" (the fuzz target's
// entry point: no file system).
absl::StatusOr<Profile> ParseProfileText(std::string_view text, const std::string& format);
// Every constraint the kernels and the server rely on (D a multiple of 32, a consumer's
// cache layer a source, ...). LoadProfile calls it.
absl::Status ValidateProfile(const Profile& profile);

// The profile's identity for moving cache contents between servers (ExportSequence,
// snapshots): a 64-bit FNV-1a hash of every constant that gives a cache's bytes or a
// candidate record their meaning (head dim, page size, Hadamard, candidate geometry, rows per
// sequence, max context, the layer plan with each cache's format). Two servers whose hashes
// and names agree read each other's pages the same way.
uint64_t CacheIdentityHash(const Profile& profile);

}  // namespace decode_indexer::config
