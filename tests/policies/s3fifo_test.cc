#include "policies/s3fifo/s3fifo.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

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

TEST(S3Fifo, OneHitWondersGoToGhostAndComeBackToMain) {
  S3FifoPolicy p;
  p.OnCapacity(10);  // small = 1, main = 9, ghost = 9
  uint64_t now = 0;
  for (ObjectId id = 1; id <= 10; ++id) Get(p, 10, id, ++now);
  Get(p, 10, 11, ++now);  // first eviction: from small (never hit) -> ghost
  ObjectId ghosted = 0;
  for (ObjectId id = 1; id <= 10; ++id) {
    if (p.TEST_InGhost(id)) ghosted = id;
  }
  ASSERT_NE(ghosted, 0u);
  EXPECT_FALSE(p.Contains(ghosted));
  Get(p, 10, ghosted, ++now);  // ghost hit: inserted straight into main
  EXPECT_TRUE(p.TEST_InMain(ghosted));
  EXPECT_FALSE(p.TEST_InGhost(ghosted));
}

TEST(S3Fifo, HitInSmallPromotesToMain) {
  S3FifoPolicy p;
  p.OnCapacity(10);
  uint64_t now = 0;
  for (ObjectId id = 1; id <= 10; ++id) Get(p, 10, id, ++now);
  Get(p, 10, 11, ++now);  // 11 enters small
  EXPECT_FALSE(p.TEST_InMain(11));
  Get(p, 10, 11, ++now);  // hit in small
  Get(p, 10, 12, ++now);  // eviction from small: 11 moves to main instead of out
  EXPECT_TRUE(p.Contains(11));
  EXPECT_TRUE(p.TEST_InMain(11));
}

TEST(S3Fifo, RejectsUnknownParams) {
  PolicyParams params;
  params.values = {{"small_ratio", "0.2"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).ok());
  params.values = {{"small", "0.2"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).status().IsInvalidArgument());
  params.values = {{"small_ratio", "two"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::policies
