// The data plane's compact and zero-copy paths: the delta-varint answer encoding
// (AnswerEncoding), the client regions (shared memory handed over the shm socket, device
// buffers opened through CUDA IPC: RegisterCudaIpcMemory) and their one registry.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace decode_indexer::service {

// Appends rows x k sorted, -1 padded positions in ANSWER_ENCODING_DELTA_VARINT form.
void EncodeTopkDelta(std::span<const int32_t> topk, int32_t rows, int32_t k, std::string& out);

// 64 random bits, never 0: region ids are capabilities (whoever holds one may use and
// unregister the region), so they must not be guessable.
uint64_t RandomRegionId();

// A mapped client region (a sealed memfd); unmapped when the last step using it lets go.
class SharedMemoryRegion {
 public:
  SharedMemoryRegion(void* base, uint64_t size, uint32_t owner_uid, int owner_pidfd = -1)
      : base_(static_cast<uint8_t*>(base)),
        size_(size),
        owner_uid_(owner_uid),
        owner_pidfd_(owner_pidfd) {}
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  // [offset, offset + bytes) inside the region, else INVALID_ARGUMENT naming `field`
  // ("shared_memory.<field>").
  absl::StatusOr<uint8_t*> Span(const char* field, uint64_t offset, uint64_t bytes) const;
  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  uint32_t owner_uid() const { return owner_uid_; }
  // A pidfd of the process that registered the region (SO_PEERCRED at the shm socket),
  // readable once it has exited; -1 when unknown. The region owns it. The fast path's
  // poller watches it to release a dead worker's ring.
  int owner_pidfd() const { return owner_pidfd_; }
  // Runs just before the unmap (e.g. to undo a page-lock of the region).
  void SetReleaseHook(std::function<void()> hook) { release_ = std::move(hook); }
  // Whether the region was page-locked for every device (set once, before first use): the
  // executor then copies q from and answers into it with no staging copy.
  void MarkPageLocked() { page_locked_ = true; }
  bool page_locked() const { return page_locked_; }

 private:
  uint8_t* base_;
  uint64_t size_;
  uint32_t owner_uid_;
  int owner_pidfd_;
  std::function<void()> release_;
  bool page_locked_ = false;
};

}  // namespace decode_indexer::service

namespace decode_indexer::service {

// A client's device buffer opened in the answering rank's backend (CUDA IPC): a device
// pointer, never dereferenced on the host. Closed (the close hook) when the last step using
// it lets go.
class CudaIpcRegion {
 public:
  CudaIpcRegion(void* base, uint64_t size, std::function<void(void*)> close)
      : base_(static_cast<uint8_t*>(base)), size_(size), close_(std::move(close)) {}
  ~CudaIpcRegion() {
    if (close_event_) {
      if (inputs_event_ != nullptr) close_event_(inputs_event_);
      if (answer_event_ != nullptr) close_event_(answer_event_);
    }
    if (close_) close_(base_);
  }
  CudaIpcRegion(const CudaIpcRegion&) = delete;
  CudaIpcRegion& operator=(const CudaIpcRegion&) = delete;

  // [offset, offset + bytes) inside the buffer, else INVALID_ARGUMENT naming
  // "cuda_ipc.<field>"; offsets must keep int32 alignment.
  absl::StatusOr<uint8_t*> Span(const char* field, uint64_t offset, uint64_t bytes) const;
  uint64_t size() const { return size_; }
  // The CUDA IPC events registered with the buffer (null: none), opened in the same backend;
  // `close_event` closes each when the region goes.
  void SetEvents(void* inputs, void* answer, std::function<void(void*)> close_event) {
    inputs_event_ = inputs;
    answer_event_ = answer;
    close_event_ = std::move(close_event);
  }
  void* inputs_event() const { return inputs_event_; }
  void* answer_event() const { return answer_event_; }

 private:
  uint8_t* base_;
  uint64_t size_;
  std::function<void(void*)> close_;
  void* inputs_event_ = nullptr;
  void* answer_event_ = nullptr;
  std::function<void(void*)> close_event_;
};

// Every region the clients registered, shared memory and CUDA IPC, in one table and one id
// space: an id names one region of one kind, and a step's shared_memory / cuda_ipc field finds
// only a region of its own kind (another kind's id is "no such region" there, as an unknown
// one). Ids are random capabilities (RandomRegionId). A region stays alive while a step holds
// its shared_ptr, whatever happens to the registration meanwhile.
class RegionRegistry {
 public:
  static constexpr size_t kMaxSharedMemoryRegions = 64;
  static constexpr size_t kMaxSharedMemoryRegionsPerOwner = 16;
  static constexpr uint64_t kMaxSharedMemoryBytes = uint64_t{1} << 40;
  static constexpr size_t kMaxCudaIpcRegions = 64;

  // Maps `size` bytes of the memfd `fd` (the caller keeps and closes fd) for a client of
  // `owner_uid`: the descriptor must be a read-write memfd sealed against shrinking and
  // growing with the seals themselves sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), so
  // the mapping can never lose its pages (no SIGBUS), of at least `size` bytes. `on_map`
  // (optional) sees the new region before it can be used (page-locking). `owner_pidfd`
  // (optional, see SharedMemoryRegion::owner_pidfd) is taken over: closed on failure, else
  // by the region. Answers the new region's id.
  absl::StatusOr<uint64_t> RegisterSharedMemoryFd(
      int fd, uint64_t size, uint32_t owner_uid,
      const std::function<void(SharedMemoryRegion&)>& on_map = nullptr, int owner_pidfd = -1);
  // A CUDA IPC buffer opened by the caller (RegisterCudaIpcMemory); RESOURCE_EXHAUSTED past
  // kMaxCudaIpcRegions (HasRoomForCudaIpc asks before the opening work).
  absl::StatusOr<uint64_t> AddCudaIpc(std::shared_ptr<CudaIpcRegion> region);
  bool HasRoomForCudaIpc() const;
  // Unregistration, each for its own kind (NOT_FOUND naming region_id otherwise, nothing
  // changed).
  absl::Status UnregisterSharedMemory(uint64_t region_id);
  absl::Status UnregisterCudaIpc(uint64_t region_id);
  // The step's lookups (NOT_FOUND naming shared_memory.region_id / cuda_ipc.region_id).
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemory(uint64_t region_id) const;
  absl::StatusOr<std::shared_ptr<CudaIpcRegion>> CudaIpc(uint64_t region_id) const;
  size_t shared_memory_count() const;
  size_t cuda_ipc_count() const;

 private:
  // One of the two is set.
  struct Entry {
    std::shared_ptr<SharedMemoryRegion> shm;
    std::shared_ptr<CudaIpcRegion> ipc;
  };
  size_t CountLocked(bool shm) const;
  size_t OwnedLocked(uint32_t owner_uid) const;
  uint64_t NewIdLocked() const;

  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> regions_;
};

}  // namespace decode_indexer::service
