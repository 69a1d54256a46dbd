// Longer engine checks (LABELS slow): the candidate pool at the 512-token boundary and past it.
#include <gtest/gtest.h>

#include "engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::BitEqual;
using testutil::MakeEngine;
using testutil::Prompt;

TEST(EngineSlow, PoolCoversAllAt512AndRestrictsBeyond) {
  auto with_pool = MakeEngine(2, true);
  auto without = MakeEngine(2, false);
  StepTrace trace;
  with_pool->set_trace(&trace);
  SequenceState a = with_pool->NewSequence(), b = without->NewSequence();
  std::vector<float> la, lb;
  const auto prompt = Prompt(512, 21);
  ASSERT_TRUE(with_pool->Forward(&a, prompt, false, &la).ok());
  ASSERT_TRUE(without->Forward(&b, prompt, false, &lb).ok());
  EXPECT_EQ(trace.candidate_pool.back(), 512);
  EXPECT_TRUE(BitEqual(la.data(), lb.data(), la.size()));
  // Past 512 positions the pool (64 blocks x 8) no longer covers everything.
  const auto more = Prompt(40, 22);
  ASSERT_TRUE(with_pool->Forward(&a, more, false, &la).ok());
  EXPECT_EQ(trace.candidate_visible.back(), 552);
  EXPECT_EQ(trace.candidate_pool.back(), 512);
}

}  // namespace
}  // namespace kvtier::engine
