#include "policies/belady/belady.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

TEST(Belady, EvictsFarthestNextUseAndNeverUsedFirst) {
  BeladyPolicy p;
  p.SetNextAccess(1, 10);
  p.OnInsert({.id = 1}, 0);
  p.SetNextAccess(2, 5);
  p.OnInsert({.id = 2}, 0);
  p.SetNextAccess(3, BeladyPolicy::kNever);
  p.OnInsert({.id = 3}, 0);
  EXPECT_EQ(p.Evict(0), std::optional<ObjectId>(3));
  EXPECT_EQ(p.Evict(0), std::optional<ObjectId>(1));
  p.SetNextAccess(2, 100);  // 2 is accessed; its next use moves far away
  p.OnAccess(2, 1);
  p.SetNextAccess(4, 50);
  p.OnInsert({.id = 4}, 1);
  EXPECT_EQ(p.Evict(2), std::optional<ObjectId>(2));
  EXPECT_EQ(p.Size(), 1u);
}

}  // namespace
}  // namespace kvtier::policies
