// SSD tier free-space floor (SsdOptions::disk_free_min_bytes; docs/format/ssd.md "Free space
// for the index"): the segments give way to the files that share their disk. A fault env
// models a small disk (FaultInjectionEnv::SetDiskBytes) whose other files (the index, a name
// log) grow and shrink at the test's word (SetOtherBytes). The tier must never prepare a
// segment into the floor, must reclaim segments while the others grow into it, must take its
// room back once they shrink, and at its smallest must refuse puts with a clear error rather
// than take the last bytes; every unit reads back exactly or is gone.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_tier.h"
#include "tests/process_util.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kSegmentBytes = kMiB;
constexpr size_t kUnitBytes = 10'000;  // ~100 units per segment
// Liveness bound: a condition the segment thread must reach within this long.
constexpr auto kStuck = std::chrono::seconds(20);

SsdOptions Options(const std::string& dir, DeviceEnv* env, uint64_t floor_bytes) {
  SsdOptions o;
  o.dir = dir;
  o.env = env;
  o.segment_bytes = kSegmentBytes;
  o.capacity_bytes = 16 * kSegmentBytes;
  o.write_buffer_bytes = 64 << 10;
  o.durability = Durability::kBatched;
  o.group_commit_ms = 3'600'000;
  o.compression = false;
  o.background_io_bytes_per_s = 0;
  o.disk_free_min_bytes = floor_bytes;
  o.disk_check_ms = 2;
  return o;
}

Status PutUnit(SsdTier& ssd, int i) {
  SsdMeta m;
  m.version = 1;
  std::vector<Key> evicted;
  return ssd.Put(MakeKey(i), MakeValue(MakeKey(i), 1, kUnitBytes), m, &evicted);
}

// Every unit below `units` reads back exactly or is gone; returns how many are there.
int CheckUnits(SsdTier& ssd, int units) {
  int present = 0;
  std::vector<uint8_t> out;
  SsdMeta meta;
  for (int i = 0; i < units; ++i) {
    Status st = ssd.Get(MakeKey(i), &out, &meta);
    if (st.IsNotFound()) continue;
    EXPECT_TRUE(st.ok()) << i << ": " << st.ToString();
    if (!st.ok()) continue;
    EXPECT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
    ++present;
  }
  return present;
}

uint64_t FreeBytes(FaultInjectionEnv& env) {
  auto free = env.FreeBytes();
  EXPECT_TRUE(free.ok()) << free.status().ToString();
  return free.ok() ? *free : 0;
}

class DiskFloorTest : public ::testing::Test {
 protected:
  TempDir dir_;
  std::unique_ptr<DeviceEnv> mem_ = NewMemEnv();
  FaultInjectionEnv disk_{mem_.get(), {}};
};

// A 10 MiB disk under a 16 MiB capacity and a 3 MiB floor: the tier stops preparing segments
// where one more would leave less than 3 MiB free, so the free space never goes below the floor
// while puts write 12 MB, and the tier reports the lower capacity. Without the check at
// preparation, the segments take the disk down to its last segment's worth.
TEST_F(DiskFloorTest, ANewSegmentNeverTakesTheDiskBelowTheFloor) {
  constexpr uint64_t kFloorBytes = 3 * kMiB;
  disk_.SetDiskBytes(10 * kMiB);
  auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, kFloorBytes));
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  constexpr int kUnits = 1200;  // 12 MB
  uint64_t free_min = UINT64_MAX;
  for (int i = 0; i < kUnits; ++i) {
    Status st = PutUnit(**ssd, i);
    ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
    free_min = std::min(free_min, FreeBytes(disk_));
  }
  EXPECT_GE(free_min, kFloorBytes);
  SsdStats s = (*ssd)->GetStats();
  EXPECT_GE(s.disk_free_shrinks, 1u);
  EXPECT_LE(s.capacity_bytes, 7 * kSegmentBytes);
  EXPECT_GT(s.evictions, 0u);
  EXPECT_EQ(s.disk_full_shrinks, 0u);  // no ENOSPC was met
  EXPECT_GT(CheckUnits(**ssd, kUnits), 100);
  std::vector<uint8_t> out;
  SsdMeta meta;
  EXPECT_TRUE((*ssd)->Get(MakeKey(kUnits - 1), &out, &meta).ok());
}

// The tier fills a 20 MiB disk, then the other files grow by 8 MiB: the free space falls
// below the 2 MiB floor and the tier gives segments back (the cleaner reclaims them, without
// a put to drive it) until the floor is free again; units read back exactly or are gone. The
// other files shrink again: the limit rises, one segment per check after a quiet spell, and
// puts fill the tier back to its full capacity.
TEST_F(DiskFloorTest, TheSegmentsGiveWayWhileTheIndexGrowsAndComeBackWhenItShrinks) {
  constexpr uint64_t kFloorBytes = 2 * kMiB;
  disk_.SetDiskBytes(20 * kMiB);
  auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, kFloorBytes));
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  int units = 0;
  for (; units < 1500; ++units) ASSERT_TRUE(PutUnit(**ssd, units).ok()) << units;
  ASSERT_TRUE((*ssd)->Flush().ok());
  const uint64_t full_capacity = (*ssd)->GetStats().capacity_bytes;
  ASSERT_EQ(full_capacity, 16 * kSegmentBytes);
  ASSERT_GE(FreeBytes(disk_), kFloorBytes);

  disk_.SetOtherBytes(8 * kMiB);
  ASSERT_LT(FreeBytes(disk_), kFloorBytes);
  const auto deadline = std::chrono::steady_clock::now() + kStuck;
  while (FreeBytes(disk_) < kFloorBytes && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(FreeBytes(disk_), kFloorBytes) << "the segments did not give way";
  SsdStats s = (*ssd)->GetStats();
  EXPECT_GE(s.disk_free_shrinks, 1u);
  EXPECT_LT(s.capacity_bytes, full_capacity);
  EXPECT_GT(CheckUnits(**ssd, units), 300);
  // Puts go on within the lower limit, and the floor holds.
  for (int end = units + 300; units < end; ++units) {
    ASSERT_TRUE(PutUnit(**ssd, units).ok()) << units;
    EXPECT_GE(FreeBytes(disk_), kFloorBytes) << units;
  }

  disk_.SetOtherBytes(0);
  const auto back_by = std::chrono::steady_clock::now() + kStuck;
  while ((*ssd)->GetStats().capacity_bytes < full_capacity &&
         std::chrono::steady_clock::now() < back_by) {
    ASSERT_TRUE(PutUnit(**ssd, units).ok()) << units;
    ++units;
  }
  EXPECT_EQ((*ssd)->GetStats().capacity_bytes, full_capacity) << "the limit did not rise again";
  EXPECT_GE(FreeBytes(disk_), kFloorBytes);
  CheckUnits(**ssd, units);
}

// A disk of 3.5 MiB and a 1 MiB floor cannot hold the tier's smallest size (3 segments) and
// the floor: once two segments are full, a put that needs a third fails with a no-space error
// that names the floor, and the free space stays above it. Once the disk has room (here: it
// grows), puts succeed again without a restart.
TEST_F(DiskFloorTest, AtItsSmallestTheTierRefusesPutsUntilTheDiskHasRoom) {
  constexpr uint64_t kFloorBytes = kMiB;
  disk_.SetDiskBytes(3 * kMiB + kMiB / 2);
  auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, kFloorBytes));
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  Status refused;
  int units = 0;
  for (; units < 400 && refused.ok(); ++units) {
    refused = PutUnit(**ssd, units);
    EXPECT_GE(FreeBytes(disk_), kFloorBytes) << units;
  }
  ASSERT_FALSE(refused.ok()) << "400 units fit in two segments?";
  EXPECT_TRUE(IsNoSpace(refused)) << refused.ToString();
  EXPECT_NE(refused.message().find("disk_free_min_bytes"), std::string::npos) << refused.ToString();
  EXPECT_GT(CheckUnits(**ssd, units), 100);

  disk_.SetDiskBytes(64 * kMiB);
  Status st;
  const auto deadline = std::chrono::steady_clock::now() + kStuck;
  do {
    st = PutUnit(**ssd, units);
    if (!st.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (!st.ok() && std::chrono::steady_clock::now() < deadline);
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (int end = units + 300; units < end; ++units) {
    ASSERT_TRUE(PutUnit(**ssd, units).ok()) << units;
  }
  CheckUnits(**ssd, units);
}

// A daemon that stopped with its disk full must start again: a start appends to a fresh
// segment, and before, its fallocate's ENOSPC failed the whole start ("opening the store: no
// space left on device", found on a tmpfs filled to 2 MB free). Now the oldest segment gives
// way: its file is deleted and its units are dropped (misses, never wrong), every other unit
// reads back exactly, and the tier goes on within what the disk holds.
TEST_F(DiskFloorTest, AStartOnAFullDiskDropsTheOldestSegmentInsteadOfFailing) {
  constexpr int kUnits = 500;  // ~5 segments of 1 MiB
  {
    auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, 0));
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    for (int i = 0; i < kUnits; ++i) ASSERT_TRUE(PutUnit(**ssd, i).ok()) << i;
    ASSERT_TRUE((*ssd)->Flush().ok());
  }
  auto files = disk_.List();
  ASSERT_TRUE(files.ok());
  const size_t held = files->size();
  ASSERT_GE(held, 4u);
  disk_.SetFilesMax(held);  // the disk is full: not one more segment
  auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, 0));
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  ASSERT_TRUE((*ssd)->WaitForIndexLoad().ok());
  SsdStats s = (*ssd)->GetStats();
  EXPECT_EQ(s.disk_full_open_drops, 1u);
  EXPECT_GT(s.dropped_on_recovery, 0u);
  const int present = CheckUnits(**ssd, kUnits);
  EXPECT_EQ(present, kUnits - static_cast<int>(s.dropped_on_recovery));
  EXPECT_GT(present, kUnits / 2);
  std::vector<uint8_t> out;
  SsdMeta meta;
  EXPECT_TRUE((*ssd)->Get(MakeKey(0), &out, &meta).IsNotFound());  // in the oldest segment
  EXPECT_TRUE((*ssd)->Get(MakeKey(kUnits - 1), &out, &meta).ok());
  for (int i = kUnits; i < kUnits + 300; ++i) ASSERT_TRUE(PutUnit(**ssd, i).ok()) << i;
  CheckUnits(**ssd, kUnits + 300);
}

// With no room at all (probed: a tmpfs filled to 0 bytes free), RocksDB 7.8 opening the
// index ended kvtierd with an assertion of its own. Open now fails first with a no-space error
// that says what to free; once there is room the same store opens with every unit.
TEST_F(DiskFloorTest, AStartWithNoRoomForTheIndexFailsWithAnErrorNotAnAbort) {
  {
    auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, 0));
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(PutUnit(**ssd, i).ok()) << i;
  }
  disk_.SetDiskBytes(64 * kMiB);
  disk_.SetOtherBytes(64 * kMiB);  // full
  auto refused = SsdTier::Open(Options(dir_.path(), &disk_, 0));
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(IsNoSpace(refused.status())) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("needs at least"), std::string::npos)
      << refused.status().ToString();
  disk_.SetOtherBytes(0);
  auto ssd = SsdTier::Open(Options(dir_.path(), &disk_, 0));
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  ASSERT_TRUE((*ssd)->WaitForIndexLoad().ok());
  EXPECT_EQ(CheckUnits(**ssd, 50), 50);
}

// The index's own share of the disk stays bounded: its meta column family takes a small write
// per commit and never fills a memtable, so without max_total_wal_size every WAL since the
// start stayed on disk (a 48 MiB disk held 23 MiB of WALs beside 1 MiB of tables). 100,000
// puts in 1,000 commits write some 10 MB of index entries; the WALs on disk (allocated
// blocks, preallocation included) stay within a few memtables of a 64 MiB tier (1 MiB each).
TEST(IndexWal, StaysWithinItsBoundWhileOneColumnFamilyTakesEveryWrite) {
  TempDir dir;
  auto mem = NewMemEnv();
  SsdOptions o = Options(dir.path(), mem.get(), 0);
  o.capacity_bytes = 64 * kMiB;
  auto ssd = SsdTier::Open(o);
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  SsdMeta m;
  m.version = 1;
  std::vector<Key> evicted;
  const std::vector<uint8_t> value(64, 7);
  for (int i = 0; i < 100'000; ++i) {
    ASSERT_TRUE((*ssd)->Put(MakeKey(i), value, m, &evicted).ok()) << i;
    if (i % 100 == 99) {
      ASSERT_TRUE((*ssd)->Flush().ok()) << i;
    }
  }
  uint64_t wal_bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/index")) {
    if (e.path().extension() != ".log") continue;
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0) << e.path();
    wal_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  EXPECT_LE(wal_bytes, 4 * kMiB);
  EXPECT_GT(wal_bytes, 0u);
}

// Without a floor (0) or without a limit to read (memory), the segment thread sleeps until it
// is woken: an idle tier takes no CPU (a first version waited "for ever" with wait_for, whose
// deadline overflowed the clock: the thread spun).
TEST(DiskFloorIdle, AnIdleTierSleepsWithAndWithoutAFloor) {
  auto mem = NewMemEnv();
  for (uint64_t floor_bytes : {uint64_t{0}, 3 * kMiB}) {
    TempDir tier_dir;
    auto ssd = SsdTier::Open(Options(tier_dir.path(), mem.get(), floor_bytes));
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    ASSERT_TRUE(PutUnit(**ssd, 1).ok());
    ASSERT_TRUE((*ssd)->Flush().ok());
    // RocksDB's own threads idle too; 1 s of a spinning thread would be ~1 CPU-s.
    EXPECT_LT(kvtier::testing::SelfCpuSecondsOver(std::chrono::milliseconds(1000)), 0.25)
        << floor_bytes;
  }
}

// The env's side of it: memory has no limit, a directory reports its file system's free space.
TEST(DiskFreeBytes, MemoryHasNoLimitAndADirectoryReportsItsFileSystem) {
  auto mem = NewMemEnv();
  auto free = mem->FreeBytes();
  ASSERT_TRUE(free.ok());
  EXPECT_EQ(*free, DeviceEnv::kNoFreeSpaceLimit);
  TempDir dir;
  auto env = NewDirEnv(dir.path() + "/segments");
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  free = (*env)->FreeBytes();
  ASSERT_TRUE(free.ok()) << free.status().ToString();
  EXPECT_GT(*free, 0u);
  EXPECT_LT(*free, DeviceEnv::kNoFreeSpaceLimit);
  FaultInjectionEnv fault(env->get(), {});
  auto forwarded = fault.FreeBytes();
  ASSERT_TRUE(forwarded.ok());
  EXPECT_GT(*forwarded, 0u);
}

}  // namespace
}  // namespace kvtier::storage
