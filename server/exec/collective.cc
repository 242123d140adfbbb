#include "server/exec/collective.h"

#include <condition_variable>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace decode_indexer::exec {
namespace {

class InProcessCollective final : public Collective {
 public:
  InProcessCollective(std::vector<kernels::Backend*> backends, size_t max_bytes)
      : backends_(std::move(backends)), host_(max_bytes) {}

  int32_t world_size() const override { return static_cast<int32_t>(backends_.size()); }

  absl::Status AllGather(int32_t rank, const void* send, void* recv,
                         size_t bytes_per_rank) override {
    const size_t total = bytes_per_rank * backends_.size();
    kernels::Backend& b = *backends_[rank];
    absl::Status status;
    if (total > host_.size()) {
      status = absl::InternalError(absl::StrCat(
          "all-gather of ", total, " bytes exceeds the bounce buffer of ", host_.size()));
    }
    // Each rank writes only its own slice of the bounce buffer.
    if (status.ok())
      status = b.CopyToHost(host_.data() + rank * bytes_per_rank, send, bytes_per_rank);
    if (status.ok()) status = b.Synchronize();
    // The barriers run whatever happened, so that a failing rank never strands the others.
    absl::Status sync = Barrier(rank);
    if (status.ok()) status = sync;
    if (status.ok()) status = b.CopyToDevice(recv, host_.data(), total);
    if (status.ok()) status = b.Synchronize();
    // Nobody may refill the bounce buffer (the next collective) before everyone has read it.
    sync = Barrier(rank);
    if (status.ok()) status = sync;
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("all-gather on rank ", rank, ": ", status.message()));
    }
    return absl::OkStatus();
  }

  absl::Status Barrier(int32_t /*rank*/) override {
    std::unique_lock lock(mu_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_size()) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    return absl::OkStatus();
  }

 private:
  std::vector<kernels::Backend*> backends_;
  std::vector<uint8_t> host_;
  std::mutex mu_;
  std::condition_variable cv_;
  int32_t arrived_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace

std::unique_ptr<Collective> MakeInProcessCollective(std::vector<kernels::Backend*> backends,
                                                    size_t max_bytes) {
  return std::make_unique<InProcessCollective>(std::move(backends), max_bytes);
}

}  // namespace decode_indexer::exec
