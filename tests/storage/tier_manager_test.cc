// TierManager placement over HBM, DRAM and SSD: demotion and promotion, peeks, flushes, miss
// reasons, pins, tenants and quotas, conditional puts (if absent), policies at run time, SWA
// state kept off SSD; and the memory tiers' arenas (CUDA or mmap).
// Part of kvtier_storage_test (tests/storage/CMakeLists.txt).
#include "storage/tier_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/key_util.h"
#include "storage/memory_tier.h"
#include "tests/cuda_required.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

// ---------------------------------------------------------- TierManager ----

class TierManagerTest : public ::testing::Test {
 protected:
  TierManagerOptions Options() {
    TierManagerOptions o;
    o.hbm_capacity_bytes = 0;
    o.dram_capacity_bytes = 1ull << 20;
    o.slab_page_bytes = 64 << 10;
    o.ssd_capacity_bytes = 32ull << 20;
    o.ssd_segment_bytes = 2ull << 20;
    o.ssd_write_buffer_bytes = 256 << 10;
    o.data_dir = dir_.path();
    o.ssd_env = env_.get();
    o.clock = &clock_;
    return o;
  }
  TempDir dir_;
  std::unique_ptr<DeviceEnv> env_ = NewMemEnv();
  ManualClock clock_{1'000'000};
};

// Demotion through the admission policy: durability none (under batched / sync a DRAM put
// is written through to SSD at once, see tests/storage/durability_test.cc).
TEST_F(TierManagerTest, DramEvictionDemotesToSsdAndGetPromotes) {
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  constexpr int kUnits = 200;  // 200 x 20 KB = 4 MB into a 1 MB DRAM tier
  for (int i = 0; i < kUnits; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  }
  std::vector<Key> chain;
  for (int i = 0; i < kUnits; ++i) chain.push_back(MakeKey(i));
  LookupResult r = (*tm)->Lookup(chain);
  ASSERT_EQ(r.hit_count, static_cast<size_t>(kUnits));
  EXPECT_EQ(r.tiers.front(), Tier::kSsd);
  EXPECT_EQ(r.tiers.back(), Tier::kDram);
  Stats s = (*tm)->GetStats();
  EXPECT_GT(s.dram.evictions, 0u);
  EXPECT_GT(s.admissions, 0u);
  EXPECT_LE(s.dram.used_bytes, 1ull << 20);
  std::vector<uint8_t> out;
  Tier from;
  ASSERT_TRUE((*tm)->Get(chain[0], &out, &from).ok());
  EXPECT_EQ(from, Tier::kSsd);
  EXPECT_EQ(out, MakeValue(chain[0], 1, 20000));
  ASSERT_TRUE((*tm)->Get(chain[0], &out, &from).ok());
  EXPECT_EQ(from, Tier::kDram);  // promoted
  // Prefetch promotes as well.
  ASSERT_TRUE((*tm)->Prefetch(std::span<const Key>(chain.data() + 1, 1)).ok());
  EXPECT_EQ((*tm)->Lookup(std::span<const Key>(chain.data() + 1, 1)).tiers[0], Tier::kDram);
  // Overwrite: the stale SSD copy must not come back.
  ASSERT_TRUE((*tm)->Put(chain[0], MakeValue(chain[0], 2, 20000), {}).ok());
  for (int i = 100; i < kUnits; ++i) ASSERT_TRUE((*tm)->Get(chain[i], &out).ok());
  ASSERT_TRUE((*tm)->Get(chain[0], &out).ok());
  EXPECT_EQ(out, MakeValue(chain[0], 2, 20000));
}

// A clock that moves 1 ms every time it is read: any two readings differ.
class TickingClock final : public Clock {
 public:
  explicit TickingClock(uint64_t start_us) : now_us_(start_us) {}
  uint64_t NowUs() const override { return now_us_.fetch_add(1000); }
  void SetUs(uint64_t now_us) { now_us_.store(now_us); }

 private:
  mutable std::atomic<uint64_t> now_us_;
};

// ListUnits reports a unit's time left from one reading of the clock: with two (expired?,
// then time left) a unit listed at its expiry was reported with 0 ms left, "never expires",
// and a repair or refetch copy of it lived for ever. Every listing is tried here at each
// time around the unit's expiry; the unit is either left out or has 1..ttl ms left.
TEST_F(TierManagerTest, ListedUnitsNeverOutliveTheirTtl) {
  TickingClock clock(1'000'000);
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;
  o.clock = &clock;
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  constexpr uint64_t kTtlMs = 20;
  clock.SetUs(1'000'000);
  const Key k = MakeKey(7);
  PutOptions p;
  p.ttl_ms = kTtlMs;
  ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 100), p).ok());
  int listed = 0;
  for (uint64_t at_ms = 1005; at_ms < 1000 + kTtlMs + 10; ++at_ms) {  // past the put's readings
    clock.SetUs(at_ms * 1000);
    UnitCursor cursor;
    std::vector<UnitInfo> page;
    while (!cursor.done) (*tm)->ListUnits(&cursor, 16, &page);
    for (const UnitInfo& u : page) {
      ASSERT_EQ(u.key, k);
      ++listed;
      EXPECT_GE(u.ttl_left_ms, 1u) << "listed at " << at_ms << " ms as never expiring";
      EXPECT_LE(u.ttl_left_ms, kTtlMs) << "listed at " << at_ms << " ms";
    }
  }
  EXPECT_GT(listed, 0);
}

// Peek describes the version it read, as ListUnits would. The repair scan used to copy the value
// Peek returned with the metadata of its listing: a PUT between the two (here v2, with a TTL,
// over v1, without) sent v2 with v1's "no expiry", and the copy outlived v2 for good (the
// cluster judge, seed 1023: a TTL unit served 1.26 s past its TTL through every node).
TEST_F(TierManagerTest, PeekDescribesTheVersionItReadNotAnEarlierListing) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  const Key k = MakeKey(3);
  PutOptions v1;
  v1.tenant = 4;
  ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 2000), v1).ok());
  UnitCursor cursor;
  std::vector<UnitInfo> listing;
  (*tm)->ListUnits(&cursor, 16, &listing);
  ASSERT_EQ(listing.size(), 1u);
  ASSERT_EQ(listing[0].ttl_left_ms, 0u);

  for (Tier highest : {Tier::kDram, Tier::kSsd}) {
    PutOptions v2;
    v2.tenant = 4;
    v2.kind = policies::ObjectKind::kSwa;
    v2.parent = MakeKey(9);
    v2.recompute_tokens = 77;
    v2.ttl_ms = 60000;
    v2.highest_tier = highest;
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 2, 3000), v2).ok());
    std::vector<uint8_t> out;
    UnitInfo read;
    ASSERT_TRUE((*tm)->Peek(k, &out, &read).ok());
    EXPECT_EQ(out, MakeValue(k, 2, 3000));
    EXPECT_EQ(read.key, k);
    EXPECT_EQ(read.tier, highest);
    EXPECT_EQ(read.tenant, 4u);
    EXPECT_EQ(read.bytes, out.size());
    EXPECT_EQ(read.kind, policies::ObjectKind::kSwa);
    EXPECT_EQ(ObjectIdOf(read.parent), ObjectIdOf(MakeKey(9)));
    EXPECT_EQ(read.recompute_tokens, 77u);
    EXPECT_GT(read.ttl_left_ms, 0u) << "v2 described as never expiring";
    EXPECT_LE(read.ttl_left_ms, 60000u);
  }
}

// Describe is ListUnits for one key, from metadata alone: the same description for a unit
// in DRAM and on SSD, nothing for an absent or expired one, and no read (no hit counted, no
// SSD read, nothing promoted).
TEST_F(TierManagerTest, DescribeListsOneUnitWithoutReadingIt) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  PutOptions in_dram, on_ssd, short_lived;
  in_dram.tenant = on_ssd.tenant = 5;
  in_dram.ttl_ms = 60000;
  on_ssd.highest_tier = Tier::kSsd;
  on_ssd.recompute_tokens = 64;
  short_lived.ttl_ms = 1;
  ASSERT_TRUE((*tm)->Put(MakeKey(1), MakeValue(MakeKey(1), 1, 3000), in_dram).ok());
  ASSERT_TRUE((*tm)->Put(MakeKey(2), MakeValue(MakeKey(2), 1, 3000), on_ssd).ok());
  ASSERT_TRUE((*tm)->Put(MakeKey(3), MakeValue(MakeKey(3), 1, 3000), short_lived).ok());
  clock_.AdvanceMs(5);  // past the short TTL
  const Stats before = (*tm)->GetStats();
  UnitCursor cursor;
  std::vector<UnitInfo> listed;
  (*tm)->ListUnits(&cursor, 16, &listed);
  ASSERT_EQ(listed.size(), 2u) << "the expired unit is listed";
  for (const UnitInfo& l : listed) {
    UnitInfo d;
    ASSERT_TRUE((*tm)->Describe(l.key, &d));
    EXPECT_EQ(d.key, l.key);
    EXPECT_EQ(d.tenant, l.tenant);
    EXPECT_EQ(d.bytes, l.bytes);
    EXPECT_EQ(d.tier, l.tier);
    EXPECT_EQ(d.kind, l.kind);
    EXPECT_EQ(d.recompute_tokens, l.recompute_tokens);
    EXPECT_EQ(d.allow_ssd, l.allow_ssd);
    EXPECT_LE(d.ttl_left_ms, l.ttl_left_ms);
    EXPECT_EQ(d.ttl_left_ms == 0, l.ttl_left_ms == 0);
  }
  UnitInfo d;
  ASSERT_TRUE((*tm)->Describe(MakeKey(2), &d));
  EXPECT_EQ(d.tier, Tier::kSsd);
  EXPECT_EQ(d.tenant, 5u);
  EXPECT_EQ(d.recompute_tokens, 64u);
  EXPECT_EQ(d.ttl_left_ms, 0u);
  ASSERT_TRUE((*tm)->Describe(MakeKey(1), &d));
  EXPECT_EQ(d.tier, Tier::kDram);
  EXPECT_GT(d.ttl_left_ms, 0u);
  EXPECT_LE(d.ttl_left_ms, 60000u);
  EXPECT_FALSE((*tm)->Describe(MakeKey(3), &d)) << "expired";
  EXPECT_FALSE((*tm)->Describe(MakeKey(4), &d)) << "never stored";
  const Stats after = (*tm)->GetStats();
  EXPECT_EQ(after.dram.hits, before.dram.hits);
  EXPECT_EQ(after.ssd.hits, before.ssd.hits);
  EXPECT_EQ(after.ssd.bytes_read, before.ssd.bytes_read);
  EXPECT_EQ(after.dram.objects, before.dram.objects) << "a description promoted a unit";
}

// Peek (the cluster's repair reads) returns the value of an SSD unit without promoting it
// and without counting a hit: DRAM holds exactly what it held before.
TEST_F(TierManagerTest, PeekReadsSsdUnitsWithoutPromotingThem) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  PutOptions ssd_only;
  ssd_only.highest_tier = Tier::kSsd;
  constexpr int kUnits = 10;
  for (int i = 0; i < kUnits; ++i) {
    ASSERT_TRUE((*tm)->Put(MakeKey(i), MakeValue(MakeKey(i), 1, 20000), ssd_only).ok());
  }
  Stats before = (*tm)->GetStats();
  ASSERT_EQ(before.dram.objects, 0u);
  std::vector<uint8_t> out;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < kUnits; ++i) {
      UnitInfo read;
      ASSERT_TRUE((*tm)->Peek(MakeKey(i), &out, &read).ok());
      EXPECT_EQ(read.tier, Tier::kSsd);
      EXPECT_EQ(out, MakeValue(MakeKey(i), 1, 20000));
    }
  }
  EXPECT_TRUE((*tm)->Peek(MakeKey(kUnits), &out).IsNotFound());
  Stats after = (*tm)->GetStats();
  EXPECT_EQ(after.dram.objects, 0u);
  EXPECT_EQ(after.dram.used_bytes, before.dram.used_bytes);
  EXPECT_EQ(after.misses_never_stored, before.misses_never_stored);
  // A client Get of the same unit does promote it (so the check above can fail).
  ASSERT_TRUE((*tm)->Get(MakeKey(0), &out).ok());
  ASSERT_TRUE((*tm)->Get(MakeKey(0), &out).ok());
  EXPECT_EQ((*tm)->GetStats().dram.objects, 1u);
}

// Flush writes DRAM-only units back to SSD (keeping the DRAM copy), so a clean close and
// reopen loses nothing acknowledged; SWA units (allow_ssd=false) stay out of SSD. Durability
// none: the only mode in which DRAM puts are not written through at once.
TEST_F(TierManagerTest, FlushWritesDramUnitsBackSoTheySurviveReopen) {
  constexpr int kUnits = 20;  // 20 x 20 KB fits the 1 MB DRAM tier: nothing is demoted
  PutOptions swa;
  swa.kind = policies::ObjectKind::kSwa;
  swa.allow_ssd = false;
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;
  {
    auto tm = TierManager::Open(o);
    ASSERT_TRUE(tm.ok()) << tm.status().ToString();
    for (int i = 0; i < kUnits; ++i) {
      Key k = MakeKey(i);
      ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
    }
    Key swa_key = MakeKey(1000);
    ASSERT_TRUE((*tm)->Put(swa_key, MakeValue(swa_key, 1, 2000), swa).ok());
    EXPECT_EQ((*tm)->GetStats().ssd.objects, 0u) << "nothing was demoted before the flush";
    ASSERT_TRUE((*tm)->Flush().ok());
    EXPECT_EQ((*tm)->GetStats().ssd.objects, static_cast<uint64_t>(kUnits));
    std::vector<uint8_t> out;
    Tier from = Tier::kNone;
    ASSERT_TRUE((*tm)->Get(MakeKey(0), &out, &from).ok());
    EXPECT_EQ(from, Tier::kDram) << "the DRAM copy is kept";
    ASSERT_TRUE((*tm)->Flush().ok());  // idempotent: the same versions are not written twice
    EXPECT_EQ((*tm)->GetStats().ssd.objects, static_cast<uint64_t>(kUnits));
  }
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  std::vector<uint8_t> out;
  for (int i = 0; i < kUnits; ++i) {
    Key k = MakeKey(i);
    Tier from = Tier::kNone;
    ASSERT_TRUE((*tm)->Get(k, &out, &from).ok()) << i;
    EXPECT_EQ(from, Tier::kSsd);
    EXPECT_EQ(out, MakeValue(k, 1, 20000));
  }
  EXPECT_TRUE((*tm)->Get(MakeKey(1000), &out).IsNotFound()) << "SWA state never reaches SSD";
}

TEST_F(TierManagerTest, HbmDramSsdPlacement) {
  TierManagerOptions o = Options();
  o.hbm_capacity_bytes = 256 << 10;
  o.dram_capacity_bytes = 512 << 10;
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  PutOptions p;
  p.highest_tier = Tier::kHbm;
  std::vector<Key> chain;
  for (int i = 0; i < 80; ++i) {
    chain.push_back(MakeKey(i));
    ASSERT_TRUE((*tm)->Put(chain.back(), MakeValue(chain.back(), 1, 16000), p).ok());
  }
  LookupResult r = (*tm)->Lookup(chain);
  ASSERT_EQ(r.hit_count, chain.size());
  EXPECT_EQ(r.tiers.front(), Tier::kSsd);
  EXPECT_EQ(r.tiers.back(), Tier::kHbm);
  EXPECT_NE(std::find(r.tiers.begin(), r.tiers.end(), Tier::kDram), r.tiers.end());
  std::vector<uint8_t> out;
  for (const Key& k : chain) {
    ASSERT_TRUE((*tm)->Get(k, &out).ok());
    EXPECT_EQ(out, MakeValue(k, 1, 16000));
  }
  Stats s = (*tm)->GetStats();
  EXPECT_GT(s.hbm.objects, 0u);
  EXPECT_GT(s.hbm.evictions, 0u);
}

TEST_F(TierManagerTest, MissReasons) {
  TierManagerOptions o = Options();
  o.ssd_capacity_bytes = 0;  // DRAM only: evicted units are gone
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok());
  Key never = MakeKey(999);
  Key chain1[] = {never};
  EXPECT_EQ((*tm)->Lookup(chain1).first_miss, MissReason::kNeverStored);
  PutOptions ttl;
  ttl.ttl_ms = 1000;
  Key t = MakeKey(500);
  ASSERT_TRUE((*tm)->Put(t, MakeValue(t, 1, 1000), ttl).ok());
  Key chain2[] = {t};
  EXPECT_EQ((*tm)->Lookup(chain2).hit_count, 1u);
  clock_.AdvanceMs(1001);
  LookupResult r = (*tm)->Lookup(chain2);
  EXPECT_EQ(r.hit_count, 0u);
  EXPECT_EQ(r.first_miss, MissReason::kExpired);
  std::vector<uint8_t> out;
  EXPECT_TRUE((*tm)->Get(t, &out).IsNotFound());
  for (int i = 0; i < 200; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  }
  Key chain3[] = {MakeKey(199), MakeKey(0)};
  r = (*tm)->Lookup(chain3);
  EXPECT_EQ(r.hit_count, 1u);
  EXPECT_EQ(r.first_miss, MissReason::kEvicted);
  EXPECT_GT((*tm)->GetStats().misses_evicted, 0u);
  // Re-storing clears the reason; deleting makes it "never stored" again.
  ASSERT_TRUE((*tm)->Put(MakeKey(0), MakeValue(MakeKey(0), 2, 100), {}).ok());
  ASSERT_TRUE((*tm)->Delete(MakeKey(0)).ok());
  EXPECT_TRUE((*tm)->Delete(MakeKey(0)).IsNotFound());
  Key chain4[] = {MakeKey(0)};
  EXPECT_EQ((*tm)->Lookup(chain4).first_miss, MissReason::kNeverStored);
}

// A unit whose TTL has run out is absent for a Delete too: NotFound (it is removed all the
// same), as for a read. Delete used to answer OK for it, so a RESP DEL counted an expired key
// as deleted (Redis counts it not; the differential test found it).
TEST_F(TierManagerTest, DeletingAnExpiredUnitFindsNothing) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok());
  PutOptions ttl;
  ttl.ttl_ms = 1000;
  PutOptions ssd = ttl;  // an SSD record's expiry is Unix time: it runs on the real clock
  ssd.ttl_ms = 20;
  ssd.highest_tier = Tier::kSsd;
  const Key in_dram = MakeKey(1), on_ssd = MakeKey(2), live = MakeKey(3);
  ASSERT_TRUE((*tm)->Put(in_dram, MakeValue(in_dram, 1, 1000), ttl).ok());
  ASSERT_TRUE((*tm)->Put(on_ssd, MakeValue(on_ssd, 1, 1000), ssd).ok());
  PutOptions longer = ttl;
  longer.ttl_ms = 5000;
  ASSERT_TRUE((*tm)->Put(live, MakeValue(live, 1, 1000), longer).ok());
  clock_.AdvanceMs(1001);
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  EXPECT_TRUE((*tm)->Delete(in_dram).IsNotFound());
  EXPECT_TRUE((*tm)->Delete(on_ssd).IsNotFound());
  DeferredCommit deferred;
  EXPECT_TRUE((*tm)->DeleteDeferred(live, &deferred).ok()) << "a unit with TTL left";
  EXPECT_TRUE((*tm)->CompletePut(deferred).ok());
  for (const Key& k : {in_dram, on_ssd, live}) {
    std::vector<uint8_t> out;
    EXPECT_TRUE((*tm)->Get(k, &out).IsNotFound());
    EXPECT_TRUE((*tm)->Delete(k).IsNotFound()) << "removed by the first delete";
  }
}

// GetWithTtl reports what is left of a unit's TTL (a cluster GET copy must not outlive the
// unit): counted down on the store's clock in DRAM, from the record's expiry on SSD; 0 for a
// unit without one.
TEST_F(TierManagerTest, GetWithTtlReportsTheTimeLeft) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok());
  PutOptions ttl;
  ttl.ttl_ms = 5000;
  Key t = MakeKey(1), forever = MakeKey(2), on_ssd = MakeKey(3);
  ASSERT_TRUE((*tm)->Put(t, MakeValue(t, 1, 1000), ttl).ok());
  ASSERT_TRUE((*tm)->Put(forever, MakeValue(forever, 1, 1000), {}).ok());
  PutOptions ssd = ttl;
  ssd.ttl_ms = 600'000;
  ssd.highest_tier = Tier::kSsd;
  ASSERT_TRUE((*tm)->Put(on_ssd, MakeValue(on_ssd, 1, 1000), ssd).ok());
  clock_.AdvanceMs(1200);
  std::vector<uint8_t> out;
  uint64_t left = 0;
  ASSERT_TRUE((*tm)->GetWithTtl(t, &out, &left).ok());
  EXPECT_EQ(out, MakeValue(t, 1, 1000));
  EXPECT_EQ(left, 3800u);
  left = 7;
  ASSERT_TRUE((*tm)->GetWithTtl(forever, &out, &left).ok());
  EXPECT_EQ(left, 0u);
  ASSERT_EQ((*tm)->Lookup(std::span<const Key>(&on_ssd, 1)).tiers[0], Tier::kSsd);
  ASSERT_TRUE((*tm)->GetWithTtl(on_ssd, &out, &left).ok());
  EXPECT_EQ(out, MakeValue(on_ssd, 1, 1000));
  EXPECT_GT(left, 0u);
  EXPECT_GE(left, 590'000u);  // counted down from the record's expiry, not made up
  EXPECT_LE(left, 600'000u);
  clock_.AdvanceMs(3800);
  EXPECT_TRUE((*tm)->GetWithTtl(t, &out, &left).IsNotFound());
}

// PutOptions::if_absent: a conditional put never replaces a live unit of the key, in any
// tier (the cluster's repair copies, GET copies and refetches rely on it: a newer write that
// got there first wins); it writes when the key is absent, expired or deleted.
TEST_F(TierManagerTest, PutIfAbsentNeverReplacesALiveUnit) {
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;  // DRAM puts stay in DRAM, SSD puts on SSD only
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  std::vector<uint8_t> out;
  bool held = true;
  PutOptions cond;
  cond.if_absent = true;
  cond.held = &held;

  // Absent: written, not held.
  Key a = MakeKey(1);
  ASSERT_TRUE((*tm)->Put(a, MakeValue(a, 1, 1000), cond).ok());
  EXPECT_FALSE(held);
  ASSERT_TRUE((*tm)->Get(a, &out).ok());
  EXPECT_EQ(out, MakeValue(a, 1, 1000));

  // A newer plain put got there first (DRAM, then SSD only): the older copy is refused.
  ASSERT_TRUE((*tm)->Put(a, MakeValue(a, 2, 1000), {}).ok());
  EXPECT_TRUE((*tm)->Put(a, MakeValue(a, 1, 1000), cond).IsRejected());
  EXPECT_TRUE(held);
  ASSERT_TRUE((*tm)->Get(a, &out).ok());
  EXPECT_EQ(out, MakeValue(a, 2, 1000)) << "a conditional put replaced a held unit (DRAM)";
  Key s = MakeKey(2);
  PutOptions ssd;
  ssd.highest_tier = Tier::kSsd;
  ASSERT_TRUE((*tm)->Put(s, MakeValue(s, 2, 5000), ssd).ok());
  ASSERT_EQ((*tm)->Lookup(std::span<const Key>(&s, 1)).tiers[0], Tier::kSsd);
  EXPECT_TRUE((*tm)->Put(s, MakeValue(s, 1, 5000), cond).IsRejected());
  EXPECT_TRUE(held);
  ASSERT_TRUE((*tm)->Get(s, &out).ok());
  EXPECT_EQ(out, MakeValue(s, 2, 5000)) << "a conditional put replaced a held unit (SSD)";

  // Deleted or expired: written again.
  ASSERT_TRUE((*tm)->Delete(a).ok());
  ASSERT_TRUE((*tm)->Put(a, MakeValue(a, 3, 1000), cond).ok());
  EXPECT_FALSE(held);
  ASSERT_TRUE((*tm)->Get(a, &out).ok());
  EXPECT_EQ(out, MakeValue(a, 3, 1000));
  Key t = MakeKey(3);
  PutOptions ttl;
  ttl.ttl_ms = 1000;
  ASSERT_TRUE((*tm)->Put(t, MakeValue(t, 1, 1000), ttl).ok());
  clock_.AdvanceMs(1001);
  ASSERT_TRUE((*tm)->Put(t, MakeValue(t, 2, 1000), cond).ok());
  EXPECT_FALSE(held);
  ASSERT_TRUE((*tm)->Get(t, &out).ok());
  EXPECT_EQ(out, MakeValue(t, 2, 1000));

  // Every other outcome leaves held false.
  held = true;
  EXPECT_TRUE((*tm)->Put(MakeKey(4), std::vector<uint8_t>(65ull << 20), cond).IsInvalidArgument());
  EXPECT_FALSE(held);
}

// Racing a plain put of the newer value with a conditional put of an older one, on a fresh
// key each round: whichever runs first, the newer value is what the store keeps.
TEST_F(TierManagerTest, PutIfAbsentRacingAPlainPutLeavesTheNewerValue) {
  TierManagerOptions o = Options();  // batched: puts go through the SSD step outside the lock
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  constexpr int kRounds = 200;
  for (int i = 0; i < kRounds; ++i) {
    Key k = MakeKey(100 + i);
    std::thread older([&] {
      PutOptions cond;
      cond.if_absent = true;
      (void)(*tm)->Put(k, MakeValue(k, 1, 3000), cond);
    });
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 2, 3000), {}).ok());
    older.join();
    std::vector<uint8_t> out;
    ASSERT_TRUE((*tm)->Get(k, &out).ok());
    ASSERT_EQ(out, MakeValue(k, 2, 3000)) << "round " << i << ": the older value won";
  }
}

TEST_F(TierManagerTest, PinnedUnitsSurviveUntilTheLeaseExpires) {
  TierManagerOptions o = Options();
  o.ssd_capacity_bytes = 0;
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok());
  Key pinned[] = {MakeKey(1), MakeKey(2)};
  for (const Key& k : pinned) ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  ASSERT_TRUE((*tm)->Pin(pinned, 5000).ok());
  Key absent[] = {MakeKey(77)};
  EXPECT_TRUE((*tm)->Pin(absent, 5000).IsNotFound());
  for (int i = 10; i < 300; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  }
  EXPECT_EQ((*tm)->Lookup(pinned).hit_count, 2u);
  clock_.AdvanceMs(5001);  // the lease expires: evictable again
  for (int i = 300; i < 600; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  }
  EXPECT_EQ((*tm)->Lookup(pinned).hit_count, 0u);
  // Unpin makes a unit evictable at once.
  Key p2[] = {MakeKey(1000)};
  ASSERT_TRUE((*tm)->Put(p2[0], MakeValue(p2[0], 1, 20000), {}).ok());
  ASSERT_TRUE((*tm)->Pin(p2, 1'000'000).ok());
  ASSERT_TRUE((*tm)->Unpin(p2).ok());
  for (int i = 600; i < 900; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  }
  EXPECT_EQ((*tm)->Lookup(p2).hit_count, 0u);
}

TEST_F(TierManagerTest, TenantsQuotasAndDeleteTenant) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok());
  PutOptions a, b;
  a.tenant = 1;
  b.tenant = 2;
  (*tm)->SetTenantQuota(1, 50000);
  Key k1 = MakeKey(1), k2 = MakeKey(2), k3 = MakeKey(3);
  ASSERT_TRUE((*tm)->Put(k1, MakeValue(k1, 1, 30000), a).ok());
  EXPECT_TRUE((*tm)->Put(k2, MakeValue(k2, 1, 30000), a).IsRejected());
  ASSERT_TRUE((*tm)->Put(k1, MakeValue(k1, 2, 40000), a).ok());  // replacing counts once
  ASSERT_TRUE((*tm)->Put(k3, MakeValue(k3, 1, 30000), b).ok());
  Stats s = (*tm)->GetStats();
  ASSERT_EQ(s.tenant_bytes.size(), 2u);
  EXPECT_EQ(s.tenant_bytes[0], std::make_pair(TenantId{1}, uint64_t{40000}));
  EXPECT_EQ(s.tenant_bytes[1], std::make_pair(TenantId{2}, uint64_t{30000}));
  ASSERT_TRUE((*tm)->DeleteTenant(1).ok());
  std::vector<uint8_t> out;
  EXPECT_TRUE((*tm)->Get(k1, &out).IsNotFound());
  ASSERT_TRUE((*tm)->Get(k3, &out).ok());
  s = (*tm)->GetStats();
  ASSERT_EQ(s.tenant_bytes.size(), 1u);
  EXPECT_EQ(s.tenant_bytes[0].first, TenantId{2});
  EXPECT_TRUE((*tm)->Put(k1, std::vector<uint8_t>(65ull << 20), a).IsInvalidArgument());
}

// A unit whose TTL has passed no longer counts against its tenant's quota once the quota
// refuses a put: the put first reclaims the tenant's expired units. Before, expiry was only
// enforced when something read the unit, so a tenant whose short-lived units nobody read
// again had its puts refused for ever by a quota full of dead bytes.
TEST_F(TierManagerTest, ExpiredUnitsStopChargingTheirTenantsQuota) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  TierManager& t = **tm;
  auto bytes_of = [&](TenantId tenant) {
    for (const auto& [id, bytes] : t.GetStats().tenant_bytes) {
      if (id == tenant) return bytes;
    }
    return uint64_t{0};
  };
  t.SetTenantQuota(1, 100000);
  t.SetTenantQuota(2, 100000);
  PutOptions short_lived, other;
  short_lived.tenant = 1;
  short_lived.ttl_ms = 1000;
  other.tenant = 2;
  other.ttl_ms = 1000;
  for (int i = 0; i < 3; ++i) {  // 90,000 of tenant 1's 100,000 bytes, expiring in 1 s
    const Key k = MakeKey(i);
    ASSERT_TRUE(t.Put(k, MakeValue(k, 1, 30000), short_lived).ok());
  }
  const Key kept = MakeKey(10), o = MakeKey(20);
  ASSERT_TRUE(t.Put(o, MakeValue(o, 1, 30000), other).ok());  // another tenant's, expiring too
  PutOptions forever;
  forever.tenant = 1;
  // A unit put with a TTL and then again without one: it never expires.
  ASSERT_TRUE(t.Put(MakeKey(2), MakeValue(MakeKey(2), 2, 5000), short_lived).ok());
  ASSERT_TRUE(t.Put(MakeKey(2), MakeValue(MakeKey(2), 3, 5000), forever).ok());
  EXPECT_EQ(bytes_of(1), 65000u);
  ASSERT_TRUE(t.Put(kept, MakeValue(kept, 1, 30000), forever).ok());  // 95,000
  const Key next = MakeKey(30);
  EXPECT_TRUE(t.Put(next, MakeValue(next, 1, 30000), short_lived).IsRejected()) << "over quota";

  clock_.AdvanceUs(2'000'000);  // everything with a TTL has expired; nobody reads it
  EXPECT_EQ(bytes_of(1), 95000u) << "expired units still count until a put needs the room";
  ASSERT_TRUE(t.Put(next, MakeValue(next, 1, 30000), short_lived).ok());
  EXPECT_EQ(bytes_of(1), 65000u) << "the two expired units were reclaimed; kept, 2 and next";
  EXPECT_EQ(bytes_of(2), 30000u) << "another tenant's expired unit is left to its reads";
  std::vector<uint8_t> out;
  EXPECT_TRUE(t.Get(MakeKey(0), &out).IsNotFound());
  EXPECT_EQ(t.Lookup(std::vector<Key>{MakeKey(1)}).first_miss, MissReason::kExpired);
  ASSERT_TRUE(t.Get(MakeKey(2), &out).ok());
  EXPECT_EQ(out, MakeValue(MakeKey(2), 3, 5000));
  ASSERT_TRUE(t.Get(kept, &out).ok());
  // The reclaim is bounded per put (kQuotaReclaimUnitsMax units examined): a put that needs
  // more expired units than that is refused, and the next put goes on where it stopped.
  t.SetTenantQuota(3, (kQuotaReclaimUnitsMax + 100) * 100);  // the tiny units fill it
  PutOptions tiny;
  tiny.tenant = 3;
  tiny.ttl_ms = 1000;
  for (size_t i = 0; i < kQuotaReclaimUnitsMax + 100; ++i) {
    const Key k = MakeKey(1000 + i);
    ASSERT_TRUE(t.Put(k, MakeValue(k, 1, 100), tiny).ok()) << i;
  }
  clock_.AdvanceUs(2'000'000);
  const Key big = MakeKey(999);
  PutOptions whole;
  whole.tenant = 3;
  EXPECT_TRUE(t.Put(big, MakeValue(big, 1, kQuotaReclaimUnitsMax * 100 + 50), whole).IsRejected());
  EXPECT_EQ(bytes_of(3), 10000u) << "the first put reclaimed kQuotaReclaimUnitsMax units";
  ASSERT_TRUE(t.Put(big, MakeValue(big, 1, kQuotaReclaimUnitsMax * 100 + 50), whole).ok());
  EXPECT_EQ(bytes_of(3), kQuotaReclaimUnitsMax * 100 + 50);
  // The reclaim expires only what a read would: an SSD unit keeps its expiry in unix time,
  // which the manual clock does not move, so a read still serves it and it stays (its entry
  // moves to that expiry); the DRAM unit beside it, expired by the manual clock, goes.
  t.SetTenantQuota(4, 60000);
  PutOptions on_ssd;
  on_ssd.tenant = 4;
  on_ssd.ttl_ms = 1000;
  on_ssd.highest_tier = Tier::kSsd;
  PutOptions in_dram = on_ssd;
  in_dram.highest_tier = Tier::kDram;
  const Key s4 = MakeKey(40), m4 = MakeKey(41), n4 = MakeKey(42);
  ASSERT_TRUE(t.Put(s4, MakeValue(s4, 1, 30000), on_ssd).ok());
  ASSERT_TRUE(t.Put(m4, MakeValue(m4, 1, 30000), in_dram).ok());
  clock_.AdvanceUs(2'000'000);
  ASSERT_TRUE(t.Put(n4, MakeValue(n4, 1, 30000), in_dram).ok());
  EXPECT_EQ(bytes_of(4), 60000u);
  Tier from = Tier::kNone;
  ASSERT_TRUE(t.Get(s4, &out, &from).ok()) << "still live for a read: not reclaimed";
  EXPECT_EQ(from, Tier::kSsd);
  EXPECT_TRUE(t.Get(m4, &out).IsNotFound());
}

// The same for units the SSD index loads at a warm restart: they enter their tenant's expiry
// index with their stored expiry. Real clocks: the SSD keeps expiry in unix time.
TEST_F(TierManagerTest, ExpiredUnitsLoadedAtRestartStopChargingTheirTenantsQuota) {
  TierManagerOptions o = Options();
  o.clock = nullptr;  // the steady clock, which moves with the SSD's unix time
  auto bytes_of = [](TierManager& t, TenantId tenant) {
    for (const auto& [id, bytes] : t.GetStats().tenant_bytes) {
      if (id == tenant) return bytes;
    }
    return uint64_t{0};
  };
  PutOptions short_lived;
  short_lived.tenant = 1;
  short_lived.ttl_ms = 1000;
  short_lived.highest_tier = Tier::kSsd;
  {
    auto tm = TierManager::Open(o);
    ASSERT_TRUE(tm.ok()) << tm.status().ToString();
    for (int i = 0; i < 3; ++i) {
      const Key k = MakeKey(i);
      ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 30000), short_lived).ok());
    }
    ASSERT_TRUE((*tm)->Flush().ok());
  }
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  TierManager& t = **tm;
  t.SetTenantQuota(1, 100000);
  // The index loads in the background; the units count once it is done.
  for (int i = 0; i < 500 && bytes_of(t, 1) != 90000u; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(bytes_of(t, 1), 90000u);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // past their TTL
  const Key next = MakeKey(10);
  ASSERT_TRUE(t.Put(next, MakeValue(next, 1, 30000), short_lived).ok());
  EXPECT_EQ(bytes_of(t, 1), 30000u);
}

// A unit on SSD whose TTL has run out is a miss for Lookup and Probe as for Get, with its
// reason. Until session 37 only a read checked an SSD unit's expiry: after a restart (every
// unit on SSD) a LOOKUP counted units whose TTL had passed and the GET that followed missed
// them (the cluster judge under ASan, seeds 1003 and 1004: a LOOKUP counted a key 324-600 ms
// after its TTL ran out).
TEST_F(TierManagerTest, LookupMissesAnSsdUnitWhoseTtlRanOut) {
  TierManagerOptions o = Options();
  o.clock = nullptr;  // the steady clock, which moves with the SSD's unix time
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  PutOptions on_ssd;
  on_ssd.highest_tier = Tier::kSsd;
  PutOptions short_lived = on_ssd, long_lived = on_ssd;
  short_lived.ttl_ms = 1;
  long_lived.ttl_ms = 600000;
  const std::vector<Key> chain = {MakeKey(1), MakeKey(2), MakeKey(3)};
  ASSERT_TRUE((*tm)->Put(chain[0], MakeValue(chain[0], 1, 3000), on_ssd).ok());
  ASSERT_TRUE((*tm)->Put(chain[1], MakeValue(chain[1], 1, 3000), long_lived).ok());
  ASSERT_TRUE((*tm)->Put(chain[2], MakeValue(chain[2], 1, 3000), short_lived).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the short TTL
  const LookupResult probe = (*tm)->Probe(chain);
  EXPECT_EQ(probe.hit_count, 2u);
  LookupResult r = (*tm)->Lookup(chain);
  ASSERT_EQ(r.hit_count, 2u);
  EXPECT_EQ(r.tiers[0], Tier::kSsd);
  EXPECT_EQ(r.tiers[1], Tier::kSsd);
  EXPECT_EQ(r.first_miss, MissReason::kExpired);
  std::vector<uint8_t> out;
  EXPECT_TRUE((*tm)->Get(chain[2], &out).IsNotFound());
  EXPECT_TRUE((*tm)->Get(chain[1], &out).ok());
}

TEST_F(TierManagerTest, SetPolicyAtRunTime) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok());
  Key k = MakeKey(1);
  ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 1000), {}).ok());
  EXPECT_TRUE((*tm)->SetPolicy("no-such-policy", "admit-all", {}).IsInvalidArgument());
  EXPECT_TRUE((*tm)->SetPolicy("lru", "no-such-admission", {}).IsInvalidArgument());
  ASSERT_TRUE((*tm)->SetPolicy("lru", "admit-all", {}).ok());
  for (int i = 2; i < 200; ++i) {
    Key x = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(x, MakeValue(x, 1, 20000), {}).ok());
  }
  std::vector<uint8_t> out;
  ASSERT_TRUE((*tm)->Get(k, &out).ok());  // demoted through the new policies, still served
  EXPECT_EQ(out, MakeValue(k, 1, 1000));
}

// A policy set (or SIGHUP) that changes nothing keeps the admission policy's state: the
// write budget spent today stays spent (before, every reload built a new write-budget with 0
// spent, so frequent reloads let the SSD take more than bytes_per_day). A changed cap keeps
// today's spending too; a switch away from write-budget and back starts over (documented:
// nothing meters in between).
TEST_F(TierManagerTest, APolicySetThatChangesNothingKeepsTheWriteBudgetSpent) {
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;
  o.admission_policy = "write-budget";
  o.policy_params.values = {{"write-budget:bytes_per_day", "100000000"}};
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  for (int i = 0; i < 100; ++i) {  // 2 MB into a 1 MB DRAM tier: demotions are admitted
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
  }
  const uint64_t spent = (*tm)->GetStats().admission_budget_spent_bytes;
  ASSERT_GT(spent, 0u);
  ASSERT_TRUE((*tm)->SetPolicy("lru", "write-budget", o.policy_params).ok());
  EXPECT_EQ((*tm)->GetStats().admission_budget_spent_bytes, spent);
  policies::PolicyParams reordered = o.policy_params;  // the same settings, another order
  reordered.values.insert(reordered.values.begin(), {"long-tail:decay", "0.5"});
  ASSERT_TRUE((*tm)->SetPolicy("lru", "write-budget", reordered).ok());
  EXPECT_EQ((*tm)->GetStats().admission_budget_spent_bytes, spent);
  policies::PolicyParams bigger;
  bigger.values = {{"write-budget:bytes_per_day", "200000000"}};
  ASSERT_TRUE((*tm)->SetPolicy("lru", "write-budget", bigger).ok());
  EXPECT_EQ((*tm)->GetStats().admission_budget_bytes, 200000000u);
  EXPECT_EQ((*tm)->GetStats().admission_budget_spent_bytes, spent);
  ASSERT_TRUE((*tm)->SetPolicy("lru", "admit-all", bigger).ok());
  ASSERT_TRUE((*tm)->SetPolicy("lru", "write-budget", bigger).ok());
  EXPECT_EQ((*tm)->GetStats().admission_budget_spent_bytes, 0u);
}

// second-hit admission counts the references the live store sees (AdmissionPolicy::OnLookup),
// one per reference of a unit as the simulator counts them: a Lookup counts the keys from its
// first miss to the end of the chain (the engine recomputes and PUTs those), and each client
// read (Get, GetWithTtl, GetBatch, GetBatchVisit; hit or miss) counts its keys; Peek, Prefetch
// and the hits of a Lookup (the GET that follows counts them) do not. Before, the live store
// never called OnLookup, so second-hit admitted nothing to SSD, whatever was read.
// DRAM is then flooded with units nobody looked up, so every earlier unit is demoted through
// the policy; Peek (which counts nothing) tells which ones the SSD took.
TEST_F(TierManagerTest, SecondHitAdmitsUnitsReferencedTwice) {
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;  // demotions go through the admission policy
  o.admission_policy = "second-hit";
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  TierManager& t = **tm;
  auto put = [&](const Key& k) { ASSERT_TRUE(t.Put(k, MakeValue(k, 1, 20000), {}).ok()); };
  auto lookup = [&](std::vector<Key> chain) { return t.Lookup(chain); };
  std::vector<uint8_t> out;
  // a: two engine turns (LOOKUP miss + PUT, then LOOKUP hit + GET): two references.
  const Key a = MakeKey(1);
  EXPECT_EQ(lookup({a}).hit_count, 0u);
  put(a);
  EXPECT_EQ(lookup({a}).hit_count, 1u);
  ASSERT_TRUE(t.Get(a, &out).ok());
  // b: one turn only.
  const Key b = MakeKey(2);
  EXPECT_EQ(lookup({b}).hit_count, 0u);
  put(b);
  // c: put without a lookup, then read by GetBatch and by GetBatchVisit: two references.
  const Key c = MakeKey(3);
  put(c);
  {
    std::vector<std::vector<uint8_t>> outs;
    std::vector<Status> results;
    t.GetBatch(std::vector<Key>{c}, &outs, nullptr, &results);
    ASSERT_TRUE(results[0].ok());
    int visits = 0;
    t.GetBatchVisit(std::vector<Key>{c}, [&](size_t, const Status& st, Tier, auto) {
      EXPECT_TRUE(st.ok());
      ++visits;
    });
    EXPECT_EQ(visits, 1);
  }
  // d: peeked, prefetched and looked up as a hit, again and again: no reference counted.
  const Key d = MakeKey(4);
  put(d);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(t.Peek(d, &out).ok());
    ASSERT_TRUE(t.Prefetch(std::vector<Key>{d}).ok());
    EXPECT_EQ(lookup({d}).hit_count, 1u);
  }
  // e: a GetWithTtl and a Get that missed (before its put) count: two references.
  const Key e = MakeKey(5);
  EXPECT_TRUE(t.Get(e, &out).IsNotFound());
  put(e);
  uint64_t ttl_left_ms = 0;
  ASSERT_TRUE(t.GetWithTtl(e, &out, &ttl_left_ms).ok());
  // f, g: one lookup of [f, missing, g] counts missing and g (from the first miss on), not the
  // hit f before it; a Get of each adds one.
  const Key f = MakeKey(6), missing = MakeKey(7), g = MakeKey(8);
  put(f);
  put(g);
  EXPECT_EQ(lookup({f, missing, g}).hit_count, 1u);
  ASSERT_TRUE(t.Get(f, &out).ok());
  ASSERT_TRUE(t.Get(g, &out).ok());
  EXPECT_EQ(t.GetStats().ssd.objects, 0u);

  // 200 x 20 KB of units nobody looked up into the 1 MB DRAM tier: everything above leaves
  // DRAM through the admission policy; the fillers themselves are refused.
  for (int i = 100; i < 300; ++i) put(MakeKey(i));
  auto on_ssd = [&](const Key& k) {
    UnitInfo read;
    return t.Peek(k, &out, &read).ok() && read.tier == Tier::kSsd;
  };
  EXPECT_TRUE(on_ssd(a)) << "looked up twice";
  EXPECT_FALSE(on_ssd(b)) << "looked up once";
  EXPECT_TRUE(on_ssd(c)) << "read twice by batches";
  EXPECT_FALSE(on_ssd(d)) << "peeks, prefetches and lookup hits count nothing";
  EXPECT_TRUE(on_ssd(e)) << "a missed Get and a GetWithTtl";
  EXPECT_FALSE(on_ssd(f)) << "a lookup hit before the first miss and one Get";
  EXPECT_TRUE(on_ssd(g)) << "after the first miss, and one Get";
  EXPECT_FALSE(on_ssd(MakeKey(100)));
  const Stats s = t.GetStats();
  EXPECT_EQ(s.admissions, 4u);
  EXPECT_GT(s.admission_rejections, 100u);
}

// A policy set that switches to second-hit starts the counting at once, and one that switches
// away stops it (TierManagerImpl keeps whether its admission policy counts lookups).
TEST_F(TierManagerTest, SecondHitSetAtRunTimeCountsFromThen) {
  TierManagerOptions o = Options();
  o.durability = Durability::kNone;
  auto tm = TierManager::Open(o);  // admit-all
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  TierManager& t = **tm;
  policies::PolicyParams once;
  once.values = {{"second-hit:hits_required", "1"}};
  ASSERT_TRUE(t.SetPolicy("lru", "second-hit", once).ok());
  std::vector<uint8_t> out;
  const Key read = MakeKey(1), unread = MakeKey(2);
  ASSERT_TRUE(t.Put(read, MakeValue(read, 1, 20000), {}).ok());
  ASSERT_TRUE(t.Put(unread, MakeValue(unread, 1, 20000), {}).ok());
  ASSERT_TRUE(t.Get(read, &out).ok());
  for (int i = 100; i < 300; ++i) {
    ASSERT_TRUE(t.Put(MakeKey(i), MakeValue(MakeKey(i), 1, 20000), {}).ok());
  }
  UnitInfo peeked;
  EXPECT_TRUE(t.Peek(read, &out, &peeked).ok() && peeked.tier == Tier::kSsd);
  EXPECT_TRUE(t.Peek(unread, &out).IsNotFound());
  EXPECT_EQ(t.GetStats().admissions, 1u);
  // Back to admit-all: every demotion is admitted again.
  ASSERT_TRUE(t.SetPolicy("lru", "admit-all", {}).ok());
  for (int i = 300; i < 400; ++i) {
    ASSERT_TRUE(t.Put(MakeKey(i), MakeValue(MakeKey(i), 1, 20000), {}).ok());
  }
  EXPECT_GT(t.GetStats().admissions, 50u);
}

// A policy set keeps DRAM's recency order: unchanged, the policy is not touched at all;
// switched (lru -> fifo), the new policy learns the units in the order of their last insert or
// hit. Before, every set re-registered the units in the shards' hash order, all at one time,
// so the next evictions went in hash order. DRAM holds the newest C units; they are read in
// an order unlike their insert order; then C/2 new units demote the C/2 read first.
TEST_F(TierManagerTest, APolicySetKeepsDramInLastTouchOrder) {
  for (const std::string eviction : {"lru", "fifo"}) {
    TierManagerOptions o = Options();
    o.durability = Durability::kNone;
    o.data_dir = dir_.path() + "/" + eviction;
    std::filesystem::create_directories(o.data_dir);
    auto tm = TierManager::Open(o);
    ASSERT_TRUE(tm.ok()) << tm.status().ToString();
    int next = 0;
    auto put = [&]() {
      Key k = MakeKey(next++);
      ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 20000), {}).ok());
    };
    auto in_dram = [&](int i) {
      Key k = MakeKey(i);
      LookupResult r = (*tm)->Lookup(std::span<const Key>(&k, 1));
      return r.hit_count == 1 && r.tiers[0] == Tier::kDram;
    };
    for (int i = 0; i < 100; ++i) put();
    std::vector<int> resident;
    for (int i = 0; i < next; ++i) {
      if (in_dram(i)) resident.push_back(i);
    }
    ASSERT_GE(resident.size(), 8u) << eviction;
    // Read in an order unlike the insert order: odd positions first, then even, each reversed.
    std::vector<int> reads;
    for (size_t i = resident.size(); i-- > 0;) {
      if (i % 2 == 1) reads.push_back(resident[i]);
    }
    for (size_t i = resident.size(); i-- > 0;) {
      if (i % 2 == 0) reads.push_back(resident[i]);
    }
    std::vector<uint8_t> out;
    for (int i : reads) ASSERT_TRUE((*tm)->Get(MakeKey(i), &out).ok());
    ASSERT_TRUE((*tm)->SetPolicy(eviction, "admit-all", {}).ok());
    const size_t half = resident.size() / 2;
    for (size_t i = 0; i < half; ++i) put();
    for (size_t i = 0; i < reads.size(); ++i) {
      EXPECT_EQ(in_dram(reads[i]), i >= half)
          << eviction << ": unit " << reads[i] << ", read " << i << " of " << reads.size();
    }
  }
}

TEST_F(TierManagerTest, SwaStateNeverReachesSsd) {
  auto tm = TierManager::Open(Options());
  ASSERT_TRUE(tm.ok());
  PutOptions swa;
  swa.kind = policies::ObjectKind::kSwa;
  swa.allow_ssd = false;
  Key s = MakeKey(1);
  ASSERT_TRUE((*tm)->Put(s, MakeValue(s, 1, 20000), swa).ok());
  for (int i = 2; i < 200; ++i) {
    Key x = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(x, MakeValue(x, 1, 20000), {}).ok());
  }
  Key chain[] = {s};
  LookupResult r = (*tm)->Lookup(chain);
  EXPECT_EQ(r.hit_count, 0u);
  EXPECT_EQ(r.first_miss, MissReason::kEvicted);
}

// The HBM and DRAM tiers' arenas: CUDA device and pinned memory when a GPU is usable, mmap
// otherwise; bytes round-trip through either (cudaMemcpy on a GPU). Under
// KVTIER_REQUIRE_CUDA=1 (the GPU check, deploy/gpu/check.sh) the CUDA arenas are required.
// Object limits (TierManagerOptions::*_objects_max): each tier holds at most its limit of
// objects whatever their size, a new object beyond it evicting by policy (the memory tier
// demotes, the SSD tier drops), so tiny values cannot grow the bookkeeping without bound. The
// newest units are the ones kept (LRU), each exact; the limits are reported.
TEST_F(TierManagerTest, ObjectLimitsEvictByPolicyAndKeepTheNewestUnits) {
  TierManagerOptions o = Options();
  o.durability = Durability::kBatched;
  o.dram_objects_max = 10;
  o.ssd_objects_max = 40;
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  constexpr int kUnits = 200;  // 200 x 100 B: far below either tier's bytes
  for (int i = 0; i < kUnits; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE((*tm)->Put(k, MakeValue(k, 1, 100), {}).ok()) << i;
    Stats s = (*tm)->GetStats();
    ASSERT_LE(s.dram.objects, 10u) << i;
    ASSERT_LE(s.ssd.objects, 40u) << i;
  }
  Stats s = (*tm)->GetStats();
  EXPECT_EQ(s.dram.objects_max, 10u);
  EXPECT_EQ(s.ssd.objects_max, 40u);
  EXPECT_EQ(s.ssd.objects, 40u);
  EXPECT_GE(s.ssd.evictions, static_cast<uint64_t>(kUnits - 40));
  std::vector<uint8_t> out;
  for (int i = kUnits - 40; i < kUnits; ++i) {
    ASSERT_TRUE((*tm)->Get(MakeKey(i), &out).ok()) << i;
    EXPECT_EQ(out, MakeValue(MakeKey(i), 1, 100)) << i;
  }
  EXPECT_TRUE((*tm)->Get(MakeKey(0), &out).IsNotFound());
  // A unit put again is no new object: it replaces in place, evicting nothing.
  const uint64_t evictions = (*tm)->GetStats().ssd.evictions;
  ASSERT_TRUE((*tm)->Put(MakeKey(kUnits - 1), MakeValue(MakeKey(kUnits - 1), 2, 100), {}).ok());
  EXPECT_EQ((*tm)->GetStats().ssd.evictions, evictions);
}

// The defaults: one object per 512 bytes of a tier's capacity, the SSD tier's at most 8 Mi.
TEST(TierManagerOptionsTest, ObjectLimitDefaultsFollowTheCapacity) {
  TierManagerOptions o;
  o.hbm_capacity_bytes = 1ull << 20;
  o.dram_capacity_bytes = 1ull << 30;
  o.ssd_capacity_bytes = 1ull << 30;
  EXPECT_EQ(o.ObjectsMax(Tier::kHbm), 2048u);
  EXPECT_EQ(o.ObjectsMax(Tier::kDram), 2097152u);
  EXPECT_EQ(o.ObjectsMax(Tier::kSsd), 2097152u);
  o.ssd_capacity_bytes = 1ull << 40;
  EXPECT_EQ(o.ObjectsMax(Tier::kSsd), TierManagerOptions::kDefaultSsdObjectsMax);
  o.ssd_objects_max = 123;
  o.dram_objects_max = 45;
  EXPECT_EQ(o.ObjectsMax(Tier::kSsd), 123u);
  EXPECT_EQ(o.ObjectsMax(Tier::kDram), 45u);
}

// The memory tier's side: a new key beyond objects_max is Rejected (the caller evicts and
// retries, as for a full arena); replacing a key it holds is not; a removal makes room.
TEST(MemoryTierObjects, ANewKeyBeyondTheLimitIsRejectedAReplaceIsNot) {
  MemoryTierOptions o;
  o.capacity_bytes = 4u << 20;
  o.slab_page_bytes = 64u << 10;
  o.use_cuda = false;
  o.objects_max = 3;
  auto t = MemoryTier::Create(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const std::vector<uint8_t> v(16, 1);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*t)->Insert(MakeKey(i), v, MemMeta{}, true).ok()) << i;
  EXPECT_TRUE((*t)->Insert(MakeKey(3), v, MemMeta{}, true).IsRejected());
  EXPECT_TRUE((*t)->Insert(MakeKey(1), std::vector<uint8_t>(32, 2), MemMeta{}, true).ok());
  EXPECT_EQ((*t)->GetStats().objects, 3u);
  EXPECT_EQ((*t)->GetStats().objects_max, 3u);
  ASSERT_TRUE((*t)->Remove(MakeKey(0)).ok());
  EXPECT_TRUE((*t)->Insert(MakeKey(3), v, MemMeta{}, true).ok());
  EXPECT_EQ((*t)->GetStats().objects, 3u);
}

TEST(MemoryTierArena, HbmAndDramRoundTripOnTheirArena) {
  for (Tier tier : {Tier::kHbm, Tier::kDram}) {
    for (bool use_cuda : {true, false}) {
      SCOPED_TRACE(std::string(tier == Tier::kHbm ? "hbm" : "dram") +
                   (use_cuda ? " use_cuda" : " host"));
      MemoryTierOptions o;
      o.tier = tier;
      o.capacity_bytes = 16u << 20;
      o.use_cuda = use_cuda;
      auto t = MemoryTier::Create(o);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      const std::string kind = (*t)->arena_kind();
      if (!use_cuda) {
        EXPECT_EQ(kind, "mmap");
      } else if (::kvtier::testing::CudaRequired()) {
        EXPECT_EQ(kind, tier == Tier::kHbm ? "cuda-device" : "cuda-pinned");
      } else {
        EXPECT_TRUE(kind == "mmap" || kind == (tier == Tier::kHbm ? "cuda-device" : "cuda-pinned"))
            << kind;
      }
      const Key key = MakeKey(7);
      const std::vector<uint8_t> value = MakeValue(key, 1, 100003);  // not a multiple of any page
      ASSERT_TRUE((*t)->Insert(key, value, MemMeta{}, true).ok());
      std::vector<uint8_t> out;
      ASSERT_TRUE((*t)->Read(key, &out).ok());
      EXPECT_EQ(out, value);
    }
  }
}

}  // namespace
}  // namespace kvtier::storage
