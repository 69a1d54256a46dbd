// kvtierd in cluster mode against an "etcd" that answers every request with a hostile reply:
// fields of the wrong JSON types, keys outside the prefix asked for, a stream error object,
// a chunk size beyond any limit, a head of 20 KiB, text that is not JSON. Whatever answers at
// an etcd endpoint is not trusted: the node stays up, counts etcd errors, keeps serving what
// it holds, and its memory stays bounded.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cluster/base64.h"
#include "tests/cluster/cluster_fixture.h"
#include "tests/cluster/scripted_http_server.h"

namespace kvtier::cluster {
namespace {

using kvtier::testing::HttpOk;
using kvtier::testing::HttpOkChunkedLine;
using kvtier::testing::ScriptedHttpServer;

TEST(ClusterHostileEtcdTest, ANodeStaysUpAndServesAgainstAnEtcdThatLies) {
  // A lease grant and a keepalive that look right come first, so that the node registers and
  // then meets the rest in its session, watch and tombstone loops alike.
  const std::vector<std::string> responses = {
      HttpOk(R"({"header":{"revision":"1"},"ID":"7","TTL":"2"})"),
      HttpOk(R"({"header":{"revision":"1"}})"),
      HttpOk(R"({"error": 1})"),
      HttpOk(R"({"error": "x", "code": "5", "message": ["m"]})"),
      HttpOkChunkedLine(
          R"({"error": {"grpc_code": 1, "http_code": 500, "message": "stream broke"}})"),
      HttpOk(R"({"header": {"revision": "2"}, "kvs": [{"key": "eA==", "value": "e30="}]})"),
      HttpOkChunkedLine(
          R"({"result": {"header": {"revision": "3"}, "events": [{"kv": {"key": "eA=="}}]}})"),
      HttpOk(R"({"header": [], "kvs": {}})"),
      HttpOk(R"({"ID": {}, "TTL": [], "result": 7})"),
      HttpOkChunkedLine(R"({"result": {"canceled": "yes", "events": [{"type": 3}]}})"),
      HttpOk(R"({"header": {"revision": "18446744073709551615"}, "deleted": 1.5})"),
      HttpOk("<html>502 Bad Gateway</html>"),
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\nabc",
      "HTTP/1.1 200 OK\r\nX-Pad: " + std::string(20 << 10, 'a') + "\r\n\r\n{}",
      "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
      "SSH-2.0-OpenSSH_9.2\r\n",
  };
  // The membership's range of the members prefix always gets 50 records that are not JSON:
  // 50 bad records per re-read (every 500 ms), which must not mean 50 warnings each time.
  std::string bad_records = R"({"header": {"revision": "4"}, "kvs": [)";
  for (int i = 0; i < 50; ++i) {
    // "/kvtier/members/bad<i>" and "{not json", base64.
    const std::string key = "/kvtier/members/bad" + std::to_string(i);
    bad_records += std::string(i == 0 ? "" : ",") + R"({"key": ")" + Base64Encode(key) +
                   R"(", "value": "e25vdCBqc29u", "mod_revision": "4"})";
  }
  bad_records += "]}";
  ScriptedHttpServer etcd(responses, {"POST /v3/kv/range ", Base64Encode("/kvtier/members/")},
                          HttpOk(bad_records));

  const auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_hostile_etcd_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "credential", std::ios::binary) << std::string(40, 'c');
  kvtier::testing::KvtierdProcess node(dir / "n0");
  node.WriteConfig(
      "[storage]\ndram_capacity_bytes = 16777216\n"
      "[cluster]\nenabled = true\netcd_endpoints = [\"" +
      etcd.endpoint() + "\"]\nnode_id = \"n0\"\npeer_listen = \"127.0.0.1:" +
      std::to_string(kvtier::testing::FreePort()) +
      "\"\nreplicas = 1\nlease_ttl_s = 2\netcd_timeout_ms = 500\n"
      "credential_file = \"" +
      (dir / "credential").string() + "\"\n");
  ASSERT_TRUE(node.Start()) << node.Log();

  // Every reply twice over, spread across the loops that talk to etcd (session, watch,
  // tombstones), in whatever order they ask.
  ASSERT_TRUE(kvtier::testing::WaitFor(
      [&] { return etcd.served() >= 2 * responses.size() || !node.Alive(); }, 60000))
      << "served " << etcd.served() << "\n"
      << node.Log();
  ASSERT_TRUE(node.Alive()) << "after " << etcd.served() << " replies\n" << node.Log();
  const std::string metrics = kvtier::testing::HttpRequest(node.http_port(), "GET", "/metrics");
  EXPECT_GE(Metric(metrics, "kvtier_cluster_etcd_errors_total"), 4.0) << metrics;
  const std::string log = node.Log();
  EXPECT_EQ(log.find("terminate called"), std::string::npos) << log;
  // The watcher's retries (every 500 ms here) are one warning per 10 s, not one per retry.
  size_t watch_warnings = 0;
  for (size_t at = 0; (at = log.find("membership watch ended", at)) != std::string::npos; ++at) {
    ++watch_warnings;
  }
  EXPECT_LE(watch_warnings, 1u) << log;
  size_t record_warnings = 0;
  for (size_t at = 0; (at = log.find("ignoring member record", at)) != std::string::npos; ++at) {
    ++record_warnings;
  }
  EXPECT_EQ(record_warnings, 1u) << log;
  EXPECT_GE(Metric(metrics, "kvtier_cluster_bad_member_records_total"), 100.0) << metrics;
  // Both fronts still answer.
  auto c = daemon::Client::Connect(daemon::ClientOptions{.socket_path = node.socket()});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(kvtier::testing::HttpRequest(node.http_port(), "GET", "/readyz").rfind("HTTP/1.1 ", 0),
            0u);
  // Resident memory stays far below what the hostile lengths asked for (a 16 EiB chunk).
  EXPECT_LT(node.RssBytes(), uint64_t{512} << 20);
  EXPECT_EQ(node.Stop(), 0) << node.Log();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::cluster
