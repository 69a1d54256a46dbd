// SsdTier::GetBatch and TierManager::GetBatch: every key of a batch gets what Get would give
// it (units on the device, in the write buffer, missing, corrupted on the device), on the
// memory env and on io_uring files, and under injected ring faults (RingFaults). The same for
// the forms without a copy per unit (SsdTier::Batch, TierManager::GetBatchVisit).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>
#include <vector>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_format.h"
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
    // Every fifth unit is a compressible blob: stored zstd, decoded on read.
    const bool blob = i % 5 == 0;
    if (blob) m.kind = policies::ObjectKind::kBlob;
    ASSERT_TRUE(
        ssd.Put(MakeKey(i), MakeValue(MakeKey(i), i + 1, 20'000 + i, blob), m, nullptr).ok());
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
  EXPECT_GT(ssd.GetStats().compressed_bytes_saved, 0u);  // the zstd path was read too
  // The same batch with each value viewed where it was read (or decoded).
  SsdTier::Batch batch;
  ssd.GetBatch(keys, &batch);
  ASSERT_EQ(batch.size(), keys.size());
  for (size_t j = 0; j < keys.size(); ++j) {
    std::vector<uint8_t> one;
    SsdMeta meta;
    Status st = ssd.Get(keys[j], &one, &meta);
    ASSERT_EQ(batch.result(j).code(), st.code()) << j << " " << batch.result(j).ToString();
    if (!st.ok()) {
      EXPECT_TRUE(batch.value(j).empty()) << j;
      continue;
    }
    EXPECT_EQ(std::vector<uint8_t>(batch.value(j).begin(), batch.value(j).end()), one) << j;
    EXPECT_EQ(batch.meta(j).version, meta.version) << j;
    EXPECT_EQ(batch.meta(j).raw_bytes, one.size()) << j;
  }
}

// Views stay valid while their Batch lives: a second batch read on the same thread (which
// reuses the thread's read region once the first hands it back) does not overwrite them, nor
// does moving the Batch.
TEST(SsdGetBatchTest, BatchViewsStayValidWhileTheirBatchLives) {
  TempDir dir;
  DirEnvOptions d;
  d.engine = IoEngine::kIoUring;
  auto env = NewDirEnv(dir.path() + "/segments", d);
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  SsdOptions o;
  o.dir = dir.path();
  o.env = env->get();
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 4ull << 20;
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  SsdTier& ssd = **opened;
  constexpr int kUnits = 60;
  auto value = [](int i) { return MakeValue(MakeKey(i), 1, 5216 + i); };
  for (int i = 0; i < kUnits; ++i) ASSERT_TRUE(ssd.Put(MakeKey(i), value(i), {}, nullptr).ok());
  ASSERT_TRUE(ssd.Flush().ok());
  auto keys = [](int first, int n) {
    std::vector<Key> k;
    for (int i = first; i < first + n; ++i) k.push_back(MakeKey(i));
    return k;
  };
  auto expect = [&](const SsdTier::Batch& b, int first, size_t n, const char* what) {
    ASSERT_EQ(b.size(), n) << what;
    for (size_t j = 0; j < b.size(); ++j) {
      ASSERT_TRUE(b.result(j).ok()) << what << " " << j << " " << b.result(j).ToString();
      EXPECT_EQ(std::vector<uint8_t>(b.value(j).begin(), b.value(j).end()),
                value(first + static_cast<int>(j)))
          << what << " " << j;
    }
  };
  SsdTier::Batch a;
  ssd.GetBatch(keys(0, 20), &a);
  {
    SsdTier::Batch b;
    ssd.GetBatch(keys(20, 20), &b);
    expect(b, 20, 20, "b");
  }  // b hands its region to the thread's cache
  SsdTier::Batch c;
  ssd.GetBatch(keys(40, 20), &c);  // takes the cached region
  SsdTier::Batch e;
  ssd.GetBatch(keys(10, 20), &e);  // while c holds it: another region
  SsdTier::Batch moved = std::move(a);
  expect(moved, 0, 20, "a, moved");
  expect(c, 40, 20, "c");
  expect(e, 10, 20, "e");
  ssd.GetBatch(keys(0, kUnits), &c);  // reused for a larger batch
  expect(c, 0, kUnits, "c again");
  expect(moved, 0, 20, "a, after c's second batch");
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
  StatusOr<uint64_t> FreeBytes() override { return base_->FreeBytes(); }
  std::string Kind() const override { return "counting"; }
  Status SubmitAcross(std::span<DeviceIo> batch, const IoDoneFn& on_done) override {
    std::set<BlockDevice*> devices;
    for (const DeviceIo& d : batch) devices.insert(d.device);
    across_calls.fetch_add(1);
    requests.fetch_add(static_cast<int>(batch.size()));
    size_t prev = max_devices.load();
    while (devices.size() > prev && !max_devices.compare_exchange_weak(prev, devices.size())) {
    }
    return DeviceEnv::SubmitAcross(batch, on_done);  // per device: reaches Dev::Submit below
  }
  std::atomic<int> across_calls{0}, read_submits{0}, requests{0};
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
// merge_max: SsdOptions::batch_read_merge_bytes_max (0: one device read per unit).
std::unique_ptr<SsdTier> OpenRingFaultTier(const std::string& dir, RingFaults* faults,
                                           uint64_t merge_max = 0) {
  SsdOptions o;
  o.batch_read_merge_bytes_max = merge_max;
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

// Units that lie next to each other share a device read: a failed read is an I/O error for
// every unit it held (never a verification of a buffer the device did not fill, never a
// quarantine), and each is served by the next read.
TEST(SsdGetBatchTest, AFailedMergedReadIsAnIoErrorForEachOfItsUnits) {
  TempDir dir;
  RingFaults faults;
  auto ssd = OpenRingFaultTier(dir.path(), &faults, 128 << 10);  // 8 x 5 KB: one read
  ASSERT_NE(ssd, nullptr);
  faults.FailNextCompletions(1);
  EXPECT_EQ(CheckBatchUnderRingFaults(*ssd), kRingUnits);
  EXPECT_EQ(faults.injected(), 1u);
}

// Records that lie next to each other in a segment are read together, in reads of at most
// batch_read_merge_bytes_max, each record still verified on its own: 60 units of 5216 B put
// in a row come back bit-exact from far fewer device reads than units (0: one read each),
// in key order whatever the order on the device, duplicates and misses included, and a
// corrupted record inside a shared read is a miss while the units beside it are exact.
void CheckMergedReads(DeviceEnv* base, const std::string& dir, uint64_t merge_max) {
  {
    SCOPED_TRACE(merge_max);
    CountingEnv env(base);
    SsdOptions o;
    o.dir = dir;
    o.env = &env;
    o.capacity_bytes = 64ull << 20;
    o.segment_bytes = 4ull << 20;
    o.group_commit_ms = 3'600'000;
    o.compression = false;
    o.batch_read_merge_bytes_max = merge_max;
    auto opened = SsdTier::Open(o);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    SsdTier& ssd = **opened;
    constexpr int kUnits = 60;
    constexpr int first_key = 1000;
    auto value = [&](int i) { return MakeValue(MakeKey(first_key + i), 1, 5216 + i % 7); };
    for (int i = 0; i < kUnits; ++i) {
      ASSERT_TRUE(ssd.Put(MakeKey(first_key + i), value(i), {}, nullptr).ok());
    }
    ASSERT_TRUE(ssd.Flush().ok());
    std::vector<Key> keys;
    for (int i = kUnits - 1; i >= 0; --i) keys.push_back(MakeKey(first_key + i));  // reversed
    keys.push_back(MakeKey(first_key + 5));                                        // a duplicate
    keys.push_back(MakeKey(first_key + kUnits));                                   // never stored
    const int requests0 = env.requests.load();
    SsdTier::Batch batch;
    ssd.GetBatch(keys, &batch);
    const int reads = env.requests.load() - requests0;
    ASSERT_EQ(batch.size(), keys.size());
    for (int j = 0; j < kUnits; ++j) {
      ASSERT_TRUE(batch.result(j).ok()) << j << " " << batch.result(j).ToString();
      EXPECT_TRUE(std::ranges::equal(batch.value(j), value(kUnits - 1 - j))) << j;
    }
    ASSERT_TRUE(batch.result(kUnits).ok());
    EXPECT_TRUE(std::ranges::equal(batch.value(kUnits), value(5)));
    EXPECT_TRUE(batch.result(kUnits + 1).IsNotFound());
    // 60 x ~5.3 KB = 321 KB in a row: at least 5 reads of at most 64 KiB, at most a few more.
    if (merge_max == 0) {
      EXPECT_EQ(reads, kUnits + 1);  // the duplicate is read again
    } else {
      EXPECT_GE(reads, 5);
      EXPECT_LE(reads, 8);
    }
  }
}

TEST(SsdGetBatchTest, AdjacentRecordsShareReadsOnIoUringFiles) {
  for (uint64_t merge_max : {uint64_t{0}, uint64_t{64} << 10}) {
    TempDir dir;
    DirEnvOptions d;
    d.engine = IoEngine::kIoUring;
    auto env = NewDirEnv(dir.path() + "/segments", d);
    ASSERT_TRUE(env.ok()) << env.status().ToString();
    CheckMergedReads(env->get(), dir.path(), merge_max);
  }
}

TEST(SsdGetBatchTest, AdjacentRecordsShareReadsOnTheMemoryEnv) {
  for (uint64_t merge_max : {uint64_t{0}, uint64_t{64} << 10}) {
    TempDir dir;
    auto env = NewMemEnv();
    CheckMergedReads(env.get(), dir.path(), merge_max);
  }
}

// Flips one payload byte of record `index` of the 5000-byte units put first into a memory
// env's first segment (records are 5128 B apart: a 128-byte header, then the payload; the
// next segment is prepared ahead, empty).
// Flips a payload byte of the index-th record (0-based, in append order) of the first segment.
// The records are found by their headers, not at fixed offsets: a background commit between two
// puts starts the next record at the next block, leaving zeros between.
void FlipPayloadByte(DeviceEnv* env, int index) {
  auto names = env->List();
  ASSERT_TRUE(names.ok() && !names->empty());
  auto dev = env->Open(*std::min_element(names->begin(), names->end()), false);
  ASSERT_TRUE(dev.ok());
  std::vector<uint8_t> seg(size_t{64} << 10);  // the tests put at most 6 records of 5 KB
  ASSERT_TRUE((*dev)->Read(0, {seg.data(), seg.size()}).ok());
  // Records start at kRecordAlignBytes boundaries; a valid header (its own checksum) is one.
  uint64_t at = 0;
  for (int seen = 0;;) {
    ASSERT_LE(at + ssd::kRecordHeaderBytes, seg.size()) << "record " << index << " not found";
    ssd::RecordHeader h;
    if (!ssd::DecodeRecordHeader({seg.data() + at, ssd::kRecordHeaderBytes}, &h).ok()) {
      at += ssd::kRecordAlignBytes;
    } else if (seen++ == index) {
      break;
    } else {
      at += ssd::AlignUp(ssd::RecordBytes(h), ssd::kRecordAlignBytes);
    }
  }
  const uint64_t flip = at + ssd::kRecordHeaderBytes + 100;
  ASSERT_LT(flip, seg.size());
  uint8_t b = seg[flip] ^ 0xff;
  ASSERT_TRUE((*dev)->Write(flip, {&b, 1}).ok());
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
  // A commit after each put, as the background commit may make at any point: each next record
  // starts at the next block (the layout that made this test flaky when the helper assumed
  // records back to back).
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(ssd.Put(MakeKey(i), MakeValue(MakeKey(i), 1, 5000), {}, nullptr).ok());
    ASSERT_TRUE(ssd.Flush().ok());
  }
  // The second record's payload, in the first segment (not the one prepared ahead).
  FlipPayloadByte(env.get(), 1);
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

// The same through a Batch: the corrupted record is never viewed (its value is empty), it is
// quarantined and counted once, and its neighbours are served bit-exact.
TEST(SsdGetBatchTest, ACorruptedRecordIsNeverViewedInABatch) {
  TempDir dir;
  auto env = NewMemEnv();
  CountingEnv counting(env.get());
  SsdOptions o;
  o.dir = dir.path();
  o.env = &counting;
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 4ull << 20;
  auto opened = SsdTier::Open(o);
  ASSERT_TRUE(opened.ok());
  SsdTier& ssd = **opened;
  for (int i = 0; i < 3; ++i) {
    SsdMeta m;
    m.version = 7;
    ASSERT_TRUE(ssd.Put(MakeKey(i), MakeValue(MakeKey(i), 1, 5000), m, nullptr).ok());
  }
  ASSERT_TRUE(ssd.Flush().ok());
  FlipPayloadByte(env.get(), 1);
  SsdTier::Batch batch;
  const int requests0 = counting.requests.load();
  ssd.GetBatch(std::vector<Key>{MakeKey(0), MakeKey(1), MakeKey(2)}, &batch);
  EXPECT_EQ(counting.requests.load() - requests0, 1);  // the three records share one read
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_TRUE(batch.result(1).IsCorruption()) << batch.result(1).ToString();
  EXPECT_TRUE(batch.value(1).empty());
  EXPECT_EQ(batch.meta(1).version, 7u);  // what a refetch of the quarantined unit needs
  for (int i : {0, 2}) {
    ASSERT_TRUE(batch.result(i).ok()) << batch.result(i).ToString();
    EXPECT_EQ(std::vector<uint8_t>(batch.value(i).begin(), batch.value(i).end()),
              MakeValue(MakeKey(i), 1, 5000));
  }
  EXPECT_FALSE(ssd.Contains(MakeKey(1)));  // quarantined
  EXPECT_EQ(ssd.GetStats().checksum_failures, 1u);
}

// A TierManager over `env` with 8 MiB of DRAM (1 MiB slab pages) and 64 MiB of SSD in 4 MiB
// segments: room for every unit these tests put, in both tiers.
TierManagerOptions SmallTiers(const std::string& dir, DeviceEnv* env) {
  TierManagerOptions o;
  o.data_dir = dir;
  o.ssd_env = env;
  o.dram_capacity_bytes = 8ull << 20;
  o.slab_page_bytes = 1ull << 20;
  o.ssd_capacity_bytes = 64ull << 20;
  o.ssd_segment_bytes = 4ull << 20;
  return o;
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

// GetBatchVisit's `visited` (where the daemon answers its client) comes after the last visit
// and before the promotions: inside it every key was visited and the SSD hits are still on
// SSD only; when GetBatchVisit returns they are in DRAM, bit-exact (no promotion lost). A
// unit deleted in `visited` (a client deleting right after its reply) is not brought back by
// the promotion that follows, and a unit put again there keeps its new value.
TEST(TierManagerGetBatchTest, VisitedComesBeforePromotionsThatHonourLaterDeletesAndPuts) {
  TempDir dir;
  auto env = NewMemEnv();
  auto tm = TierManager::Open(SmallTiers(dir.path(), env.get()));
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  auto value = [](int i) { return MakeValue(MakeKey(i), 1, 5000); };
  PutOptions on_ssd;
  on_ssd.highest_tier = Tier::kSsd;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE((*tm)->Put(MakeKey(i), value(i), on_ssd).ok());
  ASSERT_TRUE((*tm)->Flush().ok());
  auto tier_of = [&](int i) {
    LookupResult r = (*tm)->Lookup(std::vector<Key>{MakeKey(i)});
    return r.hit_count == 1 ? r.tiers[0] : Tier::kNone;
  };
  const std::vector<uint8_t> new_value = MakeValue(MakeKey(2), 2, 4000);
  std::vector<Key> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(MakeKey(i));
  size_t visits = 0;
  int visited_calls = 0;
  (*tm)->GetBatchVisit(
      keys,
      [&](size_t i, const Status& st, Tier from, std::span<const uint8_t> v) {
        EXPECT_EQ(i, visits);
        ++visits;
        ASSERT_TRUE(st.ok()) << i << " " << st.ToString();
        EXPECT_EQ(from, Tier::kSsd) << i;
        EXPECT_TRUE(std::ranges::equal(v, value(static_cast<int>(i)))) << i;
      },
      RequestTag{},
      [&] {
        ++visited_calls;
        EXPECT_EQ(visits, keys.size());
        for (int i = 0; i < 6; ++i) EXPECT_EQ(tier_of(i), Tier::kSsd) << i << " promoted early";
        ASSERT_TRUE((*tm)->Delete(MakeKey(1)).ok());
        ASSERT_TRUE((*tm)->Put(MakeKey(2), new_value, on_ssd).ok());
      });
  EXPECT_EQ(visited_calls, 1);
  for (int i : {0, 3, 4, 5}) {
    EXPECT_EQ(tier_of(i), Tier::kDram) << i << " not promoted";
    std::vector<uint8_t> out;
    Tier from = Tier::kNone;
    ASSERT_TRUE((*tm)->Get(MakeKey(i), &out, &from).ok()) << i;
    EXPECT_EQ(from, Tier::kDram) << i;
    EXPECT_EQ(out, value(i)) << i;
  }
  std::vector<uint8_t> out;
  EXPECT_TRUE((*tm)->Get(MakeKey(1), &out).IsNotFound()) << "a deleted unit came back";
  EXPECT_EQ(tier_of(1), Tier::kNone);
  ASSERT_TRUE((*tm)->Get(MakeKey(2), &out).ok());
  EXPECT_EQ(out, new_value) << "the old version was promoted over the new one";
  // Without a batch to promote `visited` is still called once (every key a miss).
  visited_calls = 0;
  (*tm)->GetBatchVisit(
      std::vector<Key>{MakeKey(98), MakeKey(99)},
      [&](size_t, const Status& st, Tier, std::span<const uint8_t>) {
        EXPECT_TRUE(st.IsNotFound());
      },
      RequestTag{}, [&] { ++visited_calls; });
  EXPECT_EQ(visited_calls, 1);
}

// GetBatchVisit: one visit per key, in key order, with GetBatch's status, tier and value; SSD
// hits are promoted (the next batch finds them in DRAM); a unit corrupted on SSD is visited as
// a miss with no value, quarantined and counted, and its neighbours are exact.
TEST(TierManagerGetBatchTest, VisitSeesEachKeyOnceInOrderAndNeverACorruptedValue) {
  TempDir dir;
  auto env = NewMemEnv();
  auto tm = TierManager::Open(SmallTiers(dir.path(), env.get()));
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  auto value = [](int i) { return MakeValue(MakeKey(i), 1, 5000); };
  for (int i = 0; i < 6; ++i) {  // records 0..5 in put order, on SSD only
    PutOptions p;
    p.highest_tier = Tier::kSsd;
    ASSERT_TRUE((*tm)->Put(MakeKey(i), value(i), p).ok());
  }
  ASSERT_TRUE((*tm)->Flush().ok());
  FlipPayloadByte(env.get(), 4);
  PutOptions dram;
  ASSERT_TRUE((*tm)->Put(MakeKey(50), value(50), dram).ok());  // in DRAM
  struct Visit {
    size_t i;
    StatusCode code;
    Tier from;
    std::vector<uint8_t> value;
  };
  auto visit_all = [&](const std::vector<Key>& keys) {
    std::vector<Visit> seen;
    (*tm)->GetBatchVisit(keys,
                         [&](size_t i, const Status& st, Tier from, std::span<const uint8_t> v) {
                           seen.push_back({i, st.code(), from, {v.begin(), v.end()}});
                         });
    return seen;
  };
  const std::vector<Key> keys = {MakeKey(1), MakeKey(99), MakeKey(50),
                                 MakeKey(4), MakeKey(3),  MakeKey(1)};
  std::vector<Visit> seen = visit_all(keys);
  ASSERT_EQ(seen.size(), keys.size());
  for (size_t j = 0; j < seen.size(); ++j) EXPECT_EQ(seen[j].i, j);
  const std::vector<std::pair<int, Tier>> hits = {
      {0, Tier::kSsd}, {2, Tier::kDram}, {4, Tier::kSsd}, {5, Tier::kSsd}};
  for (auto [j, tier] : hits) {
    EXPECT_EQ(seen[j].code, StatusCode::kOk) << j;
    EXPECT_EQ(seen[j].from, tier) << j;
    EXPECT_EQ(seen[j].value, value(j == 2 ? 50 : j == 4 ? 3 : 1)) << j;
  }
  EXPECT_EQ(seen[1].code, StatusCode::kNotFound);
  EXPECT_TRUE(seen[1].value.empty());
  EXPECT_EQ(seen[3].code, StatusCode::kNotFound);  // failed verification: a miss, no bytes
  EXPECT_EQ(seen[3].from, Tier::kNone);
  EXPECT_TRUE(seen[3].value.empty());
  EXPECT_EQ((*tm)->GetStats().misses_checksum, 1u);
  EXPECT_EQ((*tm)->Lookup(std::vector<Key>{MakeKey(4)}).first_miss, MissReason::kChecksumFailure);
  // The SSD hits were promoted: the same batch now comes from DRAM, bit-exact.
  seen = visit_all({MakeKey(1), MakeKey(3), MakeKey(4)});
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].from, Tier::kDram);
  EXPECT_EQ(seen[0].value, value(1));
  EXPECT_EQ(seen[1].from, Tier::kDram);
  EXPECT_EQ(seen[1].value, value(3));
  EXPECT_EQ(seen[2].code, StatusCode::kNotFound);
  // Over kMaxBatch keys: every key is visited as InvalidArgument.
  std::vector<Key> too_many(kMaxBatch + 1, MakeKey(1));
  seen = visit_all(too_many);
  ASSERT_EQ(seen.size(), too_many.size());
  EXPECT_EQ(seen.back().code, StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::storage
