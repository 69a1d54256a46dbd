#include "policies/gdsf/gdsf.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

TEST(Gdsf, KeepsExpensivePerByteAndAgesWithInflation) {
  GdsfPolicy p;
  p.OnInsert({.id = 1, .size_bytes = 1000, .recompute_tokens = 64}, 0);   // 0.064 / byte
  p.OnInsert({.id = 2, .size_bytes = 1000, .recompute_tokens = 640}, 0);  // 0.64 / byte
  p.OnInsert({.id = 3, .size_bytes = 100, .recompute_tokens = 64}, 0);    // 0.64 / byte
  EXPECT_EQ(p.Evict(1), std::optional<ObjectId>(1));
  EXPECT_DOUBLE_EQ(p.TEST_Inflation(), 0.064);
  // A new cheap object now starts at L + 0.064, above nothing yet cached: 2 and 3 at 0.64.
  p.OnInsert({.id = 4, .size_bytes = 1000, .recompute_tokens = 64}, 2);
  EXPECT_EQ(p.Evict(3), std::optional<ObjectId>(4));
  p.OnAccess(2, 4);  // frequency doubles 2's priority
  EXPECT_EQ(p.Evict(5), std::optional<ObjectId>(3));
}

}  // namespace
}  // namespace kvtier::policies
