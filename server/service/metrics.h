// Prometheus metrics for decode-indexer on maintained libraries: prometheus-cpp (metric types,
// registry, text serializer) and civetweb (the HTTP server prometheus-cpp's own exposer uses;
// called directly here so that /metrics can demand a bearer token). Both are Debian 12
// packages (prometheus-cpp-dev, libcivetweb-dev).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/metric_family.h"

struct mg_context;
struct mg_connection;

namespace decode_indexer::service {

// Histogram bounds in seconds: a 1-2-5 series from 10 µs to 100 s, made from decimal text so
// that the bucket labels print as le="2e-05", never le="2.0000000000000002e-05".
std::vector<double> LatencyBuckets();
// Rows per step: 1, 2, 4, .. 4096.
std::vector<double> RowBuckets();

// The standard process_* metrics (prometheus-cpp has no process collector), from
// /proc/self: process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_max_fds,
// process_start_time_seconds. Linux only; a file that cannot be read leaves its metric out.
std::vector<prometheus::MetricFamily> ProcessMetrics();

// One family of one sample (gauge or counter), for collectors that read their values at
// scrape time.
prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help,
                                     double value);
prometheus::MetricFamily CounterFamily(const std::string& name, const std::string& help,
                                       double value);

// The text exposition format 0.0.4 of `families`.
std::string SerializeMetrics(const std::vector<prometheus::MetricFamily>& families);

struct MetricsHttpOptions {
  // "host:port", port 0 picks one; "[::]:port" for IPv6.
  std::string listen;
  // Non-empty: every request must carry "Authorization: Bearer <token>" (401 otherwise).
  std::string bearer_token;
  // Worker threads: an idle or slow connection holds one until request_timeout_ms, so several
  // idle clients cannot starve a scrape.
  int threads = 8;
  int request_timeout_ms = 10000;
};

// Serves GET (and HEAD) /metrics with render(); 404 for other paths, 405 for other methods.
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options, std::function<std::string()> render);
  ~MetricsHttpServer();  // stops civetweb's threads and closes the socket

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  static int HandleMetrics(mg_connection* conn, void* self);
  static int HandleOther(mg_connection* conn, void* self);

  std::function<std::string()> render_;
  std::string bearer_token_;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace decode_indexer::service
