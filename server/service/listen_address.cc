#include "server/service/listen_address.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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
  return out;
}

absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(
    const std::vector<std::string>& addresses) {
  std::vector<ListenAddress> out;
  // What makes two addresses one listener: the kind and the path made absolute and normal
  // ("unix:x.sock", "unix:./x.sock" and "unix:///cwd/x.sock" are one file; a symlinked
  // directory is not seen through, as that would touch the system), or the exact host:port.
  std::vector<std::string> keys;
  for (const std::string& address : addresses) {
    absl::StatusOr<ListenAddress> parsed = ParseListenAddress(address);
    if (!parsed.ok()) return parsed.status();
    std::string key;
    switch (parsed->kind) {
      case ListenAddress::Kind::kUnixPath: {
        std::error_code ec;
        std::filesystem::path path = std::filesystem::absolute(parsed->path, ec);
        key = absl::StrCat(
            "p", (ec ? std::filesystem::path(parsed->path) : path).lexically_normal().string());
        break;
      }
      case ListenAddress::Kind::kUnixAbstract:
        key = absl::StrCat("a", parsed->path);
        break;
      case ListenAddress::Kind::kTcp:
        if (!absl::EndsWith(address, ":0")) key = absl::StrCat("t", address);
        break;
    }
    for (size_t i = 0; i < keys.size() && !key.empty(); ++i) {
      if (keys[i] != key) continue;
      return Invalid(address, out[i].address == address
                                  ? "given twice"
                                  : absl::StrCat("the same address as ", EchoInput(out[i].address),
                                                 ", given twice"));
    }
    keys.push_back(std::move(key));
    out.push_back(*std::move(parsed));
  }
  return out;
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

absl::Status CheckCanListen(const ListenAddress& address) {
  if (!address.is_unix()) return absl::OkStatus();
  if (address.kind == ListenAddress::Kind::kUnixAbstract) {
    if (ProbeUnixSocket(address.path, /*abstract=*/true, SOCK_STREAM) == 0) {
      return absl::AlreadyExistsError(absl::StrCat("listen: ", EchoInput(address.address),
                                                   ": another process is serving on it"));
    }
    return absl::OkStatus();
  }
  const std::string& path = address.path;
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == path.npos ? std::string(".") : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st = {};
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("listen: ", EchoInput(address.address),
                                                   ": directory ", EchoInput(dir), ": ",
                                                   std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("listen: ", EchoInput(address.address), ": ",
                                                   EchoInput(dir), " is not a directory"));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("listen: ", EchoInput(address.address),
                                                    ": cannot create a socket in ", EchoInput(dir),
                                                    ": ", std::strerror(errno)));
  }
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::AlreadyExistsError(absl::StrCat("listen: ", EchoInput(address.address),
                                                   ": the path exists and is not a socket"));
    }
    const int probe = ProbeUnixSocket(path, /*abstract=*/false, SOCK_STREAM);
    if (probe == 0) {
      return absl::AlreadyExistsError(absl::StrCat("listen: ", EchoInput(address.address),
                                                   ": another process is serving on it"));
    }
    if (probe != ECONNREFUSED) {
      // Neither live nor plainly stale (e.g. EACCES): replacing it could take a live
      // server's path, so leave the decision to whoever owns it.
      return absl::FailedPreconditionError(absl::StrCat("listen: ", EchoInput(address.address),
                                                        ": cannot tell whether the "
                                                        "socket there is in use: ",
                                                        std::strerror(probe)));
    }
  }
  return absl::OkStatus();
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
