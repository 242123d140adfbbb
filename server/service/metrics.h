// Prometheus text exposition for decode-indexer: a fixed-bucket histogram and a tiny
// HTTP/1.0 server that answers GET /metrics (and nothing else) from one thread. Scrapes are
// rare and small, so one connection at a time is enough and keeps the server trivial.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace decode_indexer::service {

// A cumulative histogram with fixed upper bounds (Prometheus "le" buckets, +Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // Appends the _bucket/_sum/_count lines of `name` with `labels` ("k=\"v\"" or empty).
  void Render(const std::string& name, const std::string& labels, std::string& out) const;
  uint64_t count() const;

  // Seconds, 10 µs .. ~84 s in factors of 2.
  static std::vector<double> LatencyBounds();
  // Rows per step: 1, 2, 4, .. 4096.
  static std::vector<double> RowBounds();

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; last: above every bound
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Formats a value the way Prometheus text expects (integers without exponent).
std::string PromValue(double value);

class MetricsHttpServer {
 public:
  // Listens on "host:port" (port 0 picks one) and serves render() on GET /metrics.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render);
  ~MetricsHttpServer();  // stops the thread and closes the socket

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Loop();
  void Serve(int fd);

  std::function<std::string()> render_;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::thread thread_;
};

}  // namespace decode_indexer::service
