#include "server/exec/rank.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/exec/step_io.h"

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
  // Rank 0 has no thread of its own: its jobs run on the caller's thread (Start).
  if (index != 0) rank->thread_ = std::thread([r = rank.get()] { r->Loop(); });
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
  if (overlap_.has_value()) (void)overlap_->Join();
  (void)backend_->Synchronize();
  for (void* p : allocations_) backend_->Free(p);
  if (arena_.base != nullptr) {
    if (arena_.pinned) {
      backend_->FreeHost(arena_.base);
    } else {
      backend_->Device::FreeHost(arena_.base);
    }
  }
  if (readback_.base != nullptr) backend_->FreeHost(readback_.base);
  if (value_flags_host_ != nullptr) {
    backend_->FreeMapped(const_cast<uint32_t*>(value_flags_host_));
  }
}

absl::Status Rank::ClearValueFlags() {
  if (!value_flags_settled_) {
    if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
    value_flags_settled_ = true;
  }
  for (int w = 0; w < kernels::kValueFlagWords; ++w) value_flags_host_[w] = 0;
  return absl::OkStatus();
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
  b.page_tables.assign(s.pools.size(), nullptr);
  for (int32_t*& table : b.page_tables) {
    if (absl::Status st = Alloc(&table, s.max_sequences * s.max_pages_per_sequence); !st.ok()) {
      return st;
    }
  }
  const int64_t cand_positions = int64_t{s.num_candidate_blocks} * s.candidate_block_size;
  for (absl::Status st : {
           Alloc(&b.candidate_store, s.candidate_store_rows * s.num_candidate_blocks),
           Alloc(&b.keys, int64_t{s.key_chunk} * s.head_dim * 4),
           Alloc(&b.key_scales, int64_t{s.key_chunk} * std::max(4, s.head_dim / 32)),
           Alloc(&b.slots, s.key_chunk),
           Alloc(&b.row_request, rows),
           Alloc(&b.row_length, rows),
           Alloc(&b.request_slot, s.max_requests),
           Alloc(&b.edit_index, s.table_edit_chunk),
           Alloc(&b.edit_pages, s.table_edit_chunk),
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
  // Host staging: the step's row tables, request slots, page-table edits, candidate-store rows,
  // q and weights, and one chunk of keys (with scales and slots), each 64-byte aligned.
  const int64_t key_bytes =
      int64_t{s.key_chunk} * (int64_t{s.head_dim} * 4 + std::max(4, s.head_dim / 32) + 8);
  // The staging ring's slot (PackStepUploads lays it out; a step whose edits or keys do not
  // fit uploads those as before): the row tables, request slots, positions, staged weights
  // and q scales, store rows, a chunk of edits of each kind (pending, the step's own), the
  // kernel section's fixed edit area (kSectionEdits indices and pages) and a chunk of keys
  // with a run's alignment slack, each 64-byte aligned.
  const auto a64 = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t slot_bytes =
      s.staging_slots <= 0 ? 0
                           : 3 * a64(rows * 4) + a64(int64_t{s.max_requests} * 4) + a64(rows * 8) +
                                 a64(rows * s.num_heads * 4) + a64(rows * hd / 32) +
                                 4 * a64(int64_t{s.table_edit_chunk} * 4) +
                                 2 * a64(int64_t{kSectionEdits} * 4) + a64(key_bytes) + 16 * 64;
  const int64_t arena_bytes =
      3 * rows * 4 + int64_t{s.max_requests} * 4 + int64_t{s.table_edit_chunk} * 8 + rows * hd * 4 +
      rows * s.num_heads * 4 + rows * hd / 32 + rows * 8 + key_bytes + 24 * 64;
  // The ring's host side: one slot each, after the arena's own space (so page-locked with it).
  const int64_t ring_bytes = slot_bytes * std::max(0, s.staging_slots);
  if (ring_bytes > 0) {
    if (absl::Status st = Alloc(&ring_.device, ring_bytes); !st.ok()) return st;
    ring_.slot_bytes = static_cast<size_t>(slot_bytes);
    ring_.busy.assign(static_cast<size_t>(s.staging_slots), false);
  }
  graphs_enabled_ = s.step_graphs && backend_->SupportsGraphs();
  graphs_ = StepGraphs(static_cast<size_t>(std::max(1, s.max_step_graphs)));
  // Page-locked only where a device copies from it; a host backend gets plain memory (the
  // keys of a step are still gathered there, to insert them in one call).
  arena_.pinned = s.pinned_staging && backend_->name() != "cpu";
  const int64_t host_bytes = a64(arena_bytes) + ring_bytes;
  absl::StatusOr<void*> arena =
      arena_.pinned ? backend_->AllocateHost(static_cast<size_t>(host_bytes))
                    : backend_->Device::AllocateHost(static_cast<size_t>(host_bytes));
  if (!arena.ok()) return arena.status();
  arena_.base = static_cast<uint8_t*>(*arena);
  arena_.capacity = static_cast<size_t>(arena_bytes);
  if (ring_bytes > 0) ring_.host = arena_.base + a64(arena_bytes);
  if (arena_.pinned) {
    const int64_t readback_bytes = rows * (int64_t{s.topk} + s.num_candidate_blocks) * 4 + 2 * 64;
    absl::StatusOr<void*> rb = backend_->AllocateHost(static_cast<size_t>(readback_bytes));
    if (!rb.ok()) return rb.status();
    readback_.base = static_cast<uint8_t*>(*rb);
    readback_.capacity = static_cast<size_t>(readback_bytes);
    readback_.pinned = true;
  }
  absl::StatusOr<kernels::Device::Mapped> flags =
      backend_->AllocateMapped(kernels::kValueFlagWords * sizeof(uint32_t));
  if (!flags.ok()) return flags.status();
  value_flags_host_ = static_cast<uint32_t*>(flags->host);
  b.value_flags = static_cast<uint32_t*>(flags->device);
  if (!s.inv_freq.empty()) {
    absl::Status st =
        backend_->CopyToDevice(b.inv_freq, s.inv_freq.data(), s.inv_freq.size() * sizeof(double));
    if (st.ok()) st = backend_->Synchronize();
    if (!st.ok()) return st;
  }
  kernels::ExpandArgs expand;
  expand.candidates = b.candidates;
  expand.row_length = b.row_length;
  expand.num_candidate_blocks = s.num_candidate_blocks;
  expand.candidate_block_size = s.candidate_block_size;
  expand.out.positions = b.expansion_positions;
  expand.out.counts = b.expansion_counts;
  expand.out.max_positions = s.num_candidate_blocks * s.candidate_block_size;
  overlap_.emplace(backend_->ops(), expand);
  // The side stream's first fork and join from here, an eager point before any step (and any
  // graph capture), where the profile has candidate layers.
  if (s.num_candidate_blocks > 0) {
    absl::Status st = overlap_->Warm();
    if (st.ok()) st = backend_->Synchronize();
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

namespace {

// How long a hand-off waiter spins before it sleeps on the condition variable. Long enough to
// cover the gap between two hand-offs of a decode step (the executor's join, its planning of
// the next step), short enough that an idle rank thread sleeps almost at once. The spin
// yields, so on an oversubscribed host (CI's two cores) it gives way to the threads that work.
constexpr std::chrono::microseconds kHandOffSpin{200};

// Spins until ready() or kHandOffSpin has passed; returns ready()'s last answer.
template <typename Ready>
bool SpinFor(Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + kHandOffSpin;
  for (int32_t i = 1;; ++i) {
    if (ready()) return true;
    if (i % 16 == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return ready();
      std::this_thread::yield();
    }
  }
}

}  // namespace

void Rank::Start(const Job* job) {
  if (!thread_.joinable()) {  // rank 0: the job runs here, Wait just returns its status
    result_ = (*job)(*this);
    done_.store(true, std::memory_order_release);
    return;
  }
  {
    std::lock_guard lock(mu_);
    done_.store(false, std::memory_order_relaxed);
    job_.store(job, std::memory_order_release);
  }
  cv_.notify_all();
}

absl::Status Rank::Wait() {
  SpinFor([&] { return done_.load(std::memory_order_acquire); });
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_.load(std::memory_order_relaxed); });
  return result_;
}

void Rank::Loop() {
  while (true) {
    SpinFor([&] {
      return stop_.load(std::memory_order_acquire) ||
             job_.load(std::memory_order_acquire) != nullptr;
    });
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stop_ || job_ != nullptr; });
    const Job* job = job_.load(std::memory_order_relaxed);
    if (job == nullptr) return;  // stop_ with no job left
    lock.unlock();
    absl::Status status = (*job)(*this);
    lock.lock();
    result_ = std::move(status);
    job_.store(nullptr, std::memory_order_relaxed);
    done_.store(true, std::memory_order_release);
    lock.unlock();
    cv_.notify_all();
  }
}

std::vector<absl::Status> RunOnRanks(const std::vector<std::unique_ptr<Rank>>& ranks,
                                     const Rank::Job& job) {
  // The other ranks first, then rank 0's job on this thread (Start runs it inline): one
  // hand-off less each way. A hand-off whose waiter has stopped spinning costs a condition
  // variable's wake-up, which on the GPU machine's sandboxed kernel measured up to ~100 us
  // (docs/results/multigpu.md, "rest"). The backends take calls from any thread (each entry
  // point sets its device).
  for (size_t r = ranks.size(); r-- > 0;) ranks[r]->Start(&job);
  std::vector<absl::Status> out;
  out.reserve(ranks.size());
  for (const auto& r : ranks) out.push_back(r->Wait());
  return out;
}

}  // namespace decode_indexer::exec
