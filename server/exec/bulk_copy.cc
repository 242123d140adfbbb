#include "server/exec/bulk_copy.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace decode_indexer::exec {
namespace {

// How long a helper spins for the next job before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(300);

class Helper {
 public:
  Helper() : thread_([this] { Loop(); }) {}
  ~Helper() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Post(void* dst, const void* src, size_t bytes) {
    dst_ = dst;
    src_ = src;
    bytes_ = bytes;
    done_.store(false, std::memory_order_relaxed);
    {
      std::lock_guard lock(mu_);
      posted_.store(posted_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    cv_.notify_one();
  }
  void Wait() const {
    while (!done_.load(std::memory_order_acquire)) std::this_thread::yield();
  }

 private:
  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (posted_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      if (posted_.load(std::memory_order_acquire) == seen) {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || posted_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
      }
      seen = posted_.load(std::memory_order_acquire);
      std::memcpy(dst_, src_, bytes_);
      done_.store(true, std::memory_order_release);
    }
  }

  void* dst_ = nullptr;
  const void* src_ = nullptr;
  size_t bytes_ = 0;
  std::atomic<uint64_t> posted_{0};
  std::atomic<bool> done_{true};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

struct Pool {
  std::mutex use;  // held by the copy that uses the helpers
  std::vector<std::unique_ptr<Helper>> helpers;
  bool made = false;
};

Pool& ThePool() {
  static Pool* pool = new Pool;  // never destroyed: helpers may outlive static destructors
  return *pool;
}

// DI_BULK_COPY_HELPERS (0-15) if set, else hardware threads / 4, at most 3.
int DefaultHelpers() {
  if (const char* env = std::getenv("DI_BULK_COPY_HELPERS"); env != nullptr && *env != '\0') {
    return std::clamp(std::atoi(env), 0, 15);
  }
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw / 4, 0, 3);
}

void MakeLocked(Pool& p, int n) {
  p.helpers.clear();
  for (int i = 0; i < n; ++i) p.helpers.push_back(std::make_unique<Helper>());
  p.made = true;
}

}  // namespace

void SetBulkCopyHelpers(int helpers) {
  Pool& p = ThePool();
  std::lock_guard lock(p.use);
  MakeLocked(p, std::clamp(helpers, 0, 15));
}

int BulkCopyHelpers() {
  Pool& p = ThePool();
  std::lock_guard lock(p.use);
  if (!p.made) MakeLocked(p, DefaultHelpers());
  return static_cast<int>(p.helpers.size());
}

void BulkCopy(void* dst, const void* src, size_t bytes) {
  if (bytes < kBulkCopyMin) {
    std::memcpy(dst, src, bytes);
    return;
  }
  Pool& p = ThePool();
  std::unique_lock lock(p.use, std::try_to_lock);
  if (!lock.owns_lock()) {  // another caller has the helpers
    std::memcpy(dst, src, bytes);
    return;
  }
  if (!p.made) MakeLocked(p, DefaultHelpers());
  const size_t parts = p.helpers.size() + 1;
  if (parts == 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Page-aligned chunks, the caller's (the last) taking the remainder.
  const size_t chunk = std::max<size_t>(4096, (bytes / parts) / 4096 * 4096);
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  size_t at = 0;
  size_t used = 0;
  for (; used < p.helpers.size() && at + chunk < bytes; ++used, at += chunk) {
    p.helpers[used]->Post(d + at, s + at, chunk);
  }
  std::memcpy(d + at, s + at, bytes - at);
  for (size_t i = 0; i < used; ++i) p.helpers[i]->Wait();
}

}  // namespace decode_indexer::exec
