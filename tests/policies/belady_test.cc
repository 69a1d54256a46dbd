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

// Hints are kept per id: a hint given before another id's calls still reaches its own id's
// later OnAccess (the prefix layer delivers a request's hits after all were referred).
TEST(Belady, HintsAreKeptPerId) {
  BeladyPolicy p;
  p.SetNextAccess(1, 10);
  p.SetNextAccess(2, 20);
  p.OnInsert({.id = 2}, 0);
  p.OnInsert({.id = 1}, 0);
  EXPECT_EQ(p.Evict(0), std::optional<ObjectId>(2));
  p.SetNextAccess(2, 5);
  p.SetNextAccess(1, 30);
  p.OnInsert({.id = 2}, 1);  // takes 5, not 30
  p.OnAccess(1, 1);          // takes 30
  EXPECT_EQ(p.Evict(1), std::optional<ObjectId>(1));
}

}  // namespace
}  // namespace kvtier::policies
