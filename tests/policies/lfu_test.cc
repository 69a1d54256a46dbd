#include "policies/lfu/lfu.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

TEST(Lfu, EvictsLeastFrequentThenLeastRecent) {
  LfuPolicy p;
  for (ObjectId id = 1; id <= 3; ++id) p.OnInsert({.id = id}, id);
  p.OnAccess(1, 4);
  p.OnAccess(1, 5);
  p.OnAccess(3, 6);
  // counts: 1 -> 3, 2 -> 1, 3 -> 2
  EXPECT_EQ(p.Evict(7), std::optional<ObjectId>(2));
  EXPECT_EQ(p.Evict(8), std::optional<ObjectId>(3));
  p.OnInsert({.id = 4}, 9);
  p.OnInsert({.id = 5}, 10);
  EXPECT_EQ(p.Evict(11), std::optional<ObjectId>(4));  // tie at 1: the older goes first
  EXPECT_EQ(p.Size(), 2u);
}

}  // namespace
}  // namespace kvtier::policies
