// engine/scratch.h: a slot is reused call to call (no allocation once it is large enough), its
// values are what it last held, and a slot that grew past kScratchKeepBytes is released.
#include "engine/scratch.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvtier::engine {
namespace {

TEST(Scratch, ReusesItsSlotAndReleasesOnlyWhatGrewPastTheBound) {
  std::vector<float> slot;
  const float* first = nullptr;
  {
    Scratch<float> s(slot, 1000);
    ASSERT_EQ(s.size(), 1000u);
    s.fill(2.0f);
    first = s.data();
  }
  {
    Scratch<float> s(slot, 500);  // smaller: the same storage, the values it last held
    EXPECT_EQ(s.data(), first);
    EXPECT_EQ(s.size(), 500u);
    EXPECT_EQ(s[499], 2.0f);
  }
  EXPECT_GE(slot.capacity(), 1000u);  // kept: under the bound
  {
    Scratch<float> s(slot, kScratchKeepBytes / sizeof(float) + 1);  // a long prefill's size
    s[0] = 1.0f;
  }
  EXPECT_EQ(slot.capacity(), 0u);  // released on the way out

  std::vector<int> grown;
  grown.resize(kScratchKeepBytes / sizeof(int) + 1);
  TrimScratch(grown);
  EXPECT_EQ(grown.capacity(), 0u);
  grown.resize(10);
  TrimScratch(grown);
  EXPECT_EQ(grown.size(), 10u);  // under the bound: untouched

  int runs = 0;
  {
    const ScopeExit once([&] { ++runs; });
    EXPECT_EQ(runs, 0);
  }
  EXPECT_EQ(runs, 1);
}

}  // namespace
}  // namespace kvtier::engine
