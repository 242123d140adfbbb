#include "server/exec/step_graphs.h"

#include <algorithm>

#include "server/exec/rank.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::exec {

int32_t BucketRowLength(int32_t length, int64_t cap) {
  int64_t bucket = 4096;
  // Four buckets per power of two: 2^k * {5, 6, 7, 8} / 4.
  for (int64_t pow2 = 4096; bucket < length; pow2 *= 2) {
    for (int64_t m = 5; m <= 8 && bucket < length; ++m) bucket = pow2 * m / 4;
  }
  return static_cast<int32_t>(std::max<int64_t>(length, std::min<int64_t>(bucket, cap)));
}

StepGraphs::Use StepGraphs::Next(const StepShape& shape, Entry** entry, Eviction* eviction) {
  *eviction = Eviction{};
  auto it = entries_.find(shape);
  if (it == entries_.end()) {
    if (entries_.size() >= max_shapes_) {
      // The least recently seen shape: a scan, only when a new shape meets a full table.
      auto lru = entries_.begin();
      for (auto e = entries_.begin(); e != entries_.end(); ++e) {
        if (e->second.last_use < lru->second.last_use) lru = e;
      }
      eviction->happened = true;
      if (lru->second.captured) eviction->graph_key = lru->second.key;
      entries_.erase(lru);
    }
    it = entries_.emplace(shape, Entry{}).first;
    it->second.key = next_key_++;
  }
  Entry& e = it->second;
  *entry = &e;
  e.last_use = ++clock_;
  ++e.sightings;
  if (e.captured) return Use::kReplay;
  if (e.failed || e.sightings < 2) return Use::kEager;
  return Use::kCapture;
}

absl::Status RunKernelSection(Rank& rank, const StepShape& shape,
                              const std::function<absl::Status()>& launch) {
  kernels::Device& be = rank.device();
  if (!rank.graphs_enabled()) return launch();
  StepGraphs::Entry* entry = nullptr;
  StepGraphs::Eviction eviction;
  const StepGraphs::Use use = rank.graphs().Next(shape, &entry, &eviction);
  if (eviction.graph_key != 0) be.DropGraph(eviction.graph_key);
  if (eviction.happened) rank.step_record().graph_evicted = true;
  switch (use) {
    case StepGraphs::Use::kEager:
      return launch();
    case StepGraphs::Use::kReplay: {
      absl::StatusOr<bool> replayed = be.Replay(entry->key);
      if (!replayed.ok()) return replayed.status();
      if (*replayed) {
        rank.step_record().graph_replayed = true;
        return absl::OkStatus();
      }
      entry->captured = false;  // the backend lost it: run eager, capture again next time
      entry->sightings = 1;
      return launch();
    }
    case StepGraphs::Use::kCapture:
      break;
  }
  absl::Status status = be.BeginCapture();
  if (status.ok()) {
    status = launch();
    if (status.ok()) {
      status = be.EndCapture(entry->key);
    } else {
      be.AbortCapture();
    }
  }
  if (!status.ok()) {
    entry->failed = true;
    spdlog::warn("rank {}: step graph capture failed ({}); this shape runs eagerly", rank.index(),
                 status.ToString());
    return launch();
  }
  entry->captured = true;
  rank.step_record().graph_captured = true;
  absl::StatusOr<bool> replayed = be.Replay(entry->key);
  if (!replayed.ok()) return replayed.status();
  if (!*replayed) return absl::InternalError("a step graph just captured was not found");
  return absl::OkStatus();
}

}  // namespace decode_indexer::exec
