// The durability contract of TierManager (storage/tier_manager.h): every acknowledged write,
// whatever tier it was placed in, and every acknowledged delete survives a crash under the
// mode in force (sync: all of them; batched: all but the last group-commit window). Crashes
// are simulated with FaultInjectionEnv over a memory env: unsynced writes and unsynced
// directory entries are dropped, and the tier is reopened over the surviving state.
#include <gtest/gtest.h>
#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_format.h"
#include "storage/ssd_tier.h"
#include "storage/tier_manager.h"
#include "tests/storage/test_util.h"
#include "tests/storage/wal_sync_faults.h"

namespace kvtier::storage {
namespace {

using kvtier::testing::WalSyncFaults;

using testing::CheckValue;
using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

constexpr size_t kValueBytes = 5000;

class DurabilityTest : public ::testing::Test {
 protected:
  TierManagerOptions Options(Durability d, DeviceEnv* env) {
    TierManagerOptions o;
    o.dram_capacity_bytes = 4ull << 20;
    o.slab_page_bytes = 64 << 10;
    o.ssd_capacity_bytes = 64ull << 20;
    o.ssd_segment_bytes = 1ull << 20;
    o.ssd_write_buffer_bytes = 64 << 10;
    o.data_dir = dir_.path();
    o.durability = d;
    o.group_commit_ms = 3'600'000;  // no timed group commit unless a test sets one
    o.ssd_env = env;
    return o;
  }
  std::unique_ptr<TierManager> Open(const TierManagerOptions& o) {
    auto tm = TierManager::Open(o);
    EXPECT_TRUE(tm.ok()) << tm.status().ToString();
    return tm.ok() ? std::move(tm).value() : nullptr;
  }
  // The state after a crash: reopened over the base env (what reached the "disk").
  // A simulated crash: drops the env's unsynced writes and directory entries, and takes the
  // RocksDB index as it is on disk now (a copy), so that nothing the tier writes while it is
  // torn down afterwards (its close commit) reaches the state the test reopens.
  void Crash(FaultInjectionEnv& fault) {
    fault.SimulateCrash();
    std::error_code ec;
    std::filesystem::copy(dir_.path() + "/index", image_.path() + "/index",
                          std::filesystem::copy_options::recursive, ec);
    ASSERT_FALSE(ec) << ec.message();
    crashed_ = true;
  }
  // The state after a crash: the index image and what reached the base env.
  std::unique_ptr<TierManager> Reopen(Durability d) {
    TierManagerOptions o = Options(d, base_.get());
    if (crashed_) o.data_dir = image_.path();
    return Open(o);
  }
  static Status PutVersion(TierManager* tm, int i, uint64_t version, PutOptions p = {},
                           size_t bytes = kValueBytes) {
    Key k = MakeKey(i);
    return tm->Put(k, MakeValue(k, version, bytes), p);
  }
  // The version Get returns, 0 on a miss; fails the test on wrong bytes.
  static uint64_t VersionOf(TierManager* tm, int i) {
    Key k = MakeKey(i);
    std::vector<uint8_t> out;
    if (!tm->Get(k, &out).ok()) return 0;
    uint64_t v = 0;
    EXPECT_TRUE(CheckValue(k, out, &v)) << "unit " << i << " returned wrong bytes";
    return v;
  }
  // Polls until `done` holds, at most 10 s (the test then fails instead of hanging).
  template <typename F>
  static bool Eventually(F done) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  TempDir dir_, image_;
  bool crashed_ = false;
  std::unique_ptr<DeviceEnv> base_ = NewMemEnv();
};

// A default put (placed in DRAM) under sync is on disk when acknowledged: written through.
TEST_F(DurabilityTest, SyncPutPlacedInDramSurvivesACrash) {
  constexpr int kUnits = 60;
  {
    FaultInjectionEnv fault(base_.get(), {});
    auto tm = Open(Options(Durability::kSync, &fault));
    ASSERT_NE(tm, nullptr);
    PutOptions hbm;
    hbm.highest_tier = Tier::kHbm;  // no HBM tier: placed in DRAM
    for (int i = 0; i < kUnits; ++i) {
      ASSERT_TRUE(PutVersion(tm.get(), i, 1, i % 2 ? hbm : PutOptions{}).ok());
    }
    ASSERT_TRUE(PutVersion(tm.get(), 0, 2).ok());  // an overwrite, also in DRAM
    std::vector<Key> chain{MakeKey(1)};
    EXPECT_EQ(tm->Lookup(chain).tiers.at(0), Tier::kDram) << "placed in DRAM";
    // SWA state asks to stay in memory: it is the one exception.
    PutOptions swa;
    swa.kind = policies::ObjectKind::kSwa;
    swa.allow_ssd = false;
    ASSERT_TRUE(PutVersion(tm.get(), 1000, 1, swa).ok());
    Crash(fault);
  }
  auto tm = Reopen(Durability::kSync);
  ASSERT_NE(tm, nullptr);
  EXPECT_EQ(VersionOf(tm.get(), 0), 2u);
  for (int i = 1; i < kUnits; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 1u) << "lost unit " << i;
  EXPECT_EQ(VersionOf(tm.get(), 1000), 0u) << "memory-only state never reaches SSD";
}

// Under sync, an overwrite whose older copy is the DRAM tier's eviction victim when the new
// version is placed in memory (step 3 of a written-through put): the older copy must only
// leave DRAM. Demoting it used to write the old version over the new one on SSD (or, when
// admission refused it, remove the SSD copy), and the put's stale-copy removal then deleted
// the key from SSD: acknowledged, yet absent after a crash.
TEST_F(DurabilityTest, SyncOverwriteOfTheDramVictimSurvivesACrash) {
  {
    FaultInjectionEnv fault(base_.get(), {});
    TierManagerOptions o = Options(Durability::kSync, &fault);
    o.dram_capacity_bytes = o.slab_page_bytes;  // one slab page: a handful of units
    auto tm = Open(o);
    ASSERT_NE(tm, nullptr);
    for (int i = 100; i < 200; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1).ok());
    const uint64_t slots = tm->GetStats().dram.objects;
    ASSERT_GE(slots, 2u);
    ASSERT_LT(slots, 100u) << "DRAM must be full";
    // Unit 0 in DRAM, then exactly enough puts after it that it is the LRU victim of a full
    // DRAM tier.
    ASSERT_TRUE(PutVersion(tm.get(), 0, 1).ok());
    for (uint64_t i = 0; i + 1 < slots; ++i) {
      ASSERT_TRUE(PutVersion(tm.get(), 200 + static_cast<int>(i), 1).ok());
    }
    std::vector<Key> chain{MakeKey(0)};
    ASSERT_EQ(tm->Lookup(chain).tiers.at(0), Tier::kDram);
    ASSERT_TRUE(PutVersion(tm.get(), 0, 2).ok());
    EXPECT_EQ(VersionOf(tm.get(), 0), 2u) << "read-your-writes before the crash";
    Crash(fault);
  }
  auto tm = Reopen(Durability::kSync);
  ASSERT_NE(tm, nullptr);
  EXPECT_EQ(VersionOf(tm.get(), 0), 2u) << "acknowledged overwrite lost";
}

// Batched: everything acknowledged before a group commit survives; later puts may be lost
// (each unit is then absent or exactly its acknowledged bytes).
TEST_F(DurabilityTest, BatchedLosesAtMostItsWindow) {
  constexpr int kCommitted = 40, kWindow = 40;
  {
    FaultInjectionEnv fault(base_.get(), {});
    TierManagerOptions o = Options(Durability::kBatched, &fault);
    o.group_commit_ms = 2;
    auto tm = Open(o);
    ASSERT_NE(tm, nullptr);
    for (int i = 0; i < kCommitted; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1).ok());
    // Two more group commits: the second started after the last put was acknowledged (commits
    // are serialised). Empty commits are not counted, so an SSD-placed marker unit keeps giving
    // them something to write.
    PutOptions ssd;
    ssd.highest_tier = Tier::kSsd;
    uint64_t c0 = tm->GetStats().ssd_commits;
    uint64_t marker = 0;
    ASSERT_TRUE(Eventually([&] {
      EXPECT_TRUE(PutVersion(tm.get(), 999, ++marker, ssd).ok());
      return tm->GetStats().ssd_commits >= c0 + 2;
    }));
    for (int i = kCommitted; i < kCommitted + kWindow; ++i) {
      ASSERT_TRUE(PutVersion(tm.get(), i, 1).ok());
    }
    Crash(fault);
  }
  auto tm = Reopen(Durability::kBatched);
  ASSERT_NE(tm, nullptr);
  for (int i = 0; i < kCommitted; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 1u) << "lost unit " << i;
  for (int i = kCommitted; i < kCommitted + kWindow; ++i) {
    uint64_t v = VersionOf(tm.get(), i);
    EXPECT_TRUE(v == 0 || v == 1) << i;
  }
}

class DeleteDurabilityTest : public DurabilityTest,
                             public ::testing::WithParamInterface<Durability> {};

// Deleted units stay deleted after a crash: single deletes, a tenant delete, a unit whose
// record lies in the newest segment (the part recovery scans), and a unit deleted and then
// put again (never its first version).
TEST_P(DeleteDurabilityTest, DeletedKeysStayDeletedAfterCrashAndRecovery) {
  Durability d = GetParam();
  PutOptions tenant2;
  tenant2.tenant = 2;
  {
    // A first life fills older segments and ends cleanly.
    auto tm = Open(Options(d, base_.get()));
    ASSERT_NE(tm, nullptr);
    for (int i = 0; i < 100; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1).ok());
  }
  {
    FaultInjectionEnv fault(base_.get(), {});
    auto tm = Open(Options(d, &fault));
    ASSERT_NE(tm, nullptr);
    // Records in the newest segment (this life appends to a fresh one), deleted at once.
    for (int i = 200; i < 210; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1).ok());
    for (int i = 200; i < 205; ++i) ASSERT_TRUE(tm->Delete(MakeKey(i)).ok());
    // Older units deleted; unit 10 deleted and put again.
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(tm->Delete(MakeKey(i)).ok());
    ASSERT_TRUE(PutVersion(tm.get(), 10, 3).ok());
    // A tenant's units, then the tenant delete (FLUSHDB).
    for (int i = 300; i < 320; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1, tenant2).ok());
    ASSERT_TRUE(tm->DeleteTenant(2).ok());
    if (d == Durability::kBatched) {
      uint64_t c0 = tm->GetStats().ssd_commits;
      ASSERT_TRUE(tm->Flush().ok());  // a group commit (Flush commits like the timer does)
      EXPECT_GT(tm->GetStats().ssd_commits, c0);
    }
    // After the commit: more records in the tail (written to the device, never committed).
    for (int i = 400; i < 440; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1).ok());
    Crash(fault);
  }
  auto tm = Reopen(d);
  ASSERT_NE(tm, nullptr);
  for (int i = 200; i < 205; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 0u) << "resurrected " << i;
  for (int i = 205; i < 210; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 1u) << "lost " << i;
  for (int i = 0; i < 20; ++i) {
    if (i != 10) {
      EXPECT_EQ(VersionOf(tm.get(), i), 0u) << "resurrected " << i;
    }
  }
  EXPECT_EQ(VersionOf(tm.get(), 10), 3u) << "the re-put survives, never the deleted version";
  for (int i = 20; i < 100; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 1u) << "lost " << i;
  for (int i = 300; i < 320; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 0u) << "tenant unit " << i;
  Stats s = tm->GetStats();
  for (const auto& [tenant, bytes] : s.tenant_bytes) EXPECT_NE(tenant, 2u);
  // A second crash-free restart changes nothing.
  tm.reset();
  tm = Reopen(d);
  for (int i = 200; i < 205; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 0u) << "resurrected " << i;
  EXPECT_EQ(VersionOf(tm.get(), 10), 3u);
}

// A delete of a unit the SSD tier had evicted stays deleted after a power failure. An
// eviction's index delete is not synced (a power failure may lose it and bring back an intact
// unit, which a cache may do), so the SSD index may still hold a unit that DRAM serves, or that
// is gone from every tier. Before, Delete, DeleteTenant and the removal of the SSD copy that a
// memory-only put replaced found nothing on SSD and committed nothing: the deleted (or
// replaced) value came back after the crash. The crash keeps the RocksDB index as of its last
// synced write (the image is taken at the Flush, and again only if a later commit synced the
// index): what a power failure leaves of writes RocksDB did not sync. Each way of deleting
// runs alone (a synced delete of one unit would also sync the eviction deletes of the others).
TEST_P(DeleteDurabilityTest, DeleteOfAUnitTheSsdEvictedStaysDeletedAfterACrash) {
  const Durability d = GetParam();
  enum class Way { kDelete, kDeleteAbsent, kDeleteTenant, kDeleteTenantAbsent, kMemoryOnlyPut };
  for (Way way : {Way::kDelete, Way::kDeleteAbsent, Way::kDeleteTenant, Way::kDeleteTenantAbsent,
                  Way::kMemoryOnlyPut}) {
    SCOPED_TRACE("way " + std::to_string(static_cast<int>(way)));
    TempDir dir, image;
    std::unique_ptr<DeviceEnv> base = NewMemEnv();
    PutOptions tenant2;
    tenant2.tenant = 2;
    PutOptions ssd;
    ssd.highest_tier = Tier::kSsd;
    PutOptions ssd_tenant2 = ssd;
    ssd_tenant2.tenant = 2;
    uint64_t marker = 0;
    {
      FaultInjectionEnv fault(base.get(), {});
      TierManagerOptions o = Options(d, &fault);
      o.data_dir = dir.path();
      o.ssd_objects_max = 2;  // evictions without capacity pressure (no cleaning, no roll)
      if (d == Durability::kBatched) o.group_commit_ms = 2;
      auto tm = Open(o);
      ASSERT_NE(tm, nullptr);
      // Unit 1: in DRAM and written through to SSD, or on SSD only; tenant 2's for a tenant
      // delete.
      const bool absent = way == Way::kDeleteAbsent || way == Way::kDeleteTenantAbsent;
      const bool tenant = way == Way::kDeleteTenant || way == Way::kDeleteTenantAbsent;
      ASSERT_TRUE(
          PutVersion(tm.get(), 1, 1,
                     absent ? (tenant ? ssd_tenant2 : ssd) : (tenant ? tenant2 : PutOptions{}))
              .ok());
      ASSERT_TRUE(tm->Flush().ok());  // the index holds unit 1, synced: the image
      auto take_image = [&] {
        std::error_code ec;
        std::filesystem::remove_all(image.path() + "/index", ec);
        std::filesystem::copy(dir.path() + "/index", image.path() + "/index",
                              std::filesystem::copy_options::recursive, ec);
        ASSERT_FALSE(ec) << ec.message();
      };
      take_image();
      const uint64_t index_syncs = tm->GetStats().ssd_index_syncs;
      // Two SSD puts of new keys evict unit 1 from SSD (LRU; the index delete is not synced).
      ASSERT_TRUE(PutVersion(tm.get(), 100, 1, ssd).ok());
      ASSERT_TRUE(PutVersion(tm.get(), 101, 1, ssd).ok());
      Stats s = tm->GetStats();
      ASSERT_EQ(s.ssd.evictions, 1u);
      ASSERT_EQ(s.ssd.objects, 2u);
      std::vector<Key> chain{MakeKey(1)};
      if (absent) {
        ASSERT_EQ(tm->Lookup(chain).hit_count, 0u) << "evicted from every tier";
      } else {
        ASSERT_EQ(tm->Lookup(chain).tiers.at(0), Tier::kDram) << "DRAM keeps the unit";
      }
      switch (way) {
        case Way::kDelete:
          ASSERT_TRUE(tm->Delete(MakeKey(1)).ok());
          break;
        case Way::kDeleteAbsent:  // NotFound, but it must not come back either
          ASSERT_TRUE(tm->Delete(MakeKey(1)).IsNotFound());
          break;
        case Way::kDeleteTenant:
        case Way::kDeleteTenantAbsent:
          ASSERT_TRUE(tm->DeleteTenant(2).ok());
          break;
        case Way::kMemoryOnlyPut: {
          PutOptions memory_only;
          memory_only.kind = policies::ObjectKind::kSwa;
          memory_only.allow_ssd = false;
          ASSERT_TRUE(PutVersion(tm.get(), 1, 2, memory_only).ok());
          EXPECT_EQ(VersionOf(tm.get(), 1), 2u);
          break;
        }
      }
      if (d == Durability::kBatched) {
        // Two group commits (not Flush, which syncs the index anyway): the second started
        // after the delete. An overwrite of an SSD unit gives them something to write.
        uint64_t c0 = tm->GetStats().ssd_commits;
        ASSERT_TRUE(Eventually([&] {
          EXPECT_TRUE(PutVersion(tm.get(), 100, 1 + ++marker, ssd).ok());
          return tm->GetStats().ssd_commits >= c0 + 2;
        }));
      }
      if (tm->GetStats().ssd_index_syncs != index_syncs) take_image();
      fault.SimulateCrash();
    }
    TierManagerOptions o = Options(d, base.get());
    o.data_dir = image.path();
    auto tm = Open(o);
    ASSERT_NE(tm, nullptr);
    EXPECT_EQ(VersionOf(tm.get(), 1), 0u) << "the deleted (or replaced) value came back";
    EXPECT_EQ(VersionOf(tm.get(), 101), 1u) << "lost unit 101";
    // The marker's overwrites: batched may lose those of its last window, never the unit.
    const uint64_t v100 = VersionOf(tm.get(), 100);
    EXPECT_TRUE(v100 >= 1 && v100 <= 1 + marker) << "unit 100 at version " << v100;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, DeleteDurabilityTest,
                         ::testing::Values(Durability::kSync, Durability::kBatched),
                         [](const auto& info) {
                           return info.param == Durability::kSync ? "Sync" : "Batched";
                         });

// Concurrent sync writers share commits: while one fdatasync is held, N puts (DRAM-placed)
// all reach the SSD tier (TierManager's lock is not held across the SSD write and commit
// wait), and all of them are then made durable by at most two commits. The same for deletes.
TEST_F(DurabilityTest, ConcurrentSyncWritersShareCommits) {
  constexpr int kThreads = 8;
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = Open(Options(Durability::kSync, &fault));
  ASSERT_NE(tm, nullptr);
  std::vector<Key> keys;
  for (int i = 0; i < kThreads; ++i) keys.push_back(MakeKey(i));
  auto present = [&] {
    int n = 0;
    for (const Key& k : keys) n += tm->Lookup(std::span<const Key>(&k, 1)).hit_count == 1;
    return n;
  };
  // Puts.
  {
    uint64_t commits0 = tm->GetStats().ssd_commits;
    fault.PauseSyncs(true);
    std::atomic<int> failed{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] { failed += PutVersion(tm.get(), i, 1).ok() ? 0 : 1; });
    }
    // Every put is written (and visible) while the first commit's fdatasync is held.
    bool all_written = Eventually([&] { return present() == kThreads; });
    fault.PauseSyncs(false);
    for (auto& t : threads) t.join();
    ASSERT_TRUE(all_written) << "puts were serialised behind one commit";
    EXPECT_EQ(failed.load(), 0);
    uint64_t commits = tm->GetStats().ssd_commits - commits0;
    EXPECT_LE(commits, 2u) << "concurrent sync puts did not share commits";
    EXPECT_LT(commits, static_cast<uint64_t>(kThreads));
  }
  // Deletes: a put's commit is held at its fdatasync; the deletes behind it are all done in
  // memory meanwhile and share the next commit.
  {
    uint64_t commits0 = tm->GetStats().ssd_commits;
    fault.PauseSyncs(true);
    PutOptions ssd;
    ssd.highest_tier = Tier::kSsd;  // always writes, so its commit syncs
    std::thread blocker([&] { EXPECT_TRUE(PutVersion(tm.get(), 100, 1, ssd).ok()); });
    bool blocked = Eventually([&] { return fault.syncs_waiting() == 1; });
    std::atomic<int> failed{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] { failed += tm->Delete(MakeKey(i)).ok() ? 0 : 1; });
    }
    bool all_removed = Eventually([&] { return present() == 0; });
    fault.PauseSyncs(false);
    blocker.join();
    for (auto& t : threads) t.join();
    ASSERT_TRUE(blocked);
    ASSERT_TRUE(all_removed) << "deletes were serialised behind one commit";
    EXPECT_EQ(failed.load(), 0);
    EXPECT_LE(tm->GetStats().ssd_commits - commits0, 2u) << "deletes did not share a commit";
  }
  Crash(fault);
  tm.reset();
  auto after = Reopen(Durability::kSync);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(VersionOf(after.get(), i), 0u) << i;
}

// Puts with a deferred commit (PutOptions::defer_commit) and DeleteDeferred under sync, as the
// RESP front's MSET and multi-key DEL use them: none of them commits by itself, the first
// CompletePut commits all of them (one commit for 32 puts, one for 17 deletes; the others
// find their tickets covered), and after a crash every completed put is there and every
// completed delete stays gone. A delete of a key never stored is NotFound and still leaves a
// DeferredCommit to complete.
TEST_F(DurabilityTest, DeferredPutsAndDeletesShareOneCommitAndSurviveACrash) {
  constexpr int kKeys = 32;
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = Open(Options(Durability::kSync, &fault));
  ASSERT_NE(tm, nullptr);
  uint64_t commits0 = tm->GetStats().ssd_commits;
  std::vector<DeferredCommit> puts(kKeys);
  for (int i = 0; i < kKeys; ++i) {
    PutOptions p;
    p.defer_commit = &puts[i];
    ASSERT_TRUE(PutVersion(tm.get(), i, 1, p).ok()) << i;
  }
  EXPECT_EQ(tm->GetStats().ssd_commits, commits0) << "a deferred put committed by itself";
  for (const DeferredCommit& d : puts) ASSERT_TRUE(tm->CompletePut(d).ok());
  EXPECT_EQ(tm->GetStats().ssd_commits - commits0, 1u);

  commits0 = tm->GetStats().ssd_commits;
  std::vector<DeferredCommit> dels(kKeys / 2 + 1);
  for (int i = 0; i < kKeys / 2; ++i) EXPECT_TRUE(tm->DeleteDeferred(MakeKey(i), &dels[i]).ok());
  EXPECT_TRUE(tm->DeleteDeferred(MakeKey(1000), &dels[kKeys / 2]).IsNotFound());
  EXPECT_EQ(tm->GetStats().ssd_commits, commits0) << "a deferred delete committed by itself";
  for (int i = 0; i < kKeys / 2; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 0u) << i;
  for (const DeferredCommit& d : dels) ASSERT_TRUE(tm->CompletePut(d).ok());
  EXPECT_EQ(tm->GetStats().ssd_commits - commits0, 1u);

  Crash(fault);
  tm.reset();
  auto after = Reopen(Durability::kSync);
  ASSERT_NE(after, nullptr);
  for (int i = 0; i < kKeys; ++i) {
    EXPECT_EQ(VersionOf(after.get(), i), i < kKeys / 2 ? 0u : 1u) << i;
  }
}

// Puts, deletes and gets of the same keys from several threads under sync: every Get sees a
// whole acknowledged version, and after the threads stop, a crash changes nothing.
TEST_F(DurabilityTest, ConcurrentPutsDeletesAndGetsOfOneKeySetAreExactAfterACrash) {
  constexpr int kKeys = 16, kThreads = 4, kOps = 150;
  std::map<int, uint64_t> before;
  {
    FaultInjectionEnv fault(base_.get(), {});
    auto tm = Open(Options(Durability::kSync, &fault));
    ASSERT_NE(tm, nullptr);
    std::atomic<uint64_t> next_version{1};
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        uint64_t x = static_cast<uint64_t>(t) * 7919 + 1;
        for (int n = 0; n < kOps; ++n) {
          x = testing::SplitMix(x);
          int i = static_cast<int>(x % kKeys);
          switch ((x >> 8) % 4) {
            case 0:
              (void)tm->Delete(MakeKey(i));
              break;
            case 1: {
              Key k = MakeKey(i);
              std::vector<uint8_t> out;
              if (tm->Get(k, &out).ok() && !CheckValue(k, out, nullptr)) ++bad;
              break;
            }
            default:
              if (!PutVersion(tm.get(), i, next_version++).ok()) ++bad;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(bad.load(), 0);
    for (int i = 0; i < kKeys; ++i) before[i] = VersionOf(tm.get(), i);
    Crash(fault);
  }
  auto tm = Reopen(Durability::kSync);
  ASSERT_NE(tm, nullptr);
  for (int i = 0; i < kKeys; ++i) EXPECT_EQ(VersionOf(tm.get(), i), before[i]) << "unit " << i;
}

// A failed commit names its stage (typed, in stats); the unit it covered is not kept, and
// the tier goes on working.
TEST_F(DurabilityTest, FailedCommitCarriesItsStage) {
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = Open(Options(Durability::kSync, &fault));
  ASSERT_NE(tm, nullptr);
  EXPECT_EQ(tm->GetStats().ssd_last_failed_stage, CommitStage::kNone);
  fault.FailNextSyncs(1);
  Status st = PutVersion(tm.get(), 1, 1);
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  Stats s = tm->GetStats();
  EXPECT_EQ(s.ssd_commit_failures, 1u);
  EXPECT_EQ(s.ssd_last_failed_stage, CommitStage::kSync);
  EXPECT_STREQ(CommitStageName(s.ssd_last_failed_stage), "sync");
  EXPECT_EQ(VersionOf(tm.get(), 1), 0u) << "a put whose commit failed is not served";

  fault.FailNextWrites(1);
  st = PutVersion(tm.get(), 2, 1);
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  s = tm->GetStats();
  EXPECT_EQ(s.ssd_commit_failures, 2u);
  EXPECT_EQ(s.ssd_last_failed_stage, CommitStage::kBufferWrite);
  EXPECT_EQ(VersionOf(tm.get(), 2), 0u);

  ASSERT_TRUE(PutVersion(tm.get(), 3, 1).ok());
  Crash(fault);
  tm.reset();
  auto after = Reopen(Durability::kSync);
  EXPECT_EQ(VersionOf(after.get(), 3), 1u);
  EXPECT_EQ(VersionOf(after.get(), 1), 0u);
  EXPECT_EQ(VersionOf(after.get(), 2), 0u);
}

// A tier whose index goes through WalSyncFaults.
class IndexFaultTest : public DurabilityTest {
 protected:
  // Opens the tier over env with the faulty index, once its background load has finished
  // (the index is reopened only then: until it, point reads use it outside the commit's locks).
  std::unique_ptr<TierManager> OpenWithIndexFaults(Durability d, DeviceEnv* env) {
    TierManagerOptions o = Options(d, env);
    o.ssd_index_env = index_env_.get();
    auto tm = Open(o);
    EXPECT_NE(tm, nullptr);
    if (tm != nullptr) {
      EXPECT_TRUE(Eventually([&] { return tm->GetStats().ssd_index_loaded; }));
    }
    return tm;
  }
  // After an index fault: puts units 3..5 (each must commit: the index was reopened), crashes
  // the device and opens the tier again (null when it did not open); the three survived.
  std::unique_ptr<TierManager> PutThreeCrashAndReopen(std::unique_ptr<TierManager> tm,
                                                      FaultInjectionEnv* fault) {
    for (int i = 3; i < 6; ++i) {
      Status put = PutVersion(tm.get(), i, 1);
      EXPECT_TRUE(put.ok()) << "commit after the index fault: " << put.ToString();
    }
    Crash(*fault);
    tm.reset();
    auto after = Reopen(Durability::kSync);
    EXPECT_NE(after, nullptr);
    if (after != nullptr) {
      for (int i = 3; i < 6; ++i) EXPECT_EQ(VersionOf(after.get(), i), 1u) << "unit " << i;
    }
    return after;
  }
  std::shared_ptr<WalSyncFaults> faults_ = std::make_shared<WalSyncFaults>();
  std::unique_ptr<rocksdb::Env> index_env_ = rocksdb::NewCompositeEnv(faults_);
};

// One failed sync of the index's write-ahead log (a transient EIO under the index) fails the
// commit it belongs to, and only that one: RocksDB refuses every write after a failed WAL sync
// (its background error; DB::Resume returns the same error), and the tier used to leave it so,
// failing every later commit until a restart. Now it reopens the index. The delete whose commit
// failed stays applied in memory and its index delete is retried: after a crash it is still gone,
// and a put after the failure survives.
TEST_F(IndexFaultTest, AFailedIndexSyncFailsOneCommitNotEveryLaterOne) {
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = OpenWithIndexFaults(Durability::kSync, &fault);
  ASSERT_NE(tm, nullptr);
  ASSERT_TRUE(PutVersion(tm.get(), 1, 1).ok());
  ASSERT_TRUE(PutVersion(tm.get(), 2, 1).ok());
  faults_->FailNextWalSyncs(1);
  Status del = tm->Delete(MakeKey(1));
  EXPECT_TRUE(del.IsIOError()) << del.ToString();
  EXPECT_EQ(faults_->failed(), 1) << "the delete's commit did not sync the index";
  EXPECT_EQ(VersionOf(tm.get(), 1), 0u) << "the delete stands in memory";
  Stats s = tm->GetStats();
  EXPECT_EQ(s.ssd_last_failed_stage, CommitStage::kIndexWrite);
  EXPECT_EQ(s.ssd_index_reopens, 1u);
  auto after = PutThreeCrashAndReopen(std::move(tm), &fault);
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(VersionOf(after.get(), 1), 0u) << "the delete came back after the crash";
  EXPECT_EQ(VersionOf(after.get(), 2), 1u);
}

// The disk under the index is full for one append to its write-ahead log (ENOSPC, which
// RocksDB keeps as a background error as it keeps EIO): that commit fails, and the next ones
// succeed once the index is reopened. The failed put holds no value (TierManager::Put: the key
// then holds none), neither at once nor after a crash, which keeps the puts after it.
TEST_F(IndexFaultTest, AFullDiskUnderTheIndexFailsOneCommitNotEveryLaterOne) {
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = OpenWithIndexFaults(Durability::kSync, &fault);
  ASSERT_NE(tm, nullptr);
  ASSERT_TRUE(PutVersion(tm.get(), 1, 1).ok());
  faults_->FailNextWalAppendsNoSpace(1);
  Status put = PutVersion(tm.get(), 2, 1);
  EXPECT_TRUE(put.IsIOError()) << put.ToString();
  EXPECT_EQ(faults_->failed(), 1) << "the put's commit did not append to the index's WAL";
  EXPECT_EQ(VersionOf(tm.get(), 2), 0u) << "a put answered with an error holds a value";
  EXPECT_EQ(tm->GetStats().ssd_index_reopens, 1u);
  auto after = PutThreeCrashAndReopen(std::move(tm), &fault);
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(VersionOf(after.get(), 1), 1u);
  EXPECT_EQ(VersionOf(after.get(), 2), 0u) << "the failed put came back after the crash";
}

// The reopen after a failed index sync fails too (the index cannot create its new WAL): that
// commit fails, the index stays closed, and the next commit opens it again and succeeds.
TEST_F(IndexFaultTest, AReopenThatFailsIsMadeAgainByTheNextCommit) {
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = OpenWithIndexFaults(Durability::kSync, &fault);
  ASSERT_NE(tm, nullptr);
  ASSERT_TRUE(PutVersion(tm.get(), 1, 1).ok());
  faults_->FailNextWalSyncs(1);
  faults_->FailNextWalOpens(1);
  EXPECT_TRUE(tm->Delete(MakeKey(1)).IsIOError());
  EXPECT_EQ(faults_->failed(), 2) << "the sync and the reopen's WAL";
  EXPECT_EQ(tm->GetStats().ssd_index_reopens, 0u);
  Status put = PutVersion(tm.get(), 2, 1);
  EXPECT_TRUE(put.ok()) << "the commit after a failed reopen: " << put.ToString();
  EXPECT_EQ(tm->GetStats().ssd_index_reopens, 1u);
  EXPECT_TRUE(tm->Flush().ok());
  Crash(fault);
  tm.reset();
  auto after = Reopen(Durability::kSync);
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(VersionOf(after.get(), 1), 0u) << "the delete came back after the crash";
  EXPECT_EQ(VersionOf(after.get(), 2), 1u);
}

// A failed index sync in the commit a close makes (batched puts still pending) ends the close
// with the error logged; it does not reopen the index (that commit runs with the tier's lock
// held, which the reopen takes: the close used to hang there).
TEST_F(IndexFaultTest, AFailedIndexSyncWhileClosingEndsTheClose) {
  auto tm = OpenWithIndexFaults(Durability::kBatched, base_.get());
  ASSERT_NE(tm, nullptr);
  PutOptions ssd;
  ssd.highest_tier = Tier::kSsd;
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1, ssd).ok());
  faults_->FailNextWalSyncs(1);
  std::atomic<bool> closed{false};
  std::thread closer([&] {
    tm.reset();
    closed = true;
  });
  const bool ended = Eventually([&] { return closed.load(); });
  EXPECT_TRUE(ended) << "the close hung on its failed index sync";
  if (!ended) {
    closer.detach();  // the process ends with the test binary
    return;
  }
  closer.join();
  EXPECT_EQ(faults_->failed(), 1) << "the close's commit did not sync the index";
}

// The SSD tier itself: a put whose fdatasync failed is forgotten (its data may not be on
// disk), a put whose buffer write failed too; the stage is typed.
TEST_F(DurabilityTest, SsdTierForgetsWhatAFailedSyncOrWriteMayHaveLost) {
  FaultInjectionEnv fault(base_.get(), {});
  SsdOptions o;
  o.dir = dir_.path();
  o.env = &fault;
  o.capacity_bytes = 16ull << 20;
  o.segment_bytes = 1ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.durability = Durability::kSync;
  o.group_commit_ms = 3'600'000;
  auto ssd = SsdTier::Open(o);
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  Key a = MakeKey(1), b = MakeKey(2), c = MakeKey(3);
  SsdMeta meta;
  meta.version = 1;
  fault.FailNextSyncs(1);
  EXPECT_TRUE((*ssd)->Put(a, MakeValue(a, 1, 3000), meta, nullptr).IsIOError());
  EXPECT_FALSE((*ssd)->Contains(a)) << "kept an entry whose data may not be durable";
  EXPECT_EQ((*ssd)->GetStats().last_failed_stage, CommitStage::kSync);
  fault.FailNextWrites(1);
  EXPECT_TRUE((*ssd)->Put(b, MakeValue(b, 1, 3000), meta, nullptr).IsIOError());
  EXPECT_FALSE((*ssd)->Contains(b));
  EXPECT_EQ((*ssd)->GetStats().last_failed_stage, CommitStage::kBufferWrite);
  EXPECT_EQ((*ssd)->GetStats().commit_failures, 2u);
  ASSERT_TRUE((*ssd)->Put(c, MakeValue(c, 1, 3000), meta, nullptr).ok());
  EXPECT_TRUE((*ssd)->Contains(c));
}

// The SSD tier remembers the keys it evicted until a synced index write covers their eviction
// deletes: Remove of such a key records a delete that syncs the index (once), a synced commit
// forgets them, and a put of the key again does too. Bounded: the commit after 16384
// evictions wait syncs the index although it holds no other delete.
TEST_F(DurabilityTest, SsdTierRemembersUnsyncedEvictionsForRemove) {
  SsdOptions o;
  o.dir = dir_.path();
  o.env = base_.get();
  o.capacity_bytes = 16ull << 20;
  o.segment_bytes = 1ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.durability = Durability::kSync;
  o.group_commit_ms = 3'600'000;
  o.objects_max = 1;  // every put of a new key evicts the last one
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  auto unsynced = [&] {
    std::map<Key, TenantId> m;
    ssd.ForEachUnsyncedEviction([&](const Key& k, TenantId t) { m[k] = t; });
    return m;
  };
  auto put = [&](int i, TenantId tenant) {
    Key k = MakeKey(i);
    SsdMeta meta;
    meta.tenant = tenant;
    meta.version = 1;
    std::vector<Key> evicted;
    EXPECT_TRUE(ssd.Put(k, MakeValue(k, 1, 100), meta, &evicted).ok());
    return evicted;
  };
  Key a = MakeKey(1), b = MakeKey(2), c = MakeKey(3);
  put(1, 7);
  ASSERT_EQ(put(2, 8), std::vector<Key>{a});
  EXPECT_EQ(unsynced(), (std::map<Key, TenantId>{{a, 7}}));
  EXPECT_FALSE(ssd.Contains(a));
  uint64_t syncs = ssd.GetStats().index_syncs;
  uint64_t ticket = 0;
  ASSERT_TRUE(ssd.Remove(a, &ticket).ok()) << "an unsynced eviction is not absent";
  EXPECT_GT(ticket, 0u);
  EXPECT_TRUE(ssd.Remove(a).IsNotFound()) << "its delete is recorded once";
  ASSERT_TRUE(ssd.WaitDurable(ticket).ok());
  EXPECT_EQ(ssd.GetStats().index_syncs, syncs + 1) << "the delete synced the index";
  EXPECT_TRUE(unsynced().empty());
  // A synced commit (Flush) forgets the evictions it covers.
  ASSERT_EQ(put(3, 9), std::vector<Key>{b});
  ASSERT_EQ(unsynced().size(), 1u);
  ASSERT_TRUE(ssd.Flush().ok());
  EXPECT_TRUE(unsynced().empty());
  EXPECT_TRUE(ssd.Remove(b).IsNotFound());
  // A key put again is no unsynced eviction (its next removal syncs, or evicts it again).
  ASSERT_EQ(put(1, 7), std::vector<Key>{c});
  ASSERT_EQ(put(3, 9), std::vector<Key>{a});
  EXPECT_EQ(unsynced(), (std::map<Key, TenantId>{{a, 7}})) << "c's eviction went with its put";
  // The bound: evictions alone make a commit sync the index once 16384 of them wait.
  syncs = ssd.GetStats().index_syncs;
  constexpr int kEvictions = 16384 + 16;
  for (int i = 0; i < kEvictions; ++i) ASSERT_EQ(put(1000 + i, 1).size(), 1u);
  EXPECT_GE(ssd.GetStats().index_syncs, syncs + 1) << "the unsynced evictions were not bounded";
  EXPECT_LT(unsynced().size(), 16384u);
}

// A commit of the cleaner's relocations that fails (its fdatasync, or the write of the buffer
// holding them) must not cost the units it was moving: their records in the victim segment
// are durable, so the entries go back there and the victim stays until a clean succeeds.
// Before, the failed commit forgot the relocated entries like fresh puts (a sync failure) or
// dropped them as lost writes (a buffer failure), the victim then held no live bytes and the
// next clean deleted it: long-durable units were lost because a write elsewhere failed. A
// batched put the failed commit covered is lost, and is reported so (io_error, and no longer
// in the tenant's bytes): before, a failed fdatasync forgot it silently.
class RelocationFailureTest : public DurabilityTest,
                              public ::testing::WithParamInterface<bool /*sync fails*/> {};

TEST_P(RelocationFailureTest, AFailedRelocationCommitKeepsTheUnitsInTheVictim) {
  const bool sync_fails = GetParam();
  constexpr size_t kUnitBytes = 20000;  // not compressed (global KV): 20128-byte records
  constexpr uint64_t kSegmentBytes = 1ull << 20;
  FaultInjectionEnv fault(base_.get(), {});
  TierManagerOptions o = Options(Durability::kBatched, &fault);
  o.ssd_write_buffer_bytes = 256 << 10;  // the clean's relocations and the put share a buffer
  auto tm = Open(o);
  ASSERT_NE(tm, nullptr);
  PutOptions ssd;
  ssd.highest_tier = Tier::kSsd;
  // Segment 1: units 0..29, then all but 0..2 deleted: sparse, the next roll cleans it.
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1, ssd, kUnitBytes).ok());
  ASSERT_TRUE(tm->Flush().ok());
  for (int i = 3; i < 30; ++i) ASSERT_TRUE(tm->Delete(MakeKey(i)).ok());
  // Overwrites of one filler unit (each flushed: nothing pending) until the next record rolls
  // the segment; then the fault is armed and unit 600 rolls it.
  auto next_rolls = [&] {
    LogPosition end = *tm->SsdLogEnd();
    return ((end.offset + kUnitBytes + 128 + 4095) / 4096) * 4096 > kSegmentBytes;
  };
  const uint32_t first_segment = tm->SsdLogEnd()->segment;
  uint64_t filler = 0;
  for (int n = 0; !next_rolls(); ++n) {
    ASSERT_LT(n, 100);
    ASSERT_TRUE(PutVersion(tm.get(), 500, ++filler, ssd, kUnitBytes).ok());
    ASSERT_TRUE(tm->Flush().ok());
  }
  if (sync_fails) {
    fault.FailNextSyncs(1);
  } else {
    fault.FailNextWrites(1);
  }
  ASSERT_TRUE(PutVersion(tm.get(), 600, 1, ssd, kUnitBytes).ok());  // batched: acknowledged
  ASSERT_EQ(tm->SsdLogEnd()->segment, first_segment + 1) << "unit 600 did not roll";
  // The segment thread cleans segment 1 into the active segment and commits: that fails.
  ASSERT_TRUE(Eventually([&] { return tm->GetStats().ssd_commit_failures >= 1; }));
  EXPECT_EQ(tm->GetStats().ssd_last_failed_stage,
            sync_fails ? CommitStage::kSync : CommitStage::kBufferWrite);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 1u) << "lost relocated unit " << i;
  EXPECT_EQ(VersionOf(tm.get(), 500), filler) << "lost the relocated filler";
  std::vector<Key> chain{MakeKey(600)};
  LookupResult r = tm->Lookup(chain);
  EXPECT_EQ(r.hit_count, 0u) << "a put whose commit failed is not served";
  EXPECT_EQ(r.first_miss, MissReason::kIoError) << MissReasonName(r.first_miss);
  Stats s = tm->GetStats();
  ASSERT_EQ(s.tenant_bytes.size(), 1u);
  EXPECT_EQ(s.tenant_bytes[0].second, 4 * kUnitBytes) << "the lost unit is still accounted";
  EXPECT_EQ(s.segments_cleaned, 0u) << "the victim went although its units did not move";
  // The next roll cleans segment 1 again, now with success: the victim goes, the units stay.
  for (int n = 0; tm->SsdLogEnd()->segment == first_segment + 1; ++n) {
    ASSERT_LT(n, 100);
    ASSERT_TRUE(PutVersion(tm.get(), 500, ++filler, ssd, kUnitBytes).ok());
    ASSERT_TRUE(tm->Flush().ok());
  }
  ASSERT_TRUE(Eventually([&] { return tm->GetStats().segments_cleaned >= 1; }));
  ASSERT_TRUE(tm->Flush().ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(VersionOf(tm.get(), i), 1u) << "lost unit " << i;
  Crash(fault);
  tm.reset();
  auto after = Reopen(Durability::kBatched);
  ASSERT_NE(after, nullptr);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(VersionOf(after.get(), i), 1u) << "lost unit " << i;
  EXPECT_EQ(VersionOf(after.get(), 500), filler);
  for (int i = 3; i < 30; ++i) EXPECT_EQ(VersionOf(after.get(), i), 0u) << "resurrected " << i;
}

INSTANTIATE_TEST_SUITE_P(Failures, RelocationFailureTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Sync" : "BufferWrite"; });

// A failed buffer write leaves a hole in its segment (the range was never written), and the
// recovery tail scan stops at it. A sync put acknowledged after the hole, in the same segment,
// is recovered by that scan when a power failure loses its unsynced index write, so the scan
// must start past the hole: the commit that covers a failed buffer write syncs its index
// (durable_end past the hole). Before, it synced only when the buffer's units were dropped
// (their deletes sync), not when every record in it was superseded already: the scan started
// before the hole (at the last synced commit), stopped there, and the acknowledged put was
// gone after the crash. The crash keeps the RocksDB index as of its last synced write.
TEST_F(DurabilityTest, SyncPutsAfterAFailedBufferWriteSurviveAPowerFailure) {
  SsdOptions o;
  o.dir = dir_.path();
  o.capacity_bytes = 16ull << 20;
  o.segment_bytes = 1ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.durability = Durability::kSync;
  o.group_commit_ms = 3'600'000;
  SsdMeta meta;  // global KV: stored as is
  meta.version = 1;
  Key k = MakeKey(1), c = MakeKey(2);
  {
    FaultInjectionEnv fault(base_.get(), {});
    o.env = &fault;
    auto opened = SsdTier::Open(o);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    SsdTier& ssd = **opened;
    auto take_image = [&] {
      std::error_code ec;
      std::filesystem::remove_all(image_.path() + "/index", ec);
      std::filesystem::copy(dir_.path() + "/index", image_.path() + "/index",
                            std::filesystem::copy_options::recursive, ec);
      ASSERT_FALSE(ec) << ec.message();
    };
    take_image();  // Open synced the index
    uint64_t index_syncs = ssd.GetStats().index_syncs;
    auto image_if_synced = [&] {
      if (ssd.GetStats().index_syncs == index_syncs) return;
      index_syncs = ssd.GetStats().index_syncs;
      take_image();
    };
    // Two versions of k, not committed yet (deferred): the second does not fit in the write
    // buffer beside the first, so the first goes out alone, and that write fails. Nothing in
    // the hole is indexed (the first version is superseded), so nothing is dropped.
    uint64_t t1 = 0, t2 = 0;
    ASSERT_TRUE(ssd.Put(k, MakeValue(k, 1, 40000), meta, nullptr, nullptr, &t1).ok());
    fault.FailNextWrites(1);
    meta.version = 2;
    ASSERT_TRUE(ssd.Put(k, MakeValue(k, 2, 40000), meta, nullptr, nullptr, &t2).ok());
    EXPECT_TRUE(ssd.WaitDurable(t2).IsIOError()) << "the commit covers the failed write";
    EXPECT_EQ(ssd.GetStats().last_failed_stage, CommitStage::kBufferWrite);
    image_if_synced();
    // Acknowledged after the hole, in the same segment.
    meta.version = 3;
    ASSERT_TRUE(ssd.Put(c, MakeValue(c, 3, 40000), meta, nullptr).ok());
    image_if_synced();
    fault.SimulateCrash();
    crashed_ = true;
  }
  o.env = base_.get();
  o.dir = image_.path();
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  std::vector<uint8_t> out;
  Status st = (*opened)->Get(c, &out);
  ASSERT_TRUE(st.ok()) << "lost an acknowledged sync put: " << st.ToString();
  EXPECT_EQ(out, MakeValue(c, 3, 40000));
  st = (*opened)->Get(k, &out);  // reported failed: absent, or its second version
  if (st.ok()) {
    EXPECT_EQ(out, MakeValue(k, 2, 40000));
  }
}

// The same when the cleaner moves a record whose own put is still being committed: that put's
// commit succeeding must not settle the relocation (both carry the record's seq). Here the
// put's commit is held at its fdatasync while the cleaner copies the record and waits to
// commit; then the put's commit ends and the relocation's buffer write fails. Before, the
// put's commit forgot where the relocation came from, and the unit was dropped as lost.
TEST_F(DurabilityTest, ARelocationOfARecordStillBeingCommittedSurvivesItsFailedWrite) {
  constexpr size_t kUnitBytes = 20000;  // 20128-byte records
  constexpr uint64_t kSegmentBytes = 1ull << 20;
  FaultInjectionEnv fault(base_.get(), {});
  SsdOptions o;
  o.dir = dir_.path();
  o.env = &fault;
  o.capacity_bytes = 16ull << 20;
  o.segment_bytes = kSegmentBytes;
  o.write_buffer_bytes = 256 << 10;
  o.durability = Durability::kBatched;
  o.group_commit_ms = 3'600'000;
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  SsdMeta meta;
  meta.version = 1;
  auto put = [&](int i) {
    return ssd.Put(MakeKey(i), MakeValue(MakeKey(i), 1, kUnitBytes), meta, nullptr);
  };
  // Segment 1: unit 0 stays, 1..29 go; then overwrites of a filler until only one more record
  // fits before the segment end.
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(put(i).ok());
  ASSERT_TRUE(ssd.Flush().ok());
  for (int i = 1; i < 30; ++i) ASSERT_TRUE(ssd.Remove(MakeKey(i)).ok());
  auto fits = [&](int records) {
    return ((ssd.LogEnd().offset + records * (kUnitBytes + 128) + 4095) / 4096) * 4096 <=
           kSegmentBytes;
  };
  for (int n = 0; fits(2); ++n) {
    ASSERT_LT(n, 100);
    ASSERT_TRUE(put(500).ok());
    ASSERT_TRUE(ssd.Flush().ok());
  }
  ASSERT_TRUE(fits(1));
  const uint32_t first = ssd.LogEnd().segment;
  // Unit 7's put, committed by a Flush held at its fdatasync.
  fault.PauseSyncs(true);
  ASSERT_TRUE(put(7).ok());
  std::thread flush([&] { EXPECT_TRUE(ssd.Flush().ok()); });
  struct Release {  // a failing assertion must not leave the flush blocked
    FaultInjectionEnv& fault;
    std::thread& flush;
    ~Release() {
      fault.PauseSyncs(false);
      if (flush.joinable()) flush.join();
    }
  } release{fault, flush};
  ASSERT_TRUE(Eventually([&] { return fault.syncs_waiting() == 1; }));
  // The filler rolls the segment; the cleaner moves units 0 and 7 (segment 1 is sparse) and
  // waits for the commit in flight.
  ASSERT_TRUE(put(500).ok());
  ASSERT_EQ(ssd.LogEnd().segment, first + 1);
  ASSERT_TRUE(Eventually([&] { return ssd.GetStats().relocated_bytes >= 2 * (kUnitBytes + 128); }));
  fault.FailNextWrites(1);  // the relocations' buffer, written by the cleaner's commit
  fault.PauseSyncs(false);
  flush.join();
  ASSERT_TRUE(Eventually([&] { return ssd.GetStats().commit_failures >= 1; }));
  EXPECT_EQ(ssd.GetStats().last_failed_stage, CommitStage::kBufferWrite);
  std::vector<uint8_t> out;
  for (int i : {0, 7}) {
    Status st = ssd.Get(MakeKey(i), &out);
    ASSERT_TRUE(st.ok()) << "lost unit " << i << ": " << st.ToString();
    EXPECT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
  }
  EXPECT_EQ(ssd.GetStats().segments_cleaned, 0u);
}

// SSD I/O errors are io_error misses, not never_stored: a failed read (Get) and a unit lost
// to a failed buffer write (Lookup's first_miss).
TEST_F(DurabilityTest, IoErrorsAreTheirOwnMissReason) {
  FaultInjectionEnv fault(base_.get(), {});
  auto tm = Open(Options(Durability::kBatched, &fault));
  ASSERT_NE(tm, nullptr);
  PutOptions ssd;
  ssd.highest_tier = Tier::kSsd;
  ASSERT_TRUE(PutVersion(tm.get(), 1, 1, ssd).ok());
  ASSERT_TRUE(tm->Flush().ok());  // on the device, not in a write buffer
  fault.FailNextReads(1);
  std::vector<uint8_t> out;
  Status st = tm->Get(MakeKey(1), &out);
  EXPECT_TRUE(st.IsNotFound()) << st.ToString();
  Stats s = tm->GetStats();
  EXPECT_EQ(s.misses_io_error, 1u);
  EXPECT_EQ(s.misses_never_stored, 0u);
  EXPECT_EQ(VersionOf(tm.get(), 1), 1u) << "the entry stays after a read error";

  ASSERT_TRUE(PutVersion(tm.get(), 2, 1, ssd).ok());  // batched: acknowledged, then lost
  fault.FailNextWrites(1);
  EXPECT_FALSE(tm->Flush().ok());
  std::vector<Key> chain{MakeKey(2)};
  LookupResult r = tm->Lookup(chain);
  EXPECT_EQ(r.hit_count, 0u);
  EXPECT_EQ(r.first_miss, MissReason::kIoError);
  EXPECT_STREQ(MissReasonName(r.first_miss), "io_error");
  EXPECT_EQ(tm->GetStats().misses_io_error, 2u);
}

// A new segment's directory entry is synced before any commit names it: a crash right after
// a roll loses nothing acknowledged (without the directory fsync the new segment file is
// gone after the crash and recovery drops the index entries that name it).
TEST_F(DurabilityTest, NewSegmentsSurviveACrashThroughTheDirectoryFsync) {
  constexpr int kUnits = 60;  // 60 x 50 KB = 3 MB: several 1 MiB segments
  {
    FaultInjectionEnv fault(base_.get(), {});
    auto tm = Open(Options(Durability::kSync, &fault));
    ASSERT_NE(tm, nullptr);
    PutOptions ssd;
    ssd.highest_tier = Tier::kSsd;
    for (int i = 0; i < kUnits; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1, ssd, 50000).ok());
    Crash(fault);
  }
  auto names = base_->List();
  ASSERT_TRUE(names.ok());
  EXPECT_GE(names->size(), 3u);
  auto tm = Reopen(Durability::kSync);
  ASSERT_NE(tm, nullptr);
  for (int i = 0; i < kUnits; ++i) ASSERT_EQ(VersionOf(tm.get(), i), 1u) << "lost unit " << i;
}

// Under sync, a put's commit syncs its data only: the index write's WAL is not synced (one
// synced write per commit, as Redis's appendfsync always). A power failure that loses those
// index writes loses no acknowledged put: RocksDB comes back as of an earlier commit, and the
// tail scan from that commit's durable_end re-indexes every record written since, across
// segment rolls, newest version last. A delete does sync the index with its commit.
TEST_F(DurabilityTest, SyncPutsSurviveAnIndexThatLostTheirUnsyncedCommits) {
  constexpr int kUnits = 80;  // 80 x 50 KB: the unsynced commits span several 1 MiB segments
  {
    FaultInjectionEnv fault(base_.get(), {});
    auto tm = Open(Options(Durability::kSync, &fault));
    ASSERT_NE(tm, nullptr);
    PutOptions ssd;
    ssd.highest_tier = Tier::kSsd;
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(PutVersion(tm.get(), i, 1, ssd, 50000).ok());
    // Flush syncs the index: the state a power failure goes back to (taken as the image).
    ASSERT_TRUE(tm->Flush().ok());
    std::error_code ec;
    std::filesystem::copy(dir_.path() + "/index", image_.path() + "/index",
                          std::filesystem::copy_options::recursive, ec);
    ASSERT_FALSE(ec) << ec.message();
    uint64_t index_syncs = tm->GetStats().ssd_index_syncs;
    for (int i = 0; i < kUnits; ++i) {
      ASSERT_TRUE(PutVersion(tm.get(), i, i < 5 ? 2 : 1, ssd, 50000).ok());
    }
    EXPECT_EQ(tm->GetStats().ssd_index_syncs, index_syncs) << "a put synced the index";
    fault.SimulateCrash();  // the index stays as the image: its later commits are lost
    crashed_ = true;
  }
  auto tm = Reopen(Durability::kSync);
  ASSERT_NE(tm, nullptr);
  for (int i = 0; i < kUnits; ++i) {
    ASSERT_EQ(VersionOf(tm.get(), i), i < 5 ? 2u : 1u) << "lost unit " << i;
  }
  uint64_t index_syncs = tm->GetStats().ssd_index_syncs;
  ASSERT_TRUE(tm->Delete(MakeKey(7)).ok());
  EXPECT_EQ(tm->GetStats().ssd_index_syncs, index_syncs + 1) << "a delete left the index unsynced";
  EXPECT_EQ(VersionOf(tm.get(), 7), 0u);
}

// The fault env models directory entries: an unsynced create is lost in a crash, an
// unsynced remove is undone.
TEST(FaultInjectionDirTest, UnsyncedDirectoryEntriesFollowTheCrash) {
  auto base = NewMemEnv();
  {
    auto kept = base->Open("kept", true);
    ASSERT_TRUE(kept.ok());
  }
  {
    FaultInjectionEnv fault(base.get(), {});
    ASSERT_TRUE(fault.Open("synced", true).ok());
    ASSERT_TRUE(fault.SyncDir().ok());
    ASSERT_TRUE(fault.Open("unsynced", true).ok());
    ASSERT_TRUE(fault.Remove("kept").ok());
    auto listed = fault.List();
    ASSERT_TRUE(listed.ok());
    EXPECT_EQ(*listed, (std::vector<std::string>{"synced", "unsynced"}));
    EXPECT_TRUE(fault.Open("kept", false).status().IsNotFound());
    fault.SimulateCrash();
  }
  auto names = base->List();
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"kept", "synced"}));
  {
    FaultInjectionEnv fault(base.get(), {});
    ASSERT_TRUE(fault.Remove("kept").ok());
    ASSERT_TRUE(fault.SyncDir().ok());
  }
  names = base->List();
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"synced"}));
}

}  // namespace
}  // namespace kvtier::storage

namespace kvtier::storage {
namespace {

// ReplaySsdLog (what kvtierd reads RESP names back from): from a position SsdLogEnd gave, it
// visits exactly the records appended after it, across segment rolls, with their decoded
// values (compressed ones too), also of units deleted since; from the start it visits all.
TEST_F(DurabilityTest, ReplaySsdLogVisitsExactlyTheRecordsAppendedAfterAPosition) {
  constexpr int kBefore = 40, kAfter = 300;  // 5000-byte units: several 1 MiB segments
  auto tm = Open(Options(Durability::kSync, base_.get()));
  ASSERT_NE(tm, nullptr);
  auto put = [&](int i) {
    Key k = MakeKey(i);
    return tm->Put(k, MakeValue(k, 1, kValueBytes, /*compressible=*/i % 3 == 0), {});
  };
  for (int i = 0; i < kBefore; ++i) ASSERT_TRUE(put(i).ok());
  std::optional<LogPosition> mid = tm->SsdLogEnd();
  ASSERT_TRUE(mid.has_value());
  for (int i = kBefore; i < kBefore + kAfter; ++i) ASSERT_TRUE(put(i).ok());
  ASSERT_TRUE(tm->Delete(MakeKey(kBefore + 5)).ok());  // its record stays in the log
  ASSERT_GT(tm->SsdLogEnd()->segment, mid->segment) << "the walk should cross a roll";

  std::map<Key, int> seen;
  auto visit = [&](TenantId, const Key& k, std::span<const uint8_t> value) {
    uint64_t v = 0;
    EXPECT_TRUE(CheckValue(k, std::vector<uint8_t>(value.begin(), value.end()), &v));
    ++seen[k];
  };
  ASSERT_TRUE(tm->ReplaySsdLog(*mid, visit).ok());
  EXPECT_EQ(seen.size(), static_cast<size_t>(kAfter));
  for (int i = kBefore; i < kBefore + kAfter; ++i) EXPECT_EQ(seen[MakeKey(i)], 1) << i;
  for (int i = 0; i < kBefore; ++i) EXPECT_EQ(seen.count(MakeKey(i)), 0u) << i;

  seen.clear();
  ASSERT_TRUE(tm->ReplaySsdLog(LogPosition{}, visit).ok());
  EXPECT_EQ(seen.size(), static_cast<size_t>(kBefore + kAfter));
}

}  // namespace
}  // namespace kvtier::storage
