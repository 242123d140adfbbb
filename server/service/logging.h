// Server logging: spdlog as plain text (the default) or one JSON object a line, and the
// request id of the call a thread is handling (taken from the client's x-request-id metadata
// or generated), which JSON lines carry as "request_id" and the response echoes.
#pragma once

#include <memory>
#include <string>

#include "spdlog/formatter.h"

namespace decode_indexer::service {

// The --log-format json formatter (exposed for tests).
std::unique_ptr<spdlog::formatter> MakeJsonFormatter();

// format: "text" or "json"; level: spdlog's names (trace .. off). Applies to the default
// logger (stderr).
void ConfigureLogging(const std::string& format, const std::string& level);

// The metadata key of the request id, both ways.
inline constexpr const char* kRequestIdKey = "x-request-id";

// A fresh id: 16 random hex digits.
std::string NewRequestId();

// While alive, CurrentRequestId() on this thread answers `id`.
class ScopedRequestId {
 public:
  explicit ScopedRequestId(std::string id);
  ~ScopedRequestId();
  ScopedRequestId(const ScopedRequestId&) = delete;
  ScopedRequestId& operator=(const ScopedRequestId&) = delete;

 private:
  std::string previous_;
};

// "" outside a call.
const std::string& CurrentRequestId();

// `text` as a JSON string literal, quotes included (control characters escaped).
std::string JsonQuote(const std::string& text);

}  // namespace decode_indexer::service
