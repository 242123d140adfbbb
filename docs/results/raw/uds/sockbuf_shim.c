// LD_PRELOAD shim (experiment only): SO_SNDBUF / SO_RCVBUF of DI_SOCKBUF bytes on every
// AF_UNIX stream socket this process creates or accepts (gRPC's client sockets come from
// socket(), its server connections from accept4(); an accepted Unix socket does not inherit
// the listener's buffer sizes).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/socket.h>

static void tune(int fd) {
  const char* env = getenv("DI_SOCKBUF");
  if (fd < 0 || env == NULL) return;
  int domain = 0, type = 0;
  socklen_t len = sizeof(domain);
  if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 || domain != AF_UNIX) return;
  len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return;
  int n = atoi(env);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &n, sizeof(n)) == 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &n, sizeof(n));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &n, sizeof(n)) == 0 ||
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &n, sizeof(n));
}

int socket(int domain, int type, int protocol) {
  static int (*real)(int, int, int);
  if (!real) real = dlsym(RTLD_NEXT, "socket");
  int fd = real(domain, type, protocol);
  tune(fd);
  return fd;
}

int accept4(int fd, struct sockaddr* addr, socklen_t* len, int flags) {
  static int (*real)(int, struct sockaddr*, socklen_t*, int);
  if (!real) real = dlsym(RTLD_NEXT, "accept4");
  int c = real(fd, addr, len, flags);
  tune(c);
  return c;
}

int accept(int fd, struct sockaddr* addr, socklen_t* len) {
  static int (*real)(int, struct sockaddr*, socklen_t*);
  if (!real) real = dlsym(RTLD_NEXT, "accept");
  int c = real(fd, addr, len);
  tune(c);
  return c;
}
