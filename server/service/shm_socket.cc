#include "server/service/shm_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/service/listen_address.h"
#include "server/service/status_mapping.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::service {
namespace {

void PutU32(uint32_t v, char* p) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
void PutU64(uint64_t v, char* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

void Reply(int conn, const absl::StatusOr<uint64_t>& result) {
  char buf[12 + 256];
  const absl::Status status = result.status();
  PutU32(static_cast<uint32_t>(status.code()), buf);
  PutU64(result.ok() ? *result : 0, buf + 4);
  const size_t n = std::min<size_t>(status.message().size(), 256);
  if (n > 0) std::memcpy(buf + 12, status.message().data(), n);
  // A peer that does not read its reply only loses it.
  [[maybe_unused]] ssize_t sent = send(conn, buf, 12 + n, MSG_DONTWAIT | MSG_NOSIGNAL);
}

// What is at `path` now: nothing, or a stale socket (*stale), is fine.
absl::Status CheckShmSocketFile(const std::string& path, bool* stale) {
  *stale = false;
  struct stat st = {};
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::AlreadyExistsError(
        absl::StrCat("shm-socket: ", path, " exists and is not a socket"));
  }
  // A stale socket of an earlier run is replaced; a live one (another server) is not, nor
  // one whose state the probe cannot tell: a full backlog (the probe does not wait for it,
  // see ProbeUnixSocket) or a listener of another type (a gRPC --listen socket).
  const int probe = ProbeUnixSocket(path, /*abstract=*/false, SOCK_SEQPACKET);
  if (probe == 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("shm-socket: another server is listening on ", path));
  }
  if (probe != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm-socket: cannot tell whether the socket at ", path,
                     " is in use: ", std::strerror(probe)));
  }
  *stale = true;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SocketPathLock> ShmSocketServer::Reserve(const std::string& path) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path) ||
      path.find('\0') != path.npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm-socket: a path of 1..", sizeof(sockaddr_un{}.sun_path) - 1, " bytes"));
  }
  const std::string what = absl::StrCat("shm-socket: ", EchoInput(path));
  if (absl::Status s = CheckSocketDirectory(path, what); !s.ok()) return s;
  absl::StatusOr<SocketPathLock> lock = SocketPathLock::Acquire(path, what);
  if (!lock.ok()) return lock.status();
  bool stale;
  if (absl::Status s = CheckShmSocketFile(path, &stale); !s.ok()) return s;
  return lock;
}

absl::StatusOr<std::unique_ptr<ShmSocketServer>> ShmSocketServer::Start(
    const std::string& path, RegionRegistry& registry,
    std::function<void(SharedMemoryRegion&)> on_map, SocketPathLock lock, int mode) {
  if (mode < -1 || mode > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm-socket: mode ", mode, ": expected 0..0777 (or -1: 0600)"));
  }
  if (!lock.held()) {
    absl::StatusOr<SocketPathLock> reserved = Reserve(path);
    if (!reserved.ok()) return reserved.status();
    lock = *std::move(reserved);
  }
  // Once more under the lock, as the file may have changed since Reserve (a process that takes
  // no lock); no server that locks can have come in between.
  bool stale;
  if (absl::Status s = CheckShmSocketFile(path, &stale); !s.ok()) return s;
  if (stale) unlink(path.c_str());
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  std::unique_ptr<ShmSocketServer> server(new ShmSocketServer());
  server->path_ = path;
  server->lock_ = std::move(lock);
  server->registry_ = &registry;
  server->on_map_ = std::move(on_map);
  server->listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (server->listen_fd_ < 0) {
    return absl::InternalError(absl::StrCat("shm-socket: socket: ", std::strerror(errno)));
  }
  // Owner-only from the start (0600: a socket's bind gives it 0777 less the umask): no window in
  // which another user could connect.
  const mode_t old_mask = umask(0177);
  const int bound = bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_mask);
  server->bound_ = bound == 0;
  if (bound != 0) {
    return absl::UnavailableError(
        absl::StrCat("shm-socket: cannot listen on ", path, ": ", std::strerror(bind_errno)));
  }
  // --socket-mode between the bind and the listen: nobody can connect before it is set.
  if (mode >= 0) {
    if (absl::Status s = ApplySocketMode(path, mode, "shm-socket"); !s.ok()) return s;
  }
  if (listen(server->listen_fd_, 16) != 0) {
    return absl::UnavailableError(
        absl::StrCat("shm-socket: cannot listen on ", path, ": ", std::strerror(errno)));
  }
  if (pipe2(server->wake_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("shm-socket: pipe: ", std::strerror(errno)));
  }
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

ShmSocketServer::~ShmSocketServer() {
  if (thread_.joinable()) {
    const char byte = 1;
    [[maybe_unused]] ssize_t n = write(wake_[1], &byte, 1);
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
  if (bound_) unlink(path_.c_str());
}

void ShmSocketServer::Serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("shm-socket: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    HandleConnection(conn);
    close(conn);
  }
}

void ShmSocketServer::HandleConnection(int conn) {
  // One connection at a time, each bounded: a peer that sends nothing holds the socket for
  // at most this long.
  timeval timeout = {1, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ucred cred = {};
  socklen_t cred_len = sizeof(cred);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
    Reply(conn, absl::PermissionDeniedError("peer credentials unavailable"));
    return;
  }
  if (cred.uid != geteuid() && cred.uid != 0) {
    Reply(conn, absl::PermissionDeniedError("shared memory: only the server's own user (or root) "
                                            "may register regions"));
    return;
  }
  char buf[64];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  iovec iov = {buf, sizeof(buf)};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  // Every descriptor that came along is closed here, used or not.
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.push_back(fd);
      }
    }
  }
  absl::StatusOr<uint64_t> result;
  if (n != 16 || std::memcmp(buf, kShmSocketMagic, 8) != 0 || (msg.msg_flags & MSG_TRUNC)) {
    result = absl::InvalidArgumentError("request: expected \"DISHM001\" and a uint64 size");
  } else if (fds.size() != 1 || (msg.msg_flags & MSG_CTRUNC)) {
    result = absl::InvalidArgumentError("request: expected exactly one descriptor (SCM_RIGHTS)");
  } else {
    // The registering process, watched by the fast path (a ring in this region is released
    // when it exits). Opened while the peer waits for its reply, so the pid is still its.
    const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, cred.pid, 0));
    result = registry_->RegisterSharedMemoryFd(fds[0], GetU64(buf + 8), cred.uid, on_map_, pidfd);
  }
  for (int fd : fds) close(fd);
  if (!result.ok()) {
    spdlog::info("shm-socket: registration by pid {} uid {} refused: {}", cred.pid, cred.uid,
                 result.status().ToString());
  }
  Reply(conn, result);
}

}  // namespace decode_indexer::service
