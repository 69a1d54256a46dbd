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

TEST(S3Fifo, TwoHitsInSmallPromoteToMainOneDoesNot) {
  S3FifoPolicy p;  // libCacheSim's default threshold: 2
  p.OnCapacity(10);
  uint64_t now = 0;
  for (ObjectId id = 1; id <= 10; ++id) Get(p, 10, id, ++now);  // every new id enters small
  for (ObjectId id = 1; id <= 10; ++id) EXPECT_FALSE(p.TEST_InMain(id)) << id;
  Get(p, 10, 1, ++now);  // 1: one hit
  Get(p, 10, 2, ++now);  // 2: two hits
  Get(p, 10, 2, ++now);
  Get(p, 10, 11, ++now);  // evicts small's tail, 1: one hit is below the threshold
  EXPECT_TRUE(p.TEST_InGhost(1));
  Get(p, 10, 12, ++now);  // 2 moves to main, then 3 (never hit) is evicted
  EXPECT_TRUE(p.TEST_InMain(2));
  EXPECT_TRUE(p.TEST_InGhost(3));
}

TEST(S3Fifo, FillMainFirstVariantSendsOverflowToMainBeforeTheFirstEviction) {
  PolicyParams params;
  params.values = {{"fill_main_first", "1"}, {"move_to_main_threshold", "1"}};
  auto made = S3FifoPolicy::Make(params);
  ASSERT_TRUE(made.ok());
  EvictionPolicy& p = **made;
  auto& s3 = static_cast<S3FifoPolicy&>(p);
  p.OnCapacity(10);  // small = 1
  uint64_t now = 0;
  for (ObjectId id = 1; id <= 10; ++id) Get(p, 10, id, ++now);
  EXPECT_FALSE(s3.TEST_InMain(1));  // filled small
  for (ObjectId id = 2; id <= 10; ++id) EXPECT_TRUE(s3.TEST_InMain(id)) << id;
  Get(p, 10, 11, ++now);  // after the first eviction new ids enter small again
  EXPECT_FALSE(s3.TEST_InMain(11));
  Get(p, 10, 11, ++now);  // one hit is enough with threshold 1
  Get(p, 10, 12, ++now);
  EXPECT_TRUE(s3.TEST_InMain(11));
}

TEST(S3Fifo, RejectsUnknownParams) {
  PolicyParams params;
  params.values = {{"small_ratio", "0.2"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).ok());
  params.values = {{"small", "0.2"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).status().IsInvalidArgument());
  params.values = {{"small_ratio", "two"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).status().IsInvalidArgument());
  params.values = {{"fill_main_first", "2"}};
  EXPECT_TRUE(S3FifoPolicy::Make(params).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::policies
