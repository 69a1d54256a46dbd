// SlabAllocator: chunks never overlap and stay inside the arena, a page goes back to every
// class when its last chunk is freed (and no class hands out its chunks after that), a full
// arena says so, and every mix of allocations and frees keeps the byte count exact.
#include "storage/slab_allocator.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <vector>

namespace kvtier::storage {
namespace {

constexpr uint64_t kPage = 4096, kPages = 8, kMinChunk = 64;

TEST(SlabAllocator, ClassesCoverEverySizeUpToAPage) {
  SlabAllocator a(kPages * kPage, kPage, kMinChunk);
  EXPECT_EQ(a.ClassFor(1), 0);
  EXPECT_EQ(a.chunk_size(0), kMinChunk);
  for (uint64_t size : {1ull, 64ull, 65ull, 1000ull, 4095ull, 4096ull}) {
    const int c = a.ClassFor(size);
    ASSERT_GE(c, 0) << size;
    EXPECT_GE(a.chunk_size(c), size);
    if (c > 0) {
      EXPECT_LT(a.chunk_size(c - 1), size) << "not the smallest class for " << size;
    }
  }
  EXPECT_EQ(a.ClassFor(kPage + 1), -1);
}

TEST(SlabAllocator, FillsTheArenaWithDisjointChunksThenSaysFull) {
  SlabAllocator a(kPages * kPage, kPage, kMinChunk);
  const int c = a.ClassFor(100);
  const uint64_t chunk = a.chunk_size(c), per_page = kPage / chunk;
  std::set<uint64_t> offsets;
  std::vector<uint64_t> first_uses;
  for (uint64_t i = 0; i < per_page * kPages; ++i) {
    uint64_t first_use = 0;
    auto o = a.Allocate(c, &first_use);
    ASSERT_TRUE(o.has_value()) << i;
    EXPECT_EQ(*o % kPage % chunk, 0u);
    EXPECT_LE(*o % kPage + chunk, kPage) << "a chunk across a page boundary";
    EXPECT_LT(*o, kPages * kPage);
    EXPECT_TRUE(offsets.insert(*o).second) << "offset " << *o << " handed out twice";
    if (first_use != UINT64_MAX) first_uses.push_back(first_use);
  }
  EXPECT_EQ(first_uses.size(), kPages) << "each page's first use is reported once";
  EXPECT_EQ(a.used(), per_page * kPages * chunk);
  EXPECT_FALSE(a.Allocate(c).has_value());
  EXPECT_FALSE(a.Allocate(a.ClassFor(kPage)).has_value());
  EXPECT_EQ(a.free_pages(), 0u);
}

TEST(SlabAllocator, AnEmptiedPageServesAnotherClassAndNotItsOld) {
  SlabAllocator a(2 * kPage, kPage, kMinChunk);
  const int small = a.ClassFor(64), whole = a.ClassFor(kPage);
  const uint64_t per_page = kPage / a.chunk_size(small);
  std::vector<uint64_t> page0;
  for (uint64_t i = 0; i < per_page; ++i) page0.push_back(*a.Allocate(small));
  const uint64_t other = *a.Allocate(small);  // the second page
  EXPECT_EQ(a.free_pages(), 0u);
  for (uint64_t o : page0) a.Free(small, o);
  EXPECT_EQ(a.free_pages(), 1u);
  // The emptied page is the one free page: a whole-page chunk gets it.
  auto w = a.Allocate(whole);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(*w, page0.front() / kPage * kPage);
  // The small class has its second page's chunks only, never the given-away page's.
  for (uint64_t i = 1; i < per_page; ++i) {
    auto o = a.Allocate(small);
    ASSERT_TRUE(o.has_value());
    EXPECT_EQ(*o / kPage, other / kPage) << "a chunk of the page the whole-page class holds";
  }
  EXPECT_FALSE(a.Allocate(small).has_value());
  EXPECT_EQ(a.used(), kPage + per_page * a.chunk_size(small));
}

// A value replaced again and again (allocate the new, free the old) keeps to one page.
TEST(SlabAllocator, AReplacedValueKeepsToOnePage) {
  SlabAllocator a(kPages * kPage, kPage, kMinChunk);
  const int c = a.ClassFor(1000);
  uint64_t held = *a.Allocate(c);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t next = *a.Allocate(c);
    a.Free(c, held);
    held = next;
    EXPECT_EQ(held / kPage, 0u) << i;
  }
  EXPECT_EQ(a.free_pages(), kPages - 1);
  a.Free(c, held);
  EXPECT_EQ(a.free_pages(), kPages);
  EXPECT_EQ(a.used(), 0u);
}

// Random allocations and frees over several classes against a model of what is live: no
// offset is live twice, none overlaps another, the byte count is exact, and once everything
// is freed every page is free again.
TEST(SlabAllocator, RandomMixesKeepChunksDisjointAndCountsExact) {
  SlabAllocator a(kPages * kPage, kPage, kMinChunk);
  std::mt19937_64 rng(7);
  std::map<uint64_t, int> live;  // offset -> class
  uint64_t used = 0;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 100 < 55) {
      const int c = a.ClassFor(1 + rng() % 1500);
      auto o = a.Allocate(c);
      if (!o) continue;  // full for this class
      const uint64_t end = *o + a.chunk_size(c);
      auto next = live.lower_bound(*o);
      if (next != live.end()) {
        ASSERT_LE(end, next->first) << "overlaps the next chunk";
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + a.chunk_size(prev->second), *o) << "overlaps the previous chunk";
      }
      live[*o] = c;
      used += a.chunk_size(c);
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      a.Free(it->second, it->first);
      used -= a.chunk_size(it->second);
      live.erase(it);
    }
    ASSERT_EQ(a.used(), used) << step;
  }
  for (auto [o, c] : live) a.Free(c, o);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_pages(), kPages);
}

}  // namespace
}  // namespace kvtier::storage
