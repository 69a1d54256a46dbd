// PeerHealth (cluster/peer_health.h): a peer whose call timed out is suspect, calls to it
// fail at once until a probe or a call in flight gets an answer; and PeerClient's use of it
// against a listener that never answers.
#include "cluster/peer_health.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "cluster/peer_client.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::cluster {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// Polls cond every 2 ms for up to 10 s (generous: a loaded 2-core machine).
template <typename Cond>
bool Eventually(Cond cond) {
  const auto until = steady_clock::now() + std::chrono::seconds(10);
  while (steady_clock::now() < until) {
    if (cond()) return true;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return cond();
}

// A probe whose answer the test sets, and that can be held mid-probe.
class ScriptedProbe {
 public:
  PeerHealth::Probe Fn() {
    return [this](const std::string& endpoint) {
      std::unique_lock lock(mu_);
      ++probes_;
      last_ = endpoint;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !hold_; });
      return answer_;
    };
  }
  void Answer(bool a) {
    std::lock_guard lock(mu_);
    answer_ = a;
  }
  void Hold(bool h) {
    {
      std::lock_guard lock(mu_);
      hold_ = h;
    }
    cv_.notify_all();
  }
  int probes() {
    std::lock_guard lock(mu_);
    return probes_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool answer_ = false;
  bool hold_ = false;
  int probes_ = 0;
  std::string last_;
};

TEST(PeerHealthTest, ATimeoutFailsLaterCallsFastUntilAProbeIsAnswered) {
  ScriptedProbe probe;
  PeerHealth health(PeerHealthOptions{.probe_interval_ms = 10}, probe.Fn());
  EXPECT_TRUE(health.Admit("a:1"));
  health.TimedOut("a:1");
  uint64_t for_ms = 12345;
  EXPECT_FALSE(health.Admit("a:1", &for_ms));
  EXPECT_LT(for_ms, 12345u);
  EXPECT_TRUE(health.Admit("b:1"));  // only the endpoint that timed out
  ASSERT_TRUE(Eventually([&] { return probe.probes() >= 3; }));
  EXPECT_FALSE(health.Admit("a:1"));  // unanswered probes keep it suspect
  probe.Answer(true);
  ASSERT_TRUE(Eventually([&] { return health.stats().suspects == 0; }));
  EXPECT_TRUE(health.Admit("a:1"));
  const PeerHealthStats s = health.stats();
  EXPECT_EQ(s.suspicions, 1u);
  EXPECT_EQ(s.failed_fast, 2u);
  EXPECT_EQ(s.recoveries, 1u);
  EXPECT_GE(s.probes_failed, 2u);
  EXPECT_EQ(s.probes, s.probes_failed + 1);
}

TEST(PeerHealthTest, AnAnswerToACallInFlightClearsTheSuspicionWhileAProbeWaits) {
  ScriptedProbe probe;
  probe.Hold(true);
  PeerHealth health(PeerHealthOptions{.probe_interval_ms = 10}, probe.Fn());
  health.TimedOut("a:1");
  ASSERT_TRUE(Eventually([&] { return probe.probes() == 1; }));  // held in its probe
  EXPECT_FALSE(health.Admit("a:1"));
  health.Answered("a:1");
  EXPECT_TRUE(health.Admit("a:1"));  // at once, not after the probe's deadline
  // A new timeout starts a new suspicion even though the old prober is still in its probe.
  health.TimedOut("a:1");
  EXPECT_FALSE(health.Admit("a:1"));
  probe.Answer(true);
  probe.Hold(false);
  ASSERT_TRUE(Eventually([&] { return health.stats().suspects == 0; }));
  const PeerHealthStats s = health.stats();
  EXPECT_EQ(s.suspicions, 2u);
  EXPECT_EQ(s.recoveries, 2u);  // the answer, then the second suspicion's probe
}

TEST(PeerHealthTest, ASuspectNobodyAsksForIsForgottenAndItsProbesStop) {
  ScriptedProbe probe;
  PeerHealth health(PeerHealthOptions{.probe_interval_ms = 5, .forget_after_ms = 60}, probe.Fn());
  health.TimedOut("gone:1");
  ASSERT_TRUE(Eventually([&] { return health.stats().forgotten == 1; }));
  EXPECT_EQ(health.stats().suspects, 0u);
  EXPECT_TRUE(health.Admit("gone:1"));  // the next call is made
  const int probes = probe.probes();
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(probe.probes(), probes);  // no prober left
  EXPECT_EQ(health.stats().recoveries, 0u);
}

TEST(PeerHealthTest, CallsKeepASuspectRemembered) {
  ScriptedProbe probe;
  PeerHealth health(PeerHealthOptions{.probe_interval_ms = 5, .forget_after_ms = 500}, probe.Fn());
  health.TimedOut("a:1");
  const auto until = steady_clock::now() + milliseconds(1000);
  while (steady_clock::now() < until) {
    EXPECT_FALSE(health.Admit("a:1"));
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(health.stats().forgotten, 0u);
  EXPECT_EQ(health.stats().suspects, 1u);
}

TEST(PeerHealthTest, SuspectsAreBoundedAndOffMeansNoSuspicion) {
  ScriptedProbe probe;
  {
    PeerHealth health(PeerHealthOptions{.probe_interval_ms = 1000, .endpoints_max = 2}, probe.Fn());
    health.TimedOut("a:1");
    health.TimedOut("b:1");
    health.TimedOut("c:1");
    EXPECT_FALSE(health.Admit("a:1"));
    EXPECT_FALSE(health.Admit("b:1"));
    EXPECT_TRUE(health.Admit("c:1"));
    EXPECT_EQ(health.stats().not_suspected, 1u);
    EXPECT_EQ(health.stats().suspects, 2u);
    auto listed = health.Suspects(8);  // in endpoint order, with their ages
    ASSERT_EQ(listed.size(), 2u);
    EXPECT_EQ(listed[0].first, "a:1");
    EXPECT_EQ(listed[1].first, "b:1");
    EXPECT_LT(listed[0].second, 10000u);
    ASSERT_EQ(health.Suspects(1).size(), 1u);
    EXPECT_EQ(health.Suspects(1)[0].first, "a:1");
  }  // joins its probers, which wait out their interval no longer
  PeerHealth off(PeerHealthOptions{.probe_interval_ms = 0}, probe.Fn());
  off.TimedOut("a:1");
  EXPECT_TRUE(off.Admit("a:1"));
  EXPECT_EQ(off.stats().suspicions, 0u);
}

TEST(PeerHealthTest, DestroyingWaitsForAProbeInFlight) {
  ScriptedProbe probe;
  probe.Hold(true);
  std::thread release;
  {
    PeerHealth health(PeerHealthOptions{.probe_interval_ms = 1}, probe.Fn());
    health.TimedOut("a:1");
    ASSERT_TRUE(Eventually([&] { return probe.probes() == 1; }));
    release = std::thread([&] {
      std::this_thread::sleep_for(milliseconds(50));
      probe.Hold(false);
    });
  }  // returns once the held probe ended
  release.join();
  EXPECT_EQ(probe.probes(), 1);
}

// PeerClient against a listener that never accepts (a stopped process: the kernel completes
// connections, nobody answers): the first call waits its timeout, the next fails at once;
// when the port refuses (the process is gone), the probe hears it and calls are made again.
TEST(PeerClientHealthTest, ASilentPeerCostsOneTimeoutNotOnePerCall) {
  const uint16_t port = testing::FreePort();
  const int silent = testing::ListenTcp(port);
  ASSERT_GE(silent, 0);
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  PeerClient client(PeerClientOptions{.node_id = "n1",
                                      .credential = std::vector<uint8_t>(40, 'c'),
                                      .timeout_ms = 300,
                                      .probe_interval_ms = 20});
  const PeerKey key{};
  auto t0 = steady_clock::now();
  Status first = client.DropCopies(endpoint, std::span<const PeerKey>(&key, 1));
  EXPECT_TRUE(first.IsUnavailable()) << first.ToString();
  // Waited its deadline (which the client sets in whole milliseconds: up to 1 ms early).
  EXPECT_GE(steady_clock::now() - t0, milliseconds(299));
  for (int i = 0; i < 5; ++i) {
    Status again = client.DropCopies(endpoint, std::span<const PeerKey>(&key, 1));
    EXPECT_TRUE(again.IsUnavailable());
    EXPECT_NE(again.message().find("not answering"), std::string::npos) << again.ToString();
  }
  PeerHealthStats s = client.health_stats();
  EXPECT_EQ(s.suspicions, 1u);
  EXPECT_EQ(s.failed_fast, 5u);
  ::close(silent);  // now refused: an answer
  ASSERT_TRUE(Eventually([&] { return client.health_stats().suspects == 0; }));
  Status made = client.DropCopies(endpoint, std::span<const PeerKey>(&key, 1));
  EXPECT_TRUE(made.IsUnavailable());
  EXPECT_EQ(made.message().find("not answering"), std::string::npos) << made.ToString();
  s = client.health_stats();
  EXPECT_EQ(s.failed_fast, 5u);
  EXPECT_EQ(s.recoveries, 1u);
  EXPECT_EQ(s.suspicions, 1u);  // a refusal is an answer, not a timeout
}

}  // namespace
}  // namespace kvtier::cluster
