// kvtierd serving Engram tables ([engram]), in-process over real sockets against the test-only
// fake store: a synthetic `kvtier engram build`-style directory with two shards on different
// endpoints (only ours is served) -> ENGRAM_GRANT over the native client -> an
// rdma::TcpTransport opens the region with the token and reads rows bit for bit equal to the
// table file. Refusals (unauthenticated, wrong tenant, expired, unknown region), ENGRAM_REPORT
// sums on /metrics (checked with promtool when installed), startup failures, and no secret in
// the daemon's log output.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "cache_daemon/daemon.h"
#include "common/key_spec.h"
#include "common/temp_dir.h"
#include "rdma/engram_table.h"
#include "rdma/tcp_transport.h"
#include "tests/cache_daemon/fake_tier_manager.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;

constexpr uint32_t kRowDim = 64;  // stride EngramRowBytes(64) = 66 bytes
constexpr uint64_t kSeed = 7;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TokenHex(const wire::EngramToken& t) {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : t) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

// Redirects fd 2 (KVTIER_LOG's destination) to a file for the object's lifetime.
class StderrCapture {
 public:
  explicit StderrCapture(std::string path) : path_(std::move(path)) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrCapture() { Restore(); }
  std::string Restore() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      ::dup2(saved_, 2);
      ::close(saved_);
      saved_ = -1;
    }
    return ReadAll(path_);
  }

 private:
  std::string path_;
  int saved_ = -1;
};

class EngramDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    engram_dir_ = dir_.File("engram");
    std::filesystem::create_directories(engram_dir_);
    port_ = kt::FreePort();
    other_port_ = kt::FreePort();
    // Two shards of one table on two servers; this daemon is the first. Only its file exists:
    // the daemon must not even open the other one.
    rdma::EngramTableHeader h;
    h.row_dim = kRowDim;
    h.row_begin = 0;
    h.row_count = 100;
    h.row_stride_bytes = rdma::EngramRowBytes(kRowDim);
    h.layer_id = 1;
    ASSERT_TRUE(rdma::GenerateEngramTable(engram_dir_ + "/engram.l1.s0.engram", h, kSeed).ok());
    WriteShards("engram.l1.s0", port_, "engram.l1.s1", other_port_);
  }

  void TearDown() override {
    if (daemon_) {
      daemon_->Shutdown();
      EXPECT_TRUE(daemon_->Wait().ok());
    }
  }

  void WriteShards(const std::string& r0, uint16_t p0, const std::string& r1, uint16_t p1) {
    std::ofstream(engram_dir_ + "/shards.toml")
        << "[[engram.l1.shard]]\nregion = \"" << r0 << "\"\nendpoint = \"127.0.0.1:" << p0
        << "\"\nrow_begin = 0\nrow_end = 100\n\n[[engram.l1.shard]]\nregion = \"" << r1
        << "\"\nendpoint = \"127.0.0.1:" << p1 << "\"\nrow_begin = 100\nrow_end = 200\n";
  }

  DaemonOptions Options() {
    DaemonOptions o;
    o.data_dir = dir_.File("data");
    std::filesystem::create_directories(o.data_dir);
    o.socket_path = dir_.File("d.sock");
    o.resp_port = 0;
    o.http_port = http_port_;
    o.tokens_file = "inline";
    o.engram.enabled = true;
    o.engram.listen = "127.0.0.1:" + std::to_string(port_);
    o.engram.dir = engram_dir_;
    o.engram.grant_ttl_ms_max = 60000;
    o.engram.grant_ttl_ms = 30000;
    return o;
  }

  StatusOr<std::unique_ptr<Daemon>> StartWith(DaemonOptions o) {
    KVTIER_RETURN_IF_ERROR(Finalize(&o));
    std::vector<uint8_t> secret(32, 9);
    std::string text = "[[tenant]]\nname = \"alice\"\nid = 1\nadmin = true\ntoken_sha256 = [\"" +
                       TokenSha256Hex("tok-alice") + "\"]\n[[tenant]]\nname = \"bob\"\nid = 2\n" +
                       "token_sha256 = [\"" + TokenSha256Hex("tok-bob") + "\"]\n";
    KVTIER_ASSIGN_OR_RETURN(auto tenants, TenantRegistry::Parse(text, secret));
    return Daemon::Start(o, std::make_unique<kt::FakeTierManager>(), std::move(tenants), nullptr);
  }

  // Starts a daemon on Options() as changed by `adjust`, with an HTTP front when `http`.
  // When another process bound one of the ports first (FreePort() only finds ports free a
  // moment ago), picks new ones, rewrites shards.toml and tries again.
  StatusOr<std::unique_ptr<Daemon>> StartRetrying(
      bool http, const std::function<void(DaemonOptions*)>& adjust = nullptr) {
    for (int attempt = 1;; ++attempt) {
      http_port_ = http ? kt::FreePort() : 0;
      DaemonOptions o = Options();
      if (adjust) adjust(&o);
      StatusOr<std::unique_ptr<Daemon>> d = StartWith(o);
      if (d.ok() || attempt == kt::kAddressInUseAttemptsMax ||
          !kt::AddressInUse(d.status().message())) {
        return d;
      }
      port_ = kt::FreePort();
      other_port_ = kt::FreePort();
      WriteShards("engram.l1.s0", port_, "engram.l1.s1", other_port_);
    }
  }

  void Start() {
    auto d = StartRetrying(/*http=*/true);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    daemon_ = std::move(d).value();
  }

  std::unique_ptr<Client> Connect(const std::string& token) {
    ClientOptions co;
    co.socket_path = dir_.File("d.sock");
    co.token = token;
    co.shm_bytes = 0;
    auto c = Client::Connect(co);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  std::unique_ptr<rdma::TcpTransport> Transport() {
    rdma::TransportOptions to;
    to.reconnect_on_submit = false;
    auto t = rdma::TcpTransport::Create({"127.0.0.1", port_}, to);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  }

  static rdma::RegionCredentials Creds(const wire::EngramGrantedRegion& g, std::string tenant) {
    rdma::RegionCredentials c;
    c.region_name = g.name;
    c.tenant = std::move(tenant);
    std::copy(g.token.begin(), g.token.end(), c.token.begin());
    return c;
  }

  TempDir dir_{"kvtier-engramd-"};
  std::string engram_dir_;
  uint16_t port_ = 0, other_port_ = 0, http_port_ = 0;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(EngramDaemonTest, GrantThenReadRowsBitForBitAndRefusals) {
  StderrCapture log(dir_.File("daemon.log"));
  Start();
  auto alice = Connect("tok-alice");
  ASSERT_NE(alice, nullptr);

  auto g = alice->EngramGrant({}, 0);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->endpoint, "127.0.0.1:" + std::to_string(port_));
  EXPECT_EQ(g->tenant, "alice");
  EXPECT_EQ(g->ttl_ms, 30000u);  // engram.grant_ttl_ms
  EXPECT_EQ(g->shards_toml, ReadAll(engram_dir_ + "/shards.toml"));
  ASSERT_EQ(g->regions.size(), 1u);  // only the shard assigned to this endpoint
  EXPECT_EQ(g->regions[0].name, "engram.l1.s0");
  uint64_t now_ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              std::chrono::system_clock::now().time_since_epoch())
                                              .count());
  EXPECT_GT(g->regions[0].expires_unix_ms, now_ms + 20000);
  EXPECT_LE(g->regions[0].expires_unix_ms, now_ms + 30000);

  // The other server's shard, an unknown region, a ttl over the max, a duplicate name.
  std::vector<std::string> other = {"engram.l1.s1"};
  EXPECT_TRUE(alice->EngramGrant(other, 0).status().IsNotFound());
  std::vector<std::string> ours = {"engram.l1.s0"};
  EXPECT_TRUE(alice->EngramGrant(ours, 60001).status().IsInvalidArgument());
  std::vector<std::string> twice = {"engram.l1.s0", "engram.l1.s0"};
  EXPECT_TRUE(alice->EngramGrant(twice, 0).status().IsInvalidArgument());

  // Read the whole region with the granted token; bytes equal the file past its header.
  auto t = Transport();
  ASSERT_NE(t, nullptr);
  auto info = t->OpenRegion(Creds(g->regions[0], "alice"));
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->row_begin, 0u);
  EXPECT_EQ(info->row_count, 100u);
  EXPECT_EQ(info->row_dim, kRowDim);
  const uint32_t stride = rdma::EngramRowBytes(kRowDim);
  ASSERT_EQ(info->row_stride_bytes, stride);
  std::vector<uint8_t> buf(100 * stride, 0xEE);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::vector<rdma::ReadOp> ops;
  for (uint64_t r = 0; r < 100; r += 10) {  // ten reads of ten rows each, in reverse order
    uint64_t row = 90 - r;
    ops.push_back({info->id, row * stride, 10 * stride, buf.data() + row * stride});
  }
  ASSERT_TRUE(rdma::ReadSync(*t, ops).ok());
  std::string file = ReadAll(engram_dir_ + "/engram.l1.s0.engram");
  ASSERT_EQ(file.size(), rdma::kEngramTableHeaderBytes + buf.size());
  EXPECT_EQ(0, std::memcmp(buf.data(), file.data() + rdma::kEngramTableHeaderBytes, buf.size()));
  std::vector<uint8_t> expect(stride);
  rdma::FillSyntheticEngramRow(kSeed, 57, kRowDim, expect.data());
  EXPECT_EQ(0, std::memcmp(buf.data() + 57 * stride, expect.data(), stride));

  // Wrong tenant (alice's token presented as bob) and a made-up token are refused.
  auto t2 = Transport();
  EXPECT_TRUE(t2->OpenRegion(Creds(g->regions[0], "bob")).status().IsPermissionDenied());
  wire::EngramGrantedRegion forged = g->regions[0];
  forged.token[0] ^= 1;
  EXPECT_TRUE(t2->OpenRegion(Creds(forged, "alice")).status().IsPermissionDenied());

  // Expired: a 300 ms grant, used after it ran out.
  auto short_grant = alice->EngramGrant(ours, 300);
  ASSERT_TRUE(short_grant.ok()) << short_grant.status().ToString();
  EXPECT_EQ(short_grant->regions[0].expires_unix_ms - now_ms < 10000, true);
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  auto t3 = Transport();
  EXPECT_TRUE(
      t3->OpenRegion(Creds(short_grant->regions[0], "alice")).status().IsPermissionDenied());

  // Unauthenticated: a connection without a token may not ask for grants.
  auto anon = Connect("");
  ASSERT_NE(anon, nullptr);
  EXPECT_TRUE(anon->EngramGrant({}, 0).status().IsPermissionDenied());
  EXPECT_TRUE(anon->EngramReport(wire::EngramReport{.transport = "tcp"}).IsPermissionDenied());

  // The row server's counters and the grants appear on /metrics (no tokens there either).
  std::string metrics = kt::HttpRequest(http_port_, "GET", "/metrics");
  EXPECT_NE(metrics.find("kvtier_engram_server_ops_total{transport=\"tcp\"} 10\n"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("kvtier_engram_server_bytes_total{transport=\"tcp\"} " +
                         std::to_string(100 * stride) + "\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("kvtier_engram_server_permission_denied_total{transport=\"tcp\"} 3\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("kvtier_engram_regions 1\n"), std::string::npos);
  EXPECT_NE(metrics.find("kvtier_engram_grants_issued_total 2\n"), std::string::npos);
  EXPECT_NE(metrics.find("kvtier_requests_total{op=\"engram_grant\",code=\"ok\"} 2\n"),
            std::string::npos);

  t.reset();
  t2.reset();
  t3.reset();
  daemon_->Shutdown();
  EXPECT_TRUE(daemon_->Wait().ok());
  daemon_.reset();
  // Shutdown closed the row server too.
  int fd = kt::ConnectTcp(port_);
  EXPECT_LT(fd, 0);
  if (fd >= 0) ::close(fd);

  // Secrets never in the daemon's log output; the capture itself worked.
  std::string text = log.Restore();
  EXPECT_NE(text.find("engram: 1 grants for tenant alice"), std::string::npos) << text;
  EXPECT_NE(text.find("engram: serving 1 regions"), std::string::npos) << text;
  for (const auto* grant : {&*g, &*short_grant}) {
    const wire::EngramToken& tok = grant->regions[0].token;
    std::string hex = TokenHex(tok);
    std::string upper = hex;
    for (char& c : upper) c = static_cast<char>(std::toupper(c));
    EXPECT_EQ(text.find(hex), std::string::npos);
    EXPECT_EQ(text.find(upper), std::string::npos);
    EXPECT_EQ(text.find(std::string(tok.begin(), tok.end())), std::string::npos);
    EXPECT_EQ(metrics.find(hex), std::string::npos);
  }
  EXPECT_EQ(text.find("tok-alice"), std::string::npos);
}

// Shutdown while row clients read on several connections, half of them hanging up at the
// same moment, and a native client sends requests: the row server's sessions run on the
// daemon's two I/O threads, so before each ran on a strand a client's hang-up and Stop()
// closed one socket on two threads at once (SIGSEGV in the reactor). Several rounds, each
// a fresh daemon.
TEST_F(EngramDaemonTest, ShutdownWhileRowClientsReadAndHangUpIsClean) {
  constexpr int kRounds = 8;
  constexpr int kReaders = 8;
  const uint32_t stride = rdma::EngramRowBytes(kRowDim);
  for (int round = 0; round < kRounds; ++round) {
    Start();
    auto alice = Connect("tok-alice");
    ASSERT_NE(alice, nullptr);
    auto g = alice->EngramGrant({}, 0);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    std::vector<std::pair<std::unique_ptr<rdma::TcpTransport>, rdma::RegionId>> conns;
    for (int i = 0; i < kReaders; ++i) {
      auto t = Transport();
      ASSERT_NE(t, nullptr);
      auto info = t->OpenRegion(Creds(g->regions[0], "alice"));
      ASSERT_TRUE(info.ok()) << info.status().ToString();
      conns.emplace_back(std::move(t), info->id);
    }
    std::atomic<bool> go{false};
    std::atomic<int> reads_ok{0};
    std::vector<std::thread> readers;
    for (int i = 0; i < kReaders; ++i) {
      readers.emplace_back([&, i, t = std::move(conns[i].first), id = conns[i].second]() mutable {
        std::vector<uint8_t> buf(4 * stride);
        if (!t->RegisterLocalBuffer(buf.data(), buf.size()).ok()) return;
        for (uint64_t n = 0;; ++n) {
          if (i % 2 == 0 && go.load()) return t.reset();  // hangs up during the shutdown
          std::vector<rdma::ReadOp> ops;
          for (uint64_t k = 0; k < 4; ++k) {
            const uint64_t row = (n * 4 + k) % 100;
            ops.push_back({id, row * stride, stride, buf.data() + k * stride});
          }
          if (!rdma::ReadSync(*t, ops).ok()) return;  // the server closed the connection
          reads_ok.fetch_add(1);
        }
      });
    }
    std::thread native([&] {
      while (!go.load()) {
        if (!alice->EngramReport(wire::EngramReport{.transport = "tcp"}).ok()) return;
      }
      (void)alice->EngramReport(wire::EngramReport{.transport = "tcp"});
    });
    for (int i = 0; i < 10000 && reads_ok.load() < kReaders; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    go.store(true);
    daemon_->Shutdown();
    EXPECT_TRUE(daemon_->Wait().ok());
    for (auto& r : readers) r.join();
    native.join();
    daemon_.reset();
    int fd = kt::ConnectTcp(port_);  // the row server is closed
    EXPECT_LT(fd, 0) << "round " << round;
    if (fd >= 0) ::close(fd);
    if (HasFailure()) return;
  }
}

// The fixture's port handling: a row port another process binds between FreePort() and the
// daemon's start is replaced (new ports, shards.toml rewritten) instead of failing the test.
TEST_F(EngramDaemonTest, StartPicksNewPortsWhenTheRowPortIsTaken) {
  const uint16_t taken = port_;
  const int fd = kt::ListenTcp(taken);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  Start();
  ::close(fd);
  ASSERT_NE(daemon_, nullptr);
  EXPECT_NE(port_, taken);
  auto alice = Connect("tok-alice");
  ASSERT_NE(alice, nullptr);
  auto g = alice->EngramGrant({}, 0);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->endpoint, "127.0.0.1:" + std::to_string(port_));
  ASSERT_EQ(g->regions.size(), 1u);
  auto t = Transport();
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->OpenRegion(Creds(g->regions[0], "alice")).ok());
}

// FreePort(): distinct ports within a process, none from the kernel's ephemeral range (which
// any outgoing connection on the host may take before the caller binds).
TEST(FreePortTest, PortsAreDistinctAndBelowTheEphemeralRange) {
  unsigned low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    ASSERT_EQ(std::fscanf(f, "%u %u", &low, &high), 2);
    std::fclose(f);
  }
  if (low <= kt::kFreePortLow + 1000u) GTEST_SKIP() << "no room below the ephemeral range";
  // A whole window of kFreePortRecentMax ports: picked at random from the ~20,000 below the
  // range, so many would repeat without the window (birthday bound: about 20 pairs).
  std::set<uint16_t> seen;
  for (size_t i = 0; i < kt::kFreePortRecentMax; ++i) {
    const uint16_t p = kt::FreePort();
    EXPECT_GE(p, kt::kFreePortLow);
    EXPECT_LT(p, low);
    EXPECT_TRUE(seen.insert(p).second) << p << " handed out twice";
  }
}

TEST_F(EngramDaemonTest, ReportsAreSummedPerTenantAndTransportAndPassPromtool) {
  Start();
  auto alice = Connect("tok-alice");
  auto bob = Connect("tok-bob");
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);
  wire::EngramReport r;
  r.transport = "tcp";
  r.rows_requested = 100;
  r.rows_deduplicated = 10;
  r.hot_cache_hits = 20;
  r.rows_read = 70;
  r.bytes_read = 70 * 66;
  r.late_rows = 5;
  r.stalls = 2;
  r.stall_us = 250000;
  r.retries = 1;
  r.fetches_failed = 0;
  r.reads_in_flight = 9;
  ASSERT_TRUE(alice->EngramReport(r).ok());
  r.reads_in_flight = 3;
  ASSERT_TRUE(alice->EngramReport(r).ok());
  r.transport = "verbs";
  r.rows_requested = 7;
  ASSERT_TRUE(bob->EngramReport(r).ok());
  r.transport = "rdma";
  EXPECT_TRUE(bob->EngramReport(r).IsInvalidArgument());  // refused before sending
  // The daemon refuses it too (a raw frame with the unknown name).
  wire::Writer w;
  w.U8(4);
  w.Bytes(std::string_view("rdma"));
  for (int i = 0; i < 11; ++i) w.U64(1);
  std::vector<uint8_t> body = w.Take();
  ASSERT_TRUE(bob->TEST_SendRaw(wire::BuildFrame(0x31, 0, 999999, body)).ok());
  // Its reply goes to no pending call: wait until the daemon has counted it.
  const std::string refused =
      "kvtier_requests_total{op=\"engram_report\",code=\"invalid_argument\"} 1\n";
  std::string m;
  for (int i = 0; i < 500; ++i) {
    // Series with a tenant label need an admin token (alice).
    m = kt::HttpRequest(http_port_, "GET", "/metrics", "", "Authorization: Bearer tok-alice\r\n");
    if (m.find(refused) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_NE(m.find(refused), std::string::npos) << m;
  const std::string a = "{tenant=\"alice\",transport=\"tcp\"} ";
  EXPECT_NE(m.find("kvtier_engram_fetch_rows_requested_total" + a + "200\n"), std::string::npos)
      << m;
  EXPECT_NE(m.find("kvtier_engram_fetch_rows_deduplicated_total" + a + "20\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_hot_cache_hits_total" + a + "40\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_bytes_read_total" + a + "9240\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_late_rows_total" + a + "10\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_stalls_total" + a + "4\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_stall_seconds_total" + a + "0.5\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_reads_in_flight" + a + "3\n"), std::string::npos);
  EXPECT_NE(m.find("kvtier_engram_fetch_rows_requested_total{tenant=\"bob\",transport=\"verbs\"} "
                   "7\n"),
            std::string::npos);
  EXPECT_EQ(m.find("tenant=\"bob\",transport=\"tcp\""), std::string::npos);

  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed: the exposition check needs it";
  }
  std::string path = dir_.File("metrics.txt");
  std::ofstream(path) << m.substr(m.find("\r\n\r\n") + 4);
  std::string cmd =
      "promtool check metrics < " + path + " > " + dir_.File("promtool.out") + " 2>&1";
  int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << ReadAll(dir_.File("promtool.out"));
}

TEST_F(EngramDaemonTest, StartupFailsClearlyForBadEngramDirectories) {
  http_port_ = 0;
  auto expect_fail = [&](const char* what, StatusCode code, const std::string& needle) {
    auto d = StartWith(Options());
    ASSERT_FALSE(d.ok()) << what;
    EXPECT_EQ(d.status().code(), code) << what << ": " << d.status().ToString();
    EXPECT_NE(d.status().message().find(needle), std::string::npos)
        << what << ": " << d.status().ToString();
  };
  // No shard names this daemon's endpoint.
  WriteShards("engram.l1.s0", other_port_, "engram.l1.s1", other_port_);
  expect_fail("no shard for us", StatusCode::kInvalidArgument, "no shard");
  // Our shard's table file is missing.
  WriteShards("engram.l1.s9", port_, "engram.l1.s1", other_port_);
  expect_fail("missing file", StatusCode::kNotFound, "engram.l1.s9.engram");
  // A region name that would escape the directory.
  WriteShards("../escape", port_, "engram.l1.s1", other_port_);
  expect_fail("unsafe name", StatusCode::kInvalidArgument, "region name");
  // A table whose rows do not match its shard range.
  rdma::EngramTableHeader h;
  h.row_dim = kRowDim;
  h.row_begin = 0;
  h.row_count = 50;
  h.row_stride_bytes = rdma::EngramRowBytes(kRowDim);
  ASSERT_TRUE(rdma::GenerateEngramTable(engram_dir_ + "/engram.l1.s2.engram", h, kSeed).ok());
  WriteShards("engram.l1.s2", port_, "engram.l1.s1", other_port_);
  expect_fail("row mismatch", StatusCode::kInvalidArgument, "shards.toml assigns [0, 100)");
  // A corrupt table file.
  std::ofstream(engram_dir_ + "/engram.l1.s3.engram") << "not a table";
  WriteShards("engram.l1.s3", port_, "engram.l1.s1", other_port_);
  auto bad = StartWith(Options());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("engram.l1.s3.engram"), std::string::npos)
      << bad.status().ToString();
  // A broken shards.toml (a gap between the ranges).
  std::ofstream(engram_dir_ + "/shards.toml")
      << "[[engram.l1.shard]]\nregion = \"engram.l1.s0\"\nendpoint = \"127.0.0.1:" << port_
      << "\"\nrow_begin = 0\nrow_end = 100\n[[engram.l1.shard]]\nregion = \"x\"\n"
      << "endpoint = \"127.0.0.1:1\"\nrow_begin = 150\nrow_end = 200\n";
  expect_fail("gap", StatusCode::kInvalidArgument, "shards.toml");
  // No shards.toml / no directory.
  std::filesystem::remove(engram_dir_ + "/shards.toml");
  expect_fail("no shards.toml", StatusCode::kNotFound, "shards.toml");
  std::filesystem::remove_all(engram_dir_);
  expect_fail("no dir", StatusCode::kNotFound, engram_dir_);
  // The socket was released after each failed start: a good start still works afterwards.
  EXPECT_FALSE(std::filesystem::exists(dir_.File("d.sock")));
}

TEST_F(EngramDaemonTest, GrantLimitsAndDisabledServing) {
  // Serving off: ENGRAM_GRANT is NotFound, reports are still accepted.
  {
    auto d = StartRetrying(/*http=*/false, [](DaemonOptions* o) { o->engram.enabled = false; });
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    auto c = Connect("tok-alice");
    ASSERT_NE(c, nullptr);
    auto g = c->EngramGrant({}, 0);
    EXPECT_TRUE(g.status().IsNotFound()) << g.status().ToString();
    EXPECT_TRUE(c->EngramReport(wire::EngramReport{.transport = "tcp"}).ok());
    c.reset();
    (*d)->Shutdown();
    EXPECT_TRUE((*d)->Wait().ok());
  }
  auto d =
      StartRetrying(/*http=*/false, [](DaemonOptions* o) { o->engram.grants_per_tenant_max = 2; });
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  daemon_ = std::move(d).value();
  auto alice = Connect("tok-alice");
  auto bob = Connect("tok-bob");
  EXPECT_TRUE(alice->EngramGrant({}, 0).ok());
  EXPECT_TRUE(alice->EngramGrant({}, 0).ok());
  EXPECT_TRUE(alice->EngramGrant({}, 0).status().IsRejected());
  EXPECT_TRUE(bob->EngramGrant({}, 0).ok());  // the limit is per tenant
  // Client-side limits.
  std::vector<std::string> too_many(wire::kEngramRegionsMax + 1, "r");
  EXPECT_TRUE(alice->EngramGrant(too_many, 0).status().IsInvalidArgument());
  std::vector<std::string> long_name = {std::string(257, 'r')};
  EXPECT_TRUE(alice->EngramGrant(long_name, 0).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::daemon
