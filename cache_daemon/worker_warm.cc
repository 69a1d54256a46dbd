#include "cache_daemon/worker_warm.h"

#include <algorithm>
#include <boost/asio/post.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/key_spec.h"

namespace kvtier::daemon::internal {

size_t RunOncePerThread(boost::asio::thread_pool& pool, size_t threads,
                        const std::function<void()>& fn, uint64_t timeout_ms) {
  threads = std::min<size_t>(threads, 1024);
  // Shared with the jobs: a job that outlives a timed-out wait still finds it.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    size_t arrived = 0;
    bool released = false;  // every job may return (all arrived, or the caller gave up)
  };
  auto state = std::make_shared<State>();
  for (size_t i = 0; i < threads; ++i) {
    boost::asio::post(pool, [state, fn, threads] {
      fn();
      std::unique_lock lock(state->mu);
      if (++state->arrived == threads) state->released = true;
      state->cv.notify_all();
      // Held until every job has arrived: a thread that ran fn takes no second job.
      state->cv.wait(lock, [&] { return state->released; });
    });
  }
  std::unique_lock lock(state->mu);
  state->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                     [&] { return state->arrived == threads; });
  const size_t ran = state->arrived;
  state->released = true;  // on a timeout: the jobs that arrived go back to the pool
  state->cv.notify_all();
  return ran;
}

namespace {

// Touches `bytes` of the stack below the caller's frame (not inlined: its frame is the touch).
[[gnu::noinline]] void TouchStack() {
  uint8_t area[kWarmStackBytes];
  for (uint64_t i = 0; i < kWarmStackBytes; i += 4096) area[i] = 0;
  asm volatile("" : : "r"(area) : "memory");  // the stores are kept: the array is "used"
}

}  // namespace

void WarmWorkerThread() {
  (void)StorageKey(Digest{}, Digest{});  // the thread's SHA-256 context, OpenSSL's thread state
  TouchStack();
  std::vector<uint8_t*> blocks;
  blocks.reserve(kWarmHeapBytes / kWarmHeapBlockBytes);
  for (uint64_t b = 0; b < kWarmHeapBytes / kWarmHeapBlockBytes; ++b) {
    auto* p = static_cast<uint8_t*>(std::malloc(kWarmHeapBlockBytes));
    if (p == nullptr) break;
    // Through a volatile pointer: the compiler may not drop the touch with the block.
    volatile uint8_t* v = p;
    for (uint64_t i = 0; i < kWarmHeapBlockBytes; i += 4096) v[i] = 0;
    v[kWarmHeapBlockBytes - 1] = 0;  // a block may end on one more page
    blocks.push_back(p);
  }
  // Freed in reverse: each coalesces with the free top of the arena.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) std::free(*it);
}

}  // namespace kvtier::daemon::internal
