#include "server/exec/collective.h"

#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace decode_indexer::exec {
namespace {

constexpr char kPeerPayload[] = "decode_indexer/peer_failure";

absl::Status PeerFailure(int32_t failed_rank, const absl::Status& failed) {
  absl::Status s(failed.code(), absl::StrCat("rank ", failed_rank, " failed: ", failed.message()));
  s.SetPayload(kPeerPayload, absl::Cord("1"));
  return s;
}

class InProcessCollective final : public Collective {
 public:
  InProcessCollective(std::vector<kernels::Device*> devices, size_t max_bytes,
                      std::chrono::milliseconds timeout)
      : devices_(std::move(devices)),
        host_(max_bytes),
        rendezvous_(static_cast<int32_t>(devices_.size()), timeout) {}

  int32_t world_size() const override { return static_cast<int32_t>(devices_.size()); }
  std::string_view name() const override { return "in-process"; }

  absl::Status AllGather(int32_t rank, const void* send, void* recv,
                         size_t bytes_per_rank) override {
    const size_t total = bytes_per_rank * devices_.size();
    kernels::Device& b = *devices_[rank];
    absl::Status status;
    if (total > host_.size()) {
      status = absl::InternalError(absl::StrCat(
          "all-gather of ", total, " bytes exceeds the bounce buffer of ", host_.size()));
    }
    // Each rank writes only its own slice of the bounce buffer.
    if (status.ok())
      status = b.CopyToHost(host_.data() + rank * bytes_per_rank, send, bytes_per_rank);
    if (status.ok()) status = b.Synchronize();
    // The rendezvous runs whatever happened, so that a failing rank never strands the others;
    // after a failure nobody reads the bounce buffer.
    status = rendezvous_.Exchange(rank, status);
    if (status.ok()) status = b.CopyToDevice(recv, host_.data(), total);
    if (status.ok()) status = b.Synchronize();
    // Nobody may refill the bounce buffer (the next collective) before everyone has read it.
    status = rendezvous_.Exchange(rank, status);
    if (!status.ok()) {
      if (IsPeerFailure(status)) return status;
      return absl::Status(status.code(),
                          absl::StrCat("all-gather on rank ", rank, ": ", status.message()));
    }
    return absl::OkStatus();
  }

  absl::Status Barrier(int32_t rank) override {
    return rendezvous_.Exchange(rank, absl::OkStatus());
  }
  absl::Status Agree(int32_t rank, const absl::Status& local) override {
    return rendezvous_.Exchange(rank, local);
  }
  void Abort(const absl::Status& why) override { rendezvous_.Break(why); }
  bool aborted() const override { return rendezvous_.broken(); }

 private:
  std::vector<kernels::Device*> devices_;
  std::vector<uint8_t> host_;
  HostRendezvous rendezvous_;
};

}  // namespace

absl::Status MarkPeerFailure(absl::Status status) {
  if (!status.ok()) status.SetPayload(kPeerPayload, absl::Cord("1"));
  return status;
}

bool IsPeerFailure(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kPeerPayload).has_value();
}

absl::Status Collective::Broadcast(int32_t /*rank*/, void* /*buf*/, size_t /*bytes*/) {
  return absl::UnimplementedError(
      absl::StrCat(std::string(name()), " collective: no device broadcast"));
}

void HostRendezvous::SpinForGeneration(uint64_t generation) const {
  const auto deadline = std::chrono::steady_clock::now() + kRendezvousSpin;
  for (int32_t i = 1;; ++i) {
    if (generation_seen_.load(std::memory_order_acquire) != generation ||
        broken_seen_.load(std::memory_order_acquire)) {
      return;
    }
    if (i % 16 == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return;
      std::this_thread::yield();
    }
  }
}

bool HostRendezvous::WaitForGeneration(std::unique_lock<std::mutex>& lock, uint64_t generation) {
  lock.unlock();
  SpinForGeneration(generation);
  lock.lock();
  return cv_.wait_for(lock, timeout_, [&] { return broken_ || generation_ != generation; });
}

absl::Status HostRendezvous::Exchange(int32_t rank, const absl::Status& local) {
  std::unique_lock lock(mu_);
  if (broken_) return broken_why_;
  const uint64_t generation = generation_;
  posted_[rank] = local;
  if (++arrived_ == world_) {
    // The last to arrive settles the generation; nobody can post into the next one before
    // every waiter of this one has read the outcome (they all must arrive there first).
    failed_rank_ = -1;
    for (int32_t r = 0; r < world_; ++r) {
      if (!posted_[r].ok()) {
        failed_rank_ = r;
        failed_ = posted_[r];
        break;
      }
    }
    arrived_ = 0;
    ++generation_;
    generation_seen_.store(generation_, std::memory_order_release);
    cv_.notify_all();
  } else if (!WaitForGeneration(lock, generation)) {
    // The others never came: a rank is stuck. Break the rendezvous (its counts are now
    // meaningless) so that every later call fails fast instead of waiting again.
    broken_ = true;
    broken_seen_.store(true, std::memory_order_release);
    broken_why_ = MarkPeerFailure(absl::InternalError(
        absl::StrCat("rank ", rank, " waited ", timeout_.count(),
                     " ms for the other ranks at a collective; the collective is aborted")));
    cv_.notify_all();
    return broken_why_;
  }
  if (generation_ == generation) return broken_why_;  // woken by Break
  // A rank that failed itself reports its own failure, not the lowest rank's.
  if (!local.ok()) return local;
  if (failed_rank_ < 0) return absl::OkStatus();
  return PeerFailure(failed_rank_, failed_);
}

void HostRendezvous::Break(const absl::Status& why) {
  std::lock_guard lock(mu_);
  if (broken_) return;
  broken_ = true;
  broken_seen_.store(true, std::memory_order_release);
  broken_why_ =
      MarkPeerFailure(absl::InternalError(absl::StrCat("collective aborted: ", why.message())));
  cv_.notify_all();
}

bool HostRendezvous::broken() const {
  std::lock_guard lock(mu_);
  return broken_;
}

absl::Status HostRendezvous::broken_status() const {
  std::lock_guard lock(mu_);
  return broken_why_;
}

std::unique_ptr<Collective> MakeInProcessCollective(std::vector<kernels::Device*> devices,
                                                    size_t max_bytes,
                                                    std::chrono::milliseconds timeout) {
  return std::make_unique<InProcessCollective>(std::move(devices), max_bytes, timeout);
}

}  // namespace decode_indexer::exec
