// SsdTier::GetBatch and TierManager::GetBatch: every key of a batch gets what Get would give
// it (units on the device, in the write buffer, missing, corrupted on the device), on the
// memory env and on io_uring files.
#include <gtest/gtest.h>

#include "storage/block_device.h"
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
