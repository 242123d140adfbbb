// What the socket tests share (--listen's in unix_socket_test, --shm-socket's in
// security_test): a listener that never accepts, and servers started at one instant.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace decode_indexer::testing {

// A Unix socket listener that never accepts, for the live-server probes' tests: bound at a
// path with a backlog of 0 and, if asked, its backlog filled by non-blocking connects, so that
// one more connect answers EAGAIN and a blocking one would wait until the listener accepts.
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

// Runs start(i) for i < n on n threads released together (the closest a test gets to n
// servers started at one instant); answers every result, in order, the winners still alive.
// Every refusal must be ALREADY_EXISTS naming "another server holds `held_path`".
template <typename T>
std::vector<absl::StatusOr<T>> StartAllAtOnce(int n,
                                              const std::function<absl::StatusOr<T>(int)>& start,
                                              const std::string& held_path, int* winners) {
  std::vector<absl::StatusOr<T>> started;
  for (int i = 0; i < n; ++i) started.emplace_back(absl::UnknownError("not started"));
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < n) std::this_thread::yield();
      started[i] = start(i);
    });
  }
  for (std::thread& t : threads) t.join();
  *winners = 0;
  for (const auto& s : started) {
    if (s.ok()) {
      ++*winners;
      continue;
    }
    EXPECT_EQ(s.status().code(), absl::StatusCode::kAlreadyExists) << s.status();
    EXPECT_NE(s.status().message().find("another server holds " + held_path), std::string::npos)
        << s.status();
  }
  return started;
}

}  // namespace decode_indexer::testing
