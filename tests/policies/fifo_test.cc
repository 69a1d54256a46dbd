#include "policies/fifo/fifo.h"

#include <gtest/gtest.h>

namespace kvtier::policies {
namespace {

TEST(Fifo, EvictsInInsertionOrderIgnoringHits) {
  FifoPolicy p;
  for (ObjectId id = 1; id <= 3; ++id) p.OnInsert({.id = id}, id);
  p.OnAccess(1, 10);  // a hit does not reorder FIFO
  EXPECT_EQ(p.Evict(11), std::optional<ObjectId>(1));
  p.OnRemove(2);
  EXPECT_FALSE(p.Contains(2));
  EXPECT_EQ(p.Evict(12), std::optional<ObjectId>(3));
  EXPECT_EQ(p.Evict(13), std::nullopt);
}

}  // namespace
}  // namespace kvtier::policies
