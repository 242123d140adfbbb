#include "server/service/gpu_utilization.h"

#include <dlfcn.h>

#include <cstdlib>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace decode_indexer::service {
namespace {

// The few NVML declarations this file needs (nvml.h's ABI: these have been stable since
// NVML's v2 entry points).
using NvmlReturn = int;  // NVML_SUCCESS == 0
struct NvmlUtilization {
  unsigned int gpu;
  unsigned int memory;
};
using InitFn = NvmlReturn (*)();
using ByIndexFn = NvmlReturn (*)(unsigned int, void**);
using ByUuidFn = NvmlReturn (*)(const char*, void**);
using UtilizationFn = NvmlReturn (*)(void*, NvmlUtilization*);
using ShutdownFn = NvmlReturn (*)();

}  // namespace

std::vector<std::string> NvmlDevicesForRanks(const std::optional<std::string>& visible, int ranks) {
  std::vector<std::string> out;
  std::vector<std::string> listed;
  if (visible.has_value() && !visible->empty()) {
    for (absl::string_view part : absl::StrSplit(*visible, ',', absl::SkipWhitespace())) {
      listed.emplace_back(absl::StripAsciiWhitespace(part));
    }
  }
  for (int r = 0; r < ranks; ++r) {
    if (!visible.has_value() || visible->empty()) {
      out.push_back(std::to_string(r));
    } else if (static_cast<size_t>(r) < listed.size()) {
      out.push_back(listed[r]);
    } else {
      out.emplace_back();  // the rank has no device in the list: nothing to report
    }
  }
  return out;
}

GpuUtilization::GpuUtilization(int ranks) {
  handle_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) return;
  auto init = reinterpret_cast<InitFn>(dlsym(handle_, "nvmlInit_v2"));
  auto by_index = reinterpret_cast<ByIndexFn>(dlsym(handle_, "nvmlDeviceGetHandleByIndex_v2"));
  auto by_uuid = reinterpret_cast<ByUuidFn>(dlsym(handle_, "nvmlDeviceGetHandleByUUID"));
  get_utilization_ = dlsym(handle_, "nvmlDeviceGetUtilizationRates");
  if (init == nullptr || by_index == nullptr || by_uuid == nullptr || get_utilization_ == nullptr ||
      init() != 0) {
    dlclose(handle_);
    handle_ = nullptr;
    return;
  }
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::optional<std::string> visible =
      env == nullptr ? std::nullopt : std::optional<std::string>(env);
  for (const std::string& id : NvmlDevicesForRanks(visible, ranks)) {
    void* device = nullptr;
    if (id.empty()) {
      // not visible to this rank
    } else if (id[0] >= '0' && id[0] <= '9') {
      if (by_index(static_cast<unsigned int>(std::strtoul(id.c_str(), nullptr, 10)), &device) !=
          0) {
        device = nullptr;
      }
    } else if (by_uuid(id.c_str(), &device) != 0) {
      device = nullptr;
    }
    devices_.push_back(device);
  }
}

GpuUtilization::~GpuUtilization() {
  if (handle_ == nullptr) return;
  if (auto shutdown = reinterpret_cast<ShutdownFn>(dlsym(handle_, "nvmlShutdown"))) shutdown();
  dlclose(handle_);
}

std::vector<double> GpuUtilization::Sample() const {
  std::vector<double> out;
  if (handle_ == nullptr) return out;
  auto get = reinterpret_cast<UtilizationFn>(get_utilization_);
  for (void* device : devices_) {
    NvmlUtilization u{};
    out.push_back(device != nullptr && get(device, &u) == 0 ? u.gpu / 100.0 : -1.0);
  }
  return out;
}

}  // namespace decode_indexer::service
