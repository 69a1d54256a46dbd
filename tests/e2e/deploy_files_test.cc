// The operator files in deploy/ against the tools that read them and against the real binaries:
// promtool checks and unit-tests the rules, systemd-analyze verifies the units, every metric that
// kvtierd's rules and the Grafana dashboard query is one that the built kvtierd exports (a single
// node, and for the kvtier_cluster_* series a node in cluster mode), every metric that the
// server's rules and dashboard query is one that the built `kvtier-engine serve` exports, every
// dashboard query parses (promtool), and the server unit's command line starts the built server.
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

#include "cache_daemon/config.h"
#include "tests/e2e/kvtierd_process.h"
#ifdef KVTIER_ENGINE_PATH
#include "tests/serving/serve_process.h"
#endif

namespace kvtier {
namespace {

namespace kt = kvtier::testing;
namespace fs = std::filesystem;

const fs::path kDeploy = fs::path(KVTIER_SOURCE_DIR) / "deploy";

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::set<std::string> Matches(const std::string& text, const std::regex& re, int group = 0) {
  std::set<std::string> out;
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it)
    out.insert((*it)[group].str());
  return out;
}

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

// The manifests as JSON documents (Debian's python3-yaml parses them; kubectl's client dry run
// needs an API server for discovery, which a test machine does not have).
nlohmann::json LoadManifests(const fs::path& file) {
  std::string out;
  const int rc = kt::RunShell(
      "/usr/bin/python3 -c 'import json,sys,yaml; "
      "json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], sys.stdout)' " +
          file.string(),
      &out);
  EXPECT_EQ(rc, 0) << out;
  return rc == 0 ? nlohmann::json::parse(out) : nlohmann::json::array();
}

// The first document of `kind` in docs (LoadManifests); null when there is none.
const nlohmann::json* OfKind(const nlohmann::json& docs, const std::string& kind) {
  for (const auto& d : docs) {
    if (d.at("kind") == kind) return &d;
  }
  return nullptr;
}

TEST_F(DeployFilesTest, KubernetesManifestsAgreeWithKvtierd) {
  const nlohmann::json docs = LoadManifests(kDeploy / "k8s/kvtierd.yaml");
  const nlohmann::json* config_map = nullptr;
  const nlohmann::json* stateful = nullptr;
  std::vector<const nlohmann::json*> services;
  for (const auto& d : docs) {
    const std::string kind = d.at("kind");
    if (kind == "ConfigMap") config_map = &d;
    if (kind == "StatefulSet") stateful = &d;
    if (kind == "Service") services.push_back(&d);
  }
  ASSERT_NE(config_map, nullptr);
  ASSERT_NE(stateful, nullptr);
  ASSERT_FALSE(services.empty());

  // The config kvtierd reads parses as a kvtierd config, with the ports the manifests name.
  StatusOr<daemon::DaemonOptions> o =
      daemon::ParseConfig(config_map->at("data").at("kvtierd.toml").get<std::string>());
  ASSERT_TRUE(o.ok()) << o.status().ToString();

  const nlohmann::json& pod = stateful->at("spec").at("template").at("spec");
  const nlohmann::json& c = pod.at("containers").at(0);
  std::map<std::string, int> ports;
  for (const auto& p : c.at("ports")) ports[p.at("name")] = p.at("containerPort");
  EXPECT_EQ(ports.at("resp"), o->resp_port);
  EXPECT_EQ(ports.at("http"), o->http_port);
  for (const auto* svc : services) {
    for (const auto& p : svc->at("spec").at("ports")) {
      EXPECT_TRUE(ports.count(p.at("targetPort").get<std::string>()))
          << svc->at("metadata").at("name") << " targets a port the container does not have";
    }
  }
  // Probes hit endpoints kvtierd serves, on its HTTP port.
  for (const char* probe : {"readinessProbe", "livenessProbe"}) {
    const nlohmann::json& get = c.at(probe).at("httpGet");
    EXPECT_EQ(get.at("port"), "http") << probe;
    const std::string path = get.at("path");
    EXPECT_TRUE(path == "/readyz" || path == "/healthz") << probe << " " << path;
  }
  // The data volume is the config's data_dir, the config file is where --config points.
  std::set<std::string> mounts;
  for (const auto& m : c.at("volumeMounts")) mounts.insert(m.at("mountPath"));
  EXPECT_TRUE(mounts.count(o->data_dir)) << o->data_dir;
  const nlohmann::json& args = c.at("args");
  ASSERT_GE(args.size(), 2u);
  EXPECT_EQ(args.at(0), "--config");
  EXPECT_TRUE(mounts.count(args.at(1).get<std::string>())) << args.at(1);
  // SIGTERM drains and flushes: the grace period is the systemd unit's stop timeout.
  EXPECT_GE(pod.at("terminationGracePeriodSeconds").get<int>(), 120);

  // [cluster]: every pod joins the etcd of etcd.yaml under its pod name, advertising its pod
  // IP on the container's peer port, and the result passes kvtierd's own cluster checks.
  ASSERT_TRUE(o->cluster.enabled);
  std::map<std::string, std::string> env;
  for (const auto& e : c.at("env"))
    env[e.at("name")] = e.at("valueFrom").at("fieldRef").at("fieldPath");
  EXPECT_EQ(env["POD_NAME"], "metadata.name");
  EXPECT_EQ(env["POD_IP"], "status.podIP");
  std::map<std::string, std::string> flags;
  for (size_t i = 2; i + 1 < args.size(); i += 2) flags[args.at(i)] = args.at(i + 1);
  EXPECT_EQ(flags["--cluster-node-id"], "$(POD_NAME)");
  EXPECT_EQ(flags["--cluster-peer-advertise"], "$(POD_IP):" + std::to_string(ports.at("peer")));
  daemon::ClusterServeOptions cluster = o->cluster;
  cluster.node_id = stateful->at("metadata").at("name").get<std::string>() + "-0";
  cluster.peer_advertise = "10.0.0.7:" + std::to_string(ports.at("peer"));
  Status fin = daemon::FinalizeCluster(&cluster, !o->tokens_file.empty());
  ASSERT_TRUE(fin.ok()) << fin.ToString();
  EXPECT_EQ(cluster.peer_port, ports.at("peer"));

  const nlohmann::json etcd_docs = LoadManifests(kDeploy / "k8s/etcd.yaml");
  const nlohmann::json* etcd = OfKind(etcd_docs, "StatefulSet");
  const nlohmann::json* etcd_svc = OfKind(etcd_docs, "Service");
  ASSERT_TRUE(etcd != nullptr && etcd_svc != nullptr);
  const std::string sts = etcd->at("metadata").at("name");
  EXPECT_EQ(etcd->at("spec").at("serviceName"), etcd_svc->at("metadata").at("name"));
  const int members = etcd->at("spec").at("replicas");
  EXPECT_EQ(members % 2, 1) << "an etcd of an even size tolerates no more failures than one less";
  std::set<std::string> want;
  std::string initial;
  for (int i = 0; i < members; ++i) {
    const std::string host = sts + "-" + std::to_string(i) + "." +
                             etcd_svc->at("metadata").at("name").get<std::string>();
    want.insert(host + ":2379");
    initial += (i ? "," : "") + sts + "-" + std::to_string(i) + "=http://" + host + ":2380";
  }
  EXPECT_EQ(
      std::set<std::string>(o->cluster.etcd_endpoints.begin(), o->cluster.etcd_endpoints.end()),
      want);
  bool found = false;
  for (const auto& a :
       etcd->at("spec").at("template").at("spec").at("containers").at(0).at("args")) {
    found = found || a.get<std::string>() == "--initial-cluster=" + initial;
  }
  EXPECT_TRUE(found) << "etcd's --initial-cluster must name every member: " << initial;
}

// deploy/k8s/serve.yaml and deploy/container/Containerfile.serve against the built server and
// kvtierd.yaml: the server container's args, after the image's entrypoint and with the pod's
// mounts mapped to this tree (the keys Secret to a keys file, the shared /run/kvtier volume to a
// started kvtierd's socket), start the built server; its probes' path answers without an API
// key; the socket it names is where kvtierd.yaml's ConfigMap puts kvtierd's, in a volume both
// containers mount; both run as the uid both images create (kvtierd's socket admits only its own
// user); the kvtierd container is kvtierd.yaml's.
TEST_F(DeployFilesTest, TheServeManifestStartsTheServerBesideItsKvtierd) {
#ifndef KVTIER_ENGINE_PATH
  GTEST_SKIP() << "kvtier-engine is not built in this configuration";
#else
  const nlohmann::json docs = LoadManifests(kDeploy / "k8s/serve.yaml");
  const nlohmann::json* stateful = OfKind(docs, "StatefulSet");
  std::vector<const nlohmann::json*> services;
  for (const auto& d : docs) {
    if (d.at("kind") == "Service") services.push_back(&d);
  }
  ASSERT_NE(stateful, nullptr);
  const nlohmann::json& pod = stateful->at("spec").at("template").at("spec");
  const nlohmann::json* kvtierd = nullptr;
  const nlohmann::json* serve = nullptr;
  for (const auto& c : pod.at("containers")) {
    if (c.at("name") == "kvtierd") kvtierd = &c;
    if (c.at("name") == "serve") serve = &c;
  }
  ASSERT_TRUE(kvtierd != nullptr && serve != nullptr);

  // The kvtierd container is kvtierd.yaml's: its image, args and config.
  const nlohmann::json kvtierd_docs = LoadManifests(kDeploy / "k8s/kvtierd.yaml");
  const nlohmann::json* config_map = OfKind(kvtierd_docs, "ConfigMap");
  const nlohmann::json* kvtierd_sts = OfKind(kvtierd_docs, "StatefulSet");
  ASSERT_TRUE(config_map != nullptr && kvtierd_sts != nullptr);
  const nlohmann::json& theirs =
      kvtierd_sts->at("spec").at("template").at("spec").at("containers").at(0);
  EXPECT_EQ(kvtierd->at("image"), theirs.at("image"));
  EXPECT_EQ(kvtierd->at("args"), theirs.at("args"));
  StatusOr<daemon::DaemonOptions> o =
      daemon::ParseConfig(config_map->at("data").at("kvtierd.toml").get<std::string>());
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  std::map<std::string, int> kvtierd_ports;
  for (const auto& p : kvtierd->at("ports")) kvtierd_ports[p.at("name")] = p.at("containerPort");
  EXPECT_EQ(kvtierd_ports.at("http"), o->http_port);

  // Mount path -> volume name, per container; and the pod's volumes by name.
  auto mounts_of = [](const nlohmann::json& c) {
    std::map<std::string, std::string> m;
    for (const auto& v : c.at("volumeMounts")) m[v.at("mountPath")] = v.at("name");
    return m;
  };
  const auto kvtierd_mounts = mounts_of(*kvtierd), serve_mounts = mounts_of(*serve);
  std::map<std::string, nlohmann::json> volumes;
  for (const auto& v : pod.at("volumes")) volumes[v.at("name")] = v;

  // The server's flags: the image's entrypoint (past "serve"), then the container's args.
  const std::string containerfile = ReadFile(kDeploy / "container/Containerfile.serve");
  auto json_instruction = [&](const std::string& name) {
    const size_t at = containerfile.find("\n" + name + " [");
    EXPECT_NE(at, std::string::npos) << name;
    if (at == std::string::npos) return nlohmann::json::array();
    std::string text;
    for (size_t p = at + name.size() + 2;;) {  // the line and its continuations
      const size_t eol = containerfile.find('\n', p);
      std::string line = containerfile.substr(p, eol - p);
      const bool more = !line.empty() && line.back() == '\\';
      if (more) line.pop_back();
      text += line;
      if (!more) break;
      p = eol + 1;
    }
    return nlohmann::json::parse(text);
  };
  const nlohmann::json entrypoint = json_instruction("ENTRYPOINT");
  ASSERT_GE(entrypoint.size(), 2u);
  EXPECT_EQ(entrypoint.at(0), "/usr/local/bin/kvtier-engine");
  EXPECT_EQ(entrypoint.at(1), "serve");
  // The image's CMD is the container's args: a pod without args runs the same server.
  EXPECT_EQ(json_instruction("CMD"), serve->at("args"));
  std::vector<std::string> image_flags, pod_flags;
  for (size_t i = 2; i < entrypoint.size(); ++i) image_flags.push_back(entrypoint.at(i));
  for (const auto& a : serve->at("args")) pod_flags.push_back(a);
  std::map<std::string, std::string> flag;
  for (size_t i = 0; i + 1 < pod_flags.size(); i += 2) flag[pod_flags[i]] = pod_flags[i + 1];

  // kvtierd's socket, in a volume both containers mount.
  const fs::path socket = flag["--socket"];
  EXPECT_EQ(socket, fs::path(o->socket_path));
  const std::string run_dir = socket.parent_path().string();
  ASSERT_TRUE(kvtierd_mounts.count(run_dir) && serve_mounts.count(run_dir)) << run_dir;
  EXPECT_EQ(kvtierd_mounts.at(run_dir), serve_mounts.at(run_dir));
  // The keys file, from the Secret mounted at its directory.
  const fs::path keys = flag["--api-keys"];
  const std::string keys_dir = keys.parent_path().string();
  ASSERT_TRUE(serve_mounts.count(keys_dir)) << keys_dir;
  EXPECT_TRUE(volumes.at(serve_mounts.at(keys_dir)).contains("secret")) << keys_dir;
  // The API port: the flag, the container's named port, the probes, the Services.
  std::map<std::string, int> serve_ports;
  for (const auto& p : serve->at("ports")) serve_ports[p.at("name")] = p.at("containerPort");
  EXPECT_EQ(std::to_string(serve_ports.at("api")), flag["--port"]);
  for (const char* probe : {"readinessProbe", "livenessProbe"}) {
    EXPECT_EQ(serve->at(probe).at("httpGet").at("port"), "api") << probe;
    EXPECT_EQ(serve->at(probe).at("httpGet").at("path"), "/health") << probe;
  }
  for (const auto* svc : services) {
    for (const auto& p : svc->at("spec").at("ports")) {
      const std::string target = p.at("targetPort");
      EXPECT_TRUE(serve_ports.count(target) || kvtierd_ports.count(target))
          << svc->at("metadata").at("name") << " targets a port no container has: " << target;
    }
  }
  // One user, the one both images create; kvtierd's drain fits the grace period.
  const std::regex uid(R"(--uid (\d+))");
  const std::set<std::string> uids = Matches(containerfile, uid, 1);
  ASSERT_EQ(uids.size(), 1u);
  EXPECT_EQ(Matches(ReadFile(kDeploy / "container/Containerfile"), uid, 1), uids);
  EXPECT_EQ(std::to_string(pod.at("securityContext").at("runAsUser").get<int>()), *uids.begin());
  EXPECT_GE(pod.at("terminationGracePeriodSeconds").get<int>(), 120);

  // Started here: the model files the entrypoint names (deploy/models, each copied into the
  // image), a kvtierd's socket, a keys file; loopback for the pod's every-address listen.
  kt::KvtierdProcess d(dir_ / "d");
  d.WriteConfig("");
  ASSERT_TRUE(d.Start()) << d.Log();
  std::ofstream(dir_ / "keys.json")
      << R"({"keys": [{"key": "sk-pod", "tenant": "t", "daemon_token": "tok"}]})";
  const std::string models = "/usr/local/share/kvtier/models/";
  std::vector<std::string> flags;
  for (std::string a : image_flags) {
    if (a.rfind(models, 0) == 0) {
      const std::string file = a.substr(models.size());
      EXPECT_NE(containerfile.find("deploy/models/" + file), std::string::npos)
          << file << " is not copied into the image";
      a = (kDeploy / "models" / file).string();
      EXPECT_TRUE(fs::exists(a)) << a;
    }
    flags.push_back(a);
  }
  for (size_t i = 0; i < pod_flags.size(); ++i) {
    std::string a = pod_flags[i];
    if (a == "--port") {  // ServeProcess picks a free port
      ++i;
      continue;
    }
    if (a == socket.string()) a = d.socket();
    if (a == keys.string()) a = (dir_ / "keys.json").string();
    if (a == "0.0.0.0") a = "127.0.0.1";
    flags.push_back(a);
  }
  kt::ServeProcess server(dir_ / "serve");
  ASSERT_TRUE(server.Start(flags)) << server.Log();
  EXPECT_EQ(kt::Http(server.port(), "GET", "/health").status, 200) << server.Log();
  EXPECT_EQ(kt::Http(server.port(), "GET", "/v1/models", "", "sk-pod").status, 200) << server.Log();
  EXPECT_EQ(kt::Http(server.port(), "GET", "/v1/models").status, 401) << server.Log();
  EXPECT_EQ(server.Stop(), 0) << server.Log();
#endif
}

}  // namespace
}  // namespace kvtier
