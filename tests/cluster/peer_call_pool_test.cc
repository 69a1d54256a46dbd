// PeerCallPool: calls run on at most `threads` threads, at most threads + queue_max are
// accepted at once (the rest refused and counted), and every accepted call runs, even when
// the pool is destroyed with calls still queued.
#include "cluster/peer_call_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

namespace kvtier::cluster {
namespace {

// A latch the test opens to let blocked tasks finish.
class Gate {
 public:
  void Wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

TEST(PeerCallPoolTest, RefusesPastThreadsPlusQueueAndRunsEveryAcceptedCall) {
  Gate gate;
  std::atomic<int> running{0}, peak{0}, done{0};
  auto task = [&] {
    int now = running.fetch_add(1) + 1;
    int p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
    gate.Wait();
    running.fetch_sub(1);
    done.fetch_add(1);
  };
  {
    PeerCallPool pool(PeerCallPoolOptions{.threads = 2, .queue_max = 3});
    int accepted = 0;
    for (int i = 0; i < 8; ++i) accepted += pool.TrySubmit(task) ? 1 : 0;
    EXPECT_EQ(accepted, 5);  // 2 running + 3 waiting
    EXPECT_EQ(pool.refused(), 3u);
    gate.Open();
  }  // the destructor runs what is still queued
  EXPECT_EQ(done.load(), 5);
  EXPECT_LE(peak.load(), 2);
}

TEST(PeerCallPoolTest, SlotsComeBackAsCallsFinish) {
  PeerCallPool pool(PeerCallPoolOptions{.threads = 1, .queue_max = 0});
  std::atomic<int> done{0};
  for (int i = 0; i < 50; ++i) {
    // One slot: wait until the previous call has finished before the next is accepted.
    while (!pool.TrySubmit([&] { done.fetch_add(1); })) std::this_thread::yield();
  }
  while (done.load() < 50) std::this_thread::yield();
  EXPECT_EQ(done.load(), 50);
  EXPECT_EQ(pool.queued(), 0u);
}

TEST(PeerCallPoolTest, ManySubmittersNeverExceedTheLimit) {
  Gate gate;
  std::atomic<int> done{0};
  std::atomic<int> accepted{0};
  {
    PeerCallPool pool(PeerCallPoolOptions{.threads = 3, .queue_max = 5});
    std::vector<std::thread> submitters;
    for (int t = 0; t < 4; ++t) {
      submitters.emplace_back([&] {
        for (int i = 0; i < 10; ++i) {
          if (pool.TrySubmit([&] {
                gate.Wait();
                done.fetch_add(1);
              })) {
            accepted.fetch_add(1);
          }
        }
      });
    }
    for (auto& s : submitters) s.join();
    EXPECT_EQ(accepted.load(), 8);
    EXPECT_EQ(pool.refused(), 32u);
    gate.Open();
  }
  EXPECT_EQ(done.load(), 8);
}

}  // namespace
}  // namespace kvtier::cluster
