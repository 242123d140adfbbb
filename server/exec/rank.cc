#include "server/exec/rank.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace decode_indexer::exec {

Rank::Rank(int32_t index, std::unique_ptr<kernels::Backend> backend, const RankSizes& sizes)
    : index_(index), backend_(std::move(backend)), sizes_(sizes) {}

absl::StatusOr<std::unique_ptr<Rank>> Rank::Create(int32_t index,
                                                   std::unique_ptr<kernels::Backend> backend,
                                                   const RankSizes& sizes) {
  std::unique_ptr<Rank> rank(new Rank(index, std::move(backend), sizes));
  if (absl::Status s = rank->Allocate(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("rank ", index, ": ", s.message()));
  }
  rank->thread_ = std::thread([r = rank.get()] { r->Loop(); });
  return rank;
}

Rank::~Rank() {
  if (thread_.joinable()) {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  if (fork_pending) (void)backend_->JoinExpand();
  (void)backend_->Synchronize();
  for (void* p : allocations_) backend_->Free(p);
}

template <typename T>
absl::Status Rank::Alloc(T** out, int64_t count) {
  // Zero-sized buffers still get a distinct allocation so every pointer is valid.
  const size_t bytes = std::max<size_t>(sizeof(T) * static_cast<size_t>(count), 64);
  absl::StatusOr<void*> p = backend_->Allocate(bytes);
  if (!p.ok()) {
    return absl::Status(p.status().code(),
                        absl::StrCat("allocating ", bytes, " bytes: ", p.status().message()));
  }
  allocations_.push_back(*p);
  *out = static_cast<T*>(*p);
  return absl::OkStatus();
}

absl::Status Rank::Allocate() {
  const RankSizes& s = sizes_;
  const int64_t rows = s.max_rows;
  const int64_t hd = int64_t{s.num_heads} * s.head_dim;
  for (const kernels::CacheGeometry& g : s.pools) {
    kernels::CacheView view;
    view.geometry = g;
    view.num_pages = s.pages_per_pool;
    if (absl::Status st = Alloc(&view.base, g.page_bytes() * s.pages_per_pool); !st.ok()) return st;
    buffers_.caches.push_back(view);
  }
  RankBuffers& b = buffers_;
  const int64_t cand_positions = int64_t{s.num_candidate_blocks} * s.candidate_block_size;
  for (absl::Status st : {
           Alloc(&b.candidate_store, s.candidate_store_rows * s.num_candidate_blocks),
           Alloc(&b.keys, int64_t{s.key_chunk} * s.head_dim * 4),
           Alloc(&b.key_scales, int64_t{s.key_chunk} * std::max(4, s.head_dim / 32)),
           Alloc(&b.slots, s.key_chunk),
           Alloc(&b.row_request, rows),
           Alloc(&b.row_length, rows),
           Alloc(&b.page_table, int64_t{s.max_requests} * s.max_pages_per_sequence),
           Alloc(&b.q_raw, rows * hd * 4),
           Alloc(&b.weights_raw, rows * s.num_heads),
           Alloc(&b.positions, rows),
           Alloc(&b.q_codes, rows * hd),
           Alloc(&b.q_scales, rows * hd / 32),
           Alloc(&b.weights, rows * s.num_heads),
           Alloc(&b.topk, rows * s.topk),
           Alloc(&b.candidates, rows * s.num_candidate_blocks),
           Alloc(&b.store_index, rows),
           Alloc(&b.expansion_positions, rows * cand_positions),
           Alloc(&b.expansion_counts, rows),
           Alloc(&b.inv_freq, static_cast<int64_t>(s.inv_freq.size())),
       }) {
    if (!st.ok()) return st;
  }
  if (!s.inv_freq.empty()) {
    absl::Status st =
        backend_->CopyToDevice(b.inv_freq, s.inv_freq.data(), s.inv_freq.size() * sizeof(double));
    if (st.ok()) st = backend_->Synchronize();
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

void Rank::Start(const Job* job) {
  {
    std::lock_guard lock(mu_);
    job_ = job;
    done_ = false;
  }
  cv_.notify_all();
}

absl::Status Rank::Wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  return result_;
}

void Rank::Loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || job_ != nullptr; });
    if (job_ == nullptr) return;  // stop_ with no job left
    const Job* job = job_;
    lock.unlock();
    absl::Status status = (*job)(*this);
    lock.lock();
    result_ = std::move(status);
    job_ = nullptr;
    done_ = true;
    cv_.notify_all();
  }
}

std::vector<absl::Status> RunOnRanks(const std::vector<std::unique_ptr<Rank>>& ranks,
                                     const Rank::Job& job) {
  for (const auto& r : ranks) r->Start(&job);
  std::vector<absl::Status> out;
  out.reserve(ranks.size());
  for (const auto& r : ranks) out.push_back(r->Wait());
  return out;
}

}  // namespace decode_indexer::exec
