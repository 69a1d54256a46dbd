// The SSD tier's warm restart: hits served while the index loads in the background, exact
// afterwards, and a TierManager that accounts and deletes tenants right after reopening.
// Part of kvtier_storage_test (tests/storage/CMakeLists.txt).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <string>
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
  ASSERT_TRUE((*ssd)->WaitForIndexLoad().ok());
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
  ASSERT_TRUE((*ssd)->ForEach([&](const Key&, const SsdMeta&) { ++forEach; }).ok());
  EXPECT_EQ(forEach, static_cast<uint64_t>(kUnits - 1));
  // Live bytes are fully accounted once loaded: equal to a fresh open's count.
  uint64_t live = s.live_bytes;
  ssd->reset();
  o.on_index_load = nullptr;
  auto again = SsdTier::Open(o);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE((*again)->WaitForIndexLoad().ok());
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

// Runs fn on a thread of its own and returns its result; when it has not returned within 10 s
// the test fails and the process ends (nothing could unblock the thread: a hang must fail the
// test, not stall the suite).
template <typename F>
auto WithinTenSeconds(const char* what, F fn) {
  auto task = std::make_shared<std::packaged_task<decltype(fn())()>>(std::move(fn));
  auto result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << what << " hung";
    std::fflush(stdout);
    std::_Exit(1);
  }
  return result.get();
}

// Corrupts the largest table file of the RocksDB index under `dir` (the index column family's)
// in its middle, where its data blocks lie: a scan of the index fails there (block checksum).
void CorruptIndexTable(const std::string& dir) {
  std::filesystem::path largest;
  uintmax_t largest_bytes = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir + "/index")) {
    if (f.path().extension() == ".sst" && f.file_size() > largest_bytes) {
      largest = f.path();
      largest_bytes = f.file_size();
    }
  }
  ASSERT_GT(largest_bytes, 64u << 10) << "no index table of several blocks";
  std::fstream file(largest, std::ios::in | std::ios::out | std::ios::binary);
  std::string bytes(512, '\0');
  file.seekg(static_cast<std::streamoff>(largest_bytes / 2));
  file.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  for (char& c : bytes) c = static_cast<char>(~c);
  file.seekp(static_cast<std::streamoff>(largest_bytes / 2));
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(file.good());
}

// A background index load that fails (a corrupt index table) ends in its error. Before, it
// only logged and returned: everything that waits for the load waited forever (a put that
// needs room, ForEach, WaitForIndexLoad, TierManager::DeleteTenant) and the tier never
// cleaned. Now the tier serves what it can (point reads), reports the failure in its stats,
// and the waiters get the error, which names the cause.
TEST(SsdWarmRestartTest, AFailedIndexLoadEndsInItsErrorInsteadOfHanging) {
  constexpr int kUnits = 3000;  // index entries over many 4 KiB table blocks
  TempDir dir;
  auto env = NewMemEnv();
  SsdOptions o;
  o.dir = dir.path();
  o.env = env.get();
  // 3 segments: after a restart the segment bytes on disk (1 MiB) exceed the live limit (768
  // KiB), so every put waits for the load (it could need room).
  o.capacity_bytes = 3ull << 20;
  o.segment_bytes = 1ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.group_commit_ms = 3'600'000;
  o.durability = Durability::kBatched;
  {
    auto ssd = SsdTier::Open(o);
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    SsdMeta m;
    m.tenant = 2;
    for (int i = 0; i < kUnits; ++i) {
      m.version = i + 1;
      ASSERT_TRUE((*ssd)->Put(MakeKey(i), MakeValue(MakeKey(i), 1, 60), m, nullptr).ok());
    }
  }  // close commits and flushes the index into a table
  CorruptIndexTable(dir.path());
  {
    std::atomic<uint64_t> reported{0};
    o.on_index_load = [&](std::span<const std::pair<Key, SsdMeta>> batch) {
      reported += batch.size();
    };
    auto ssd = SsdTier::Open(o);
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    SsdTier* t = ssd->get();
    Status loaded = WithinTenSeconds("WaitForIndexLoad", [t] { return t->WaitForIndexLoad(); });
    EXPECT_TRUE(loaded.IsCorruption()) << loaded.ToString();
    EXPECT_NE(loaded.message().find("ssd index load failed"), std::string::npos)
        << loaded.ToString();
    SsdStats s = t->GetStats();
    EXPECT_TRUE(s.index_load_failed);
    EXPECT_FALSE(s.index_loaded);
    Status put = WithinTenSeconds("a put that needs room", [t] {
      SsdMeta m;
      m.version = kUnits + 1;
      return t->Put(MakeKey(kUnits), MakeValue(MakeKey(kUnits), 1, 60), m, nullptr);
    });
    EXPECT_TRUE(put.IsCorruption()) << put.ToString();
    EXPECT_NE(put.message().find("ssd index load failed"), std::string::npos) << put.ToString();
    uint64_t visited = 0;
    Status each = WithinTenSeconds(
        "ForEach", [&] { return t->ForEach([&](const Key&, const SsdMeta&) { ++visited; }); });
    EXPECT_TRUE(each.IsCorruption()) << each.ToString();
    // What can be read is served (loaded, or by a point read); what lies in the corrupt
    // blocks is not.
    int served = 0;
    std::vector<uint8_t> out;
    for (int i = 0; i < kUnits; ++i) {
      if (t->Get(MakeKey(i), &out).ok()) {
        ++served;
        EXPECT_EQ(out, MakeValue(MakeKey(i), 1, 60)) << i;
      }
    }
    EXPECT_GE(served, kUnits / 2);
    EXPECT_LT(served, kUnits) << "the corruption should cost some entries";
    EXPECT_GE(visited, 1u);
    EXPECT_LT(visited, static_cast<uint64_t>(kUnits));
    // Units met by point reads after the failure are still reported (the load thread stays
    // for that until close).
    EXPECT_TRUE(WithinTenSeconds("the report of point reads", [&] {
      while (reported.load() < static_cast<uint64_t>(served)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return true;
    }));
  }  // closes (joins the load thread)
  // A TierManager over it: stats say so; a tenant delete fails instead of hanging.
  TierManagerOptions tmo;
  tmo.dram_capacity_bytes = 0;
  tmo.ssd_capacity_bytes = o.capacity_bytes;
  tmo.ssd_segment_bytes = o.segment_bytes;
  tmo.ssd_write_buffer_bytes = o.write_buffer_bytes;
  tmo.data_dir = dir.path();
  tmo.ssd_env = env.get();
  tmo.durability = Durability::kBatched;
  auto tm = TierManager::Open(tmo);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  TierManager* m = tm->get();
  std::vector<uint8_t> out;
  int readable = 0;  // before the refused DeleteTenant
  for (int i = 0; i < 100; ++i) readable += m->Get(MakeKey(i), &out).ok() ? 1 : 0;
  Status deleted = WithinTenSeconds("DeleteTenant", [m] { return m->DeleteTenant(2); });
  EXPECT_TRUE(deleted.IsCorruption()) << deleted.ToString();
  EXPECT_TRUE(m->GetStats().ssd_index_load_failed);
  int kept = 0;  // nothing deleted
  for (int i = 0; i < 100; ++i) kept += m->Get(MakeKey(i), &out).ok() ? 1 : 0;
  EXPECT_GE(kept, 50);
  EXPECT_EQ(kept, readable);
}

}  // namespace
}  // namespace kvtier::storage
