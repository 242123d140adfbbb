// The shared-memory registration socket (--shm-socket PATH): a Unix-domain SOCK_SEQPACKET
// socket on which a client on the server's host hands over a sealed memfd (SCM_RIGHTS) and
// gets back the region's id for DecodeStepRequest.shared_memory.region_id.
//
// Why not a POSIX shm name over gRPC: whoever can open a named object can ftruncate it, and a
// server that reads q from a shrunk mapping dies of SIGBUS. A memfd sealed with
// F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL can never change size again, so the mapping stays
// valid for as long as the server holds it; and the client proves it may use the memory by
// holding the descriptor (no names to guess, no modes to bypass).
//
// Wire format (little-endian), one message each way per connection:
//   request:  "DISHM001" (8 bytes) | uint64 size, with exactly one descriptor (SCM_RIGHTS)
//   reply:    uint32 status code (absl/gRPC numbering, 0 = OK) | uint64 region id | message
// The peer's credentials (SO_PEERCRED) decide who may register: the server's own uid and
// root; the uid is the owner for the per-client quota.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/service/data_plane.h"
#include "server/service/listen_address.h"

namespace decode_indexer::service {

inline constexpr char kShmSocketMagic[8] = {'D', 'I', 'S', 'H', 'M', '0', '0', '1'};

class ShmSocketServer {
 public:
  // What Start checks before it binds, without binding, so that a server can refuse a bad path
  // before it allocates anything: the path's length, its directory, the path's lock
  // (SocketPathLock: taken first, so that two servers started on it at once cannot both find
  // it free) and the file there (none, or a stale socket nobody accepts on). The lock comes
  // back, to be handed to Start.
  static absl::StatusOr<SocketPathLock> Reserve(const std::string& path);
  // Binds `path` (a stale socket file there is replaced; a live one, one it cannot tell
  // apart from a live one, or anything else is refused), mode 0600 or `mode` (0..0777, set
  // right after the bind; -1: 0600), and serves registrations into `registry` on one thread;
  // `on_map` as for RegionRegistry::RegisterSharedMemoryFd. `lock`: what Reserve(path)
  // returned; without one Start reserves the path itself. The lock is held until the socket is
  // unlinked.
  static absl::StatusOr<std::unique_ptr<ShmSocketServer>> Start(
      const std::string& path, RegionRegistry& registry,
      std::function<void(SharedMemoryRegion&)> on_map, SocketPathLock lock = SocketPathLock(),
      int mode = -1);
  ~ShmSocketServer();  // stops the thread, closes and unlinks the socket, then drops the lock
  ShmSocketServer(const ShmSocketServer&) = delete;
  ShmSocketServer& operator=(const ShmSocketServer&) = delete;
  const std::string& path() const { return path_; }

 private:
  ShmSocketServer() = default;
  void Serve();
  void HandleConnection(int conn);

  std::string path_;
  // Destroyed after the destructor's unlink: the path is ours until its file is gone.
  SocketPathLock lock_;
  int listen_fd_ = -1;
  bool bound_ = false;  // the path is ours to unlink
  int wake_[2] = {-1, -1};
  RegionRegistry* registry_ = nullptr;
  std::function<void(SharedMemoryRegion&)> on_map_;
  std::thread thread_;
};

}  // namespace decode_indexer::service
