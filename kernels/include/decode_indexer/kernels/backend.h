// A rank's compute backend (CPU reference, CUDA): one Device (device.h: memory, copies,
// stream, graphs, events, IPC, host registration) and the IndexerOps that run on it
// (indexer_ops.h: the indexer's math), implemented together by the CPU and CUDA backends.
// The server's callers take the narrow interface they need (a rank's staging, readback and
// collectives a Device; decode_rows and CandidateOverlap its IndexerOps; the data plane the
// answering rank's Device). A test decorates the interface it faults (DeviceWrapper,
// IndexerOpsWrapper) and joins the pieces with ComposeBackend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "decode_indexer/kernels/device.h"
#include "decode_indexer/kernels/indexer_ops.h"
#include "decode_indexer/kernels/types.h"
#include "decode_indexer/kernels/value_check.h"

namespace decode_indexer::kernels {

// Precision of the dense FP8 logits (spec section 6). kExact: exact products summed in fp32
// (within 4 fp32 ulps of the row's largest |logit|). kFp8: fp8 tensor-core accumulation (within
// the fp8-accumulation bound; faster on the GPU). kDefault: the backend's choice (the CUDA
// backend: sm90_heuristics.h). The CPU backend is exact under every value.
enum class LogitsPrecision { kDefault, kExact, kFp8 };

// Bounds known at start-up; a backend sizes its workspaces from them once.
struct BackendLimits {
  int32_t max_rows = 0;      // rows in one step
  int32_t max_requests = 0;  // requests in one step
  int64_t max_context = 0;   // longest row
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  int32_t max_topk = 0;
  int32_t max_candidate_positions = 0;
  LogitsPrecision logits_precision = LogitsPrecision::kDefault;
};

class Backend : public Device, public IndexerOps {
 public:
  ~Backend() override = default;
  Device& device() { return *this; }
  IndexerOps& ops() { return *this; }
};

// Forwards every Device call to another device (LevelDB's EnvWrapper). Base is Device for a
// test's decorator (DeviceWrapper, which overrides only the calls it checks or faults), or a
// class that also needs the IndexerOps calls forwarded (ComposeBackend's).
template <typename Base>
class ForwardingDevice : public Base {
 public:
  explicit ForwardingDevice(Device& target) : target_(target) {}
  Device& target() const { return target_; }

  std::string_view name() const override { return target_.name(); }
  std::string description() const override { return target_.description(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override { return target_.Allocate(bytes); }
  void Free(void* ptr) override { target_.Free(ptr); }
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    return target_.CopyToDevice(dst, host_src, bytes);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    return target_.CopyToHost(host_dst, src, bytes);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return target_.CopyDeviceToDevice(dst, src, bytes);
  }
  absl::Status Synchronize() override { return target_.Synchronize(); }
  absl::StatusOr<void*> AllocateHost(size_t bytes) override { return target_.AllocateHost(bytes); }
  void FreeHost(void* ptr) override { target_.FreeHost(ptr); }
  absl::StatusOr<Device::Mapped> AllocateMapped(size_t bytes) override {
    return target_.AllocateMapped(bytes);
  }
  void FreeMapped(void* host) override { target_.FreeMapped(host); }
  bool SupportsGraphs() const override { return target_.SupportsGraphs(); }
  absl::Status BeginCapture() override { return target_.BeginCapture(); }
  absl::Status EndCapture(uint64_t key) override { return target_.EndCapture(key); }
  void AbortCapture() override { target_.AbortCapture(); }
  absl::StatusOr<bool> Replay(uint64_t key) override { return target_.Replay(key); }
  void DropGraph(uint64_t key) override { target_.DropGraph(key); }
  absl::StatusOr<void*> OpenIpcMemory(std::string_view handle, size_t bytes, int device) override {
    return target_.OpenIpcMemory(handle, bytes, device);
  }
  absl::Status CloseIpcMemory(void* ptr) override { return target_.CloseIpcMemory(ptr); }
  absl::StatusOr<void*> OpenIpcEvent(std::string_view handle, int device) override {
    return target_.OpenIpcEvent(handle, device);
  }
  absl::Status CloseIpcEvent(void* event) override { return target_.CloseIpcEvent(event); }
  absl::Status WaitEvent(void* event) override { return target_.WaitEvent(event); }
  absl::Status RecordEvent(void* event) override { return target_.RecordEvent(event); }
  absl::Status RegisterHostMemory(void* ptr, size_t bytes) override {
    return target_.RegisterHostMemory(ptr, bytes);
  }
  absl::Status UnregisterHostMemory(void* ptr) override {
    return target_.UnregisterHostMemory(ptr);
  }
  int64_t DeviceMemoryBytes() const override { return target_.DeviceMemoryBytes(); }

 private:
  Device& target_;
};

// Forwards every IndexerOps call to other ops, as ForwardingDevice does the Device calls
// (IndexerOpsWrapper: a test's decorator overrides only the operations it checks or faults).
// BaseArgs go to Base's constructor.
template <typename Base>
class ForwardingOps : public Base {
 public:
  template <typename... BaseArgs>
  explicit ForwardingOps(IndexerOps& target, BaseArgs&&... base_args)
      : Base(std::forward<BaseArgs>(base_args)...), target_(target) {}
  IndexerOps& target() const { return target_; }

  absl::Status InsertKeys(const KeyInsertArgs& args) override { return target_.InsertKeys(args); }
  absl::Status RopeQuantQ(const QPrepArgs& args) override { return target_.RopeQuantQ(args); }
  absl::Status DenseTopK(const DenseArgs& args) override { return target_.DenseTopK(args); }
  absl::Status SparseTopK(const SparseArgs& args) override { return target_.SparseTopK(args); }
  absl::Status MaskedTopK(const MaskedArgs& args) override { return target_.MaskedTopK(args); }
  absl::Status CopyRows(const CopyRowsArgs& args) override { return target_.CopyRows(args); }
  absl::Status CheckValues(const ValueCheckArgs& args) override {
    return target_.CheckValues(args);
  }
  absl::Status ForkExpand(const ExpandArgs& args) override { return target_.ForkExpand(args); }
  absl::Status JoinExpand() override { return target_.JoinExpand(); }

 private:
  IndexerOps& target_;
};

class DeviceWrapper : public ForwardingDevice<Device> {
 public:
  using ForwardingDevice::ForwardingDevice;
};
class IndexerOpsWrapper : public ForwardingOps<IndexerOps> {
 public:
  using ForwardingOps::ForwardingOps;
};

// A Backend made of `inner` with its Device, its IndexerOps or both replaced by decorators
// (DeviceWrapper / IndexerOpsWrapper built over inner's); null keeps inner's own. Owns all
// three (the decorators are destroyed first).
std::unique_ptr<Backend> ComposeBackend(std::unique_ptr<Backend> inner,
                                        std::unique_ptr<Device> device,
                                        std::unique_ptr<IndexerOps> ops);

// The CPU reference backend. threads <= 0: one per hardware thread.
std::unique_ptr<Backend> MakeCpuBackend(const BackendLimits& limits, int threads);

// Whether this build has the CUDA backend and a usable GPU.
bool CudaBackendAvailable();
int CudaDeviceCount();
// The CUDA backend on `device`; an error where the build has no CUDA or no such device.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendLimits& limits, int device);

// What the CUDA kernels take, so a server refuses an unsupported profile at start-up instead of
// failing its first step (the kernels keep their own checks as a second line). Defined in every
// build (no CUDA needed). FAILED_PRECONDITION names the field, its value and what is supported:
// "<cache_field>.page_size: 16 (the CUDA backend takes 64)", "num_heads: 8 (...)".
// candidate_block_size 0 means no candidate layers.
absl::Status CudaSupportsGeometry(const CacheGeometry& geometry, int32_t num_heads,
                                  int32_t candidate_block_size,
                                  std::string_view cache_field = "cache");
// The number of GPUs (ranks) one CUDA process may drive: "ranks: 17 (...)".
absl::Status CudaSupportsRanks(int32_t ranks);

}  // namespace decode_indexer::kernels
