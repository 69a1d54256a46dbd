// SSD tier commit delay (SsdOptions::commit_delay_us, durability kSync): a commit's leader
// waits for the sync writers it expects (the last commit's writers plus those that appended
// while it ran) so that writers it released, on their way back, share the next commit instead
// of forming a second group. The fault env's held fdatasync sets up the group sizes, so every
// test is deterministic: no assertion depends on how long anything took.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_tier.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

constexpr size_t kUnitBytes = 1024;
constexpr int kWriters = 4;
constexpr uint32_t kLongDelayUs = SsdOptions::kMaxCommitDelayUs;  // must end early

SsdOptions Options(const std::string& dir, DeviceEnv* env, uint32_t commit_delay_us) {
  SsdOptions o;
  o.dir = dir;
  o.env = env;
  o.capacity_bytes = 16ull << 20;
  o.segment_bytes = 4ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.durability = Durability::kSync;
  o.commit_delay_us = commit_delay_us;
  o.group_commit_ms = 3'600'000;  // no background commit pass in between
  o.compression = false;
  return o;
}

Status PutUnit(SsdTier* t, int i, uint64_t version, uint64_t* defer_ticket = nullptr) {
  Key k = MakeKey(i);
  SsdMeta meta;
  meta.version = version;
  return t->Put(k, MakeValue(k, version, kUnitBytes), meta, nullptr, nullptr, defer_ticket);
}

// Polls until pred() holds; false after 10 s (a hang, not a speed bound).
template <typename Pred>
bool Eventually(Pred pred) {
  for (int i = 0; i < 10000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return pred();
}

class CommitDelayTest : public ::testing::Test {
 protected:
  void Open(uint32_t commit_delay_us) {
    mem_ = NewMemEnv();
    fault_ = std::make_unique<FaultInjectionEnv>(mem_.get(), FaultOptions{});
    auto t = SsdTier::Open(Options(dir_.path(), fault_.get(), commit_delay_us));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tier_ = std::move(t).value();
  }

  // Leaves kWriters expected by the next leader: writer 0's commit is held at its fdatasync
  // while writers 1..kWriters-1 append (deferred: they have not waited yet). Returns the
  // ticket that covers those three, still uncommitted.
  uint64_t Prime() {
    fault_->PauseSyncs(true);
    std::thread first([&] { EXPECT_TRUE(PutUnit(tier_.get(), 0, 1).ok()); });
    EXPECT_TRUE(Eventually([&] { return fault_->syncs_waiting() == 1; }));
    uint64_t ticket = 0;
    for (int i = 1; i < kWriters; ++i) EXPECT_TRUE(PutUnit(tier_.get(), i, 1, &ticket).ok());
    fault_->PauseSyncs(false);
    first.join();
    SsdStats s = tier_->GetStats();
    EXPECT_EQ(s.commits, 1u);  // writer 0 alone: nothing was expected, no delay
    EXPECT_EQ(s.commit_writers, 1u);
    EXPECT_EQ(s.commit_delays, 0u);
    return ticket;
  }

  // One round: the leader commits writers 1..3 (WaitDurable of `ticket`) while writer 0,
  // released by the previous commit, comes back with its next put once the leader waits
  // (or, without a delay, once the leader is done). Returns the commits the round made.
  uint64_t Round(uint64_t ticket) {
    uint64_t commits0 = tier_->GetStats().commits;
    std::atomic<bool> leader_done{false};
    std::thread leader([&] {
      EXPECT_TRUE(tier_->WaitDurable(ticket).ok());
      leader_done = true;
    });
    EXPECT_TRUE(
        Eventually([&] { return leader_done.load() || tier_->GetStats().commit_delays == 1; }));
    EXPECT_TRUE(PutUnit(tier_.get(), 0, 2).ok());  // a sync put: it waits for its commit
    leader.join();
    return tier_->GetStats().commits - commits0;
  }

  TempDir dir_;
  std::unique_ptr<DeviceEnv> mem_;
  std::unique_ptr<FaultInjectionEnv> fault_;
  std::unique_ptr<SsdTier> tier_;
};

// Without the delay the writer on its way back misses the leader's commit: two commits where
// one would do (the alternating groups seen with 16 RESP clients).
TEST_F(CommitDelayTest, WithoutTheDelayAReturningWriterNeedsASecondCommit) {
  Open(0);
  uint64_t ticket = Prime();
  EXPECT_EQ(Round(ticket), 2u);
  SsdStats s = tier_->GetStats();
  EXPECT_EQ(s.commit_delays, 0u);
  EXPECT_EQ(s.commit_writers, static_cast<uint64_t>(kWriters + 1));
}

// With the delay the leader waits for the writer it expects and one commit covers all four;
// the wait ends when that writer joins (long before the 1 s bound: no timeout counted).
TEST_F(CommitDelayTest, TheLeaderWaitsForTheExpectedWritersAndEndsWhenAllHaveJoined) {
  Open(kLongDelayUs);
  uint64_t ticket = Prime();
  EXPECT_EQ(Round(ticket), 1u);
  SsdStats s = tier_->GetStats();
  EXPECT_EQ(s.commit_delays, 1u);
  EXPECT_EQ(s.commit_delay_timeouts, 0u);
  EXPECT_EQ(s.commit_writers, static_cast<uint64_t>(kWriters + 1));
  // Every unit is durable and exact after reopening.
  tier_.reset();
  auto r = SsdTier::Open(Options(dir_.path(), mem_.get(), 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (int i = 0; i < kWriters; ++i) {
    Key k = MakeKey(i);
    std::vector<uint8_t> out;
    ASSERT_TRUE((*r)->Get(k, &out).ok()) << i;
    EXPECT_EQ(out, MakeValue(k, i == 0 ? 2 : 1, kUnitBytes)) << i;
  }
}

// A leader whose expected writers do not come commits at the bound with those that did, and
// the next leader expects only as many as that commit saw.
TEST_F(CommitDelayTest, TheWaitIsBoundedWhenExpectedWritersDoNotCome) {
  Open(2000);
  uint64_t ticket = Prime();
  ASSERT_TRUE(tier_->WaitDurable(ticket).ok());  // writer 0 never comes back
  SsdStats s = tier_->GetStats();
  EXPECT_EQ(s.commits, 2u);
  EXPECT_EQ(s.commit_delays, 1u);
  EXPECT_EQ(s.commit_delay_timeouts, 1u);
  EXPECT_EQ(s.commit_writers, static_cast<uint64_t>(kWriters));
  // Three writers expected now; three come (one sync put after two deferred): no wait.
  uint64_t t2 = 0;
  ASSERT_TRUE(PutUnit(tier_.get(), 1, 2, &t2).ok());
  ASSERT_TRUE(PutUnit(tier_.get(), 2, 2, &t2).ok());
  ASSERT_TRUE(PutUnit(tier_.get(), 3, 2).ok());
  s = tier_->GetStats();
  EXPECT_EQ(s.commits, 3u);
  EXPECT_EQ(s.commit_delays, 1u);
}

// A lone sync writer never waits: each put commits at once, however long the delay allowed.
TEST_F(CommitDelayTest, ALoneWriterNeverWaits) {
  Open(kLongDelayUs);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(PutUnit(tier_.get(), i, 1).ok()) << i;
  SsdStats s = tier_->GetStats();
  EXPECT_EQ(s.commits, 10u);
  EXPECT_EQ(s.commit_delays, 0u);
}

}  // namespace
}  // namespace kvtier::storage
