// cluster/pause_guard: a node that did not run for a while answers its peers from its store
// again only after the hold and a tombstone catch-up that started after it. On a ManualClock,
// with the guard's steps called directly (no threads).
#include "cluster/pause_guard.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

namespace kvtier::cluster {
namespace {

class PauseGuardTest : public ::testing::Test {
 protected:
  PauseGuardOptions Options() const {
    return PauseGuardOptions{.tick_ms = 50, .pause_ms = 1000, .hold_ms = 4000, .retry_ms = 500};
  }
  // Advances the clock by ms in ticks of 50 ms (no pause), making due catch-ups on the way.
  void RunFor(PauseGuard* g, uint64_t ms) {
    for (uint64_t t = 0; t < ms; t += 50) {
      clock_.AdvanceMs(50);
      g->Tick();
      (void)g->CatchUpIfDue();
    }
  }
  ManualClock clock_{1'000'000'000};
  int catch_ups_ = 0;
  Status next_ = Status::Ok();
  std::function<void()> during_catch_up_;
  std::function<Status()> CatchUp() {
    return [this] {
      ++catch_ups_;
      if (during_catch_up_) during_catch_up_();
      return next_;
    };
  }
};

TEST_F(PauseGuardTest, TicksWithinPauseMsAreNoPause) {
  PauseGuard g(Options(), CatchUp(), &clock_);
  g.Tick();
  RunFor(&g, 3000);
  clock_.AdvanceMs(1000);  // exactly pause_ms: not more
  EXPECT_TRUE(g.Current());
  g.Tick();
  RunFor(&g, 5000);
  EXPECT_TRUE(g.Current());
  EXPECT_EQ(catch_ups_, 0);
  EXPECT_EQ(g.stats().pauses, 0u);
}

TEST_F(PauseGuardTest, APauseHoldsAnswersUntilACatchUpAfterTheHold) {
  PauseGuard g(Options(), CatchUp(), &clock_);
  g.Tick();
  clock_.AdvanceMs(1500);  // stopped: a peer's request is read before the tick thread runs
  EXPECT_FALSE(g.Current()) << "answered before the pause was noticed";
  g.Tick();
  EXPECT_FALSE(g.Current());
  EXPECT_EQ(g.stats().pauses, 1u);
  EXPECT_EQ(g.stats().last_pause_ms, 1500u);
  EXPECT_EQ(g.stats().held, 1u);
  RunFor(&g, 3950);  // the hold is not over: no catch-up yet
  EXPECT_EQ(catch_ups_, 0);
  EXPECT_FALSE(g.Current());
  RunFor(&g, 50);  // 4000 ms after the pause: the catch-up, and answers again
  EXPECT_EQ(catch_ups_, 1);
  EXPECT_TRUE(g.Current());
  EXPECT_EQ(g.stats().held, 0u);
  RunFor(&g, 2000);
  EXPECT_EQ(catch_ups_, 1) << "catch-ups without a pause";
}

TEST_F(PauseGuardTest, AFailedCatchUpKeepsTheHoldAndIsRetried) {
  PauseGuard g(Options(), CatchUp(), &clock_);
  g.Tick();
  clock_.AdvanceMs(2000);
  g.Tick();
  next_ = Status::Unavailable("etcd down");
  RunFor(&g, 4000);
  EXPECT_EQ(catch_ups_, 1);
  EXPECT_FALSE(g.Current());
  RunFor(&g, 450);  // retry_ms not over
  EXPECT_EQ(catch_ups_, 1);
  RunFor(&g, 1000);
  EXPECT_GE(catch_ups_, 2);
  EXPECT_FALSE(g.Current());
  next_ = Status::Ok();
  RunFor(&g, 500);
  EXPECT_TRUE(g.Current());
}

// A pause noticed while the catch-up runs (the catch-up read etcd before it): the hold stays,
// and the next catch-up after the new hold ends it.
TEST_F(PauseGuardTest, APauseDuringTheCatchUpKeepsTheHold) {
  PauseGuard g(Options(), CatchUp(), &clock_);
  g.Tick();
  clock_.AdvanceMs(1200);
  g.Tick();
  during_catch_up_ = [&] {
    during_catch_up_ = nullptr;
    clock_.AdvanceMs(1500);
    g.Tick();
  };
  RunFor(&g, 4000);
  EXPECT_EQ(catch_ups_, 1);
  EXPECT_FALSE(g.Current()) << "a catch-up older than a pause ended the hold";
  EXPECT_EQ(g.stats().pauses, 2u);
  RunFor(&g, 4000);
  EXPECT_EQ(catch_ups_, 2);
  EXPECT_TRUE(g.Current());
}

// The threads: a guard that runs is current, and Stop joins them.
TEST_F(PauseGuardTest, ItsThreadsTickAndStop) {
  PauseGuard g(PauseGuardOptions{.tick_ms = 5, .pause_ms = 1000, .hold_ms = 10, .retry_ms = 5},
               [] { return Status::Ok(); });
  g.Start();
  for (int i = 0; i < 20; ++i) {
    EXPECT_TRUE(g.Current());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  g.Stop();
  EXPECT_EQ(g.stats().pauses, 0u);
}

}  // namespace
}  // namespace kvtier::cluster
