// The SSD tier's warm restart: hits served while the index loads in the background, exact
// afterwards, and a TierManager that accounts and deletes tenants right after reopening.
// Part of kvtier_storage_test (tests/storage/CMakeLists.txt).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/ssd_tier.h"
#include "storage/tier_manager.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

// ------------------------------------------------------- warm restart ----

// A gate the background index load waits at (through on_index_load) until the test opens it.
class LoadGate {
 public:
  void Wait() {
    std::unique_lock lock(mu_);
    ++calls_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
  }
  void WaitForFirstCall() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return calls_ > 0; });
  }
  void Open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  ~LoadGate() { Open(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int calls_ = 0;
  bool open_ = false;
};

TEST(SsdWarmRestartTest, ServesHitsWhileTheIndexLoadsAndIsExactAfterwards) {
  constexpr int kUnits = 12000;  // three load batches of 4096
  TempDir dir;
  auto env = NewMemEnv();
  SsdOptions o;
  o.dir = dir.path();
  o.env = env.get();
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 4ull << 20;
  o.write_buffer_bytes = 256 << 10;
  o.group_commit_ms = 3'600'000;
  o.durability = Durability::kBatched;
  auto value_of = [](int i, uint64_t version) { return MakeValue(MakeKey(i), version, 200); };
  {
    auto ssd = SsdTier::Open(o);
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    SsdMeta m;
    for (int i = 0; i < kUnits; ++i) {
      m.version = i + 1;
      m.tenant = i % 2;
      ASSERT_TRUE((*ssd)->Put(MakeKey(i), value_of(i, 1), m, nullptr).ok());
    }
  }  // close commits

  // Reopen with the load held after its first batch.
  LoadGate gate;
  std::atomic<uint64_t> reported{0};
  o.durability = Durability::kSync;
  o.on_index_load = [&](std::span<const std::pair<Key, SsdMeta>> batch) {
    reported += batch.size();
    gate.Wait();
  };
  auto ssd = SsdTier::Open(o);
  struct OpenAtExit {  // a failing assertion must not leave the load (and the close) blocked
    LoadGate& gate;
    ~OpenAtExit() { gate.Open(); }
  } open_at_exit{gate};
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  gate.WaitForFirstCall();
  SsdStats s = (*ssd)->GetStats();
  EXPECT_FALSE(s.index_loaded);
  EXPECT_LT(s.objects, static_cast<uint64_t>(kUnits));  // not everything is in memory yet
  EXPECT_EQ((*ssd)->max_version(), static_cast<uint64_t>(kUnits));  // known without the load

  // Every unit is served now, with its bytes verified, loaded or not.
  std::vector<uint8_t> out;
  SsdMeta meta;
  for (int i = 0; i < kUnits; i += 7) {
    ASSERT_TRUE((*ssd)->Get(MakeKey(i), &out, &meta).ok()) << i;
    ASSERT_EQ(out, value_of(i, 1)) << i;
    EXPECT_EQ(meta.version, static_cast<uint64_t>(i + 1));
  }
  EXPECT_FALSE((*ssd)->Contains(MakeKey(kUnits + 5)));
  EXPECT_TRUE((*ssd)->Get(MakeKey(kUnits + 5), &out).IsNotFound());
  // Changes made while loading win over the snapshot the load reads: the last key is in the
  // last batch, so it is certainly not loaded yet.
  const int removed = kUnits - 1, replaced = kUnits - 2;
  ASSERT_TRUE((*ssd)->Remove(MakeKey(removed)).ok());
  SsdMeta m2;
  m2.version = kUnits + 1;
  ASSERT_TRUE((*ssd)->Put(MakeKey(replaced), value_of(replaced, 2), m2, nullptr).ok());
  EXPECT_FALSE((*ssd)->GetStats().index_loaded);

  gate.Open();
  (*ssd)->WaitForIndexLoad();
  s = (*ssd)->GetStats();
  EXPECT_TRUE(s.index_loaded);
  EXPECT_EQ(s.objects, static_cast<uint64_t>(kUnits - 1));
  EXPECT_EQ(s.dropped_on_recovery, 0u);
  EXPECT_FALSE((*ssd)->Contains(MakeKey(removed)));
  ASSERT_TRUE((*ssd)->Get(MakeKey(replaced), &out).ok());
  EXPECT_EQ(out, value_of(replaced, 2));
  // Units reported to on_index_load: every loaded one (point-read ones included), at most once.
  EXPECT_GE(reported.load(), static_cast<uint64_t>(kUnits - 2));
  EXPECT_LE(reported.load(), static_cast<uint64_t>(kUnits));
  uint64_t forEach = 0;
  (*ssd)->ForEach([&](const Key&, const SsdMeta&) { ++forEach; });
  EXPECT_EQ(forEach, static_cast<uint64_t>(kUnits - 1));
  // Live bytes are fully accounted once loaded: equal to a fresh open's count.
  uint64_t live = s.live_bytes;
  ssd->reset();
  o.on_index_load = nullptr;
  auto again = SsdTier::Open(o);
  ASSERT_TRUE(again.ok());
  (*again)->WaitForIndexLoad();
  EXPECT_EQ((*again)->GetStats().live_bytes, live);
  EXPECT_EQ((*again)->GetStats().objects, static_cast<uint64_t>(kUnits - 1));
  EXPECT_FALSE((*again)->Contains(MakeKey(removed)));  // the removal was durable (kSync)
  ASSERT_TRUE((*again)->Get(MakeKey(replaced), &out).ok());
  EXPECT_EQ(out, value_of(replaced, 2));
  EXPECT_EQ((*again)->max_version(), static_cast<uint64_t>(kUnits + 1));
}

TEST(SsdWarmRestartTest, TierManagerAccountsAndDeletesTenantsRightAfterReopen) {
  TempDir dir;
  auto env = NewMemEnv();
  TierManagerOptions o;
  o.dram_capacity_bytes = 0;
  o.ssd_capacity_bytes = 64ull << 20;
  o.ssd_segment_bytes = 4ull << 20;
  o.data_dir = dir.path();
  o.ssd_env = env.get();
  o.durability = Durability::kBatched;
  constexpr int kUnits = 10000;
  {
    auto tm = TierManager::Open(o);
    ASSERT_TRUE(tm.ok());
    PutOptions p;
    p.highest_tier = Tier::kSsd;
    for (int i = 0; i < kUnits; ++i) {
      p.tenant = 1 + i % 2;
      ASSERT_TRUE((*tm)->Put(MakeKey(i), MakeValue(MakeKey(i), 1, 100), p).ok());
    }
  }
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok());
  // Right after open (the load may still run): tenant 2 is deleted completely.
  ASSERT_TRUE((*tm)->DeleteTenant(2).ok());
  std::vector<uint8_t> out;
  for (int i = 0; i < kUnits; ++i) {
    Status st = (*tm)->Get(MakeKey(i), &out);
    if (i % 2 == 1) {
      ASSERT_TRUE(st.IsNotFound()) << i;
    } else {
      ASSERT_TRUE(st.ok()) << i;
      ASSERT_EQ(out, MakeValue(MakeKey(i), 1, 100));
    }
  }
  Stats s = (*tm)->GetStats();
  ASSERT_EQ(s.tenant_bytes.size(), 1u);
  EXPECT_EQ(s.tenant_bytes[0].first, 1u);
  EXPECT_EQ(s.tenant_bytes[0].second, static_cast<uint64_t>(kUnits / 2 * 100));
  EXPECT_EQ(s.ssd.objects, static_cast<uint64_t>(kUnits / 2));
}

}  // namespace
}  // namespace kvtier::storage
