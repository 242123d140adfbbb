// decode-indexer-server: flags -> Profile + ExecutorOptions -> Server. SIGTERM/SIGINT drain
// and exit 0. The signal handler only writes a byte to a pipe; a thread reads it and runs
// the (non-async-signal-safe) shutdown.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/cli.h"
#include "common/malloc_tuning.h"
#include "server/config/profile.h"
#include "server/service/listen_address.h"
#include "server/service/logging.h"
#include "server/service/server.h"
#include "spdlog/spdlog.h"

namespace {

int g_signal_pipe[2] = {-1, -1};

extern "C" void OnSignal(int signo) {
  const int saved = errno;
  const char byte = static_cast<char>(signo);
  // Nothing else is async-signal-safe enough to do here.
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

}  // namespace

int main(int argc, char** argv) {
  namespace service = decode_indexer::service;
  std::string profile_name = "v32";
  std::string log_level = "info";
  std::string log_format = "text";
  int drain_seconds = 10;
  double drain_grace_seconds = 0;
  service::ServerOptions options;
  CLI::App app{"decode-indexer-server: the sparse-attention lightning indexer over gRPC"};
  app.add_option("--listen", options.listen,
                 "address to serve on, repeatable: host:port (port 0: pick one), or for "
                 "clients on this host a Unix socket, unix:PATH or unix-abstract:NAME")
      ->check([](const std::string& address) {
        absl::StatusOr<service::ListenAddress> parsed = service::ParseListenAddress(address);
        // CLI11 names the flag already.
        return parsed.ok() ? std::string()
                           : std::string(absl::StripPrefix(parsed.status().message(), "listen: "));
      })
      ->capture_default_str();
  app.add_option("--backend", options.executor.backend, "compute backend")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--ranks", options.executor.ranks, "ranks (0: every GPU for cuda, 1 for cpu)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--profile", profile_name, "built-in profile (v32, v41) or a profile file")
      ->capture_default_str();
  app.add_option("--cache-pages", options.executor.cache_pages,
                 "pages in EACH cache pool (one pool per cache-owning layer and rank: memory is "
                 "pools x pages x page bytes, e.g. v32: 61 x 4096 x 8448 B = 2.1 GB)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--row-shard-min-requests", options.executor.row_shard_min_requests,
                 "fewest requests in a step for row sharding")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-sequences", options.executor.max_sequences, "live sequences at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--cpu-threads", options.executor.cpu_threads,
                 "CPU backend threads per rank (0: hardware threads / ranks)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--collective-timeout", options.executor.collective_timeout_ms,
                 "ms a rank waits for the others at a collective before the executor turns "
                 "unhealthy")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--logits-precision", options.executor.logits_precision,
                 "default|exact|fp8: dense FP8 logits on the GPU summed exactly in fp32, or on "
                 "the fp8 tensor cores (faster, within spec section 6's fp8 bound); default: "
                 "the CUDA backend's choice")
      ->check(CLI::IsMember({"default", "exact", "fp8"}))
      ->capture_default_str();
  app.add_option("--cuda-graphs", options.executor.cuda_graphs,
                 "on|off: replay a step's kernels from a captured CUDA graph once its shape "
                 "was seen (CUDA backend)")
      ->capture_default_str();
  app.add_option("--max-step-graphs", options.executor.max_step_graphs,
                 "step shapes a rank keeps CUDA graphs for; a new shape past it evicts the "
                 "least recently seen one (decode_indexer_step_graphs_total{event=\"evicted\"})")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--pinned-staging", options.executor.pinned_staging,
                 "on|off: stage each step's uploads in page-locked host memory (CUDA backend)")
      ->capture_default_str();
  app.add_option("--packed-uploads", options.executor.packed_uploads,
                 "on|off: upload a step's small arrays (row tables, page-table edits, keys, "
                 "...) in one copy into each rank's device staging ring (off: one copy each)")
      ->capture_default_str();
  app.add_option("--direct-answers", options.executor.direct_answers,
                 "on|off: in a row-sharded step, each rank copies its own answer rows to the "
                 "host instead of all-gathering them first (a source layer's candidate blocks "
                 "and CUDA IPC answers are still all-gathered)")
      ->capture_default_str();
  app.add_option("--max-message-bytes", options.max_message_bytes,
                 "gRPC message size limit (0: sized from the profile's largest legal step, at "
                 "least 64 MiB)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-sequences-per-step", options.max_sequences_per_step,
                 "sequences one DecodeStep may carry (bounds the largest legal request)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  int64_t malloc_keep_mb = 64;
  app.add_option("--malloc-keep-mb", malloc_keep_mb,
                 "freed heap memory the allocator keeps for reuse instead of returning it to "
                 "the kernel, so each call's gRPC messages reuse warm pages (glibc mallopt; "
                 "0: glibc's defaults)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  options.max_concurrent_streams = 64;
  options.max_threads = 512;
  app.add_option("--max-concurrent-streams", options.max_concurrent_streams,
                 "HTTP/2 streams (calls) one connection may have open at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-threads", options.max_threads,
                 "threads gRPC's sync handlers may use in all (calls beyond wait for one): every "
                 "call on --grpc-edge sync, reflection on either edge")
      ->check(CLI::Range(8, 1 << 20))
      ->capture_default_str();
  std::string grpc_edge = "callback";
  app.add_option("--grpc-edge", grpc_edge,
                 "callback: one reactor per call, the token checked before a request is read "
                 "(plaintext too), open streams cost no thread, the methods run on "
                 "--edge-workers threads; sync: gRPC's sync service, a thread per running call "
                 "(up to --max-threads), on plaintext the token checked after the request was "
                 "read and parsed")
      ->check(CLI::IsMember({"callback", "sync"}))
      ->capture_default_str();
  app.add_option("--edge-workers", options.edge_workers,
                 "threads that run the methods on --grpc-edge callback (0: hardware threads, "
                 "at least 4)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  app.add_option("--shm-socket", options.shm_socket,
                 "Unix socket on which clients of this host register sealed memfds as "
                 "shared-memory regions (empty: no shared memory)");
  std::string socket_mode;
  app.add_option("--socket-mode", socket_mode,
                 "octal file mode (at most 0777, e.g. 0660) given to every socket file the "
                 "server creates (--listen unix:PATH, --shm-socket) right after its bind "
                 "(default: as created: 0777 less the umask for --listen, 0600 for --shm-socket)")
      ->check([&options](const std::string& text) {
        absl::StatusOr<int> mode = service::ParseSocketMode(text);
        if (mode.ok()) options.socket_mode = *mode;
        // CLI11 names the flag already.
        return mode.ok() ? std::string()
                         : std::string(absl::StripPrefix(mode.status().message(), "socket-mode: "));
      });
  std::string reflection = "auto";
  app.add_option("--reflection", reflection,
                 "serve grpc.reflection: on, off, or auto (on unless a token is set)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--drain-timeout,--drain-seconds", drain_seconds,
                 "seconds in-flight calls get on SIGTERM/SIGINT before they are cancelled")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--drain-grace", drain_grace_seconds,
                 "seconds health already answers NOT_SERVING on SIGTERM/SIGINT while calls are "
                 "still accepted, so balancers stop routing here first; then the drain above")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  // The flag wins over the environment (the container image sets DI_METRICS_LISTEN).
  app.add_option("--metrics-listen", options.metrics_listen,
                 "host:port for Prometheus GET /metrics (empty: off)")
      ->envname("DI_METRICS_LISTEN");
  app.add_flag("--metrics-auth", options.metrics_auth,
               "GET /metrics also demands \"Authorization: Bearer <token>\" with the server's "
               "bearer token (--auth-token / DI_AUTH_TOKEN)");
  app.add_option("--auth-token", options.auth_token,
                 "deprecated (the token shows in ps): use --auth-token-file or DI_AUTH_TOKEN");
  std::string auth_token_file;
  app.add_option("--auth-token-file", auth_token_file,
                 "file holding the bearer token every call must carry (default: env "
                 "DI_AUTH_TOKEN; neither: no token)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-cert", options.tls_cert, "PEM server certificate (enables TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", options.tls_key, "PEM server private key")->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", options.tls_client_ca,
                 "PEM CA that client certificates must chain to (enables mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--keepalive-time-ms", options.keepalive_time_ms,
                 "ping idle connections this often (0: gRPC default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--keepalive-timeout-ms", options.keepalive_timeout_ms,
                 "drop a connection whose ping is not acked within this (0: gRPC default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--keepalive-min-ping-ms", options.keepalive_min_ping_ms,
                 "shortest client ping interval accepted, also without calls (0: gRPC default)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--log-format", log_format,
                 "text, or json: one JSON object a line (time, level, message, request_id)")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  app.add_option("--snapshot-dir", options.snapshot_dir,
                 "on SIGTERM, after the drain, write every sequence here; on start, restore "
                 "them before health reports SERVING (exit 3 if the snapshot is refused)");
  double idle_seconds = 0;
  app.add_option("--idle-sequence-timeout", idle_seconds,
                 "seconds after which a sequence no call has named is released (0: never)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, critical, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  // Each --listen value is checked alone above; one address given twice (or two that overlap)
  // is a usage error too (exit 2, before anything starts), caught once all are parsed, and so
  // is a --shm-socket that is one of their socket paths.
  app.callback([&options] {
    absl::StatusOr<std::vector<service::ListenAddress>> parsed =
        service::ParseListenAddresses(options.listen);
    if (!parsed.ok()) {
      throw CLI::ValidationError(
          "--listen", std::string(absl::StripPrefix(parsed.status().message(), "listen: ")));
    }
    if (absl::Status s = service::CheckShmSocketIsNotListened(options.shm_socket, *parsed);
        !s.ok()) {
      throw CLI::ValidationError("--shm-socket",
                                 std::string(absl::StripPrefix(s.message(), "shm-socket: ")));
    }
  });
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  service::ConfigureLogging(log_format, log_level);
  options.drain_grace = std::chrono::milliseconds(static_cast<int64_t>(drain_grace_seconds * 1e3));
  if (!options.auth_token.empty()) {
    spdlog::warn(
        "--auth-token shows the token to anyone who can list processes; use "
        "--auth-token-file or DI_AUTH_TOKEN");
  }
  if (!auth_token_file.empty()) {
    if (!options.auth_token.empty()) {
      spdlog::critical("--auth-token and --auth-token-file: give one");
      return 2;
    }
    std::ifstream in(auth_token_file, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    options.auth_token = text.str();
    // A trailing newline (echo token > file) is not part of the token.
    while (!options.auth_token.empty() &&
           (options.auth_token.back() == '\n' || options.auth_token.back() == '\r')) {
      options.auth_token.pop_back();
    }
    if (!in || options.auth_token.empty()) {
      spdlog::critical("--auth-token-file {}: unreadable or empty", auth_token_file);
      return 2;
    }
  }
  options.executor.idle_sequence_timeout_ms = static_cast<int64_t>(idle_seconds * 1000.0 + 0.5);
  if (options.auth_token.empty()) {
    // From the environment so the token stays out of `ps`.
    if (const char* env = std::getenv("DI_AUTH_TOKEN")) options.auth_token = env;
  }
  options.grpc_edge = grpc_edge == "sync" ? service::ServerOptions::GrpcEdge::kSync
                                          : service::ServerOptions::GrpcEdge::kCallback;
  options.reflection = reflection == "on" || (reflection == "auto" && options.auth_token.empty());

  absl::StatusOr<decode_indexer::config::Profile> profile =
      decode_indexer::config::LoadProfile(profile_name);
  if (!profile.ok()) {
    spdlog::critical("--profile {}: {}", profile_name, profile.status().ToString());
    return 2;
  }
  options.profile = *profile;
  if (malloc_keep_mb > 0) {
    if (decode_indexer::KeepFreedMemory(malloc_keep_mb)) {
      spdlog::info("allocator: keeping up to {} MB of freed heap for reuse", malloc_keep_mb);
    } else {
      spdlog::warn("allocator: --malloc-keep-mb not applied (not glibc's malloc)");
    }
  }

  // The pipe exists before any handler can fire; the write end never blocks the handler.
  if (pipe(g_signal_pipe) != 0 || fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK) != 0) {
    spdlog::critical("signal pipe: {}", std::strerror(errno));
    return 1;
  }
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  if (!server.ok()) {
    spdlog::critical("cannot start: {}", server.status().ToString());
    // A refused snapshot has its own exit code: the operator must look at the file.
    return absl::StrContains(server.status().message(), "snapshot ") &&
                   absl::StrContains(server.status().message(), " refused: ")
               ? 3
               : 1;
  }
  const decode_indexer::exec::ExecutorStatus st = (*server)->executor().Status();
  int64_t pages = 0;
  for (const auto& c : st.caches) pages += c.pages_total;
  // Each address as given, a TCP one with the port it got (port 0 picks one).
  std::string listening;
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& dial = (*server)->addresses()[i];
    absl::StrAppend(&listening, i == 0 ? "" : ", ", options.listen[i]);
    if (dial != options.listen[i]) {
      absl::StrAppend(&listening, " (port ", dial.substr(dial.rfind(':') + 1), ")");
    }
  }
  spdlog::info(
      "{} started: profile {} ({} layers, {} cache pools), backend {} ({}), "
      "{} rank(s), {} pages ({} per pool), listening on {}",
      decode_indexer::cli::VersionLine(), profile->name, profile->layers.size(), st.caches.size(),
      st.backend, st.backend_desc, st.num_ranks, pages, options.executor.cache_pages, listening);
  if ((*server)->metrics_port() != 0) {
    spdlog::info("metrics on {} (port {})", options.metrics_listen, (*server)->metrics_port());
  }

  std::atomic<bool> stopping{false};
  std::thread waiter([&] {
    char byte = 0;
    ssize_t n;
    do {
      n = read(g_signal_pipe[0], &byte, 1);
    } while (n < 0 && errno == EINTR);
    if (n == 1 && byte != 0) {
      spdlog::info(
          "signal {}: draining ({} s NOT_SERVING while accepting, then up to {} s for "
          "in-flight calls)",
          static_cast<int>(byte), drain_grace_seconds, drain_seconds);
    }
    stopping = true;
    (*server)->Shutdown(std::chrono::seconds(drain_seconds));
  });
  (*server)->Wait();
  if (!stopping) {
    // The server stopped on its own; wake the waiter so it can be joined.
    const char zero = 0;
    [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &zero, 1);
  }
  waiter.join();
  (*server)->Shutdown();  // idempotent: makes sure the executor is down
  if (!(*server)->snapshot_status().ok()) {
    spdlog::critical("decode-indexer-server stopped, but its snapshot was not written");
    return 4;
  }
  spdlog::info("decode-indexer-server stopped");
  return 0;
}
