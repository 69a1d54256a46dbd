// A trace recorded by the real kvtierd ([trace] path) from engine-like turns (LOOKUP of a
// session's chain, GET of the hits, PUT of the misses, one turn id each, sessions interleaved),
// replayed by the simulator with the daemon's DRAM capacity and policy: the replay counts what
// the daemon saw (each turn N references, H hits, N-H misses; the daemon's own DRAM hit count)
// and knows every unit's size (so `kvtier sim --capacity-bytes` sizes the tier).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "sim/simulator.h"
#include "sim/trace.h"
#include "tests/e2e/kvtierd_process.h"

namespace kvtier::sim {
namespace {

namespace kt = kvtier::testing;
using daemon::Client;
using daemon::wire::Key;

constexpr uint64_t kValueBytes = 4096;
constexpr uint64_t kDramUnits = 24;  // dram_objects_max: LRU capacity in units, exactly

Key ChainKey(uint64_t id) {
  Key k{};
  for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>(id >> (8 * i));
  k[31] = 0x5a;
  return k;
}

// A sample's value in a /metrics page (-1 when absent).
double Sample(const std::string& page, const std::string& series) {
  const size_t at = page.find("\n" + series + " ");
  return at == std::string::npos ? -1 : std::stod(page.substr(at + series.size() + 2));
}

// Before: the daemon wrote no request id (a turn replayed as three requests) and a LOOKUP with
// bytes 0; the simulator replayed the lookup as a read that inserted its misses and then counted
// the GET's hits again (twice the daemon's hits; miss ratio (N-H)/(N+H)), and took every unit's
// size from its first record, the lookup: 0 bytes, so a --capacity-bytes run had no capacity.
TEST(DaemonTrace, ReplayCountsWhatTheDaemonSaw) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("kvtier_daemon_trace_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  kt::KvtierdProcess d(dir);
  const std::string trace_path = (dir / "trace.jsonl.zst").string();
  d.WriteConfig("[storage]\ndram_capacity_bytes = 16777216\ndram_objects_max = " +
                std::to_string(kDramUnits) + "\nssd_capacity_bytes = 0\n[trace]\npath = \"" +
                trace_path + "\"\n");
  ASSERT_TRUE(d.Start()) << d.Log();
  daemon::ClientOptions co;
  co.socket_path = d.socket();
  co.unit_tokens = 64;
  auto c = Client::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  constexpr int kSessions = 6, kTurns = 8;
  std::mt19937 rng(7);
  std::vector<std::vector<Key>> chain(kSessions);
  std::vector<int> turns_done(kSessions, 0);
  struct Open {
    uint64_t turn = 0;
    size_t hits = 0;
  };
  std::vector<std::optional<Open>> open(kSessions);
  uint64_t refs = 0, hits = 0, turns = 0;
  const std::vector<uint8_t> value(kValueBytes, 3);
  for (int left = kSessions * kTurns; left > 0;) {
    const int s = static_cast<int>(rng() % kSessions);
    if (!open[s]) {  // a turn begins: the prompt grows, LOOKUP, GET the hits
      if (turns_done[s] == kTurns) continue;
      for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i) {
        chain[s].push_back(ChainKey(1000ull * (s + 1) + chain[s].size() + 1));
      }
      const uint64_t turn = (*c)->NewTurn();
      auto lk = (*c)->Lookup(chain[s], turn);
      ASSERT_TRUE(lk.ok()) << lk.status().ToString();
      refs += chain[s].size();
      hits += lk->hit_count;
      if (lk->hit_count > 0) {
        std::vector<Key> got(chain[s].begin(), chain[s].begin() + lk->hit_count);
        ASSERT_TRUE((*c)->Get(got, turn,
                              [](size_t, const daemon::GetItem& g) {
                                EXPECT_TRUE(g.status.ok()) << g.status.ToString();
                              })
                        .ok());
      }
      open[s] = Open{turn, lk->hit_count};
      continue;
    }
    // The turn ends: PUT what the lookup missed (the engine computed it).
    std::vector<daemon::PutUnit> units;
    for (size_t i = open[s]->hits; i < chain[s].size(); ++i) {
      units.push_back({chain[s][i], i > 0 ? chain[s][i - 1] : Key{}, value});
    }
    daemon::PutOptions po;
    po.turn = open[s]->turn;
    auto put = (*c)->Put(units, po);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    open[s].reset();
    ++turns_done[s];
    ++turns;
    --left;
  }
  const std::string metrics = kt::HttpRequest(d.http_port(), "GET", "/metrics");
  const double daemon_hits = Sample(metrics, "kvtier_tier_hits_total{tier=\"dram\"}");
  ASSERT_GT(daemon_hits, 0) << metrics.substr(0, 3000);
  ASSERT_EQ(daemon_hits, static_cast<double>(hits));  // no unit was evicted between LOOKUP and GET
  ASSERT_GT(Sample(metrics, "kvtier_tier_evictions_total{tier=\"dram\"}"), 0);
  c->reset();
  ASSERT_EQ(d.Stop(), 0) << d.Log();  // the trace file is complete

  auto trace = LoadTrace(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  // Every record carries its turn's request id: 3 records per turn with hits, 2 without, one
  // request id per turn.
  std::set<uint64_t> request_ids;
  for (const TraceRequest& r : trace->requests) {
    EXPECT_NE(r.request, 0u);
    request_ids.insert(r.request);
  }
  EXPECT_EQ(request_ids.size(), turns);
  auto units = BuildUnitTrace(*trace);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  for (uint64_t size : units->size_bytes) EXPECT_EQ(size, kValueBytes);
  ASSERT_EQ(units->unit_bytes, kValueBytes);
  // What `kvtier sim --capacity-bytes` does with the daemon's DRAM bytes in units of this size.
  SimOptions o;
  o.policy = "lru";
  o.dram_capacity_units = kDramUnits * kValueBytes / units->unit_bytes;
  auto r = Simulate(*units, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->read_refs, refs);
  EXPECT_EQ(r->dram_hits, hits);
  EXPECT_EQ(r->misses, refs - hits);
  EXPECT_DOUBLE_EQ(r->block_miss_ratio,
                   static_cast<double>(refs - hits) / static_cast<double>(refs));
  EXPECT_GT(r->prefix_hit_tokens, 0u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::sim
