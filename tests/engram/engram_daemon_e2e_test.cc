// The whole Engram control and data path with kvtierd: `kvtier engram build`'s export of the
// miniature's tables split across two shards, served by an in-process kvtierd ([engram]);
// the engine asks the daemon for grants (ConnectEngramViaDaemons), reads its rows over the
// TCP row transport, and its logits equal the local table's bit for bit; then it pushes its
// fetch counters (EngramStatsReporter) and kvtierd's /metrics shows them for its tenant.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cache_daemon/daemon.h"
#include "cache_daemon/tenants.h"
#include "common/key_spec.h"
#include "common/temp_dir.h"
#include "engine/config.h"
#include "engine/engram_daemon.h"
#include "engine/engram_export.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "tests/cache_daemon/fake_tier_manager.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

namespace kt = kvtier::testing;

using testutil::MiniConfig;
using testutil::MiniWeights;
using testutil::Prompt;

// Prefill then three decode steps; every logit of every step.
StatusOr<std::vector<float>> RunEngine(EngramRowSource* rows) {
  EngineOptions o;
  o.threads = 2;
  o.engram_rows = rows;
  KVTIER_ASSIGN_OR_RETURN(auto e, Engine::Create(MiniConfig(), MiniWeights(), o));
  SequenceState st = e->NewSequence();
  std::vector<float> all, logits;
  KVTIER_RETURN_IF_ERROR(e->Forward(&st, Prompt(40, 12), true, &logits));
  all.insert(all.end(), logits.begin(), logits.end());
  for (int32_t tok : {5, 77, 42}) {
    KVTIER_RETURN_IF_ERROR(e->Decode(&st, tok, &logits));
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

TEST(EngramDaemonE2eTest, EngineReadsRowsGrantedByKvtierdAndReportsOnMetrics) {
  TempDir dir("kvtier-engram-e2e-");
  ASSERT_TRUE(dir.ok());
  const uint16_t row_port = kt::FreePort(), http_port = kt::FreePort();
  const std::string endpoint = "127.0.0.1:" + std::to_string(row_port);

  EngramExportOptions eo;
  eo.out_dir = dir.File("engram");
  eo.shards = 2;
  eo.endpoints = {endpoint};  // both shards on this daemon
  auto exported = ExportEngramTables(MiniConfig(), *MiniWeights(), eo);
  ASSERT_TRUE(exported.ok()) << exported.status().ToString();

  daemon::DaemonOptions o;
  o.data_dir = dir.File("data");
  std::filesystem::create_directories(o.data_dir);
  o.socket_path = dir.File("d.sock");
  o.resp_port = 0;
  o.http_port = http_port;
  o.tokens_file = "inline";
  o.engram.enabled = true;
  o.engram.listen = endpoint;
  o.engram.dir = eo.out_dir;
  ASSERT_TRUE(daemon::Finalize(&o).ok());
  auto tenants = daemon::TenantRegistry::Parse(
      "[[tenant]]\nname = \"agents\"\nid = 1\nadmin = true\ntoken_sha256 = [\"" +
          TokenSha256Hex("tok-agents") + "\"]\n",
      std::vector<uint8_t>(32, 3));
  ASSERT_TRUE(tenants.ok()) << tenants.status().ToString();
  auto d = daemon::Daemon::Start(o, std::make_unique<kt::FakeTierManager>(), std::move(*tenants),
                                 nullptr);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::unique_ptr<daemon::Daemon> kvtierd = std::move(*d);

  daemon::ClientOptions co;
  co.socket_path = o.socket_path;
  co.token = "tok-agents";
  co.shm_bytes = 0;
  auto client = daemon::Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status().ToString();

  auto local = RunEngine(nullptr);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  {
    daemon::Client* daemons[] = {client->get()};
    auto rows = ConnectEngramViaDaemons(daemons, MiniConfig(), RemoteEngramOptions{});
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    auto remote = RunEngine(rows->get());
    ASSERT_TRUE(remote.ok()) << remote.status().ToString();
    ASSERT_EQ(local->size(), remote->size());
    EXPECT_EQ(std::memcmp(local->data(), remote->data(), local->size() * sizeof(float)), 0);

    const RemoteEngramStats stats = (*rows)->stats();
    ASSERT_GT(stats.fetch.rows_read, 0u);
    EngramStatsReporter reporter;
    // kAuto: "tcp" here (no RDMA device); "verbs" where the host has one.
    const std::string transport = (*rows)->transport_name();
    ASSERT_TRUE(transport == "tcp" || transport == "verbs") << transport;
    ASSERT_TRUE(reporter.Report(**client, **rows).ok());
    // A second report with nothing new adds nothing (deltas, not totals).
    ASSERT_TRUE(reporter.Report(**client, **rows).ok());
    // Series with a tenant label need an admin token.
    const std::string metrics =
        kt::HttpRequest(http_port, "GET", "/metrics", "", "Authorization: Bearer tok-agents\r\n");
    const std::string want = "kvtier_engram_fetch_rows_requested_total{tenant=\"agents\"," +
                             std::string("transport=\"") + transport + "\"} " +
                             std::to_string(stats.fetch.rows_requested) + "\n";
    EXPECT_NE(metrics.find(want), std::string::npos) << want << "\n" << metrics;
    // The embedded row server counted what the engine read (over TCP).
    if (transport == "tcp") {
      EXPECT_NE(metrics.find("kvtier_engram_server_ops_total{transport=\"tcp\"} " +
                             std::to_string(stats.fetch.rows_read) + "\n"),
                std::string::npos)
          << metrics;
    }
  }

  kvtierd->Shutdown();
  EXPECT_TRUE(kvtierd->Wait().ok());
}

TEST(EngramDaemonE2eTest, NoDaemonsOrNoEngramIsInvalidArgument) {
  std::span<daemon::Client* const> none;
  auto r = ConnectEngramViaDaemons(none, MiniConfig(), RemoteEngramOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EngineConfig no_engram = MiniConfig();
  no_engram.engram_layer_ids.clear();
  daemon::Client* null_client[] = {nullptr};
  r = ConnectEngramViaDaemons(null_client, no_engram, RemoteEngramOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::engine
