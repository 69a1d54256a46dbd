// Long crash loop (LABELS slow): many rounds of random puts/deletes/flushes over the SSD tier
// through the fault-injection env, each round ending in a simulated crash with a torn last
// write, with swarm-randomised options (durability, segment and buffer sizes). After each
// restart every unit must be absent or exactly one acknowledged version, and in sync mode
// every acknowledged put of the round must be present. The seed is printed; set
// KVTIER_CRASH_SEED to replay, KVTIER_CRASH_ROUNDS to lengthen.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <random>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/tier_manager.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::CheckValue;
using testing::MakeKey;
using testing::MakeValue;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

TEST(SsdCrashTest, SwarmCrashLoop) {
  uint64_t seed = EnvOr("KVTIER_CRASH_SEED", std::random_device{}());
  uint64_t rounds = EnvOr("KVTIER_CRASH_ROUNDS", 60);
  std::printf("crash loop seed=%llu rounds=%llu\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(rounds));
  std::mt19937_64 rng(seed);
  testing::TempDir dir;
  auto base = NewMemEnv();
  std::map<int, uint64_t> max_acked;   // highest acknowledged version per unit
  std::map<int, uint64_t> deleted_at;  // version counter value when deleted
  uint64_t version = 0;
  for (uint64_t round = 0; round < rounds; ++round) {
    TierManagerOptions o;
    o.dram_capacity_bytes = 0;
    o.ssd_capacity_bytes = 64ull << 20;
    o.ssd_segment_bytes = (1ull + rng() % 3) << 20;
    o.ssd_write_buffer_bytes = (64ull << 10) << (rng() % 4);
    o.durability =
        std::array{Durability::kNone, Durability::kBatched, Durability::kSync}[rng() % 3];
    o.group_commit_ms = 3'600'000;
    o.data_dir = dir.path();
    FaultOptions fo;
    fo.seed = rng();
    fo.torn_last_write = rng() % 4 != 0;
    FaultInjectionEnv fault(base.get(), fo);
    o.ssd_env = &fault;
    auto tm = TierManager::Open(o);
    ASSERT_TRUE(tm.ok()) << "round " << round << ": " << tm.status().ToString();
    std::vector<uint8_t> out;
    for (const auto& [i, ver] : max_acked) {
      Key k = MakeKey(i);
      if ((*tm)->Get(k, &out).ok()) {
        uint64_t v = 0;
        ASSERT_TRUE(CheckValue(k, out, &v)) << "round " << round << " unit " << i;
        ASSERT_LE(v, ver) << "a version that was never acknowledged";
      }
    }
    std::map<int, uint64_t> acked_this_round;
    int ops = 50 + static_cast<int>(rng() % 300);
    for (int n = 0; n < ops; ++n) {
      int i = static_cast<int>(rng() % 200);
      Key k = MakeKey(i);
      if (rng() % 10 == 0) {
        Status st = (*tm)->Delete(k);
        (void)st;
        acked_this_round.erase(i);
        continue;
      }
      uint64_t v = ++version;
      PutOptions p;
      p.highest_tier = Tier::kSsd;
      p.kind = rng() % 2 ? policies::ObjectKind::kBlob : policies::ObjectKind::kGlobalKv;
      if ((*tm)->Put(k, MakeValue(k, v, 500 + rng() % 60000, rng() % 3 == 0), p).ok()) {
        max_acked[i] = v;
        acked_this_round[i] = v;
      }
    }
    fault.SimulateCrash();
    tm->reset();
    if (o.durability == Durability::kSync) {
      // Every acknowledged put of the round survives the crash.
      TierManagerOptions check = o;
      check.ssd_env = base.get();
      auto reopened = TierManager::Open(check);
      ASSERT_TRUE(reopened.ok());
      for (const auto& [i, v] : acked_this_round) {
        Key k = MakeKey(i);
        ASSERT_TRUE((*reopened)->Get(k, &out).ok()) << "round " << round << " lost unit " << i;
        uint64_t got = 0;
        ASSERT_TRUE(CheckValue(k, out, &got));
        ASSERT_EQ(got, v);
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::storage
