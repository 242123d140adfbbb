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

namespace decode_indexer::service {

struct ListenAddress {
  enum class Kind { kTcp, kUnixPath, kUnixAbstract };
  Kind kind = Kind::kTcp;
  // As given: what gRPC binds, and (for a socket) what a client dials.
  std::string address;
  // kUnixPath: the socket's file path; kUnixAbstract: the name (without the leading NUL).
  std::string path;

  bool is_unix() const { return kind != Kind::kTcp; }
};

// The address's form, without touching the system: "host:port" (any host gRPC resolves, the
// port a number in 0..65535) or one of the socket forms above. INVALID_ARGUMENT names what is
// wrong.
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address);

// Each of a server's addresses parsed as above, in order, with the same socket (one path,
// however spelled, or one abstract name) or the same host:port (port 0 aside: each picks its
// own) refused when given twice: gRPC would bind the second over the first, and for a path it
// unlinks the first's socket file first, leaving that listener unreachable. INVALID_ARGUMENT
// names the address.
absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(
    const std::vector<std::string>& addresses);

// Whether a socket address can be bound, before gRPC tries: gRPC reports only "No address
// added", and it removes whatever socket file is at the path before it binds, so a second
// server started on a live server's path would silently take the path over (the first
// keeps running, unreachable). So: the directory must exist and be writable, the path must
// fit a sockaddr_un, an existing file must be a socket, and no process may be accepting on
// it (a stale socket left by a killed server is fine: gRPC replaces it). OK for TCP.
absl::Status CheckCanListen(const ListenAddress& address);

// What a connect of `type` (the listener's: SOCK_STREAM, SOCK_SEQPACKET) to the Unix socket at
// `path` (`abstract`: the abstract name, without its leading NUL) answers, for a caller that
// replaces a socket file only when nobody serves on it: 0 when a process accepts on it,
// ECONNREFUSED when none does (a stale file left by a killed process), otherwise the errno that
// leaves it open (EAGAIN: a live listener whose backlog is full; EPROTOTYPE: a live listener
// of another type; EACCES). The connect does not block: a blocking one to a live listener
// whose backlog is full waits until it accepts, which would hang the caller's start.
int ProbeUnixSocket(const std::string& path, bool abstract, int type);

// What a client on this host dials to reach `address` once bound on `port` (gRPC's selected
// port; unused for a socket): a wildcard or loopback host becomes 127.0.0.1, a socket
// address is dialled as given.
std::string ConnectAddress(const ListenAddress& address, int port);

}  // namespace decode_indexer::service
