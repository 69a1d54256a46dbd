// PeerClocks (cluster/peer_clocks.h): each member's last clock offset, members that left
// forgotten, silent ones not reported once stale, nodes older than CLOCK asked rarely; and
// PeerClient::Clock against a peer front whose clock runs ahead or behind.
#include "cluster/peer_clocks.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "cluster/peer_server.h"

namespace kvtier::cluster {
namespace {

// Members and answers the test sets; counts the asks per endpoint.
class Script {
 public:
  PeerClocks::MembersFn Members() {
    return [this] {
      std::lock_guard<std::mutex> lock(mu_);
      return members;
    };
  }
  PeerClocks::SampleFn Sample() {
    return [this](const std::string& endpoint) -> StatusOr<PeerClient::ClockSample> {
      std::lock_guard<std::mutex> lock(mu_);
      ++asked[endpoint];
      const auto it = answers.find(endpoint);
      if (it == answers.end()) return Status::Unavailable("no answer");
      return it->second;
    };
  }
  void Set(std::vector<PeerClocks::Peer> m,
           std::map<std::string, StatusOr<PeerClient::ClockSample>> a) {
    std::lock_guard<std::mutex> lock(mu_);
    members = std::move(m);
    answers = std::move(a);
  }
  int Asked(const std::string& endpoint) {
    std::lock_guard<std::mutex> lock(mu_);
    return asked[endpoint];
  }

 private:
  std::mutex mu_;
  std::vector<PeerClocks::Peer> members;
  std::map<std::string, StatusOr<PeerClient::ClockSample>> answers;
  std::map<std::string, int> asked;
};

PeerClient::ClockSample Offset(int64_t us, uint64_t rtt_us = 100) { return {us, rtt_us}; }

TEST(PeerClocksTest, EachMembersLastAnswerInNodeOrder) {
  Script s;
  ManualClock steady(1000000);
  PeerClocks clocks(PeerClockOptions{.interval_ms = 1000}, s.Members(), s.Sample(), &steady);
  s.Set({{"n2", "e2"}, {"n1", "e1"}, {"n3", "e3"}},
        {{"e1", Offset(-1500)}, {"e2", Offset(60000000, 250)}});
  clocks.SampleRound();
  auto r = clocks.Readings(64);
  ASSERT_EQ(r.size(), 2u) << "n3 never answered";
  EXPECT_EQ(r[0].node_id, "n1");
  EXPECT_EQ(r[0].offset_us, -1500);
  EXPECT_EQ(r[1].node_id, "n2");
  EXPECT_EQ(r[1].offset_us, 60000000);
  EXPECT_EQ(r[1].rtt_us, 250u);
  EXPECT_EQ(clocks.stats().samples, 2u);
  EXPECT_EQ(clocks.stats().failures, 1u);
  EXPECT_EQ(clocks.Readings(1).size(), 1u);

  // A later answer replaces the earlier one; a member that left is forgotten.
  s.Set({{"n2", "e2"}}, {{"e2", Offset(-7)}});
  steady.AdvanceMs(1000);
  clocks.SampleRound();
  r = clocks.Readings(64);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].node_id, "n2");
  EXPECT_EQ(r[0].offset_us, -7);
  EXPECT_EQ(r[0].age_ms, 0u);
}

// A member that stops answering keeps its last reading for kStaleIntervals intervals, then
// is not reported (an offset from long ago is no measurement); its answer brings it back.
TEST(PeerClocksTest, ASilentMembersReadingGoesStale) {
  Script s;
  ManualClock steady(1000000);
  PeerClocks clocks(PeerClockOptions{.interval_ms = 1000}, s.Members(), s.Sample(), &steady);
  s.Set({{"n1", "e1"}}, {{"e1", Offset(42)}});
  clocks.SampleRound();
  s.Set({{"n1", "e1"}}, {});
  for (uint64_t i = 1; i <= PeerClocks::kStaleIntervals; ++i) {
    steady.AdvanceMs(1000);
    clocks.SampleRound();
    auto r = clocks.Readings(64);
    ASSERT_EQ(r.size(), 1u) << "interval " << i;
    EXPECT_EQ(r[0].offset_us, 42);
    EXPECT_EQ(r[0].age_ms, i * 1000);
  }
  steady.AdvanceMs(1);
  EXPECT_TRUE(clocks.Readings(64).empty());
  EXPECT_EQ(clocks.stats().failures, PeerClocks::kStaleIntervals);
  s.Set({{"n1", "e1"}}, {{"e1", Offset(43)}});
  clocks.SampleRound();
  ASSERT_EQ(clocks.Readings(64).size(), 1u);
  EXPECT_EQ(clocks.Readings(64)[0].offset_us, 43);
}

// A node older than CLOCK answers InvalidArgument: it is asked again only after
// kUnsupportedRetryMs (its bad-frame counter would otherwise rise every interval), and reads
// as soon as it answers (upgraded).
TEST(PeerClocksTest, ANodeOlderThanClockIsAskedRarely) {
  Script s;
  ManualClock steady(1000000);
  PeerClocks clocks(PeerClockOptions{.interval_ms = 1000}, s.Members(), s.Sample(), &steady);
  s.Set({{"old", "eo"}, {"new", "en"}},
        {{"eo", Status::InvalidArgument("unknown peer opcode")}, {"en", Offset(5)}});
  clocks.SampleRound();
  for (int i = 0; i < 10; ++i) {
    steady.AdvanceMs(1000);
    clocks.SampleRound();
  }
  EXPECT_EQ(s.Asked("eo"), 1);
  EXPECT_EQ(s.Asked("en"), 11);
  EXPECT_EQ(clocks.stats().unsupported, 1u);
  ASSERT_EQ(clocks.Readings(64).size(), 1u);
  EXPECT_EQ(clocks.Readings(64)[0].node_id, "new");

  s.Set({{"old", "eo"}, {"new", "en"}}, {{"eo", Offset(-9)}, {"en", Offset(5)}});
  steady.AdvanceMs(PeerClocks::kUnsupportedRetryMs - 10000);
  clocks.SampleRound();
  EXPECT_EQ(s.Asked("eo"), 2) << "asked again after kUnsupportedRetryMs";
  ASSERT_EQ(clocks.Readings(64).size(), 2u);
  EXPECT_EQ(clocks.Readings(64)[1].node_id, "old");
  EXPECT_EQ(clocks.Readings(64)[1].offset_us, -9);
}

TEST(PeerClocksTest, AtMostPeersMaxAreAsked) {
  Script s;
  ManualClock steady(1000000);
  PeerClocks clocks(PeerClockOptions{.interval_ms = 1000, .peers_max = 2}, s.Members(), s.Sample(),
                    &steady);
  s.Set({{"c", "ec"}, {"a", "ea"}, {"b", "eb"}},
        {{"ea", Offset(1)}, {"eb", Offset(2)}, {"ec", Offset(3)}});
  clocks.SampleRound();
  EXPECT_EQ(s.Asked("ec"), 0);
  EXPECT_EQ(clocks.Readings(64).size(), 2u);
}

// The thread asks at once on Start, then every interval, and Stop ends it.
TEST(PeerClocksTest, TheThreadAsksAtStartAndStopsOnStop) {
  Script s;
  s.Set({{"n1", "e1"}}, {{"e1", Offset(3)}});
  PeerClocks clocks(PeerClockOptions{.interval_ms = 1000}, s.Members(), s.Sample());
  clocks.Start();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (s.Asked("e1") == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_GE(s.Asked("e1"), 1);
  clocks.Stop();
  const int asked = s.Asked("e1");
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  EXPECT_EQ(s.Asked("e1"), asked) << "a round after Stop";
  PeerClocks off(PeerClockOptions{.interval_ms = 0}, s.Members(), s.Sample());
  off.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(s.Asked("e1"), asked) << "interval 0 starts no thread";
}

// Stop during a round waits for the call in flight and asks no further member (a round over
// many silent peers would otherwise hold a node's shutdown for a timeout each).
TEST(PeerClocksTest, StopEndsARoundAfterTheCallInFlight) {
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, release = false;
  std::atomic<int> asked{0};
  PeerClocks clocks(
      PeerClockOptions{.interval_ms = 1000},
      [] {
        return std::vector<PeerClocks::Peer>{{"a", "ea"}, {"b", "eb"}, {"c", "ec"}};
      },
      [&](const std::string&) -> StatusOr<PeerClient::ClockSample> {
        ++asked;
        std::unique_lock<std::mutex> lock(mu);
        entered = true;
        cv.notify_all();
        cv.wait(lock, [&] { return release; });
        return Offset(1);
      });
  clocks.Start();
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return entered; }));
  }
  std::thread stopper([&] { clocks.Stop(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // Stop is waiting on the call
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  stopper.join();
  EXPECT_EQ(asked.load(), 1) << "members asked after Stop";
}

std::vector<uint8_t> Credential() { return std::vector<uint8_t>(32, 9); }

class NoStore final : public PeerHandler {
 public:
  std::vector<uint8_t> Lookup(std::span<const PeerKey> keys) override {
    return std::vector<uint8_t>(keys.size(), kPeerTierAbsent);
  }
  Status Get(const PeerKey&, std::vector<uint8_t>*) override { return Status::NotFound(""); }
  Status Put(const PeerPut&, bool*) override { return Status::Ok(); }
  StatusOr<std::vector<uint8_t>> Delete(std::span<const PeerKey> keys) override {
    return std::vector<uint8_t>(keys.size(), 0);
  }
  Status DeleteTenant(std::string_view) override { return Status::Ok(); }
};

class ShiftedClock final : public Clock {
 public:
  explicit ShiftedClock(int64_t shift_us) : shift_us_(shift_us) {}
  uint64_t NowUs() const override {
    return static_cast<uint64_t>(static_cast<int64_t>(DefaultSystemClock().NowUs()) + shift_us_);
  }

 private:
  int64_t shift_us_;
};

TEST(PeerWireTest, AClockReplyIsOneU64) {
  daemon::wire::Writer w;
  w.U64(1764979200123456u);
  auto t = DecodeClockReply(w.buffer());
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, 1764979200123456u);
  std::vector<uint8_t> body = w.buffer();
  body.pop_back();
  EXPECT_TRUE(DecodeClockReply(body).status().IsCorruption()) << "short";
  body.push_back(0);
  body.push_back(0);
  EXPECT_TRUE(DecodeClockReply(body).status().IsCorruption()) << "trailing bytes";
  EXPECT_TRUE(DecodeClockReply({}).status().IsCorruption()) << "empty";
  EXPECT_TRUE(IsPeerOp(static_cast<uint8_t>(PeerOp::kClock)));
}

// CLOCK against a real peer front whose clock runs 10 s ahead, then 10 s behind: the sample
// finds the shift within half its round trip (and the clocks' reading granularity).
TEST(PeerClientClockTest, ASampleFindsThePeersOffset) {
  NoStore handler;
  for (int64_t shift_us : {int64_t{10000000}, int64_t{-10000000}, int64_t{0}}) {
    ShiftedClock clock(shift_us);
    PeerServerOptions o;
    o.credential = Credential();
    o.unix_clock = &clock;
    auto server = PeerServer::Start(o, &handler);
    ASSERT_TRUE(server.ok()) << server.status().message();
    const std::string endpoint = "127.0.0.1:" + std::to_string((*server)->port());
    PeerClient c(PeerClientOptions{.node_id = "n1", .credential = Credential()});
    auto sample = c.Clock(endpoint);
    ASSERT_TRUE(sample.ok()) << sample.status().message();
    const int64_t slack_us = static_cast<int64_t>(sample->rtt_us / 2) + 1000;
    EXPECT_NEAR(static_cast<double>(sample->offset_us), static_cast<double>(shift_us),
                static_cast<double>(slack_us))
        << "rtt " << sample->rtt_us << " us";
    EXPECT_LT(sample->rtt_us, 2000000u);
    (*server)->Stop();
    EXPECT_FALSE(c.Clock(endpoint).ok()) << "a stopped peer answered";
  }
}

}  // namespace
}  // namespace kvtier::cluster
