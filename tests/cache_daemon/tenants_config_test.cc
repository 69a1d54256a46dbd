// Tenants (tokens file, hashed tokens, salts, in-flight limits), config loading, metrics
// rendering and the trace writer.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "cache_daemon/config.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/tenants.h"
#include "cache_daemon/trace_writer.h"
#include "common/key_spec.h"
#include "storage/ssd_tier.h"

namespace kvtier::daemon {
namespace {

std::vector<uint8_t> Secret(uint8_t b) { return std::vector<uint8_t>(32, b); }

std::string TwoTenants() {
  return "[[tenant]]\nname = \"alice\"\nid = 1\ntoken_sha256 = [\"" + TokenSha256Hex("tok-a") +
         "\", \"" + TokenSha256Hex("tok-a2") +
         "\"]\nquota_bytes = 1000\ninflight_max = 2\n\n"
         "[[tenant]]\nname = \"bob\"\nid = 2\nadmin = true\ntoken_sha256 = [\"" +
         TokenSha256Hex("tok-b") + "\"]\n";
}

TEST(Tenants, AuthenticatesHashedTokens) {
  auto reg = TenantRegistry::Parse(TwoTenants(), Secret(1));
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_TRUE((*reg)->auth_enabled());
  EXPECT_EQ((*reg)->default_tenant(), nullptr);
  auto a = (*reg)->Authenticate("tok-a");
  auto a2 = (*reg)->Authenticate("tok-a2");
  auto b = (*reg)->Authenticate("tok-b");
  ASSERT_TRUE(a.ok() && a2.ok() && b.ok());
  EXPECT_EQ((*a)->name, "alice");
  EXPECT_EQ(*a, *a2);
  EXPECT_EQ((*a)->quota_bytes, 1000u);
  EXPECT_FALSE((*a)->admin);
  EXPECT_TRUE((*b)->admin);
  EXPECT_TRUE((*reg)->Authenticate("tok-c").status().IsPermissionDenied());
  EXPECT_TRUE((*reg)->Authenticate("").status().IsPermissionDenied());
  // The digest itself is not a token.
  EXPECT_FALSE((*reg)->Authenticate(TokenSha256Hex("tok-a")).ok());
}

// FindById answers for every tenant of a tokens file and of the auth-off registry, and
// nullptr for an id nobody has.
TEST(Tenants, FindsEveryTenantById) {
  auto reg = TenantRegistry::Parse(TwoTenants(), Secret(1));
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  ASSERT_NE((*reg)->FindById(1), nullptr);
  EXPECT_EQ((*reg)->FindById(1)->name, "alice");
  ASSERT_NE((*reg)->FindById(2), nullptr);
  EXPECT_EQ((*reg)->FindById(2)->name, "bob");
  EXPECT_EQ((*reg)->FindById(0), nullptr);
  EXPECT_EQ((*reg)->FindById(3), nullptr);
  auto off = TenantRegistry::Open(Secret(1), 8);
  ASSERT_NE(off->FindById(0), nullptr);
  EXPECT_EQ(off->FindById(0), off->default_tenant());
  EXPECT_EQ(off->FindById(1), nullptr);
}

TEST(Tenants, SaltIsDerivedFromSecretAndName) {
  auto r1 = TenantRegistry::Parse(TwoTenants(), Secret(1));
  auto r1b = TenantRegistry::Parse(TwoTenants(), Secret(1));
  auto r2 = TenantRegistry::Parse(TwoTenants(), Secret(2));
  ASSERT_TRUE(r1.ok() && r1b.ok() && r2.ok());
  const auto& t1 = (*r1)->tenants();
  EXPECT_NE(t1[0]->salt, t1[1]->salt);                     // two tenants differ
  EXPECT_EQ(t1[0]->salt, (*r1b)->tenants()[0]->salt);      // stable across restarts
  EXPECT_NE(t1[0]->salt, (*r2)->tenants()[0]->salt);       // bound to the server secret
  EXPECT_EQ(t1[0]->salt, TenantSalt(Secret(1), "alice"));  // DESIGN §3
}

TEST(Tenants, RejectsBadFiles) {
  const std::string bad[] = {
      "",
      "[[tenant]]\nname = \"a\"\nid = 1\n",
      "[[tenant]]\nname = \"a\"\nid = 1\ntoken_sha256 = [\"zz\"]\n",
      "[[tenant]]\nname = \"a\"\nid = 0\ntoken_sha256 = [\"" + TokenSha256Hex("x") + "\"]\n",
      TwoTenants() + "[[tenant]]\nname = \"alice\"\nid = 3\ntoken_sha256 = [\"" +
          TokenSha256Hex("y") + "\"]\n",
      "[[tenant\n"};
  for (const std::string& text : bad) {
    EXPECT_TRUE(TenantRegistry::Parse(text, Secret(1)).status().IsInvalidArgument()) << text;
  }
}

TEST(Tenants, InflightLimitIsEnforcedAndReleased) {
  auto reg = TenantRegistry::Parse(TwoTenants(), Secret(1));
  ASSERT_TRUE(reg.ok());
  const Tenant& alice = *(*reg)->tenants()[0];
  {
    auto s1 = AcquireInflight(alice);
    auto s2 = AcquireInflight(alice);
    ASSERT_TRUE(s1.ok() && s2.ok());
    EXPECT_TRUE(AcquireInflight(alice).status().IsRejected());
    EXPECT_EQ(alice.inflight.load(), 2u);
  }
  EXPECT_EQ(alice.inflight.load(), 0u);
  EXPECT_TRUE(AcquireInflight(alice).ok());
}

TEST(Tenants, ServerSecretIsCreatedOnceAndReused) {
  auto dir = std::filesystem::temp_directory_path() / ("kvtier_secret_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::string path = (dir / "secret").string();
  auto s1 = LoadOrCreateServerSecret(path);
  auto s2 = LoadOrCreateServerSecret(path);
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(s1->size(), 32u);
  EXPECT_EQ(*s1, *s2);
  auto perms = std::filesystem::status(path).permissions();
  EXPECT_EQ(perms & std::filesystem::perms::others_read, std::filesystem::perms::none);
  std::filesystem::remove_all(dir);
}

TEST(Config, DefaultsWorkWithNoFile) {
  auto o = ParseConfig("");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->listen_address, "127.0.0.1");
  EXPECT_EQ(o->storage.durability, storage::Durability::kBatched);
  DaemonOptions d = *o;
  ASSERT_TRUE(Finalize(&d).ok());
  EXPECT_FALSE(d.data_dir.empty());
  EXPECT_EQ(d.socket_path, d.data_dir + "/kvtierd.sock");
}

TEST(Config, ParsesEveryTableAndRejectsUnknownKeys) {
  auto o = ParseConfig(
      "[server]\nresp_port = 7000\nio_threads = 3\n[limits]\nmax_frame_bytes = 8192\n"
      "[storage]\ndurability = \"sync\"\ndram_capacity_bytes = 1048576\n"
      "[policy]\neviction = \"lru\"\nseed = 9\n[policy.params]\nttl_ms = 5\n");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->resp_port, 7000);
  EXPECT_EQ(o->io_threads, 3u);
  EXPECT_EQ(o->max_frame_bytes, 8192u);
  EXPECT_EQ(o->storage.durability, storage::Durability::kSync);
  EXPECT_EQ(o->storage.policy_params.seed, 9u);
  ASSERT_EQ(o->storage.policy_params.values.size(), 1u);
  EXPECT_EQ(o->storage.policy_params.values[0].second, "5");
  EXPECT_TRUE(ParseConfig("[server]\nresp_prot = 1\n").status().IsInvalidArgument());
  EXPECT_TRUE(ParseConfig("[server]\nresp_port = 70000\n").status().IsInvalidArgument());
  EXPECT_TRUE(ParseConfig("[storage]\ndurability = \"fast\"\n").status().IsInvalidArgument());
  EXPECT_TRUE(ParseConfig("[server\n").status().IsInvalidArgument());
}

// An integer key given a float: a whole number in int64_t's range is taken (toml++'s own
// conversion accepts it), a fraction is refused, and so is a float beyond the range, checked
// before any cast (toml++'s value<int64_t>() cast it first: undefined behaviour, fatal in the
// asan preset's UBSan; found by kvtier_daemon_config_fuzz). Every reader of the daemon's
// config and of its tokens file: limits, the policy seed and params, [cluster], tenant ids.
TEST(Config, IntegerKeysTakeWholeFloatsAndRefuseTheRest) {
  auto whole = ParseConfig("[server]\nio_threads = 3.0\n");
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->io_threads, 3u);
  for (const std::string v : {"2.5", "1e92", "-1e92", "9.3e18", "inf", "-inf", "nan"}) {
    EXPECT_TRUE(ParseConfig("[server]\nio_threads = " + v + "\n").status().IsInvalidArgument())
        << v;
    EXPECT_TRUE(ParseConfig("[policy]\nseed = " + v + "\n").status().IsInvalidArgument()) << v;
    EXPECT_TRUE(ParseConfig("[cluster]\nreplicas = " + v + "\n").status().IsInvalidArgument()) << v;
    EXPECT_TRUE(TenantRegistry::Parse("[[tenant]]\nname = \"a\"\nid = " + v +
                                          "\ntoken_sha256 = [\"" + TokenSha256Hex("x") + "\"]\n",
                                      Secret(1))
                    .status()
                    .IsInvalidArgument())
        << v;
  }
  // A policy parameter is passed on as text: a float stays a float.
  auto param = ParseConfig("[policy.params]\nttl_ms = 1e92\n");
  ASSERT_TRUE(param.ok()) << param.status().ToString();
  ASSERT_EQ(param->storage.policy_params.values.size(), 1u);
  EXPECT_EQ(param->storage.policy_params.values[0].second, "1e+92");
}

// The sync commit delay (docs/format/ssd.md, "Commit delay"): default, parsed, bounded.
TEST(Config, SsdCommitDelayIsBoundedToOneSecond) {
  auto def = ParseConfig("");
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def->storage.ssd_commit_delay_us, storage::SsdOptions::kDefaultCommitDelayUs);
  for (uint32_t us : {0u, 250u, storage::SsdOptions::kMaxCommitDelayUs}) {
    auto o = ParseConfig("[storage]\nssd_commit_delay_us = " + std::to_string(us) + "\n");
    ASSERT_TRUE(o.ok()) << us;
    EXPECT_EQ(o->storage.ssd_commit_delay_us, us);
    DaemonOptions d = *o;
    EXPECT_TRUE(Finalize(&d).ok()) << us;
  }
  auto over = ParseConfig("[storage]\nssd_commit_delay_us = 1000001\n");
  ASSERT_TRUE(over.ok());
  DaemonOptions d = *over;
  Status st = Finalize(&d);
  EXPECT_TRUE(st.IsInvalidArgument());
  EXPECT_NE(st.ToString().find("storage.ssd_commit_delay_us"), std::string::npos) << st.ToString();
  EXPECT_TRUE(ParseConfig("[storage]\nssd_commit_delay_us = -1\n").status().IsInvalidArgument());
}

// The free space left to the SSD index (docs/format/ssd.md, "Free space for the index"):
// 256 MiB by default, any byte count, 0 turns it off; passed to the store.
TEST(Config, SsdDiskFreeMinBytesDefaultsTo256MiBAndZeroTurnsItOff) {
  auto def = ParseConfig("");
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def->storage.ssd_disk_free_min_bytes, 256ull << 20);
  for (uint64_t bytes : {0ull, 8388608ull, 1ull << 40}) {
    auto o = ParseConfig("[storage]\nssd_disk_free_min_bytes = " + std::to_string(bytes) + "\n");
    ASSERT_TRUE(o.ok()) << bytes;
    EXPECT_EQ(o->storage.ssd_disk_free_min_bytes, bytes);
  }
  EXPECT_TRUE(
      ParseConfig("[storage]\nssd_disk_free_min_bytes = -1\n").status().IsInvalidArgument());
  EXPECT_TRUE(
      ParseConfig("[storage]\nssd_disk_free_min_bytes = \"256M\"\n").status().IsInvalidArgument());
}

// Object limits per tier: absent keys leave 0 (the store derives them from the capacities),
// given ones are passed through.
TEST(Config, ObjectLimitsArePassedToTheStore) {
  auto def = ParseConfig("");
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def->storage.dram_objects_max, 0u);
  EXPECT_EQ(def->storage.ssd_objects_max, 0u);
  auto o = ParseConfig(
      "[storage]\nhbm_objects_max = 7\ndram_objects_max = 4096\nssd_objects_max = 100000\n");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->storage.hbm_objects_max, 7u);
  EXPECT_EQ(o->storage.dram_objects_max, 4096u);
  EXPECT_EQ(o->storage.ssd_objects_max, 100000u);
  EXPECT_TRUE(ParseConfig("[storage]\nssd_objects_max = -3\n").status().IsInvalidArgument());
}

// The prefix layer under every tier's policy (docs/POLICIES.md, "Structures"): off by default.
TEST(Config, EvictionStructureIsPlainOrPrefix) {
  auto plain = ParseConfig("");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->storage.eviction_structure, policies::Structure::kPlain);
  auto prefix = ParseConfig("[storage]\neviction_structure = \"prefix\"\n");
  ASSERT_TRUE(prefix.ok()) << prefix.status().ToString();
  EXPECT_EQ(prefix->storage.eviction_structure, policies::Structure::kPrefix);
  for (const char* bad : {"\"Prefix\"", "\"\"", "1"}) {
    auto st = ParseConfig(std::string("[storage]\neviction_structure = ") + bad + "\n").status();
    EXPECT_TRUE(st.IsInvalidArgument()) << bad;
    EXPECT_NE(st.message().find("storage.eviction_structure"), std::string::npos) << st.ToString();
  }
}

TEST(Config, PolicyParamsScopeToAKnownPolicyOnly) {
  auto o = ParseConfig("[policy.params]\n\"write-budget:bytes_per_day\" = 1000\n");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->storage.policy_params.values[0].first, "write-budget:bytes_per_day");
  // A misspelt scope would otherwise be dropped by every policy, silently.
  auto bad = ParseConfig("[policy.params]\n\"write-budgte:bytes_per_day\" = 1000\n");
  EXPECT_TRUE(bad.status().IsInvalidArgument()) << bad.status().ToString();
}

TEST(Config, RefusesNonLoopbackWithoutAuth) {
  DaemonOptions o;
  o.data_dir = "/tmp/x";
  o.listen_address = "0.0.0.0";
  Status st = Finalize(&o);
  EXPECT_TRUE(st.IsPermissionDenied());
  EXPECT_NE(st.message().find("without authentication"), std::string::npos);
  o.tokens_file = "/etc/kvtier/tokens.toml";
  // With auth, a non-loopback front still needs TLS (security_test.cc has the details).
  EXPECT_TRUE(Finalize(&o).IsPermissionDenied());
  o.tls = {.cert_file = "/c.pem", .key_file = "/k.pem", .native = true, .resp = true};
  EXPECT_TRUE(Finalize(&o).ok());
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackAddress("127.3.0.1"));
  EXPECT_TRUE(IsLoopbackAddress("::1"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackAddress("::"));
}

TEST(Metrics, RendersFamiliesWithoutKeys) {
  DaemonMetrics m;
  m.RecordRequest(Op::kGet, StatusCode::kOk, 120);
  m.RecordRequest(Op::kGet, StatusCode::kNotFound, 3000000);
  storage::Stats s;
  s.dram.hits = 5;
  s.misses_evicted = 2;
  s.tenant_bytes = {{1, 4096}};
  DaemonMetrics::Extra e;
  e.tenants = {{"alice", 1}};
  e.eviction_policy = "lru";
  e.admission_policy = "admit-all";
  std::string page = m.RenderPrometheus(s, e);
  EXPECT_NE(page.find("kvtier_tier_hits_total{tier=\"dram\"} 5\n"), std::string::npos);
  EXPECT_NE(page.find("kvtier_misses_total{reason=\"evicted\"} 2\n"), std::string::npos);
  EXPECT_NE(page.find("kvtier_tenant_used_bytes{tenant=\"alice\"} 4096\n"), std::string::npos);
  EXPECT_NE(page.find("kvtier_requests_total{op=\"get\",code=\"not_found\"} 1\n"),
            std::string::npos);
  EXPECT_NE(page.find("kvtier_request_duration_seconds_bucket{op=\"get\",le=\"0.00025\"} 1\n"),
            std::string::npos);
  EXPECT_NE(page.find("kvtier_request_duration_seconds_bucket{op=\"get\",le=\"+Inf\"} 2\n"),
            std::string::npos);
  EXPECT_NE(page.find("kvtier_request_duration_seconds_count{op=\"get\"} 2\n"), std::string::npos);
  EXPECT_EQ(EscapeLabel("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST(Trace, WritesZstdJsonLines) {
  auto path = std::filesystem::temp_directory_path() /
              ("kvtier_trace_" + std::to_string(getpid()) + ".jsonl.zst");
  auto w = TraceWriter::Open(path.string(), 16);
  ASSERT_TRUE(w.ok());
  for (uint32_t i = 0; i < 10; ++i) {
    TraceRecord r;
    r.op = i % 2 ? "get" : "put";
    r.tenant = 3;
    r.ids = {i, i + 1};
    r.bytes = 100 * i;
    r.unit_tokens = 64;
    (*w)->Record(std::move(r));
  }
  ASSERT_TRUE((*w)->Close().ok());
  std::ifstream in(path, std::ios::binary);
  std::string comp((std::istreambuf_iterator<char>(in)), {});
  unsigned long long n = ZSTD_getFrameContentSize(comp.data(), comp.size());
  std::string text;
  if (n == ZSTD_CONTENTSIZE_UNKNOWN || n == ZSTD_CONTENTSIZE_ERROR) n = 1 << 20;
  text.resize(n);
  size_t got = ZSTD_decompress(text.data(), text.size(), comp.data(), comp.size());
  ASSERT_FALSE(ZSTD_isError(got)) << ZSTD_getErrorName(got);
  text.resize(got);
  std::istringstream lines(text);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    EXPECT_NE(line.find("\"tenant\":3"), std::string::npos);
    EXPECT_NE(line.find("\"unit_tokens\":64"), std::string::npos);
    ++count;
  }
  EXPECT_EQ(count + static_cast<int>((*w)->dropped()), 10);
  EXPECT_GT(count, 0);
  EXPECT_EQ(TraceWriter::FormatLine(TraceRecord{5, "lookup", 1, {7, 8}, 0, 16}),
            "{\"ts_ms\":5,\"op\":\"lookup\",\"tenant\":1,\"ids\":[7,8],\"bytes\":0,"
            "\"unit_tokens\":16}");
  // A record of a request (an engine turn's): its id, so the simulator replays it as one.
  EXPECT_EQ(TraceWriter::FormatLine(TraceRecord{5, "get", 1, {7}, 4096, 16, 9}),
            "{\"ts_ms\":5,\"op\":\"get\",\"tenant\":1,\"ids\":[7],\"bytes\":4096,"
            "\"unit_tokens\":16,\"request\":9}");
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvtier::daemon
