// Every registered eviction policy yields the same victims for the same call sequence.
#include <gtest/gtest.h>

#include <vector>

#include "policies/policy.h"

namespace kvtier::policies {
namespace {

std::vector<ObjectId> Replay(const std::string& name) {
  auto made = MakeEvictionPolicy(name);
  EXPECT_TRUE(made.ok()) << name;
  EvictionPolicy& p = **made;
  p.OnCapacity(64);
  std::vector<ObjectId> victims;
  uint64_t x = 12345;
  for (uint64_t t = 1; t <= 5000; ++t) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    ObjectId id = 1 + (x >> 33) % 300;
    uint64_t now = t * 1000;
    if (p.Contains(id)) {
      p.OnAccess(id, now);
      continue;
    }
    p.OnMiss(id, now);
    while (p.Size() >= 64) {
      auto v = p.Evict(now);
      EXPECT_TRUE(v.has_value());
      EXPECT_FALSE(p.Contains(*v));
      victims.push_back(*v);
    }
    p.OnInsert({.id = id, .size_bytes = 100, .parent_id = id > 1 ? id - 1 : kNoParent}, now);
    EXPECT_LE(p.Size(), 64u);
  }
  return victims;
}

TEST(Determinism, SameCallsSameVictims) {
  for (const auto& name : EvictionPolicyNames()) {
    auto a = Replay(name);
    EXPECT_FALSE(a.empty()) << name;
    EXPECT_EQ(a, Replay(name)) << name;
  }
}

}  // namespace
}  // namespace kvtier::policies
