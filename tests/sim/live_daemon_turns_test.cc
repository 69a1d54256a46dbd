// Engine turns through the real daemon: interleaved sessions' LOOKUP, GET and PUT, sent by the
// client library over the native protocol with one turn id per turn (wire::kFlagTurn), reach
// the real TierManager's policy as the simulator replays the same turns (one request per turn,
// one time); and a turn id chosen by a client, however hostile, never joins another
// connection's or another tenant's calls into its request.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_daemon/client.h"
#include "cache_daemon/daemon.h"
#include "common/clock.h"
#include "common/key_spec.h"
#include "sim/trace.h"
#include "storage/block_device.h"
#include "storage/key_util.h"
#include "storage/tier_manager.h"
#include "tests/sim/recording_policy.h"

namespace kvtier::sim {
namespace {

using daemon::Client;
using daemon::wire::Key;
using live_test::MakeInner;
using live_test::Named;
using live_test::RecordingPolicy;
using live_test::SimRun;
using policies::EvictionPolicy;
using policies::ObjectId;

constexpr uint64_t kValueBytes = 4096;  // one slab page per unit: capacity in units is exact

Key ChainKey(uint64_t id) {
  Key k{};
  for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>(id >> (8 * i));
  k[31] = 0xa5;
  return k;
}

// An SSD tier for LiveDaemon: capacity_bytes in segments of segment_bytes (in memory),
// demotions through the admission policy `admission` (durability none: a put reaches SSD only
// when DRAM demotes it, as in the simulator).
struct DaemonSsd {
  uint64_t capacity_bytes = 0, segment_bytes = 0;
  std::string admission = "admit-all";
};

// An in-process kvtierd on a Unix socket over a real TierManager (DRAM, and SSD when given;
// ManualClock) whose policies record their hook calls (ids numbered densely in first-use
// order, shared by both tiers).
class LiveDaemon {
 public:
  LiveDaemon(const MakeInner& make, uint64_t capacity_units, bool auth,
             Structure structure = Structure::kPlain, const DaemonSsd* ssd = nullptr) {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtier_turns_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(dir_);
    storage::TierManagerOptions so;
    so.hbm_capacity_bytes = 0;
    so.dram_capacity_bytes = capacity_units * kValueBytes;
    so.slab_page_bytes = kValueBytes;
    so.ssd_capacity_bytes = 0;
    so.clock = &clock_;
    so.eviction_structure = structure;
    so.eviction_policy_factory = [this, make]() -> std::unique_ptr<EvictionPolicy> {
      return std::make_unique<RecordingPolicy>(make(), &log_, &dense_, /*assign_new=*/true,
                                               &record_mu_);
    };
    if (ssd != nullptr) {
      env_ = storage::NewMemEnv();
      std::filesystem::create_directories(dir_ / "ssd");
      so.ssd_capacity_bytes = ssd->capacity_bytes;
      so.ssd_segment_bytes = ssd->segment_bytes;
      so.ssd_env = env_.get();
      so.data_dir = (dir_ / "ssd").string();
      so.durability = storage::Durability::kNone;
      so.admission_policy = ssd->admission;
      so.ssd_eviction_policy_factory = [this, make]() -> std::unique_ptr<EvictionPolicy> {
        return std::make_unique<RecordingPolicy>(make(), &ssd_log_, &dense_, /*assign_new=*/true,
                                                 &record_mu_);
      };
    }
    auto store = storage::TierManager::Open(so);
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    if (!store.ok()) return;
    o_.data_dir = dir_.string();
    o_.socket_path = (dir_ / "s.sock").string();
    o_.native_port = 0;
    o_.resp_port = 0;
    o_.http_port = 0;
    o_.shm_max_bytes = 8u << 20;
    std::vector<uint8_t> secret(32, 7);
    std::unique_ptr<daemon::TenantRegistry> tenants;
    if (auth) {
      auto t = daemon::TenantRegistry::Parse(
          "[[tenant]]\nname = \"alice\"\nid = 1\ntoken_sha256 = [\"" + TokenSha256Hex("tok-alice") +
              "\"]\n[[tenant]]\nname = \"bob\"\nid = 2\ntoken_sha256 = [\"" +
              TokenSha256Hex("tok-bob") + "\"]\n",
          secret);
      EXPECT_TRUE(t.ok());
      tenants = std::move(t).value();
      o_.tokens_file = "inline";
    } else {
      tenants = daemon::TenantRegistry::Open(secret, 64);
    }
    EXPECT_TRUE(daemon::Finalize(&o_).ok());
    store_ = store->get();
    if (tenants->default_tenant() != nullptr) salt_ = tenants->default_tenant()->salt;
    auto d = daemon::Daemon::Start(o_, std::move(store).value(), std::move(tenants), nullptr);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    if (d.ok()) daemon_ = std::move(d).value();
  }
  ~LiveDaemon() {
    if (daemon_) {
      daemon_->Shutdown();
      EXPECT_TRUE(daemon_->Wait().ok());
    }
    std::filesystem::remove_all(dir_);
  }
  bool ok() const { return daemon_ != nullptr; }
  std::unique_ptr<Client> Connect(const std::string& token = "") {
    daemon::ClientOptions co;
    co.socket_path = o_.socket_path;
    co.token = token;
    co.shm_bytes = 4u << 20;
    co.timeout_ms = 10000;
    auto c = Client::Connect(co);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  ManualClock& clock() { return clock_; }
  // Copies, taken under record_mu_: a GET's promotions may still run after its reply.
  std::vector<std::string> log() const {
    std::lock_guard<std::mutex> lock(record_mu_);
    return log_;
  }
  std::vector<std::string> ssd_log() const {
    std::lock_guard<std::mutex> lock(record_mu_);
    return ssd_log_;
  }
  storage::Stats stats() const { return store_->GetStats(); }
  // Numbers the unit of chain key k (authentication off: the default tenant's), if it has no
  // number yet, as the simulator numbers units: in the order the trace first names them.
  void Note(const Key& k) {
    std::lock_guard<std::mutex> lock(record_mu_);
    dense_.try_emplace(storage::ObjectIdOf(StorageKey(salt_, k)), dense_.size() + 1);
  }

 private:
  std::filesystem::path dir_;
  ManualClock clock_{0};
  std::unique_ptr<storage::DeviceEnv> env_;  // the SSD tier's segments: outlives the daemon
  storage::TierManager* store_ = nullptr;    // owned by daemon_
  // Guards log_, ssd_log_ and dense_: the DRAM and SSD tiers' recording policies run on the
  // daemon's threads under the tiers' own locks, and Note on the test's.
  mutable std::mutex record_mu_;
  std::vector<std::string> log_, ssd_log_;
  Digest salt_{};  // the default tenant's (authentication off)
  std::unordered_map<ObjectId, ObjectId> dense_;
  daemon::DaemonOptions o_;
  std::unique_ptr<daemon::Daemon> daemon_;
};

// Replays `sessions` conversations of `turns` turns each through one client of `d`, as an
// engine's session store sends them (a turn: LOOKUP, GET of the hit prefix, PUT of the rest,
// one turn id), with a seeded schedule running other sessions' phases between a turn's GET
// and its PUT; and writes the same turns as a kvtier trace (one request id per turn; with
// record_lookups each turn's records start with its LOOKUP of the whole chain, as kvtierd
// records it). A GET must hit every key its LOOKUP hit, unless get_misses_allowed (an SSD
// tier: an earlier GET's promotions, which run after its reply, may demote a unit between a
// turn's LOOKUP and its GET).
void DaemonRun(LiveDaemon* d, int sessions, int turns, uint32_t seed, Trace* trace,
               bool record_lookups = false, bool get_misses_allowed = false) {
  std::unique_ptr<Client> c = d->Connect();
  ASSERT_NE(c, nullptr);
  std::mt19937 rng(seed);
  std::vector<std::vector<int>> grow(sessions, std::vector<int>(turns));
  for (auto& g : grow) {
    for (int& x : g) x = 1 + static_cast<int>(rng() % 3);
  }
  std::vector<int> next_turn(sessions, 0);
  std::vector<std::vector<Key>> chain(sessions);
  std::vector<std::vector<uint64_t>> ids(sessions);
  struct Pending {
    bool open = false;
    uint64_t turn = 0, request = 0, ts_ms = 0;
    size_t first_put = 0;
  };
  std::vector<Pending> pending(sessions);
  uint64_t requests = 0;
  const std::vector<uint8_t> value(kValueBytes, 7);

  auto start_turn = [&](int s) {
    const int k = next_turn[s]++;
    Pending& p = pending[s];
    p.ts_ms = 1000 + 5000ull * static_cast<uint64_t>(k) + 37ull * s;
    d->clock().SetUs(p.ts_ms * 1000);  // the turn's time: its first call (the LOOKUP) takes it
    for (int i = 0; i < grow[s][k]; ++i) {
      const uint64_t id = 1000ull * (s + 1) + chain[s].size() + 1;
      chain[s].push_back(ChainKey(id));
      ids[s].push_back(id);
    }
    p.open = true;
    p.turn = c->NewTurn();
    p.request = ++requests;
    auto lk = c->Lookup(chain[s], p.turn);
    ASSERT_TRUE(lk.ok()) << lk.status().ToString();
    p.first_put = lk->hit_count;
    if (record_lookups) {
      TraceRequest look{.ts_ms = p.ts_ms, .op = TraceOp::kLookup, .request = p.request};
      look.first_id = static_cast<uint32_t>(trace->ids.size());
      trace->ids.insert(trace->ids.end(), ids[s].begin(), ids[s].end());
      for (const Key& k : chain[s]) d->Note(k);  // the simulator numbers units from here on
      look.num_ids = static_cast<uint32_t>(ids[s].size());
      look.bytes = kValueBytes * look.num_ids;
      look.unit_tokens = 64;
      trace->requests.push_back(look);
    }
    if (lk->hit_count == 0) return;
    std::vector<Key> keys(chain[s].begin(), chain[s].begin() + lk->hit_count);
    d->clock().AdvanceUs(123);  // later calls of the turn keep the turn's time
    Status st = c->Get(keys, p.turn, [&](size_t, const daemon::GetItem& item) {
      EXPECT_TRUE(item.status.ok() || (get_misses_allowed && item.status.IsNotFound()))
          << item.status.ToString();
    });
    ASSERT_TRUE(st.ok()) << st.ToString();
    TraceRequest get{.ts_ms = p.ts_ms, .op = TraceOp::kGet, .request = p.request};
    get.first_id = static_cast<uint32_t>(trace->ids.size());
    trace->ids.insert(trace->ids.end(), ids[s].begin(), ids[s].begin() + lk->hit_count);
    get.num_ids = static_cast<uint32_t>(lk->hit_count);
    get.bytes = kValueBytes * get.num_ids;
    get.unit_tokens = 64;
    trace->requests.push_back(get);
  };
  auto finish_turn = [&](int s) {
    Pending& p = pending[s];
    p.open = false;
    d->clock().AdvanceUs(456);
    std::vector<daemon::PutUnit> units;
    for (size_t i = p.first_put; i < chain[s].size(); ++i) {
      units.push_back({chain[s][i], i > 0 ? chain[s][i - 1] : Key{}, value});
    }
    if (units.empty()) return;
    daemon::PutOptions po;
    po.turn = p.turn;
    auto put = c->Put(units, po);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    for (const Status& st : *put) ASSERT_TRUE(st.ok()) << st.ToString();
    TraceRequest rec{.ts_ms = p.ts_ms, .op = TraceOp::kPut, .request = p.request};
    rec.first_id = static_cast<uint32_t>(trace->ids.size());
    trace->ids.insert(trace->ids.end(), ids[s].begin() + p.first_put, ids[s].end());
    rec.num_ids = static_cast<uint32_t>(units.size());
    rec.bytes = kValueBytes * rec.num_ids;
    rec.unit_tokens = 64;
    trace->requests.push_back(rec);
  };

  int left = sessions * turns;
  while (left > 0) {
    const int s = static_cast<int>(rng() % sessions);
    if (pending[s].open) {
      finish_turn(s);
      --left;
    } else if (next_turn[s] < turns) {
      start_turn(s);
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  trace->format = TraceFormat::kKvtier;
}

class DaemonVsSim : public ::testing::TestWithParam<std::string> {};

// Interleaved sessions through kvtierd give the policy the simulator's hook sequence, call
// for call and time for time, with evictions happening.
TEST_P(DaemonVsSim, InterleavedTurnsSameHookSequence) {
  const uint64_t capacity = 24;
  for (uint32_t seed : {1u, 2u}) {
    LiveDaemon d(Named(GetParam()), capacity, /*auth=*/false);
    ASSERT_TRUE(d.ok());
    Trace trace;
    DaemonRun(&d, /*sessions=*/5, /*turns=*/8, seed, &trace);
    ASSERT_FALSE(HasFatalFailure());
    const std::vector<std::string> sim = SimRun(Named(GetParam()), capacity, trace);
    const std::vector<std::string>& live = d.log();
    ASSERT_GT(live.size(), 100u);
    EXPECT_GT(std::count_if(live.begin(), live.end(),
                            [](const std::string& l) { return l.starts_with("evict"); }),
              20);
    ASSERT_EQ(live.size(), sim.size()) << "seed " << seed;
    for (size_t i = 0; i < sim.size(); ++i) {
      ASSERT_EQ(live[i], sim[i]) << "seed " << seed << " call " << i;
    }
  }
}

// kvtierd under second-hit admission (SSD tier, durability none): a unit reaches SSD only
// once the turns referenced it twice (a LOOKUP counts the keys from its first miss on, which
// the turn PUTs; a GET counts its keys), never after one reference. Before, the live store
// never counted a reference, so kvtierd under second-hit admitted nothing to SSD.
// The hook sequences are not compared with the simulator's here, as they are without an SSD
// tier above and with one in tests/sim/live_requests_test.cc (LiveVsSim, on the TierManager
// itself): kvtierd answers a GET before that GET's SSD hits are promoted (GetBatchVisit's
// `visited`), and a promotion that finds the store's lock taken is skipped, so the
// promotions' demotions, and the admissions they ask for, interleave with the next calls as
// the threads run. What holds whatever the timing is checked: every unit ever admitted had
// two references among the turns run, and demotions were both admitted and refused.
TEST(DaemonSecondHit, AdmitsToSsdOnlyUnitsReferencedTwice) {
  const uint64_t dram_units = 16;
  DaemonSsd ssd{.capacity_bytes = 3u << 20, .segment_bytes = 1u << 20, .admission = "second-hit"};
  LiveDaemon d(Named("lru"), dram_units, /*auth=*/false, Structure::kPlain, &ssd);
  ASSERT_TRUE(d.ok());
  Trace trace;
  DaemonRun(&d, /*sessions=*/6, /*turns=*/10, /*seed=*/1, &trace, /*record_lookups=*/true,
            /*get_misses_allowed=*/true);
  ASSERT_FALSE(HasFatalFailure());
  const storage::Stats stats = d.stats();
  EXPECT_GT(stats.admissions, 10u);
  EXPECT_GT(stats.admission_rejections, 10u);
  // References per unit: one per lookup record naming it (each turn references each unit of
  // its chain once); dense numbers as the daemon's policies were given them (Note).
  std::unordered_map<uint64_t, int> refs;  // dense number -> references
  std::unordered_map<uint64_t, uint64_t> dense;
  for (const TraceRequest& r : trace.requests) {
    if (r.op != TraceOp::kLookup) continue;
    for (uint32_t i = 0; i < r.num_ids; ++i) {
      const uint64_t id = trace.ids[r.first_id + i];
      ++refs[dense.try_emplace(id, dense.size() + 1).first->second];
    }
  }
  size_t inserted = 0, once = 0;
  for (const auto& [unit, n] : refs) once += n == 1 ? 1 : 0;
  EXPECT_GT(once, 10u) << "the check has teeth: units referenced once were demoted";
  for (const std::string& line : d.ssd_log()) {
    if (!line.starts_with("insert ")) continue;
    ++inserted;
    const uint64_t unit = std::stoull(line.substr(7, line.find(' ', 7) - 7));
    ASSERT_TRUE(refs.count(unit)) << line;
    EXPECT_GE(refs[unit], 2) << "admitted after one reference: " << line;
  }
  EXPECT_EQ(inserted, stats.admissions);
}

INSTANTIATE_TEST_SUITE_P(Policies, DaemonVsSim, ::testing::Values("lru", "long-tail"));

// The same under the prefix layer (eviction_structure prefix, --structure prefix): the same
// calls reach the inner policy and the same units are evicted, in the same order.
class DaemonVsSimPrefix : public ::testing::TestWithParam<std::string> {};

TEST_P(DaemonVsSimPrefix, InterleavedTurnsSameHooksAndVictims) {
  const uint64_t capacity = 24;
  for (uint32_t seed : {1u, 2u}) {
    LiveDaemon d(Named(GetParam()), capacity, /*auth=*/false, Structure::kPrefix);
    ASSERT_TRUE(d.ok());
    Trace trace;
    DaemonRun(&d, /*sessions=*/5, /*turns=*/8, seed, &trace);
    ASSERT_FALSE(HasFatalFailure());
    const std::vector<std::string> sim =
        SimRun(Named(GetParam()), capacity, trace, 0, nullptr, Structure::kPrefix);
    const std::vector<std::string>& live = d.log();
    ASSERT_EQ(live.size(), sim.size()) << "seed " << seed;
    for (size_t i = 0; i < sim.size(); ++i) {
      ASSERT_EQ(live[i], sim[i]) << "seed " << seed << " call " << i;
    }
    std::vector<std::string> live_victims, sim_victims;
    (void)live_test::Cached(live, &live_victims);
    (void)live_test::Cached(sim, &sim_victims);
    EXPECT_GT(live_victims.size(), 20u) << "seed " << seed;
    EXPECT_EQ(live_victims, sim_victims) << "seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, DaemonVsSimPrefix,
                         ::testing::Values("lru", "arc", "s3fifo", "long-tail"));

// The request lines of a hook log, in order ("request t <us>").
std::vector<std::string> RequestLines(const std::vector<std::string>& log) {
  std::vector<std::string> out;
  for (const std::string& l : log) {
    if (l.starts_with("request")) out.push_back(l);
  }
  return out;
}

// A turn id that two tenants (and two connections of one tenant) both use, the largest
// there is, stays three separate requests; the same id on one connection is one request.
TEST(DaemonTurns, HostileTurnIdCannotJoinAnotherTenantsRequest) {
  LiveDaemon d(Named("lru"), 64, /*auth=*/true);
  ASSERT_TRUE(d.ok());
  std::unique_ptr<Client> alice = d.Connect("tok-alice");
  std::unique_ptr<Client> bob = d.Connect("tok-bob");
  std::unique_ptr<Client> alice2 = d.Connect("tok-alice");
  ASSERT_TRUE(alice && bob && alice2);
  constexpr uint64_t kTurn = UINT64_MAX;
  const std::vector<uint8_t> value(kValueBytes, 1);
  auto put = [&](Client* c, uint64_t id) {
    daemon::PutOptions po;
    po.turn = kTurn;
    const Key k = ChainKey(id);
    auto r = c->Put(std::vector<daemon::PutUnit>{{k, Key{}, value}}, po);
    ASSERT_TRUE(r.ok() && (*r)[0].ok());
  };
  d.clock().SetUs(1'000'000);
  put(alice.get(), 1);
  d.clock().SetUs(2'000'000);
  put(bob.get(), 2);
  d.clock().SetUs(3'000'000);
  put(alice2.get(), 3);
  d.clock().SetUs(4'000'000);
  put(alice.get(), 4);  // alice's first connection: the same turn, so her first request
  EXPECT_EQ(RequestLines(d.log()),
            (std::vector<std::string>{"request t 1000000", "request t 2000000", "request t 3000000",
                                      "request t 1000000"}));
  // Every insert carries the time of its own tenant's (connection's) request.
  std::vector<std::string> inserts;
  for (const std::string& l : d.log()) {
    if (l.starts_with("insert")) inserts.push_back(l.substr(l.find(" t ")));
  }
  EXPECT_EQ(inserts,
            (std::vector<std::string>{" t 1000000", " t 2000000", " t 3000000", " t 1000000"}));
}

}  // namespace
}  // namespace kvtier::sim
