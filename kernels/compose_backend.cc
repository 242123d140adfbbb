// ComposeBackend (backend.h): a Backend whose Device or IndexerOps is a test's decorator.
#include <memory>
#include <utility>

#include "decode_indexer/kernels/backend.h"

namespace decode_indexer::kernels {
namespace {

class ComposedBackend final : public Backend {
 public:
  ComposedBackend(std::unique_ptr<Backend> inner, std::unique_ptr<Device> device,
                  std::unique_ptr<IndexerOps> ops)
      : inner_(std::move(inner)),
        own_device_(std::move(device)),
        own_ops_(std::move(ops)),
        d_(own_device_ != nullptr ? *own_device_ : inner_->device()),
        o_(own_ops_ != nullptr ? *own_ops_ : inner_->ops()) {}
  ~ComposedBackend() override {
    // The decorators refer to the inner backend: they go first.
    own_ops_.reset();
    own_device_.reset();
  }

  // Device.
  std::string_view name() const override { return d_.name(); }
  std::string description() const override { return d_.description(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override { return d_.Allocate(bytes); }
  void Free(void* ptr) override { d_.Free(ptr); }
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    return d_.CopyToDevice(dst, host_src, bytes);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    return d_.CopyToHost(host_dst, src, bytes);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return d_.CopyDeviceToDevice(dst, src, bytes);
  }
  absl::Status Synchronize() override { return d_.Synchronize(); }
  absl::StatusOr<void*> AllocateHost(size_t bytes) override { return d_.AllocateHost(bytes); }
  void FreeHost(void* ptr) override { d_.FreeHost(ptr); }
  bool SupportsGraphs() const override { return d_.SupportsGraphs(); }
  absl::Status BeginCapture() override { return d_.BeginCapture(); }
  absl::Status EndCapture(uint64_t key) override { return d_.EndCapture(key); }
  void AbortCapture() override { d_.AbortCapture(); }
  absl::StatusOr<bool> Replay(uint64_t key) override { return d_.Replay(key); }
  absl::StatusOr<void*> OpenIpcMemory(std::string_view handle, size_t bytes, int device) override {
    return d_.OpenIpcMemory(handle, bytes, device);
  }
  absl::Status CloseIpcMemory(void* ptr) override { return d_.CloseIpcMemory(ptr); }
  absl::StatusOr<void*> OpenIpcEvent(std::string_view handle, int device) override {
    return d_.OpenIpcEvent(handle, device);
  }
  absl::Status CloseIpcEvent(void* event) override { return d_.CloseIpcEvent(event); }
  absl::Status WaitEvent(void* event) override { return d_.WaitEvent(event); }
  absl::Status RecordEvent(void* event) override { return d_.RecordEvent(event); }
  absl::Status RegisterHostMemory(void* ptr, size_t bytes) override {
    return d_.RegisterHostMemory(ptr, bytes);
  }
  absl::Status UnregisterHostMemory(void* ptr) override { return d_.UnregisterHostMemory(ptr); }
  int64_t DeviceMemoryBytes() const override { return d_.DeviceMemoryBytes(); }

  // IndexerOps.
  absl::Status InsertKeys(const KeyInsertArgs& args) override { return o_.InsertKeys(args); }
  absl::Status RopeQuantQ(const QPrepArgs& args) override { return o_.RopeQuantQ(args); }
  absl::Status DenseTopK(const DenseArgs& args) override { return o_.DenseTopK(args); }
  absl::Status SparseTopK(const SparseArgs& args) override { return o_.SparseTopK(args); }
  absl::Status MaskedTopK(const MaskedArgs& args) override { return o_.MaskedTopK(args); }
  absl::Status CopyRows(const CopyRowsArgs& args) override { return o_.CopyRows(args); }
  absl::Status CheckValues(const ValueCheckArgs& args) override { return o_.CheckValues(args); }
  absl::Status ForkExpand(const ExpandArgs& args) override { return o_.ForkExpand(args); }
  absl::Status JoinExpand() override { return o_.JoinExpand(); }
  absl::StatusOr<OverlapTiming> LastOverlapTiming() override { return o_.LastOverlapTiming(); }
  void SetScoringTiming(bool on) override { o_.SetScoringTiming(on); }
  absl::StatusOr<double> LastScoringUs() override { return o_.LastScoringUs(); }

 private:
  std::unique_ptr<Backend> inner_;
  std::unique_ptr<Device> own_device_;
  std::unique_ptr<IndexerOps> own_ops_;
  Device& d_;
  IndexerOps& o_;
};

}  // namespace

std::unique_ptr<Backend> ComposeBackend(std::unique_ptr<Backend> inner,
                                        std::unique_ptr<Device> device,
                                        std::unique_ptr<IndexerOps> ops) {
  return std::make_unique<ComposedBackend>(std::move(inner), std::move(device), std::move(ops));
}

}  // namespace decode_indexer::kernels
