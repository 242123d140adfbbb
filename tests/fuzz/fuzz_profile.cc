// Profile loading (server/config/profile_loader.cc) on arbitrary documents: the first byte
// picks TOML, YAML or JSON, the rest is the document. Loading must never crash or hang, and
// a profile it accepts must pass ValidateProfile (it is what the server would serve).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "server/config/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const char* const kFormats[] = {"toml", "yaml", "json"};
  const char* format = kFormats[data[0] % 3];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  absl::StatusOr<decode_indexer::config::Profile> profile =
      decode_indexer::config::ParseProfileText(text, format);
  if (!profile.ok()) {
    if (profile.status().message().empty()) std::abort();
    return 0;
  }
  if (!decode_indexer::config::ValidateProfile(*profile).ok()) std::abort();
  return 0;
}
