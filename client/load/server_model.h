// What the load tester needs to know about the server it drives, read once from
// GetServerInfo: the shapes of a step and the order in which a frontend visits the layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode_indexer/v1/indexer.pb.h"

namespace decode_indexer::load {

enum class Role { kDense, kSource, kConsumer };
const char* RoleName(Role role);

struct LayerStep {
  int32_t layer = 0;
  Role role = Role::kDense;
  int32_t cache_layer = 0;
  v1::CacheFormat format = v1::CACHE_FORMAT_FP8;
  // The layer owns its cache: a step brings new keys for it.
  bool owns_cache = true;
};

struct ServerModel {
  v1::ServerInfo info;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  int32_t topk = 0;
  int32_t page_size = 0;
  int32_t num_candidate_blocks = 0;
  int32_t candidate_block_size = 0;
  // The layers in the order a frontend runs them: layer order, except that a consumer never
  // runs before the source whose candidates it reads.
  std::vector<LayerStep> plan;
  // Cache-owning layers (each gets prefill keys), in plan order.
  std::vector<int32_t> cache_layers;
};

// Builds the model; max_layers > 0 keeps only the first max_layers layers of the plan
// (dropping consumers whose source was cut), which keeps CPU-server runs short.
absl::StatusOr<ServerModel> BuildServerModel(const v1::ServerInfo& info, int32_t max_layers);

}  // namespace decode_indexer::load
