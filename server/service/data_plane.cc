#include "server/service/data_plane.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace decode_indexer::service {
namespace {

// Writes v as a varint at p; answers the byte after it.
char* PutVarint(uint32_t v, char* p) {
  while (v >= 0x80) {
    *p++ = static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<char>(v);
  return p;
}

}  // namespace

void EncodeTopkDelta(std::span<const int32_t> topk, int32_t rows, int32_t k, std::string& out) {
  // A row encodes into at most 5 * (k + 1) bytes: each is encoded into a scratch row and
  // appended once (byte-wise push_back cost more than the encoding itself).
  std::vector<char> scratch(size_t(5) * (static_cast<size_t>(k) + 1));
  out.reserve(out.size() + static_cast<size_t>(rows) * (static_cast<size_t>(k) + 5));
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t* row = topk.data() + static_cast<size_t>(r) * k;
    // Positions, then -1 padding: a row whose last entry is a position is full (most rows).
    uint32_t valid = 0;
    if (k > 0 && row[k - 1] >= 0) {
      valid = static_cast<uint32_t>(k);
    } else {
      while (valid < static_cast<uint32_t>(k) && row[valid] >= 0) ++valid;
    }
    char* p = PutVarint(valid, scratch.data());
    uint32_t i = 0;
    if (valid > 0) p = PutVarint(static_cast<uint32_t>(row[i++]), p);  // the first position
    // Then the gaps (position - previous - 1; ascending and distinct, so >= 0, and a difference
    // of two non-negative int32 cannot overflow), sixteen at a time: with K of 2048 in 8K+
    // keys nearly every gap is below 128, a one-byte varint, so a group of sixteen such is
    // computed and stored without a branch per gap; a group holding a longer gap goes varint
    // by varint. Twice as fast as varint by varint (docs/results/data-plane.md).
    for (; i + 16 <= valid; i += 16) {
      uint32_t any = 0;
      uint8_t bytes[16];
      for (int j = 0; j < 16; ++j) {
        const auto gap = static_cast<uint32_t>(row[i + j] - row[i + j - 1] - 1);
        any |= gap;
        bytes[j] = static_cast<uint8_t>(gap);
      }
      if (any < 0x80) {
        std::memcpy(p, bytes, 16);
        p += 16;
      } else {
        for (int j = 0; j < 16; ++j) {
          p = PutVarint(static_cast<uint32_t>(row[i + j] - row[i + j - 1] - 1), p);
        }
      }
    }
    for (; i < valid; ++i) p = PutVarint(static_cast<uint32_t>(row[i] - row[i - 1] - 1), p);
    out.append(scratch.data(), p);
  }
}

SharedMemoryRegion::~SharedMemoryRegion() {
  if (release_) release_();
  if (base_ != nullptr) munmap(base_, size_);
  if (owner_pidfd_ >= 0) close(owner_pidfd_);
}

absl::StatusOr<uint8_t*> SharedMemoryRegion::Span(const char* field, uint64_t offset,
                                                  uint64_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("shared_memory.", field, ": [", offset, ", +",
                                                   bytes, ") is outside the region of ", size_,
                                                   " bytes"));
  }
  return base_ + offset;
}

uint64_t RandomRegionId() {
  uint64_t id = 0;
  while (id == 0) {
    if (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) {
      std::random_device rd;  // getrandom cannot fail on Linux >= 3.17 for 8 bytes
      id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
  }
  return id;
}

absl::StatusOr<uint64_t> RegionRegistry::RegisterSharedMemoryFd(
    int fd, uint64_t size, uint32_t owner_uid,
    const std::function<void(SharedMemoryRegion&)>& on_map, int owner_pidfd) {
  // Closed on every failure; handed to the region on success.
  struct PidfdGuard {
    int fd;
    ~PidfdGuard() {
      if (fd >= 0) close(fd);
    }
  } pidfd{owner_pidfd};
  if (size == 0 || size > kMaxSharedMemoryBytes) {
    return absl::InvalidArgumentError(absl::StrCat("size: must be in [1, 2^40] bytes, got ", size));
  }
  // The server writes answers into it: the client must hold it read-write too.
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR) {
    return absl::PermissionDeniedError("descriptor: not open read-write");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        "descriptor: not a sealable memfd (create it with memfd_create(MFD_ALLOW_SEALING))");
  }
  constexpr int kNeeded = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  if ((seals & kNeeded) != kNeeded) {
    return absl::FailedPreconditionError(
        "descriptor: seal it with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL first (an unsealed "
        "object could be shrunk under the server)");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::FailedPreconditionError("descriptor: write-sealed (the answer is written there)");
  }
  struct stat st = {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("descriptor: not a memfd");
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    return absl::InvalidArgumentError(
        absl::StrCat("size: ", size, " exceeds the memfd's ", st.st_size, " bytes"));
  }
  // Every page allocated by the client: the server maps the region populated and page-locks
  // it, so pages the client only sized would be allocated here, charged to the server (a
  // client could then make the server take up to 2^40 bytes, the whole host's memory, by one
  // ftruncate). st_blocks counts 512-byte units of allocated pages.
  if (static_cast<uint64_t>(st.st_blocks) * 512 < size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "descriptor: ", static_cast<uint64_t>(st.st_blocks) * 512, " of its ", size,
        " bytes allocated; allocate every page (posix_fallocate) before registering it"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (CountLocked(/*shm=*/true) >= kMaxSharedMemoryRegions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("at most ", kMaxSharedMemoryRegions, " shared-memory regions"));
    }
    if (OwnedLocked(owner_uid) >= kMaxSharedMemoryRegionsPerOwner) {
      return absl::ResourceExhaustedError(absl::StrCat("at most ", kMaxSharedMemoryRegionsPerOwner,
                                                       " shared-memory regions per client user"));
    }
  }
  // Populated now: the pages exist before any step touches them.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap: ", std::strerror(errno)));
  }
  auto region = std::make_shared<SharedMemoryRegion>(base, size, owner_uid, pidfd.fd);
  pidfd.fd = -1;
  if (on_map) on_map(*region);
  std::lock_guard<std::mutex> lock(mu_);
  // Checked again: a racing registration may have taken the last slot meanwhile.
  if (CountLocked(/*shm=*/true) >= kMaxSharedMemoryRegions ||
      OwnedLocked(owner_uid) >= kMaxSharedMemoryRegionsPerOwner) {
    return absl::ResourceExhaustedError("shared-memory regions: quota reached meanwhile");
  }
  const uint64_t id = NewIdLocked();
  regions_.emplace(id, Entry{std::move(region), nullptr});
  return id;
}

}  // namespace decode_indexer::service

namespace decode_indexer::service {

absl::StatusOr<uint8_t*> CudaIpcRegion::Span(const char* field, uint64_t offset,
                                             uint64_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.", field, ": [", offset, ", +", bytes,
                                                   ") is outside the registered ", size_,
                                                   " bytes of device memory"));
  }
  if (offset % sizeof(int32_t) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.", field, ": ", offset, " is not a multiple of 4 (int32 answer)"));
  }
  return base_ + offset;
}

size_t RegionRegistry::CountLocked(bool shm) const {
  size_t n = 0;
  for (const auto& [id, e] : regions_) n += shm ? e.shm != nullptr : e.ipc != nullptr;
  return n;
}

size_t RegionRegistry::OwnedLocked(uint32_t owner_uid) const {
  size_t n = 0;
  for (const auto& [id, e] : regions_) n += e.shm != nullptr && e.shm->owner_uid() == owner_uid;
  return n;
}

uint64_t RegionRegistry::NewIdLocked() const {
  uint64_t id = RandomRegionId();
  while (regions_.count(id) != 0) id = RandomRegionId();
  return id;
}

bool RegionRegistry::HasRoomForCudaIpc() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CountLocked(/*shm=*/false) < kMaxCudaIpcRegions;
}

absl::StatusOr<uint64_t> RegionRegistry::AddCudaIpc(std::shared_ptr<CudaIpcRegion> region) {
  std::lock_guard<std::mutex> lock(mu_);
  if (CountLocked(/*shm=*/false) >= kMaxCudaIpcRegions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("at most ", kMaxCudaIpcRegions, " CUDA IPC regions"));
  }
  const uint64_t id = NewIdLocked();
  regions_.emplace(id, Entry{nullptr, std::move(region)});
  return id;
}

absl::Status RegionRegistry::UnregisterSharedMemory(uint64_t region_id) {
  std::shared_ptr<SharedMemoryRegion> gone;  // unmapped (and unpinned) outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.shm == nullptr) {
      return absl::NotFoundError("region_id: no such region");
    }
    gone = std::move(it->second.shm);
    regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::UnregisterCudaIpc(uint64_t region_id) {
  std::shared_ptr<CudaIpcRegion> gone;  // closed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.ipc == nullptr) {
      return absl::NotFoundError("region_id: no such CUDA IPC region");
    }
    gone = std::move(it->second.ipc);
    regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> RegionRegistry::SharedMemory(
    uint64_t region_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end() || it->second.shm == nullptr) {
    return absl::NotFoundError("shared_memory.region_id: no such region (register it first)");
  }
  return it->second.shm;
}

absl::StatusOr<std::shared_ptr<CudaIpcRegion>> RegionRegistry::CudaIpc(uint64_t region_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end() || it->second.ipc == nullptr) {
    return absl::NotFoundError("cuda_ipc.region_id: no such CUDA IPC region (register it first)");
  }
  return it->second.ipc;
}

size_t RegionRegistry::shared_memory_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CountLocked(/*shm=*/true);
}

size_t RegionRegistry::cuda_ipc_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CountLocked(/*shm=*/false);
}

}  // namespace decode_indexer::service
