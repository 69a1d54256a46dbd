// The Kubernetes manifests in deploy/k8s against kvtierd's own config parser, the images'
// Containerfiles and the real binaries: kvtierd.yaml's ports, probes, mounts, cluster settings and
// TLS front agree with its config; serve.yaml's and serve-shared.yaml's server args, after the
// image's entrypoint and with the pod's mounts mapped to this tree, start the built server, which
// then resumes a second turn through a started kvtierd reached the way the pod reaches it (the
// shared socket; kvtierd.yaml's client Service over TLS).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "cache_daemon/config.h"
#include "common/key_spec.h"
#include "tests/e2e/deploy_test_util.h"
#include "tests/e2e/kvtierd_process.h"
#ifdef KVTIER_ENGINE_PATH
#include "tests/serving/prompt_text.h"
#include "tests/serving/serve_process.h"
#endif

namespace kvtier {
namespace {

namespace kt = kvtier::testing;
namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kDeploy = kt::kDeployDir;
using kt::Matches;
using kt::ReadFile;

class K8sManifestsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / ("kvtier_k8s_" + std::to_string(getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

// The manifests as JSON documents (Debian's python3-yaml parses them; kubectl's client dry run
// needs an API server for discovery, which a test machine does not have).
json LoadManifests(const fs::path& file) {
  std::string out;
  const int rc = kt::RunShell(
      "/usr/bin/python3 -c 'import json,sys,yaml; "
      "json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], sys.stdout)' " +
          file.string(),
      &out);
  EXPECT_EQ(rc, 0) << out;
  return rc == 0 ? json::parse(out) : json::array();
}

// The documents of `kind` in docs (LoadManifests), in order.
std::vector<const json*> AllOfKind(const json& docs, const std::string& kind) {
  std::vector<const json*> out;
  for (const auto& d : docs) {
    if (d.at("kind") == kind) out.push_back(&d);
  }
  return out;
}

// The first document of `kind` in docs; null when there is none.
const json* OfKind(const json& docs, const std::string& kind) {
  const std::vector<const json*> all = AllOfKind(docs, kind);
  return all.empty() ? nullptr : all.front();
}

TEST_F(K8sManifestsTest, KvtierdManifestsAgreeWithKvtierd) {
  const json docs = LoadManifests(kDeploy / "k8s/kvtierd.yaml");
  const json* config_map = nullptr;
  const json* stateful = nullptr;
  std::vector<const json*> services;
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

  const json& pod = stateful->at("spec").at("template").at("spec");
  const json& c = pod.at("containers").at(0);
  std::map<std::string, int> ports;
  for (const auto& p : c.at("ports")) ports[p.at("name")] = p.at("containerPort");
  EXPECT_EQ(ports.at("resp"), o->resp_port);
  EXPECT_EQ(ports.at("http"), o->http_port);
  EXPECT_EQ(ports.count("native") ? ports.at("native") : 0, o->native_port);
  for (const auto* svc : services) {
    for (const auto& p : svc->at("spec").at("ports")) {
      EXPECT_TRUE(ports.count(p.at("targetPort").get<std::string>()))
          << svc->at("metadata").at("name") << " targets a port the container does not have";
    }
  }
  // Probes hit endpoints kvtierd serves, on its HTTP port.
  for (const char* probe : {"readinessProbe", "livenessProbe"}) {
    const json& get = c.at(probe).at("httpGet");
    EXPECT_EQ(get.at("port"), "http") << probe;
    const std::string path = get.at("path");
    EXPECT_TRUE(path == "/readyz" || path == "/healthz") << probe << " " << path;
  }
  // The data volume is the config's data_dir, the config file is where --config points.
  std::set<std::string> mounts;
  for (const auto& m : c.at("volumeMounts")) mounts.insert(m.at("mountPath"));
  EXPECT_TRUE(mounts.count(o->data_dir)) << o->data_dir;
  const json& args = c.at("args");
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

  const json etcd_docs = LoadManifests(kDeploy / "k8s/etcd.yaml");
  const json* etcd = OfKind(etcd_docs, "StatefulSet");
  const json* etcd_svc = OfKind(etcd_docs, "Service");
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

// A container's volume mounts: mount path -> volume name.
std::map<std::string, std::string> MountsOf(const json& container) {
  std::map<std::string, std::string> m;
  for (const auto& v : container.at("volumeMounts")) m[v.at("mountPath")] = v.at("name");
  return m;
}

// A pod's volumes by name.
std::map<std::string, json> VolumesOf(const json& pod) {
  std::map<std::string, json> v;
  for (const auto& vol : pod.at("volumes")) v[vol.at("name")] = vol;
  return v;
}

// Where a StatefulSet's volume `name` comes from: the pod's volume of that name without its
// name, or {"claim": name} for a volume claim template; null when there is neither.
json VolumeSource(const json& stateful, const std::string& name) {
  const json& spec = stateful.at("spec");
  for (json v : spec.at("template").at("spec").at("volumes")) {
    if (v.at("name") != name) continue;
    v.erase("name");
    return v;
  }
  for (const auto& t : spec.value("volumeClaimTemplates", json::array())) {
    if (t.at("metadata").at("name") == name) return json{{"claim", name}};
  }
  return json();
}

// A container's named ports: name -> containerPort.
std::map<std::string, int> PortsOf(const json& container) {
  std::map<std::string, int> p;
  for (const auto& port : container.at("ports")) p[port.at("name")] = port.at("containerPort");
  return p;
}

// `file` is in a directory that `container` mounts from a Secret of `pod` (or, with
// `or_config_map`, from a ConfigMap: for what is not secret, such as a CA certificate).
::testing::AssertionResult FromASecret(const json& pod, const json& container,
                                       const std::string& file, bool or_config_map = false) {
  const auto mounts = MountsOf(container);
  const auto at = mounts.find(fs::path(file).parent_path().string());
  if (at == mounts.end())
    return ::testing::AssertionFailure() << file << ": its directory is not mounted";
  const json& v = VolumesOf(pod).at(at->second);
  if (!v.contains("secret") && !(or_config_map && v.contains("configMap")))
    return ::testing::AssertionFailure() << file << ": volume " << at->second << " is not a Secret";
  return ::testing::AssertionSuccess();
}

// A container's args as flag -> value; a flag followed by another flag (or last) maps to "".
std::map<std::string, std::string> FlagsOf(const json& args) {
  std::map<std::string, std::string> f;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string a = args.at(i);
    const bool valued =
        i + 1 < args.size() && args.at(i + 1).get<std::string>().rfind("--", 0) != 0;
    f[a] = valued ? args.at(++i).get<std::string>() : "";
  }
  return f;
}

// The server image (deploy/container/Containerfile.serve).
struct ServeImage {
  std::string containerfile;
  json entrypoint, cmd;  // the ENTRYPOINT and CMD instructions' arrays
};

// `name`'s JSON array in the Containerfile (the line and its continuations).
json Instruction(const std::string& containerfile, const std::string& name) {
  const size_t at = containerfile.find("\n" + name + " [");
  EXPECT_NE(at, std::string::npos) << name;
  if (at == std::string::npos) return json::array();
  std::string text;
  for (size_t p = at + name.size() + 2;;) {
    const size_t eol = containerfile.find('\n', p);
    std::string line = containerfile.substr(p, eol - p);
    const bool more = !line.empty() && line.back() == '\\';
    if (more) line.pop_back();
    text += line;
    if (!more) break;
    p = eol + 1;
  }
  return json::parse(text);
}

ServeImage LoadServeImage() {
  ServeImage im;
  im.containerfile = ReadFile(kDeploy / "container/Containerfile.serve");
  im.entrypoint = Instruction(im.containerfile, "ENTRYPOINT");
  im.cmd = Instruction(im.containerfile, "CMD");
  return im;
}

// The entrypoint's flags past "serve", with the model files it names mapped to deploy/models;
// each must be copied into the image.
std::vector<std::string> EntrypointFlags(const ServeImage& im) {
  EXPECT_GE(im.entrypoint.size(), 2u);
  if (im.entrypoint.size() < 2) return {};
  EXPECT_EQ(im.entrypoint.at(0), "/usr/local/bin/kvtier-engine");
  EXPECT_EQ(im.entrypoint.at(1), "serve");
  const std::string models = "/usr/local/share/kvtier/models/";
  std::vector<std::string> flags;
  for (size_t i = 2; i < im.entrypoint.size(); ++i) {
    std::string a = im.entrypoint.at(i);
    if (a.rfind(models, 0) == 0) {
      const std::string file = a.substr(models.size());
      EXPECT_NE(im.containerfile.find("deploy/models/" + file), std::string::npos)
          << file << " is not copied into the image";
      a = (kDeploy / "models" / file).string();
      EXPECT_TRUE(fs::exists(a)) << a;
    }
    flags.push_back(a);
  }
  return flags;
}

// What every server pod shares: probes on /health at the named port `api`, which the container
// has; each Service's target a port of the pod's containers; one uid, the one both images
// create (kvtierd's socket admits only its own user).
void ExpectServerPod(const json& pod, const json& serve, const std::vector<const json*>& services,
                     const std::vector<const json*>& containers, const ServeImage& im) {
  const auto serve_ports = PortsOf(serve);
  EXPECT_TRUE(serve_ports.count("api"));
  for (const char* probe : {"readinessProbe", "livenessProbe"}) {
    EXPECT_EQ(serve.at(probe).at("httpGet").at("port"), "api") << probe;
    EXPECT_EQ(serve.at(probe).at("httpGet").at("path"), "/health") << probe;
  }
  for (const auto* svc : services) {
    for (const auto& p : svc->at("spec").at("ports")) {
      const std::string target = p.at("targetPort");
      bool found = false;
      for (const auto* c : containers) found = found || PortsOf(*c).count(target) > 0;
      EXPECT_TRUE(found) << svc->at("metadata").at("name")
                         << " targets a port no container has: " << target;
    }
  }
  const std::regex uid(R"(--uid (\d+))");
  const std::set<std::string> uids = Matches(im.containerfile, uid, 1);
  ASSERT_EQ(uids.size(), 1u);
  EXPECT_EQ(Matches(ReadFile(kDeploy / "container/Containerfile"), uid, 1), uids);
  EXPECT_EQ(std::to_string(pod.at("securityContext").at("runAsUser").get<int>()), *uids.begin());
}

#ifdef KVTIER_ENGINE_PATH
// Two turns of one conversation through `server` with API key `key` (nothing stays resident:
// the server runs with --idle-sequences-max 0): the second turn's cached_tokens, and in *whole
// the first turn's tokens in its sequence (its whole pages and, by its hot state, the rest).
int64_t SecondTurnCachedTokens(const kt::ServeProcess& server, const std::string& key,
                               int64_t* whole) {
  json msgs = json::array({{{"role", "user"}, {"content", kt::PromptText(150, 1)}}});
  kt::HttpReply r1 =
      kt::Http(server.port(), "POST", "/v1/chat/completions", kt::GreedyChat(msgs, 24).dump(), key);
  EXPECT_EQ(r1.status, 200) << r1.body;
  if (r1.status != 200) return -1;
  const json u1 = r1.Json()["usage"];
  *whole = u1["prompt_tokens"].get<int64_t>() + u1["completion_tokens"].get<int64_t>() - 1;
  msgs.push_back(
      {{"role", "assistant"}, {"content", r1.Json()["choices"][0]["message"]["content"]}});
  msgs.push_back({{"role", "user"}, {"content", "and then?"}});
  kt::HttpReply r2 =
      kt::Http(server.port(), "POST", "/v1/chat/completions", kt::GreedyChat(msgs, 8).dump(), key);
  EXPECT_EQ(r2.status, 200) << r2.body;
  if (r2.status != 200) return -1;
  return r2.Json()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
}

// The server's flags as a pod runs them: `flags` (the image's entrypoint's), then the
// container's args with each one in `mapped` replaced (paths and addresses of the pod mapped to
// the test's), every-address listens on loopback and --port dropped (ServeProcess picks one).
std::vector<std::string> PodFlags(std::vector<std::string> flags, const json& args,
                                  const std::map<std::string, std::string>& mapped) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args.at(i);
    if (a == "--port") {
      ++i;
      continue;
    }
    if (auto it = mapped.find(a); it != mapped.end()) a = it->second;
    if (a == "0.0.0.0") a = "127.0.0.1";
    flags.push_back(a);
  }
  return flags;
}

// Starts the server with `flags` (nothing left resident, so a second turn resumes through
// kvtierd) and checks what every pod's server must do: /health without a key, 401 without one
// on /v1/models, a conversation's second turn restored whole, exit 0 on SIGTERM.
void ExpectServerResumesTurns(const fs::path& dir, std::vector<std::string> flags,
                              const std::string& key, const kt::KvtierdProcess& d) {
  flags.insert(flags.end(), {"--idle-sequences-max", "0"});
  kt::ServeProcess server(dir);
  ASSERT_TRUE(server.Start(flags)) << server.Log();
  EXPECT_EQ(kt::Http(server.port(), "GET", "/health").status, 200) << server.Log();
  EXPECT_EQ(kt::Http(server.port(), "GET", "/v1/models").status, 401) << server.Log();
  int64_t whole = 0;
  const int64_t cached = SecondTurnCachedTokens(server, key, &whole);
  EXPECT_EQ(cached, whole) << server.Log() << d.Log();
  EXPECT_GT(whole, 64);
  EXPECT_EQ(server.Stop(), 0) << server.Log();
}
#endif

// deploy/k8s/serve.yaml and deploy/container/Containerfile.serve against the built server and
// kvtierd.yaml: the server container's args, after the image's entrypoint and with the pod's
// mounts mapped to this tree (the keys Secret to a keys file, the shared /run/kvtier volume to a
// started kvtierd's socket), start the built server, whose second turn of a conversation hits the
// first through that kvtierd; its probes' path answers without an API key; the socket it names is
// where kvtierd.yaml's ConfigMap puts kvtierd's, in a volume both containers mount; both run as
// the uid both images create; the kvtierd container is kvtierd.yaml's (image, args, and each
// mount from the same source).
TEST_F(K8sManifestsTest, TheServeManifestStartsTheServerBesideItsKvtierd) {
#ifndef KVTIER_ENGINE_PATH
  GTEST_SKIP() << "kvtier-engine is not built in this configuration";
#else
  const json docs = LoadManifests(kDeploy / "k8s/serve.yaml");
  const json* stateful = OfKind(docs, "StatefulSet");
  const std::vector<const json*> services = AllOfKind(docs, "Service");
  ASSERT_NE(stateful, nullptr);
  const json& pod = stateful->at("spec").at("template").at("spec");
  const json* kvtierd = nullptr;
  const json* serve = nullptr;
  for (const auto& c : pod.at("containers")) {
    if (c.at("name") == "kvtierd") kvtierd = &c;
    if (c.at("name") == "serve") serve = &c;
  }
  ASSERT_TRUE(kvtierd != nullptr && serve != nullptr);

  // The kvtierd container is kvtierd.yaml's: its image, args, config, and every mount from the
  // same kind of source (the same ConfigMap or Secret, or a volume claim of the same name).
  const json kvtierd_docs = LoadManifests(kDeploy / "k8s/kvtierd.yaml");
  const json* config_map = OfKind(kvtierd_docs, "ConfigMap");
  const json* kvtierd_sts = OfKind(kvtierd_docs, "StatefulSet");
  ASSERT_TRUE(config_map != nullptr && kvtierd_sts != nullptr);
  const json& their_pod = kvtierd_sts->at("spec").at("template").at("spec");
  const json& theirs = their_pod.at("containers").at(0);
  EXPECT_EQ(kvtierd->at("image"), theirs.at("image"));
  EXPECT_EQ(kvtierd->at("args"), theirs.at("args"));
  const auto their_mounts = MountsOf(theirs), kvtierd_mounts = MountsOf(*kvtierd);
  for (const auto& [path, name] : their_mounts) {
    ASSERT_TRUE(kvtierd_mounts.count(path)) << "kvtierd.yaml's kvtierd mounts " << path;
    EXPECT_EQ(VolumeSource(*stateful, kvtierd_mounts.at(path)), VolumeSource(*kvtierd_sts, name))
        << path;
  }
  StatusOr<daemon::DaemonOptions> o =
      daemon::ParseConfig(config_map->at("data").at("kvtierd.toml").get<std::string>());
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(PortsOf(*kvtierd).at("http"), o->http_port);

  const ServeImage im = LoadServeImage();
  // The image's CMD is the container's args: a pod without args runs the same server.
  EXPECT_EQ(im.cmd, serve->at("args"));
  std::map<std::string, std::string> flag = FlagsOf(serve->at("args"));
  const auto serve_mounts = MountsOf(*serve);

  // kvtierd's socket, in a volume both containers mount.
  const fs::path socket = flag["--socket"];
  EXPECT_EQ(socket, fs::path(o->socket_path));
  const std::string run_dir = socket.parent_path().string();
  ASSERT_TRUE(kvtierd_mounts.count(run_dir) && serve_mounts.count(run_dir)) << run_dir;
  EXPECT_EQ(kvtierd_mounts.at(run_dir), serve_mounts.at(run_dir));
  // The keys file, from the Secret mounted at its directory.
  const std::string keys = flag["--api-keys"];
  EXPECT_TRUE(FromASecret(pod, *serve, keys));
  EXPECT_EQ(std::to_string(PortsOf(*serve).at("api")), flag["--port"]);
  ExpectServerPod(pod, *serve, services, {serve, kvtierd}, im);
  // kvtierd drains and flushes on SIGTERM: the grace period fits it.
  EXPECT_GE(pod.at("terminationGracePeriodSeconds").get<int>(), 120);

  // Started here: a kvtierd whose socket stands for the shared volume's, a keys file; loopback
  // for the pod's every-address listen.
  kt::KvtierdProcess d(dir_ / "d");
  d.WriteConfig("");
  ASSERT_TRUE(d.Start()) << d.Log();
  std::ofstream(dir_ / "keys.json")
      << R"({"keys": [{"key": "sk-pod", "tenant": "t", "daemon_token": "tok"}]})";
  ExpectServerResumesTurns(
      dir_ / "serve",
      PodFlags(EntrypointFlags(im), serve->at("args"),
               {{socket.string(), d.socket()}, {keys, (dir_ / "keys.json").string()}}),
      "sk-pod", d);
#endif
}

// deploy/k8s/serve-shared.yaml: servers without a kvtierd of their own reach kvtierd.yaml's
// cluster through its client Service, over TLS. `--kvtierd` names a Service of kvtierd.yaml (not
// the headless one) on the port that leads to kvtierd's native port, whose front the config puts
// under TLS with a certificate and key from a Secret; the server verifies it against a CA from a
// Secret. Started here as the pod starts it (the image's entrypoint and the container's args,
// the Service's address mapped to a kvtierd on loopback whose certificate and CA are what
// deploy/k8s/kvtierd-tls.sh makes, still verified by the Service's name; the Secrets mapped to
// the test's files), the server's second turn hits the first through that kvtierd over TLS.
TEST_F(K8sManifestsTest, TheSharedServeManifestReachesKvtierdOverTls) {
#ifndef KVTIER_ENGINE_PATH
  GTEST_SKIP() << "kvtier-engine is not built in this configuration";
#else
  const json docs = LoadManifests(kDeploy / "k8s/serve-shared.yaml");
  const json* deployment = OfKind(docs, "Deployment");
  ASSERT_NE(deployment, nullptr);
  const std::vector<const json*> services = AllOfKind(docs, "Service");
  const json& pod = deployment->at("spec").at("template").at("spec");
  ASSERT_EQ(pod.at("containers").size(), 1u) << "a server pod with no kvtierd of its own";
  const json& serve = pod.at("containers").at(0);
  const std::map<std::string, std::string> flag = FlagsOf(serve.at("args"));
  EXPECT_FALSE(flag.count("--socket"));

  const json kvtierd_docs = LoadManifests(kDeploy / "k8s/kvtierd.yaml");
  const json* config_map = OfKind(kvtierd_docs, "ConfigMap");
  const json* kvtierd_sts = OfKind(kvtierd_docs, "StatefulSet");
  ASSERT_TRUE(config_map != nullptr && kvtierd_sts != nullptr);
  const json& their_pod = kvtierd_sts->at("spec").at("template").at("spec");
  const json& theirs = their_pod.at("containers").at(0);
  StatusOr<daemon::DaemonOptions> o =
      daemon::ParseConfig(config_map->at("data").at("kvtierd.toml").get<std::string>());
  ASSERT_TRUE(o.ok()) << o.status().ToString();

  // --kvtierd host:port: a client Service of kvtierd.yaml, its port leading to the native port.
  ASSERT_TRUE(flag.count("--kvtierd"));
  const std::string address = flag.at("--kvtierd");
  const size_t colon = address.rfind(':');
  ASSERT_NE(colon, std::string::npos) << address;
  const std::string host = address.substr(0, colon);
  const int port = std::stoi(address.substr(colon + 1));
  const json* service = nullptr;
  for (const auto& d : kvtierd_docs) {
    if (d.at("kind") == "Service" && d.at("metadata").at("name") == host) service = &d;
  }
  ASSERT_NE(service, nullptr) << host << " is not a Service of kvtierd.yaml";
  EXPECT_NE(service->at("spec").value("clusterIP", ""), "None")
      << "a headless Service names no one address";
  std::string target;
  for (const auto& p : service->at("spec").at("ports")) {
    if (p.at("port") == port) target = p.at("targetPort");
  }
  ASSERT_FALSE(target.empty()) << host << " has no port " << port;
  ASSERT_NE(o->native_port, 0);
  EXPECT_EQ(PortsOf(theirs).at(target), o->native_port) << "the Service's port " << port;
  // TLS both ways: kvtierd's native front with its certificate and key from a Secret, the
  // server verifying it against a CA from a Secret, by the name it dials (or the one it gives).
  EXPECT_TRUE(o->tls.native);
  EXPECT_TRUE(FromASecret(their_pod, theirs, o->tls.cert_file));
  EXPECT_TRUE(FromASecret(their_pod, theirs, o->tls.key_file));
  EXPECT_TRUE(flag.count("--kvtierd-tls"));
  ASSERT_TRUE(flag.count("--kvtierd-ca"));
  const std::string ca = flag.at("--kvtierd-ca");
  EXPECT_TRUE(FromASecret(pod, serve, ca, /*or_config_map=*/true));
  const std::string keys = flag.at("--api-keys");
  EXPECT_TRUE(FromASecret(pod, serve, keys));
  EXPECT_EQ(std::to_string(PortsOf(serve).at("api")), flag.at("--port"));
  const ServeImage im = LoadServeImage();
  ExpectServerPod(pod, serve, services, {&serve}, im);
  // The Deployment and its Service select the pods by the template's labels.
  const json& labels = deployment->at("spec").at("template").at("metadata").at("labels");
  EXPECT_EQ(deployment->at("spec").at("selector").at("matchLabels"), labels);
  for (const auto* svc : services) EXPECT_EQ(svc->at("spec").at("selector"), labels);

  // Started here: kvtierd with auth and TLS on its native port, with the certificate and CA
  // that kvtierd-tls.sh makes for the Service; the server dials loopback and checks the
  // certificate against the Service's name.
  const fs::path pki = dir_ / "pki";
  std::string out;
  ASSERT_EQ(kt::RunShell((kDeploy / "k8s/kvtierd-tls.sh").string() + " " + pki.string(), &out), 0)
      << out;
  std::ofstream(dir_ / "tokens.toml")
      << "[[tenant]]\nname = \"t\"\nid = 1\ntoken_sha256 = [\"" << TokenSha256Hex("tok") << "\"]\n";
  kt::KvtierdProcess d(dir_ / "d");
  d.WriteConfig("[auth]\ntokens_file = \"" + (dir_ / "tokens.toml").string() +
                "\"\n[tls]\ncert_file = \"" + (pki / "tls.crt").string() + "\"\nkey_file = \"" +
                (pki / "tls.key").string() + "\"\nnative = true\n");
  const uint16_t native_port = kt::FreePort();
  ASSERT_TRUE(d.Start({"--native-port", std::to_string(native_port)})) << d.Log();
  std::ofstream(dir_ / "keys.json")
      << R"({"keys": [{"key": "sk-pod", "tenant": "t", "daemon_token": "tok"}]})";
  std::vector<std::string> flags = PodFlags(EntrypointFlags(im), serve.at("args"),
                                            {{address, "localhost:" + std::to_string(native_port)},
                                             {ca, (pki / "ca.crt").string()},
                                             {keys, (dir_ / "keys.json").string()}});
  // The name the pod dials, which the certificate must carry.
  if (!flag.count("--kvtierd-server-name"))
    flags.insert(flags.end(), {"--kvtierd-server-name", host});
  ExpectServerResumesTurns(dir_ / "serve", flags, "sk-pod", d);
  const std::string m = kt::Http(d.http_port(), "GET", "/metrics").body;
  EXPECT_GE(kt::Metric(m, "kvtier_tls_handshakes_total{result=\"ok\"}"), 1) << m;
#endif
}

}  // namespace
}  // namespace kvtier
