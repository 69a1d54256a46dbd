#include "engine/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVTIER_CPU_RELAX() _mm_pause()
#else
#define KVTIER_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvtier::engine {

namespace {

constexpr uint64_t kIndexMask = 0xffff;

uint64_t ClaimWord(uint32_t gen, uint64_t chunks, uint64_t next) {
  return (static_cast<uint64_t>(gen) << 32) | (chunks << 16) | next;
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  threads = std::clamp(threads, 1, kMaxThreads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  gen_.fetch_add(1);
  Wake();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Wake() {
  // A worker between its predicate check and its wait holds the mutex: taking it here means
  // every sleeper either sees the new gen_ or is waiting and gets the notification.
  { std::lock_guard<std::mutex> lock(sleep_mu_); }
  sleep_cv_.notify_all();
}

void ThreadPool::RunChunks(uint32_t gen) {
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (static_cast<uint32_t>(c >> 32) != gen) return;  // a newer call: this one is done
    const uint64_t chunks = (c >> 16) & kIndexMask, next = c & kIndexMask;
    if (next >= chunks) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      continue;  // c reloaded
    }
    // Chunk `next` of call `gen` is ours; the call cannot end before it is done, so its
    // fields are stable.
    const int64_t n = job_n_.load(std::memory_order_relaxed);
    const auto* fn = job_.load(std::memory_order_relaxed);
    const int64_t b = n * static_cast<int64_t>(next) / static_cast<int64_t>(chunks);
    const int64_t e = n * static_cast<int64_t>(next + 1) / static_cast<int64_t>(chunks);
    (*fn)(b, e);
    done_.fetch_add(1, std::memory_order_release);
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::WorkerLoop() {
  using Clock = std::chrono::steady_clock;
  // The value at construction, not at thread start: a worker that starts late must still see
  // every later change (including the destructor's).
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      const auto deadline = Clock::now() + std::chrono::microseconds(kSpinMicros);
      for (int i = 0; g == seen; ++i) {
        KVTIER_CPU_RELAX();
        g = gen_.load(std::memory_order_acquire);
        if ((i & 63) == 63 && Clock::now() > deadline) break;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1);  // seq_cst: pairs with the caller's store of gen_, then load
        sleep_cv_.wait(lock, [&] { return gen_.load() != seen || stop_.load(); });
        sleepers_.fetch_sub(1);
        g = gen_.load();
      }
    }
    if (stop_.load()) return;
    seen = g;
    RunChunks(g);
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  const uint64_t chunks =
      static_cast<uint64_t>(std::min<int64_t>(n, int64_t{threads()} * kChunksPerThread));
  // The previous call is fully done (done_ reached its chunk count), so no worker can still
  // claim from it: claim_ says its chunks are all taken.
  const uint32_t gen = gen_.load(std::memory_order_relaxed) + 1;
  job_.store(&fn, std::memory_order_relaxed);
  job_n_.store(n, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  claim_.store(ClaimWord(gen, chunks, 0), std::memory_order_release);
  gen_.store(gen);  // seq_cst: pairs with a worker's sleepers_ increment, then wait
  if (sleepers_.load() > 0) Wake();
  RunChunks(gen);
  // Only chunks some worker is running remain; wait for them.
  for (int i = 0; done_.load(std::memory_order_acquire) != static_cast<int64_t>(chunks); ++i) {
    if (i < 4096) {
      KVTIER_CPU_RELAX();
    } else {
      std::this_thread::yield();  // the worker was descheduled mid-chunk
    }
  }
}

}  // namespace kvtier::engine
