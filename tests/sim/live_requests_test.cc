// The live tiers see requests as the simulator does: several sessions' engine turns
// (LOOKUP, GET of the hit prefix, PUT of the rest, one RequestTag per turn), interleaved, are
// replayed through the real TierManager and, as a kvtier trace whose records carry the turn's
// request id, through the simulator; a recording policy in each must see the same hook calls
// (OnCapacity, OnRequest, OnMiss, Evict, OnInsert, OnAccess, OnRemove) with the same times.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "policies/long_tail/long_tail.h"
#include "policies/policy.h"
#include "sim/simulator.h"
#include "sim/trace.h"
#include "storage/block_device.h"
#include "storage/key_util.h"
#include "storage/tier_manager.h"
#include "tests/sim/recording_policy.h"

namespace kvtier::sim {
namespace {

using live_test::MakeInner;
using live_test::Named;
using live_test::RecordingPolicy;
using live_test::SimRun;
using policies::EvictionPolicy;
using policies::ObjectId;

storage::Key KeyOf(uint64_t id) {
  storage::Key k{};
  for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>(id >> (8 * i));
  k[31] = 0x5a;  // not all zero beyond the id
  return k;
}

// One engine turn as sent: a GET of the hit prefix (skipped when nothing hit) and a PUT of
// the rest, sharing one request.
struct Turn {
  uint64_t request = 0;
  uint64_t ts_ms = 0;
  std::vector<uint64_t> get_ids, put_ids;
};

// An SSD tier under the DRAM tier (durability none: a put reaches SSD only when demoted, as in
// the simulator): units of value_bytes, segments in memory, the index under dir, demotions
// through the admission policy `admission`. record_lookups: each turn's trace starts with a
// "lookup" record of its whole chain, as kvtierd records a LOOKUP (the simulator then counts
// the turn's references there, and its GET only touches the policies).
struct LiveSsd {
  uint64_t value_bytes = 0;
  uint64_t capacity_bytes = 0;
  std::string dir;
  std::string admission = "admit-all";
  bool record_lookups = false;
};

struct Replayed {
  std::vector<std::string> log, ssd_log;
  Trace trace;                                   // what the simulator replays
  std::unordered_map<ObjectId, ObjectId> dense;  // live id -> simulator id (first use order)
  policies::EvictionPolicy* inner = nullptr;     // the live tier's wrapped policy
  std::unique_ptr<ManualClock> clock;
  std::unique_ptr<storage::DeviceEnv> env;   // the SSD tier's segments (before tm: outlives it)
  std::unique_ptr<storage::TierManager> tm;  // owns `inner`
};

constexpr uint64_t kValueBytes = 4096;  // one slab page per unit: capacity in units is exact

// Replays `sessions` conversations of `turns` turns each, through a TierManager with a DRAM
// tier of `capacity_units`. `interleave`: a seeded schedule runs other sessions' phases
// between a turn's GET and its PUT; otherwise each turn runs whole, session after session
// in the same turn order. The turn times do not depend on the schedule.
void LiveRun(const MakeInner& make, uint64_t capacity_units, int sessions, int turns,
             bool interleave, uint32_t seed, Replayed* run, const LiveSsd* ssd = nullptr,
             Structure structure = Structure::kPlain) {
  run->clock = std::make_unique<ManualClock>(0);
  ManualClock& clock = *run->clock;
  const uint64_t value_bytes = ssd != nullptr ? ssd->value_bytes : kValueBytes;
  storage::TierManagerOptions o;
  o.hbm_capacity_bytes = 0;
  o.dram_capacity_bytes = capacity_units * value_bytes;
  o.slab_page_bytes = value_bytes;
  o.ssd_capacity_bytes = 0;
  o.clock = &clock;
  o.eviction_structure = structure;
  if (ssd != nullptr) {
    run->env = storage::NewMemEnv();
    o.ssd_capacity_bytes = ssd->capacity_bytes;
    o.ssd_segment_bytes = 1u << 20;
    o.ssd_env = run->env.get();
    o.data_dir = ssd->dir;
    o.durability = storage::Durability::kNone;
    o.admission_policy = ssd->admission;
    o.ssd_eviction_policy_factory = [&]() -> std::unique_ptr<EvictionPolicy> {
      return std::make_unique<RecordingPolicy>(make(), &run->ssd_log, &run->dense);
    };
  }
  o.eviction_policy_factory = [&]() -> std::unique_ptr<EvictionPolicy> {
    auto inner = make();
    run->inner = inner.get();
    return std::make_unique<RecordingPolicy>(std::move(inner), &run->log, &run->dense);
  };
  auto opened = storage::TierManager::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  run->tm = std::move(*opened);
  storage::TierManager* tm = run->tm.get();

  // Each session's chain grows by 1..3 units a turn; turn k of session s happens at a time
  // fixed by (s, k), so serial and interleaved schedules give every turn the same time.
  std::mt19937 rng(seed);
  std::vector<std::vector<int>> grow(sessions, std::vector<int>(turns));
  for (auto& g : grow) {
    for (int& x : g) x = 1 + static_cast<int>(rng() % 3);
  }
  std::vector<int> next_turn(sessions, 0);
  std::vector<std::vector<storage::Key>> chain(sessions);
  struct Pending {
    bool open = false;
    storage::RequestTag tag;
    size_t first_put = 0;
    uint64_t request = 0;
  };
  std::vector<Pending> pending(sessions);
  uint64_t requests = 0;
  const std::vector<uint8_t> value(value_bytes, 7);
  auto note = [&](uint64_t id) { run->dense.try_emplace(id, run->dense.size() + 1); };

  auto start_turn = [&](int s) {
    const int k = next_turn[s]++;
    const uint64_t ts_ms = 1000 + 5000ull * static_cast<uint64_t>(k) + 37ull * s;
    clock.SetUs(ts_ms * 1000);
    for (int i = 0; i < grow[s][k]; ++i) {
      chain[s].push_back(KeyOf(1000ull * (s + 1) + chain[s].size() + 1));
    }
    Pending& p = pending[s];
    p.open = true;
    p.tag = tm->BeginRequest();
    p.request = ++requests;
    const storage::LookupResult lk = tm->Lookup(chain[s]);
    p.first_put = lk.hit_count;
    if (ssd != nullptr && ssd->record_lookups) {
      TraceRequest look{.ts_ms = ts_ms, .op = TraceOp::kLookup, .request = p.request};
      look.first_id = static_cast<uint32_t>(run->trace.ids.size());
      for (const storage::Key& k : chain[s]) {  // the simulator numbers units from here on
        run->trace.ids.push_back(storage::ObjectIdOf(k));
        note(storage::ObjectIdOf(k));
      }
      look.num_ids = static_cast<uint32_t>(chain[s].size());
      look.bytes = kValueBytes * look.num_ids;
      look.unit_tokens = 64;
      run->trace.requests.push_back(look);
    }
    TraceRequest get{.ts_ms = ts_ms, .op = TraceOp::kGet, .request = p.request};
    if (lk.hit_count > 0) {
      std::vector<storage::Key> keys(chain[s].begin(), chain[s].begin() + lk.hit_count);
      std::vector<std::vector<uint8_t>> outs;
      std::vector<Status> results;
      tm->GetBatch(keys, &outs, nullptr, &results, p.tag);
      get.first_id = static_cast<uint32_t>(run->trace.ids.size());
      for (const storage::Key& k : keys) {
        run->trace.ids.push_back(storage::ObjectIdOf(k));
        note(storage::ObjectIdOf(k));
      }
      get.num_ids = static_cast<uint32_t>(keys.size());
      get.bytes = kValueBytes * keys.size();
      get.unit_tokens = 64;
      run->trace.requests.push_back(get);
      for (const Status& st : results) ASSERT_TRUE(st.ok()) << st.ToString();
    }
  };
  auto finish_turn = [&](int s) {
    Pending& p = pending[s];
    p.open = false;
    TraceRequest put{.ts_ms = p.tag.now_us / 1000, .op = TraceOp::kPut, .request = p.request};
    put.first_id = static_cast<uint32_t>(run->trace.ids.size());
    for (size_t i = p.first_put; i < chain[s].size(); ++i) {
      storage::PutOptions po;
      if (i > 0) po.parent = chain[s][i - 1];
      po.request = p.tag;
      const uint64_t id = storage::ObjectIdOf(chain[s][i]);
      run->trace.ids.push_back(id);
      note(id);
      ASSERT_TRUE(tm->Put(chain[s][i], value, po).ok());
    }
    put.num_ids = static_cast<uint32_t>(chain[s].size() - p.first_put);
    put.bytes = kValueBytes * put.num_ids;
    put.unit_tokens = 64;
    if (put.num_ids > 0) run->trace.requests.push_back(put);
  };

  if (!interleave) {
    for (int k = 0; k < turns; ++k) {
      for (int s = 0; s < sessions; ++s) {
        start_turn(s);
        finish_turn(s);
      }
    }
  } else {
    // Each step runs one phase of a random session: its next turn's LOOKUP+GET, or the PUT
    // of its open turn. Sessions drift apart in turn count, as real ones do.
    int left = sessions * turns;
    while (left > 0) {
      const int s = static_cast<int>(rng() % sessions);
      if (pending[s].open) {
        finish_turn(s);
        --left;
      } else if (next_turn[s] < turns) {
        start_turn(s);
      }
    }
  }
  run->trace.format = TraceFormat::kKvtier;
}

class LiveVsSim : public ::testing::TestWithParam<std::string> {};

// The hook sequences agree call for call, with evictions happening (capacity well below the
// units stored) and sessions interleaved between a turn's GET and its PUT.
TEST_P(LiveVsSim, InterleavedSessionsSameHookSequence) {
  const uint64_t capacity = 24;
  for (uint32_t seed : {1u, 2u, 3u}) {
    Replayed live;
    LiveRun(Named(GetParam()), capacity, /*sessions=*/5, /*turns=*/8, /*interleave=*/true, seed,
            &live);
    const std::vector<std::string> sim = SimRun(Named(GetParam()), capacity, live.trace);
    ASSERT_GT(live.log.size(), 100u);
    EXPECT_GT(std::count_if(live.log.begin(), live.log.end(),
                            [](const std::string& l) { return l.starts_with("evict"); }),
              20);
    ASSERT_EQ(live.log.size(), sim.size()) << "seed " << seed;
    for (size_t i = 0; i < sim.size(); ++i) {
      ASSERT_EQ(live.log[i], sim[i]) << "seed " << seed << " call " << i;
    }
  }
}

// With an SSD tier under DRAM (durability none, so units reach SSD only when DRAM demotes
// them, as in the simulator): the SSD tier's policy gets the simulator's SSD hook sequence too
// (OnCapacity, OnRequest when a request first reaches it, OnMiss, Evict, OnInsert, OnAccess
// on SSD hits), and the DRAM policy's stays the same, with SSD hits promoted.
TEST_P(LiveVsSim, SsdTierSameHookSequence) {
  const uint64_t dram_units = 16;
  // Records of 128 KiB + a 128-byte header in 1 MiB segments: 6 MiB hold 5 segments, of which
  // 4 x 75% may be live: floor(3 MiB / 131200 B) = 23 records.
  const uint64_t ssd_units = 23;
  for (uint32_t seed : {1u}) {
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() /
        ("kvtier_live_ssd_" + std::to_string(::getpid()) + "_" + GetParam() + std::to_string(seed));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    LiveSsd ssd{.value_bytes = 128u << 10, .capacity_bytes = 6u << 20, .dir = dir.string()};
    Replayed live;
    LiveRun(Named(GetParam()), dram_units, /*sessions=*/6, /*turns=*/10, /*interleave=*/true, seed,
            &live, &ssd);
    ASSERT_FALSE(HasFatalFailure());
    std::vector<std::string> sim_ssd;
    const std::vector<std::string> sim =
        SimRun(Named(GetParam()), dram_units, live.trace, ssd_units, &sim_ssd);
    live.tm.reset();
    std::filesystem::remove_all(dir);
    ASSERT_GT(std::count_if(live.ssd_log.begin(), live.ssd_log.end(),
                            [](const std::string& l) { return l.starts_with("evict"); }),
              10)
        << "seed " << seed;
    ASSERT_GT(std::count_if(live.ssd_log.begin(), live.ssd_log.end(),
                            [](const std::string& l) { return l.starts_with("access"); }),
              5)
        << "seed " << seed;
    for (size_t i = 0; i < std::min(sim_ssd.size(), live.ssd_log.size()); ++i) {
      ASSERT_EQ(live.ssd_log[i], sim_ssd[i]) << "seed " << seed << " ssd call " << i;
    }
    ASSERT_EQ(live.ssd_log.size(), sim_ssd.size()) << "seed " << seed;
    for (size_t i = 0; i < std::min(sim.size(), live.log.size()); ++i) {
      ASSERT_EQ(live.log[i], sim[i]) << "seed " << seed << " call " << i;
    }
    ASSERT_EQ(live.log.size(), sim.size()) << "seed " << seed;
  }
}

// second-hit admission: the live store counts a unit's references as the simulator does (a
// LOOKUP counts the keys from its first miss on, which the turn PUTs; the turn's GET counts the
// hits), so with the turns' lookups in the trace the SSD admits the same demotions in both and
// both tiers' policies again see the same calls. admit-all with lookup records as well: a
// lookup touches no policy, in the simulator as in the live store (no OnRequest for a turn
// that only looked up before other sessions ran). Before, the live store never counted a
// reference and admitted nothing to SSD, and the simulator told the DRAM policy of a request
// at its lookup record.
TEST_P(LiveVsSim, SsdTierWithLookupsSameHookSequence) {
  const uint64_t dram_units = 16, ssd_units = 23;  // as SsdTierSameHookSequence
  for (const std::string admission : {"admit-all", "second-hit"}) {
    const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                      ("kvtier_live_ssd_lookups_" + std::to_string(::getpid()) +
                                       "_" + GetParam() + "_" + admission);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    LiveSsd ssd{.value_bytes = 128u << 10,
                .capacity_bytes = 6u << 20,
                .dir = dir.string(),
                .admission = admission,
                .record_lookups = true};
    Replayed live;
    LiveRun(Named(GetParam()), dram_units, /*sessions=*/6, /*turns=*/10, /*interleave=*/true, 1,
            &live, &ssd);
    ASSERT_FALSE(HasFatalFailure());
    const storage::Stats stats = live.tm->GetStats();
    std::vector<std::string> sim_ssd;
    const std::vector<std::string> sim = SimRun(Named(GetParam()), dram_units, live.trace,
                                                ssd_units, &sim_ssd, Structure::kPlain, admission);
    live.tm.reset();
    std::filesystem::remove_all(dir);
    // The check has teeth: demotions were admitted, and (second-hit) others refused.
    EXPECT_GT(stats.admissions, 10u) << admission;
    if (admission == "second-hit") {
      EXPECT_GT(stats.admission_rejections, 10u);
    } else {
      EXPECT_EQ(stats.admission_rejections, 0u);
    }
    for (size_t i = 0; i < std::min(sim_ssd.size(), live.ssd_log.size()); ++i) {
      ASSERT_EQ(live.ssd_log[i], sim_ssd[i]) << admission << " ssd call " << i;
    }
    ASSERT_EQ(live.ssd_log.size(), sim_ssd.size()) << admission;
    for (size_t i = 0; i < std::min(sim.size(), live.log.size()); ++i) {
      ASSERT_EQ(live.log[i], sim[i]) << admission << " call " << i;
    }
    ASSERT_EQ(live.log.size(), sim.size()) << admission;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, LiveVsSim,
                         ::testing::Values("lru", "arc", "s3fifo", "long-tail"));

// Under the prefix layer (TierManagerOptions::eviction_structure, `--structure prefix`): the
// live tiers and the simulator run the same layer, so the inner policy sees the same calls
// and the same units leave the tier, in the same order, on interleaved sessions; and the live
// DRAM tier holds exactly the units the log says it holds.
class LiveVsSimPrefix : public ::testing::TestWithParam<std::string> {};

TEST_P(LiveVsSimPrefix, InterleavedSessionsSameHooksAndVictims) {
  const uint64_t capacity = 24;
  uint64_t swaps = 0, given_back = 0;
  for (uint32_t seed : {1u, 2u, 3u}) {
    Replayed live;
    LiveRun(Named(GetParam()), capacity, /*sessions=*/5, /*turns=*/8, /*interleave=*/true, seed,
            &live, nullptr, Structure::kPrefix);
    ASSERT_FALSE(HasFatalFailure());
    const std::vector<std::string> sim =
        SimRun(Named(GetParam()), capacity, live.trace, 0, nullptr, Structure::kPrefix);
    for (size_t i = 0; i < std::min(sim.size(), live.log.size()); ++i) {
      ASSERT_EQ(live.log[i], sim[i]) << "seed " << seed << " call " << i;
    }
    ASSERT_EQ(live.log.size(), sim.size()) << "seed " << seed;
    std::vector<std::string> live_victims, sim_victims;
    const std::set<std::string> cached = live_test::Cached(live.log, &live_victims);
    (void)live_test::Cached(sim, &sim_victims);
    EXPECT_GT(live_victims.size(), 20u) << "seed " << seed;
    EXPECT_EQ(live_victims, sim_victims) << "seed " << seed;
    // The log's account of the tier is the tier's: every unit is in DRAM iff the log says so.
    for (const auto& [live_id, dense] : live.dense) {
      const storage::LookupResult lk = live.tm->Lookup(std::vector<storage::Key>{KeyOf(live_id)});
      EXPECT_EQ(lk.hit_count == 1, cached.count(std::to_string(dense)) == 1) << "unit " << dense;
    }
    // Rules 2 and 3 acted (see Cached: a give-back is an OnGiveBack of a unit Evict returned;
    // a leaf swap gives the victim back and removes the leaf right after).
    for (size_t i = 0; i + 1 < live.log.size(); ++i) {
      if (!live.log[i].starts_with("giveback ")) continue;
      if (live.log[i + 1].starts_with("remove ")) {
        ++swaps;
      } else {
        ++given_back;
      }
    }
  }
  EXPECT_GT(swaps, 0u);
  if (GetParam() != "lru") {
    EXPECT_GT(given_back, 0u);
  }
}

// The same with an SSD tier under DRAM: both tiers' policies run under the layer, SSD hits are
// reported deepest first and promoted deepest first, as the simulator inserts them.
TEST_P(LiveVsSimPrefix, SsdTierSameHookSequence) {
  const uint64_t dram_units = 16, ssd_units = 23;  // as LiveVsSim.SsdTierSameHookSequence
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("kvtier_live_ssd_prefix_" + std::to_string(::getpid()) + "_" + GetParam());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  LiveSsd ssd{.value_bytes = 128u << 10, .capacity_bytes = 6u << 20, .dir = dir.string()};
  Replayed live;
  LiveRun(Named(GetParam()), dram_units, /*sessions=*/6, /*turns=*/10, /*interleave=*/true, 1,
          &live, &ssd, Structure::kPrefix);
  ASSERT_FALSE(HasFatalFailure());
  std::vector<std::string> sim_ssd;
  const std::vector<std::string> sim =
      SimRun(Named(GetParam()), dram_units, live.trace, ssd_units, &sim_ssd, Structure::kPrefix);
  live.tm.reset();
  std::filesystem::remove_all(dir);
  ASSERT_GT(std::count_if(live.ssd_log.begin(), live.ssd_log.end(),
                          [](const std::string& l) { return l.starts_with("access"); }),
            5);
  for (size_t i = 0; i < std::min(sim_ssd.size(), live.ssd_log.size()); ++i) {
    ASSERT_EQ(live.ssd_log[i], sim_ssd[i]) << "ssd call " << i;
  }
  ASSERT_EQ(live.ssd_log.size(), sim_ssd.size());
  for (size_t i = 0; i < std::min(sim.size(), live.log.size()); ++i) {
    ASSERT_EQ(live.log[i], sim[i]) << "call " << i;
  }
  ASSERT_EQ(live.log.size(), sim.size());
}

INSTANTIATE_TEST_SUITE_P(Policies, LiveVsSimPrefix,
                         ::testing::Values("lru", "arc", "s3fifo", "long-tail"));

// Long-tail under interleaved sessions: with room for everything (no eviction), every unit
// ends in the same class whether the sessions' turns run whole or interleaved, because the
// live tiers give each turn one request and one time; so its model learns the same thing.
TEST(LiveLongTail, ClassesDoNotDependOnInterleaving) {
  auto make = []() -> std::unique_ptr<EvictionPolicy> {
    return std::make_unique<policies::LongTailPolicy>();
  };
  Replayed serial, mixed;
  LiveRun(make, 4096, /*sessions=*/6, /*turns=*/6, /*interleave=*/false, 7, &serial);
  LiveRun(make, 4096, /*sessions=*/6, /*turns=*/6, /*interleave=*/true, 7, &mixed);
  auto* a = static_cast<policies::LongTailPolicy*>(serial.inner);
  auto* b = static_cast<policies::LongTailPolicy*>(mixed.inner);
  // The last request's leaves move to the leaf class when another request begins.
  a->OnRequest(1ull << 40);
  b->OnRequest(1ull << 40);
  ASSERT_EQ(serial.dense.size(), mixed.dense.size());
  size_t per_class[policies::LongTailPolicy::kClasses + 1] = {};
  for (const auto& [live_id, unused] : serial.dense) {
    (void)unused;
    const ObjectId sa = serial.dense.at(live_id), sb = mixed.dense.at(live_id);
    ASSERT_EQ(a->TEST_ClassOf(sa), b->TEST_ClassOf(sb)) << "unit " << live_id;
    ++per_class[a->TEST_ClassOf(sa)];
  }
  // The check has teeth: fresh, extension, hit and leaf classes all occur.
  EXPECT_GT(per_class[policies::LongTailPolicy::kExtension], 0u);
  EXPECT_GT(per_class[policies::LongTailPolicy::kLeaf], 0u);
  EXPECT_GT(per_class[policies::LongTailPolicy::kHit1] +
                per_class[policies::LongTailPolicy::kHit2] +
                per_class[policies::LongTailPolicy::kHit3],
            0u);
}

}  // namespace
}  // namespace kvtier::sim
