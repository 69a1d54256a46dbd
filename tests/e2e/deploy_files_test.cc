// The operator files in deploy/ against the tools that read them and against the real binaries:
// promtool checks and unit-tests the rules, systemd-analyze verifies the units, every metric that
// kvtierd's rules and the Grafana dashboard query is one that the built kvtierd exports (a single
// node, and for the kvtier_cluster_* series a node in cluster mode), every metric that the
// server's rules and dashboard query is one that the built `kvtier-engine serve` exports, every
// dashboard query parses (promtool), and the server unit's command line starts the built server.
// The Kubernetes manifests: k8s_manifests_test.cc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/e2e/deploy_test_util.h"
#include "tests/e2e/kvtierd_process.h"
#ifdef KVTIER_ENGINE_PATH
#include "tests/serving/serve_process.h"
#endif

namespace kvtier {
namespace {

namespace kt = kvtier::testing;
namespace fs = std::filesystem;

const fs::path kDeploy = kt::kDeployDir;
using kt::Matches;
using kt::ReadFile;

// Names a scrape of kvtierd can answer: every family of a `# TYPE` line, and for a histogram
// its _bucket, _sum and _count series.
std::set<std::string> ExportedNames(const std::string& page) {
  std::set<std::string> names;
  static const std::regex kType(R"(# TYPE (\S+) (\S+))");
  for (std::sregex_iterator it(page.begin(), page.end(), kType), end; it != end; ++it) {
    const std::string name = (*it)[1].str();
    names.insert(name);
    if ((*it)[2].str() == "histogram") {
      for (const char* s : {"_bucket", "_sum", "_count"}) names.insert(name + s);
    }
  }
  return names;
}

class DeployFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvtier_deploy_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The families a freshly started kvtierd exports, with a write-budget admission policy so
  // that the budget gauges carry values.
  std::string Scrape() {
    return ScrapeWith("d",
                      "[policy]\nadmission = \"write-budget\"\n"
                      "[policy.params]\n\"write-budget:bytes_per_day\" = 123456789\n"
                      "\"write-budget:window_ms\" = 3600000\n");
  }
  // The families a kvtierd in cluster mode exports (kvtier_cluster_*): a real cluster node
  // whose etcd endpoint is a closed loopback port. A node starts and serves without etcd
  // (docs/CLUSTER.md), so every cluster family is there, without starting an etcd.
  std::string ScrapeClusterNode() {
    std::ofstream(dir_ / "credential", std::ios::binary) << std::string(40, 'c');
    return ScrapeWith("c", "[cluster]\nenabled = true\netcd_endpoints = [\"127.0.0.1:" +
                               std::to_string(kt::FreePort()) +
                               "\"]\nnode_id = \"n0\"\npeer_listen = \"127.0.0.1:" +
                               std::to_string(kt::FreePort()) + "\"\ncredential_file = \"" +
                               (dir_ / "credential").string() + "\"\netcd_timeout_ms = 200\n");
  }
  std::string ScrapeWith(const std::string& name, const std::string& config) {
    kt::KvtierdProcess d(dir_ / name);
    d.WriteConfig(config);
    EXPECT_TRUE(d.Start()) << d.Log();
    // Start() returns once the Unix socket accepts; the HTTP front may bind a moment later.
    std::string page;
    for (int i = 0; i < 100 && page.find("\r\n\r\n") == std::string::npos; ++i) {
      if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      page = kt::HttpRequest(d.http_port(), "GET", "/metrics");
    }
    size_t body = page.find("\r\n\r\n");
    EXPECT_NE(body, std::string::npos) << page;
    return body == std::string::npos ? "" : page.substr(body + 4);
  }

  fs::path dir_;
};

TEST_F(DeployFilesTest, PromtoolChecksAndUnitTestsTheRules) {
  for (const std::string rules : {"kvtier", "kvtier-serve"}) {
    SCOPED_TRACE(rules);
    const fs::path dir = kDeploy / "prometheus";
    std::string out;
    EXPECT_EQ(kt::RunShell("promtool check rules " + (dir / (rules + ".rules.yml")).string(), &out),
              0)
        << out;
    // promtool resolves rule_files relative to the test file.
    EXPECT_EQ(
        kt::RunShell("promtool test rules " + (dir / (rules + ".rules.test.yml")).string(), &out),
        0)
        << out;
  }
}

// The queries of a Grafana dashboard, in panel order.
std::vector<std::string> DashboardExprs(const fs::path& file) {
  const nlohmann::json dash = nlohmann::json::parse(ReadFile(file));
  std::vector<std::string> exprs;
  for (const auto& panel : dash.at("panels")) {
    for (const auto& t : panel.at("targets")) exprs.push_back(t.at("expr").get<std::string>());
  }
  return exprs;
}

// Every metric that `rules_file` and `dashboard_file` query is in `exported` (what `binary`'s
// /metrics page declares), every recorded series they use is recorded by `rules_file`, and every
// dashboard query parses as PromQL (promtool checks it as a recording rule, with the
// dashboard's $instance variable as a regular expression).
void ExpectQueriesExported(const std::string& binary, const std::set<std::string>& exported,
                           const fs::path& rules_file, const fs::path& dashboard_file,
                           const fs::path& dir) {
  SCOPED_TRACE(binary);
  const std::string rules = ReadFile(rules_file);
  ASSERT_FALSE(rules.empty());
  const std::vector<std::string> exprs = DashboardExprs(dashboard_file);
  ASSERT_GT(exprs.size(), 10u);
  std::string dash_exprs, dash_rules = "groups:\n  - name: dashboard\n    rules:\n";
  for (size_t i = 0; i < exprs.size(); ++i) {
    dash_exprs += exprs[i] + "\n";
    const std::string promql = std::regex_replace(exprs[i], std::regex(R"(\$instance)"), ".*");
    dash_rules += "      - record: dashboard:q" + std::to_string(i) +
                  "\n        expr: " + nlohmann::json(promql).dump() + "\n";
  }
  std::ofstream(dir / "dashboard.rules.yml") << dash_rules;
  std::string out;
  EXPECT_EQ(kt::RunShell("promtool check rules " + (dir / "dashboard.rules.yml").string(), &out), 0)
      << out;

  static const std::regex kMetric(R"(\bkvtier_[a-z0-9_]+)");
  static const std::regex kRecorded(R"(\bkvtier:[a-z0-9_:]+)");
  static const std::regex kRecord(R"(record:\s*(kvtier:[a-z0-9_:]+))");
  const std::set<std::string> defined = Matches(rules, kRecord, 1);
  EXPECT_GE(defined.size(), 4u);
  for (const auto& [what, text] :
       {std::pair<const char*, const std::string&>{"rules", rules}, {"dashboard", dash_exprs}}) {
    const std::set<std::string> queried = Matches(text, kMetric);
    EXPECT_GE(queried.size(), 8u) << what;
    for (const std::string& m : queried) {
      EXPECT_TRUE(exported.count(m))
          << what << " queries " << m << ", which " << binary << " does not export";
    }
    for (const std::string& r : Matches(text, kRecorded)) {
      EXPECT_TRUE(defined.count(r)) << what << " uses " << r << ", which no rule records";
    }
  }
}

TEST_F(DeployFilesTest, EveryMetricTheRulesAndDashboardQueryIsExported) {
  const std::string page = Scrape();
  std::set<std::string> exported = ExportedNames(page);
  ASSERT_GT(exported.size(), 30u) << page;
  // The cluster rules' series come from a cluster node's page.
  const std::string cluster_page = ScrapeClusterNode();
  const std::set<std::string> cluster_names = ExportedNames(cluster_page);
  ASSERT_TRUE(cluster_names.count("kvtier_cluster_etcd_reachable")) << cluster_page;
  exported.insert(cluster_names.begin(), cluster_names.end());
  // The budget gauges carry the configured policy's budget.
  EXPECT_NE(page.find("kvtier_admission_budget_bytes 123456789\n"), std::string::npos) << page;
  EXPECT_NE(page.find("kvtier_admission_budget_window_seconds 3600\n"), std::string::npos) << page;
  ExpectQueriesExported("kvtierd", exported, kDeploy / "prometheus/kvtier.rules.yml",
                        kDeploy / "grafana/kvtier.json", dir_);
}

// The server's rules and dashboard against a scrape of the built server, with --speculative (its
// families are all on the page from the start, before any request: counters by label with no
// series yet keep their TYPE line).
TEST_F(DeployFilesTest, EveryMetricTheServeRulesAndDashboardQueryIsExportedByTheServer) {
#ifndef KVTIER_ENGINE_PATH
  GTEST_SKIP() << "kvtier-engine is not built in this configuration";
#else
  kt::ServeProcess serve(dir_ / "serve");
  ASSERT_TRUE(serve.Start({"--speculative"})) << serve.Log();
  const kt::HttpReply reply = kt::Http(serve.port(), "GET", "/metrics");
  ASSERT_EQ(reply.status, 200) << reply.body;
  const std::set<std::string> exported = ExportedNames(reply.body);
  ASSERT_TRUE(exported.count("kvtier_serve_layer_device_failed")) << reply.body;
  ExpectQueriesExported("kvtier-engine serve", exported,
                        kDeploy / "prometheus/kvtier-serve.rules.yml",
                        kDeploy / "grafana/kvtier-serve.json", dir_);
  EXPECT_EQ(serve.Stop(), 0) << serve.Log();
#endif
}

// systemd-analyze verify of one unit, its ExecStart binary pointed at the built one (verify
// needs it to exist).
void VerifyUnit(const fs::path& dir, const std::string& name, const std::string& installed,
                const std::string& built) {
  SCOPED_TRACE(name);
  std::string unit = ReadFile(kDeploy / "systemd" / name);
  const size_t at = unit.find("ExecStart=" + installed);
  ASSERT_NE(at, std::string::npos);
  unit.replace(at + 10, installed.size(), built);
  std::ofstream(dir / name) << unit;
  std::string out;
  EXPECT_EQ(kt::RunShell("systemd-analyze verify " + (dir / name).string(), &out), 0) << out;
  // verify exits 0 on an unknown key or a bad value ("ignoring"): it must print nothing.
  EXPECT_EQ(out, "");
}

TEST_F(DeployFilesTest, SystemdVerifiesTheUnits) {
  VerifyUnit(dir_, "kvtierd.service", "/usr/local/bin/kvtierd", KVTIERD_PATH);
#ifdef KVTIER_ENGINE_PATH
  VerifyUnit(dir_, "kvtier-engine-serve.service", "/usr/local/bin/kvtier-engine",
             KVTIER_ENGINE_PATH);
#endif
}

// The server unit's command line, with the installed paths mapped to this tree (the models in
// deploy/models, the credential to a keys file, kvtierd's socket to a started kvtierd's), starts
// the built server, which then answers its API key and refuses a request without one: the
// unit's flags, model files and keys file are what `kvtier-engine serve` takes.
TEST_F(DeployFilesTest, TheServerUnitsCommandStartsTheServer) {
#ifndef KVTIER_ENGINE_PATH
  GTEST_SKIP() << "kvtier-engine is not built in this configuration";
#else
  std::string unit = ReadFile(kDeploy / "systemd/kvtier-engine-serve.service");
  const size_t at = unit.find("\nExecStart=");
  ASSERT_NE(at, std::string::npos);
  std::string command;
  for (size_t p = at + 11;;) {  // the line and its continuations
    const size_t eol = unit.find('\n', p);
    std::string line = unit.substr(p, eol == std::string::npos ? std::string::npos : eol - p);
    const bool more = !line.empty() && line.back() == '\\';
    if (more) line.pop_back();
    command += line + " ";
    if (!more || eol == std::string::npos) break;
    p = eol + 1;
  }
  std::vector<std::string> args;
  std::istringstream words(command);
  for (std::string w; words >> w;) args.push_back(w);
  ASSERT_GE(args.size(), 2u) << command;
  ASSERT_EQ(args[0], "/usr/local/bin/kvtier-engine") << command;
  ASSERT_EQ(args[1], "serve") << command;

  kt::KvtierdProcess d(dir_ / "d");
  d.WriteConfig("");
  ASSERT_TRUE(d.Start()) << d.Log();
  std::ofstream(dir_ / "serve-keys.json")
      << R"({"keys": [{"key": "sk-unit", "tenant": "t", "daemon_token": "tok"}]})";
  const std::string models = "/usr/local/share/kvtier/models/";
  std::vector<std::string> flags;
  for (size_t i = 2; i < args.size(); ++i) {
    std::string a = args[i];
    if (a == "--port") {  // ServeProcess picks a free port
      ++i;
      continue;
    }
    if (a.rfind(models, 0) == 0) {
      a = (kDeploy / "models" / a.substr(models.size())).string();
      EXPECT_TRUE(fs::exists(a)) << a;
    } else if (a == "${CREDENTIALS_DIRECTORY}/serve-keys.json") {
      a = (dir_ / "serve-keys.json").string();
    } else if (a == "/run/kvtier/kvtierd.sock") {
      a = d.socket();
    }
    flags.push_back(a);
  }
  kt::ServeProcess serve(dir_ / "serve");
  ASSERT_TRUE(serve.Start(flags)) << serve.Log();
  EXPECT_EQ(kt::Http(serve.port(), "GET", "/v1/models", "", "sk-unit").status, 200) << serve.Log();
  EXPECT_EQ(kt::Http(serve.port(), "GET", "/v1/models").status, 401) << serve.Log();
  EXPECT_EQ(serve.Stop(), 0) << serve.Log();
#endif
}

}  // namespace
}  // namespace kvtier
