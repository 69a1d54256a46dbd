#include "policies/sieve/sieve.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

TEST(Sieve, VisitedBitSparesOnceAndHandStays) {
  SievePolicy p;
  for (ObjectId id = 1; id <= 4; ++id) p.OnInsert({.id = id}, id);
  p.OnAccess(1, 5);
  p.OnAccess(2, 5);
  EXPECT_TRUE(p.TEST_Visited(1));
  // Hand starts at the tail (1): clears 1 and 2, evicts 3.
  EXPECT_EQ(p.Evict(6), std::optional<ObjectId>(3));
  EXPECT_FALSE(p.TEST_Visited(1));
  EXPECT_FALSE(p.TEST_Visited(2));
  // The hand stayed at 4 (not back at the tail): 4 is evicted next although 1 is older.
  EXPECT_EQ(p.Evict(7), std::optional<ObjectId>(4));
  p.OnInsert({.id = 5}, 8);
  // Hand wrapped: 1 (bit now clear) goes next.
  EXPECT_EQ(p.Evict(9), std::optional<ObjectId>(1));
}

TEST(Sieve, RemoveUnderTheHandIsSafe) {
  SievePolicy p;
  for (ObjectId id = 1; id <= 3; ++id) p.OnInsert({.id = id}, id);
  p.OnAccess(1, 4);
  EXPECT_EQ(p.Evict(5), std::optional<ObjectId>(2));  // hand now at 3
  p.OnRemove(3);
  EXPECT_EQ(p.Evict(6), std::optional<ObjectId>(1));
  EXPECT_EQ(p.Size(), 0u);
}

}  // namespace
}  // namespace kvtier::policies
