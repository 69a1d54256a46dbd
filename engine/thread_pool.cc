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
  gen_.notify_all();
  for (auto& t : workers_) t.join();
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

bool ThreadPool::RunSide() {
  int s = kSidePosted;
  if (side_state_.load(std::memory_order_relaxed) != kSidePosted ||
      !side_state_.compare_exchange_strong(s, kSideTaken, std::memory_order_acq_rel,
                                           std::memory_order_relaxed)) {
    return false;
  }
  (*side_fn_.load(std::memory_order_relaxed))();
  side_state_.store(kSideDone, std::memory_order_release);
  return true;
}

uint32_t ThreadPool::Publish() {
  const uint32_t gen = gen_.load(std::memory_order_relaxed) + 1;
  gen_.store(gen);  // seq_cst: pairs with a worker's sleepers_ increment, then load
  if (sleepers_.load() > 0) gen_.notify_all();
  return gen;
}

ThreadPool::Side::Side(ThreadPool* pool, const std::function<void()>* fn) : pool_(pool) {
  if (pool_ == nullptr || pool_->workers_.empty()) {
    pool_ = nullptr;
    (*fn)();
    return;
  }
  ++pool_->dispatches_;
  pool_->side_fn_.store(fn, std::memory_order_relaxed);
  pool_->side_state_.store(kSidePosted, std::memory_order_release);
  // A new generation wakes idle workers; its claim word is the previous call's (all taken), so
  // a worker finds no chunk in it, only the side task.
  pool_->Publish();
}

void ThreadPool::Side::Join() {
  if (pool_ == nullptr) return;
  if (!pool_->RunSide()) {  // a worker has it: wait until it is done
    for (int i = 0; pool_->side_state_.load(std::memory_order_acquire) != kSideDone; ++i) {
      if (i < 4096) {
        KVTIER_CPU_RELAX();
      } else {
        std::this_thread::yield();  // the worker was descheduled mid-task
      }
    }
  }
  pool_->side_state_.store(kSideIdle, std::memory_order_relaxed);
  pool_ = nullptr;
}

void ThreadPool::WorkerLoop() {
  using Clock = std::chrono::steady_clock;
  // The value at construction, not at thread start: a worker that starts late must still see
  // every later change (including the destructor's).
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      const auto start = Clock::now();
      for (int i = 0; g == seen; ++i) {
        KVTIER_CPU_RELAX();
        g = gen_.load(std::memory_order_acquire);
        if ((i & 63) == 63) {
          const int limit_us =
              holds_.load(std::memory_order_relaxed) > 0 ? kHeldSpinMicros : kSpinMicros;
          if (Clock::now() - start > std::chrono::microseconds(limit_us)) break;
        }
      }
      if (g == seen) {
        // seq_cst increment, then load: either this load sees the caller's new gen_, or the
        // caller's load of sleepers_ (after its store of gen_) sees this worker and notifies.
        sleepers_.fetch_add(1);
        while ((g = gen_.load()) == seen) gen_.wait(seen);  // returns once gen_ != seen
        sleepers_.fetch_sub(1);
      }
    }
    if (stop_.load()) return;
    seen = g;
    RunSide();
    RunChunks(g);
  }
}

void ThreadPool::ParallelFor(int64_t n, RangeFn fn, int chunks_per_thread) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  const int64_t per_thread = std::clamp(chunks_per_thread, 1, kChunksPerThread);
  const uint64_t chunks = static_cast<uint64_t>(std::min<int64_t>(n, threads() * per_thread));
  ++dispatches_;
  // The previous call is fully done (done_ reached its chunk count), so no worker can still
  // claim from it: claim_ says its chunks are all taken.
  const uint32_t gen = gen_.load(std::memory_order_relaxed) + 1;
  job_.store(&fn, std::memory_order_relaxed);
  job_n_.store(n, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  claim_.store(ClaimWord(gen, chunks, 0), std::memory_order_release);
  Publish();
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
