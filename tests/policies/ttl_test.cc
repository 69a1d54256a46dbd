#include "policies/ttl/ttl.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

constexpr uint64_t kMinuteUs = 60ull * 1000 * 1000;

TEST(Ttl, ExpiredSwaGoesBeforeOlderGlobalKv) {
  TtlPolicy p;  // defaults: global KV 72 h, SWA 10 min
  p.OnInsert({.id = 1, .kind = ObjectKind::kGlobalKv}, 0);
  p.OnInsert({.id = 2, .kind = ObjectKind::kSwa}, 1 * kMinuteUs);
  p.OnInsert({.id = 3, .kind = ObjectKind::kGlobalKv}, 2 * kMinuteUs);
  // At 5 min nothing has expired: plain LRU picks 1.
  EXPECT_EQ(p.Evict(5 * kMinuteUs), std::optional<ObjectId>(1));
  p.OnInsert({.id = 1, .kind = ObjectKind::kGlobalKv}, 5 * kMinuteUs);
  // At 12 min the SWA unit (last used at 1 min) has expired and goes first.
  EXPECT_EQ(p.PopExpired(12 * kMinuteUs), std::optional<ObjectId>(2));
  EXPECT_EQ(p.PopExpired(12 * kMinuteUs), std::nullopt);
  // Global KV lasts 72 h: at 73 h both remaining units are expired, oldest expiry first.
  EXPECT_EQ(p.Evict(73 * 60 * kMinuteUs), std::optional<ObjectId>(3));
}

TEST(Ttl, AccessExtendsLifeAndParamsAreChecked) {
  PolicyParams params;
  params.values = {{"ttl_swa_ms", "1000"}};
  auto made = TtlPolicy::Make(params);
  ASSERT_TRUE(made.ok());
  auto& p = **made;
  p.OnInsert({.id = 7, .kind = ObjectKind::kSwa}, 0);
  p.OnAccess(7, 900'000);
  EXPECT_TRUE(static_cast<TtlPolicy&>(p).PopExpired(1'500'000) == std::nullopt);
  EXPECT_EQ(static_cast<TtlPolicy&>(p).PopExpired(1'900'000), std::optional<ObjectId>(7));
  params.values = {{"ttl_minutes", "5"}};
  EXPECT_TRUE(TtlPolicy::Make(params).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::policies
