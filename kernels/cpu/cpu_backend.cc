// The CPU backend: host memory, memcpy copies, no streams (every entry point completes before
// it returns, so Synchronize is a no-op and ForkExpand runs inline). The scoring runs on a
// fixed thread pool with per-thread scratch sized once from the limits.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "kernels/cpu/engine.h"
#include "kernels/cpu/thread_pool.h"

namespace decode_indexer::kernels {
namespace {

constexpr size_t kAlignment = 64;

class CpuBackend final : public Backend {
 public:
  CpuBackend(const BackendLimits& limits, int threads) : pool_(threads), engine_(&pool_) {
    engine_.Reserve(limits);
  }

  std::string_view name() const override { return "cpu"; }
  std::string description() const override {
    return absl::StrCat("cpu (", pool_.size(), pool_.size() == 1 ? " thread)" : " threads)");
  }

  // calloc, aligned by hand: a large block comes from fresh zero pages that the OS commits on
  // first touch (glibc and ASan's allocator both skip clearing them), so a big, sparsely used
  // buffer (a resident page table with a row per possible sequence) costs only what is used.
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const size_t rounded =
        std::max<size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
    void* raw = std::calloc(1, rounded + kAlignment);
    if (raw == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    const uintptr_t at =
        (reinterpret_cast<uintptr_t>(raw) + kAlignment - 1) / kAlignment * kAlignment;
    void* ptr = reinterpret_cast<void*>(at);
    std::lock_guard<std::mutex> lock(alloc_mu_);
    blocks_[ptr] = raw;
    return ptr;
  }
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    void* raw = nullptr;
    {
      std::lock_guard<std::mutex> lock(alloc_mu_);
      auto it = blocks_.find(ptr);
      if (it == blocks_.end()) return;
      raw = it->second;
      blocks_.erase(it);
    }
    std::free(raw);
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    return Copy(dst, host_src, bytes);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    return Copy(host_dst, src, bytes);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status InsertKeys(const KeyInsertArgs& args) override { return cpu::InsertKeys(args); }
  absl::Status RopeQuantQ(const QPrepArgs& args) override { return cpu::RopeQuantQ(args); }
  absl::Status DenseTopK(const DenseArgs& args) override {
    std::lock_guard<std::mutex> lock(engine_mu_);
    return engine_.DenseTopK(args);
  }
  absl::Status SparseTopK(const SparseArgs& args) override {
    std::lock_guard<std::mutex> lock(engine_mu_);
    return engine_.SparseTopK(args);
  }
  absl::Status MaskedTopK(const MaskedArgs& args) override {
    std::lock_guard<std::mutex> lock(engine_mu_);
    return engine_.MaskedTopK(args);
  }
  absl::Status CopyRows(const CopyRowsArgs& args) override { return cpu::CopyRows(args); }
  absl::Status CheckValues(const ValueCheckArgs& args) override { return cpu::CheckValues(args); }

  absl::Status ForkExpand(const ExpandArgs& args) override { return cpu::ExpandCandidates(args); }
  absl::Status JoinExpand() override { return absl::OkStatus(); }

 private:
  static absl::Status Copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError("cpu: copy with a null pointer");
    }
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }

  std::mutex alloc_mu_;
  std::unordered_map<void*, void*> blocks_;  // aligned pointer -> calloc's
  cpu::ThreadPool pool_;
  // The engine's scratch serves one call at a time; a rank calls from one thread, so this
  // lock only matters for misuse.
  std::mutex engine_mu_;
  cpu::internal::Engine engine_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const BackendLimits& limits, int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(limits, threads);
}

}  // namespace decode_indexer::kernels
