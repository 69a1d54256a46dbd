// Concurrency: 8 threads of mixed put / get / lookup / delete / prefetch (promote) / pin over a
// small DRAM tier and an SSD tier, every value self-checking (it encodes its key and version).
// Any read must return either NotFound or exactly a value some thread wrote for that key.
// Run it under ThreadSanitizer too (-DKVTIER_SANITIZE=thread).
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "storage/block_device.h"
#include "storage/tier_manager.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::CheckValue;
using testing::MakeKey;
using testing::MakeValue;

// The tiers of these tests: 1 MiB of DRAM over a 16 MiB SSD tier of 1 MiB segments in `env`.
TierManagerOptions SmallTiers(DeviceEnv* env, const std::string& dir, Durability d) {
  TierManagerOptions o;
  o.dram_capacity_bytes = 1ull << 20;
  o.slab_page_bytes = 64 << 10;
  o.ssd_capacity_bytes = 16ull << 20;
  o.ssd_segment_bytes = 1ull << 20;
  o.ssd_write_buffer_bytes = 128 << 10;
  o.data_dir = dir;
  o.ssd_env = env;
  o.durability = d;
  return o;
}

void RunMixed(DeviceEnv* env, const std::string& dir, int ops_per_thread, Durability d) {
  TierManagerOptions o = SmallTiers(env, dir, d);
  o.group_commit_ms = 2;
  auto opened = TierManager::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TierManager* tm = opened->get();

  constexpr int kThreads = 8, kKeys = 256;
  std::atomic<uint64_t> next_version{1};
  std::atomic<uint64_t> bad{0}, hits{0}, puts{0};
  auto worker = [&](int id) {
    std::mt19937_64 rng(1000 + id);
    std::vector<uint8_t> out;
    for (int n = 0; n < ops_per_thread; ++n) {
      int i = static_cast<int>(rng() % kKeys);
      Key k = MakeKey(i, 7);
      switch (rng() % 10) {
        case 0:
        case 1:
        case 2: {
          uint64_t v = next_version.fetch_add(1);
          if (tm->Put(k, MakeValue(k, v, 3000 + rng() % 30000), {}).ok()) puts.fetch_add(1);
          break;
        }
        case 3:
        case 4:
        case 5: {
          Status st = tm->Get(k, &out);
          uint64_t v = 0;
          if (st.ok()) {
            hits.fetch_add(1);
            if (!CheckValue(k, out, &v) || v >= next_version.load()) bad.fetch_add(1);
          } else if (!st.IsNotFound()) {
            bad.fetch_add(1);
          }
          break;
        }
        case 6: {
          Key chain[4];
          for (int j = 0; j < 4; ++j) chain[j] = MakeKey((i + j) % kKeys, 7);
          LookupResult r = tm->Lookup(chain);
          if (r.hit_count > 4 || r.tiers.size() != r.hit_count) bad.fetch_add(1);
          break;
        }
        case 7: {
          Status st = tm->Delete(k);
          if (!st.ok() && !st.IsNotFound()) bad.fetch_add(1);
          break;
        }
        case 8: {
          Key keys[2] = {k, MakeKey((i + 1) % kKeys, 7)};
          if (!tm->Prefetch(keys).ok()) bad.fetch_add(1);
          break;
        }
        default: {
          Key keys[1] = {k};
          if (tm->Pin(keys, 5).ok() && rng() % 2 == 0) (void)tm->Unpin(keys);
          (void)tm->GetStats();
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(hits.load(), 0u);
  EXPECT_GT(puts.load(), 0u);
  Stats s = tm->GetStats();
  EXPECT_EQ(s.checksum_failures, 0u);
  EXPECT_GT(s.dram.evictions + s.ssd.objects, 0u);
  // After the storm every present unit is still exactly one written version.
  std::vector<uint8_t> out;
  for (int i = 0; i < kKeys; ++i) {
    Key k = MakeKey(i, 7);
    if (tm->Get(k, &out).ok()) {
      uint64_t v = 0;
      EXPECT_TRUE(CheckValue(k, out, &v)) << i;
    }
  }
}

TEST(ConcurrencyTest, MixedOpsOverDramAndSsdMemoryEnv) {
  testing::TempDir dir;
  auto env = NewMemEnv();
  RunMixed(env.get(), dir.path(), 1500, Durability::kBatched);
}

TEST(ConcurrencyTest, MixedOpsOverDramAndSsdIoUring) {
  testing::TempDir dir;
  RunMixed(nullptr, dir.path(), 800, Durability::kBatched);
}

// second-hit admission counts every client read and every lookup past its first miss on the
// reader's thread, without the store's mutation lock, while demotions ask the same policy to
// admit (under that lock) and policy sets replace it (carrying its counts over). Readers
// (Get, GetWithTtl, GetBatch, GetBatchVisit, Lookup), writers whose puts demote through the
// policy, and a thread cycling the admission policy (second-hit with small tables, so ids are
// forgotten all the time; admit-all, which counts nothing) run together: every read is a value
// some thread wrote, and demotions are admitted. Run it under ThreadSanitizer too.
TEST(ConcurrencyTest, SecondHitCountsWhileDemotionsAdmitAndPoliciesSwitch) {
  testing::TempDir dir;
  auto env = NewMemEnv();
  // Durability none: demotions go through the admission policy.
  TierManagerOptions o = SmallTiers(env.get(), dir.path(), Durability::kNone);
  o.admission_policy = "second-hit";
  o.policy_params.values = {{"second-hit:max_tracked", "64"}};
  auto opened = TierManager::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TierManager* tm = opened->get();

  constexpr int kReaders = 4, kWriters = 2, kOps = 1500, kKeys = 256;
  std::atomic<uint64_t> next_version{1};
  std::atomic<uint64_t> bad{0}, hits{0};
  std::atomic<bool> done{false};
  auto check = [&](const Key& k, const Status& st, std::span<const uint8_t> value) {
    if (st.ok()) {
      hits.fetch_add(1);
      uint64_t v = 0;
      if (!CheckValue(k, std::vector<uint8_t>(value.begin(), value.end()), &v) ||
          v >= next_version.load()) {
        bad.fetch_add(1);
      }
    } else if (!st.IsNotFound()) {
      bad.fetch_add(1);
    }
  };
  for (int i = 0; i < kKeys; ++i) {  // every key has a value before the storm
    const Key k = MakeKey(i, 9);
    ASSERT_TRUE(tm->Put(k, MakeValue(k, next_version.fetch_add(1), 3000), {}).ok());
  }
  std::atomic<int> writing{kWriters};
  auto reader = [&](int id) {
    std::mt19937_64 rng(2000 + id);
    std::vector<uint8_t> out;
    for (int n = 0; n < kOps || writing.load() > 0; ++n) {  // as long as the writers write
      const int i = static_cast<int>(rng() % kKeys);
      const Key k = MakeKey(i, 9);
      Key keys[4];
      for (int j = 0; j < 4; ++j) keys[j] = MakeKey((i + j) % kKeys, 9);
      switch (rng() % 5) {
        case 0: {
          const Status st = tm->Get(k, &out);
          check(k, st, out);
          break;
        }
        case 1: {
          uint64_t ttl_left_ms = 0;
          const Status st = tm->GetWithTtl(k, &out, &ttl_left_ms);
          check(k, st, out);
          break;
        }
        case 2: {
          std::vector<std::vector<uint8_t>> outs;
          std::vector<Status> results;
          tm->GetBatch(keys, &outs, nullptr, &results);
          for (int j = 0; j < 4; ++j) check(keys[j], results[j], outs[j]);
          break;
        }
        case 3:
          tm->GetBatchVisit(keys, [&](size_t j, const Status& st, Tier, auto value) {
            check(keys[j], st, value);
          });
          break;
        default: {
          LookupResult r = tm->Lookup(keys);
          if (r.hit_count > 4 || r.tiers.size() != r.hit_count) bad.fetch_add(1);
        }
      }
    }
  };
  auto writer = [&](int id) {
    std::mt19937_64 rng(3000 + id);
    for (int n = 0; n < kOps; ++n) {
      const Key k = MakeKey(static_cast<int>(rng() % kKeys), 9);
      const uint64_t v = next_version.fetch_add(1);
      if (!tm->Put(k, MakeValue(k, v, 3000 + rng() % 30000), {}).ok()) bad.fetch_add(1);
    }
    writing.fetch_sub(1);
  };
  std::thread switcher([&] {
    int n = 0;
    while (!done.load()) {
      policies::PolicyParams params;
      std::string admission = "second-hit";
      switch (n++ % 3) {
        case 0:
          params.values = {{"second-hit:max_tracked", "128"}, {"second-hit:hits_required", "3"}};
          break;
        case 1:
          admission = "admit-all";
          break;
        default:
          params.values = {{"second-hit:max_tracked", "64"}};
      }
      if (!tm->SetPolicy("lru", admission, params).ok()) bad.fetch_add(1);
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kReaders; ++t) threads.emplace_back(reader, t);
  for (int t = 0; t < kWriters; ++t) threads.emplace_back(writer, t);
  for (auto& t : threads) t.join();
  done.store(true);
  switcher.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(hits.load(), 0u);
  const Stats s = tm->GetStats();
  EXPECT_GT(s.admissions, 0u);
  EXPECT_GT(s.admission_rejections, 0u);
}

// A quota that its tenant's expired units fill is reclaimed by the puts it would refuse
// (SetTenantQuota), while puts of the same keys run their SSD step outside the lock (batched:
// every put is written through), reads expire units of their own, deletes remove some, and the
// clock moves. Every call returns what its contract allows, and afterwards, with every TTL
// passed, one put of the whole quota fits: nothing expired still counts, and nothing was
// subtracted twice (the tenant then holds exactly that put). Run it under ThreadSanitizer too.
TEST(ConcurrencyTest, QuotaReclaimWhilePutsReadsAndDeletesRun) {
  testing::TempDir dir;
  auto env = NewMemEnv();
  ManualClock clock(1'000'000);
  TierManagerOptions o = SmallTiers(env.get(), dir.path(), Durability::kBatched);
  o.dram_capacity_bytes = 4ull << 20;
  o.group_commit_ms = 2;
  o.clock = &clock;
  auto opened = TierManager::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TierManager* tm = opened->get();
  constexpr uint64_t kQuota = 200000;
  constexpr int kThreads = 4, kOps = 1500, kKeys = 128;
  tm->SetTenantQuota(1, kQuota);

  std::atomic<uint64_t> next_version{1};
  std::atomic<uint64_t> bad{0}, puts{0}, refused{0};
  auto worker = [&](int id) {
    std::mt19937_64 rng(4000 + id);
    std::vector<uint8_t> out;
    PutOptions p;
    p.tenant = 1;
    for (int n = 0; n < kOps; ++n) {
      const Key k = MakeKey(static_cast<int>(rng() % kKeys), 11);
      switch (rng() % 8) {
        case 0:
        case 1:
        case 2: {
          p.ttl_ms = 1 + rng() % 20;
          const Status st =
              tm->Put(k, MakeValue(k, next_version.fetch_add(1), 2000 + rng() % 8000), p);
          if (st.ok()) {
            puts.fetch_add(1);
          } else if (st.IsRejected()) {
            refused.fetch_add(1);
          } else {
            bad.fetch_add(1);
          }
          break;
        }
        case 3:
        case 4: {
          const Status st = tm->Get(k, &out);
          uint64_t v = 0;
          if (st.ok() ? !CheckValue(k, out, &v) : !st.IsNotFound()) bad.fetch_add(1);
          break;
        }
        case 5: {
          const Status st = tm->Delete(k);
          if (!st.ok() && !st.IsNotFound()) bad.fetch_add(1);
          break;
        }
        case 6: {
          Key chain[2] = {k, MakeKey(static_cast<int>(rng() % kKeys), 11)};
          (void)tm->Lookup(chain);
          break;
        }
        default:
          clock.AdvanceUs(1000);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(puts.load(), 100u);
  EXPECT_GT(refused.load(), 0u) << "the quota was reached";

  clock.AdvanceUs(1'000'000);  // every TTL has passed
  const Key whole = MakeKey(kKeys + 1, 11);
  PutOptions p;
  p.tenant = 1;
  ASSERT_TRUE(tm->Put(whole, MakeValue(whole, next_version.fetch_add(1), kQuota), p).ok());
  const Stats s = tm->GetStats();
  ASSERT_EQ(s.tenant_bytes.size(), 1u);
  EXPECT_EQ(s.tenant_bytes[0], std::make_pair(TenantId{1}, kQuota));
}

}  // namespace
}  // namespace kvtier::storage
