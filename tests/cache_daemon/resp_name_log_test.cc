// RespNameLog and RespKeyIndex::Persist: names written, removed and flushed by tenant come back
// after a reopen exactly; a torn or corrupt tail is cut off; the limits apply at replay; the
// log is compacted; concurrent Adds share syncs and all come back; Service logs a RESP name
// before the put that it names.
#include "cache_daemon/resp_name_log.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "cache_daemon/resp_key_index.h"
#include "cache_daemon/service.h"
#include "common/temp_dir.h"
#include "tests/cache_daemon/fake_tier_manager.h"

namespace kvtier::daemon {
namespace {

storage::Key K(uint64_t i) {
  storage::Key k{};
  for (int b = 0; b < 8; ++b) k[b] = static_cast<uint8_t>(i >> (8 * b));
  k[31] = 0x5A;
  return k;
}

// All (tenant, name) pairs the index holds.
std::set<std::pair<uint64_t, std::string>> Names(const RespKeyIndex& idx,
                                                 std::initializer_list<uint64_t> tenants) {
  std::set<std::pair<uint64_t, std::string>> out;
  for (uint64_t t : tenants) {
    std::vector<RespKeyIndex::Entry> entries;
    uint64_t cursor = 0;
    do {
      cursor = idx.Scan(t, cursor, 100, &entries);
      for (auto& e : entries) out.emplace(t, e.name);
    } while (cursor != 0);
  }
  return out;
}

class RespNameLogTest : public ::testing::Test {
 protected:
  std::string Path() const { return dir_.path() + "/resp-names.log"; }
  std::unique_ptr<RespKeyIndex> Open(uint64_t bytes_max = 1 << 30, bool sync = true) {
    auto idx = std::make_unique<RespKeyIndex>(1 << 20, bytes_max);
    Status st = idx->Persist(Path(), sync);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return idx;
  }
  TempDir dir_{"resp_name_log"};
};

TEST_F(RespNameLogTest, AddsRemovesAndTenantFlushesComeBackAfterReopen) {
  {
    auto idx = Open();
    for (uint64_t i = 0; i < 50; ++i) ASSERT_TRUE(idx->Add(1, K(i), "a" + std::to_string(i)).ok());
    for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(idx->Add(2, K(i), "b" + std::to_string(i)).ok());
    for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(idx->Add(3, K(i), "c" + std::to_string(i)).ok());
    for (uint64_t i = 0; i < 10; ++i) idx->Remove(1, K(i));
    idx->RemoveTenant(2);
    ASSERT_TRUE(idx->Add(2, K(9), "b-again").ok());
    // No Flush: a process that dies keeps what was written (page cache).
  }
  auto idx = Open();
  std::set<std::pair<uint64_t, std::string>> want;
  for (uint64_t i = 10; i < 50; ++i) want.emplace(1, "a" + std::to_string(i));
  want.emplace(2, "b-again");
  for (uint64_t i = 0; i < 3; ++i) want.emplace(3, "c" + std::to_string(i));
  EXPECT_EQ(Names(*idx, {1, 2, 3}), want);
  EXPECT_EQ(idx->log_errors(), 0u);
}

TEST_F(RespNameLogTest, TornTailIsCutOffAndAppendsContinue) {
  {
    auto idx = Open();
    for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(idx->Add(1, K(i), "n" + std::to_string(i)).ok());
  }
  uint64_t whole = std::filesystem::file_size(Path());
  // Half of the last record, as a crash in the middle of its write leaves it.
  std::filesystem::resize_file(Path(), whole - 20);
  {
    auto idx = Open();
    EXPECT_EQ(Names(*idx, {1}),
              (std::set<std::pair<uint64_t, std::string>>{{1, "n0"}, {1, "n1"}, {1, "n2"}}));
    ASSERT_TRUE(idx->Add(1, K(7), "n7").ok());
  }
  auto idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{
                                  {1, "n0"}, {1, "n1"}, {1, "n2"}, {1, "n7"}}));
}

TEST_F(RespNameLogTest, FlippedByteEndsTheReplayThere) {
  {
    auto idx = Open();
    ASSERT_TRUE(idx->Add(1, K(1), "first").ok());
    ASSERT_TRUE(idx->Add(1, K(2), "second").ok());
  }
  // Flip a byte of the second record's name: its checksum fails, the first stays.
  uint64_t size = std::filesystem::file_size(Path());
  std::fstream f(Path(), std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(size - 8 - 3));
  f.put('X');
  f.close();
  auto idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{{1, "first"}}));
}

TEST_F(RespNameLogTest, ForeignFileIsRefused) {
  std::ofstream(Path()) << "this is not a name log at all";
  RespKeyIndex idx(100, 1 << 20);
  Status st = idx.Persist(Path(), true);
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
}

TEST_F(RespNameLogTest, ReplayKeepsTheLimitsAndCountsTheRest) {
  {
    auto idx = Open();
    for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(idx->Add(1, K(i), "name").ok());
  }
  auto idx = Open(4 * (4 + RespKeyIndex::kEntryOverheadBytes));
  EXPECT_EQ(idx->size(1), 4u);
  EXPECT_EQ(idx->unindexed(), 6u);
}

TEST_F(RespNameLogTest, ChurnIsCompactedSoTheFileStaysBounded) {
  auto idx = Open(1 << 30, /*sync=*/false);
  std::string name(200, 'x');
  // 40000 adds and removes of 10 live names: about 10 MiB of records without compaction.
  for (uint64_t i = 0; i < 20000; ++i) {
    ASSERT_TRUE(idx->Add(1, K(i % 10), name).ok());
    idx->Remove(1, K(i % 10));
  }
  ASSERT_TRUE(idx->Add(1, K(3), name).ok());
  EXPECT_LE(std::filesystem::file_size(Path()), RespKeyIndex::kLogCompactBytesMin + 4096);
  ASSERT_TRUE(idx->Flush().ok());
  idx.reset();
  idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{{1, name}}));
}

TEST_F(RespNameLogTest, ConcurrentAddsAllComeBack) {
  constexpr int kThreads = 4, kPerThread = 200;
  {
    auto idx = Open();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i) {
          uint64_t n = static_cast<uint64_t>(t * kPerThread + i);
          EXPECT_TRUE(idx->Add(1, K(n), "k" + std::to_string(n)).ok());
          if (i % 3 == 0) idx->Remove(1, K(n));
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  auto idx = Open();
  std::set<std::pair<uint64_t, std::string>> want;
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    if ((n % kPerThread) % 3 != 0) want.emplace(1, "k" + std::to_string(n));
  }
  EXPECT_EQ(Names(*idx, {1}), want);
}

// Service::RespSet: the name is in the log file before the store sees the put (so a unit is
// never durable before its name). Every call but Put goes to a FakeTierManager.
class LogCheckingStore final : public storage::TierManager {
 public:
  explicit LogCheckingStore(std::string path) : path_(std::move(path)) {}
  Status Put(const storage::Key& key, std::span<const uint8_t> value,
             const storage::PutOptions& o) override {
    std::ifstream f(path_, std::ios::binary);
    std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (log.find(next_name) == std::string::npos) ++puts_before_name;
    return fake.Put(key, value, o);
  }
  Status Get(const storage::Key& k, std::vector<uint8_t>* out, storage::Tier* from) override {
    return fake.Get(k, out, from);
  }
  storage::LookupResult Lookup(std::span<const storage::Key> chain) override {
    return fake.Lookup(chain);
  }
  Status Prefetch(std::span<const storage::Key> k) override { return fake.Prefetch(k); }
  Status Pin(std::span<const storage::Key> k, uint64_t ms) override { return fake.Pin(k, ms); }
  Status Unpin(std::span<const storage::Key> k) override { return fake.Unpin(k); }
  Status Delete(const storage::Key& k) override { return fake.Delete(k); }
  Status DeleteTenant(storage::TenantId t) override { return fake.DeleteTenant(t); }
  void SetTenantQuota(storage::TenantId t, uint64_t q) override { fake.SetTenantQuota(t, q); }
  Status SetPolicy(const std::string& e, const std::string& a,
                   const policies::PolicyParams& p) override {
    return fake.SetPolicy(e, a, p);
  }
  storage::Stats GetStats() const override { return fake.GetStats(); }
  Status Flush() override { return fake.Flush(); }

  testing::FakeTierManager fake;
  std::string next_name;
  int puts_before_name = 0;

 private:
  std::string path_;
};

TEST_F(RespNameLogTest, ServiceLogsTheNameBeforeThePut) {
  LogCheckingStore store(Path());
  DaemonMetrics metrics;
  auto tenants = TenantRegistry::Open(std::vector<uint8_t>(32, 7), 1024);
  Service svc(&store, tenants.get(), &metrics, nullptr, PolicySettings{});
  ASSERT_TRUE(svc.PersistRespNames(Path(), true, 0).ok());
  const Tenant& t = *tenants->default_tenant();
  for (int i = 0; i < 20; ++i) {
    store.next_name = "resp-key-" + std::to_string(i) + "-end";
    ASSERT_TRUE(svc.RespSet(t, store.next_name, "v", 0).ok());
  }
  EXPECT_EQ(store.puts_before_name, 0);
  EXPECT_EQ(svc.RespDbSize(t), 20u);
}

}  // namespace
}  // namespace kvtier::daemon
