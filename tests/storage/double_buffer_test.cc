// SSD tier double buffering: a gate env holds buffer writes in flight (the writer thread blocks
// inside Submit) so the tests can check, deterministically, that Get serves units from buffers
// in flight bit exact, that an async write error drops exactly the units of its buffer and is
// reported by the commit covering it, that Close drains buffers in flight, and that a crash
// with buffers in flight leaves every unit absent or exactly right.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_format.h"
#include "storage/ssd_tier.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

// Wraps an env; while closed, a Submit containing a write blocks until the gate opens.
class GateEnv final : public DeviceEnv {
 public:
  explicit GateEnv(DeviceEnv* base) : base_(base) {}

  void Close() {
    std::lock_guard l(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard l(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // Waits until at least n writes are blocked at the gate (false after 10 s).
  bool WaitBlocked(int n) {
    std::unique_lock l(mu_);
    return cv_.wait_for(l, std::chrono::seconds(10), [&] { return blocked_ >= n; });
  }
  // Waits until at least n write batches went through (completed, ok or not).
  bool WaitPassed(int n) {
    std::unique_lock l(mu_);
    return cv_.wait_for(l, std::chrono::seconds(10), [&] { return passed_ >= n; });
  }
  int passed() {
    std::lock_guard l(mu_);
    return passed_;
  }
  // Write batches submitted from the thread `id` so far.
  int WritesFrom(std::thread::id id) {
    std::lock_guard l(mu_);
    int n = 0;
    for (std::thread::id w : writers_) n += w == id;
    return n;
  }

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
    Status Submit(std::span<IoRequest> batch) override {
      bool writes = false;
      for (const IoRequest& r : batch) writes |= r.op == IoRequest::Op::kWrite;
      if (writes) env_->Enter();
      Status st = base_->Submit(batch);
      if (writes) env_->Leave();
      return st;
    }
    Status Sync(bool data_only) override { return base_->Sync(data_only); }
    Status Allocate(uint64_t offset, uint64_t length) override {
      return base_->Allocate(offset, length);
    }
    uint64_t Size() const override { return base_->Size(); }
    size_t Alignment() const override { return base_->Alignment(); }
    std::string Kind() const override { return "gate"; }

   private:
    GateEnv* env_;
    std::shared_ptr<BlockDevice> base_;
  };
  void Enter() {
    std::unique_lock l(mu_);
    writers_.push_back(std::this_thread::get_id());
    ++blocked_;
    cv_.notify_all();
    cv_.wait(l, [&] { return open_; });
    --blocked_;
  }
  void Leave() {
    std::lock_guard l(mu_);
    ++passed_;
    cv_.notify_all();
  }

  DeviceEnv* base_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int blocked_ = 0, passed_ = 0;
  std::vector<std::thread::id> writers_;  // the thread of every write batch, in order
};

constexpr size_t kUnitBytes = 5000;  // 64 KiB buffers hold 12 records (5,128 B each)

SsdOptions Options(const std::string& dir, DeviceEnv* env, Durability d) {
  SsdOptions o;
  o.dir = dir;
  o.env = env;
  o.capacity_bytes = 16ull << 20;
  o.segment_bytes = 4ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.write_buffers = 2;
  o.durability = d;
  o.group_commit_ms = 3'600'000;  // commits only when the test asks
  o.compression = false;
  return o;
}

std::unique_ptr<SsdTier> OpenTier(const SsdOptions& o) {
  auto t = SsdTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

Status PutUnit(SsdTier* t, int i, uint64_t version = 1) {
  Key k = MakeKey(i);
  SsdMeta meta;
  meta.version = version;
  return t->Put(k, MakeValue(k, version, kUnitBytes), meta, nullptr);
}

// Exactly the unit's bytes, or NotFound; anything else fails the test.
bool ExactOrAbsent(SsdTier* t, int i, bool* present, uint64_t version = 1) {
  Key k = MakeKey(i);
  std::vector<uint8_t> out;
  Status st = t->Get(k, &out);
  *present = st.ok();
  if (st.IsNotFound()) return true;
  return st.ok() && out == MakeValue(k, version, kUnitBytes);
}

TEST(SsdDoubleBufferTest, GetServesUnitsFromBuffersInFlightBitExact) {
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  auto t = OpenTier(Options(dir.path(), &gate, Durability::kBatched));
  ASSERT_NE(t, nullptr);
  gate.Close();
  // 20 units: the first buffer (12 units) is handed to the writer and held at the gate; the
  // rest fill the second buffer.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  ASSERT_TRUE(gate.WaitBlocked(1));
  EXPECT_EQ(gate.passed(), 0);  // nothing has reached the device yet
  std::vector<uint8_t> out;
  for (int i = 0; i < 20; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE(t->Get(k, &out).ok()) << i;
    EXPECT_EQ(out, MakeValue(k, 1, kUnitBytes)) << i;
  }
  gate.Open();
  ASSERT_TRUE(t->Flush().ok());
  EXPECT_GE(gate.passed(), 2);
  for (int i = 0; i < 20; ++i) {
    Key k = MakeKey(i);
    ASSERT_TRUE(t->Get(k, &out).ok()) << i;
    EXPECT_EQ(out, MakeValue(k, 1, kUnitBytes)) << i;
  }
  EXPECT_EQ(t->GetStats().io_errors, 0u);
}

TEST(SsdDoubleBufferTest, PutsWaitForAFreeBufferAndLoseNothing) {
  // One buffer: the put that needs the next buffer waits until the writer releases it.
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  SsdOptions o = Options(dir.path(), &gate, Durability::kBatched);
  o.write_buffers = 1;
  auto t = OpenTier(o);
  ASSERT_NE(t, nullptr);
  gate.Close();
  for (int i = 0; i < 12; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  std::thread putter([&] {
    EXPECT_TRUE(PutUnit(t.get(), 12).ok());  // hands buffer 1 over, then waits for it
  });
  ASSERT_TRUE(gate.WaitBlocked(1));
  gate.Open();
  putter.join();
  ASSERT_TRUE(t->Flush().ok());
  t.reset();
  auto r = OpenTier(Options(dir.path(), mem.get(), Durability::kBatched));
  ASSERT_NE(r, nullptr);
  for (int i = 0; i <= 12; ++i) {
    bool present = false;
    ASSERT_TRUE(ExactOrAbsent(r.get(), i, &present)) << i;
    EXPECT_TRUE(present) << i;
  }
}

TEST(SsdDoubleBufferTest, AsyncWriteErrorDropsItsBufferAndFailsTheFlush) {
  TempDir dir;
  auto mem = NewMemEnv();
  FaultInjectionEnv fault(mem.get(), {});
  GateEnv gate(&fault);
  {
    auto t = OpenTier(Options(dir.path(), &gate, Durability::kBatched));
    ASSERT_NE(t, nullptr);
    // Committed before the fault: must survive everything below.
    for (int i = 0; i < 30; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
    ASSERT_TRUE(t->Flush().ok());
    int passed = gate.passed();
    gate.Close();
    // Units 100..111 fill a buffer, 112 hands it to the writer (held at the gate).
    for (int i = 100; i < 113; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
    ASSERT_TRUE(gate.WaitBlocked(1));
    fault.SetNoSpace(true);
    gate.Open();
    ASSERT_TRUE(gate.WaitPassed(passed + 1));  // the held write failed with ENOSPC
    fault.SetNoSpace(false);
    for (int i = 113; i < 120; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
    Status st = t->Flush();
    EXPECT_TRUE(st.IsIOError()) << st.ToString();
    EXPECT_NE(st.message().find("ENOSPC"), std::string::npos) << st.ToString();
    EXPECT_GE(t->GetStats().io_errors, 1u);
    std::vector<uint8_t> out;
    for (int i = 100; i < 112; ++i) {
      EXPECT_TRUE(t->Get(MakeKey(i), &out).IsNotFound()) << "unit of the failed buffer " << i;
    }
    for (int i = 0; i < 30; ++i) {
      bool present = false;
      ASSERT_TRUE(ExactOrAbsent(t.get(), i, &present)) << i;
      EXPECT_TRUE(present) << "committed unit lost " << i;
    }
    for (int i = 112; i < 120; ++i) {
      bool present = false;
      ASSERT_TRUE(ExactOrAbsent(t.get(), i, &present)) << i;
      EXPECT_TRUE(present) << "unit of a later buffer lost " << i;
    }
    EXPECT_TRUE(t->Flush().ok());  // the error is reported once, by the commit covering it
  }
  // After a reopen: the same picture (nothing of the failed buffer indexed).
  auto r = OpenTier(Options(dir.path(), mem.get(), Durability::kBatched));
  ASSERT_NE(r, nullptr);
  std::vector<uint8_t> out;
  for (int i = 100; i < 112; ++i) EXPECT_TRUE(r->Get(MakeKey(i), &out).IsNotFound()) << i;
  for (int i : {0, 29, 112, 119}) {
    bool present = false;
    ASSERT_TRUE(ExactOrAbsent(r.get(), i, &present)) << i;
    EXPECT_TRUE(present) << i;
  }
  EXPECT_EQ(r->GetStats().checksum_failures, 0u);
}

TEST(SsdDoubleBufferTest, SyncPutFailsWhenItsAsyncWriteFails) {
  TempDir dir;
  auto mem = NewMemEnv();
  FaultInjectionEnv fault(mem.get(), {});
  GateEnv gate(&fault);
  auto t = OpenTier(Options(dir.path(), &gate, Durability::kSync));
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  fault.FailNextWrites(1);
  Status st = PutUnit(t.get(), 50);
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  std::vector<uint8_t> out;
  EXPECT_TRUE(t->Get(MakeKey(50), &out).IsNotFound());
  ASSERT_TRUE(PutUnit(t.get(), 51).ok());
  t.reset();
  auto r = OpenTier(Options(dir.path(), mem.get(), Durability::kSync));
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE(r->Get(MakeKey(50), &out).IsNotFound());
  for (int i : {0, 1, 2, 3, 4, 51}) {
    bool present = false;
    ASSERT_TRUE(ExactOrAbsent(r.get(), i, &present)) << i;
    EXPECT_TRUE(present) << i;
  }
}

// A sync put's commit writes the buffer it closes itself, on the putting thread: no hand-off
// to the writer thread and back on the commit's critical path. The writer thread still writes
// the buffers that fill up between commits.
TEST(SsdDoubleBufferTest, ACommitWritesItsOwnBufferOnTheCommittingThread) {
  TempDir dir;
  auto mem = NewMemEnv();
  // Both envs outlive both tiers (declared before t): a tier's segment thread uses its env
  // until the tier is destroyed.
  GateEnv gate(mem.get());
  GateEnv gate2(mem.get());
  auto t = OpenTier(Options(dir.path(), &gate, Durability::kSync));
  ASSERT_NE(t, nullptr);
  int before = gate.passed();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  EXPECT_EQ(gate.passed() - before, 5);  // one buffer write per commit
  EXPECT_EQ(gate.WritesFrom(std::this_thread::get_id()), 5);
  // Batched: buffers that fill up go to the writer thread. Flush writes the last one itself
  // when the writer is idle; a writer stream still running (its first buffer just completed)
  // takes it instead, which this test cannot rule out under load (seen once in 300 runs with
  // both cores busy): either way it is written exactly once.
  t.reset();
  t = OpenTier(Options(dir.path(), &gate2, Durability::kBatched));
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(PutUnit(t.get(), 100 + i).ok()) << i;
  ASSERT_TRUE(gate2.WaitPassed(1));
  EXPECT_EQ(gate2.WritesFrom(std::this_thread::get_id()), 0);  // the full buffer: the writer's
  ASSERT_TRUE(t->Flush().ok());
  EXPECT_EQ(gate2.passed(), 2);  // 12 records filled the first buffer, 8 wait in the second
  EXPECT_LE(gate2.WritesFrom(std::this_thread::get_id()), 1);
  bool present = false;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(ExactOrAbsent(t.get(), 100 + i, &present)) << i;
    EXPECT_TRUE(present) << i;
  }
}

TEST(SsdDoubleBufferTest, CloseDrainsBuffersInFlight) {
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  auto t = OpenTier(Options(dir.path(), &gate, Durability::kBatched));
  ASSERT_NE(t, nullptr);
  gate.Close();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  ASSERT_TRUE(gate.WaitBlocked(1));
  std::thread closer([&] { t.reset(); });  // blocks until the held write completes
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  gate.Open();
  closer.join();
  auto r = OpenTier(Options(dir.path(), mem.get(), Durability::kBatched));
  ASSERT_NE(r, nullptr);
  for (int i = 0; i < 20; ++i) {
    bool present = false;
    ASSERT_TRUE(ExactOrAbsent(r.get(), i, &present)) << i;
    EXPECT_TRUE(present) << "close lost unit " << i;
  }
}

TEST(SsdDoubleBufferTest, CrashWithBuffersInFlightLeavesUnitsAbsentOrExact) {
  // kNone is left out: it promises nothing after a crash (entries may point at lost data).
  for (Durability d : {Durability::kBatched, Durability::kSync}) {
    SCOPED_TRACE(static_cast<int>(d));
    TempDir dir;
    auto mem = NewMemEnv();
    {
      FaultOptions fo;
      fo.seed = 7;
      FaultInjectionEnv fault(mem.get(), fo);
      GateEnv gate(&fault);
      auto t = OpenTier(Options(dir.path(), &gate, d));
      ASSERT_NE(t, nullptr);
      for (int i = 0; i < 30; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
      ASSERT_TRUE(t->Flush().ok());
      if (d != Durability::kSync) {
        gate.Close();
        // Newer versions of committed units plus new units: one buffer held, one filling.
        for (int i = 20; i < 40; ++i) ASSERT_TRUE(PutUnit(t.get(), i, 2).ok()) << i;
        ASSERT_TRUE(gate.WaitBlocked(1));
        fault.SimulateCrash();
        gate.Open();
      } else {
        // A sync put blocks in its own commit: crash while its write is held.
        gate.Close();
        std::thread putter([&] { (void)PutUnit(t.get(), 35, 2); });
        ASSERT_TRUE(gate.WaitBlocked(1));
        fault.SimulateCrash();
        gate.Open();
        putter.join();
      }
      t.reset();  // the held write and the close's commit fail: the env has crashed
    }
    auto r = OpenTier(Options(dir.path(), mem.get(), d));
    ASSERT_NE(r, nullptr);
    std::vector<uint8_t> out;
    for (int i = 0; i < 40; ++i) {
      Key k = MakeKey(i);
      Status st = r->Get(k, &out);
      if (st.IsNotFound()) {
        EXPECT_GE(i, 30) << "committed unit lost " << i;
        continue;
      }
      ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
      bool v1 = out == MakeValue(k, 1, kUnitBytes), v2 = out == MakeValue(k, 2, kUnitBytes);
      EXPECT_TRUE((v1 && i < 30) || v2) << "wrong bytes for unit " << i;
    }
    EXPECT_EQ(r->GetStats().checksum_failures, 0u);
  }
}

TEST(SsdDoubleBufferTest, ManyBuffersRoundTripAcrossSegmentRolls) {
  TempDir dir;
  auto mem = NewMemEnv();
  SsdOptions o = Options(dir.path(), mem.get(), Durability::kBatched);
  o.write_buffers = SsdOptions::kMaxWriteBuffers + 5;  // clamped to the limit
  o.segment_bytes = 1ull << 20;
  o.capacity_bytes = 64ull << 20;
  auto t = OpenTier(o);
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;  // ~5 segments
  std::vector<uint8_t> out;
  for (int i = 0; i < 1000; i += 7) {
    Key k = MakeKey(i);
    ASSERT_TRUE(t->Get(k, &out).ok()) << i;
    EXPECT_EQ(out, MakeValue(k, 1, kUnitBytes)) << i;
  }
  ASSERT_TRUE(t->Flush().ok());
  t.reset();
  auto r = OpenTier(o);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->WaitForIndexLoad().ok());
  EXPECT_EQ(r->GetStats().objects, 1000u);
  for (int i = 0; i < 1000; i += 3) {
    bool present = false;
    ASSERT_TRUE(ExactOrAbsent(r.get(), i, &present)) << i;
    EXPECT_TRUE(present) << i;
  }
}

// The cleaner may pick a sealed segment whose last buffers are still in flight: it must take
// those records from the buffers, not read them from the device (where they are not yet, so
// they would read as zeros, fail verification and be dropped: live units lost as "corrupt").
// Found by LiveVsSim.SsdTierSameHookSequence (a `remove` the simulator never made).
TEST(SsdDoubleBufferTest, CleanerRelocatesRecordsOfBuffersInFlight) {
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  SsdOptions o = Options(dir.path(), &gate, Durability::kBatched);
  o.segment_bytes = 1 << 20;
  o.write_buffer_bytes = 256 << 10;  // 4 buffers per segment, of kPer records each
  o.write_buffers = 8;
  o.capacity_bytes = 8ull << 20;
  o.background_io_bytes_per_s = 0;
  constexpr int kPer = (256 << 10) / (ssd::kRecordHeaderBytes + kUnitBytes);  // 51
  auto t = OpenTier(o);
  ASSERT_NE(t, nullptr);
  struct OpenAtExit {
    GateEnv& g;
    ~OpenAtExit() { g.Open(); }
  } open_at_exit{gate};
  // Segment A: its first 3 buffers written and reaped.
  for (int i = 0; i < 3 * kPer; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  ASSERT_TRUE(t->Flush().ok());
  gate.Close();
  // Buffer 4 fills; the next put rolls into segment B and hands buffer 4 to the writer, held
  // at the gate: A is sealed with its last buffer in flight.
  for (int i = 3 * kPer; i <= 4 * kPer; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  ASSERT_TRUE(gate.WaitBlocked(1));
  // A keeps its last 8 records (in buffer 4): under clean_live_ratio, so the next roll
  // cleans it.
  const int kept = 4 * kPer - 8;
  for (int i = 0; i < kept; ++i) ASSERT_TRUE(t->Remove(MakeKey(i), nullptr).ok()) << i;
  const int total = 8 * kPer + 1;  // fills B and rolls into C
  for (int i = 4 * kPer + 1; i < total; ++i) ASSERT_TRUE(PutUnit(t.get(), i).ok()) << i;
  // The cleaner relocates the 8 records (or, reading them from the device, drops them).
  const uint64_t record_bytes = ssd::kRecordHeaderBytes + kUnitBytes;
  SsdStats s;
  for (int tries = 0; tries < 1000; ++tries) {
    s = t->GetStats();
    if (s.relocated_bytes >= 8 * record_bytes || s.checksum_failures + s.io_errors > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.checksum_failures, 0u);
  EXPECT_EQ(s.io_errors, 0u);
  // At least the 8 kept records; more when the segment thread cleaned A while the removals
  // above were still under way (A was already sparse, its tail just as much in flight).
  EXPECT_GE(s.relocated_bytes, 8 * record_bytes);
  EXPECT_TRUE(gate.WaitBlocked(1));  // buffer 4 is still held: A's tail is not on the device
  gate.Open();
  ASSERT_TRUE(t->Flush().ok());
  for (int tries = 0; tries < 1000 && t->GetStats().segments_cleaned == 0; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(t->GetStats().segments_cleaned, 1u);
  std::vector<uint8_t> out;
  for (int i = 0; i < total; ++i) {
    Key k = MakeKey(i);
    Status st = t->Get(k, &out);
    if (i < kept) {
      EXPECT_TRUE(st.IsNotFound()) << i << ": " << st.ToString();
    } else {
      ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
      EXPECT_EQ(out, MakeValue(k, 1, kUnitBytes)) << i;
    }
  }
}

// With the default number of write buffers, puts go on filling a third buffer while two are
// in flight (here: held at the gate): a group commit that closes a partly filled buffer, or a
// putting thread that missed a CPU for a while, does not leave the device queue waiting for a
// free buffer (docs/performance/storage.md, "Unit writes with four write buffers"). With 2 buffers
// the put of unit 24 blocks until the gate opens.
TEST(SsdDoubleBufferTest, DefaultBuffersLetPutsFillAThirdBufferWhileTwoAreInFlight) {
  TempDir dir;
  auto mem = NewMemEnv();
  GateEnv gate(mem.get());
  SsdOptions o = Options(dir.path(), &gate, Durability::kBatched);
  o.write_buffers = SsdOptions{}.write_buffers;
  auto t = OpenTier(o);
  ASSERT_NE(t, nullptr);
  gate.Close();
  // 30 units: buffers of 12; the first is held at the gate, the second queued behind it, the
  // rest fill a third.
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::thread putter([&] {
    for (int i = 0; i < 30; ++i) EXPECT_TRUE(PutUnit(t.get(), i).ok()) << i;
    std::lock_guard l(mu);
    finished = true;
    cv.notify_all();
  });
  bool done = false;
  {
    std::unique_lock l(mu);
    done = cv.wait_for(l, std::chrono::seconds(10), [&] { return finished; });
  }
  EXPECT_TRUE(done) << "a put waited for a free buffer while two were in flight";
  EXPECT_TRUE(gate.WaitBlocked(1));
  EXPECT_EQ(gate.passed(), 0);  // nothing has reached the device while the puts ran
  gate.Open();
  putter.join();
  ASSERT_TRUE(t->Flush().ok());
  bool present = false;
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(ExactOrAbsent(t.get(), i, &present)) << i;
    EXPECT_TRUE(present) << i;
  }
}

}  // namespace
}  // namespace kvtier::storage
