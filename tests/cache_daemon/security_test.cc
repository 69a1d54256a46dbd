// The security rules of kvtierd's configuration and start: per-front listen addresses and
// [tls] (Finalize), duplicate token digests and the branch-free token lookup, the server
// secret fingerprint, /metrics without tenant series, and TlsFront's certificate checks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "cache_daemon/config.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/server_secret.h"
#include "cache_daemon/tenants.h"
#include "cache_daemon/tls_front.h"
#include "common/key_spec.h"
#include "tests/cache_daemon/tls_test_util.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("kvtier_security_" + std::to_string(getpid()) + "_" + info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

DaemonOptions Base() {
  DaemonOptions o;
  o.data_dir = "/tmp/x";
  return o;
}

TEST(SecurityConfig, ParsesPerFrontAddressesAndTls) {
  auto o = ParseConfig(
      "[server]\nlisten = \"10.0.0.5\"\nresp_listen = \"10.0.0.6\"\nhttp_listen = \"::1\"\n"
      "native_port = 7300\n[auth]\ntokens_file = \"/t.toml\"\n"
      "[tls]\ncert_file = \"/c.pem\"\nkey_file = \"/k.pem\"\nnative = true\nresp = true\n"
      "handshake_timeout_ms = 500\nhandshakes_max = 8\n");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->resp_listen, "10.0.0.6");
  EXPECT_EQ(o->http_listen, "::1");
  EXPECT_TRUE(o->tls.native && o->tls.resp && !o->tls.http);
  EXPECT_EQ(o->tls.cert_file, "/c.pem");
  EXPECT_EQ(o->tls.handshake_timeout_ms, 500u);
  EXPECT_EQ(o->tls.handshakes_max, 8u);
  ASSERT_TRUE(Finalize(&*o).ok());
  EXPECT_EQ(o->native_listen, "10.0.0.5");  // from listen
  EXPECT_FALSE(ParseConfig("[tls]\nnative = \"yes\"\n").ok());
  EXPECT_FALSE(ParseConfig("[tls]\ncertfile = \"/c.pem\"\n").ok());
}

// [server] http_allowed_hosts: bare host names, lower-cased; a port, a scheme or a wildcard
// is an error (the check compares names exactly).
TEST(SecurityConfig, HttpAllowedHostsAreBareNames) {
  auto o = ParseConfig("[server]\nhttp_allowed_hosts = [\"Kvtier-Box\", \"kv.example.org\"]\n");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->http_allowed_hosts, (std::vector<std::string>{"kvtier-box", "kv.example.org"}));
  EXPECT_TRUE(ParseConfig("").value().http_allowed_hosts.empty());
  for (const char* bad :
       {"[\"kv:9180\"]", "[\"http://kv\"]", "[\"*\"]", "[\"\"]", "\"kv\"", "[1]"}) {
    EXPECT_FALSE(ParseConfig(std::string("[server]\nhttp_allowed_hosts = ") + bad + "\n").ok())
        << bad;
  }
}

TEST(SecurityConfig, AdminFrontStaysOnLoopbackByDefault) {
  DaemonOptions o = Base();
  o.listen_address = "127.0.0.2";
  ASSERT_TRUE(Finalize(&o).ok());
  EXPECT_EQ(o.native_listen, "127.0.0.2");
  EXPECT_EQ(o.resp_listen, "127.0.0.2");
  EXPECT_EQ(o.http_listen, "127.0.0.1");
}

TEST(SecurityConfig, NonLoopbackFrontNeedsTls) {
  DaemonOptions o = Base();
  o.tokens_file = "/t.toml";
  o.listen_address = "0.0.0.0";
  Status st = Finalize(&o);
  ASSERT_TRUE(st.IsPermissionDenied()) << st.ToString();
  EXPECT_NE(st.message().find("resp front on non-loopback address '0.0.0.0'"), std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("without TLS"), std::string::npos);
  // TLS on, but no certificate.
  o = Base();
  o.tokens_file = "/t.toml";
  o.listen_address = "0.0.0.0";
  o.tls.resp = true;
  st = Finalize(&o);
  ASSERT_TRUE(st.IsInvalidArgument()) << st.ToString();
  EXPECT_NE(st.message().find("tls.cert_file"), std::string::npos);
  o.tls.cert_file = "/c.pem";
  o.tls.key_file = "/k.pem";
  EXPECT_TRUE(Finalize(&o).ok());
  // The admin front has its own address and its own TLS switch.
  o.http_listen = "192.168.1.10";
  st = Finalize(&o);
  ASSERT_TRUE(st.IsPermissionDenied()) << st.ToString();
  EXPECT_NE(st.message().find("http front"), std::string::npos) << st.ToString();
  o.tls.http = true;
  EXPECT_TRUE(Finalize(&o).ok());
  // A disabled front may name any address.
  o = Base();
  o.tokens_file = "/t.toml";
  o.native_listen = "0.0.0.0";
  EXPECT_TRUE(Finalize(&o).ok()) << "native_port is 0";
  o.native_port = 7300;
  EXPECT_TRUE(Finalize(&o).IsPermissionDenied());
  // listen itself stays loopback-only without auth, even with every TCP port off.
  o = Base();
  o.listen_address = "0.0.0.0";
  o.resp_port = 0;
  o.http_port = 0;
  st = Finalize(&o);
  ASSERT_TRUE(st.IsPermissionDenied());
  EXPECT_NE(st.message().find("refusing to listen on non-loopback address '0.0.0.0'"),
            std::string::npos)
      << st.ToString();
  // Without auth the older rule answers first, for every front.
  o = Base();
  o.http_listen = "0.0.0.0";
  st = Finalize(&o);
  ASSERT_TRUE(st.IsPermissionDenied());
  EXPECT_NE(st.message().find("without authentication"), std::string::npos);
}

TEST(SecurityConfig, RefusesBadAddressesAndTlsLimits) {
  DaemonOptions o = Base();
  o.resp_listen = "example.com";
  Status st = Finalize(&o);
  ASSERT_TRUE(st.IsInvalidArgument());
  EXPECT_NE(st.message().find("server.resp_listen"), std::string::npos) << st.ToString();
  o = Base();
  o.tls.handshake_timeout_ms = 0;
  EXPECT_TRUE(Finalize(&o).IsInvalidArgument());
  o = Base();
  o.tls.handshakes_max = 0;
  EXPECT_TRUE(Finalize(&o).IsInvalidArgument());
  EXPECT_TRUE(IsIpAddressOrLocalhost("::"));
  EXPECT_TRUE(IsIpAddressOrLocalhost("localhost"));
  EXPECT_FALSE(IsIpAddressOrLocalhost("localhost.localdomain"));
  EXPECT_FALSE(IsIpAddressOrLocalhost(""));
}

std::string Tenant(const std::string& name, int id, const std::vector<std::string>& tokens) {
  std::string t =
      "[[tenant]]\nname = \"" + name + "\"\nid = " + std::to_string(id) + "\ntoken_sha256 = [";
  for (size_t i = 0; i < tokens.size(); ++i)
    t += (i ? ", \"" : "\"") + TokenSha256Hex(tokens[i]) + "\"";
  return t + "]\n";
}

TEST(SecurityTenants, RefusesADigestListedTwice) {
  std::vector<uint8_t> secret(32, 1);
  auto across = TenantRegistry::Parse(
      Tenant("alice", 1, {"a1"}) + Tenant("bob", 2, {"b1"}) + Tenant("carol", 3, {"c1", "a1"}),
      secret);
  ASSERT_FALSE(across.ok());
  EXPECT_TRUE(across.status().IsInvalidArgument());
  EXPECT_NE(across.status().message().find("tenants alice and carol share a token_sha256"),
            std::string::npos)
      << across.status().ToString();
  auto within = TenantRegistry::Parse(Tenant("alice", 1, {"a1", "a2", "a1"}), secret);
  ASSERT_FALSE(within.ok());
  EXPECT_NE(within.status().message().find("alice lists the same token_sha256 twice"),
            std::string::npos)
      << within.status().ToString();
}

TEST(SecurityTenants, EveryTokenFindsItsOwnTenant) {
  std::string text;
  for (int t = 1; t <= 5; ++t) {
    std::string n = "t" + std::to_string(t);
    text += Tenant(n, t, {n + "-x", n + "-y", n + "-z"});
  }
  auto reg = TenantRegistry::Parse(text, std::vector<uint8_t>(32, 2));
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  for (int t = 1; t <= 5; ++t) {
    for (const char* s : {"-x", "-y", "-z"}) {
      auto found = (*reg)->Authenticate("t" + std::to_string(t) + s);
      ASSERT_TRUE(found.ok());
      EXPECT_EQ((*found)->id, static_cast<uint64_t>(t));
    }
  }
  for (const char* bad : {"", "t1", "t1-x ", "t6-x", "T1-x"}) {
    EXPECT_TRUE((*reg)->Authenticate(bad).status().IsPermissionDenied()) << bad;
  }
}

TEST(SecuritySecret, FirstStartCreatesSecretAndFingerprint) {
  TempDir d;
  ServerSecretPaths p{d.File("server_secret"), d.File(""), d.File("store")};
  auto s1 = OpenServerSecret(p);
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  EXPECT_EQ(s1->size(), 32u);
  std::ifstream in(d.File(kSecretFingerprintFile));
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), ToHex(SecretFingerprint(*s1)) + "\n");
  // Never the salt of a tenant named like the fingerprint's message.
  EXPECT_NE(SecretFingerprint(*s1), TenantSalt(*s1, "kvtier-secret-fingerprint"));
  auto perms = std::filesystem::status(d.File(kSecretFingerprintFile)).permissions();
  EXPECT_EQ(perms & std::filesystem::perms::others_read, std::filesystem::perms::none);
  auto s2 = OpenServerSecret(p);
  ASSERT_TRUE(s2.ok()) << s2.status().ToString();
  EXPECT_EQ(*s1, *s2);
}

TEST(SecuritySecret, RefusesAnotherSecret) {
  TempDir d;
  ServerSecretPaths p{d.File("server_secret"), d.File(""), d.File("store")};
  ASSERT_TRUE(OpenServerSecret(p).ok());
  std::filesystem::remove(p.secret_file);
  std::ofstream(p.secret_file, std::ios::binary) << std::string(32, 'z');
  auto st = OpenServerSecret(p);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(st.status().IsPermissionDenied()) << st.status().ToString();
  EXPECT_NE(st.status().message().find("not the secret this data directory was written with"),
            std::string::npos);
}

TEST(SecuritySecret, MissingSecretWithDataIsAnError) {
  TempDir d;
  ServerSecretPaths p{d.File("server_secret"), d.File(""), d.File("store")};
  ASSERT_TRUE(OpenServerSecret(p).ok());
  std::filesystem::remove(p.secret_file);
  // The fingerprint says a secret existed.
  auto st = OpenServerSecret(p);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(st.status().IsNotFound()) << st.status().ToString();
  EXPECT_NE(st.status().message().find("server_secret.fingerprint exists"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(p.secret_file));
  // A non-empty store says so too, fingerprint or not.
  std::filesystem::remove(d.File(kSecretFingerprintFile));
  std::filesystem::create_directories(p.store_dir);
  std::ofstream(p.store_dir + "/segment-0") << "x";
  st = OpenServerSecret(p);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("store is not empty"), std::string::npos)
      << st.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(p.secret_file));
  // An empty store directory holds nothing: a first start.
  std::filesystem::remove(p.store_dir + "/segment-0");
  EXPECT_TRUE(OpenServerSecret(p).ok());
}

TEST(SecuritySecret, OlderDataDirectoryGetsAFingerprint) {
  TempDir d;
  ServerSecretPaths p{d.File("server_secret"), d.File(""), d.File("store")};
  auto secret = LoadOrCreateServerSecret(p.secret_file);  // as before fingerprints
  ASSERT_TRUE(secret.ok());
  std::filesystem::create_directories(p.store_dir);
  std::ofstream(p.store_dir + "/segment-0") << "x";
  auto s = OpenServerSecret(p);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(*s, *secret);
  EXPECT_TRUE(std::filesystem::exists(d.File(kSecretFingerprintFile)));
}

TEST(SecuritySecret, UnreadableFingerprintIsCorruption) {
  TempDir d;
  ServerSecretPaths p{d.File("server_secret"), d.File(""), d.File("store")};
  ASSERT_TRUE(OpenServerSecret(p).ok());
  for (const std::string& junk :
       {std::string("abc\n"), std::string(64, 'g'), std::string(), std::string(200, 'a')}) {
    std::ofstream(d.File(kSecretFingerprintFile), std::ios::trunc) << junk;
    auto st = OpenServerSecret(p);
    ASSERT_FALSE(st.ok()) << junk;
    EXPECT_TRUE(st.status().IsCorruption()) << st.status().ToString();
  }
}

TEST(SecurityMetrics, NoTenantSeriesWithoutAdmin) {
  DaemonMetrics m;
  m.engram_fetch.SetTenants({{"alice", 1}, {"bob", 2}});
  wire::EngramReport r;
  r.transport = "tcp";
  r.rows_requested = 10;
  ASSERT_TRUE(m.engram_fetch.Add(1, r).ok());
  r.rows_requested = 5;
  ASSERT_TRUE(m.engram_fetch.Add(2, r).ok());
  storage::Stats s;
  s.dram.used_bytes = 4096;
  s.tenant_bytes = {{1, 1000}, {2, 3096}};
  DaemonMetrics::Extra e;
  e.tenants = {{"alice", 1}, {"bob", 2}};
  std::string full = m.RenderPrometheus(s, e);
  EXPECT_NE(full.find("kvtier_tenant_used_bytes{tenant=\"bob\"} 3096\n"), std::string::npos);
  EXPECT_NE(full.find("kvtier_engram_fetch_rows_requested_total{tenant=\"alice\","
                      "transport=\"tcp\"} 10\n"),
            std::string::npos);
  e.tenant_series = false;
  std::string agg = m.RenderPrometheus(s, e);
  EXPECT_EQ(agg.find("tenant="), std::string::npos) << agg;
  EXPECT_NE(agg.find("kvtier_tier_used_bytes{tier=\"dram\"} 4096\n"), std::string::npos);
  EXPECT_NE(agg.find("kvtier_engram_fetch_rows_requested_total{transport=\"tcp\"} 15\n"),
            std::string::npos)
      << agg;
}

TEST(SecurityTls, CreateChecksCertificateAndKey) {
  TempDir d;
  kt::TestPki pki, other;
  ASSERT_TRUE(kt::MakeTestPki(d.File("pki"), &pki));
  ASSERT_TRUE(kt::MakeTestPki(d.File("other"), &other));
  TlsServeOptions o;
  o.cert_file = pki.cert_file;
  o.key_file = pki.key_file;
  EXPECT_TRUE(TlsFront::Create(o, /*write_stall_ms=*/1000).ok());
  o.cert_file = d.File("missing.pem");
  auto st = TlsFront::Create(o, /*write_stall_ms=*/1000);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("tls.cert_file"), std::string::npos);
  o.cert_file = pki.cert_file;
  o.key_file = other.key_file;  // another certificate's key
  st = TlsFront::Create(o, /*write_stall_ms=*/1000);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("private key of the certificate in " + pki.cert_file),
            std::string::npos)
      << st.status().ToString();
  std::ofstream(d.File("junk.pem")) << "-----BEGIN CERTIFICATE-----\nAAAA\n";
  o.cert_file = d.File("junk.pem");
  o.key_file = pki.key_file;
  st = TlsFront::Create(o, /*write_stall_ms=*/1000);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("not a PEM certificate chain"), std::string::npos)
      << st.status().ToString();
}

}  // namespace
}  // namespace kvtier::daemon
