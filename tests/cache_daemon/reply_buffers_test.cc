// ReplyBuffers (cache_daemon/reply_buffers.h): which buffers it keeps, which it hands out, and
// that what it keeps stays within its limit under concurrent use.
#include "cache_daemon/reply_buffers.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace kvtier::daemon::internal {
namespace {

std::vector<uint8_t> Buffer(size_t capacity, size_t size) {
  std::vector<uint8_t> b;
  b.reserve(capacity);
  b.assign(size, 0x7e);
  return b;
}

TEST(ReplyBuffers, NothingKeptGivesAnEmptyBuffer) {
  ReplyBuffers buffers(64u << 20);
  std::vector<uint8_t> b = buffers.Take();
  EXPECT_EQ(b.capacity(), 0u);
  EXPECT_EQ(buffers.kept_bytes(), 0u);
}

TEST(ReplyBuffers, TakeHandsOutTheLargestKeptBufferEmpty) {
  ReplyBuffers buffers(64u << 20);
  buffers.Give(Buffer(1u << 20, 1000));
  buffers.Give(Buffer(4u << 20, 3u << 20));
  buffers.Give(Buffer(2u << 20, 5));
  EXPECT_EQ(buffers.kept_buffers(), 3u);
  EXPECT_EQ(buffers.kept_bytes(), 7u << 20);
  std::vector<uint8_t> b = buffers.Take();
  EXPECT_EQ(b.capacity(), 4u << 20);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(buffers.kept_bytes(), 3u << 20);
  EXPECT_EQ(buffers.Take().capacity(), 2u << 20);
  EXPECT_EQ(buffers.Take().capacity(), 1u << 20);
  EXPECT_EQ(buffers.Take().capacity(), 0u);
  EXPECT_EQ(buffers.kept_bytes(), 0u);
}

// For a reader that overwrites the buffer whole: the kept buffer as it was given back, so
// that resizing it to a reply no larger does not zero it first.
TEST(ReplyBuffers, TakeToOverwriteLeavesTheBufferAsGiven) {
  ReplyBuffers buffers(64u << 20);
  std::vector<uint8_t> given = Buffer(1u << 20, 300000);
  const uint8_t* data = given.data();
  buffers.Give(std::move(given));
  std::vector<uint8_t> b = buffers.TakeToOverwrite();
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.capacity(), 1u << 20);
  ASSERT_EQ(b.size(), 300000u);
  EXPECT_EQ(b.front(), 0x7e);
  EXPECT_EQ(b.back(), 0x7e);
  EXPECT_EQ(buffers.kept_bytes(), 0u);
  EXPECT_EQ(buffers.TakeToOverwrite().capacity(), 0u) << "nothing kept: a new buffer";
}

TEST(ReplyBuffers, SmallBuffersAreFreedNotKept) {
  ReplyBuffers buffers(64u << 20);
  buffers.Give(Buffer(ReplyBuffers::kMinKeptBytes - 1, 10));
  EXPECT_EQ(buffers.kept_buffers(), 0u);
  buffers.Give(Buffer(ReplyBuffers::kMinKeptBytes, 10));
  EXPECT_EQ(buffers.kept_buffers(), 1u);
}

TEST(ReplyBuffers, KeepsWithinItsLimit) {
  ReplyBuffers buffers(5u << 20);
  buffers.Give(Buffer(2u << 20, 0));
  buffers.Give(Buffer(2u << 20, 0));
  buffers.Give(Buffer(2u << 20, 0));  // 6 MiB would pass the limit: freed
  EXPECT_EQ(buffers.kept_buffers(), 2u);
  EXPECT_EQ(buffers.kept_bytes(), 4u << 20);
  buffers.Give(Buffer(1u << 20, 0));  // exactly the limit
  EXPECT_EQ(buffers.kept_bytes(), 5u << 20);

  ReplyBuffers none(0);
  none.Give(Buffer(1u << 20, 0));
  EXPECT_EQ(none.kept_buffers(), 0u);
}

TEST(ReplyBuffers, KeepsAtMostItsCountOfBuffers) {
  ReplyBuffers buffers(1ull << 40);
  for (size_t i = 0; i < ReplyBuffers::kMaxKeptBuffers + 5; ++i) {
    buffers.Give(Buffer(ReplyBuffers::kMinKeptBytes, 0));
  }
  EXPECT_EQ(buffers.kept_buffers(), ReplyBuffers::kMaxKeptBuffers);
  EXPECT_EQ(buffers.kept_bytes(), ReplyBuffers::kMaxKeptBuffers * ReplyBuffers::kMinKeptBytes);
}

// A small reply built in a large kept buffer is queued as an exact copy, the buffer kept
// again; a reply that fills its buffer is queued as it is.
TEST(ReplyBuffers, FitCopiesASmallReplyOutOfALargeBuffer) {
  ReplyBuffers buffers(64u << 20);
  std::vector<uint8_t> small = buffers.Fit(Buffer(8u << 20, 100));
  EXPECT_EQ(small.size(), 100u);
  EXPECT_LT(small.capacity(), ReplyBuffers::kMinKeptBytes);
  EXPECT_EQ(small, std::vector<uint8_t>(100, 0x7e));
  EXPECT_EQ(buffers.kept_bytes(), 8u << 20);

  std::vector<uint8_t> big = buffers.Fit(Buffer(8u << 20, 5u << 20));
  EXPECT_EQ(big.size(), 5u << 20);
  EXPECT_EQ(big.capacity(), 8u << 20);
  EXPECT_EQ(buffers.kept_bytes(), 8u << 20);  // nothing more given back

  // Up to twice the size stays as it is (as a vector grown by doubling); a tiny reply in the
  // smallest buffer kept is copied out.
  EXPECT_EQ(buffers.Fit(Buffer(2u << 20, 1u << 20)).capacity(), 2u << 20);
  EXPECT_EQ(buffers.Fit(Buffer(ReplyBuffers::kMinKeptBytes, 10)).capacity(), 10u);
}

// Workers take buffers, grow them as replies do, and give them back, all at once: the tally
// stays the sum of what is kept and within the limit.
TEST(ReplyBuffers, ConcurrentTakesAndGivesKeepTheTallyTrue) {
  static constexpr uint64_t kLimit = 8u << 20;
  ReplyBuffers buffers(kLimit);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&buffers, t] {
      for (int i = 0; i < 500; ++i) {
        std::vector<uint8_t> b = buffers.Take();
        EXPECT_TRUE(b.empty());
        b.resize(ReplyBuffers::kMinKeptBytes * static_cast<size_t>(1 + (i + t) % 5), 1);
        buffers.Give(std::move(b));
        EXPECT_LE(buffers.kept_bytes(), kLimit);
      }
    });
  }
  for (auto& th : threads) th.join();
  uint64_t sum = 0;
  const size_t n = buffers.kept_buffers();
  for (size_t i = 0; i < n; ++i) sum += buffers.Take().capacity();
  EXPECT_GT(n, 0u);
  EXPECT_LE(sum, kLimit);
  EXPECT_EQ(buffers.kept_bytes(), 0u);
}

}  // namespace
}  // namespace kvtier::daemon::internal
