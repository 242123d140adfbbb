// A small fixed thread pool for the CPU backend: workers are created once, and a parallel
// loop hands out item indices from a shared counter, so no thread is spawned per call.
// Which thread runs which item never changes a result: every item writes disjoint outputs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace decode_indexer::kernels::cpu {

class ThreadPool {
 public:
  // `threads` >= 1 threads in all: the caller of ParallelFor plus threads - 1 workers.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(item, thread) for every item in [0, n), thread in [0, size()); returns when all
  // are done. Calls are serialised; fn must not call ParallelFor.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn);

 private:
  void WorkerLoop(int thread);
  void RunItems(int thread);

  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  bool stop_ = false;
  int64_t num_items_ = 0;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  std::atomic<int64_t> next_item_{0};
  std::vector<std::thread> workers_;
};

}  // namespace decode_indexer::kernels::cpu
