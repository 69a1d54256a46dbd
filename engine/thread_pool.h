// ThreadPool: a fixed set of persistent workers for the engine's data-parallel loops.
//
// ParallelFor(n, fn) calls fn(begin, end) on contiguous, disjoint chunks covering [0, n);
// the caller's thread takes part. Every index is processed by exactly one call, and the
// engine's loops compute each output element entirely inside one call with a fixed
// operation order, so results are bit-identical for any thread count.
//
// Cost: a call is cut into at most kChunksPerThread chunks per thread, claimed with one atomic
// compare-and-swap each, so a worker that is late (descheduled on a busy machine) never holds
// the caller up: the caller claims the chunks nobody took and waits only for chunks already
// running. Between calls workers spin for up to kSpinMicros, then sleep on a condition
// variable; a call touches its mutex only when some worker sleeps.
// Thread safety: ParallelFor may be called from one thread at a time (not re-entrant).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtier::engine {

inline constexpr int kMaxThreads = 256;

class ThreadPool {
 public:
  // Chunks per thread a call is cut into (fewer when n is smaller).
  static constexpr int kChunksPerThread = 4;
  // How long an idle worker polls for the next call before it sleeps.
  static constexpr int kSpinMicros = 50;

  // threads <= 1: everything runs on the caller. Clamped to kMaxThreads.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();
  // Claims and runs chunks of call `gen` until none is left (or a newer call began).
  void RunChunks(uint32_t gen);
  // Wakes every sleeping worker (after gen_ or stop_ changed).
  void Wake();

  std::vector<std::thread> workers_;
  // The current call: written by the caller before `claim_` opens it, read by a worker only
  // after it claimed a chunk of that call (then they cannot change until the chunk is done).
  std::atomic<const std::function<void(int64_t, int64_t)>*> job_{nullptr};
  std::atomic<int64_t> job_n_{0};
  // (generation << 32) | (chunks << 16) | next chunk: one word, so a claim names its call.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};  // chunks of the current call finished
  std::atomic<uint32_t> gen_{0};  // bumped per call; idle workers wait on it
  std::atomic<int> sleepers_{0};  // workers asleep (or about to be) on sleep_cv_
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<bool> stop_{false};
};

}  // namespace kvtier::engine
