// ThreadPool: a fixed set of workers for the engine's data-parallel loops.
//
// ParallelFor(n, fn) calls fn(begin, end) on contiguous, disjoint chunks covering [0, n);
// the caller's thread takes part. Every index is processed by exactly one call, and the
// engine's loops compute each output element entirely inside one call with a fixed
// operation order, so results are bit-identical for any thread count.
// Thread safety: ParallelFor may be called from one thread at a time (not re-entrant).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtier::engine {

inline constexpr int kMaxThreads = 256;

class ThreadPool {
 public:
  // threads <= 1: everything runs on the caller. Clamped to kMaxThreads.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace kvtier::engine
