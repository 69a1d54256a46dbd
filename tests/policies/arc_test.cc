#include "policies/arc/arc.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

// Drives a policy like a cache of `capacity` objects; returns true on a hit.
bool Get(EvictionPolicy& p, uint64_t capacity, ObjectId id, uint64_t now) {
  if (p.Contains(id)) {
    p.OnAccess(id, now);
    return true;
  }
  p.OnMiss(id, now);
  while (p.Size() >= capacity) p.Evict(now);
  p.OnInsert({.id = id}, now);
  return false;
}

TEST(Arc, GhostHitInB1GrowsRecencyTarget) {
  ArcPolicy p;
  p.OnCapacity(4);
  for (ObjectId id = 1; id <= 4; ++id) Get(p, 4, id, id);
  Get(p, 4, 4, 5);  // 4 moves to T2, so T1 no longer fills the cache
  Get(p, 4, 5, 5);  // REPLACE: T1's LRU (1) goes to ghost B1
  EXPECT_TRUE(p.TEST_InGhost(1));
  EXPECT_EQ(p.TEST_Target(), 0.0);
  Get(p, 4, 1, 6);  // ghost hit in B1: p grows, 1 goes to T2
  EXPECT_GT(p.TEST_Target(), 0.0);
  EXPECT_TRUE(p.Contains(1));
  EXPECT_FALSE(p.TEST_InGhost(1));
}

TEST(Arc, AdaptsToAScanByProtectingTheFrequentSet) {
  ArcPolicy arc;
  arc.OnCapacity(100);
  uint64_t now = 0;
  for (int round = 0; round < 3; ++round) {
    for (ObjectId id = 1; id <= 50; ++id) Get(arc, 100, id, ++now);  // hot set, reused
  }
  for (ObjectId id = 1000; id < 1300; ++id) Get(arc, 100, id, ++now);  // one-time scan
  int hot_hits = 0;
  for (ObjectId id = 1; id <= 50; ++id) hot_hits += Get(arc, 100, id, ++now);
  EXPECT_EQ(hot_hits, 50);  // the scan went through T1 only; T2 kept the hot set
}

}  // namespace
}  // namespace kvtier::policies
