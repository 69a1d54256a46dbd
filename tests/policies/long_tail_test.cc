#include "policies/long_tail/long_tail.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace kvtier::policies {
namespace {

constexpr uint64_t kSecUs = 1000 * 1000;

// Inserts a request's chain of fresh units [first, first + n) under `root` at `now`.
void InsertChain(LongTailPolicy& p, ObjectId root, ObjectId first, int n, uint64_t now) {
  ObjectId parent = root;
  for (int i = 0; i < n; ++i) {
    p.OnInsert({.id = first + i, .parent_id = parent}, now);
    parent = first + i;
  }
}

TEST(LongTail, DeepestUnitOfAChainGoesFirst) {
  LongTailPolicy p;                              // prior only: LRU per class
  InsertChain(p, kNoParent, 1, 4, 0);            // request A: 1 <- 2 <- 3 <- 4
  InsertChain(p, kNoParent, 10, 3, 5 * kSecUs);  // request B, later
  EXPECT_EQ(p.TEST_ClassOf(4), LongTailPolicy::kLeaf);
  EXPECT_EQ(p.TEST_ClassOf(3), LongTailPolicy::kFresh);
  std::vector<ObjectId> order;
  while (auto v = p.Evict(6 * kSecUs)) order.push_back(*v);
  ASSERT_EQ(order.size(), 7u);
  auto pos = [&](ObjectId id) { return std::find(order.begin(), order.end(), id) - order.begin(); };
  // Within a chain, every unit leaves only after its descendants (a prefix stays contiguous).
  EXPECT_LT(pos(3), pos(2));
  EXPECT_LT(pos(2), pos(1));
  EXPECT_LT(pos(12), pos(11));
  EXPECT_LT(pos(11), pos(10));
  // Request A's last unit became a leaf when B started: it is the first victim.
  EXPECT_EQ(order.front(), 4u);
}

// With OnRequest the policy takes request boundaries from the owner: two sessions interleaved
// unit by unit (as concurrent sessions reach a live tier) still give each request one leaf,
// its deepest unit, and a fresh unit after a non-root hit is an extension.
TEST(LongTail, ExplicitRequestsSurviveInterleavedSessions) {
  LongTailPolicy p;
  p.OnRequest(0);  // one batch holding two sessions' chains, interleaved: 1<-2<-3, 10<-11
  p.OnInsert({.id = 1}, 0);
  p.OnInsert({.id = 10}, 0);
  p.OnInsert({.id = 2, .parent_id = 1}, 0);
  p.OnInsert({.id = 11, .parent_id = 10}, 0);
  p.OnInsert({.id = 3, .parent_id = 2}, 0);
  p.OnRequest(kSecUs);
  EXPECT_EQ(p.TEST_ClassOf(3), LongTailPolicy::kLeaf);
  EXPECT_EQ(p.TEST_ClassOf(11), LongTailPolicy::kLeaf);
  EXPECT_EQ(p.TEST_ClassOf(1), LongTailPolicy::kFresh);
  EXPECT_EQ(p.TEST_ClassOf(2), LongTailPolicy::kFresh);
  EXPECT_EQ(p.TEST_ClassOf(10), LongTailPolicy::kFresh);
  // Resume session 1: hits deepest first (as the prefix structure replays), then appends 4.
  p.OnAccess(2, kSecUs);
  p.OnAccess(1, kSecUs);
  p.OnInsert({.id = 4, .parent_id = 3}, kSecUs);
  EXPECT_EQ(p.TEST_ClassOf(4), LongTailPolicy::kExtension);
}

TEST(LongTail, ClassesFollowHitsExtensionsAndRequestEnds) {
  LongTailPolicy p;
  p.OnInsert({.id = 1}, 0);    // shared root
  InsertChain(p, 1, 2, 3, 0);  // 2 <- 3 <- 4, fresh
  EXPECT_EQ(p.TEST_ClassOf(2), LongTailPolicy::kFresh);
  // Next request resumes the conversation: hits 1..4 then appends 5, 6.
  for (ObjectId id = 1; id <= 4; ++id) p.OnAccess(id, 60 * kSecUs);
  EXPECT_EQ(p.TEST_ClassOf(2), LongTailPolicy::kHit1);
  p.OnInsert({.id = 5, .parent_id = 4}, 60 * kSecUs);
  p.OnInsert({.id = 6, .parent_id = 5}, 60 * kSecUs);
  EXPECT_EQ(p.TEST_ClassOf(5), LongTailPolicy::kExtension);
  EXPECT_EQ(p.TEST_ClassOf(6), LongTailPolicy::kExtension);
  // A new request (root hit) ends the previous one: its never-hit last unit becomes a leaf.
  p.OnAccess(1, 61 * kSecUs);
  EXPECT_EQ(p.TEST_ClassOf(6), LongTailPolicy::kLeaf);
  EXPECT_EQ(p.TEST_ClassOf(5), LongTailPolicy::kExtension);
  EXPECT_EQ(p.TEST_ClassOf(1), LongTailPolicy::kHit2);
  // A unit re-referenced after eviction keeps its hit count through the ghost table.
  p.OnRemove(5);
  EXPECT_FALSE(p.Contains(5));
  ObjectId victim = 0;
  while (p.Size() > 0) {
    victim = *p.Evict(62 * kSecUs);
    if (victim == 2) break;
  }
  ASSERT_EQ(victim, 2u);
  p.OnInsert({.id = 2, .parent_id = 1}, 63 * kSecUs);
  EXPECT_EQ(p.TEST_ClassOf(2), LongTailPolicy::kHit2);
}

// Fresh units come back (once) only 100-120 s after insertion, half of them; units hit once
// never come back. The learned value must be low for a young fresh unit, peak near 100 s,
// fall after the reuse window, and be ~0 for a once-hit unit.
TEST(LongTail, LearnsTheShapeOfTheReuseDistribution) {
  LongTailOptions o;
  o.relearn_every = 512;
  o.decay = 1.0;
  o.leaf_class = false;
  LongTailPolicy p(o);
  ObjectId next = 1;
  std::vector<std::pair<uint64_t, ObjectId>> due;  // (time, id) re-references
  for (uint64_t t = 0; t < 3000; ++t) {
    const uint64_t now = t * kSecUs;
    for (auto it = due.begin(); it != due.end();) {
      if (it->first == t) {
        if (p.Contains(it->second)) {
          p.OnAccess(it->second, now);
        } else {
          p.OnMiss(it->second, now);
          p.OnInsert({.id = it->second}, now);
        }
        it = due.erase(it);
      } else {
        ++it;
      }
    }
    for (int k = 0; k < 4; ++k) {
      const ObjectId id = next++;
      p.OnInsert({.id = id}, now);
      if (id % 2 == 0) due.push_back({t + 100 + id % 21, id});
    }
    while (p.Size() > 600) ASSERT_TRUE(p.Evict(now).has_value());
  }
  p.TEST_Relearn();
  const double young = p.TEST_Value(LongTailPolicy::kFresh, 2'000);
  const double peak = p.TEST_Value(LongTailPolicy::kFresh, 100'000);
  const double late = p.TEST_Value(LongTailPolicy::kFresh, 400'000);
  EXPECT_GT(peak, young);
  EXPECT_GT(peak, 4 * late);
  EXPECT_LT(p.TEST_Value(LongTailPolicy::kHit1, 2'000), young / 4);
}

TEST(LongTail, YoungEndIsEvictedWhenYoungUnitsAreWorthLess) {
  // Same workload as above, then one old unit (age ~95 s, near the learned peak) and one
  // just-inserted unit: the just-inserted one must go first although it is more recent.
  LongTailOptions o;
  o.relearn_every = 512;
  o.decay = 1.0;
  o.leaf_class = false;
  LongTailPolicy p(o);
  ObjectId next = 1;
  std::vector<std::pair<uint64_t, ObjectId>> due;
  uint64_t t = 0;
  for (; t < 2000; ++t) {
    for (auto it = due.begin(); it != due.end();) {
      if (it->first == t) {
        if (p.Contains(it->second)) p.OnAccess(it->second, t * kSecUs);
        it = due.erase(it);
      } else {
        ++it;
      }
    }
    for (int k = 0; k < 4; ++k) {
      const ObjectId id = next++;
      p.OnInsert({.id = id}, t * kSecUs);
      if (id % 2 == 0) due.push_back({t + 100 + id % 21, id});
    }
    while (p.Size() > 600) p.Evict(t * kSecUs);
  }
  p.TEST_Relearn();
  while (p.Size() > 0) p.Evict(t * kSecUs);
  const ObjectId old_unit = 1'000'000, new_unit = 1'000'001;
  p.OnInsert({.id = old_unit}, t * kSecUs);
  p.OnInsert({.id = new_unit}, (t + 95) * kSecUs);
  EXPECT_EQ(p.Evict((t + 95) * kSecUs), std::optional<ObjectId>(new_unit));
}

// OnGiveBack undoes an eviction: a policy that evicted units and took them back acts as a twin
// that never evicted them (TEST_StateDigest: the same lists, counts, ghosts, sampled ghosts and
// rate), also when the give-backs come in the reverse order of the evictions. Two settings:
// every eviction sampled with censoring on (the eviction touches every count it can), and
// exact ghosts only (they then feed the model), their table full. Before OnGiveBack, the prefix
// layer's give-back (OnRemove, a no-op for an evicted id, then OnInsert) made the unit a ghost
// hit: a reuse in the model and a higher hit class.
TEST(LongTail, GiveBackUndoesTheEviction) {
  LongTailOptions sampled;
  sampled.censoring = true;
  sampled.ghost_sample_rate = 1.0;
  LongTailOptions exact;
  exact.sampled_ghosts_max = 0;
  exact.ghost_factor = 2.0;
  for (LongTailOptions o : {sampled, exact}) {
    o.relearn_every = 1u << 30;  // relearns by hand, at the same points for both
    o.min_entries = 4;
    LongTailPolicy kept(o), twin(o);
    // Chains of up to 4 units under 40 roots, re-referenced at random, in a cache of 32 units;
    // now and then a chain's root is deleted.
    auto run = [](LongTailPolicy& p, uint64_t seed, int requests, uint64_t* now) {
      std::mt19937_64 rng(seed);
      std::vector<ObjectId> victims;
      for (int r = 0; r < requests; ++r) {
        *now += (1 + rng() % 20) * kSecUs;
        p.OnRequest(*now);
        const ObjectId root = 1 + rng() % 40;
        if (rng() % 8 == 0) {
          p.OnRemove(root * 8);
          continue;
        }
        const int depth = 1 + static_cast<int>(rng() % 4);
        for (int d = 0; d < depth; ++d) {
          const ObjectId id = root * 8 + d, parent = d == 0 ? kNoParent : id - 1;
          if (p.Contains(id)) {
            p.OnAccess(id, *now);
            continue;
          }
          while (p.Size() >= 32) victims.push_back(*p.Evict(*now));
          p.OnInsert({.id = id, .parent_id = parent}, *now);
        }
        if (r % 50 == 49) p.TEST_Relearn();
      }
      return victims;
    };
    uint64_t now_kept = 0, now_twin = 0;
    ASSERT_EQ(run(kept, 1, 600, &now_kept), run(twin, 1, 600, &now_twin));
    ASSERT_EQ(kept.TEST_StateDigest(), twin.TEST_StateDigest());
    for (int round = 0; round < 6; ++round) {
      std::vector<ObjectId> victims;
      for (int i = 0; i < 3; ++i) victims.push_back(*kept.Evict(now_kept));
      if (round % 2 == 1) std::reverse(victims.begin(), victims.end());
      for (ObjectId v : victims) kept.OnGiveBack({.id = v}, now_kept);
      ASSERT_EQ(kept.TEST_StateDigest(), twin.TEST_StateDigest()) << "round " << round;
      // Deleted and inserted again: a new unit in both (no ghost of the undone eviction).
      kept.OnRemove(victims[0]);
      twin.OnRemove(victims[0]);
      kept.OnInsert({.id = victims[0]}, now_kept);
      twin.OnInsert({.id = victims[0]}, now_twin);
      ASSERT_EQ(run(kept, 10 + round, 20, &now_kept), run(twin, 10 + round, 20, &now_twin));
    }
    kept.TEST_Relearn();
    twin.TEST_Relearn();
    EXPECT_EQ(kept.TEST_StateDigest(), twin.TEST_StateDigest());
    EXPECT_EQ(run(kept, 2, 300, &now_kept), run(twin, 2, 300, &now_twin));
  }
}

// A full sampled-ghost table lets go of its largest-hash sample (and lowers the rate) when an
// eviction samples one more; a give-back takes both back.
TEST(LongTail, GiveBackUndoesAFullSampleTablesDrop) {
  LongTailOptions o;
  o.censoring = true;
  o.ghost_sample_rate = 1.0;
  o.sampled_ghosts_max = 4;
  LongTailPolicy kept(o), twin(o);
  for (LongTailPolicy* p : {&kept, &twin}) {
    for (ObjectId id = 1; id <= 12; ++id) p->OnInsert({.id = id}, id * kSecUs);
    for (int i = 0; i < 4; ++i) p->Evict(20 * kSecUs);  // the table is full, rate still 1
  }
  ASSERT_EQ(kept.TEST_SampledGhosts(), 4u);
  for (int i = 0; i < 8; ++i) {
    const std::optional<ObjectId> v = kept.Evict(30 * kSecUs);
    ASSERT_TRUE(v.has_value());
    EXPECT_LT(kept.TEST_SampleRate(), 1.0);  // a sample dropped
    kept.OnGiveBack({.id = *v}, 30 * kSecUs);
    ASSERT_EQ(kept.TEST_StateDigest(), twin.TEST_StateDigest()) << "give-back " << i;
    kept.OnRequest(31 * kSecUs);  // the next Evict begins a new series
    twin.OnRequest(31 * kSecUs);
  }
}

TEST(LongTail, DeterministicAndParamsChecked) {
  auto run = []() {
    auto p = LongTailPolicy::Make({.values = {{"relearn_every", "64"}}});
    EXPECT_TRUE(p.ok());
    std::vector<ObjectId> victims;
    for (ObjectId id = 1; id <= 400; ++id) {
      (*p)->OnInsert({.id = id, .parent_id = id % 7 == 0 ? kNoParent : id - 1}, id * kSecUs);
      if (id % 3 == 0) (*p)->OnAccess(id / 2, id * kSecUs);
      if ((*p)->Size() > 50) victims.push_back(*(*p)->Evict(id * kSecUs));
    }
    return victims;
  };
  EXPECT_EQ(run(), run());
  EXPECT_TRUE(LongTailPolicy::Make({.values = {{"horizon", "5"}}}).status().IsInvalidArgument());
  EXPECT_TRUE(LongTailPolicy::Make({.values = {{"decay", "1.5"}}}).status().IsInvalidArgument());
}

// Sampled ghosts stay within sampled_ghosts_max however many units are evicted, and the
// sampling rate only falls (fixed-size SHARDS).
TEST(LongTail, SampledGhostsAreBounded) {
  LongTailOptions o;
  o.ghost_sample_rate = 0.5;
  o.sampled_ghosts_max = 64;
  LongTailPolicy p(o);
  for (ObjectId id = 1; id <= 20000; ++id) {
    p.OnInsert({.id = id}, id * kSecUs);
    while (p.Size() > 100) ASSERT_TRUE(p.Evict(id * kSecUs).has_value());
    ASSERT_LE(p.TEST_SampledGhosts(), 64u);
  }
  EXPECT_EQ(p.TEST_SampledGhosts(), 64u);
  EXPECT_LT(p.TEST_SampleRate(), 0.01);  // ~64 of ~19900 evicted ids
  EXPECT_GT(p.TEST_SampleRate(), 0.0005);
}

// Fresh units come back after 3 hours, long after the exact ghosts (ghost_factor x capacity
// evictions, ~20 s of churn here) have forgotten them. Sampled ghosts still see those
// reuses, so the learned value at ~3 h is positive; without them it is zero.
TEST(LongTail, SampledGhostsSeeReuseGapsOfHours) {
  auto run = [](uint64_t sampled_max) {
    LongTailOptions o;
    o.ghost_factor = 1.0;
    o.sampled_ghosts_max = sampled_max;
    o.ghost_sample_rate = 0.25;
    o.decay = 1.0;
    o.relearn_every = 1ull << 30;
    o.leaf_class = false;
    LongTailPolicy p(o);
    std::vector<std::pair<uint64_t, ObjectId>> due;  // (second, id), in time order
    size_t next_due = 0;
    ObjectId next = 1;
    const uint64_t gap_s = 3 * 3600;
    for (uint64_t t = 0; t < gap_s + 2000; t += 2) {
      const uint64_t now = t * kSecUs;
      while (next_due < due.size() && due[next_due].first <= t) {
        const ObjectId id = due[next_due++].second;
        if (p.Contains(id)) {
          p.OnAccess(id, now);
        } else {
          p.OnInsert({.id = id}, now);
        }
      }
      for (int k = 0; k < 10; ++k) {
        const ObjectId id = next++;
        p.OnInsert({.id = id}, now);
        if (id % 4 == 0 && t < 2000) due.push_back({t + gap_s, id});
      }
      while (p.Size() > 100) p.Evict(now);
    }
    p.TEST_Relearn();
    return p.TEST_Value(LongTailPolicy::kFresh, gap_s * 1000);
  };
  EXPECT_GT(run(4096), 0.0);
  EXPECT_EQ(run(0), 0.0);
}

// Every unit is reused exactly 100 s after insertion; at relearn time the units younger than
// 100 s are still waiting. Counted as never reused (no censoring) they lower the estimated
// reuse probability to ~0.9; censored at their age (Kaplan-Meier) they do not.
TEST(LongTail, CensoringCorrectsForUnitsStillWaiting) {
  auto run = [](bool censoring) {
    LongTailOptions o;
    o.censoring = censoring;
    o.decay = 1.0;
    o.relearn_every = 1ull << 30;
    o.min_entries = 10;
    o.leaf_class = false;
    o.young_end = false;
    LongTailPolicy p(o);
    for (uint64_t t = 0; t < 1000; ++t) {
      p.OnInsert({.id = t + 1}, t * kSecUs);
      if (t >= 100) p.OnAccess(t - 99, t * kSecUs);
    }
    p.TEST_Relearn();
    return p.TEST_Value(LongTailPolicy::kFresh, 0);
  };
  const double with = run(true), without = run(false);
  EXPECT_GT(without, 0.0);
  EXPECT_GT(with, without * 1.08);  // 1 / 0.9
}

// Admission adapts from ghost hits: ghost hits of units evicted never hit raise the weight of
// never-hit units; ghost hits of units evicted after hits lower it.
TEST(LongTail, AdmissionWeightFollowsGhostHits) {
  LongTailOptions o;
  o.admit_step = 0.05;
  LongTailPolicy p(o);
  uint64_t t = 1;
  for (ObjectId id = 1; id <= 200; ++id) p.OnInsert({.id = id}, t * kSecUs);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(p.Evict(++t * kSecUs).has_value());
  for (ObjectId id = 1; id <= 200; ++id) {
    if (!p.Contains(id)) p.OnInsert({.id = id}, ++t * kSecUs);  // ghost hits, never hit
    while (p.Size() > 150) p.Evict(t * kSecUs);
  }
  const double raised = p.TEST_AdmitWeight();
  EXPECT_GT(raised, 1.5);
  // Now units that had hits are evicted and come back.
  for (ObjectId id = 1000; id < 1300; ++id) {
    p.OnInsert({.id = id}, ++t * kSecUs);
    p.OnAccess(id, ++t * kSecUs);
  }
  for (int i = 0; i < 300; ++i) p.Evict(++t * kSecUs);
  for (ObjectId id = 1000; id < 1300; ++id) {
    if (!p.Contains(id)) p.OnInsert({.id = id}, ++t * kSecUs);
    while (p.Size() > 150) p.Evict(t * kSecUs);
  }
  EXPECT_LT(p.TEST_AdmitWeight(), raised / 2);
  EXPECT_TRUE(LongTailPolicy::Make({.values = {{"sampled_ghosts_max", "99999999"}}})
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(
      LongTailPolicy::Make({.values = {{"ghost_sample_rate", "0"}}}).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::policies
