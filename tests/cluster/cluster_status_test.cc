// `kvtier cluster status` against the real binaries: etcd + three kvtierd of different SSD
// capacities (tests/cluster/cluster_fixture.h). The members, their capacities and leases are
// listed in text and JSON; ownership shares sum to 1 and follow the capacity weights; etcd down
// or bad flags give a clear error and a non-zero exit. Also: a cluster node's live /metrics
// passes `promtool check metrics`.
#include <signal.h>

#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "cluster/etcd_client.h"
#include "cluster/member.h"
#include "tests/cluster/cluster_fixture.h"
#include "tests/cluster/scripted_http_server.h"
#include "tests/crash/resp_client.h"

namespace kvtier::cluster {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

class ClusterStatusTest : public ClusterE2eTest {
 protected:
  // Weights 272, 528 and 784 MiB (16 MiB DRAM + 256/512/768 MiB SSD).
  uint64_t SsdCapacityBytes(int i) const override { return 256 * kMiB * (i + 1); }

  int Kvtier(const std::string& args, std::string* out) {
    return kt::RunShell(std::string(KVTIER_PATH) + " " + args, out);
  }
  std::string EtcdFlag() const { return "--etcd http://" + etcd_->endpoint(); }
  // Registers each (node id, scripted admin front) as a member under /fake/ in etcd.
  void RegisterFakeMembers(
      std::initializer_list<std::pair<const char*, const kvtier::testing::ScriptedHttpServer*>>
          members) {
    EtcdClient etcd(EtcdOptions{.endpoints = {etcd_->endpoint()}});
    for (auto [id, server] : members) {
      MemberInfo m;
      m.node_id = id;
      m.peer_endpoint = "127.0.0.1:1";
      m.admin_endpoint = server->endpoint();
      m.dram_bytes = 1ull << 30;
      ASSERT_TRUE(etcd.Put(std::string("/fake/members/") + id, EncodeMember(m)).ok());
    }
  }
  // The words of node's row in the text `kvtier cluster status` printed (empty: no row).
  static std::vector<std::string> RowWords(const std::string& out, const std::string& node) {
    const size_t at = out.find("\n" + node + " ");
    std::vector<std::string> words;
    if (at == std::string::npos) return words;
    std::istringstream line(out.substr(at + 1, out.find('\n', at + 1) - at - 1));
    for (std::string w; line >> w;) words.push_back(w);
    return words;
  }
};

TEST_F(ClusterStatusTest, TextListsEveryMember) {
  std::string out;
  ASSERT_EQ(Kvtier("cluster status " + EtcdFlag(), &out), 0) << out;
  for (int i = 0; i < kNodes; ++i) {
    const std::string peer = "127.0.0.1:" + std::to_string(peer_ports_[i]);
    size_t at = out.find("\nn" + std::to_string(i) + " ");
    ASSERT_NE(at, std::string::npos) << out;
    std::string line = out.substr(at + 1, out.find('\n', at + 1) - at - 1);
    EXPECT_NE(line.find(peer), std::string::npos) << line;
    EXPECT_NE(line.find("rack" + std::to_string(i)), std::string::npos) << line;
    EXPECT_NE(line.find(std::to_string(SsdCapacityBytes(i))), std::string::npos) << line;
    // Health from the member's /readyz, repair state and its bar from its /metrics.
    EXPECT_NE(line.find(" ready "), std::string::npos) << line;
    EXPECT_NE(line.find("] 100%"), std::string::npos) << line;
  }
  EXPECT_NE(out.find("3 member(s)"), std::string::npos) << out;
  EXPECT_NE(out.find("repair: 0 under-replicated unit(s), 0 move(s) in progress"),
            std::string::npos)
      << out;
}

TEST_F(ClusterStatusTest, JsonSharesSumToOneAndFollowCapacity) {
  for (int replicas : {1, 2}) {
    std::string out;
    ASSERT_EQ(Kvtier("cluster status --json --replicas " + std::to_string(replicas) + " " +
                         EtcdFlag() + " --prefix /kvtier/",
                     &out),
              0)
        << out;
    nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << out;
    ASSERT_EQ(j["members"].size(), static_cast<size_t>(kNodes)) << out;
    EXPECT_TRUE(j["bad_records"].empty()) << out;
    double sum = 0, weight_sum = 0;
    uint64_t slots = 0;
    for (const auto& m : j["members"]) weight_sum += m["weight"].get<double>();
    for (int i = 0; i < kNodes; ++i) {
      const auto& m = j["members"][i];  // sorted by node id
      EXPECT_EQ(m["node_id"], "n" + std::to_string(i));
      EXPECT_EQ(m["peer_endpoint"], "127.0.0.1:" + std::to_string(peer_ports_[i]));
      EXPECT_EQ(m["failure_domain"], "rack" + std::to_string(i));
      EXPECT_EQ(m["dram_bytes"], 16 * kMiB);
      EXPECT_EQ(m["ssd_bytes"], SsdCapacityBytes(i));
      EXPECT_EQ(m["draining"], false);
      EXPECT_EQ(m["admin_endpoint"], "127.0.0.1:" + std::to_string(nodes_[i]->http_port()));
      EXPECT_EQ(m["health"]["ready"], true) << m;
      EXPECT_EQ(m["health"]["under_replicated_units"], 0) << m;
      EXPECT_EQ(m["health"]["moves_in_progress"], 0) << m;
      ASSERT_TRUE(m["lease_ttl_left_s"].is_number()) << m;  // lease_ttl_s = 2 in the fixture
      EXPECT_LE(m["lease_ttl_left_s"].get<int64_t>(), 2);
      EXPECT_GE(m["lease_ttl_left_s"].get<int64_t>(), 0);
      const double share = m["ownership_share"].get<double>();
      sum += share;
      slots += m["owner_slots"].get<uint64_t>();
      if (replicas == 1) {
        // One owner per key: the share is the weight's fraction, within sampling noise of
        // 4096 keys (about 0.007 standard deviation).
        EXPECT_NEAR(share, m["weight"].get<double>() / weight_sum, 0.03) << m;
      }
      if (i > 0) {
        EXPECT_GT(share, j["members"][i - 1]["ownership_share"].get<double>()) << out;
      }
    }
    EXPECT_NEAR(sum, 1.0, 1e-9) << out;
    // Every sample key has `replicas` distinct owners (three members, weight > 0 each).
    EXPECT_EQ(slots, j["sample_keys"].get<uint64_t>() * replicas) << out;
  }
}

TEST_F(ClusterStatusTest, EtcdDownAndBadFlagsFailClearly) {
  std::string out;
  EXPECT_EQ(Kvtier("cluster status " + EtcdFlag() + " --prefix /kvtier", &out), 2) << out;
  EXPECT_NE(out.find("ending in '/'"), std::string::npos) << out;
  EXPECT_EQ(Kvtier("cluster status " + EtcdFlag() + " --replicas 0", &out), 2) << out;
  EXPECT_EQ(Kvtier("cluster status --etcd https://127.0.0.1:1", &out), 2) << out;
  EXPECT_EQ(Kvtier("cluster status", &out), 2) << out;
  EXPECT_EQ(Kvtier("cluster frobnicate", &out), 2) << out;
  // An empty prefix holds no members: listed as none, not an error.
  ASSERT_EQ(Kvtier("cluster status " + EtcdFlag() + " --prefix /other/", &out), 0) << out;
  EXPECT_NE(out.find("0 member(s)"), std::string::npos) << out;

  etcd_->Kill();
  EXPECT_EQ(Kvtier("cluster status --timeout-ms 500 " + EtcdFlag(), &out), 1) << out;
  EXPECT_NE(out.find("cannot read /kvtier/members/ from etcd"), std::string::npos) << out;
}

// `kvtier cluster where`: every member answers for the token's tenant; the unit's two owners
// hold it and say they own it, the third does neither; bob's token names bob's own (absent)
// unit; bob naming alice is refused by every member (exit 1, each row says why); a RESP key is
// held by the one member it was SET on, with no owners.
TEST_F(ClusterStatusTest, WhereShowsWhichMembersOwnAndHoldAUnit) {
  auto alice = Connect(0, "tok-alice");
  ASSERT_NE(alice, nullptr);
  PutSession(alice.get(), "where");
  const std::string hex = ToHex(ChainKey("where", 1));
  const std::string where = "cluster where --key " + hex + " " + EtcdFlag();
  std::string out;
  ASSERT_EQ(Kvtier(where + " --token tok-alice", &out), 0) << out;
  EXPECT_NE(out.find("tenant alice"), std::string::npos) << out;
  EXPECT_NE(out.find("2 of 2 owner(s) hold it; 0 other member(s) hold it"), std::string::npos)
      << out;
  EXPECT_NE(out.find("3 of 3 member(s) answered"), std::string::npos) << out;
  EXPECT_EQ(out.find("views differ"), std::string::npos) << out;
  int owners = 0;
  for (int i = 0; i < kNodes; ++i) {
    const std::vector<std::string> w = RowWords(out, "n" + std::to_string(i));
    ASSERT_GE(w.size(), 3u) << out;
    EXPECT_EQ(w[2], w[1]) << "an owner holds it, the other member does not: " << out;
    owners += w[1] == "yes" ? 1 : 0;
  }
  EXPECT_EQ(owners, 2) << out;

  ASSERT_EQ(Kvtier(where + " --token tok-alice --json", &out), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["tenant"], "alice");
  EXPECT_EQ(j["key"], hex);
  EXPECT_EQ(j["views_agree"], true);
  EXPECT_EQ(j["owners_holding"], 2);
  ASSERT_EQ(j["members"].size(), static_cast<size_t>(kNodes)) << out;
  for (const auto& m : j["members"]) {
    ASSERT_TRUE(m["error"].is_null()) << m;
    EXPECT_EQ(m["unit"]["held"], m["unit"]["owned_here"]) << m;
    EXPECT_EQ(m["unit"]["node"], m["node_id"]) << m;
    if (m["unit"]["held"] == true) {
      EXPECT_EQ(m["unit"]["kind"], "global_kv") << m;
    }
  }

  ASSERT_EQ(Kvtier(where + " --token tok-bob", &out), 0) << out;
  EXPECT_NE(out.find("tenant bob"), std::string::npos) << out;
  EXPECT_NE(out.find("0 of 2 owner(s) hold it; 0 other member(s) hold it"), std::string::npos)
      << out;
  EXPECT_EQ(Kvtier(where + " --token tok-bob --tenant alice", &out), 1) << out;
  size_t refused = 0;
  for (size_t at = out.find("HTTP 403"); at != std::string::npos; at = out.find("HTTP 403", at + 1))
    ++refused;
  EXPECT_EQ(refused, static_cast<size_t>(kNodes)) << out;
  EXPECT_NE(out.find("0 of 3 member(s) answered"), std::string::npos) << out;

  // A RESP key stays on the node it was written to: only that member holds it, no owners.
  auto resp = crash::RespClient::Connect(nodes_[1]->resp_port(), 5000);
  ASSERT_TRUE(resp.ok()) << resp.status().ToString();
  for (const std::vector<std::string_view>& cmd : std::vector<std::vector<std::string_view>>{
           {"AUTH", "tok-alice"}, {"SET", "cart:7 +x", "v"}}) {
    StatusOr<crash::RespReply> r = (*resp)->Call(cmd);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->type, crash::RespReply::Type::kSimple) << r->str;
  }
  ASSERT_EQ(Kvtier("cluster where --resp 'cart:7 +x' " + EtcdFlag() + " --token tok-alice", &out),
            0)
      << out;
  EXPECT_NE(out.find("resp key \"cart:7 +x\"  tenant alice"), std::string::npos) << out;
  for (int i = 0; i < kNodes; ++i) {
    const std::vector<std::string> w = RowWords(out, "n" + std::to_string(i));
    ASSERT_GE(w.size(), 3u) << out;
    EXPECT_EQ(w[1], "-") << "no owner: " << out;
    EXPECT_EQ(w[2], i == 1 ? "yes" : "no") << out;
  }
  EXPECT_EQ(out.find("\nowners"), std::string::npos) << out;
  EXPECT_NE(out.find("1 member(s) hold it; 3 of 3 member(s) answered (a RESP key"),
            std::string::npos)
      << out;

  // The empty RESP key is a key (Redis allows it): `--resp ''` asks for it, and only the node
  // it was written to holds it.
  auto resp2 = crash::RespClient::Connect(nodes_[2]->resp_port(), 5000);
  ASSERT_TRUE(resp2.ok()) << resp2.status().ToString();
  for (const std::vector<std::string_view>& cmd :
       std::vector<std::vector<std::string_view>>{{"AUTH", "tok-alice"}, {"SET", "", "v"}}) {
    StatusOr<crash::RespReply> r = (*resp2)->Call(cmd);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->type, crash::RespReply::Type::kSimple) << r->str;
  }
  ASSERT_EQ(Kvtier("cluster where --resp '' " + EtcdFlag() + " --token tok-alice", &out), 0) << out;
  EXPECT_NE(out.find("resp key \"\"  tenant alice"), std::string::npos) << out;
  for (int i = 0; i < kNodes; ++i) {
    const std::vector<std::string> w = RowWords(out, "n" + std::to_string(i));
    ASSERT_GE(w.size(), 3u) << out;
    EXPECT_EQ(w[2], i == 2 ? "yes" : "no") << out;
  }

  for (const std::string& bad :
       {where + " --resp x", where + " --resp ''", "cluster where " + EtcdFlag(),
        "cluster where --key 12 " + EtcdFlag(), "cluster where --key '' " + EtcdFlag(),
        where + " --token 'a b'", "cluster where --key " + hex}) {
    EXPECT_EQ(Kvtier(bad, &out), 2) << bad << ": " << out;
  }
}

// A member's /v1/unit answer is hostile input to `kvtier cluster where`: garbage, wrong types,
// an error status and an oversized body become that member's error; strings are printed
// without control bytes (no escape sequence reaches the terminal); members that answered are
// still shown (exit 0).
TEST_F(ClusterStatusTest, WhereTakesAHostileMembersAnswerAsThatMembersError) {
  using kvtier::testing::HttpOk;
  using kvtier::testing::ScriptedHttpServer;
  ScriptedHttpServer a(
      HttpOk("{\"tenant\":\"t\",\"held\":true,\"tier\":\"dram\",\"bytes\":10,\"owned_here\":true,"
             "\"owners\":[\"a\",\"x\\u001b[31m\"],\"kind\":\"blob\\r\\nFAKE\",\"ttl_left_ms\":-5,"
             "\"get_copy\":\"no\"}"));
  ScriptedHttpServer b(HttpOk("not json"));
  ScriptedHttpServer c(HttpOk("{\"held\":\"yes\"}"));
  ScriptedHttpServer d(
      "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 30\r\n\r\n"
      "{\"error\":\"\\u001b[2J boom\"}    ");
  ScriptedHttpServer e(HttpOk("{\"held\":true,\"pad\":\"" + std::string(70000, 'x') + "\"}"));
  RegisterFakeMembers({{"a", &a}, {"b", &b}, {"c", &c}, {"d", &d}, {"e", &e}});
  const std::string where =
      "cluster where --prefix /fake/ --key " + std::string(64, 'a') + " " + EtcdFlag();
  std::string out;
  ASSERT_EQ(Kvtier(where, &out), 0) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << out;
  EXPECT_EQ(out.find("\nFAKE"), std::string::npos) << "no line forged: " << out;
  std::vector<std::string> w = RowWords(out, "a");
  ASSERT_GE(w.size(), 8u) << out;
  EXPECT_EQ(w[1], "yes");  // owner
  EXPECT_EQ(w[3], "dram");
  EXPECT_EQ(w[4], "10");
  EXPECT_EQ(w[5], "-") << "a negative TTL is not a TTL: " << out;
  EXPECT_EQ(w[6], "-") << "a get_copy that is not a boolean: " << out;
  EXPECT_EQ(w[7], "blob??FAKE") << out;
  EXPECT_NE(out.find("owners a x?[31m  (as seen by a)"), std::string::npos) << out;
  EXPECT_NE(out.find("\nb                    not a unit description"), std::string::npos) << out;
  EXPECT_NE(out.find("\nc                    not a unit description"), std::string::npos) << out;
  EXPECT_NE(out.find("\nd                    HTTP 500: ?[2J boom"), std::string::npos) << out;
  EXPECT_NE(out.find("\ne                    rejected: response body over"), std::string::npos)
      << out;
  EXPECT_NE(out.find("1 of 5 member(s) answered"), std::string::npos) << out;

  ASSERT_EQ(Kvtier(where + " --json", &out), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  ASSERT_EQ(j["members"].size(), 5u) << out;
  EXPECT_EQ(j["members"][0]["unit"]["kind"], "blob\r\nFAKE") << "JSON carries it escaped";
  for (int i = 1; i < 5; ++i) {
    EXPECT_TRUE(j["members"][i]["error"].is_string()) << j["members"][i];
    EXPECT_TRUE(j["members"][i]["unit"].is_null()) << j["members"][i];
  }
}

TEST_F(ClusterStatusTest, ClusterNodeMetricsPassPromtool) {
  if (kt::RunShell("command -v promtool") != 0) GTEST_SKIP() << "no promtool";
  std::string page = Metrics(0);
  ASSERT_NE(page.find("\nkvtier_cluster_members 3"), std::string::npos) << page;
  std::string path = (dir_ / "metrics.txt").string();
  std::ofstream(path) << page.substr(page.find("\r\n\r\n") + 4);
  std::string out;
  EXPECT_EQ(kt::RunShell("promtool check metrics < " + path, &out), 0) << out;
}

// GET /v1/cluster (cache_daemon/cluster_json.h): this node's view with every member's
// endpoint, failure domain and capacities, and every kvtier_cluster_* series of its /metrics.
TEST_F(ClusterStatusTest, AdminV1ClusterShowsTheViewAndEveryClusterSeries) {
  auto body = [](const std::string& http) { return http.substr(http.find("\r\n\r\n") + 4); };
  std::string raw = kt::HttpRequest(nodes_[1]->http_port(), "GET", "/v1/cluster");
  ASSERT_NE(raw.find(" 200 "), std::string::npos) << raw;
  nlohmann::json j = nlohmann::json::parse(body(raw), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << raw;
  EXPECT_EQ(j["clustered"], true);
  EXPECT_EQ(j["node_id"], "n1");
  EXPECT_EQ(j["etcd_reachable"], true);
  ASSERT_EQ(j["members"].size(), static_cast<size_t>(kNodes)) << raw;
  for (int i = 0; i < kNodes; ++i) {
    const auto& m = j["members"][i];
    EXPECT_EQ(m["node_id"], "n" + std::to_string(i));
    EXPECT_EQ(m["peer_endpoint"], "127.0.0.1:" + std::to_string(peer_ports_[i]));
    EXPECT_EQ(m["failure_domain"], "rack" + std::to_string(i));
    EXPECT_EQ(m["ssd_bytes"], SsdCapacityBytes(i));
    EXPECT_EQ(m["draining"], false);
    EXPECT_EQ(m["self"], i == 1);
  }
  // Every kvtier_cluster_* series of /metrics, by name and labels (values move meanwhile).
  // The per-peer clock series are left out: the members a clock round has reached may change
  // between the two reads.
  auto per_peer_clock = [](const std::string& series) {
    return series.rfind("kvtier_cluster_peer_clock_offset_seconds{", 0) == 0;
  };
  std::set<std::string> want, got;
  std::istringstream page(body(Metrics(1)));
  for (std::string line; std::getline(page, line);) {
    const std::string series = line.substr(0, line.rfind(' '));
    if (line.rfind("kvtier_cluster_", 0) == 0 && !per_peer_clock(series)) want.insert(series);
  }
  for (const auto& [series, sample] : j["metrics"].items()) {
    EXPECT_TRUE(sample["type"] == "gauge" || sample["type"] == "counter") << series;
    if (!per_peer_clock(series)) got.insert(series);
  }
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(got, want);
  EXPECT_EQ(j["metrics"]["kvtier_cluster_members"]["value"], 3.0) << raw;
  // A bad bearer token is refused, as on /metrics.
  std::string bad = kt::HttpRequest(nodes_[1]->http_port(), "GET", "/v1/cluster", "",
                                    "Authorization: Bearer nope\r\n");
  EXPECT_NE(bad.find(" 401 "), std::string::npos) << bad;
}

// Every node reads its peers' clocks (cluster/peer_clocks.h, CLOCK): /metrics names each
// other member with its offset, near 0 on one machine, and never the node itself; the page
// with the labelled series passes promtool.
class ClusterClockTest : public ClusterStatusTest {
 protected:
  std::string ExtraClusterConfig(int /*i*/) override { return "clock_sample_interval_ms = 1000\n"; }
};

TEST_F(ClusterClockTest, EveryNodeShowsItsPeersClockOffsets) {
  auto offset = [](const std::string& page, const std::string& peer) {
    return Metric(page, "kvtier_cluster_peer_clock_offset_seconds{peer=\"" + peer + "\"}");
  };
  for (int i = 0; i < kNodes; ++i) {
    std::string page;
    ASSERT_TRUE(kt::WaitFor(
        [&] {
          page = Metrics(i);
          for (int j = 0; j < kNodes; ++j) {
            if (j != i && offset(page, "n" + std::to_string(j)) == -1) return false;
          }
          return true;
        },
        15000))
        << page;
    EXPECT_EQ(offset(page, "n" + std::to_string(i)), -1) << "a node read its own clock";
    for (int j = 0; j < kNodes; ++j) {
      if (j != i) {
        EXPECT_LT(std::abs(offset(page, "n" + std::to_string(j))), 0.5) << page;
      }
    }
    EXPECT_GE(Metric(page, "kvtier_cluster_peer_clock_offset_abs_max_seconds"), 0) << page;
    EXPECT_LT(Metric(page, "kvtier_cluster_peer_clock_offset_abs_max_seconds"), 0.5) << page;
    EXPECT_GE(Metric(page, "kvtier_cluster_peer_clock_samples_total"), kNodes - 1) << page;
    EXPECT_EQ(Metric(page, "kvtier_cluster_peer_clock_unsupported_total"), 0) << page;
    if (kt::RunShell("command -v promtool") == 0) {
      const std::string path = (dir_ / "metrics.txt").string();
      std::ofstream(path) << page.substr(page.find("\r\n\r\n") + 4);
      std::string out;
      EXPECT_EQ(kt::RunShell("promtool check metrics < " + path, &out), 0) << out;
    }
  }
}

// `kvtier cluster status` shows each member's clock against its closest peer's (CLOCK_S, JSON
// clock_offset_s) and, in JSON, the offsets the member read (peer_clock_offsets_s).
TEST_F(ClusterClockTest, StatusShowsEachMembersClockOffset) {
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        for (int i = 0; i < kNodes; ++i) {
          if (Metric(Metrics(i), "kvtier_cluster_peer_clock_samples_total") < kNodes - 1)
            return false;
        }
        return true;
      },
      15000));
  std::string out;
  ASSERT_EQ(Kvtier("cluster status " + EtcdFlag(), &out), 0) << out;
  ASSERT_NE(out.find(" CLOCK_S "), std::string::npos) << out;
  for (int i = 0; i < kNodes; ++i) {
    const std::vector<std::string> words = RowWords(out, "n" + std::to_string(i));
    ASSERT_GE(words.size(), 11u) << out;
    EXPECT_LT(std::abs(std::stod(words[10])), 0.5) << out;
  }
  ASSERT_EQ(Kvtier("cluster status --json " + EtcdFlag(), &out), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  for (int i = 0; i < kNodes; ++i) {
    const auto& h = j["members"][i]["health"];
    ASSERT_TRUE(h["clock_offset_s"].is_number()) << out;
    EXPECT_LT(std::abs(h["clock_offset_s"].get<double>()), 0.5) << out;
    EXPECT_EQ(h["peer_clock_offsets_s"].size(), static_cast<size_t>(kNodes - 1)) << out;
    EXPECT_FALSE(h["peer_clock_offsets_s"].contains("n" + std::to_string(i))) << out;
  }
}

// The odd clock out, with members whose admin fronts are scripted: c's clock runs 3.2 s behind
// a's and b's, so c's peers read it at about -3.2 s and c reads them at +3.2 s. c's row shows
// -3.2 (its clock minus its closest peer's); a's and b's show their small offset against each
// other, not c's. A member whose page names no offsets, and a malformed sample, read as none.
TEST_F(ClusterClockTest, StatusNamesTheMemberWhoseClockIsOff) {
  using kvtier::testing::HttpOk;
  using kvtier::testing::ScriptedHttpServer;
  auto page = [](const std::string& samples) {
    return HttpOk("# TYPE kvtier_cluster_peer_clock_offset_seconds gauge\n" + samples);
  };
  ScriptedHttpServer a({HttpOk("ready\n")}, {"GET /metrics"},
                       page("kvtier_cluster_peer_clock_offset_seconds{peer=\"b\"} 0.004000\n"
                            "kvtier_cluster_peer_clock_offset_seconds{peer=\"c\"} -3.200000\n"));
  ScriptedHttpServer b({HttpOk("ready\n")}, {"GET /metrics"},
                       page("kvtier_cluster_peer_clock_offset_seconds{peer=\"a\"} -0.004000\n"
                            "kvtier_cluster_peer_clock_offset_seconds{peer=\"c\"} -3.196000\n"
                            "kvtier_cluster_peer_clock_offset_seconds{peer=\"d\"} nan\n"
                            "kvtier_cluster_peer_clock_offset_seconds{peer=\"d} 9\n"));
  ScriptedHttpServer c({HttpOk("ready\n")}, {"GET /metrics"},
                       page("kvtier_cluster_peer_clock_offset_seconds{peer=\"a\"} 3.200000\n"
                            "kvtier_cluster_peer_clock_offset_seconds{peer=\"b\"} 3.196000\n"));
  ScriptedHttpServer d({HttpOk("ready\n")}, {"GET /metrics"}, page(""));
  RegisterFakeMembers({{"a", &a}, {"b", &b}, {"c", &c}, {"d", &d}});
  std::string out;
  ASSERT_EQ(Kvtier("cluster status --json --prefix /fake/ " + EtcdFlag(), &out), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  ASSERT_EQ(j["members"].size(), 4u) << out;
  auto offset = [&](int i) { return j["members"][i]["health"]["clock_offset_s"]; };
  EXPECT_DOUBLE_EQ(offset(0).get<double>(), -0.004) << out;  // a, as b reads it
  EXPECT_DOUBLE_EQ(offset(1).get<double>(), 0.004) << out;   // b, as a reads it
  EXPECT_DOUBLE_EQ(offset(2).get<double>(), -3.196) << out;  // c: its closest peer, b
  EXPECT_TRUE(offset(3).is_null()) << "no page names d (b's nan and unclosed label are skipped)";
  EXPECT_EQ(j["members"][1]["health"]["peer_clock_offsets_s"].size(), 2u) << out;
  ASSERT_EQ(Kvtier("cluster status --prefix /fake/ " + EtcdFlag(), &out), 0) << out;
  EXPECT_NE(out.find(" -3.196 "), std::string::npos) << out;
  const std::vector<std::string> words = RowWords(out, "d");
  ASSERT_GE(words.size(), 11u) << out;
  EXPECT_EQ(words[10], "-") << out;
}

// A member that stops answering its peers while it keeps its place in etcd (SIGSTOP within a
// 30 s lease): the node that called it suspects it, exports the peer by name
// (kvtier_cluster_peer_suspect_seconds{peer}), and `kvtier cluster status` counts it under
// SUSPECTED on the stopped member's row (text and JSON).
class ClusterStatusSuspectTest : public ClusterStatusTest {
 protected:
  uint32_t LeaseTtlS() const override { return 30; }
  std::string ExtraClusterConfig(int /*i*/) override { return "peer_probe_interval_ms = 500\n"; }
};

TEST_F(ClusterStatusSuspectTest, AMemberItsPeersCannotReachIsCountedAsSuspected) {
  const std::string n2_peer = "127.0.0.1:" + std::to_string(peer_ports_[2]);
  std::string out;
  // Node i's HEALTH and SUSPECTED columns (the 9th and 10th) of the text in `out`.
  auto columns = [&](int i) {
    const std::vector<std::string> words = RowWords(out, "n" + std::to_string(i));
    if (words.empty()) return std::string("no row");
    return words.size() < 10 ? std::string("short row") : words[8] + " " + words[9];
  };
  ASSERT_EQ(Kvtier("cluster status " + EtcdFlag(), &out), 0) << out;
  ASSERT_NE(out.find("SUSPECTED"), std::string::npos) << out;
  for (int i = 0; i < kNodes; ++i) EXPECT_EQ(columns(i), "ready 0") << out;

  nodes_[2]->Signal(SIGSTOP);
  // A session through n0: the units n2 owns are sent to it, and the first call times out
  // (those PUTs fail: every owner must acknowledge).
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  std::vector<uint8_t> value(1000, 'v');
  std::vector<PutUnit> units;
  for (const Key& k : Chain("suspect")) units.push_back(PutUnit{.key = k, .value = value});
  ASSERT_TRUE(writer->Put(units, {}).ok());
  const std::string page = Metrics(0);
  EXPECT_EQ(Metric(page, "kvtier_cluster_peer_suspects"), 1) << page;
  EXPECT_NE(page.find("\nkvtier_cluster_peer_suspect_seconds{peer=\"" + n2_peer + "\"} "),
            std::string::npos)
      << page;
  if (kt::RunShell("command -v promtool") == 0) {  // the labelled series is well formed
    const std::string path = (dir_ / "metrics.txt").string();
    std::ofstream(path) << page.substr(page.find("\r\n\r\n") + 4);
    EXPECT_EQ(kt::RunShell("promtool check metrics < " + path, &out), 0) << out;
  }

  ASSERT_EQ(Kvtier("cluster status " + EtcdFlag(), &out), 0) << out;
  // n2's admin front is stopped too (unreachable); n0 suspects it (n1 may too, if a repair
  // scan of its own called n2 meanwhile); n0 and n1 answer their peers.
  const std::string n2_columns = columns(2);
  EXPECT_TRUE(n2_columns == "unreachable 1" || n2_columns == "unreachable 2") << out;
  EXPECT_EQ(columns(0), "ready 0") << out;
  EXPECT_EQ(columns(1), "ready 0") << out;
  ASSERT_EQ(Kvtier("cluster status --json " + EtcdFlag(), &out), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  ASSERT_EQ(j["members"].size(), static_cast<size_t>(kNodes)) << out;
  EXPECT_EQ(j["members"][0]["health"]["suspects"], nlohmann::json::array({n2_peer})) << out;
  const int n1_suspects_n2 = j["members"][1]["health"]["suspects"].size() == 1 ? 1 : 0;
  EXPECT_EQ(j["members"][2]["health"]["suspected_by"], 1 + n1_suspects_n2) << out;
  EXPECT_EQ(j["members"][0]["health"]["suspected_by"], 0) << out;
  EXPECT_EQ(j["members"][1]["health"]["suspected_by"], 0) << out;

  // Continued after seconds stopped, n2 holds its store's answers until it caught up on the
  // deletes it may have missed (docs/CLUSTER.md, "Tombstones": max(peer_timeout_ms,
  // peer_probe_interval_ms) + etcd_timeout_ms, 4 s here): HELD, then ready.
  nodes_[2]->Signal(SIGCONT);
  ASSERT_EQ(Kvtier("cluster status " + EtcdFlag(), &out), 0) << out;
  EXPECT_EQ(columns(2).substr(0, 5), "HELD ") << out;
  ASSERT_EQ(Kvtier("cluster status --json " + EtcdFlag(), &out), 0) << out;
  j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["members"][2]["health"]["answers_held"], true) << out;
  EXPECT_EQ(j["members"][0]["health"]["answers_held"], false) << out;
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return Kvtier("cluster status " + EtcdFlag(), &out) == 0 &&
               columns(2).substr(0, 6) == "ready ";
      },
      20000))
      << out;
}

}  // namespace
}  // namespace kvtier::cluster
