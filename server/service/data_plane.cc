#include "server/service/data_plane.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
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
    std::span<const int32_t> row = topk.subspan(static_cast<size_t>(r) * k, k);
    uint32_t valid = 0;
    while (valid < static_cast<uint32_t>(k) && row[valid] >= 0) ++valid;
    char* p = PutVarint(valid, scratch.data());
    int64_t prev = -1;
    for (uint32_t i = 0; i < valid; ++i) {
      // Ascending and distinct, so every gap is >= 0.
      p = PutVarint(static_cast<uint32_t>(row[i] - prev - 1), p);
      prev = row[i];
    }
    out.append(scratch.data(), p);
  }
}

SharedMemoryRegion::~SharedMemoryRegion() {
  if (release_) release_();
  if (base_ != nullptr) munmap(base_, size_);
}

absl::StatusOr<uint8_t*> SharedMemoryRegion::Span(const char* field, uint64_t offset,
                                                  uint64_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("shared_memory.", field, ": [", offset, ", +",
                                                   bytes, ") is outside the region of ", size_,
                                                   " bytes (", name_, ")"));
  }
  return base_ + offset;
}

absl::StatusOr<uint64_t> SharedMemoryRegistry::Register(
    const std::string& name, uint64_t size,
    const std::function<void(SharedMemoryRegion&)>& on_map) {
  // Only objects named for this purpose: a remote caller must not map arbitrary shm
  // objects of the server's host.
  if (name.size() < 5 || name.size() > 255 || name.rfind("/di-", 0) != 0 ||
      name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: expected a POSIX shm name \"/di-...\", got \"", name, "\""));
  }
  if (size == 0) return absl::InvalidArgumentError("size: must be positive");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.size() >= kMaxRegions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("at most ", kMaxRegions, " shared-memory regions"));
    }
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int open_errno = errno;
    if (open_errno == EACCES || open_errno == EPERM) {
      // Typically the frontend and the server run as different users (the image's server is
      // uid 10001) and the object is mode 0600.
      return absl::PermissionDeniedError(absl::StrCat(
          "name: shm_open ", name, ": ", std::strerror(open_errno), " (server uid ", geteuid(),
          "): create the object readable and writable by the server's user (same uid, or a "
          "shared group and mode 0660)"));
    }
    return absl::NotFoundError(
        absl::StrCat("name: shm_open ", name, ": ", std::strerror(open_errno)));
  }
  struct stat st = {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("size: ", size, " exceeds the object's ",
                                                   static_cast<int64_t>(st.st_size), " bytes"));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  close(fd);  // the mapping keeps the object alive
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap ", name, ": ", std::strerror(mmap_errno)));
  }
  auto region = std::make_shared<SharedMemoryRegion>(base, size, name);
  if (on_map) on_map(*region);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  regions_.emplace(id, std::move(region));
  return id;
}

absl::Status SharedMemoryRegistry::Unregister(uint64_t region_id) {
  std::shared_ptr<SharedMemoryRegion> gone;  // unmapped (and unpinned) outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("region_id: no region ", region_id));
    }
    gone = std::move(it->second);
    regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryRegistry::Get(
    uint64_t region_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared_memory.region_id: no region ", region_id, " (register it first)"));
  }
  return it->second;
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

absl::StatusOr<uint64_t> CudaIpcRegistry::Add(std::shared_ptr<CudaIpcRegion> region) {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.size() >= kMaxRegions) {
    return absl::ResourceExhaustedError(absl::StrCat("at most ", kMaxRegions, " CUDA IPC regions"));
  }
  const uint64_t id = next_id_++;
  regions_.emplace(id, std::move(region));
  return id;
}

absl::Status CudaIpcRegistry::Remove(uint64_t region_id) {
  std::shared_ptr<CudaIpcRegion> gone;  // closed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("region_id: no CUDA IPC region ", region_id));
    }
    gone = std::move(it->second);
    regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<CudaIpcRegion>> CudaIpcRegistry::Get(uint64_t region_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region_id);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("cuda_ipc.region_id: no CUDA IPC region ", region_id, " (register it first)"));
  }
  return it->second;
}

size_t CudaIpcRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

}  // namespace decode_indexer::service
