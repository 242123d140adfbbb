// Test decorators of a rank's backend, each of the interface it checks or faults: a
// CheckingDevice (kernels::DeviceWrapper) keeps the set of memory its device allocated and
// checks that copies go between host memory and that memory in the stated direction; a
// CheckingOps (kernels::IndexerOpsWrapper) checks that every pointer an operation receives
// lies inside that memory, and injects faults (a failing rank, a slow kernel). On a CPU
// backend host and "device" memory are one address space, so without this a host pointer
// handed to a kernel (fatal on a GPU) would pass every CPU test. MakeCheckingBackend joins
// both over a real backend (kernels::ComposeBackend).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"

namespace decode_indexer::testing {

class CheckingDevice final : public kernels::DeviceWrapper {
 public:
  CheckingDevice(kernels::Device& target, std::atomic<int64_t>* violations)
      : DeviceWrapper(target), violations_(violations) {}

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::StatusOr<void*> p = target().Allocate(bytes);
    if (p.ok()) {
      std::lock_guard lock(mu_);
      owned_[reinterpret_cast<uintptr_t>(*p)] = bytes;
    }
    return p;
  }
  void Free(void* ptr) override {
    {
      std::lock_guard lock(mu_);
      owned_.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    target().Free(ptr);
  }
  // Mapped host memory is the device's too (its kernels write it in place): its device
  // address is owned as an allocation.
  absl::StatusOr<Mapped> AllocateMapped(size_t bytes) override {
    absl::StatusOr<Mapped> m = target().AllocateMapped(bytes);
    if (m.ok()) {
      std::lock_guard lock(mu_);
      owned_[reinterpret_cast<uintptr_t>(m->device)] = bytes;
      mapped_[m->host] = m->device;
    }
    return m;
  }
  void FreeMapped(void* host) override {
    {
      std::lock_guard lock(mu_);
      if (auto it = mapped_.find(host); it != mapped_.end()) {
        owned_.erase(reinterpret_cast<uintptr_t>(it->second));
        mapped_.erase(it);
      }
    }
    target().FreeMapped(host);
  }
  // Counts every CopyToDevice / CopyToHost call into `*counter` from now on (null: stop
  // counting).
  void CountCopiesToDevice(std::atomic<int64_t>* counter) { copies_to_device_ = counter; }
  void CountCopiesToHost(std::atomic<int64_t>* counter) { copies_to_host_ = counter; }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (copies_to_device_ != nullptr) copies_to_device_->fetch_add(1);
    if (absl::Status s = Mine(dst, bytes, "CopyToDevice dst"); !s.ok()) return s;
    if (absl::Status s = NotMine(src, "CopyToDevice src"); !s.ok()) return s;
    return target().CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (copies_to_host_ != nullptr) copies_to_host_->fetch_add(1);
    if (absl::Status s = Mine(src, bytes, "CopyToHost src"); !s.ok()) return s;
    if (absl::Status s = NotMine(dst, "CopyToHost dst"); !s.ok()) return s;
    return target().CopyToHost(dst, src, bytes);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    if (absl::Status s = Mine(dst, bytes, "CopyDeviceToDevice dst"); !s.ok()) return s;
    if (absl::Status s = Mine(src, bytes, "CopyDeviceToDevice src"); !s.ok()) return s;
    return target().CopyDeviceToDevice(dst, src, bytes);
  }

  // Whether [p, p + bytes) lies inside one allocation of this device.
  bool Owns(const void* p, size_t bytes) {
    std::lock_guard lock(mu_);
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = owned_.upper_bound(a);
    if (it == owned_.begin()) return false;
    --it;
    return a >= it->first && a + bytes <= it->first + it->second;
  }
  absl::Status Violation(const std::string& what) {
    violations_->fetch_add(1);
    return absl::InternalError(absl::StrCat("CheckingBackend: ", what));
  }

 private:
  absl::Status Mine(const void* p, size_t bytes, const char* what) {
    if (bytes == 0 || Owns(p, bytes)) return absl::OkStatus();
    return Violation(absl::StrCat(what, " is not this backend's memory"));
  }
  absl::Status NotMine(const void* p, const char* what) {
    if (!Owns(p, 1)) return absl::OkStatus();
    return Violation(absl::StrCat(what, " is this backend's memory, not host memory"));
  }

  std::atomic<int64_t>* violations_;
  std::atomic<int64_t>* copies_to_device_ = nullptr;
  std::atomic<int64_t>* copies_to_host_ = nullptr;
  std::mutex mu_;
  std::map<uintptr_t, size_t> owned_;
  std::map<void*, void*> mapped_;  // AllocateMapped's host address -> its device address
};

class CheckingOps final : public kernels::IndexerOpsWrapper {
 public:
  // With fail_rank: while *fail_rank == rank, every kernel after key insertion (scoring,
  // CopyRows, ForkExpand) fails, to test a rank failing after the step's keys were written.
  // With pause: while *pause is set, every kernel entry point calls it first (a slow kernel,
  // e.g. one that runs past its caller's deadline).
  CheckingOps(kernels::IndexerOps& target, CheckingDevice& device, int32_t rank = 0,
              const std::atomic<int32_t>* fail_rank = nullptr,
              const std::function<void()>* pause = nullptr)
      : IndexerOpsWrapper(target),
        device_(device),
        rank_(rank),
        fail_rank_(fail_rank),
        pause_(pause) {}

  absl::Status InsertKeys(const kernels::KeyInsertArgs& a) override {
    return Check(
        {{a.cache.base, "cache"},
         {a.keys, "keys"},
         {a.key_scales, "key_scales"},
         {a.slots, "slots"}},
        [&] { return target().InsertKeys(a); }, /*injectable=*/false);
  }
  absl::Status RopeQuantQ(const kernels::QPrepArgs& a) override {
    return Check(
        {{a.q, "q"},
         {a.weights_raw, "weights_raw"},
         {a.positions, "positions"},
         {a.rope.inv_freq, "inv_freq"},
         {a.q_codes, "q_codes"},
         {a.q_scales, "q_scales"},
         {a.weights_out, "weights_out"}},
        [&] { return target().RopeQuantQ(a); }, /*injectable=*/false);
  }
  absl::Status DenseTopK(const kernels::DenseArgs& a) override {
    return Check({{a.cache.base, "cache"},
                  {a.rows.row_request, "row_request"},
                  {a.rows.row_length, "row_length"},
                  {a.rows.page_table, "page_table"},
                  {a.q.codes, "q.codes"},
                  {a.q.scales, "q.scales"},
                  {a.q.weights, "q.weights"},
                  {a.topk_out, "topk_out"},
                  {a.candidates_out, "candidates_out"}},
                 [&] { return target().DenseTopK(a); });
  }
  absl::Status SparseTopK(const kernels::SparseArgs& a) override {
    return Check({{a.cache.base, "cache"},
                  {a.rows.row_request, "row_request"},
                  {a.rows.row_length, "row_length"},
                  {a.rows.page_table, "page_table"},
                  {a.q.codes, "q.codes"},
                  {a.q.scales, "q.scales"},
                  {a.q.weights, "q.weights"},
                  {a.positions, "positions"},
                  {a.counts, "counts"},
                  {a.topk_out, "topk_out"}},
                 [&] { return target().SparseTopK(a); });
  }
  absl::Status MaskedTopK(const kernels::MaskedArgs& a) override {
    return Check({{a.cache.base, "cache"},
                  {a.rows.row_request, "row_request"},
                  {a.rows.row_length, "row_length"},
                  {a.rows.page_table, "page_table"},
                  {a.q.codes, "q.codes"},
                  {a.q.scales, "q.scales"},
                  {a.q.weights, "q.weights"},
                  {a.candidates, "candidates"},
                  {a.topk_out, "topk_out"}},
                 [&] { return target().MaskedTopK(a); });
  }
  absl::Status CopyRows(const kernels::CopyRowsArgs& a) override {
    return Check(
        {{a.dst, "dst"}, {a.dst_index, "dst_index"}, {a.src, "src"}, {a.src_index, "src_index"}},
        [&] { return target().CopyRows(a); });
  }
  absl::Status CheckValues(const kernels::ValueCheckArgs& a) override {
    std::vector<Arg> args{{a.flags, "flags"}};
    for (int32_t c = 0; c < a.num_checks && c < kernels::ValueCheckArgs::kMaxChecks; ++c) {
      args.push_back({a.checks[c].data, "checks[].data"});
    }
    for (const Arg& arg : args) {
      if (arg.ptr != nullptr && !device_.Owns(arg.ptr, 1)) {
        return device_.Violation(absl::StrCat(arg.what, " is not this backend's memory"));
      }
    }
    return target().CheckValues(a);
  }
  absl::Status ForkExpand(const kernels::ExpandArgs& a) override {
    return Check({{a.candidates, "candidates"},
                  {a.row_length, "row_length"},
                  {a.out.positions, "positions"},
                  {a.out.counts, "counts"}},
                 [&] { return target().ForkExpand(a); });
  }

 private:
  struct Arg {
    const void* ptr;
    const char* what;
  };

  template <typename F>
  absl::Status Check(std::initializer_list<Arg> args, F&& call, bool injectable = true) {
    if (pause_ != nullptr && *pause_) (*pause_)();
    if (injectable && fail_rank_ != nullptr && fail_rank_->load() == rank_) {
      return absl::InternalError(absl::StrCat("injected fault on rank ", rank_));
    }
    for (const Arg& a : args) {
      // Optional arguments are null; every non-null one must be ours.
      if (a.ptr != nullptr && !device_.Owns(a.ptr, 1)) {
        return device_.Violation(absl::StrCat(a.what, " is not this backend's memory"));
      }
    }
    return call();
  }

  CheckingDevice& device_;
  int32_t rank_;
  const std::atomic<int32_t>* fail_rank_;
  const std::function<void()>* pause_;
};

// `inner` with its device a CheckingDevice and its operations a CheckingOps over it (see
// CheckingOps for fail_rank and pause); `device_out`, where given, receives the
// CheckingDevice (owned by the answer).
inline std::unique_ptr<kernels::Backend> MakeCheckingBackend(
    std::unique_ptr<kernels::Backend> inner, std::atomic<int64_t>* violations, int32_t rank = 0,
    const std::atomic<int32_t>* fail_rank = nullptr, const std::function<void()>* pause = nullptr,
    CheckingDevice** device_out = nullptr) {
  auto device = std::make_unique<CheckingDevice>(inner->device(), violations);
  auto ops = std::make_unique<CheckingOps>(inner->ops(), *device, rank, fail_rank, pause);
  if (device_out != nullptr) *device_out = device.get();
  return kernels::ComposeBackend(std::move(inner), std::move(device), std::move(ops));
}

}  // namespace decode_indexer::testing
