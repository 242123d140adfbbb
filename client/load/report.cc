#include "client/load/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace decode_indexer::load {
namespace {

// Nearest-rank percentile of sorted values.
double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p / 100.0 * static_cast<double>(sorted.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, double(sorted.size()))) - 1;
  return sorted[index];
}

nlohmann::json LatencyJson(const LatencySummary& s) {
  return {{"count", s.count}, {"mean", s.mean}, {"p50", s.p50},    {"p90", s.p90},
          {"p95", s.p95},     {"p99", s.p99},   {"p99.9", s.p999}, {"max", s.max}};
}

std::string LatencyLine(const std::string& name, const LatencySummary& s) {
  return absl::StrFormat(
      "  %-16s n=%-8d mean %8.3f  p50 %8.3f  p90 %8.3f  p95 %8.3f  p99 %8.3f  p99.9 %8.3f  "
      "max %8.3f ms\n",
      name, s.count, s.mean, s.p50, s.p90, s.p95, s.p99, s.p999, s.max);
}

double PerSecond(double count, double seconds) { return seconds > 0 ? count / seconds : 0; }

}  // namespace

void Samples::Merge(const Samples& other) {
  step_us.insert(step_us.end(), other.step_us.begin(), other.step_us.end());
  for (const auto& [role, values] : other.rpc_us) {
    auto& mine = rpc_us[role];
    mine.insert(mine.end(), values.begin(), values.end());
  }
  steps_failed += other.steps_failed;
  rpcs_failed += other.rpcs_failed;
  for (const auto& [code, n] : other.errors) errors[code] += n;
  rows += other.rows;
  request_bytes += other.request_bytes;
  response_bytes += other.response_bytes;
  server_queue_us += other.server_queue_us;
  server_compute_us += other.server_compute_us;
  client_rpc_us += other.client_rpc_us;
  timed_rpcs += other.timed_rpcs;
  sharded_rpcs += other.sharded_rpcs;
  late_starts += other.late_starts;
  backoff_waits += other.backoff_waits;
  backoff_ms += other.backoff_ms;
  drafts += other.drafts;
  drafts_rejected += other.drafts_rejected;
  max_start_lag_us = std::max(max_start_lag_us, other.max_start_lag_us);
}

std::vector<double> HistogramBoundsMs() {
  std::vector<double> b;
  for (int exp = -2; exp <= 4; ++exp) {
    for (int m : {1, 2, 5}) b.push_back(std::stod(absl::StrCat(m, "e", exp)));
  }
  b.push_back(1e5);
  return b;
}

nlohmann::json HistogramJson(const std::vector<double>& us) {
  const std::vector<double> bounds = HistogramBoundsMs();
  std::vector<uint64_t> counts(bounds.size() + 1, 0);
  for (double v : us) {
    const double ms = v / 1e3;
    const size_t b = std::lower_bound(bounds.begin(), bounds.end(), ms) - bounds.begin();
    ++counts[b];
  }
  return {{"bounds_ms", bounds}, {"counts", counts}};
}

std::string IsoTimeUtc(double unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(std::floor(unix_seconds));
  const int millis = static_cast<int>((unix_seconds - std::floor(unix_seconds)) * 1e3);
  std::tm tm = {};
  gmtime_r(&t, &tm);
  return absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                         tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, millis);
}

LatencySummary Summarize(std::vector<double> us) {
  LatencySummary s;
  s.count = us.size();
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  double total = 0;
  for (double v : us) total += v;
  s.mean = total / us.size() / 1e3;
  s.p50 = Percentile(us, 50) / 1e3;
  s.p90 = Percentile(us, 90) / 1e3;
  s.p95 = Percentile(us, 95) / 1e3;
  s.p99 = Percentile(us, 99) / 1e3;
  s.p999 = Percentile(us, 99.9) / 1e3;
  s.max = us.back() / 1e3;
  return s;
}

nlohmann::json Report::ToJson() const {
  const Samples& s = samples;
  nlohmann::json j;
  j["config"] = config;
  j["server"] = server;
  j["started_at"] = started_at;
  j["finished_at"] = finished_at;
  j["started_unix_s"] = started_unix_s;
  j["measured_s"] = measured_s;
  const uint64_t steps_ok = s.step_us.size();
  j["steps"] = {{"count", steps_ok + s.steps_failed},
                {"ok", steps_ok},
                {"failed", s.steps_failed},
                {"rate_per_s", PerSecond(double(steps_ok), measured_s)},
                {"latency_ms", LatencyJson(Summarize(s.step_us))},
                {"histogram", HistogramJson(s.step_us)}};
  std::vector<double> all_rpcs;
  nlohmann::json by_role = nlohmann::json::object();
  for (const auto& [role, values] : s.rpc_us) {
    all_rpcs.insert(all_rpcs.end(), values.begin(), values.end());
    by_role[role] = LatencyJson(Summarize(values));
  }
  j["rpcs"] = {{"count", all_rpcs.size() + s.rpcs_failed},
               {"ok", all_rpcs.size()},
               {"failed", s.rpcs_failed},
               {"rate_per_s", PerSecond(double(all_rpcs.size()), measured_s)},
               {"sharded", s.sharded_rpcs},
               {"latency_ms", LatencyJson(Summarize(all_rpcs))},
               {"histogram", HistogramJson(all_rpcs)},
               {"by_role", by_role}};
  j["backoff"] = {{"waits", s.backoff_waits}, {"total_ms", s.backoff_ms}};
  j["errors"] = s.errors;
  if (!first_error.empty()) j["first_error"] = first_error;
  const double n = s.timed_rpcs > 0 ? double(s.timed_rpcs) : 1.0;
  const double client = s.client_rpc_us / n;
  const double queue = s.server_queue_us / n;
  const double compute = s.server_compute_us / n;
  j["split_us_per_rpc"] = {{"client", client},
                           {"server_queue", queue},
                           {"server_compute", compute},
                           {"outside_server", client - queue - compute}};
  j["throughput"] = {{"rows_per_s", PerSecond(double(s.rows), measured_s)},
                     {"request_bytes_per_s", PerSecond(double(s.request_bytes), measured_s)},
                     {"response_bytes_per_s", PerSecond(double(s.response_bytes), measured_s)},
                     {"request_bytes", s.request_bytes},
                     {"response_bytes", s.response_bytes}};
  if (config.value("draft_reject", 0.0) > 0) {
    j["speculative"] = {{"drafts", s.drafts}, {"drafts_rejected", s.drafts_rejected}};
  }
  if (config.value("rate", 0.0) > 0) {
    j["open_loop"] = {{"late_starts", s.late_starts},
                      {"max_start_lag_ms", s.max_start_lag_us / 1e3}};
  }
  j["verify"] = {{"enabled", verify.enabled},
                 {"rows_checked", verify.rows_checked},
                 {"rows_mismatched", verify.rows_mismatched},
                 {"rows_near_tie", verify.rows_near_tie},
                 {"candidate_rows_checked", verify.candidate_rows_checked},
                 {"candidate_rows_mismatched", verify.candidate_rows_mismatched},
                 {"candidate_rows_near_tie", verify.candidate_rows_near_tie},
                 {"groups_abandoned", verify.groups_abandoned},
                 {"first_mismatches", verify.first_mismatches}};
  j["server_statistics"] = server_statistics;
  return j;
}

std::string Report::ToText() const {
  const nlohmann::json j = ToJson();
  std::ostringstream out;
  out << absl::StrFormat("decode-indexer-load: %s, profile %s, backend %s, %d rank(s)\n",
                         config.value("target", ""), server.value("profile", ""),
                         server.value("backend", ""), server.value("num_ranks", 0));
  out << absl::StrFormat(
      "  %s loop, %d concurrent x %d requests x next_n %d, context ~%d, %d layers, %s%s, %s\n",
      config.value("rate", 0.0) > 0 ? "open" : "closed", config.value("concurrency", 0),
      config.value("requests_per_step", 0), config.value("next_n", 0), config.value("context", 0),
      config.value("layers", 0), config.value("streaming", false) ? "streaming" : "unary",
      config.value("request_form", "sequences") == "columnar" ? " columnar" : "",
      config.value("shared_memory", false)
          ? "shared memory"
          : absl::StrCat(config.value("answer_encoding", "raw"), " answers"));
  out << absl::StrFormat(
      "measured %.3f s: %d steps (%d failed), %.2f steps/s, %d RPCs, %.1f "
      "RPC/s, %.1f rows/s\n",
      measured_s, j["steps"]["count"].get<uint64_t>(), j["steps"]["failed"].get<uint64_t>(),
      j["steps"]["rate_per_s"].get<double>(), j["rpcs"]["count"].get<uint64_t>(),
      j["rpcs"]["rate_per_s"].get<double>(), j["throughput"]["rows_per_s"].get<double>());
  out << "latency (ms):\n";
  out << LatencyLine("step", Summarize(samples.step_us));
  {
    // The step histogram's occupied buckets: "<=2ms 10, <=5ms 3, ...".
    const nlohmann::json h = j["steps"]["histogram"];
    std::vector<std::string> parts;
    for (size_t b = 0; b < h["counts"].size(); ++b) {
      const uint64_t n = h["counts"][b].get<uint64_t>();
      if (n == 0) continue;
      parts.push_back(b < h["bounds_ms"].size()
                          ? absl::StrCat("<=", h["bounds_ms"][b].get<double>(), "ms ", n)
                          : absl::StrCat(">", h["bounds_ms"].back().get<double>(), "ms ", n));
    }
    if (!parts.empty()) out << "  step histogram: " << absl::StrJoin(parts, ", ") << "\n";
  }
  std::vector<double> all;
  for (const auto& [role, values] : samples.rpc_us) {
    all.insert(all.end(), values.begin(), values.end());
  }
  out << LatencyLine("rpc", Summarize(all));
  for (const auto& [role, values] : samples.rpc_us) {
    out << LatencyLine("rpc " + role, Summarize(values));
  }
  const auto& split = j["split_us_per_rpc"];
  out << absl::StrFormat(
      "per RPC: client %.1f us = server queue %.1f + server compute %.1f + outside the server "
      "(transport, (de)serialization) %.1f us\n",
      split["client"].get<double>(), split["server_queue"].get<double>(),
      split["server_compute"].get<double>(), split["outside_server"].get<double>());
  if (server_statistics.is_object() && server_statistics.contains("rpcs")) {
    // The server's own view (warm-up included): its handler time per step RPC.
    const nlohmann::json& s = server_statistics;
    std::vector<std::string> parts;
    for (const char* method : {"DecodeStep", "DecodeStream"}) {
      if (!s["rpcs"].contains(method)) continue;
      const nlohmann::json& r = s["rpcs"][method];
      if (r.value("count", uint64_t{0}) == 0) continue;
      parts.push_back(absl::StrFormat("%s %d calls (%d errors), handler mean %.1f us", method,
                                      r.value("count", uint64_t{0}), r.value("errors", uint64_t{0}),
                                      r.value("latency_us_mean", 0.0)));
    }
    const double steps = double(s.value("steps", uint64_t{0}));
    out << absl::StrFormat(
        "server statistics over the run (warm-up included): %d steps, %d sharded, mean queue "
        "%.1f us, mean compute %.1f us%s%s\n",
        s.value("steps", uint64_t{0}), s.value("steps_sharded", uint64_t{0}),
        steps > 0 ? s.value("queue_us_total", 0.0) / steps : 0.0,
        steps > 0 ? s.value("compute_us_total", 0.0) / steps : 0.0, parts.empty() ? "" : "; ",
        absl::StrJoin(parts, "; "));
  }
  out << absl::StrFormat("payload: %.1f MB/s sent, %.1f MB/s received\n",
                         j["throughput"]["request_bytes_per_s"].get<double>() / 1e6,
                         j["throughput"]["response_bytes_per_s"].get<double>() / 1e6);
  if (j.contains("speculative")) {
    out << absl::StrFormat("speculative: %d of %d drafts rejected and rolled back by position\n",
                           samples.drafts_rejected, samples.drafts);
  }
  if (j.contains("open_loop")) {
    out << absl::StrFormat("open loop: %d steps started late, max lag %.3f ms\n",
                           samples.late_starts, samples.max_start_lag_us / 1e3);
  }
  if (samples.backoff_waits > 0) {
    out << absl::StrFormat("backoff: %d waits after failed steps, %.1f ms in all\n",
                           samples.backoff_waits, samples.backoff_ms);
  }
  if (!first_error.empty()) out << "first error: " << first_error << "\n";
  if (samples.errors.empty()) {
    out << "errors: none\n";
  } else {
    std::vector<std::string> parts;
    for (const auto& [code, n] : samples.errors) parts.push_back(absl::StrCat(code, " ", n));
    out << "errors: " << absl::StrJoin(parts, ", ") << "\n";
  }
  if (verify.enabled) {
    out << absl::StrFormat(
        "verify: %d rows checked, %d mismatched, %d near-tie; %d candidate rows checked, %d "
        "mismatched, %d near-tie%s\n",
        verify.rows_checked, verify.rows_mismatched, verify.rows_near_tie,
        verify.candidate_rows_checked, verify.candidate_rows_mismatched,
        verify.candidate_rows_near_tie,
        verify.groups_abandoned
            ? absl::StrCat("; ", verify.groups_abandoned, " group(s) abandoned after a failed step")
            : "");
    for (const std::string& m : verify.first_mismatches) out << "  " << m << "\n";
  }
  return out.str();
}

std::string Report::ToCsv() const {
  const nlohmann::json j = ToJson();
  std::vector<std::pair<std::string, std::string>> cols;
  auto add = [&](const std::string& name, const nlohmann::json& v) {
    cols.emplace_back(name, v.is_string() ? v.get<std::string>() : v.dump());
  };
  add("started_at", started_at);
  for (const char* key :
       {"target", "concurrency", "rate", "requests_per_step", "next_n", "context", "layers",
        "streaming", "request_form", "answer_encoding", "shared_memory", "deadline_ms"}) {
    add(key, config.value(key, nlohmann::json()));
  }
  add("measured_s", measured_s);
  add("steps", j["steps"]["count"]);
  add("steps_failed", j["steps"]["failed"]);
  add("steps_per_s", j["steps"]["rate_per_s"]);
  for (const char* p : {"mean", "p50", "p90", "p95", "p99", "p99.9", "max"}) {
    add(absl::StrCat("step_", p, "_ms"), j["steps"]["latency_ms"][p]);
  }
  add("rpcs", j["rpcs"]["count"]);
  add("rpcs_per_s", j["rpcs"]["rate_per_s"]);
  for (const char* p : {"mean", "p50", "p90", "p95", "p99", "p99.9", "max"}) {
    add(absl::StrCat("rpc_", p, "_ms"), j["rpcs"]["latency_ms"][p]);
  }
  for (const char* k : {"client", "server_queue", "server_compute", "outside_server"}) {
    add(absl::StrCat(k, "_us"), j["split_us_per_rpc"][k]);
  }
  add("request_bytes_per_s", j["throughput"]["request_bytes_per_s"]);
  add("response_bytes_per_s", j["throughput"]["response_bytes_per_s"]);
  add("errors", samples.rpcs_failed);
  add("verify_rows_checked", verify.rows_checked);
  add("verify_rows_mismatched", verify.rows_mismatched);
  std::string header, values;
  for (size_t i = 0; i < cols.size(); ++i) {
    header += (i ? "," : "") + cols[i].first;
    values += (i ? "," : "") + cols[i].second;
  }
  return header + "\n" + values + "\n";
}

absl::Status WriteOutput(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return absl::OkStatus();
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  out << text;
  if (!out) return absl::UnavailableError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

absl::Status AppendCsv(const std::string& path, const std::string& csv) {
  if (path == "-") return WriteOutput(path, csv);
  const size_t newline = csv.find('\n');
  const std::string header = csv.substr(0, newline);
  std::string existing_header;
  {
    std::ifstream in(path);
    if (in) std::getline(in, existing_header);
  }
  std::ofstream out(path, std::ios::binary | std::ios::app);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  if (existing_header.empty()) {
    out << csv;
  } else if (existing_header == header) {
    out << csv.substr(newline + 1);
  } else {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " holds another report's columns; not appending (use a new --csv)"));
  }
  if (!out) return absl::UnavailableError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace decode_indexer::load
