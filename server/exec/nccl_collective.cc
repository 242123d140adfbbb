#include "server/exec/nccl_collective.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::exec {
namespace {

using Clock = std::chrono::steady_clock;

// How long a rank polls its collective with yields before it polls with sleeps.
constexpr std::chrono::microseconds kPollSpin{500};

absl::Status CudaError(cudaError_t err, absl::string_view what) {
  return absl::InternalError(absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}
absl::Status NcclError(ncclResult_t r, absl::string_view what) {
  return absl::InternalError(absl::StrCat("NCCL error in ", what, ": ", ncclGetErrorString(r)));
}

class NcclCollective final : public Collective {
 public:
  NcclCollective(std::vector<kernels::Device*> backends, std::vector<int> devices,
                 std::chrono::milliseconds timeout)
      : backends_(std::move(backends)),
        devices_(std::move(devices)),
        timeout_(timeout),
        comms_(devices_.size(), nullptr),
        streams_(devices_.size(), nullptr),
        warm_(devices_.size(), nullptr),
        inflight_(devices_.size()),
        rendezvous_(static_cast<int32_t>(devices_.size()), timeout) {}

  ~NcclCollective() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    if (watchdog_.joinable()) watchdog_.join();
    if (!aborted_) {
      // Communicators driven by one thread finalize inside one group.
      bool finalized = ncclGroupStart() == ncclSuccess;
      for (ncclComm_t c : comms_) {
        if (c != nullptr && finalized) finalized = ncclCommFinalize(c) == ncclSuccess;
      }
      finalized = ncclGroupEnd() == ncclSuccess && finalized;
      for (ncclComm_t c : comms_) {
        if (c == nullptr) continue;
        if (finalized) {
          ncclCommDestroy(c);
        } else {
          ncclCommAbort(c);
        }
      }
    }
    for (size_t r = 0; r < devices_.size(); ++r) {
      cudaSetDevice(devices_[r]);
      if (streams_[r] != nullptr) cudaStreamDestroy(streams_[r]);
      if (warm_[r] != nullptr) cudaFree(warm_[r]);
    }
  }

  absl::Status Init() {
    const int n = static_cast<int>(devices_.size());
    for (int r = 0; r < n; ++r) {
      if (cudaError_t e = cudaSetDevice(devices_[r]); e != cudaSuccess) {
        return CudaError(e, "cudaSetDevice");
      }
      if (cudaError_t e = cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking);
          e != cudaSuccess) {
        return CudaError(e, "create the collective stream");
      }
      if (cudaError_t e = cudaMalloc(&warm_[r], sizeof(int32_t) * n); e != cudaSuccess) {
        return CudaError(e, "allocate the warm-up buffer");
      }
    }
    if (ncclResult_t e = ncclCommInitAll(comms_.data(), n, devices_.data()); e != ncclSuccess) {
      for (ncclComm_t& c : comms_) c = nullptr;
      return NcclError(e, "ncclCommInitAll");
    }
    // NCCL connects its channels lazily, on the first collective of each kind, and that first
    // call blocks until the peers join. Do it once here, from one thread in one group, so a
    // step's enqueue never blocks (the watchdog relies on ranks waiting only by polling).
    if (ncclResult_t e = ncclGroupStart(); e != ncclSuccess) return NcclError(e, "group start");
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(devices_[r]);
      ncclAllGather(static_cast<int32_t*>(warm_[r]) + r, warm_[r], 1, ncclInt32, comms_[r],
                    streams_[r]);
      ncclBroadcast(warm_[r], warm_[r], 1, ncclInt32, 0, comms_[r], streams_[r]);
    }
    if (ncclResult_t e = ncclGroupEnd(); e != ncclSuccess) return NcclError(e, "warm-up");
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(devices_[r]);
      if (cudaError_t e = cudaStreamSynchronize(streams_[r]); e != cudaSuccess) {
        return CudaError(e, "warm-up collectives");
      }
    }
    watchdog_ = std::thread([this] { Watchdog(); });
    return absl::OkStatus();
  }

  int32_t world_size() const override { return static_cast<int32_t>(devices_.size()); }
  std::string_view name() const override { return "nccl"; }

  absl::Status AllGather(int32_t rank, const void* send, void* recv,
                         size_t bytes_per_rank) override {
    return Run(rank, "ncclAllGather", [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllGather(send, recv, bytes_per_rank, ncclChar, comm, stream);
    });
  }

  absl::Status Broadcast(int32_t rank, void* buf, size_t bytes) override {
    return Run(rank, "ncclBroadcast", [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclBroadcast(buf, buf, bytes, ncclChar, 0, comm, stream);
    });
  }
  bool device_broadcast() const override { return true; }

  absl::Status Barrier(int32_t rank) override {
    return rendezvous_.Exchange(rank, absl::OkStatus());
  }
  absl::Status Agree(int32_t rank, const absl::Status& local) override {
    return rendezvous_.Exchange(rank, local);
  }

  void Abort(const absl::Status& why) override {
    std::lock_guard lock(mu_);
    AbortLocked(why);
  }
  bool aborted() const override { return aborted_; }

 private:
  // Enqueues one NCCL call on the rank's collective stream and waits for it by polling.
  template <typename F>
  absl::Status Run(int32_t rank, absl::string_view what, F&& enqueue) {
    // The send buffer was written on the backend's stream.
    if (absl::Status s = backends_[rank]->Synchronize(); !s.ok()) {
      // The peers are (or will be) inside the NCCL call waiting for this rank: wake them now
      // rather than at the timeout.
      Abort(absl::InternalError(absl::StrCat("rank ", rank, " before ", what, ": ", s.message())));
      return s;
    }
    {
      std::lock_guard lock(mu_);
      if (aborted_) return why_;
      if (cudaError_t e = cudaSetDevice(devices_[rank]); e != cudaSuccess) {
        absl::Status s = CudaError(e, "cudaSetDevice");
        AbortLocked(s);
        return s;
      }
      if (ncclResult_t e = enqueue(comms_[rank], streams_[rank]); e != ncclSuccess) {
        absl::Status s = NcclError(e, absl::StrCat(what, " on rank ", rank));
        AbortLocked(s);
        return s;
      }
      inflight_[rank] = Clock::now();
    }
    // Most collectives of a step finish within tens of microseconds: poll with yields first
    // (a 10 us sleep is a timer wait that often lasts far longer, on a sandboxed kernel
    // hundreds of microseconds), then back off to sleeps.
    const Clock::time_point spin_until = Clock::now() + kPollSpin;
    while (true) {
      {
        std::lock_guard lock(mu_);
        if (aborted_) {
          inflight_[rank].reset();
          return why_;
        }
        const cudaError_t e = cudaStreamQuery(streams_[rank]);
        if (e == cudaSuccess) {
          inflight_[rank].reset();
          return absl::OkStatus();
        }
        if (e != cudaErrorNotReady) {
          absl::Status s = CudaError(e, absl::StrCat(what, " on rank ", rank));
          inflight_[rank].reset();
          AbortLocked(s);
          return s;
        }
      }
      if (Clock::now() < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(10));
      }
    }
  }

  void Watchdog() {
    std::unique_lock lock(mu_);
    while (!stop_) {
      if (!aborted_) {
        const Clock::time_point now = Clock::now();
        for (size_t r = 0; r < comms_.size() && !aborted_; ++r) {
          if (!inflight_[r]) continue;
          ncclResult_t async = ncclSuccess;
          const ncclResult_t q = ncclCommGetAsyncError(comms_[r], &async);
          if (q != ncclSuccess) {
            AbortLocked(NcclError(q, absl::StrCat("ncclCommGetAsyncError on rank ", r)));
          } else if (async != ncclSuccess && async != ncclInProgress) {
            AbortLocked(NcclError(async, absl::StrCat("rank ", r, " (asynchronous)")));
          } else if (now - *inflight_[r] > timeout_) {
            AbortLocked(absl::InternalError(
                absl::StrCat("rank ", r, "'s collective did not finish within ", timeout_.count(),
                             " ms (a peer never joined it)")));
          }
        }
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
    }
  }

  void AbortLocked(const absl::Status& why) {
    if (aborted_) return;
    why_ = MarkPeerFailure(
        absl::InternalError(absl::StrCat("NCCL communicator aborted: ", why.message())));
    spdlog::error("collective: {}", std::string(why_.message()));
    for (ncclComm_t& c : comms_) {
      if (c != nullptr) ncclCommAbort(c);
      c = nullptr;
    }
    aborted_ = true;
    rendezvous_.Break(why);
  }

  const std::vector<kernels::Device*> backends_;
  const std::vector<int> devices_;
  const std::chrono::milliseconds timeout_;
  std::vector<ncclComm_t> comms_;
  std::vector<cudaStream_t> streams_;
  std::vector<void*> warm_;

  // Guards comms_ (an abort frees them), inflight_, why_ and stop_.
  std::mutex mu_;
  std::vector<std::optional<Clock::time_point>> inflight_;
  std::atomic<bool> aborted_{false};
  absl::Status why_;
  bool stop_ = false;
  std::thread watchdog_;
  HostRendezvous rendezvous_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Collective>> MakeNcclCollective(
    std::vector<kernels::Device*> backends, std::vector<int> devices,
    std::chrono::milliseconds timeout) {
  if (backends.size() != devices.size() || devices.empty()) {
    return absl::InvalidArgumentError("nccl collective: one backend per device");
  }
  auto c = std::make_unique<NcclCollective>(std::move(backends), std::move(devices), timeout);
  if (absl::Status s = c->Init(); !s.ok()) return s;
  return std::unique_ptr<Collective>(std::move(c));
}

}  // namespace decode_indexer::exec
