// SsdTier::GetBatch and TierManager::GetBatch: every key of a batch gets what Get would give
// it (units on the device, in the write buffer, missing, corrupted on the device), on the
// memory env and on io_uring files, and under injected ring faults (RingFaults).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <set>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_tier.h"
#include "storage/tier_manager.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

void CheckBatchMatchesGet(DeviceEnv* env, const std::string& dir) {
  SsdOptions o;
  o.dir = dir;
  o.env = env;
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 4ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.group_commit_ms = 3'600'000;
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  constexpr int kUnits = 300;  // across two segments; the last ones still in the buffer
  for (int i = 0; i < kUnits; ++i) {
    SsdMeta m;
    m.version = i + 1;
    ASSERT_TRUE(ssd.Put(MakeKey(i), MakeValue(MakeKey(i), i + 1, 20'000 + i), m, nullptr).ok());
    if (i == kUnits - 10) {
      ASSERT_TRUE(ssd.Flush().ok());
    }
  }
  std::vector<Key> keys;
  for (int i = 0; i < kUnits; i += 3) keys.push_back(MakeKey(i));
  keys.push_back(MakeKey(kUnits + 1));  // never stored
  keys.push_back(MakeKey(kUnits - 1));  // in the write buffer
  keys.push_back(MakeKey(0));           // a duplicate
  std::vector<std::vector<uint8_t>> outs;
  std::vector<SsdMeta> metas;
  std::vector<Status> results;
  ssd.GetBatch(keys, &outs, &metas, &results);
  ASSERT_EQ(results.size(), keys.size());
  for (size_t j = 0; j < keys.size(); ++j) {
    std::vector<uint8_t> one;
    SsdMeta meta;
    Status st = ssd.Get(keys[j], &one, &meta);
    ASSERT_EQ(results[j].code(), st.code()) << j << " " << results[j].ToString();
    if (!st.ok()) continue;
    EXPECT_EQ(outs[j], one) << j;
    EXPECT_EQ(metas[j].version, meta.version) << j;
  }
  EXPECT_TRUE(results[keys.size() - 3].IsNotFound());
}

TEST(SsdGetBatchTest, MatchesGetOnTheMemoryEnv) {
  TempDir dir;
  auto env = NewMemEnv();
  CheckBatchMatchesGet(env.get(), dir.path());
}

TEST(SsdGetBatchTest, MatchesGetOnIoUringFiles) {
  TempDir dir;
  DirEnvOptions d;
  d.engine = IoEngine::kIoUring;
  auto env = NewDirEnv(dir.path() + "/segments", d);
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  CheckBatchMatchesGet(env->get(), dir.path());
}

// Counts how a batch reaches the devices: SubmitAcross calls (and the distinct devices the
// largest one named) and per-device Submit calls that read.
class CountingEnv final : public DeviceEnv {
 public:
  explicit CountingEnv(DeviceEnv* base) : base_(base) {}
  StatusOr<std::shared_ptr<BlockDevice>> Open(const std::string& name, bool create) override {
    KVTIER_ASSIGN_OR_RETURN(auto dev, base_->Open(name, create));
    return std::shared_ptr<BlockDevice>(std::make_shared<Dev>(this, std::move(dev)));
  }
  StatusOr<std::vector<std::string>> List() override { return base_->List(); }
  Status Remove(const std::string& name) override { return base_->Remove(name); }
  Status SyncDir() override { return base_->SyncDir(); }
  std::string Kind() const override { return "counting"; }
  Status SubmitAcross(std::span<DeviceIo> batch, const IoDoneFn& on_done) override {
    std::set<BlockDevice*> devices;
    for (const DeviceIo& d : batch) devices.insert(d.device);
    across_calls.fetch_add(1);
    size_t prev = max_devices.load();
    while (devices.size() > prev && !max_devices.compare_exchange_weak(prev, devices.size())) {
    }
    return DeviceEnv::SubmitAcross(batch, on_done);  // per device: reaches Dev::Submit below
  }
  std::atomic<int> across_calls{0}, read_submits{0};
  std::atomic<size_t> max_devices{0};

 private:
  class Dev final : public BlockDevice {
   public:
    Dev(CountingEnv* env, std::shared_ptr<BlockDevice> base) : env_(env), base_(std::move(base)) {}
    Status Submit(std::span<IoRequest> batch) override {
      for (const IoRequest& r : batch) {
        if (r.op == IoRequest::Op::kRead) {
          env_->read_submits.fetch_add(1);
          break;
        }
      }
      return base_->Submit(batch);
    }
    Status Sync(bool data_only) override { return base_->Sync(data_only); }
    Status Allocate(uint64_t offset, uint64_t length) override {
      return base_->Allocate(offset, length);
    }
    uint64_t Size() const override { return base_->Size(); }
    size_t Alignment() const override { return base_->Alignment(); }
    std::string Kind() const override { return "counting"; }

   private:
    CountingEnv* env_;
    std::shared_ptr<BlockDevice> base_;
  };
  DeviceEnv* base_;
};

// A batch whose records lie in several segments is one submission (SubmitAcross) covering
// all of them, not one submission per segment.
TEST(SsdGetBatchTest, OneSubmissionCoversEverySegmentOfTheBatch) {
  TempDir dir;
  auto mem = NewMemEnv();
  CountingEnv env(mem.get());
  SsdOptions o;
  o.dir = dir.path();
  o.env = &env;
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 1ull << 20;
  o.write_buffer_bytes = 64 << 10;
  o.group_commit_ms = 3'600'000;
  o.compression = false;
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  constexpr int kUnits = 200;  // 200 x 20 KB: four 1 MiB segments
  std::vector<Key> keys;
  for (int i = 0; i < kUnits; ++i) {
    keys.push_back(MakeKey(i));
    ASSERT_TRUE(ssd.Put(keys.back(), MakeValue(keys.back(), 1, 20'000), {}, nullptr).ok());
  }
  ASSERT_TRUE(ssd.Flush().ok());
  int across0 = env.across_calls.load();
  std::vector<std::vector<uint8_t>> outs;
  std::vector<Status> results;
  ssd.GetBatch(keys, &outs, nullptr, &results);
  for (int i = 0; i < kUnits; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << " " << results[i].ToString();
    EXPECT_EQ(outs[i], MakeValue(keys[i], 1, 20'000)) << i;
  }
  EXPECT_EQ(env.across_calls.load() - across0, 1);
  EXPECT_GE(env.max_devices.load(), 4u) << "the batch's submission did not span its segments";
}

// DirEnv::SubmitAcross on io_uring files: requests on several files in one call, each with
// its own result (a misaligned one fails alone).
TEST(DeviceEnvTest, SubmitAcrossReadsSeveralFilesAtOnce) {
  TempDir dir;
  auto env = NewDirEnv(dir.path());
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  constexpr int kFiles = 3;
  std::vector<std::shared_ptr<BlockDevice>> devs;
  AlignedBuffer data = AllocateAligned(8192, 4096);
  for (int f = 0; f < kFiles; ++f) {
    auto dev = (*env)->Open("f" + std::to_string(f), true);
    ASSERT_TRUE(dev.ok());
    ASSERT_TRUE((*dev)->Allocate(0, 8192).ok());
    std::memset(data.get(), 'a' + f, 8192);
    ASSERT_TRUE((*dev)->Write(0, {data.get(), 8192}).ok());
    devs.push_back(std::move(dev).value());
  }
  AlignedBuffer out = AllocateAligned(kFiles * 8192, 4096);
  std::vector<DeviceIo> ios;
  for (int f = 0; f < kFiles; ++f) {
    for (int b = 0; b < 2; ++b) {
      ios.push_back(
          {devs[f].get(),
           {IoRequest::Op::kRead, uint64_t(b) * 4096, out.get() + f * 8192 + b * 4096, 4096, {}}});
    }
  }
  ios.push_back({devs[0].get(), {IoRequest::Op::kRead, 100, out.get(), 4096, {}}});  // misaligned
  Status st = (*env)->SubmitAcross(ios);
  EXPECT_TRUE(st.IsInvalidArgument()) << st.ToString();
  for (size_t i = 0; i + 1 < ios.size(); ++i) EXPECT_TRUE(ios[i].io.result.ok()) << i;
  EXPECT_TRUE(ios.back().io.result.IsInvalidArgument());
  for (int f = 0; f < kFiles; ++f) {
    for (int j = 0; j < 8192; ++j) ASSERT_EQ(out.get()[f * 8192 + j], 'a' + f) << f << " " << j;
  }
}

// SubmitAcross's on_done: called once per request, and by then the request's result is set
// and (for a read) its buffer filled; a misaligned request is reported too. On io_uring files
// (one ring, reported as completions arrive) and on the memory env (per device).
void CheckOnDoneReportsEachRequestOnce(DeviceEnv* env) {
  constexpr int kFiles = 3;
  std::vector<std::shared_ptr<BlockDevice>> devs;
  AlignedBuffer data = AllocateAligned(8192, 4096);
  for (int f = 0; f < kFiles; ++f) {
    auto dev = env->Open("f" + std::to_string(f), true);
    ASSERT_TRUE(dev.ok());
    ASSERT_TRUE((*dev)->Allocate(0, 8192).ok());
    std::memset(data.get(), 'a' + f, 8192);
    ASSERT_TRUE((*dev)->Write(0, {data.get(), 8192}).ok());
    devs.push_back(std::move(dev).value());
  }
  AlignedBuffer out = AllocateAligned(kFiles * 8192, 4096);
  std::memset(out.get(), 0, kFiles * 8192);
  std::vector<DeviceIo> ios;
  for (int f = 0; f < kFiles; ++f) {
    for (int b = 0; b < 2; ++b) {
      ios.push_back(
          {devs[f].get(),
           {IoRequest::Op::kRead, uint64_t(b) * 4096, out.get() + f * 8192 + b * 4096, 4096, {}}});
    }
  }
  const bool strict_alignment = devs[0]->Alignment() > 1;
  AlignedBuffer spare = AllocateAligned(8192, 4096);
  ios.push_back({devs[0].get(), {IoRequest::Op::kRead, 100, spare.get(), 4096, {}}});
  std::vector<int> calls(ios.size(), 0);
  (void)env->SubmitAcross(ios, [&](size_t i) {
    ASSERT_LT(i, ios.size());
    ++calls[i];
    if (i + 1 == ios.size()) {
      EXPECT_EQ(ios[i].io.result.IsInvalidArgument(), strict_alignment)
          << ios[i].io.result.ToString();
      return;
    }
    ASSERT_TRUE(ios[i].io.result.ok()) << i << " " << ios[i].io.result.ToString();
    size_t f = i / 2;
    for (size_t j = 0; j < 4096; ++j) {
      ASSERT_EQ(ios[i].io.buffer[j], 'a' + f) << "request " << i << " reported before its data";
    }
  });
  for (size_t i = 0; i < ios.size(); ++i) EXPECT_EQ(calls[i], 1) << i;
}

TEST(DeviceEnvTest, OnDoneReportsEachRequestOnceOnIoUringFiles) {
  TempDir dir;
  DirEnvOptions d;
  d.engine = IoEngine::kIoUring;
  auto env = NewDirEnv(dir.path(), d);
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  CheckOnDoneReportsEachRequestOnce(env->get());
}

TEST(DeviceEnvTest, OnDoneReportsEachRequestOnceOnTheMemoryEnv) {
  auto env = NewMemEnv();
  CheckOnDoneReportsEachRequestOnce(env.get());
}

// A tier on io_uring files whose rings fail on demand (RingFaults), with kUnits units on the
// device (flushed: a batch must read them).
constexpr int kRingUnits = 8;
std::unique_ptr<SsdTier> OpenRingFaultTier(const std::string& dir, RingFaults* faults) {
  SsdOptions o;
  o.dir = dir;
  o.dir_env.engine = IoEngine::kIoUring;
  o.dir_env.ring_faults = faults;
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 4ull << 20;
  o.group_commit_ms = 3'600'000;
  o.compression = false;
  auto opened = SsdTier::Open(o);
  EXPECT_TRUE(opened.ok()) << opened.status().ToString();
  if (!opened.ok()) return nullptr;
  for (int i = 0; i < kRingUnits; ++i) {
    Key k = MakeKey(i);
    EXPECT_TRUE((*opened)->Put(k, MakeValue(k, 1, 5000), {}, nullptr).ok());
  }
  EXPECT_TRUE((*opened)->Flush().ok());
  return std::move(opened).value();
}

// Each unit of the batch is either served exact or an I/O error, never a checksum failure
// that quarantines a good unit; Get (the ring no longer failing) serves every unit. Returns
// the I/O errors.
int CheckBatchUnderRingFaults(SsdTier& ssd) {
  std::vector<Key> keys;
  for (int i = 0; i < kRingUnits; ++i) keys.push_back(MakeKey(i));
  std::vector<std::vector<uint8_t>> outs;
  std::vector<Status> results;
  ssd.GetBatch(keys, &outs, nullptr, &results);
  int io_errors = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (results[i].ok()) {
      EXPECT_EQ(outs[i], MakeValue(keys[i], 1, 5000)) << i;
    } else {
      EXPECT_TRUE(results[i].IsIOError()) << i << " " << results[i].ToString();
      ++io_errors;
    }
    EXPECT_TRUE(ssd.Contains(keys[i])) << i << " quarantined";
    std::vector<uint8_t> one;
    EXPECT_TRUE(ssd.Get(keys[i], &one).ok()) << i;
    EXPECT_EQ(one, MakeValue(keys[i], 1, 5000)) << i;
  }
  EXPECT_EQ(ssd.GetStats().checksum_failures, 0u);
  EXPECT_EQ(ssd.GetStats().io_errors, uint64_t(io_errors));
  return io_errors;
}

// A batch whose ring fails its submission is an I/O error for each of its device reads:
// never a hit over a buffer nothing was read into, never a quarantine.
TEST(SsdGetBatchTest, ARingErrorIsAnIoErrorForEveryReadAndQuarantinesNothing) {
  TempDir dir;
  RingFaults faults;
  auto ssd = OpenRingFaultTier(dir.path(), &faults);
  ASSERT_NE(ssd, nullptr);
  faults.FailNextSubmissions(1);
  EXPECT_EQ(CheckBatchUnderRingFaults(*ssd), kRingUnits);
  EXPECT_EQ(faults.injected(), 1u);
}

// Failed completions are I/O errors for their units only; the others are served.
TEST(SsdGetBatchTest, FailedCompletionsAreIoErrorsForTheirUnitsOnly) {
  TempDir dir;
  RingFaults faults;
  auto ssd = OpenRingFaultTier(dir.path(), &faults);
  ASSERT_NE(ssd, nullptr);
  faults.FailNextCompletions(3, /*after=*/2);
  EXPECT_EQ(CheckBatchUnderRingFaults(*ssd), 3);
  EXPECT_EQ(faults.injected(), 3u);
}

TEST(SsdGetBatchTest, ACorruptedRecordIsQuarantinedAndTheOthersAreServed) {
  TempDir dir;
  auto env = NewMemEnv();
  SsdOptions o;
  o.dir = dir.path();
  o.env = env.get();
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 4ull << 20;
  o.compression = false;
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok());
  SsdTier& ssd = **opened;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(ssd.Put(MakeKey(i), MakeValue(MakeKey(i), 1, 5000), {}, nullptr).ok());
  }
  ASSERT_TRUE(ssd.Flush().ok());
  // Flip a payload byte of the second record on the device (records are 5128 B apart).
  auto names = env->List();
  ASSERT_TRUE(names.ok() && !names->empty());
  auto dev = env->Open(names->front(), false);
  ASSERT_TRUE(dev.ok());
  uint8_t b = 0;
  uint64_t at = 5128 + 128 + 100;
  ASSERT_TRUE((*dev)->Read(at, {&b, 1}).ok());
  b ^= 0xff;
  ASSERT_TRUE((*dev)->Write(at, {&b, 1}).ok());
  std::vector<Key> keys = {MakeKey(0), MakeKey(1), MakeKey(2)};
  std::vector<std::vector<uint8_t>> outs;
  std::vector<Status> results;
  ssd.GetBatch(keys, &outs, nullptr, &results);
  EXPECT_TRUE(results[0].ok());
  EXPECT_TRUE(results[1].IsCorruption()) << results[1].ToString();
  EXPECT_TRUE(results[2].ok());
  EXPECT_EQ(outs[2], MakeValue(MakeKey(2), 1, 5000));
  EXPECT_FALSE(ssd.Contains(MakeKey(1)));  // quarantined
  EXPECT_EQ(ssd.GetStats().checksum_failures, 1u);
}

TEST(TierManagerGetBatchTest, ServesEveryTierAndReportsMisses) {
  TempDir dir;
  auto env = NewMemEnv();
  TierManagerOptions o;
  o.data_dir = dir.path();
  o.ssd_env = env.get();
  o.dram_capacity_bytes = 0;
  o.ssd_capacity_bytes = 64ull << 20;
  o.ssd_segment_bytes = 4ull << 20;
  auto tm = TierManager::Open(o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  for (int i = 0; i < 20; ++i) {
    PutOptions p;
    p.highest_tier = Tier::kSsd;
    ASSERT_TRUE((*tm)->Put(MakeKey(i), MakeValue(MakeKey(i), 1, 3000), p).ok());
  }
  std::vector<Key> keys = {MakeKey(3), MakeKey(99), MakeKey(7)};
  std::vector<std::vector<uint8_t>> outs;
  std::vector<Tier> froms;
  std::vector<Status> results;
  (*tm)->GetBatch(keys, &outs, &froms, &results);
  ASSERT_TRUE(results[0].ok());
  EXPECT_EQ(outs[0], MakeValue(MakeKey(3), 1, 3000));
  EXPECT_EQ(froms[0], Tier::kSsd);
  EXPECT_TRUE(results[1].IsNotFound());
  ASSERT_TRUE(results[2].ok());
  EXPECT_EQ(outs[2], MakeValue(MakeKey(7), 1, 3000));
  std::vector<Key> too_many(kMaxBatch + 1, MakeKey(1));
  (*tm)->GetBatch(too_many, &outs, &froms, &results);
  EXPECT_TRUE(results[0].IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::storage
