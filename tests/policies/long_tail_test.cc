#include "policies/long_tail/long_tail.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvtier::policies {
namespace {

constexpr uint64_t kSecUs = 1000 * 1000;

TEST(LongTail, EvictsLeavesBeforeParents) {
  LongTailPolicy p;
  // A chain root <- a <- b, plus a lone unit: only b and lone are leaves.
  p.OnInsert({.id = 1}, 0);
  p.OnInsert({.id = 2, .parent_id = 1}, 1);
  p.OnInsert({.id = 3, .parent_id = 2}, 2);
  p.OnInsert({.id = 4}, 3);
  EXPECT_EQ(p.TEST_Children(1), 1u);
  EXPECT_EQ(p.TEST_Children(2), 1u);
  std::vector<ObjectId> order;
  while (auto v = p.Evict(10 * kSecUs)) order.push_back(*v);
  ASSERT_EQ(order.size(), 4u);
  // Every unit is evicted only after all its descendants.
  auto pos = [&](ObjectId id) { return std::find(order.begin(), order.end(), id) - order.begin(); };
  EXPECT_LT(pos(3), pos(2));
  EXPECT_LT(pos(2), pos(1));
}

TEST(LongTail, SharedRootOutlivesPrivateLeaves) {
  LongTailPolicy p;
  p.OnInsert({.id = 100}, 0);  // a system prompt shared by many sessions
  for (ObjectId c = 1; c <= 20; ++c) p.OnInsert({.id = c, .parent_id = 100}, c);
  EXPECT_EQ(p.TEST_Children(100), 20u);
  for (int i = 0; i < 20; ++i) {
    auto v = p.Evict(100 * kSecUs);
    ASSERT_TRUE(v.has_value());
    EXPECT_NE(*v, 100u);
  }
  EXPECT_EQ(p.Evict(100 * kSecUs), std::optional<ObjectId>(100));
}

TEST(LongTail, LearnsThatReusedUnitsAreWorthMore) {
  // Half of new units come back once, 30 s after insertion; nothing is reused twice. The
  // learned model must say: a fresh unit (class 0) younger than 30 s is likely reused, the
  // same unit past 30 s is not, and a unit already reused once (class 1) is not.
  LongTailOptions o;
  o.relearn_every = 256;
  o.leaves_first = false;
  LongTailPolicy p(o);
  uint64_t now = 0;
  ObjectId next = 1;
  for (int round = 0; round < 50; ++round) {
    for (int k = 0; k < 10; ++k) {
      ObjectId id = next++;
      p.OnInsert({.id = id}, now);
      if (k % 2 == 0) p.OnAccess(id, now + 30 * kSecUs);
    }
    now += 60 * kSecUs;
    while (p.Size() > 20) p.Evict(now);
  }
  const double young = p.TEST_ReuseProbability(0, 1000);
  EXPECT_GT(young, 0.3);
  EXPECT_LT(p.TEST_ReuseProbability(0, 45'000), young / 4);
  EXPECT_LT(p.TEST_ReuseProbability(1, 1000), young / 4);
  EXPECT_GE(p.TEST_HorizonMs(), 1000u);
}

TEST(LongTail, DeterministicForASeedAndParamsChecked) {
  auto run = [](uint64_t seed) {
    PolicyParams params;
    params.seed = seed;
    params.values = {{"sample_size", "4"}};
    auto p = LongTailPolicy::Make(params);
    EXPECT_TRUE(p.ok());
    std::vector<ObjectId> victims;
    for (ObjectId id = 1; id <= 200; ++id) {
      (*p)->OnInsert({.id = id, .parent_id = id % 7 == 0 ? kNoParent : id - 1}, id * kSecUs);
      if (id % 3 == 0) (*p)->OnAccess(id / 2, id * kSecUs);
      if ((*p)->Size() > 50) victims.push_back(*(*p)->Evict(id * kSecUs));
    }
    return victims;
  };
  EXPECT_EQ(run(7), run(7));
  PolicyParams bad;
  bad.values = {{"horizon", "5"}};
  EXPECT_TRUE(LongTailPolicy::Make(bad).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::policies
