// GPU utilisation per rank for the metrics endpoint, read through NVML loaded at run time
// (dlopen of the driver's libnvidia-ml.so.1), so the build links nothing new and a host
// without the NVIDIA driver simply has no utilisation to report.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace decode_indexer::service {

// The NVML device each rank's GPU is, from CUDA_VISIBLE_DEVICES (NVML ignores that variable):
// unset or empty -> rank r is NVML index r; a list of indices -> its r-th entry; UUIDs
// ("GPU-...", "MIG-...") -> looked up by UUID. Exposed for tests: `visible` is the variable's
// value (nullopt when unset). Answers one entry per rank; an entry is an index ("3") or a UUID.
std::vector<std::string> NvmlDevicesForRanks(const std::optional<std::string>& visible, int ranks);

class GpuUtilization {
 public:
  // Loads NVML once; without it every Sample() answers an empty vector.
  explicit GpuUtilization(int ranks);
  ~GpuUtilization();
  GpuUtilization(const GpuUtilization&) = delete;
  GpuUtilization& operator=(const GpuUtilization&) = delete;

  bool available() const { return handle_ != nullptr; }
  // Per rank: the fraction of the last sample period in which a kernel ran (NVML's
  // utilization.gpu / 100), or a negative value where NVML could not say.
  std::vector<double> Sample() const;

 private:
  void* handle_ = nullptr;
  std::vector<void*> devices_;  // nvmlDevice_t per rank (nullptr where not found)
  void* get_utilization_ = nullptr;
};

}  // namespace decode_indexer::service
