#include <gtest/gtest.h>
#include <zstd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "sim/generator.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/trace.h"

namespace kvtier::sim {
namespace {

// Two requests sharing a 2-block prefix; the second request's third block is new.
constexpr const char* kTiny =
    "{\"timestamp\":0,\"input_length\":1500,\"output_length\":5,\"hash_ids\":[1,2,3]}\n"
    "{\"timestamp\":10,\"input_length\":1100,\"output_length\":5,\"hash_ids\":[1,2,4]}\n"
    "{\"timestamp\":20,\"input_length\":1024,\"output_length\":5,\"hash_ids\":[9,2]}\n";

UnitTrace Units(const std::string& text, UnitMapping m = {}) {
  auto t = ParseTrace(text);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  auto u = BuildUnitTrace(*t, m);
  EXPECT_TRUE(u.ok()) << u.status().ToString();
  return *u;
}

TEST(SimTrace, MooncakeParsesAndRejectsGarbage) {
  auto t = ParseTrace(kTiny);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->format, TraceFormat::kMooncake);
  ASSERT_EQ(t->requests.size(), 3u);
  EXPECT_EQ(t->requests[1].ts_ms, 10u);
  EXPECT_EQ(t->ids.size(), 8u);
  EXPECT_TRUE(ParseTrace("{\"timestamp\":0,\"input_length\":5}\n").status().IsInvalidArgument());
  EXPECT_TRUE(ParseTrace("not json\n").status().IsInvalidArgument());
  EXPECT_TRUE(ParseTrace("{\"timestamp\":-1,\"input_length\":5,\"hash_ids\":[]}")
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(LoadTrace("/nonexistent/trace.jsonl").status().IsNotFound());
}

TEST(SimTrace, KvtierFormatPlainAndZstd) {
  std::string text =
      "{\"ts_ms\":0,\"op\":\"put\",\"tenant\":1,\"ids\":[11,12],\"bytes\":200,\"unit_tokens\":64}\n"
      "{\"ts_ms\":5,\"op\":\"lookup\",\"tenant\":1,\"ids\":[11,12,13],\"bytes\":300,"
      "\"unit_tokens\":64}\n"
      "{\"ts_ms\":6,\"op\":\"delete\",\"tenant\":1,\"ids\":[12],\"bytes\":100,\"unit_tokens\":64}\n"
      "{\"ts_ms\":7,\"op\":\"get\",\"tenant\":1,\"ids\":[11,12],\"bytes\":200,\"unit_tokens\":64}"
      "\n";
  auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_sim_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string compressed(ZSTD_compressBound(text.size()), '\0');
  size_t n = ZSTD_compress(compressed.data(), compressed.size(), text.data(), text.size(), 3);
  ASSERT_FALSE(ZSTD_isError(n));
  std::string path = (dir / "t.jsonl.zst").string();
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(compressed.data(), 1, n, f);
  std::fclose(f);
  auto t = LoadTrace(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->format, TraceFormat::kKvtier);
  ASSERT_EQ(t->requests.size(), 4u);
  EXPECT_EQ(t->requests[2].op, TraceOp::kDelete);
  auto u = BuildUnitTrace(*t);
  ASSERT_TRUE(u.ok());
  SimOptions o;
  o.dram_capacity_units = 10;
  auto r = Simulate(*u, o);
  ASSERT_TRUE(r.ok());
  // lookup: 11, 12 hit (put), 13 misses; delete 12; get: 11 hits, 12 misses.
  EXPECT_EQ(r->read_refs, 5u);
  EXPECT_EQ(r->misses, 2u);
  EXPECT_EQ(r->prefix_hit_tokens, 64u * 3);
  // A truncated zstd stream is Corruption, not a silently short trace.
  f = std::fopen(path.c_str(), "wb");
  std::fwrite(compressed.data(), 1, n / 2, f);
  std::fclose(f);
  EXPECT_FALSE(LoadTrace(path).ok());
  std::filesystem::remove_all(dir);
}

// Records sharing a "request" id are one request: timed by the first, and the first id of a
// later record is chained to the last id of the request's earlier record.
TEST(SimTrace, KvtierRequestIdsJoinRecords) {
  const std::string text =
      "{\"ts_ms\":10,\"op\":\"get\",\"tenant\":1,\"ids\":[11,12],\"bytes\":200,"
      "\"unit_tokens\":64,\"request\":5}\n"
      "{\"ts_ms\":11,\"op\":\"put\",\"tenant\":1,\"ids\":[21],\"bytes\":100,"
      "\"unit_tokens\":64}\n"
      "{\"ts_ms\":30,\"op\":\"put\",\"tenant\":1,\"ids\":[13],\"bytes\":100,"
      "\"unit_tokens\":64,\"request\":5}\n";
  UnitTrace u = Units(text);
  ASSERT_EQ(u.requests.size(), 3u);
  EXPECT_EQ(u.requests[2].ts_ms, 10u);  // the request's first record's time
  EXPECT_EQ(u.parent[3], 2u);           // id 13 (unit 3) under id 12 (unit 1, + 1)
  EXPECT_EQ(u.parent[2], 0u);           // id 21: its own request, a root
  auto r = Simulate(u, SimOptions{.dram_capacity_units = 8});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->requests, 3u);  // get(5), put, put(5) resumes: told again
  EXPECT_TRUE(ParseTrace("{\"ts_ms\":0,\"op\":\"get\",\"tenant\":1,\"ids\":[1],\"bytes\":1,"
                         "\"unit_tokens\":64,\"request\":-1}\n")
                  .status()
                  .IsInvalidArgument());
}

TEST(Sim, PrefixTokensCountOnlyTheLeadingRun) {
  UnitTrace u = Units(kTiny);
  EXPECT_EQ(u.unique_units, 5u);
  SimOptions o;
  o.dram_capacity_units = 100;
  auto r = Simulate(u, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->read_refs, 8u);
  EXPECT_EQ(r->misses, 5u);  // 1,2,3,4,9 first references
  // Request 2 hits blocks 1,2 (1024 tokens); request 3 misses 9, so its hit on 2 is useless.
  EXPECT_EQ(r->prefix_hit_tokens, 1024u);
  EXPECT_EQ(r->input_tokens, 1500u + 1100u + 1024u);
  EXPECT_NEAR(r->prefix_token_hit_ratio, 1024.0 / 3624.0, 1e-12);
  // Money: saved = hit tokens x (uncached - 2% of uncached).
  EXPECT_NEAR(r->money_saved_usd, 1024 * 0.28 * 0.98 / 1e6, 1e-12);
}

TEST(Sim, UnitMappingSplitsAndGroupsBlocks) {
  UnitTrace split = Units(kTiny, {.unit_tokens = 256});
  // Request 1: 1500 tokens = blocks of 512, 512, 476 -> 2 + 2 + 2 units (476 > 256).
  EXPECT_EQ(split.requests[0].num_refs, 6u);
  EXPECT_EQ(split.tokens[5], 476u - 256u);
  UnitTrace grouped = Units(kTiny, {.unit_tokens = 1024});
  EXPECT_EQ(grouped.requests[0].num_refs, 2u);  // [1,2] and the trailing [3]
  auto t = ParseTrace(kTiny);
  EXPECT_TRUE(BuildUnitTrace(*t, {.unit_tokens = 300}).status().IsInvalidArgument());
}

TEST(Sim, SsdTierAdmissionAndWrites) {
  // Cycle through 6 blocks with DRAM 2 and SSD 10: after the first lap every read is an SSD
  // hit, and each block is written to SSD once.
  std::string text;
  for (int lap = 0; lap < 3; ++lap) {
    for (int b = 0; b < 6; ++b) {
      text += "{\"timestamp\":" + std::to_string(lap * 10 + b) +
              ",\"input_length\":512,\"hash_ids\":[" + std::to_string(b) + "]}\n";
    }
  }
  UnitTrace u = Units(text);
  SimOptions o;
  o.dram_capacity_units = 2;
  o.ssd_capacity_units = 10;
  auto r = Simulate(u, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->misses, 6u);
  EXPECT_EQ(r->ssd_hits, 12u);
  EXPECT_EQ(r->ssd_admitted, 6u);
  EXPECT_EQ(r->ssd_bytes_written, 6u * 512 * 890);
  // second-hit admission refuses first-time demotions.
  o.admission = "second-hit";
  r = Simulate(u, o);
  ASSERT_TRUE(r.ok());
  EXPECT_GT(r->ssd_rejected, 0u);
  EXPECT_LT(r->ssd_hits, 12u);
  // A 1-unit/day write budget admits exactly one unit.
  o.admission = "write-budget";
  o.admission_params.values = {{"bytes_per_day", std::to_string(512 * 890)}};
  r = Simulate(u, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ssd_admitted, 1u);
  EXPECT_EQ(r->ssd_bytes_written, 512u * 890);
  o.policy = "no-such-policy";
  EXPECT_TRUE(Simulate(u, o).status().IsInvalidArgument());
}

TEST(Sim, JsonAndCurves) {
  UnitTrace u = Units(kTiny);
  SimOptions o;
  o.dram_capacity_units = 1;
  auto r = Simulate(u, o);
  ASSERT_TRUE(r.ok());
  std::vector<ReportRow> rows = {{*r, 0.2}};
  auto j = nlohmann::json::parse(FormatJson(rows, "x"));
  ASSERT_EQ(j["results"].size(), 1u);
  EXPECT_EQ(j["results"][0]["policy"], "lru");
  EXPECT_EQ(j["results"][0]["capacity_blocks"], 1);
  EXPECT_DOUBLE_EQ(j["results"][0]["block_miss_ratio"].get<double>(), r->block_miss_ratio);
  EXPECT_TRUE(j["results"][0].contains("prefix_token_hit_ratio"));
  EXPECT_NE(FormatSvg(rows, "t").find("<polyline"), std::string::npos);
  EXPECT_NE(FormatSvg(rows, "t", CurveMetric::kPrefixTokenHitRatio).find("prefix-token hit ratio"),
            std::string::npos);
  EXPECT_NE(FormatCsv(rows).find("lru,0.200000,1,"), std::string::npos);
}

// The prefix structure: a partial unit is never cached, so a later request that extends it to a
// whole block misses it; plain replay caches it and hits.
TEST(SimPrefix, PartialUnitsAreNeverCached) {
  const std::string text = std::string(kTiny) +
                           "{\"timestamp\":30,\"input_length\":1536,\"output_length\":5,"
                           "\"hash_ids\":[1,2,3]}\n";
  UnitTrace u = Units(text);
  SimOptions o;
  o.dram_capacity_units = 10;
  auto plain = Simulate(u, o);
  o.structure = Structure::kPrefix;
  auto prefix = Simulate(u, o);
  ASSERT_TRUE(plain.ok() && prefix.ok());
  // Plain: 1,2,3 miss; 1,2 hit, 4 miss; 9 miss, 2 hit; 1,2,3 hit.
  EXPECT_EQ(plain->misses, 5u);
  // Prefix: 3 (476 tokens) and 4 (76 tokens) are partial; request 4's whole block 3 misses.
  EXPECT_EQ(prefix->partial_refs, 2u);
  EXPECT_EQ(prefix->misses, 6u);
  EXPECT_EQ(prefix->prefix_hit_tokens, plain->prefix_hit_tokens - 512);
}

// Leaf-first: FIFO would evict root 1 while its child 2 stays cached; the layer evicts 2
// instead, so the next [1,2] request still hits its first block.
TEST(SimPrefix, VictimWithCachedChildrenIsSwappedForItsDeepestLeaf) {
  const std::string text =
      "{\"timestamp\":0,\"input_length\":512,\"output_length\":1,\"hash_ids\":[1]}\n"
      "{\"timestamp\":1,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[1,2]}\n"
      "{\"timestamp\":2,\"input_length\":512,\"output_length\":1,\"hash_ids\":[8]}\n"
      "{\"timestamp\":3,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[1,2]}\n";
  UnitTrace u = Units(text);
  SimOptions o;
  o.policy = "fifo";
  o.dram_capacity_units = 2;
  auto plain = Simulate(u, o);
  o.structure = Structure::kPrefix;
  auto prefix = Simulate(u, o);
  ASSERT_TRUE(plain.ok() && prefix.ok());
  EXPECT_EQ(plain->prefix_hit_tokens, 512u);  // request 2's 1; request 4 misses 1 (and 2)
  EXPECT_EQ(prefix->leaf_swaps, 1u);
  EXPECT_EQ(prefix->unusable_hits, 0u);
  EXPECT_EQ(prefix->prefix_hit_tokens, 512u + 512u);  // request 2's 1, request 4's 1
}

// A running request holds its units: FIFO's victim would be block 1, which the request [1,2]
// just hit; it is given back and the next-oldest unit (5) goes instead.
TEST(SimPrefix, TheRunningRequestsUnitsAreGivenBack) {
  const std::string text =
      "{\"timestamp\":0,\"input_length\":512,\"output_length\":1,\"hash_ids\":[1]}\n"
      "{\"timestamp\":1,\"input_length\":512,\"output_length\":1,\"hash_ids\":[5]}\n"
      "{\"timestamp\":2,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[1,2]}\n"
      "{\"timestamp\":3,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[1,2]}\n";
  UnitTrace u = Units(text);
  SimOptions o;
  o.policy = "fifo";
  o.dram_capacity_units = 2;
  o.structure = Structure::kPrefix;
  auto r = Simulate(u, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->prefix_hit_tokens, 512u + 1024u);
  EXPECT_EQ(r->orphans_dropped, 0u);
}

// Under the prefix structure what stays cached is closed under prefixes, whatever the policy:
// no hit ever follows a miss in the same request (the generator's chains are consistent).
TEST(SimPrefix, NoPolicyKeepsAUnitWithoutItsPrefix) {
  GeneratorOptions g;
  g.sessions = 150;
  g.days = 1;
  auto gen = GenerateAgentTrace(g);
  ASSERT_TRUE(gen.ok());
  UnitTrace u = Units(gen->jsonl);
  bool plain_unusable = false;
  for (const char* policy : {"lru", "fifo", "arc", "s3fifo", "sieve", "gdsf", "long-tail"}) {
    SimOptions o;
    o.policy = policy;
    o.dram_capacity_units = u.unique_units / 20;
    auto plain = Simulate(u, o);
    o.structure = Structure::kPrefix;
    auto prefix = Simulate(u, o);
    ASSERT_TRUE(plain.ok() && prefix.ok()) << policy;
    plain_unusable |= plain->unusable_hits > 0;
    EXPECT_EQ(prefix->unusable_hits, 0u) << policy;
    EXPECT_GT(prefix->prefix_hit_tokens, 0u) << policy;
  }
  EXPECT_TRUE(plain_unusable);  // the structure is what makes the difference
}

// Recompute cost grows with depth: attention over a longer prefix.
TEST(SimTrace, RecomputeCostGrowsWithDepth) {
  UnitTrace u = Units(kTiny);
  ASSERT_GE(u.recompute_tokens.size(), 3u);
  EXPECT_EQ(u.recompute_tokens[0], 512u);                       // root: no prefix
  EXPECT_EQ(u.recompute_tokens[1], 512u + 512u * 512 / 32768);  // after 512 tokens
  EXPECT_GT(u.recompute_tokens[2], u.recompute_tokens[1]);
}

TEST(SimGen, DeterministicMultiDayAndReplayable) {
  GeneratorOptions o;
  o.sessions = 300;
  o.days = 3;
  auto a = GenerateAgentTrace(o);
  auto b = GenerateAgentTrace(o);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->jsonl, b->jsonl);
  o.seed = 2;
  EXPECT_NE(GenerateAgentTrace(o)->jsonl, a->jsonl);
  auto t = ParseTrace(a->jsonl);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->requests.size(), a->requests);
  uint64_t last = 0, max_gap_ms = 0;
  for (const auto& r : t->requests) {
    EXPECT_GE(r.ts_ms, last);  // sorted
    last = r.ts_ms;
  }
  EXPECT_GT(last, 24ull * 3600 * 1000);  // spans more than a day
  (void)max_gap_ms;
  auto u = BuildUnitTrace(*t);
  ASSERT_TRUE(u.ok());
  SimOptions so;
  so.dram_capacity_units = u->unique_units / 10;
  auto r = Simulate(*u, so);
  ASSERT_TRUE(r.ok());
  EXPECT_LT(r->block_miss_ratio, 1.0);  // shared prompts and resumed sessions do hit
  o.p_minutes = 0.9;
  o.p_hours = 0.2;
  EXPECT_TRUE(GenerateAgentTrace(o).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::sim
