// SSD tier segment thread: preparing the next segment (fallocate) and cleaning (reading the
// victim's records) run outside the tier lock. A gate env holds those device calls; the tests
// check that gets and puts that fit in the active segment complete meanwhile, that a put that
// needs a new segment waits for the prepared one (and gets still complete while it waits),
// and that everything reads back exactly once the gate opens. Under kSync, new segments are
// written with zeros before records are appended to them (no unwritten extents left).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/ssd_format.h"
#include "storage/ssd_tier.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::CheckValue;
using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

// Liveness bound: a call that has not returned after this long is blocked (a failure).
constexpr auto kStuck = std::chrono::seconds(20);

// Wraps an env. While the allocate gate is closed, Allocate blocks. While the read gate is
// closed, reads issued by any thread other than the one that closed it block.
class GateEnv final : public DeviceEnv {
 public:
  explicit GateEnv(DeviceEnv* base) : base_(base) {}

  void CloseAllocate() { Set(&alloc_open_, false); }
  void OpenAllocate() { Set(&alloc_open_, true); }
  void CloseReads() {
    std::lock_guard l(mu_);
    reader_ = std::this_thread::get_id();
    read_open_ = false;
  }
  void OpenReads() { Set(&read_open_, true); }
  // Reads of the calling thread pass the closed read gate too.
  void AllowReads() {
    std::lock_guard l(mu_);
    reader_ = std::this_thread::get_id();
  }
  void OpenAll() {
    OpenAllocate();
    OpenReads();
  }
  int allocs() {
    std::lock_guard l(mu_);
    return allocs_;
  }
  int blocked_reads() {
    std::lock_guard l(mu_);
    return blocked_reads_;
  }
  // Waits until `count` returns at least n (false after kStuck).
  bool WaitFor(const int* count, int n) {
    std::unique_lock l(mu_);
    return cv_.wait_for(l, kStuck, [&] { return *count >= n; });
  }
  const int* allocs_ptr() const { return &allocs_; }
  const int* blocked_allocs_ptr() const { return &blocked_allocs_; }
  const int* blocked_reads_ptr() const { return &blocked_reads_; }

  StatusOr<std::shared_ptr<BlockDevice>> Open(const std::string& name, bool create) override {
    KVTIER_ASSIGN_OR_RETURN(auto dev, base_->Open(name, create));
    return std::shared_ptr<BlockDevice>(std::make_shared<Dev>(this, std::move(dev)));
  }
  StatusOr<std::vector<std::string>> List() override { return base_->List(); }
  Status Remove(const std::string& name) override { return base_->Remove(name); }
  Status SyncDir() override { return base_->SyncDir(); }
  StatusOr<uint64_t> FreeBytes() override { return base_->FreeBytes(); }
  std::string Kind() const override { return "gate(" + base_->Kind() + ")"; }

 private:
  class Dev final : public BlockDevice {
   public:
    Dev(GateEnv* env, std::shared_ptr<BlockDevice> base) : env_(env), base_(std::move(base)) {}
    Status Read(uint64_t offset, std::span<uint8_t> buffer) override {
      env_->EnterRead();
      return base_->Read(offset, buffer);
    }
    Status Submit(std::span<IoRequest> batch) override {
      bool reads = false;
      for (const IoRequest& r : batch) reads |= r.op == IoRequest::Op::kRead;
      if (reads) env_->EnterRead();
      return base_->Submit(batch);
    }
    Status Sync(bool data_only) override { return base_->Sync(data_only); }
    Status Allocate(uint64_t offset, uint64_t length) override {
      env_->EnterAllocate();
      return base_->Allocate(offset, length);
    }
    uint64_t Size() const override { return base_->Size(); }
    size_t Alignment() const override { return base_->Alignment(); }
    std::string Kind() const override { return "gate"; }

   private:
    GateEnv* env_;
    std::shared_ptr<BlockDevice> base_;
  };
  void Set(bool* flag, bool v) {
    {
      std::lock_guard l(mu_);
      *flag = v;
    }
    cv_.notify_all();
  }
  void EnterAllocate() {
    std::unique_lock l(mu_);
    ++blocked_allocs_;
    cv_.notify_all();
    cv_.wait(l, [&] { return alloc_open_; });
    --blocked_allocs_;
    ++allocs_;
    cv_.notify_all();
  }
  void EnterRead() {
    std::unique_lock l(mu_);
    if (read_open_ || std::this_thread::get_id() == reader_) return;
    ++blocked_reads_;
    cv_.notify_all();
    cv_.wait(l, [&] { return read_open_; });
    --blocked_reads_;
  }

  DeviceEnv* base_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool alloc_open_ = true, read_open_ = true;
  std::thread::id reader_;
  int allocs_ = 0, blocked_allocs_ = 0, blocked_reads_ = 0;
};

constexpr size_t kUnitBytes = 10'000;

SsdOptions Options(const std::string& dir, DeviceEnv* env, uint64_t capacity_bytes) {
  SsdOptions o;
  o.dir = dir;
  o.env = env;
  o.segment_bytes = 1ull << 20;  // ~100 units per segment
  o.capacity_bytes = capacity_bytes;
  o.write_buffer_bytes = 64 << 10;
  o.durability = Durability::kBatched;
  o.group_commit_ms = 3'600'000;
  o.compression = false;
  o.background_io_bytes_per_s = 0;
  return o;
}

// Puts a unit; the value encodes (key, version).
Status PutUnit(SsdTier& ssd, int i, uint64_t version) {
  SsdMeta m;
  m.version = version;
  std::vector<Key> evicted;
  return ssd.Put(MakeKey(i), MakeValue(MakeKey(i), version, kUnitBytes), m, &evicted);
}

// A file's extents (FIEMAP): bytes mapped, and bytes in unwritten (fallocated, never written)
// extents. nullopt when the file system does not answer FIEMAP.
struct Extents {
  uint64_t mapped_bytes = 0, unwritten_bytes = 0;
};
std::optional<Extents> FileExtents(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return std::nullopt;
  constexpr uint32_t kMaxExtents = 512;
  std::vector<uint8_t> buf(sizeof(fiemap) + kMaxExtents * sizeof(fiemap_extent));
  auto* fm = reinterpret_cast<fiemap*>(buf.data());
  fm->fm_start = 0;
  fm->fm_length = FIEMAP_MAX_OFFSET;
  fm->fm_flags = FIEMAP_FLAG_SYNC;
  fm->fm_extent_count = kMaxExtents;
  int rc = ::ioctl(fd, FS_IOC_FIEMAP, fm);
  ::close(fd);
  if (rc != 0 || fm->fm_mapped_extents >= kMaxExtents) return std::nullopt;
  Extents e;
  for (uint32_t i = 0; i < fm->fm_mapped_extents; ++i) {
    const fiemap_extent& x = fm->fm_extents[i];
    e.mapped_bytes += x.fe_length;
    if (x.fe_flags & FIEMAP_EXTENT_UNWRITTEN) e.unwritten_bytes += x.fe_length;
  }
  return e;
}

// Under kSync every segment is written with zeros before records land in it (the segment Open
// starts and the ones the segment thread prepares, whose quarters wait for the active segment
// to fill), so a commit's fdatasync finds no extent to convert; the records read back exactly, also
// after a reopen (the tail scan stops at the zeros). With zero_fill_segments = false the segments
// stay fallocated (unwritten extents): the control that shows the file system reports them, else
// the test is skipped.
TEST(SsdSegmentThreadTest, SyncSegmentsAreZeroFilledBeforeRecordsAreAppended) {
  // Extents of segments 1 and 2 after ~150 units (a roll into segment 2).
  auto run = [](bool zero_fill, Extents* seg1, Extents* seg2) {
    TempDir dir;
    SsdOptions o = Options(dir.path(), nullptr, 16ull << 20);
    o.dir_env.engine = IoEngine::kIoUring;
    o.durability = Durability::kSync;
    o.zero_fill_segments = zero_fill;
    constexpr int kUnits = 150;
    std::string segs = dir.path() + "/segments/";
    {
      auto opened = SsdTier::Open(o);
      ASSERT_TRUE(opened.ok()) << opened.status().ToString();
      if (zero_fill) {
        // Nothing appended yet: the segment thread zero-fills only the next segment's first
        // quarter, the rest waits for the active segment to fill.
        auto deadline = std::chrono::steady_clock::now() + kStuck;
        while (!std::filesystem::exists(segs + ssd::SegmentName(2)) &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        auto early = FileExtents(segs + ssd::SegmentName(2));
        ASSERT_TRUE(early.has_value());
        EXPECT_GE(early->unwritten_bytes, o.segment_bytes / 2);
      }
      for (int i = 0; i < kUnits; ++i) ASSERT_TRUE(PutUnit(**opened, i, 1).ok()) << i;
      ASSERT_EQ((*opened)->GetStats().segments, 2u);
      auto e1 = FileExtents(segs + ssd::SegmentName(1));
      auto e2 = FileExtents(segs + ssd::SegmentName(2));
      if (!e1 || !e2) GTEST_SKIP() << "no FIEMAP here";
      *seg1 = *e1;
      *seg2 = *e2;
    }
    auto reopened = SsdTier::Open(o);
    ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
    std::vector<uint8_t> out;
    for (int i = 0; i < kUnits; ++i) {
      ASSERT_TRUE((*reopened)->Get(MakeKey(i), &out).ok()) << i;
      ASSERT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
    }
  };
  Extents off1, off2;
  run(false, &off1, &off2);
  if (HasFatalFailure() || IsSkipped()) return;
  if (off2.unwritten_bytes == 0) GTEST_SKIP() << "the file system reports no unwritten extents";
  Extents on1, on2;
  run(true, &on1, &on2);
  if (HasFatalFailure() || IsSkipped()) return;
  for (const Extents& e : {on1, on2}) {
    EXPECT_EQ(e.unwritten_bytes, 0u);
    EXPECT_GE(e.mapped_bytes, 1ull << 20);  // the whole segment
  }
}

TEST(SsdSegmentThreadTest, PreparesTheNextSegmentOutsideTheLockAndPutsWaitOnlyWhenNoneIsReady) {
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  // Room for every unit: nothing is evicted.
  auto opened = SsdTier::Open(Options(dir.path(), &gate, 16ull << 20));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  constexpr int kFirst = 150;
  std::atomic<int> done{kFirst};
  std::future<Status> puts, more;  // destroyed (joined) after the gate opens
  struct OpenAtExit {              // a failed assertion must not leave threads blocked at the gate
    GateEnv& g;
    ~OpenAtExit() { g.OpenAll(); }
  } open_at_exit{gate};
  // The active segment (Open) and the prepared next one (the segment thread).
  ASSERT_TRUE(gate.WaitFor(gate.allocs_ptr(), 2));
  gate.CloseAllocate();

  // ~150 units: the roll into the prepared segment needs no fallocate; the segment thread
  // then blocks preparing the one after it, holding no lock that requests need.
  puts = std::async(std::launch::async, [&] {
    for (int i = 0; i < kFirst; ++i) {
      Status st = PutUnit(ssd, i, 1);
      if (!st.ok()) return st;
    }
    return Status::Ok();
  });
  ASSERT_EQ(puts.wait_for(kStuck), std::future_status::ready) << "a roll waited for fallocate";
  ASSERT_TRUE(puts.get().ok());
  ASSERT_TRUE(gate.WaitFor(gate.blocked_allocs_ptr(), 1));
  std::vector<uint8_t> out;
  for (int i = 0; i < kFirst; ++i) {
    ASSERT_TRUE(ssd.Get(MakeKey(i), &out).ok()) << i;
    ASSERT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
  }

  // Fill the second segment: a put that needs a third one waits for the prepared segment
  // (the tier is genuinely out of room), and gets are served while it waits.
  more = std::async(std::launch::async, [&] {
    for (int i = kFirst; i < 2 * kFirst + 50; ++i) {
      Status st = PutUnit(ssd, i, 1);
      if (!st.ok()) return st;
      done = i + 1;
    }
    return Status::Ok();
  });
  // It cannot finish while the gate is closed: the segment holds ~100 units.
  EXPECT_EQ(more.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  int stalled_at = done.load();
  EXPECT_LT(stalled_at, 2 * kFirst + 50);
  for (int i = 0; i < stalled_at; ++i) {
    ASSERT_TRUE(ssd.Get(MakeKey(i), &out).ok()) << i;
    ASSERT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
  }
  gate.OpenAllocate();
  ASSERT_EQ(more.wait_for(kStuck), std::future_status::ready);
  ASSERT_TRUE(more.get().ok());
  for (int i = 0; i < 2 * kFirst + 50; ++i) {
    ASSERT_TRUE(ssd.Get(MakeKey(i), &out).ok()) << i;
    ASSERT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
  }
  EXPECT_EQ(ssd.GetStats().checksum_failures, 0u);
}

TEST(SsdSegmentThreadTest, CleaningReadsOutsideTheLockWhileGetsAndPutsContinue) {
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  // At most 3 segments (+ the prepared one): the count goes over its limit quickly.
  auto opened = SsdTier::Open(Options(dir.path(), &gate, 4ull << 20));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  constexpr int kKeys = 40;
  std::vector<std::atomic<uint64_t>> latest(kKeys);
  std::future<Status> writer;  // destroyed (joined) after the gate opens
  std::future<bool> gets;
  struct OpenAtExit {
    GateEnv& g;
    ~OpenAtExit() { g.OpenAll(); }
  } open_at_exit{gate};
  // Cold units, never overwritten: the segment they sit in must be read to be cleaned.
  constexpr int kCold = 20, kColdBase = 1000;
  for (int i = kColdBase; i < kColdBase + kCold; ++i) ASSERT_TRUE(PutUnit(ssd, i, 1).ok());
  // Reads of every thread but this one (the cleaner's, here) block at the gate.
  gate.CloseReads();

  // 40 keys overwritten again and again: sealed segments become sparse, the segment count
  // goes over its limit, and the segment thread cleans, blocked at its first read.
  writer = std::async(std::launch::async, [&] {
    uint64_t version = 0;
    for (int n = 0; n < 5000 && gate.blocked_reads() == 0; ++n) {
      int i = n % kKeys;
      Status st = PutUnit(ssd, i, ++version);
      if (!st.ok()) return st;
      latest[i] = version;
    }
    return Status::Ok();
  });
  ASSERT_TRUE(gate.WaitFor(gate.blocked_reads_ptr(), 1)) << "the cleaner never read";
  // Gets are served (from a thread whose reads pass the gate) while the cleaner is blocked
  // in a device read: it holds no lock that requests need.
  gets = std::async(std::launch::async, [&] {
    gate.AllowReads();
    std::vector<uint8_t> value;
    for (int i = 0; i < kKeys; ++i) {
      if (!ssd.Get(MakeKey(i), &value).ok()) return false;
      uint64_t v = 0;
      if (!CheckValue(MakeKey(i), value, &v)) return false;
    }
    return true;
  });
  ASSERT_EQ(gets.wait_for(kStuck), std::future_status::ready) << "a get waited for cleaning";
  EXPECT_TRUE(gets.get());
  EXPECT_EQ(gate.blocked_reads(), 1);  // the cleaner is still blocked: the gets did not wait
  std::vector<uint8_t> out;
  // (Segments whose records were all overwritten are deleted without a read: some may be.)
  uint64_t cleaned = ssd.GetStats().segments_cleaned;
  gate.OpenReads();
  ASSERT_EQ(writer.wait_for(kStuck), std::future_status::ready);
  ASSERT_TRUE(writer.get().ok());
  // The clean completes; every unit still reads back exactly.
  for (int tries = 0; tries < 2000 && ssd.GetStats().segments_cleaned == cleaned; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(ssd.GetStats().segments_cleaned, cleaned);
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_TRUE(ssd.Get(MakeKey(i), &out).ok()) << i;
    uint64_t v = 0;
    ASSERT_TRUE(CheckValue(MakeKey(i), out, &v)) << i;
    EXPECT_EQ(v, latest[i].load()) << i;
  }
  EXPECT_EQ(ssd.GetStats().evictions, 0u);  // nothing was dropped to make room
  for (int i = kColdBase; i < kColdBase + kCold; ++i) {
    Status st = ssd.Get(MakeKey(i), &out);
    ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
    ASSERT_EQ(out, MakeValue(MakeKey(i), 1, kUnitBytes)) << i;
  }
  EXPECT_EQ(ssd.GetStats().checksum_failures, 0u);
}

}  // namespace
}  // namespace kvtier::storage
