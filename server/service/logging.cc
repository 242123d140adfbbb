#include "server/service/logging.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <random>
#include <utility>

#include "spdlog/details/log_msg.h"
#include "spdlog/formatter.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::service {
namespace {

thread_local std::string t_request_id;

// {"time":"2026-12-01T19:42:06.123456Z","level":"info","message":"...","pid":1,"thread":2,
//  "request_id":"..."}: one object a line, for log shippers that parse JSON.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
    const auto micros =
        std::chrono::duration_cast<std::chrono::microseconds>(since_epoch - secs).count();
    const std::time_t t = static_cast<std::time_t>(secs.count());
    std::tm tm = {};
    gmtime_r(&t, &tm);
    char stamp[64];
    std::snprintf(stamp, sizeof(stamp), "%04d-%02d-%02dT%02d:%02d:%02d.%06lldZ", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                  static_cast<long long>(micros));
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    std::string line = "{\"time\":\"";
    line += stamp;
    line += "\",\"level\":\"";
    line.append(level.data(), level.size());
    line += "\",\"message\":";
    line += JsonQuote(std::string(msg.payload.data(), msg.payload.size()));
    line += ",\"pid\":" + std::to_string(static_cast<long long>(getpid()));
    line += ",\"thread\":" + std::to_string(static_cast<unsigned long long>(msg.thread_id));
    if (!t_request_id.empty()) line += ",\"request_id\":" + JsonQuote(t_request_id);
    line += "}\n";
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

std::string JsonQuote(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += "\"";
  return out;
}

std::unique_ptr<spdlog::formatter> MakeJsonFormatter() { return std::make_unique<JsonFormatter>(); }

void ConfigureLogging(const std::string& format, const std::string& level) {
  if (format == "json") spdlog::set_formatter(MakeJsonFormatter());
  spdlog::set_level(spdlog::level::from_str(level));
}

std::string NewRequestId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

ScopedRequestId::ScopedRequestId(std::string id) : previous_(std::move(t_request_id)) {
  t_request_id = std::move(id);
}

ScopedRequestId::~ScopedRequestId() { t_request_id = std::move(previous_); }

const std::string& CurrentRequestId() { return t_request_id; }

}  // namespace decode_indexer::service
