// kvtierd's [engram] table: parsing, Finalize() validation (each bad case), the auth rule
// for a non-loopback engram.listen, and file:line in errors. Also the ENGRAM_GRANT /
// ENGRAM_REPORT body codecs and the per-(tenant, transport) fetch metrics.
#include <gtest/gtest.h>

#include <fstream>

#include "cache_daemon/config.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/wire.h"
#include "common/temp_dir.h"

namespace kvtier::daemon {
namespace {

// A minimal enabled [engram] table followed by `extra` lines.
StatusOr<DaemonOptions> Engram(const std::string& extra, const std::string& auth = "") {
  std::string text = auth + "[engram]\nenabled = true\ndir = \"/srv/engram\"\n" + extra;
  KVTIER_ASSIGN_OR_RETURN(DaemonOptions o, ParseConfig(text));
  o.data_dir = "/tmp/kvtier-engram-config-test";
  KVTIER_RETURN_IF_ERROR(Finalize(&o));
  return o;
}

TEST(EngramConfig, DefaultsAreOffAndEveryKeyParses) {
  auto off = ParseConfig("");
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->engram.enabled);
  DaemonOptions d = *off;
  ASSERT_TRUE(Finalize(&d).ok());  // disabled: nothing else is checked

  auto o = Engram(
      "listen = \"127.0.0.1:7400\"\nadvertise = \"10.0.0.5:7400\"\ngrant_ttl_ms = 5000\n"
      "grant_ttl_ms_max = 60000\ngrants_max = 100\ngrants_per_tenant_max = 10\n"
      "connections_max = 7\nregions_per_connection_max = 3\nbatch_ops_max = 512\n"
      "read_bytes_max = 4096\nresponse_bytes_max = 8192\nverbs_path_mtu_max_bytes = 1024\n"
      "verbs_rd_atomic_max = 4\nverbs_gid_index = 3\nverbs_registrations_max = 9\n");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const EngramServeOptions& e = o->engram;
  EXPECT_TRUE(e.enabled);
  EXPECT_EQ(e.dir, "/srv/engram");
  EXPECT_EQ(e.listen_host, "127.0.0.1");
  EXPECT_EQ(e.listen_port, 7400);
  EXPECT_EQ(e.advertise, "10.0.0.5:7400");
  EXPECT_EQ(e.grant_ttl_ms, 5000u);
  EXPECT_EQ(e.grant_ttl_ms_max, 60000u);
  EXPECT_EQ(e.grants_max, 100u);
  EXPECT_EQ(e.grants_per_tenant_max, 10u);
  EXPECT_EQ(e.connections_max, 7u);
  EXPECT_EQ(e.regions_per_connection_max, 3u);
  EXPECT_EQ(e.batch_ops_max, 512u);
  EXPECT_EQ(e.read_bytes_max, 4096u);
  EXPECT_EQ(e.response_bytes_max, 8192u);
  EXPECT_EQ(e.verbs_path_mtu_max_bytes, 1024u);
  EXPECT_EQ(e.verbs_rd_atomic_max, 4u);
  EXPECT_EQ(e.verbs_gid_index, 3u);
  EXPECT_EQ(e.verbs_registrations_max, 9u);

  auto dflt = Engram("");
  ASSERT_TRUE(dflt.ok()) << dflt.status().ToString();
  EXPECT_EQ(dflt->engram.advertise, "127.0.0.1:7301");  // advertise defaults to listen
  EXPECT_EQ(dflt->engram.listen_port, 7301);
}

TEST(EngramConfig, EachBadValueIsRefusedNamingTheKey) {
  struct Case {
    std::string extra, key;
  };
  const Case cases[] = {
      {"listen = \"nope\"\n", "engram.listen"},
      {"listen = \"127.0.0.1:0\"\n", "engram.listen"},
      {"listen = \"127.0.0.1:70000\"\n", "engram.listen"},
      {"advertise = \"host-without-port\"\n", "engram.advertise"},
      {"grant_ttl_ms = 0\n", "engram.grant_ttl_ms"},
      {"grant_ttl_ms = 7200000\n", "engram.grant_ttl_ms"},  // over the default max (1 h)
      {"grant_ttl_ms_max = 0\n", "engram.grant_ttl_ms_max"},
      {"grant_ttl_ms_max = 86400001\n", "engram.grant_ttl_ms_max"},
      {"grants_max = 0\n", "engram.grants_max"},
      {"grants_max = 10\ngrants_per_tenant_max = 11\n", "engram.grants_per_tenant_max"},
      {"connections_max = 0\n", "engram.connections_max"},
      {"attach_timeout_ms = 3600001\n", "engram.attach_timeout_ms"},
      {"body_timeout_ms = 3600001\n", "engram.body_timeout_ms"},
      {"body_timeout_ms = -1\n", "engram.body_timeout_ms"},
      {"regions_per_connection_max = 0\n", "engram.regions_per_connection_max"},
      {"batch_ops_max = 0\n", "engram.batch_ops_max"},
      {"batch_ops_max = 4097\n", "engram.batch_ops_max"},
      {"read_bytes_max = 0\n", "engram.read_bytes_max"},
      {"read_bytes_max = 1048577\n", "engram.read_bytes_max"},
      {"read_bytes_max = 8192\nresponse_bytes_max = 4096\n", "engram.response_bytes_max"},
      {"response_bytes_max = 67108865\n", "engram.response_bytes_max"},
      {"verbs_path_mtu_max_bytes = 1500\n", "engram.verbs_path_mtu_max_bytes"},
      {"verbs_path_mtu_max_bytes = 8192\n", "engram.verbs_path_mtu_max_bytes"},
      {"verbs_rd_atomic_max = 0\n", "engram.verbs_rd_atomic_max"},
      {"verbs_rd_atomic_max = 256\n", "engram.verbs_rd_atomic_max"},
      {"verbs_gid_index = 256\n", "engram.verbs_gid_index"},
      {"verbs_registrations_max = 0\n", "engram.verbs_registrations_max"},
      {"enabled2 = true\n", "engram.enabled2"},
      {"connections_max = -1\n", "engram.connections_max"},
      {"listen = 7301\n", "engram.listen"},
  };
  for (const Case& c : cases) {
    auto o = Engram(c.extra);
    ASSERT_FALSE(o.ok()) << c.extra;
    EXPECT_TRUE(o.status().IsInvalidArgument()) << c.extra << ": " << o.status().ToString();
    EXPECT_NE(o.status().message().find(c.key), std::string::npos)
        << c.extra << ": " << o.status().ToString();
  }
  // A type error on `enabled` and a missing dir.
  EXPECT_TRUE(ParseConfig("[engram]\nenabled = \"yes\"\n").status().IsInvalidArgument());
  auto no_dir = ParseConfig("[engram]\nenabled = true\n");
  ASSERT_TRUE(no_dir.ok());
  DaemonOptions d = *no_dir;
  Status st = Finalize(&d);
  EXPECT_TRUE(st.IsInvalidArgument());
  EXPECT_NE(st.message().find("engram.dir"), std::string::npos) << st.ToString();
}

TEST(EngramConfig, NonLoopbackListenNeedsAuthLikeTheMainListener) {
  auto open = Engram("listen = \"0.0.0.0:7301\"\n");
  ASSERT_FALSE(open.ok());
  EXPECT_TRUE(open.status().IsPermissionDenied()) << open.status().ToString();
  EXPECT_NE(open.status().message().find("without authentication"), std::string::npos);
  auto with_auth = Engram("listen = \"0.0.0.0:7301\"\n", "[auth]\ntokens_file = \"/t.toml\"\n");
  EXPECT_TRUE(with_auth.ok()) << with_auth.status().ToString();
  EXPECT_TRUE(Engram("listen = \"localhost:7301\"\n").ok());
  EXPECT_TRUE(Engram("listen = \"[::1]:7301\"\n").ok());
}

TEST(EngramConfig, FileErrorsCarryPathAndLine) {
  TempDir dir("kvtier-engram-cfg-");
  ASSERT_TRUE(dir.ok());
  std::string path = dir.File("kvtierd.toml");
  std::ofstream(path) << "[server]\nresp_port = 0\n[engram]\nenabled = true\nbatch_ops_mx = 3\n";
  auto o = LoadConfig(path);
  ASSERT_FALSE(o.ok());
  std::string msg = o.status().ToString();
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("engram.batch_ops_mx"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 5"), std::string::npos) << msg;
}

TEST(EngramWire, GrantAndReportBodiesRoundTripAndRejectBadInput) {
  wire::EngramGrantRequest req;
  req.ttl_ms = 1234;
  req.regions = {"engram.l1.s0", "engram.l2.s3"};
  auto body = wire::EncodeEngramGrant(req);
  auto d = wire::DecodeEngramGrant(body);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->ttl_ms, 1234u);
  EXPECT_EQ(d->regions, req.regions);
  // Truncated, trailing bytes, an empty name.
  EXPECT_FALSE(wire::DecodeEngramGrant(std::span(body).first(body.size() - 1)).ok());
  auto trailing = body;
  trailing.push_back(0);
  EXPECT_TRUE(wire::DecodeEngramGrant(trailing).status().IsInvalidArgument());
  wire::EngramGrantRequest empty_name;
  empty_name.regions = {""};
  EXPECT_FALSE(wire::DecodeEngramGrant(wire::EncodeEngramGrant(empty_name)).ok());
  // A count over kEngramRegionsMax is refused before anything is allocated.
  wire::Writer w;
  w.U64(0);
  w.U16(0xFFFF);
  EXPECT_TRUE(wire::DecodeEngramGrant(w.Take()).status().IsInvalidArgument());

  wire::EngramGrantResponse resp;
  resp.endpoint = "127.0.0.1:7301";
  resp.tenant = "alice";
  resp.ttl_ms = 60000;
  resp.shards_toml = "[[engram.l1.shard]]\n";
  resp.regions.push_back({"engram.l1.s0", {}, 99});
  resp.regions[0].token.fill(0xAB);
  wire::Writer rw;
  wire::EncodeEngramGrantResponse(resp, &rw);
  std::vector<uint8_t> rb = rw.Take();
  wire::Reader rr(rb);
  auto rd = wire::DecodeEngramGrantResponse(&rr);
  ASSERT_TRUE(rd.ok()) << rd.status().ToString();
  EXPECT_EQ(rd->endpoint, resp.endpoint);
  EXPECT_EQ(rd->tenant, "alice");
  EXPECT_EQ(rd->ttl_ms, 60000u);
  EXPECT_EQ(rd->shards_toml, resp.shards_toml);
  ASSERT_EQ(rd->regions.size(), 1u);
  EXPECT_EQ(rd->regions[0].token, resp.regions[0].token);
  EXPECT_EQ(rd->regions[0].expires_unix_ms, 99u);
  for (size_t cut = 0; cut < rb.size(); ++cut) {
    wire::Reader tr(std::span<const uint8_t>(rb).first(cut));
    EXPECT_FALSE(wire::DecodeEngramGrantResponse(&tr).ok()) << cut;
  }

  wire::EngramReport rep;
  rep.transport = "verbs";
  rep.rows_requested = 1;
  rep.stall_us = 2;
  rep.reads_in_flight = 3;
  auto rpb = wire::EncodeEngramReport(rep);
  EXPECT_EQ(rpb.size(), 1 + 5 + 11 * 8u);
  auto rpd = wire::DecodeEngramReport(rpb);
  ASSERT_TRUE(rpd.ok());
  EXPECT_EQ(rpd->transport, "verbs");
  EXPECT_EQ(rpd->rows_requested, 1u);
  EXPECT_EQ(rpd->stall_us, 2u);
  EXPECT_EQ(rpd->reads_in_flight, 3u);
  rep.transport = "rdma";
  EXPECT_TRUE(wire::DecodeEngramReport(wire::EncodeEngramReport(rep)).status().IsInvalidArgument());
  EXPECT_FALSE(wire::DecodeEngramReport(std::span(rpb).first(rpb.size() - 8)).ok());
}

TEST(EngramMetrics, ReportsAddUpPerTenantAndTransportAndRender) {
  DaemonMetrics m;
  m.engram_fetch.SetTenants({{"alice", 1}, {"bob", 2}});
  wire::EngramReport r;
  r.transport = "tcp";
  r.rows_requested = 10;
  r.bytes_read = 330;
  r.stall_us = 1500000;
  r.reads_in_flight = 4;
  ASSERT_TRUE(m.engram_fetch.Add(1, r).ok());
  r.reads_in_flight = 2;
  ASSERT_TRUE(m.engram_fetch.Add(1, r).ok());
  EXPECT_TRUE(m.engram_fetch.Add(3, r).IsNotFound());  // not a tenant
  r.transport = "ib";
  EXPECT_TRUE(m.engram_fetch.Add(1, r).IsInvalidArgument());
  EXPECT_EQ(m.engram_fetch.Total("tcp").rows_requested, 20u);
  EXPECT_EQ(m.engram_fetch.Total("verbs").rows_requested, 0u);

  DaemonMetrics::Extra extra;
  std::string page = m.RenderPrometheus(storage::Stats{}, extra);
  EXPECT_NE(page.find("kvtier_engram_fetch_rows_requested_total{tenant=\"alice\",transport=\"tcp\"}"
                      " 20\n"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("kvtier_engram_fetch_bytes_read_total{tenant=\"alice\",transport=\"tcp\"} "
                      "660\n"),
            std::string::npos);
  EXPECT_NE(page.find("kvtier_engram_fetch_stall_seconds_total{tenant=\"alice\",transport=\"tcp\"}"
                      " 3\n"),
            std::string::npos);
  // The gauge is the last reported value, not a sum.
  EXPECT_NE(
      page.find("kvtier_engram_fetch_reads_in_flight{tenant=\"alice\",transport=\"tcp\"} 2\n"),
      std::string::npos);
  EXPECT_EQ(page.find("tenant=\"bob\""), std::string::npos);         // never reported
  EXPECT_EQ(page.find("kvtier_engram_server_"), std::string::npos);  // not serving
  extra.engram_server = rdma::RowServerCounters{};
  extra.engram_server->ops_served = 7;
  page = m.RenderPrometheus(storage::Stats{}, extra);
  EXPECT_NE(page.find("kvtier_engram_server_ops_total{transport=\"tcp\"} 7\n"), std::string::npos);
  EXPECT_NE(page.find("# TYPE kvtier_engram_server_connections_open gauge\n"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::daemon
