// Measurements of a load run and the final report (text, JSON, CSV).
//
// Every worker thread records into its own Samples; they are merged once at the end, so the
// hot path takes no lock. Latencies are kept whole (not bucketed): a run of a few million
// RPCs is tens of MB, and exact percentiles are what a benchmark wants.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace decode_indexer::load {

struct Samples {
  // A step through every layer, microseconds (open loop: from the intended start time).
  std::vector<double> step_us;
  // Each DecodeStep RPC, from send to answer, by the layer's role.
  std::map<std::string, std::vector<double>> rpc_us;
  uint64_t steps_failed = 0;
  uint64_t rpcs_failed = 0;
  std::map<std::string, uint64_t> errors;  // status code name -> count
  uint64_t rows = 0;
  uint64_t request_bytes = 0;
  uint64_t response_bytes = 0;
  // Sums over measured, successful RPCs of the server's own ServerTiming.
  double server_queue_us = 0;
  double server_compute_us = 0;
  double client_rpc_us = 0;
  uint64_t timed_rpcs = 0;
  uint64_t sharded_rpcs = 0;
  // Open loop: how late steps started behind their intended time.
  uint64_t late_starts = 0;
  // --draft-reject: draft tokens judged, and of those rejected (rolled back by position).
  uint64_t drafts = 0;
  uint64_t drafts_rejected = 0;
  double max_start_lag_us = 0;
  // Waits after failed steps (exponential backoff with jitter) and their total.
  uint64_t backoff_waits = 0;
  double backoff_ms = 0;

  void Merge(const Samples& other);
};

struct LatencySummary {
  uint64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p95 = 0, p99 = 0, p999 = 0, max = 0;  // milliseconds
};
LatencySummary Summarize(std::vector<double> us);

// Latency histogram bounds in milliseconds: a 1-2-5 series from 0.01 ms to 100 s.
std::vector<double> HistogramBoundsMs();
// {"bounds_ms": [...], "counts": [...]}: counts[i] latencies in (bounds[i-1], bounds[i]] ms,
// the last count those above every bound (not cumulative).
nlohmann::json HistogramJson(const std::vector<double>& us);

struct VerifyCounts {
  bool enabled = false;
  uint64_t rows_checked = 0;
  uint64_t rows_mismatched = 0;
  uint64_t rows_near_tie = 0;  // differ from the reference within the tolerance
  uint64_t candidate_rows_checked = 0;
  uint64_t candidate_rows_mismatched = 0;
  uint64_t candidate_rows_near_tie = 0;
  uint64_t groups_abandoned = 0;  // a failed step left the server's state unknown
  std::vector<std::string> first_mismatches;
};

struct Report {
  nlohmann::json config;
  nlohmann::json server;
  double measured_s = 0;
  Samples samples;
  VerifyCounts verify;
  // GetStatistics deltas over the whole run (warm-up included), when available.
  nlohmann::json server_statistics;
  // The first failed RPC's status, "CODE: message" (empty when none failed).
  std::string first_error;
  // When the run started and ended (UTC, ISO 8601) and its start in Unix seconds.
  std::string started_at, finished_at;
  double started_unix_s = 0;

  nlohmann::json ToJson() const;
  std::string ToText() const;
  // One header line and one value line.
  std::string ToCsv() const;
};

// Writes `text` to path ("-": stdout).
absl::Status WriteOutput(const std::string& path, const std::string& text);
// Appends a CSV report (header line + value line) to path: a new or empty file gets both, a
// file with the same header gets the value line only (one row per run), a file with another
// header is refused (FAILED_PRECONDITION) rather than mixed. "-": stdout, both lines.
absl::Status AppendCsv(const std::string& path, const std::string& csv);

// "2026-12-01T19:42:06.123Z".
std::string IsoTimeUtc(double unix_seconds);

}  // namespace decode_indexer::load
