// ShmValueWriter (cache_daemon/shm_writer.h): a native GET's values reach the connection's
// shared-memory file back to back, exact, in one write per stage; no room is nullopt; a
// refused write loses exactly the values it carried.
#include "cache_daemon/shm_writer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

namespace kvtier::daemon::internal {
namespace {

class Memfd {
 public:
  explicit Memfd(uint64_t bytes) : fd_(::memfd_create("shm-writer-test", MFD_CLOEXEC)) {
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(::ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  }
  ~Memfd() { ::close(fd_); }
  int fd() const { return fd_; }
  std::vector<uint8_t> Read(uint64_t offset, uint64_t bytes) const {
    std::vector<uint8_t> out(bytes);
    EXPECT_EQ(::pread(fd_, out.data(), bytes, static_cast<off_t>(offset)),
              static_cast<ssize_t>(bytes));
    return out;
  }

 private:
  int fd_;
};

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

// PwriteAll, counting the calls and refusing those listed in `refuse` (1-based call numbers).
struct CountingWrite {
  int calls = 0;
  std::vector<int> refuse;
  ShmValueWriter::WriteFn Fn() {
    return [this](int fd, std::span<const uint8_t> v, uint64_t offset) {
      ++calls;
      for (int r : refuse) {
        if (r == calls) return false;
      }
      return PwriteAll(fd, v, offset);
    };
  }
};

TEST(ShmValueWriterTest, AResumeBatchLandsBackToBackExactInOneWrite) {
  constexpr size_t kUnits = 256, kUnitBytes = 5216;
  constexpr uint64_t kDst = 4096;
  Memfd f(4u << 20);
  CountingWrite cw;
  std::vector<std::vector<uint8_t>> values;
  std::vector<ShmValueWriter::Slot> slots;
  {
    ShmValueWriter w(f.fd(), kDst, 2u << 20, cw.Fn());
    for (size_t i = 0; i < kUnits; ++i) {
      values.push_back(Pattern(kUnitBytes, static_cast<uint32_t>(i)));
      auto s = w.Add(values.back());
      ASSERT_TRUE(s.has_value()) << i;
      EXPECT_EQ(s->index, i);
      EXPECT_EQ(s->offset, kDst + i * kUnitBytes);
      slots.push_back(*s);
    }
    EXPECT_FALSE(w.Written(0)) << "nothing is written before Flush";
    EXPECT_EQ(cw.calls, 0);
    w.Flush();
    EXPECT_EQ(cw.calls, 1) << "one write for the whole batch";
    EXPECT_EQ(w.failed_writes(), 0u);
    for (size_t i = 0; i < kUnits; ++i) EXPECT_TRUE(w.Written(i)) << i;
    EXPECT_FALSE(w.Written(kUnits));
  }
  for (size_t i = 0; i < kUnits; ++i) {
    ASSERT_EQ(f.Read(slots[i].offset, kUnitBytes), values[i]) << "value " << i;
  }
  EXPECT_EQ(f.Read(0, kDst), std::vector<uint8_t>(kDst, 0)) << "nothing before dst_offset";
}

TEST(ShmValueWriterTest, NoRoomIsNulloptAndPlacesNothing) {
  Memfd f(1u << 20);
  ShmValueWriter w(f.fd(), 100, 10000);
  const auto a = Pattern(5216, 1), b = Pattern(5216, 2), c = Pattern(10000 - 5216, 3);
  auto sa = w.Add(a);
  ASSERT_TRUE(sa.has_value());
  EXPECT_FALSE(w.Add(b).has_value()) << "5216 more bytes do not fit in 10000";
  auto sc = w.Add(c);  // exactly fills what is left
  ASSERT_TRUE(sc.has_value());
  EXPECT_EQ(sc->index, 1u);
  EXPECT_EQ(sc->offset, 100u + 5216u);
  EXPECT_FALSE(w.Add(Pattern(1, 4)).has_value());
  w.Flush();
  EXPECT_TRUE(w.Written(0));
  EXPECT_TRUE(w.Written(1));
  EXPECT_EQ(f.Read(100, 5216), a);
  EXPECT_EQ(f.Read(100 + 5216, c.size()), c);
  EXPECT_EQ(f.Read(100 + 10000, 16), std::vector<uint8_t>(16, 0));
}

TEST(ShmValueWriterTest, ARefusedWriteLosesExactlyTheValuesItCarried) {
  // 1 MiB values: four fill the stage, the fifth starts a second write.
  constexpr size_t kMiB = 1u << 20;
  static_assert(kShmStageBytesMax == 4 * kMiB);
  Memfd f(16 * kMiB);
  CountingWrite cw;
  cw.refuse = {2};
  std::vector<std::vector<uint8_t>> values;
  ShmValueWriter w(f.fd(), 0, 16 * kMiB, cw.Fn());
  for (uint32_t i = 0; i < 10; ++i) {
    values.push_back(Pattern(kMiB, i));
    ASSERT_TRUE(w.Add(values.back()).has_value());
  }
  w.Flush();
  EXPECT_EQ(cw.calls, 3);  // values 0-3, 4-7 (refused), 8-9
  EXPECT_EQ(w.failed_writes(), 1u);
  for (size_t i = 0; i < 10; ++i) {
    const bool lost = i >= 4 && i < 8;
    EXPECT_EQ(w.Written(i), !lost) << "value " << i;
    if (!lost) {
      EXPECT_EQ(f.Read(i * kMiB, kMiB), values[i]) << "value " << i;
    }
  }
}

TEST(ShmValueWriterTest, ALargeValueIsWrittenDirectlyAfterWhatIsStaged) {
  Memfd f(16u << 20);
  CountingWrite cw;
  const auto empty = std::vector<uint8_t>{};
  const auto small = Pattern(3000, 1);
  const auto large = Pattern(kShmStageBytesMax + 1, 2);
  const auto tail = Pattern(777, 3);
  ShmValueWriter w(f.fd(), 64, 15u << 20, cw.Fn());
  auto s0 = w.Add(empty);  // an empty value first: still written with its group
  auto s1 = w.Add(small);
  auto s2 = w.Add(large);
  EXPECT_EQ(cw.calls, 2) << "the staged values, then the large value by itself";
  EXPECT_TRUE(w.Written(0));
  EXPECT_TRUE(w.Written(1));
  EXPECT_TRUE(w.Written(2));
  auto s3 = w.Add(tail);
  EXPECT_FALSE(w.Written(3));
  w.Flush();
  EXPECT_EQ(cw.calls, 3);
  EXPECT_TRUE(w.Written(3));
  ASSERT_TRUE(s0 && s1 && s2 && s3);
  EXPECT_EQ(s1->offset, 64u);
  EXPECT_EQ(s2->offset, 64u + small.size());
  EXPECT_EQ(s3->offset, 64u + small.size() + large.size());
  EXPECT_EQ(f.Read(s1->offset, small.size()), small);
  EXPECT_EQ(f.Read(s2->offset, large.size()), large);
  EXPECT_EQ(f.Read(s3->offset, tail.size()), tail);
}

TEST(ShmValueWriterTest, ValuesNotFlushedAreNeverWritten) {
  Memfd f(1u << 20);
  CountingWrite cw;
  {
    ShmValueWriter w(f.fd(), 0, 1u << 20, cw.Fn());
    ASSERT_TRUE(w.Add(Pattern(4096, 1)).has_value());
  }
  EXPECT_EQ(cw.calls, 0);
  EXPECT_EQ(f.Read(0, 4096), std::vector<uint8_t>(4096, 0));
}

}  // namespace
}  // namespace kvtier::daemon::internal
