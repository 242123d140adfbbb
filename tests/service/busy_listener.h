// A Unix socket listener that never accepts, for the live-server probes' tests (--listen's in
// unix_socket_test, --shm-socket's in security_test): bound at a path with a backlog of 0 and,
// if asked, its backlog filled by non-blocking connects, so that one more connect answers
// EAGAIN and a blocking one would wait until the listener accepts.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace decode_indexer::testing {

class BusyUnixListener {
 public:
  // `type`: SOCK_STREAM or SOCK_SEQPACKET. `fill`: queue connections until the backlog is full
  // (at most 64 tries; full() says whether it filled).
  BusyUnixListener(const std::string& path, int type, bool fill) {
    sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    fd_ = ::socket(AF_UNIX, type, 0);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd_, 0) != 0) {
      ADD_FAILURE() << "cannot listen on " << path << ": " << std::strerror(errno);
      return;
    }
    for (int i = 0; fill && i < 64 && !full_; ++i) {
      const int fd = ::socket(AF_UNIX, type | SOCK_NONBLOCK, 0);
      if (fd < 0) break;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
        queued_.push_back(fd);
        continue;
      }
      EXPECT_EQ(errno, EAGAIN) << std::strerror(errno);
      full_ = true;
      ::close(fd);
    }
  }
  ~BusyUnixListener() {
    for (int fd : queued_) ::close(fd);
    if (fd_ >= 0) ::close(fd_);
  }
  BusyUnixListener(const BusyUnixListener&) = delete;
  BusyUnixListener& operator=(const BusyUnixListener&) = delete;

  int fd() const { return fd_; }
  bool full() const { return full_; }

 private:
  int fd_ = -1;
  bool full_ = false;
  std::vector<int> queued_;
};

}  // namespace decode_indexer::testing
