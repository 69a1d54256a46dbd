// Worker warm-up (cache_daemon/worker_warm.h): RunOncePerThread reaches each thread of the pool
// exactly once and gives up at its timeout without stranding the pool; WarmWorkerThread leaves
// the thread's heap pages in place for its next allocations (what a restarted kvtierd's first
// GET would otherwise fault in, page by page).
#include "cache_daemon/worker_warm.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <cstdlib>
#include <future>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "tests/sanitizers.h"

namespace kvtier::daemon::internal {
namespace {

TEST(RunOncePerThreadTest, EachThreadOfThePoolRunsItOnce) {
  constexpr size_t kThreads = 4;
  boost::asio::thread_pool pool(kThreads);
  std::mutex mu;
  std::vector<std::thread::id> ran;
  auto record = [&] {
    std::lock_guard lock(mu);
    ran.push_back(std::this_thread::get_id());
  };
  EXPECT_EQ(RunOncePerThread(pool, kThreads, record, 10000), kThreads);
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(ran.size(), kThreads);
    EXPECT_EQ(std::set<std::thread::id>(ran.begin(), ran.end()).size(), kThreads);
  }
  // Every thread is free again: kThreads jobs that wait for each other all finish.
  EXPECT_EQ(RunOncePerThread(
                pool, kThreads, [] {}, 10000),
            kThreads);
  pool.join();
}

TEST(RunOncePerThreadTest, GivesUpAtTheTimeoutAndTheLateThreadStillRunsIt) {
  boost::asio::thread_pool pool(2);
  std::promise<void> unblock;
  std::shared_future<void> unblocked = unblock.get_future().share();
  boost::asio::post(pool, [unblocked] { unblocked.wait(); });  // one thread is busy
  std::mutex mu;
  std::vector<std::thread::id> ran;
  auto record = [&] {
    std::lock_guard lock(mu);
    ran.push_back(std::this_thread::get_id());
  };
  EXPECT_EQ(RunOncePerThread(pool, 2, record, 100), 1u);
  // The thread that ran it went back to the pool: another job runs while the first is busy.
  std::promise<void> other;
  boost::asio::post(pool, [&other] { other.set_value(); });
  EXPECT_EQ(other.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  unblock.set_value();
  pool.join();  // the late job ran and returned
  std::lock_guard lock(mu);
  EXPECT_EQ(ran.size(), 2u);
}

long ThreadMinorFaults() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

// Minor page faults of allocating, touching and freeing 24 blocks of 4000 bytes (96 KiB, below
// glibc's default trim threshold) on a fresh thread, after `before` ran on it.
long FaultsOfAnAllocationBurst(void (*before)()) {
  long faults = -1;
  std::thread t([&] {
    before();
    const long f0 = ThreadMinorFaults();
    std::vector<uint8_t*> blocks;
    blocks.reserve(24);
    for (int i = 0; i < 24; ++i) {
      auto* p = static_cast<uint8_t*>(std::malloc(4000));
      volatile uint8_t* v = p;
      for (int b = 0; b < 4000; b += 512) v[b] = 1;
      blocks.push_back(p);
    }
    faults = ThreadMinorFaults() - f0;
    for (uint8_t* p : blocks) std::free(p);
  });
  t.join();
  return faults;
}

// Each case in a process of its own (a death test, re-executed): a thread there gets a new
// malloc arena, not one an exited thread of an earlier test left with pages in it. The child
// exits with the burst's fault count (at most 100).
TEST(WarmWorkerThreadDeathTest, LeavesHeapPagesForTheThreadsNextAllocations) {
#if defined(KVTIER_TEST_TSAN) || defined(KVTIER_TEST_ASAN)
  // The sanitizers replace glibc's malloc (no per-thread arenas) and fault in shadow memory
  // beside every page touched: the fault counts measure their allocator, not this warm-up.
  GTEST_SKIP() << "glibc malloc's arenas are replaced by the sanitizer's allocator";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto faults_at_least = [](int n) {
    return [n](int status) { return WIFEXITED(status) && WEXITSTATUS(status) >= n; };
  };
  auto faults_at_most = [](int n) {
    return [n](int status) { return WIFEXITED(status) && WEXITSTATUS(status) <= n; };
  };
  // Without the warm-up the burst faults its new arena's pages in one by one (the measure
  // means something here) ...
  EXPECT_EXIT(std::_Exit(static_cast<int>(std::min(FaultsOfAnAllocationBurst([] {}), 100L))),
              faults_at_least(16), "");
  // ... after it, they are already there.
  EXPECT_EXIT(
      std::_Exit(static_cast<int>(std::min(FaultsOfAnAllocationBurst(WarmWorkerThread), 100L))),
      faults_at_most(2), "");
}

}  // namespace
}  // namespace kvtier::daemon::internal
