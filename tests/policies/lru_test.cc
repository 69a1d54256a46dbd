#include "policies/lru/lru.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

TEST(Lru, EvictsLeastRecentlyUsed) {
  LruPolicy lru;
  for (ObjectId id = 1; id <= 3; ++id) lru.OnInsert({.id = id, .size_bytes = 1}, id);
  lru.OnAccess(1, 10);
  EXPECT_EQ(lru.Evict(11), std::optional<ObjectId>(2));
  EXPECT_EQ(lru.Evict(12), std::optional<ObjectId>(3));
  lru.OnRemove(1);
  EXPECT_EQ(lru.Evict(13), std::nullopt);
  EXPECT_EQ(lru.Size(), 0u);
}

TEST(Registry, UnknownNamesAndParamsAreRejected) {
  EXPECT_TRUE(MakeEvictionPolicy("lru").ok());
  EXPECT_TRUE(MakeEvictionPolicy("nope").status().IsInvalidArgument());
  PolicyParams p;
  p.values.push_back({"typo", "1"});
  EXPECT_TRUE(MakeEvictionPolicy("lru", p).status().IsInvalidArgument());
  EXPECT_TRUE(MakeAdmissionPolicy("admit-all").ok());
}

}  // namespace
}  // namespace kvtier::policies
