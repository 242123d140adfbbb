// Experiment only: the kernel's part of a 64-row step's transport, without gRPC. A client
// sends REQ bytes, the server reads them all and answers RESP bytes; round trips timed over TCP
// loopback (TCP_NODELAY, as gRPC sets) and over a Unix stream socket, alternating blocks of
// calls. Usage: pingpong ITERS ROUNDS [SOCKBUF [REQ RESP]] (SOCKBUF 0: the kernel's default)
#define _GNU_SOURCE
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static size_t REQ = 541086, RESP = 524373;
static char* buf;
static int sockbuf;

static void xfer(int fd, size_t n, int out) {
  for (size_t done = 0; done < n;) {
    ssize_t k = out ? write(fd, buf + done, n - done) : read(fd, buf + done, n - done);
    if (k <= 0) { perror("xfer"); exit(1); }
    done += (size_t)k;
  }
}
static void tune(int fd) {
  if (sockbuf) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sockbuf, sizeof(sockbuf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &sockbuf, sizeof(sockbuf));
  }
}
static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}
// Forks a server on a fresh listener of `family`; answers the connected client fd.
static int pair(int family, pid_t* child) {
  int l = socket(family, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  struct sockaddr_un un = {.sun_family = AF_UNIX};
  snprintf(un.sun_path, sizeof(un.sun_path), "/tmp/pingpong-%d.sock", getpid());
  unlink(un.sun_path);
  struct sockaddr* a = family == AF_INET ? (struct sockaddr*)&in : (struct sockaddr*)&un;
  socklen_t len = family == AF_INET ? sizeof(in) : sizeof(un);
  if (bind(l, a, len) || listen(l, 1) || getsockname(l, a, &len)) { perror("listen"); exit(1); }
  if ((*child = fork()) == 0) {
    int c = accept(l, NULL, NULL);
    tune(c);
    if (family == AF_INET) setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    for (;;) { xfer(c, REQ, 0); xfer(c, RESP, 1); }
  }
  int c = socket(family, SOCK_STREAM, 0);
  tune(c);
  if (family == AF_INET) setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(c, a, len)) { perror("connect"); exit(1); }
  close(l);
  if (family == AF_UNIX) unlink(un.sun_path);
  return c;
}
int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 400, rounds = argc > 2 ? atoi(argv[2]) : 5;
  sockbuf = argc > 3 ? atoi(argv[3]) : 0;
  if (argc > 5) { REQ = strtoul(argv[4], NULL, 10); RESP = strtoul(argv[5], NULL, 10); }
  buf = calloc(1, REQ + RESP);
  pid_t kids[2];
  int fds[2] = {pair(AF_INET, &kids[0]), pair(AF_UNIX, &kids[1])};
  const char* names[2] = {"tcp", "unix"};
  double* us = calloc(iters, sizeof(double));
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 2; ++k) {
      int which = (r % 2) ? 1 - k : k;
      for (int i = 0; i < iters + 30; ++i) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        xfer(fds[which], REQ, 1);
        xfer(fds[which], RESP, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (i >= 30) us[i - 30] = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
      }
      qsort(us, iters, sizeof(double), cmp);
      printf("round=%d transport=%s raw pingpong p50 %.1f sockbuf %d bytes %zu/%zu\n", r + 1,
             names[which], us[iters / 2], sockbuf, REQ, RESP);
    }
  }
  kill(kids[0], SIGKILL);
  kill(kids[1], SIGKILL);
  while (wait(NULL) > 0) {}
  return 0;
}
