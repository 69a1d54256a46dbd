// A native request's worker thread made ready before its first request. kvtierd restarts cold
// and its first GET lands on a worker that has never run: its first SHA-256 (OpenSSL's
// per-thread state, the thread's hashing context), its malloc arena (created and grown page by
// page) and its stack's deeper pages all cost their first use inside that GET (a restarted
// daemon's 256-unit GET from SSD took ~60 minor page faults on its worker, ~10 us each in a
// virtual machine, and 0.3-0.6 ms to bind its keys against ~0.05 ms warm;
// docs/performance/resume.md, "Resume fetch: a warm worker").
//
//   asio::thread_pool workers(n);
//   RunOncePerThread(workers, n, WarmWorkerThread, kWarmWorkersTimeoutMs);  // at startup
//
// Thread safety: RunOncePerThread may be called from any thread that is not one of the pool's
// (it blocks until each of them ran `fn`). WarmWorkerThread touches only the calling thread's
// state (and the process's malloc settings, as glibc adapts them by itself).
#pragma once

#include <boost/asio/thread_pool.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace kvtier::daemon::internal {

// How much of the thread's heap and stack the warm-up touches: a 256-unit GET from SSD takes
// ~45 fresh heap pages on its worker (its batch's per-unit vectors, keys, entries) and a few
// stack pages; both with room to spare. Memory: the heap stays in the thread's arena as free
// memory (glibc keeps free memory up to its trim threshold in an arena); threads beyond
// glibc's arena limit (8 per core) share arenas, so this is at most that many times 512 KiB.
inline constexpr uint64_t kWarmHeapBytes = 512ull << 10;
inline constexpr uint64_t kWarmHeapBlockBytes = 8ull << 10;  // below malloc's mmap threshold
inline constexpr uint64_t kWarmStackBytes = 64ull << 10;
// How long startup waits for every worker to run the warm-up (they are idle then): past it the
// daemon starts anyway (a warm-up is never needed for correctness).
inline constexpr uint64_t kWarmWorkersTimeoutMs = 5000;

// Runs fn once on each of the pool's `threads` threads: `threads` jobs that each run fn and then
// wait until all have run it, so that no thread takes two. Returns how many ran it (`threads`,
// or fewer when timeout_ms passed first; the late ones still run fn once each, later). The pool
// must have exactly `threads` threads, all idle; threads is at most 1024.
size_t RunOncePerThread(boost::asio::thread_pool& pool, size_t threads,
                        const std::function<void()>& fn, uint64_t timeout_ms);

// The calling thread's first SHA-256 (the key binding's context), kWarmStackBytes of its stack
// and kWarmHeapBytes of the malloc arena it uses (allocated in kWarmHeapBlockBytes blocks,
// touched and freed: they stay in the arena as free pages for the next allocations; kvtierd's
// threads share limits.malloc_arenas_max arenas).
void WarmWorkerThread();

}  // namespace kvtier::daemon::internal
