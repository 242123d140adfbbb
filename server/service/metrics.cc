#include "server/service/metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <sys/resource.h>
#include <unistd.h>

#include <civetweb.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/text_serializer.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::service {

std::vector<double> LatencyBuckets() {
  std::vector<double> b;
  for (int exp = -5; exp <= 1; ++exp) {
    for (int m : {1, 2, 5}) b.push_back(std::stod(absl::StrCat(m, "e", exp)));
  }
  b.push_back(100);
  return b;
}

std::vector<double> RowBuckets() {
  std::vector<double> b;
  for (int i = 0; i <= 12; ++i) b.push_back(double(1 << i));
  return b;
}

namespace {

prometheus::MetricFamily OneSample(const std::string& name, const std::string& help,
                                   prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

std::string ReadSmallFile(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help,
                                     double value) {
  return OneSample(name, help, prometheus::MetricType::Gauge, value);
}

prometheus::MetricFamily CounterFamily(const std::string& name, const std::string& help,
                                       double value) {
  return OneSample(name, help, prometheus::MetricType::Counter, value);
}

std::vector<prometheus::MetricFamily> ProcessMetrics() {
  std::vector<prometheus::MetricFamily> out;
  const double ticks = double(sysconf(_SC_CLK_TCK));
  const double page = double(sysconf(_SC_PAGESIZE));
  // /proc/self/stat: "pid (comm) state ..."; comm may hold spaces, so split after the last ')'.
  const std::string stat = ReadSmallFile("/proc/self/stat");
  const size_t paren = stat.rfind(')');
  if (paren != std::string::npos && ticks > 0) {
    std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ', absl::SkipEmpty());
    // f[0] is field 3 (state): field N is f[N - 3].
    double utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
    if (f.size() > 21 && absl::SimpleAtod(f[11], &utime) && absl::SimpleAtod(f[12], &stime) &&
        absl::SimpleAtod(f[19], &start) && absl::SimpleAtod(f[20], &vsize) &&
        absl::SimpleAtod(f[21], &rss)) {
      out.push_back(CounterFamily("process_cpu_seconds_total",
                                  "Total user and system CPU time spent in seconds.",
                                  (utime + stime) / ticks));
      out.push_back(GaugeFamily("process_resident_memory_bytes", "Resident memory size in bytes.",
                                rss * page));
      out.push_back(
          GaugeFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", vsize));
      // Start time: boot time (btime in /proc/stat) plus the start in ticks after boot.
      for (absl::string_view line : absl::StrSplit(ReadSmallFile("/proc/stat"), '\n')) {
        double btime = 0;
        if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtod(line, &btime)) {
          out.push_back(GaugeFamily("process_start_time_seconds",
                                    "Start time of the process since unix epoch in seconds.",
                                    btime + start / ticks));
        }
      }
    }
  }
  if (DIR* d = opendir("/proc/self/fd")) {
    int n = 0;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(d);
    out.push_back(GaugeFamily("process_open_fds", "Number of open file descriptors.", n - 1));
  }
  rlimit lim = {};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    out.push_back(GaugeFamily("process_max_fds", "Maximum number of open file descriptors.",
                              double(lim.rlim_cur)));
  }
  return out;
}

std::string SerializeMetrics(const std::vector<prometheus::MetricFamily>& families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

namespace {

// civetweb reports start-up errors (a port in use) through this callback on the thread that
// calls mg_start.
thread_local std::string t_start_error;

int LogMessage(const mg_connection*, const char* message) {
  t_start_error = message;
  return 1;  // handled: civetweb prints nothing itself
}

// "host:port" -> civetweb's listening_ports syntax ("127.0.0.1:9464", "[::]:9464", "9464").
absl::StatusOr<std::string> CivetPort(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics-listen: expected host:port, got \"", listen, "\""));
  }
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  int port_number = 0;
  if (!absl::SimpleAtoi(port, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics-listen: port must be 0..65535, got \"", port, "\""));
  }
  if (host.empty()) return port;
  if (host.front() == '[') return absl::StrCat(host, ":", port);
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return absl::StrCat(host, ":", port);
  // A host name: civetweb binds addresses only, so resolve it (first IPv4 address).
  addrinfo hints = {};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics-listen ", listen, ": cannot resolve ", host));
  }
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, text, sizeof(text));
  freeaddrinfo(res);
  return absl::StrCat(text, ":", port);
}

void Reply(mg_connection* conn, int code, const char* reason, const std::string& content_type,
           const std::string& body, bool head_only, const char* extra_header = "") {
  const std::string head = absl::StrCat(
      "HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
      "\r\nContent-Length: ", body.size(), "\r\n", extra_header, "Connection: close\r\n\r\n");
  mg_write(conn, head.data(), head.size());
  if (!head_only) mg_write(conn, body.data(), body.size());
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= unsigned(static_cast<unsigned char>(a[i] ^ b[i]));
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options, std::function<std::string()> render) {
  absl::StatusOr<std::string> ports = CivetPort(options.listen);
  if (!ports.ok()) return ports.status();
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->render_ = std::move(render);
  server->bearer_token_ = options.bearer_token;
  mg_init_library(0);
  const std::string threads = std::to_string(options.threads > 0 ? options.threads : 1);
  const std::string timeout = std::to_string(options.request_timeout_ms);
  const char* civet_options[] = {
      "listening_ports", ports->c_str(),      "num_threads", threads.c_str(), "request_timeout_ms",
      timeout.c_str(),   "enable_keep_alive", "no",          nullptr};
  mg_callbacks callbacks = {};
  callbacks.log_message = LogMessage;
  t_start_error.clear();
  server->ctx_ = mg_start(&callbacks, nullptr, civet_options);
  if (server->ctx_ == nullptr) {
    mg_exit_library();
    return absl::UnavailableError(
        absl::StrCat("metrics-listen ", options.listen, ": ",
                     t_start_error.empty() ? std::string("cannot listen") : t_start_error));
  }
  mg_set_request_handler(server->ctx_, "/metrics", &MetricsHttpServer::HandleMetrics, server.get());
  mg_set_request_handler(server->ctx_, "/", &MetricsHttpServer::HandleOther, server.get());
  mg_server_port bound[4] = {};
  const int n = mg_get_server_ports(server->ctx_, 4, bound);
  if (n > 0) server->port_ = bound[0].port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (ctx_ != nullptr) {
    mg_stop(ctx_);  // joins the worker threads: no handler runs after this
    mg_exit_library();
  }
}

int MetricsHttpServer::HandleMetrics(mg_connection* conn, void* cbdata) {
  const auto* self = static_cast<const MetricsHttpServer*>(cbdata);
  const mg_request_info* ri = mg_get_request_info(conn);
  const std::string method = ri != nullptr && ri->request_method ? ri->request_method : "";
  const bool head = method == "HEAD";
  if (ri == nullptr || ri->local_uri == nullptr || std::strcmp(ri->local_uri, "/metrics") != 0) {
    return HandleOther(conn, cbdata);
  }
  if (method != "GET" && !head) {
    Reply(conn, 405, "Method Not Allowed", "text/plain", "GET only\n", false,
          "Allow: GET, HEAD\r\n");
    return 405;
  }
  if (!self->bearer_token_.empty()) {
    const char* auth = mg_get_header(conn, "Authorization");
    if (auth == nullptr ||
        !ConstantTimeEquals(auth, absl::StrCat("Bearer ", self->bearer_token_))) {
      Reply(conn, 401, "Unauthorized", "text/plain",
            "missing or wrong bearer token (Authorization: Bearer <token>)\n", head,
            "WWW-Authenticate: Bearer\r\n");
      return 401;
    }
  }
  Reply(conn, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", self->render_(), head);
  return 200;
}

int MetricsHttpServer::HandleOther(mg_connection* conn, void*) {
  Reply(conn, 404, "Not Found", "text/plain", "only /metrics\n", false);
  return 404;
}

}  // namespace decode_indexer::service
