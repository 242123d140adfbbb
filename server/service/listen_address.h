// The addresses the server listens on: TCP "host:port", or a Unix domain socket in gRPC's own
// forms, "unix:PATH" (relative or absolute), "unix:///ABSOLUTE/PATH" and
// "unix-abstract:NAME" (Linux's abstract namespace: no file, gone with the process). A client
// on the server's host reaches it over the socket without the TCP stack, which measured no
// faster than TCP loopback for this service's ~1 MB steps (docs/results/grpc-edge.md: the
// socket's default send buffer makes a large message cross in several fills).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace decode_indexer::service {

struct ListenAddress {
  enum class Kind { kTcp, kUnixPath, kUnixAbstract };
  Kind kind = Kind::kTcp;
  // As given: what gRPC binds, and (for a socket) what a client dials.
  std::string address;
  // kUnixPath: the socket's file path; kUnixAbstract: the name (without the leading NUL).
  std::string path;
  // kTcp: the port given (0: gRPC picks one).
  int port = 0;

  bool is_unix() const { return kind != Kind::kTcp; }
};

// The address's form, without touching the system: "host:port" (any host gRPC resolves, the
// port a number in 0..65535) or one of the socket forms above. INVALID_ARGUMENT names what is
// wrong.
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address);

// Each of a server's addresses parsed as above, in order, with the same socket (one path,
// however spelled, or one abstract name) refused when given twice: gRPC would unlink the first's
// socket file and bind the second over it, leaving that listener unreachable. So are two TCP
// addresses that bind one address and port (port 0 aside: each picks its own): the second bind
// would fail with only gRPC's "No address added" (the server turns gRPC's default SO_REUSEPORT
// off, server.cc), so the overlap is named here instead. Two hosts overlap when they share an
// address: a wildcard host ("", 0.0.0.0, [::]: gRPC binds any of them as the dual-stack
// wildcard) takes the port on every address, localhost is 127.0.0.1 and [::1], an IP literal is
// itself however written (127.1, [0::1], [::ffff:127.0.0.1] for 127.0.0.1), and any other name
// only itself (names are not resolved: parsing touches nothing). INVALID_ARGUMENT names the
// address and the one it repeats or overlaps.
absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(
    const std::vector<std::string>& addresses);

// --shm-socket's path against the --listen addresses: the same file as one of their socket paths
// (however either is spelled: relative or absolute, unix: or unix:///) is refused, as both
// listeners would bind it and the second would unlink the first's socket. INVALID_ARGUMENT naming
// both flags.
absl::Status CheckShmSocketIsNotListened(const std::string& shm_socket,
                                         const std::vector<ListenAddress>& listen);

// --socket-mode's value: octal digits (a leading 0 is optional), at most 0777 (no setuid, setgid
// or sticky bit). INVALID_ARGUMENT naming the flag and what it expects.
absl::StatusOr<int> ParseSocketMode(absl::string_view text);

// chmod `path` (a socket file just bound) to `mode` (0..0777); `what` starts the message.
absl::Status ApplySocketMode(const std::string& path, int mode, absl::string_view what);

// An exclusive advisory lock (flock) on PATH.lock beside a socket file, held while this object
// lives. Checking a path (is a live server on it?) and binding it are two steps, so two servers
// started on one path at the same instant could both find it free, and the second's bind (which
// unlinks the file first) would take the first's path, leaving it serving on nothing. Whoever
// holds the lock owns the path: a server takes it before it checks the path and keeps it until
// its socket is gone, so the second one is refused at once. Another server of the same process
// is refused the same way (flock belongs to the open file, not the process). A killed server's
// lock goes with it (the kernel drops a flock with the last descriptor of its file).
//
// The lock file is removed when the lock is let go (so that refused starts, tests and restarts
// leave nothing in the socket's directory), by its holder, while it still holds it, and only if
// the path still names the file it locked. Removing a lock file is racy on its own: a server
// that opened the file just before the removal would then lock a file nobody else can find,
// while a third creates and locks a new one, and both would own the path. So Acquire, once it
// holds the lock, checks that the path still names the file it locked, and starts over if not.
// Anyone who removes a lock file by hand while its server runs breaks this (a second server
// could then start on the path): leave them alone.
class SocketPathLock {
 public:
  SocketPathLock() = default;  // holds nothing
  SocketPathLock(SocketPathLock&& other) noexcept;
  SocketPathLock& operator=(SocketPathLock&& other) noexcept;
  SocketPathLock(const SocketPathLock&) = delete;
  SocketPathLock& operator=(const SocketPathLock&) = delete;
  ~SocketPathLock();

  // Opens (creating it, mode 0600; O_CLOEXEC, O_NOFOLLOW: a symlink there is refused) and locks
  // socket_path + ".lock" without waiting. ALREADY_EXISTS "another server holds PATH" when
  // someone holds it; `what` starts every message ("listen: \"unix:/run/x.sock\"").
  static absl::StatusOr<SocketPathLock> Acquire(const std::string& socket_path,
                                                absl::string_view what);

  bool held() const { return fd_ >= 0; }
  const std::string& lock_path() const { return lock_path_; }

 private:
  void Release();  // removes the file (see above) and drops the lock

  int fd_ = -1;
  std::string lock_path_;
};

// Whether a socket address can be bound, before gRPC tries: gRPC reports only "No address
// added", and it removes whatever socket file is at the path before it binds, so a second
// server started on a live server's path would silently take the path over (the first
// keeps running, unreachable). So: the directory must exist and be writable, then the path's
// lock (SocketPathLock) is taken, then an existing file must be a socket and no process may be
// accepting on it (a stale socket left by a killed server is fine: gRPC replaces it). The lock
// comes back, to be held until the socket is gone; TCP and abstract addresses take none (an
// abstract name has no file to take over: a second bind of it fails with EADDRINUSE).
absl::StatusOr<SocketPathLock> ReserveListenAddress(const ListenAddress& address);

// The directory of a socket file `path` exists and this process may create a file in it;
// `what` starts the message.
absl::Status CheckSocketDirectory(const std::string& path, absl::string_view what);

// What a connect of `type` (the listener's: SOCK_STREAM, SOCK_SEQPACKET) to the Unix socket at
// `path` (`abstract`: the abstract name, without its leading NUL) answers, for a caller that
// replaces a socket file only when nobody serves on it: 0 when a process accepts on it,
// ECONNREFUSED when none does (a stale file left by a killed process), otherwise the errno that
// leaves it open (EAGAIN: a live listener whose backlog is full; EPROTOTYPE: a live listener
// of another type; EACCES). The connect does not block: a blocking one to a live listener
// whose backlog is full waits until it accepts, which would hang the caller's start.
int ProbeUnixSocket(const std::string& path, bool abstract, int type);

// What a bind of a SOCK_STREAM socket to the abstract `name` (without its leading NUL)
// answers: 0 (the socket is closed again at once, freeing the name), or the errno (EADDRINUSE:
// another socket holds the name). To tell why gRPC could not serve on it.
int BindAbstractErrno(const std::string& name);

// What a client on this host dials to reach `address` once bound on `port` (gRPC's selected
// port; unused for a socket): a wildcard or loopback host becomes 127.0.0.1, a socket
// address is dialled as given.
std::string ConnectAddress(const ListenAddress& address, int port);

}  // namespace decode_indexer::service
