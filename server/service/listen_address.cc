#include "server/service/listen_address.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/service/status_mapping.h"

namespace decode_indexer::service {
namespace {

constexpr absl::string_view kUnix = "unix:";
constexpr absl::string_view kUnixAbstract = "unix-abstract:";
// sun_path's size, less the terminating NUL (an abstract name's leading NUL) gRPC writes.
constexpr size_t kMaxSocketPath = sizeof(sockaddr_un{}.sun_path) - 1;

absl::Status Invalid(absl::string_view address, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "listen: ", EchoInput(std::string_view(address.data(), address.size())), ": ", why));
}

// A socket path made absolute and normal: "x.sock", "./x.sock" and "/cwd/x.sock" are one file.
// A symlinked directory is not seen through, as that would touch the system (the path's lock,
// SocketPathLock, still tells two spellings of one file apart at start).
std::string NormalSocketPath(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(path, ec);
  return (ec ? std::filesystem::path(path) : absolute).lexically_normal().string();
}

// The addresses a TCP host binds, as ParseListenAddresses compares them: "4:a.b.c.d",
// "6:<canonical IPv6>" or "n:<lowercase name>"; a wildcard binds them all.
struct TcpHost {
  bool wildcard = false;
  std::vector<std::string> addresses;
};

TcpHost ParseTcpHost(absl::string_view host) {
  TcpHost out;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string name = absl::AsciiStrToLower(host);
  if (name.empty()) {
    out.wildcard = true;
    return out;
  }
  if (name == "localhost") {
    out.addresses = {"4:127.0.0.1", "6:::1"};
    return out;
  }
  char text[INET6_ADDRSTRLEN] = {};
  in6_addr v6 = {};
  in_addr v4 = {};
  if (name.find(':') != name.npos && ::inet_pton(AF_INET6, name.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_V4MAPPED(&v6)) {
      std::memcpy(&v4, v6.s6_addr + 12, 4);
    } else {
      out.wildcard = IN6_IS_ADDR_UNSPECIFIED(&v6);
      ::inet_ntop(AF_INET6, &v6, text, sizeof(text));
      out.addresses = {absl::StrCat("6:", text)};
      return out;
    }
  } else if (name.find(':') != name.npos || ::inet_aton(name.c_str(), &v4) == 0) {
    // As the resolver reads numbers (inet_aton: "127.1" is 127.0.0.1); anything else a name.
    out.addresses = {absl::StrCat("n:", name)};
    return out;
  }
  out.wildcard = v4.s_addr == htonl(INADDR_ANY);
  ::inet_ntop(AF_INET, &v4, text, sizeof(text));
  out.addresses = {absl::StrCat("4:", text)};
  return out;
}

// An address of TcpHost as a reader writes it.
std::string ShowTcpAddress(const std::string& address) {
  if (absl::StartsWith(address, "6:")) return absl::StrCat("[", address.substr(2), "]");
  return address.substr(2);
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& given) {
  const absl::string_view address = given;
  ListenAddress out;
  out.address = given;
  if (absl::StartsWith(address, kUnixAbstract)) {
    out.kind = ListenAddress::Kind::kUnixAbstract;
    out.path = std::string(address.substr(kUnixAbstract.size()));
    if (out.path.empty()) return Invalid(address, "unix-abstract: needs a name");
    if (out.path.size() > kMaxSocketPath - 1) {
      return Invalid(address,
                     absl::StrCat("an abstract socket's name holds at most ", kMaxSocketPath - 1,
                                  " bytes, this one has ", out.path.size()));
    }
    return out;
  }
  if (absl::StartsWith(address, kUnix)) {
    out.kind = ListenAddress::Kind::kUnixPath;
    absl::string_view path = address.substr(kUnix.size());
    // "unix://" starts a URI whose authority must be empty ("unix:///run/x.sock"); gRPC's
    // clients refuse "unix://host/...", so the server does not serve on one.
    if (absl::StartsWith(path, "//")) {
      path.remove_prefix(2);
      if (!absl::StartsWith(path, "/")) {
        return Invalid(address,
                       "unix:// must be followed by an absolute path (unix:///run/x.sock)");
      }
    }
    if (path.empty()) return Invalid(address, "unix: needs a path (unix:/run/x.sock)");
    if (path.find('\0') != path.npos) return Invalid(address, "a socket path holds no NUL byte");
    if (path.size() > kMaxSocketPath) {
      return Invalid(address, absl::StrCat("a Unix socket's path holds at most ", kMaxSocketPath,
                                           " bytes, this one has ", path.size()));
    }
    out.path = std::string(path);
    return out;
  }
  const size_t colon = address.rfind(':');
  const absl::string_view digits = colon == address.npos ? "" : address.substr(colon + 1);
  uint32_t port = 0;
  if (digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); }) ||
      !absl::SimpleAtoi(digits, &port) || port > 65535) {
    return Invalid(address,
                   "expected host:port (port 0: pick one), unix:PATH or unix-abstract:NAME");
  }
  out.port = static_cast<int>(port);
  return out;
}

absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(
    const std::vector<std::string>& addresses) {
  std::vector<ListenAddress> out;
  // What makes two sockets one listener: the kind and the path made absolute and normal
  // (NormalSocketPath), or the abstract name. TCP addresses are compared as ParseTcpHost reads
  // their hosts, on one port.
  std::vector<std::string> keys;
  std::vector<TcpHost> hosts;
  for (const std::string& address : addresses) {
    absl::StatusOr<ListenAddress> parsed = ParseListenAddress(address);
    if (!parsed.ok()) return parsed.status();
    std::string key;
    TcpHost host;
    switch (parsed->kind) {
      case ListenAddress::Kind::kUnixPath:
        key = absl::StrCat("p", NormalSocketPath(parsed->path));
        break;
      case ListenAddress::Kind::kUnixAbstract:
        key = absl::StrCat("a", parsed->path);
        break;
      case ListenAddress::Kind::kTcp:
        host = ParseTcpHost(absl::string_view(address).substr(0, address.rfind(':')));
        break;
    }
    for (size_t i = 0; i < out.size(); ++i) {
      const ListenAddress& before = out[i];
      if (before.kind != parsed->kind) continue;
      const std::string same =
          before.address == address
              ? "given twice"
              : absl::StrCat("the same address as ", EchoInput(before.address), ", given twice");
      if (parsed->kind != ListenAddress::Kind::kTcp) {
        if (keys[i] == key) return Invalid(address, same);
        continue;
      }
      // Port 0 twice is two ports.
      if (parsed->port == 0 || before.port != parsed->port) continue;
      const TcpHost& other = hosts[i];
      if ((host.wildcard && other.wildcard) ||
          (!host.wildcard && !other.wildcard && host.addresses == other.addresses)) {
        return Invalid(address, same);
      }
      const std::string overlaps = absl::StrCat("overlaps ", EchoInput(before.address), ": ");
      if (host.wildcard || other.wildcard) {
        return Invalid(address,
                       absl::StrCat(overlaps, "a wildcard host (0.0.0.0, [::]) takes port ",
                                    parsed->port, " on every address, IPv4 and IPv6"));
      }
      for (const std::string& a : host.addresses) {
        if (std::find(other.addresses.begin(), other.addresses.end(), a) == other.addresses.end()) {
          continue;
        }
        return Invalid(address, absl::StrCat(overlaps, "both bind ", ShowTcpAddress(a), " port ",
                                             parsed->port, " (localhost is 127.0.0.1 and [::1])"));
      }
    }
    keys.push_back(std::move(key));
    hosts.push_back(std::move(host));
    out.push_back(*std::move(parsed));
  }
  return out;
}

absl::Status CheckShmSocketIsNotListened(const std::string& shm_socket,
                                         const std::vector<ListenAddress>& listen) {
  if (shm_socket.empty()) return absl::OkStatus();
  const std::string path = NormalSocketPath(shm_socket);
  for (const ListenAddress& address : listen) {
    if (address.kind != ListenAddress::Kind::kUnixPath || NormalSocketPath(address.path) != path) {
      continue;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("shm-socket: ", EchoInput(shm_socket), " is the socket of --listen ",
                     EchoInput(address.address),
                     ": the shared-memory socket needs a path of its own (gRPC would unlink "
                     "it to bind its own)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ParseSocketMode(absl::string_view text) {
  int mode = 0;
  bool valid = !text.empty();
  for (char c : text) {
    valid = valid && c >= '0' && c <= '7' && mode <= 0777;  // no overflow: stops past 0777
    if (valid) mode = mode * 8 + (c - '0');
  }
  if (!valid || mode > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket-mode: ", EchoInput(std::string_view(text.data(), text.size())),
                     ": expected an octal file mode of at most 0777 (e.g. 0660: owner and group)"));
  }
  return mode;
}

absl::Status ApplySocketMode(const std::string& path, int mode, absl::string_view what) {
  if (::chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) {
    return absl::InternalError(absl::StrFormat("%s: cannot set %s's mode to %04o: %s", what,
                                               EchoInput(path), mode, std::strerror(errno)));
  }
  return absl::OkStatus();
}

SocketPathLock::SocketPathLock(SocketPathLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), lock_path_(std::move(other.lock_path_)) {}

SocketPathLock& SocketPathLock::operator=(SocketPathLock&& other) noexcept {
  if (this != &other) {
    Release();
    fd_ = std::exchange(other.fd_, -1);
    lock_path_ = std::move(other.lock_path_);
  }
  return *this;
}

SocketPathLock::~SocketPathLock() { Release(); }

void SocketPathLock::Release() {
  if (fd_ < 0) return;
  // Removed while still locked, and only if the path still names the file locked here (nobody
  // but the holder removes it, see Acquire).
  struct stat mine = {};
  struct stat there = {};
  if (::fstat(fd_, &mine) == 0 && ::lstat(lock_path_.c_str(), &there) == 0 &&
      mine.st_dev == there.st_dev && mine.st_ino == there.st_ino) {
    ::unlink(lock_path_.c_str());
  }
  ::close(fd_);
  fd_ = -1;
}

absl::StatusOr<SocketPathLock> SocketPathLock::Acquire(const std::string& socket_path,
                                                       absl::string_view what) {
  SocketPathLock lock;
  lock.lock_path_ = socket_path + ".lock";
  // A few rounds: each one lost means a holder removed the file between our open and our lock.
  for (int round = 0; round < 8; ++round) {
    // O_NONBLOCK: a FIFO planted there must not hang the open.
    const int fd = ::open(lock.lock_path_.c_str(),
                          O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": cannot open its lock file ",
                                                        EchoInput(lock.lock_path_), ": ",
                                                        std::strerror(errno)));
    }
    struct stat st = {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": its lock file ", EchoInput(lock.lock_path_), " is not a regular file"));
    }
    int locked;
    do {
      locked = ::flock(fd, LOCK_EX | LOCK_NB);
    } while (locked != 0 && errno == EINTR);
    if (locked != 0) {
      const int error = errno;
      ::close(fd);
      if (error == EWOULDBLOCK) {
        return absl::AlreadyExistsError(absl::StrCat(what, ": another server holds ", socket_path,
                                                     " (its lock file ", lock.lock_path_,
                                                     " is locked)"));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": cannot lock ", EchoInput(lock.lock_path_), ": ", std::strerror(error)));
    }
    // The holder before us removes the file before it lets go: a file locked after that is one
    // the path no longer names (a server that opens the path now creates a new one), so it
    // proves nothing. Locked and still named by the path: ours, until Release.
    struct stat there = {};
    if (::lstat(lock.lock_path_.c_str(), &there) == 0 && there.st_dev == st.st_dev &&
        there.st_ino == st.st_ino) {
      lock.fd_ = fd;
      return lock;
    }
    ::close(fd);
  }
  return absl::UnavailableError(absl::StrCat(what, ": its lock file ", EchoInput(lock.lock_path_),
                                             " kept being replaced; try again"));
}

int ProbeUnixSocket(const std::string& path, bool abstract, int type) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() + (abstract ? 1 : 0) > kMaxSocketPath) return ENAMETOOLONG;
  socklen_t len;
  if (abstract) {
    std::memcpy(addr.sun_path + 1, path.data(), path.size());
    len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  } else {
    std::memcpy(addr.sun_path, path.data(), path.size());
    len = sizeof(addr);
  }
  const int fd = ::socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  const int result = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 ? 0 : errno;
  ::close(fd);
  return result;
}

int BindAbstractErrno(const std::string& name) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (name.size() + 1 > kMaxSocketPath) return ENAMETOOLONG;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  const int result = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 ? 0 : errno;
  ::close(fd);
  return result;
}

absl::Status CheckSocketDirectory(const std::string& path, absl::string_view what) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == path.npos ? std::string(".") : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st = {};
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": directory ", EchoInput(dir), ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", EchoInput(dir), " is not a directory"));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(what, ": cannot create a socket in ",
                                                    EchoInput(dir), ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<SocketPathLock> ReserveListenAddress(const ListenAddress& address) {
  if (!address.is_unix()) return SocketPathLock();
  const std::string what = absl::StrCat("listen: ", EchoInput(address.address));
  if (address.kind == ListenAddress::Kind::kUnixAbstract) {
    if (ProbeUnixSocket(address.path, /*abstract=*/true, SOCK_STREAM) == 0) {
      return absl::AlreadyExistsError(absl::StrCat(what, ": another process is serving on it"));
    }
    return SocketPathLock();
  }
  const std::string& path = address.path;
  if (absl::Status s = CheckSocketDirectory(path, what); !s.ok()) return s;
  // Before the probe: a server starting on the path at the same instant waits for nobody's
  // probe, it is refused here.
  absl::StatusOr<SocketPathLock> lock = SocketPathLock::Acquire(path, what);
  if (!lock.ok()) return lock.status();
  struct stat st = {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::AlreadyExistsError(absl::StrCat(what, ": the path exists and is not a socket"));
    }
    const int probe = ProbeUnixSocket(path, /*abstract=*/false, SOCK_STREAM);
    if (probe == 0) {
      return absl::AlreadyExistsError(absl::StrCat(what, ": another process is serving on it"));
    }
    if (probe != ECONNREFUSED) {
      // Neither live nor plainly stale (e.g. EACCES): replacing it could take a live
      // server's path, so leave the decision to whoever owns it.
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": cannot tell whether the socket there is in use: ", std::strerror(probe)));
    }
  }
  return lock;
}

std::string ConnectAddress(const ListenAddress& address, int port) {
  if (address.is_unix()) return address.address;
  const std::string& listen = address.address;
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "localhost") {
    host = "127.0.0.1";
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace decode_indexer::service
