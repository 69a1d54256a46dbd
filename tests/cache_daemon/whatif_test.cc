// What-if curves (cache_daemon/whatif.h): the trace window's bounds, the background engine,
// and the curves against `kvtier sim` run on the trace file the same TraceWriter recorded.
#include "cache_daemon/whatif.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cache_daemon/trace_window.h"
#include "cache_daemon/trace_writer.h"
#include "tests/common/run_kvtier.h"

namespace kvtier::daemon {
namespace {

// A deterministic agent-like workload: prefix chains of 40 conversations with skewed
// popularity, mostly reads, some puts and deletes; a tenth are RESP values.
void RecordWorkload(TraceWriter* w, int requests) {
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint64_t>> convs(40);
  for (size_t c = 0; c < convs.size(); ++c) {
    for (int i = 0; i < 12; ++i) convs[c].push_back(1000 * (c + 1) + i);
  }
  for (int i = 0; i < requests; ++i) {
    if (rng() % 10 == 0) {  // a RESP SET/GET: one key, no prompt tokens (unit_tokens 0)
      TraceRecord r;
      r.op = rng() % 2 ? "get" : "put";
      r.tenant = 2;
      r.ids = {900000 + rng() % 30};
      r.bytes = 4096;
      r.unit_tokens = 0;
      w->Record(std::move(r));
      continue;
    }
    // Skewed: conversation index is the min of two uniforms.
    size_t c = std::min(rng() % convs.size(), rng() % convs.size());
    size_t len = 1 + rng() % convs[c].size();
    TraceRecord r;
    uint64_t op = rng() % 20;
    r.op = op < 16 ? "get" : op < 19 ? "put" : "delete";
    r.tenant = 1;
    r.ids.assign(convs[c].begin(), convs[c].begin() + static_cast<long>(len));
    r.bytes = 4096 * len;
    r.unit_tokens = 64;
    w->Record(std::move(r));
  }
}

TEST(TraceWindow, KeepsTheNewestLinesWithinBothLimits) {
  TraceWindow w(TraceWindowLimits{3, 1000});
  for (int i = 0; i < 5; ++i) w.Append("line" + std::to_string(i));
  TraceWindow::Snapshot s = w.Take();
  EXPECT_EQ(s.text, "line2\nline3\nline4\n");
  EXPECT_EQ(s.records, 3u);
  EXPECT_EQ(s.appended, 5u);
  EXPECT_EQ(s.dropped, 2u);

  TraceWindow b(TraceWindowLimits{100, 12});  // two 5-byte lines + newlines fit, not three
  for (int i = 0; i < 3; ++i) b.Append("abcd" + std::to_string(i));
  EXPECT_EQ(b.Take().text, "abcd1\nabcd2\n");
  b.Append(std::string(12, 'x'));  // longer than the whole window with its newline
  EXPECT_EQ(b.Take().text, "abcd1\nabcd2\n");
  EXPECT_EQ(b.Take().dropped, 2u);
}

TEST(WhatIf, MalformedWindowIsAnError) {
  EXPECT_EQ(ComputeWhatIf("not json\n", {"lru", 1 << 20}).status().code(),
            StatusCode::kInvalidArgument);
  StatusOr<WhatIfResult> empty = ComputeWhatIf("", {"lru", 1 << 20});
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->capacity_units.empty());
}

TEST(WhatIf, CurvesMatchKvtierSimOnTheRecordedFile) {
  auto path = std::filesystem::temp_directory_path() /
              ("kvtier_whatif_" + std::to_string(getpid()) + ".jsonl.zst");
  auto w = TraceWriter::Open(path.string(), 1 << 16, TraceWindowLimits{100000, 16u << 20});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  RecordWorkload(w->get(), 3000);
  ASSERT_TRUE((*w)->Close().ok());
  ASSERT_EQ((*w)->dropped(), 0u);
  TraceWindow::Snapshot snap = (*w)->window()->Take();
  ASSERT_EQ(snap.records, 3000u);
  ASSERT_EQ(snap.dropped, 0u);  // the window holds the whole file

  // Live DRAM: 30 units of 4096 bytes.
  StatusOr<WhatIfResult> r = ComputeWhatIf(snap.text, {"s3fifo", 30 * 4096});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->records, 3000u);
  EXPECT_EQ(r->live_capacity_units, 30u);
  EXPECT_NE(std::find(r->capacity_units.begin(), r->capacity_units.end(), 30u),
            r->capacity_units.end());
  ASSERT_GE(r->capacity_units.size(), 5u);
  ASSERT_EQ(r->curves.size(), WhatIfPolicies().size());

  std::string policies, caps;
  for (const WhatIfCurve& c : r->curves) {
    EXPECT_EQ(c.error, "") << c.policy;
    ASSERT_EQ(c.miss_ratio.size(), r->capacity_units.size()) << c.policy;
    policies += (policies.empty() ? "" : ",") + c.policy;
  }
  for (uint64_t c : r->capacity_units) caps += (caps.empty() ? "" : ",") + std::to_string(c);
  testing::KvtierResult sim =
      testing::RunKvtier("sim --trace " + path.string() + " --policy " + policies +
                         " --capacity-units " + caps + " --json --no-progress");
  ASSERT_EQ(sim.exit_code, 0) << sim.out;
  // stderr is merged into out; the JSON document starts at the first '{'.
  nlohmann::json j = nlohmann::json::parse(sim.out.substr(sim.out.find('{')));
  size_t compared = 0;
  for (const auto& row : j["results"]) {
    const std::string policy = row["policy"];
    const uint64_t cap = row["capacity_blocks"];
    auto curve = std::find_if(r->curves.begin(), r->curves.end(),
                              [&](const WhatIfCurve& c) { return c.policy == policy; });
    ASSERT_NE(curve, r->curves.end()) << policy;
    size_t i = std::find(r->capacity_units.begin(), r->capacity_units.end(), cap) -
               r->capacity_units.begin();
    ASSERT_LT(i, r->capacity_units.size()) << cap;
    EXPECT_EQ(curve->miss_ratio[i], row["block_miss_ratio"].get<double>())
        << policy << " at " << cap << " units";
    ++compared;
  }
  EXPECT_EQ(compared, r->curves.size() * r->capacity_units.size());
  // Not a flat answer: a larger cache misses less under LRU on this workload.
  const WhatIfCurve& lru = *std::find_if(r->curves.begin(), r->curves.end(),
                                         [](const WhatIfCurve& c) { return c.policy == "lru"; });
  EXPECT_GT(lru.miss_ratio.front(), lru.miss_ratio.back());
  std::filesystem::remove(path);
}

TEST(WhatIf, BackgroundEngineComputesAfterTraffic) {
  TraceWindow window(TraceWindowLimits{1000, 1 << 20});
  WhatIf engine(&window, WhatIfOptions{.interval_ms = 100}, [] {
    return WhatIfLive{"lru", 8 * 4096};
  });
  nlohmann::json j = nlohmann::json::parse(engine.Json());
  EXPECT_EQ(j["state"], "pending");
  for (int i = 0; i < 50; ++i) {
    window.Append(TraceWriter::FormatLine(
        TraceRecord{static_cast<uint64_t>(i), "get", 1, {uint64_t(i % 7), 100}, 8192, 64}));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (j["state"] == "pending" && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    j = nlohmann::json::parse(engine.Json());
  }
  ASSERT_EQ(j["state"], "ready") << j.dump();
  EXPECT_GE(j["seq"].get<uint64_t>(), 1u);
  EXPECT_EQ(j["window"]["records"], 50);
  EXPECT_EQ(j["live"]["policy"], "lru");
  EXPECT_EQ(j["live"]["capacity_units"], 8);  // 8 * 4096 bytes / 4096-byte units (8192 / 2 ids)
  EXPECT_EQ(j["curves"].size(), WhatIfPolicies().size());
  EXPECT_EQ(j["curves"][0]["miss_ratio"].size(), j["capacity_units"].size());
}

}  // namespace
}  // namespace kvtier::daemon
