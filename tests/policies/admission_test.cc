#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <string>

#include "policies/second_hit/second_hit.h"
#include "policies/write_budget/write_budget.h"
#include "tests/sanitizers.h"

namespace kvtier::policies {
namespace {

constexpr uint64_t kDayUs = 24ull * 3600 * 1000 * 1000;

TEST(SecondHit, AdmitsOnlyAfterTheSecondLookup) {
  SecondHitPolicy p;
  p.OnLookup(1, 0);
  EXPECT_FALSE(p.Admit({.id = 1, .size_bytes = 10}, 0));
  EXPECT_FALSE(p.Admit({.id = 2, .size_bytes = 10}, 0));
  p.OnLookup(1, 1);
  EXPECT_TRUE(p.Admit({.id = 1, .size_bytes = 10}, 1));
}

TEST(SecondHit, TrackingTableIsBounded) {
  SecondHitPolicy p({.hits_required = 2, .max_tracked = 3});
  for (ObjectId id = 1; id <= 10; ++id) p.OnLookup(id, id);
  EXPECT_EQ(p.TEST_Tracked(), 3u);
  p.OnLookup(1, 11);  // 1 was forgotten: this is its first lookup again
  EXPECT_FALSE(p.Admit({.id = 1}, 11));
}

// max_tracked is bounded by what a daemon can afford (before, up to 1<<32 ids: a table of
// hundreds of GiB), and a full table costs at most kBytesPerTrackedId bytes per id, as the
// header and docs/POLICIES.md say (the heap in use, measured while ids are forgotten).
TEST(SecondHit, TableSizeIsBoundedAndCostsItsDocumentedBytesPerId) {
  auto params = [](uint64_t max_tracked) {
    PolicyParams p;
    p.values = {{"max_tracked", std::to_string(max_tracked)}};
    return p;
  };
  EXPECT_TRUE(MakeAdmissionPolicy("second-hit", params(SecondHitOptions::kMaxTrackedMax)).ok());
  EXPECT_TRUE(MakeAdmissionPolicy("second-hit", params(SecondHitOptions::kMaxTrackedMax + 1))
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(
      MakeAdmissionPolicy("second-hit", params(uint64_t{1} << 32)).status().IsInvalidArgument());
#if defined(KVTIER_TEST_ASAN) || defined(KVTIER_TEST_TSAN)
  GTEST_SKIP() << "the sanitizer's allocator does not report the heap in use to mallinfo2";
#else
  constexpr uint64_t kIds = 1 << 18;
  const size_t before = mallinfo2().uordblks;
  SecondHitPolicy p({.hits_required = 2, .max_tracked = kIds});
  for (ObjectId id = 1; id <= 2 * kIds; ++id) p.OnLookup(id * 0x9e3779b97f4a7c15ull, id);
  ASSERT_EQ(p.TEST_Tracked(), kIds);
  const size_t after = mallinfo2().uordblks;
  ASSERT_GT(after, before);
  EXPECT_LE((after - before) / kIds, SecondHitOptions::kBytesPerTrackedId);
#endif
}

// The live store counts references (and takes the lock that needs) only for a policy that
// says it counts them: second-hit must, and the others need not.
TEST(SecondHit, OnlySecondHitCountsLookups) {
  for (const auto& name : AdmissionPolicyNames()) {
    auto p = MakeAdmissionPolicy(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_EQ((*p)->CountsLookups(), name == "second-hit") << name;
  }
}

TEST(WriteBudget, RefusesBeyondTheBudgetAndRefillsPerDay) {
  WriteBudgetPolicy p({.bytes_per_day = 1000});
  EXPECT_TRUE(p.Admit({.id = 1, .size_bytes = 600}, 0));
  EXPECT_TRUE(p.Admit({.id = 2, .size_bytes = 400}, 10));
  EXPECT_FALSE(p.Admit({.id = 3, .size_bytes = 1}, 20));
  EXPECT_EQ(p.SpentBytes(), 1000u);
  EXPECT_FALSE(p.Admit({.id = 3, .size_bytes = 1}, kDayUs - 1));
  EXPECT_TRUE(p.Admit({.id = 3, .size_bytes = 900}, kDayUs));  // a new day: full budget
  EXPECT_FALSE(p.Admit({.id = 4, .size_bytes = 101}, kDayUs + 5));
  EXPECT_TRUE(p.Admit({.id = 4, .size_bytes = 100}, kDayUs + 5));
}

TEST(WriteBudget, ReportsItsBudgetAndWhatTheCurrentWindowSpent) {
  WriteBudgetPolicy p({.bytes_per_day = 1000, .window_ms = 1000});
  std::optional<AdmissionPolicy::ByteBudget> b = p.Budget(0);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->bytes_per_window, 1000u);
  EXPECT_EQ(b->window_ms, 1000u);
  EXPECT_EQ(b->spent_bytes, 0u);
  EXPECT_TRUE(p.Admit({.id = 1, .size_bytes = 600}, 10));
  EXPECT_FALSE(p.Admit({.id = 2, .size_bytes = 500}, 20));  // refused: not charged
  EXPECT_EQ(p.Budget(999'999)->spent_bytes, 600u);
  EXPECT_EQ(p.Budget(1'000'000)->spent_bytes, 0u);  // the next window, before any Admit
}

TEST(WriteBudget, PoliciesWithoutABudgetReportNone) {
  for (const auto& name : AdmissionPolicyNames()) {
    auto p = MakeAdmissionPolicy(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_EQ((*p)->Budget(0).has_value(), name == "write-budget") << name;
  }
}

// A write-budget that replaces another (new cap) keeps what the old one spent today, and one
// that starts over the new cap admits nothing until the next window (the unsigned
// "cap - spent" would otherwise wrap and admit everything).
TEST(WriteBudget, CarryOverKeepsTodaysSpentBytes) {
  WriteBudgetPolicy old({.bytes_per_day = 1000});
  EXPECT_TRUE(old.Admit({.id = 1, .size_bytes = 700}, 10));
  WriteBudgetPolicy bigger({.bytes_per_day = 2000});
  bigger.CarryOver(old, 20);
  EXPECT_EQ(bigger.Budget(20)->spent_bytes, 700u);
  EXPECT_FALSE(bigger.Admit({.id = 2, .size_bytes = 1301}, 30));
  EXPECT_TRUE(bigger.Admit({.id = 2, .size_bytes = 1300}, 30));
  WriteBudgetPolicy smaller({.bytes_per_day = 500});
  smaller.CarryOver(old, 40);
  EXPECT_FALSE(smaller.Admit({.id = 3, .size_bytes = 1}, 50));
  EXPECT_TRUE(smaller.Admit({.id = 3, .size_bytes = 1}, kDayUs));  // a new day
  // From a policy without a budget: nothing was metered, the budget is whole.
  SecondHitPolicy none;
  WriteBudgetPolicy fresh({.bytes_per_day = 1000});
  fresh.CarryOver(none, 60);
  EXPECT_EQ(fresh.Budget(60)->spent_bytes, 0u);
}

// A second-hit that replaces another (new hits_required or table size) keeps the counts, the
// newest ones when its table is smaller.
TEST(SecondHit, CarryOverKeepsTheCounts) {
  SecondHitPolicy old;
  for (ObjectId id = 1; id <= 5; ++id) {
    old.OnLookup(id, id);
    old.OnLookup(id, id);
  }
  SecondHitPolicy next({.hits_required = 2, .max_tracked = 3});
  next.CarryOver(old, 10);
  EXPECT_EQ(next.TEST_Tracked(), 3u);
  EXPECT_FALSE(next.Admit({.id = 2}, 10));  // among the oldest two: forgotten
  EXPECT_TRUE(next.Admit({.id = 3}, 10));
  EXPECT_TRUE(next.Admit({.id = 5}, 10));
  WriteBudgetPolicy other;
  SecondHitPolicy fresh;
  fresh.CarryOver(other, 10);
  EXPECT_EQ(fresh.TEST_Tracked(), 0u);
}

TEST(Registry, SameParamsForComparesWhatReachesThePolicy) {
  PolicyParams a, b;
  a.values = {{"write-budget:bytes_per_day", "10"}, {"long-tail:decay", "0.5"}};
  b.values = {{"long-tail:decay", "0.8"}, {"write-budget:bytes_per_day", "10"}};
  EXPECT_TRUE(SameParamsFor("write-budget", a, b));  // order and other scopes do not matter
  EXPECT_FALSE(SameParamsFor("long-tail", a, b));
  b.values = {{"write-budget:bytes_per_day", "10"}, {"bytes_per_day", "10"}};
  EXPECT_FALSE(SameParamsFor("write-budget", a, b));  // a plain key reaches it
  b = a;
  b.seed = a.seed + 1;
  EXPECT_FALSE(SameParamsFor("lru", a, b));
}

TEST(Registry, ScopedParametersReachOnlyTheirPolicy) {
  PolicyParams both;
  both.values = {{"write-budget:bytes_per_day", "4096"}, {"write-budget:window_ms", "1000"}};
  // lru takes no parameter: the write-budget keys must not reach it.
  EXPECT_TRUE(MakeEvictionPolicy("lru", both).ok());
  auto wb = MakeAdmissionPolicy("write-budget", both);
  ASSERT_TRUE(wb.ok()) << wb.status().ToString();
  EXPECT_EQ((*wb)->Budget(0)->bytes_per_window, 4096u);
  EXPECT_EQ((*wb)->Budget(0)->window_ms, 1000u);
  // A plain key still reaches every policy, so a typo is still caught.
  PolicyParams plain;
  plain.values = {{"bytes_per_day", "4096"}};
  EXPECT_FALSE(MakeEvictionPolicy("lru", plain).ok());
}

// A scope that names no policy is an error naming the key, for both kinds: no policy would
// read it (before, every factory skipped it and the misspelt setting silently did nothing).
TEST(Registry, AScopeThatNamesNoPolicyIsAnError) {
  PolicyParams typo;
  typo.values = {{"write_budget:bytes_per_day", "4096"}};
  for (auto status : {MakeEvictionPolicy("lru", typo).status(),
                      MakeAdmissionPolicy("write-budget", typo).status(),
                      MakeAdmissionPolicy("admit-all", typo).status()}) {
    EXPECT_TRUE(status.IsInvalidArgument()) << status.ToString();
    EXPECT_NE(status.ToString().find("write_budget:bytes_per_day"), std::string::npos)
        << status.ToString();
  }
  // A known policy that is not the one made is no error (one set configures both kinds).
  PolicyParams other;
  other.values = {{"long-tail:decay", "0.5"}};
  EXPECT_TRUE(MakeEvictionPolicy("lru", other).ok());
  EXPECT_TRUE(MakeAdmissionPolicy("admit-all", other).ok());
}

TEST(Registry, EveryAdvertisedPolicyConstructs) {
  for (const auto& name : EvictionPolicyNames()) {
    auto p = MakeEvictionPolicy(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_EQ((*p)->Name(), name);
  }
  for (const auto& name : AdmissionPolicyNames()) {
    auto p = MakeAdmissionPolicy(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_EQ((*p)->Name(), name);
  }
  EXPECT_FALSE(MakeEvictionPolicy("belady").ok());  // simulator-only, never registered
  PolicyParams bad;
  bad.values = {{"bytes_per_dy", "5"}};
  EXPECT_TRUE(MakeAdmissionPolicy("write-budget", bad).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::policies

namespace kvtier::policies {
namespace {

// `kvtier sim --param K=V` routes an unscoped key by these lists: they must name exactly the
// keys each factory accepts.
TEST(EvictionPolicyParamKeys, ListTheKeysEachFactoryAccepts) {
  EXPECT_TRUE(EvictionPolicyParamKeys("lru").empty());
  EXPECT_TRUE(EvictionPolicyParamKeys("no-such-policy").empty());
  EXPECT_TRUE(EvictionPolicyParamKeys("arc").empty());
  auto keys = EvictionPolicyParamKeys("long-tail");
  EXPECT_NE(std::find(keys.begin(), keys.end(), "decay"), keys.end());
  keys = EvictionPolicyParamKeys("s3fifo");
  EXPECT_NE(std::find(keys.begin(), keys.end(), "small_ratio"), keys.end());
}

}  // namespace
}  // namespace kvtier::policies
