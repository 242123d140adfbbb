// Collectives between the ranks of one executor. Buffers live in each rank's backend memory.
// The in-process one serves CPU ranks (and works, slowly, for any backend: it bounces through
// host memory with the backends' own copies); the NCCL one (nccl_collective.h) serves CUDA
// ranks behind the same interface.
//
// Faults: the ranks are threads of one process, so before any collective that moves data they
// agree on the host (Agree) whether every rank got there intact. A local failure then fails
// the step on every rank without a device collective that could wait forever for the failed
// rank. What still can hang (a device collective whose peer never arrives, a rank thread that
// never reaches the rendezvous) is bounded by a timeout: the collective aborts, every waiting
// rank returns INTERNAL, and the collective stays aborted (aborted() == true) for good.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/device.h"

namespace decode_indexer::exec {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int32_t world_size() const = 0;
  // "in-process" or "nccl".
  virtual std::string_view name() const = 0;

  // Every rank calls it with the same bytes_per_rank; afterwards recv[r * bytes_per_rank ...)
  // holds rank r's send on every rank. send may alias recv + rank * bytes_per_rank. Every rank
  // must call it even after a local failure (pass its buffers anyway), so that no rank waits
  // forever; the step is then discarded.
  virtual absl::Status AllGather(int32_t rank, const void* send, void* recv,
                                 size_t bytes_per_rank) = 0;
  virtual absl::Status Barrier(int32_t rank) = 0;

  // Host-side agreement: every rank calls it with its local status. OK on every rank when
  // every rank's was OK; otherwise every rank gets an error: the failed rank its own status,
  // the others the lowest failed rank's code and message, marked with IsPeerFailure. Callers
  // then skip the collectives that follow, on every rank alike.
  virtual absl::Status Agree(int32_t rank, const absl::Status& local) = 0;

  // Whether Broadcast moves bytes between devices (NCCL over NVLink). Where it does not, a
  // caller copies host data to every rank itself, which is what a broadcast would do anyway.
  virtual bool device_broadcast() const { return false; }
  // Rank 0's buf[0, bytes) into every rank's buf (in place). Every rank calls it.
  virtual absl::Status Broadcast(int32_t rank, void* buf, size_t bytes);

  // Aborts: waiting ranks wake with INTERNAL, later calls fail at once. Thread-safe,
  // idempotent; the first reason is kept.
  virtual void Abort(const absl::Status& why) = 0;
  virtual bool aborted() const = 0;
};

// Whether a status is a copy of another rank's failure (see Collective::Agree), or a wait
// for other ranks that ended in an abort or a timeout: not where a fault began.
bool IsPeerFailure(const absl::Status& status);
absl::Status MarkPeerFailure(absl::Status status);

// A reusable host rendezvous of world_size threads that exchanges one status each, with a
// deadline: a rank that waits longer than `timeout` for the others breaks it for good.
class HostRendezvous {
 public:
  HostRendezvous(int32_t world_size, std::chrono::milliseconds timeout)
      : world_(world_size), timeout_(timeout), posted_(world_size) {}

  // See Collective::Agree.
  absl::Status Exchange(int32_t rank, const absl::Status& local);
  // Wakes every waiter with `why` (as INTERNAL); later Exchanges fail at once.
  void Break(const absl::Status& why);
  bool broken() const;
  absl::Status broken_status() const;

  // How long a waiter spins (yielding) before it sleeps on the condition variable.
  static constexpr std::chrono::microseconds kRendezvousSpin{200};

 private:
  // Returns once the generation has moved past `generation`, the rendezvous broke, or
  // kRendezvousSpin has passed (the caller then waits on the condition variable).
  void SpinForGeneration(uint64_t generation) const;
  // Spins, then sleeps until the generation moves on or the rendezvous breaks; false at the
  // timeout. Holds `lock` on entry and on return.
  bool WaitForGeneration(std::unique_lock<std::mutex>& lock, uint64_t generation);

  const int32_t world_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<absl::Status> posted_;
  int32_t arrived_ = 0;
  uint64_t generation_ = 0;
  // generation_ and broken_, published for waiters that spin before they sleep (a ranks'
  // agreement is microseconds apart; a condition variable's wake-up costs about as much
  // again, and far more on a sandboxed kernel).
  std::atomic<uint64_t> generation_seen_{0};
  std::atomic<bool> broken_seen_{false};
  int32_t failed_rank_ = -1;  // of the last completed generation
  absl::Status failed_;       // its status
  bool broken_ = false;
  absl::Status broken_why_;
};

constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{30000};

// devices[r] is rank r's device (not owned). max_bytes bounds world * bytes_per_rank; the
// host bounce buffer is allocated once here. A rank waiting longer than `timeout` for the
// others aborts the collective.
std::unique_ptr<Collective> MakeInProcessCollective(
    std::vector<kernels::Device*> devices, size_t max_bytes,
    std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);

}  // namespace decode_indexer::exec
