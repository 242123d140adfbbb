#include "client/load/server_model.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace decode_indexer::load {

const char* RoleName(Role role) {
  switch (role) {
    case Role::kDense:
      return "dense";
    case Role::kSource:
      return "source";
    case Role::kConsumer:
      return "consumer";
  }
  return "?";
}

absl::StatusOr<ServerModel> BuildServerModel(const v1::ServerInfo& info, int32_t max_layers) {
  ServerModel model;
  model.info = info;
  model.num_heads = info.num_heads();
  model.head_dim = info.head_dim();
  model.topk = info.topk();
  model.page_size = info.page_size();
  model.num_candidate_blocks = info.num_candidate_blocks();
  model.candidate_block_size = info.candidate_block_size();
  if (model.num_heads <= 0 || model.head_dim <= 0 || model.head_dim % 32 != 0 || model.topk <= 0 ||
      model.page_size <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("server reports an unusable geometry: H=", model.num_heads,
                     " D=", model.head_dim, " K=", model.topk, " page=", model.page_size));
  }
  if (info.layers().empty()) return absl::FailedPreconditionError("server reports no layers");

  std::vector<LayerStep> layers;
  for (const v1::LayerInfo& l : info.layers()) {
    LayerStep step;
    step.layer = l.layer();
    step.cache_layer = l.cache_layer();
    step.format =
        l.cache_format() == v1::CACHE_FORMAT_FP4 ? v1::CACHE_FORMAT_FP4 : v1::CACHE_FORMAT_FP8;
    switch (l.role()) {
      case v1::LAYER_ROLE_CANDIDATE_SOURCE:
        step.role = Role::kSource;
        break;
      case v1::LAYER_ROLE_CANDIDATE_CONSUMER:
        step.role = Role::kConsumer;
        break;
      default:
        step.role = Role::kDense;
        break;
    }
    step.owns_cache = step.cache_layer == step.layer;
    if (step.role == Role::kConsumer && step.owns_cache) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", step.layer, " is a consumer that owns its cache"));
    }
    layers.push_back(step);
  }
  std::stable_sort(layers.begin(), layers.end(),
                   [](const LayerStep& a, const LayerStep& b) { return a.layer < b.layer; });

  // Emit in layer order, holding back a consumer until its source has run.
  std::set<int32_t> emitted;
  std::multimap<int32_t, LayerStep> waiting;  // source layer -> consumers waiting for it
  auto emit = [&](const LayerStep& step, auto&& self) -> void {
    model.plan.push_back(step);
    emitted.insert(step.layer);
    auto [begin, end] = waiting.equal_range(step.layer);
    std::vector<LayerStep> released;
    for (auto it = begin; it != end; ++it) released.push_back(it->second);
    waiting.erase(begin, end);
    for (const LayerStep& r : released) self(r, self);
  };
  for (const LayerStep& step : layers) {
    if (step.role == Role::kConsumer && !emitted.contains(step.cache_layer)) {
      waiting.emplace(step.cache_layer, step);
    } else {
      emit(step, emit);
    }
  }
  if (!waiting.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("consumer layer ", waiting.begin()->second.layer, " reads layer ",
                     waiting.begin()->first, ", which is not a layer of the profile"));
  }

  if (max_layers > 0 && static_cast<size_t>(max_layers) < model.plan.size()) {
    model.plan.resize(max_layers);
  }
  for (const LayerStep& step : model.plan) {
    if (step.owns_cache) model.cache_layers.push_back(step.layer);
  }
  return model;
}

}  // namespace decode_indexer::load
