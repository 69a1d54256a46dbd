// Connections that never authenticate, against the real kvtierd binary (docs/CONFIG.md
// "Connection limits": limits.auth_timeout_ms and limits.unauthenticated_connections_max).
// With auth on, a connection on a front that authenticates with HELLO/AUTH (Unix, native TCP,
// RESP, each with TLS or not) is closed when it has not authenticated within auth_timeout_ms
// of its accept, whatever it sends meanwhile; each such front holds at most
// unauthenticated_connections_max of them, more are closed at accept; the count is given back
// on every path (authentication, close, error, timeout, failed handshake). On the TCP fronts
// one source address holds at most unauthenticated_connections_per_source_max of those places,
// so a client reconnecting as fast as it is closed cannot keep other hosts out (the tests use
// other loopback addresses, 127.0.0.2 and 127.0.0.3, as the other hosts). With auth off
// nothing of this applies. The HTTP admin front (per-request tokens) is not counted as
// unauthenticated; with auth on one source holds at most http_connections_per_source_max of its
// connections.
//
// Deadlines are upper bounds only: the tests poll until a connection is closed and fail after
// many times the configured timeout, never on a connection closed early.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "common/key_spec.h"
#include "tests/cache_daemon/tls_test_util.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/kvtierd_test.h"
#include "tests/e2e/raw_native.h"

namespace kvtier::daemon {
namespace {

// What a RESP connection that has not authenticated gets for a PING (as from Redis with
// requirepass): the answer that it is served, not yet a tenant's.
constexpr char kNoAuth[] = "-NOAUTH Authentication required.\r\n";

namespace kt = kvtier::testing;
using wire::Key;
using wire::Opcode;

// The deadline of the deadline tests; they wait at most kCloseWaitMs for a close.
constexpr int kAuthTimeoutMs = 1000;
constexpr int kCloseWaitMs = 10 * kAuthTimeoutMs;
// Long enough that no connection of a test is closed for these reasons meanwhile.
constexpr int kLongMs = 120000;
// limits.unauthenticated_connections_max of the tests (per front).
constexpr int kUnauthenticatedMax = 4;
// A refused connection is closed at accept: the client sees its end at once; this is the
// (generous) wait for it.
constexpr int kRefusedWaitMs = 5000;
// Source addresses of the per-source tests: the flooding client and two other hosts.
constexpr const char* kFlooder = "127.0.0.1";
constexpr const char* kOtherHost = "127.0.0.2";
constexpr const char* kThirdHost = "127.0.0.3";

Key TestKey(uint32_t i) {
  std::string s = "preauth-e2e-" + std::to_string(i);
  return Sha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

// True once the peer has ended fd (EOF or reset) within timeout_ms (0: by now); what arrives
// meanwhile is read and dropped.
bool FdClosedWithin(int fd, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                               deadline - std::chrono::steady_clock::now())
                                               .count());
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) > 0) {
      char buf[4096];
      ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
      continue;  // replies: read on
    }
    if (left == 0) return false;
  }
}

// True while fd is open at the peer: nothing says it ended (pending bytes are left unread).
bool FdOpen(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return true;
  char c;
  ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 || (n < 0 && errno == EAGAIN);
}

// A RESP command and the start of its reply (the first reply line), or "" on close/timeout.
std::string RespCall(int fd, const std::string& command) {
  if (!kt::SendAllRaw(fd, command.data(), command.size())) return "";
  std::string out;
  while (out.find("\r\n") == std::string::npos) {
    std::string got = kt::RecvFor(fd, 1, 5000);
    if (got.empty()) return "";
    out += got;
  }
  return out;
}

// Waits until `closed_want` of fds have been ended by the peer (at most kRefusedWaitMs), closes
// those and returns the others, still open.
std::vector<int> OpenOnesOnceClosed(const std::vector<int>& fds, size_t closed_want) {
  std::vector<bool> closed(fds.size(), false);
  size_t closed_n = 0;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(kRefusedWaitMs);
  while (closed_n < closed_want && std::chrono::steady_clock::now() < deadline) {
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!closed[i] && FdClosedWithin(fds[i], 0)) {
        closed[i] = true;
        ++closed_n;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<int> open;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (closed[i]) {
      ::close(fds[i]);
    } else {
      open.push_back(fds[i]);
    }
  }
  return open;
}

class PreauthE2eTest : public kt::KvtierdTest {
 protected:
  PreauthE2eTest() : KvtierdTest("kvtier_preauth") {}
  static void SetUpTestSuite() { ::signal(SIGPIPE, SIG_IGN); }

  void SetUp() override {
    KvtierdTest::SetUp();
    native_port_ = kt::FreePort();
  }

  // Starts kvtierd with the native TCP port, [limits] `limits` (idle and frame timeouts long
  // unless given), auth on (tenants alice and bob) unless `auth` is false, and `more` tables.
  // Waits until no probe connection is counted any more.
  bool StartDaemon(const std::string& limits, bool auth = true, const std::string& more = "") {
    std::string config =
        "[storage]\ndram_capacity_bytes = 16777216\nssd_capacity_bytes = 0\n[limits]\n"
        "idle_timeout_ms = " +
        std::to_string(kLongMs) + "\nframe_timeout_ms = " + std::to_string(kLongMs) + "\n" +
        limits + "\n";
    if (auth) {
      std::string tokens = (dir_ / "tokens.toml").string();
      std::ofstream(tokens) << "[[tenant]]\nname = \"alice\"\nid = 1\ntoken_sha256 = [\""
                            << TokenSha256Hex("alice-token") << "\"]\n"
                            << "[[tenant]]\nname = \"bob\"\nid = 2\ntoken_sha256 = [\""
                            << TokenSha256Hex("bob-token") << "\"]\n";
      config += "[auth]\ntokens_file = \"" + tokens + "\"\n";
    }
    d_->WriteConfig(config + more);
    // Once the Unix socket accepts every TCP front listens (kvtierd binds the socket last).
    if (!d_->Start({"--native-port", std::to_string(native_port_)})) return false;
    return UnauthenticatedBecome(0, 0, 0);  // Start()'s probe of the socket is gone
  }

  std::string Metrics() {
    std::string page = kt::HttpRequest(d_->http_port(), "GET", "/metrics");
    EXPECT_NE(page.find("# TYPE kvtier_requests_total counter"), std::string::npos)
        << "no /metrics page: " << page.substr(0, 200);
    return page;
  }
  // The value of a series ("name{labels}") on the /metrics page, -1 when absent.
  int64_t Sample(const std::string& series) {
    std::string page = Metrics();
    size_t at = page.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::stoll(page.substr(at + series.size() + 2));
  }
  int64_t Unauthenticated(const std::string& front) {
    return Sample("kvtier_unauthenticated_connections_open{front=\"" + front + "\"}");
  }
  int64_t Refusals(const std::string& reason) {
    return Sample("kvtier_connection_limit_refusals_total{reason=\"" + reason + "\"}");
  }
  // Polls the unauthenticated gauges until they read (unix, native_tcp, resp); false (with
  // the last readings reported) after kCloseWaitMs.
  bool UnauthenticatedBecome(int64_t unix_n, int64_t tcp_n, int64_t resp_n) {
    int64_t got[3] = {-1, -1, -1};
    for (int waited_ms = 0; waited_ms < kCloseWaitMs; waited_ms += 20) {
      got[0] = Unauthenticated("unix");
      got[1] = Unauthenticated("native_tcp");
      got[2] = Unauthenticated("resp");
      if (got[0] == unix_n && got[1] == tcp_n && got[2] == resp_n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << "unauthenticated connections (unix, native_tcp, resp): " << got[0] << ", "
                  << got[1] << ", " << got[2] << "; want " << unix_n << ", " << tcp_n << ", "
                  << resp_n;
    return false;
  }

  // The per-source gauges of a TCP front ("native_tcp", "resp"): sources holding
  // unauthenticated connections, and the most one of them holds.
  int64_t Sources(const std::string& front) {
    return Sample("kvtier_unauthenticated_sources{front=\"" + front + "\"}");
  }
  int64_t TopSource(const std::string& front) {
    return Sample("kvtier_unauthenticated_top_source_connections{front=\"" + front + "\"}");
  }
  // Polls until the front's per-source gauges read (sources, top); false (with the last
  // readings reported) after kCloseWaitMs.
  bool SourcesBecome(const std::string& front, int64_t sources, int64_t top) {
    int64_t got[2] = {-1, -1};
    for (int waited_ms = 0; waited_ms < kCloseWaitMs; waited_ms += 20) {
      got[0] = Sources(front);
      got[1] = TopSource(front);
      if (got[0] == sources && got[1] == top) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << front << " sources, top source: " << got[0] << ", " << got[1] << "; want "
                  << sources << ", " << top;
    return false;
  }
  // Polls until a refusal counter reads `want`; false (reported) after kCloseWaitMs.
  bool RefusalsBecome(const std::string& reason, int64_t want) {
    int64_t got = -1;
    for (int waited_ms = 0; waited_ms < kCloseWaitMs; waited_ms += 20) {
      got = Refusals(reason);
      if (got == want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << "refusals " << reason << ": " << got << "; want " << want;
    return false;
  }

  StatusOr<std::unique_ptr<Client>> ConnectNativeTcp(const std::string& token, bool tls = false) {
    ClientOptions o;
    o.tcp_host = "127.0.0.1";
    o.tcp_port = native_port_;
    o.tls = tls;
    o.tls_ca_file = pki_.ca_file;
    o.token = token;
    o.timeout_ms = 5000;
    return Client::Connect(o);
  }
  // A native connection of `token` (Unix or TCP) works: a LOOKUP is answered.
  static void ExpectServed(Client* c) {
    ASSERT_NE(c, nullptr);
    auto r = c->Lookup(std::vector<Key>{TestKey(1)});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  // A raw native connection authenticated as alice answers a LOOKUP.
  static void ExpectRawServed(kt::RawNative* raw, uint64_t id) {
    const Key key = TestKey(1);
    ASSERT_TRUE(
        raw->SendFrame(Opcode::kLookup, id, wire::EncodeKeys(std::span<const Key>(&key, 1))));
    auto r = raw->Read();
    ASSERT_TRUE(r.has_value()) << "no LOOKUP reply";
    EXPECT_EQ(r->code, StatusCode::kOk);
  }

  std::string TlsTables() {
    EXPECT_TRUE(kt::MakeTestPki(dir_ / "pki", &pki_));
    return "[tls]\ncert_file = \"" + pki_.cert_file + "\"\nkey_file = \"" + pki_.key_file +
           "\"\nnative = true\nresp = true\nhandshake_timeout_ms = " + std::to_string(kLongMs) +
           "\n";
  }

  uint16_t native_port_ = 0;
  kt::TestPki pki_;
};

std::string Limits(int auth_timeout_ms, int unauthenticated_max = kUnauthenticatedMax) {
  return "auth_timeout_ms = " + std::to_string(auth_timeout_ms) +
         "\nunauthenticated_connections_max = " + std::to_string(unauthenticated_max) + "\n";
}

// Every front that authenticates with HELLO/AUTH closes a connection that has not done so
// within auth_timeout_ms: one that sends nothing, one that keeps sending what is answered
// without authentication (a HELLO without a token, PING, a refused GET), one that lost its
// tenant to a failed AUTH. Authenticated connections and an idle HTTP keep-alive connection
// stay open past the deadline and are served.
TEST_F(PreauthE2eTest, ConnectionsThatDoNotAuthenticateAreClosedAtTheDeadline) {
  ASSERT_TRUE(StartDaemon(Limits(kAuthTimeoutMs)));
  const int64_t timeouts_before = Refusals("auth_timeout");
  // Authenticated first: the one pair of each kind that must stay.
  auto unix_auth = kt::RawNative::Unix(d_->socket());
  auto tcp_auth = kt::RawNative::Tcp(native_port_);
  ASSERT_TRUE(unix_auth.Hello("alice-token"));
  ASSERT_TRUE(tcp_auth.Hello("alice-token"));
  int resp_auth = kt::ConnectTcp(d_->resp_port());
  ASSERT_EQ(RespCall(resp_auth, "AUTH alice-token\r\n"), "+OK\r\n");
  int http_idle = kt::ConnectTcp(d_->http_port());
  std::string get = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(kt::SendAllRaw(http_idle, get.data(), get.size()));
  // To be closed.
  auto unix_silent = kt::RawNative::Unix(d_->socket());
  auto tcp_silent = kt::RawNative::Tcp(native_port_);
  int resp_silent = kt::ConnectTcp(d_->resp_port());
  auto unix_trickle = kt::RawNative::Unix(d_->socket());
  auto tcp_trickle = kt::RawNative::Tcp(native_port_);
  int resp_trickle = kt::ConnectTcp(d_->resp_port());
  auto unix_lost = kt::RawNative::Unix(d_->socket());
  ASSERT_TRUE(unix_lost.Hello("bob-token"));
  ASSERT_TRUE(unix_lost.SendFrame(Opcode::kAuth, 2, wire::EncodeAuth("not-a-token")));
  auto lost_reply = unix_lost.Read();
  ASSERT_TRUE(lost_reply.has_value());
  ASSERT_EQ(lost_reply->code, StatusCode::kPermissionDenied);
  const int closing_fds[] = {unix_silent.fd(), tcp_silent.fd(), resp_silent,   unix_trickle.fd(),
                             tcp_trickle.fd(), resp_trickle,    unix_lost.fd()};
  const char* names[] = {"silent unix",
                         "silent native tcp",
                         "silent resp",
                         "trickle unix",
                         "trickle native tcp",
                         "trickle resp",
                         "unix after a failed AUTH"};
  constexpr size_t kClosing = std::size(closing_fds);
  std::vector<bool> closed(kClosing, false);
  const wire::HelloRequest no_token;
  const auto hello = wire::EncodeHello(no_token);
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t round = 0;; ++round) {
    // Trickle: a HELLO without a token (answered OK, still unauthenticated), PING and a GET
    // answered NOAUTH; each keeps idle_timeout_ms and frame_timeout_ms from closing.
    if (!closed[3]) (void)unix_trickle.SendFrame(Opcode::kHello, 100 + round, hello);
    if (!closed[4]) (void)tcp_trickle.SendFrame(Opcode::kHello, 100 + round, hello);
    if (!closed[5]) {
      const std::string cmd = round % 2 == 0 ? "PING\r\n" : "GET k\r\n";
      (void)kt::SendAllRaw(resp_trickle, cmd.data(), cmd.size());
    }
    for (size_t i = 0; i < kClosing; ++i) {
      if (!closed[i]) closed[i] = FdClosedWithin(closing_fds[i], 0);
    }
    if (std::all_of(closed.begin(), closed.end(), [](bool c) { return c; })) break;
    if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(kCloseWaitMs)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (size_t i = 0; i < kClosing; ++i) {
    EXPECT_TRUE(closed[i]) << names[i] << " still open " << kCloseWaitMs << " ms after accept";
  }
  EXPECT_GE(Refusals("auth_timeout") - timeouts_before, static_cast<int64_t>(kClosing));
  // Past the deadline of every connection above: the authenticated ones are served.
  ExpectRawServed(&unix_auth, 50);
  ExpectRawServed(&tcp_auth, 50);
  EXPECT_EQ(RespCall(resp_auth, "SET k v\r\n"), "+OK\r\n");
  EXPECT_TRUE(FdOpen(http_idle)) << "the HTTP front has no authentication deadline";
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  for (int fd : {resp_auth, http_idle, resp_silent, resp_trickle}) ::close(fd);
}

// A front holds at most unauthenticated_connections_max connections that have not
// authenticated: the one beyond is closed at accept (counted), while authenticated
// connections, the other fronts and a tenant's new connections there keep working. Once the
// held ones authenticate, or close, the front accepts again.
TEST_F(PreauthE2eTest, UnauthenticatedConnectionsAreCappedPerFront) {
  ASSERT_TRUE(StartDaemon(Limits(kLongMs) + "resp_connections_max = 64\n"));
  const int64_t refused_before = Refusals("unauthenticated_connections");
  int resp_alice = kt::ConnectTcp(d_->resp_port());
  ASSERT_EQ(RespCall(resp_alice, "AUTH alice-token\r\n"), "+OK\r\n");
  std::vector<int> held;
  for (int i = 0; i < kUnauthenticatedMax; ++i) held.push_back(kt::ConnectTcp(d_->resp_port()));
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, kUnauthenticatedMax));
  // The next one, from another host (this one holds its source's share too), is closed at
  // once; so is a tenant's on this front until a place is free.
  int extra = kt::ConnectTcp(d_->resp_port(), 0, kOtherHost);
  EXPECT_TRUE(FdClosedWithin(extra, kRefusedWaitMs)) << "a connection over the cap was accepted";
  ::close(extra);
  EXPECT_EQ(Refusals("unauthenticated_connections") - refused_before, 1);
  // Authenticated: served; other fronts: a tenant connects and works.
  EXPECT_EQ(RespCall(resp_alice, "SET k1 v1\r\n"), "+OK\r\n");
  EXPECT_EQ(RespCall(resp_alice, "GET k1\r\n"), "$2\r\nv1\r\n");
  ExpectServed(ConnectUnix("bob-token").get());
  auto tcp_bob = ConnectNativeTcp("bob-token");
  ASSERT_TRUE(tcp_bob.ok()) << tcp_bob.status().ToString();
  ExpectServed(tcp_bob->get());
  // The /metrics page with the new family at non-zero values passes promtool.
  std::string page = Metrics();
  size_t body = page.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  std::ofstream(dir_ / "metrics.txt") << page.substr(body + 4);
  std::string out;
  EXPECT_EQ(kt::RunShell("promtool check metrics < " + (dir_ / "metrics.txt").string(), &out), 0)
      << out;
  // The held ones authenticate: their places are free and the front accepts again.
  for (int fd : held) EXPECT_EQ(RespCall(fd, "AUTH bob-token\r\n"), "+OK\r\n");
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, 0));
  int again = kt::ConnectTcp(d_->resp_port());
  EXPECT_EQ(RespCall(again, "PING\r\n"), kNoAuth);
  EXPECT_EQ(RespCall(again, "AUTH alice-token\r\n"), "+OK\r\n");
  ::close(again);
  for (int fd : held) EXPECT_EQ(RespCall(fd, "GET k1\r\n"), "$-1\r\n") << "bob's keyspace";
  // The native TCP front the same way, released by closing this time.
  std::vector<kt::RawNative> natives;
  for (int i = 0; i < kUnauthenticatedMax; ++i) natives.push_back(kt::RawNative::Tcp(native_port_));
  ASSERT_TRUE(UnauthenticatedBecome(0, kUnauthenticatedMax, 0));
  auto over = kt::RawNative::Tcp(native_port_, kOtherHost);
  EXPECT_TRUE(over.ClosedWithin(kRefusedWaitMs)) << "a connection over the cap was accepted";
  EXPECT_EQ(Refusals("unauthenticated_connections") - refused_before, 2);
  ExpectServed(ConnectUnix("alice-token").get());
  natives.clear();
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, 0));
  auto fresh = kt::RawNative::Tcp(native_port_);
  EXPECT_TRUE(fresh.Hello("alice-token"));
  ExpectRawServed(&fresh, 7);
  // A native connection that loses its tenant while its front is full is closed after the
  // reply: it cannot stay unauthenticated beyond the cap.
  auto unix_alice = kt::RawNative::Unix(d_->socket());
  ASSERT_TRUE(unix_alice.Hello("alice-token"));
  std::vector<kt::RawNative> unix_held;
  for (int i = 0; i < kUnauthenticatedMax; ++i) {
    unix_held.push_back(kt::RawNative::Unix(d_->socket()));
  }
  ASSERT_TRUE(UnauthenticatedBecome(kUnauthenticatedMax, 0, 0));
  ASSERT_TRUE(unix_alice.SendFrame(Opcode::kAuth, 9, wire::EncodeAuth("not-a-token")));
  auto denied = unix_alice.Read();
  ASSERT_TRUE(denied.has_value());
  EXPECT_EQ(denied->code, StatusCode::kPermissionDenied);
  EXPECT_TRUE(unix_alice.ClosedWithin(kRefusedWaitMs))
      << "a connection that lost its tenant stayed open beyond the cap";
  EXPECT_EQ(Refusals("unauthenticated_connections") - refused_before, 3);
  unix_held.clear();
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  for (int fd : held) ::close(fd);
  ::close(resp_alice);
}

// The count is given back on every path, many times over: a close before any byte, a
// successful HELLO/AUTH, a refused request (native: answered, then closed), framing errors,
// three failed AUTHs, a tenant lost to a failed AUTH then closed, and the deadline. The TCP
// fronts' per-source places too (every connection here is from 127.0.0.1, whose share is the
// whole front: min(8, kUnauthenticatedMax)): their gauges read no source after each round. With
// places leaking, the fronts would refuse connections after a few rounds.
TEST_F(PreauthE2eTest, TheUnauthenticatedCountIsGivenBackOnEveryPath) {
  ASSERT_TRUE(StartDaemon(Limits(kAuthTimeoutMs)));
  constexpr int kRounds = 3 * kUnauthenticatedMax;
  const auto bad_auth = wire::EncodeAuth("not-a-token");
  const auto lookup_body = wire::EncodeKeys({});
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    for (bool tcp : {false, true}) {
      auto open = [&] {
        return tcp ? kt::RawNative::Tcp(native_port_) : kt::RawNative::Unix(d_->socket());
      };
      {
        auto c = open();  // closed before any byte
      }
      {
        auto c = open();
        ASSERT_TRUE(c.Hello("alice-token"));
        ExpectRawServed(&c, 2);
      }
      {
        auto c = open();
        ASSERT_TRUE(c.SendFrame(Opcode::kLookup, 2, lookup_body));
        EXPECT_TRUE(c.ClosedWithin(kCloseWaitMs)) << "a request before HELLO closes";
      }
      {
        auto c = open();  // a header announcing more than preauth_frame_bytes_max
        ASSERT_TRUE(
            c.Send(wire::EncodeHeader(static_cast<uint8_t>(Opcode::kHello), 0, 1, 1u << 30)));
        EXPECT_TRUE(c.ClosedWithin(kCloseWaitMs)) << "an oversized frame before HELLO closes";
      }
      {
        auto c = open();
        for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(c.SendFrame(Opcode::kAuth, i, bad_auth));
        EXPECT_TRUE(c.ClosedWithin(kCloseWaitMs)) << "three failed AUTHs close";
      }
      {
        auto c = open();
        ASSERT_TRUE(c.Hello("alice-token"));
        ASSERT_TRUE(c.SendFrame(Opcode::kAuth, 3, bad_auth));
        ASSERT_TRUE(c.Read().has_value());
      }
    }
    int r = kt::ConnectTcp(d_->resp_port());
    ::close(r);
    r = kt::ConnectTcp(d_->resp_port());
    EXPECT_EQ(RespCall(r, "AUTH alice-token\r\n"), "+OK\r\n");
    ::close(r);
    r = kt::ConnectTcp(d_->resp_port());
    const std::string too_big = "*2\r\n$3\r\nGET\r\n$1000000\r\n";  // over preauth_frame_bytes_max
    ASSERT_TRUE(kt::SendAllRaw(r, too_big.data(), too_big.size()));
    EXPECT_TRUE(FdClosedWithin(r, kCloseWaitMs)) << "an oversized command before AUTH closes";
    ::close(r);
    r = kt::ConnectTcp(d_->resp_port());
    EXPECT_EQ(RespCall(r, "AUTH x\r\n").substr(0, 10), "-WRONGPASS");
    EXPECT_EQ(RespCall(r, "AUTH y\r\n").substr(0, 10), "-WRONGPASS");
    EXPECT_EQ(RespCall(r, "AUTH z\r\n").substr(0, 10), "-WRONGPASS");
    EXPECT_TRUE(FdClosedWithin(r, kCloseWaitMs)) << "three failed AUTHs close";
    ::close(r);
    // Every place of the round is given back (the last closes are seen by the daemon a
    // moment later), its source's places too.
    ASSERT_TRUE(UnauthenticatedBecome(0, 0, 0));
    ASSERT_TRUE(SourcesBecome("native_tcp", 0, 0));
    ASSERT_TRUE(SourcesBecome("resp", 0, 0));
  }
  // The deadline path: a full set of silent connections on each front, closed by it.
  std::vector<int> silent;
  for (int i = 0; i < kUnauthenticatedMax; ++i) {
    silent.push_back(kt::ConnectUnix(d_->socket()));
    silent.push_back(kt::ConnectTcp(native_port_));
    silent.push_back(kt::ConnectTcp(d_->resp_port()));
  }
  for (int fd : silent) EXPECT_TRUE(FdClosedWithin(fd, kCloseWaitMs));
  for (int fd : silent) ::close(fd);
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  EXPECT_TRUE(SourcesBecome("native_tcp", 0, 0));
  EXPECT_TRUE(SourcesBecome("resp", 0, 0));
  EXPECT_EQ(Refusals("unauthenticated_connections"), 0);
  EXPECT_EQ(Refusals("unauthenticated_per_source"), 0);
  // Every front still takes a full set and authenticates it.
  std::vector<kt::RawNative> natives;
  for (int i = 0; i < kUnauthenticatedMax; ++i) {
    natives.push_back(kt::RawNative::Unix(d_->socket()));
    natives.push_back(kt::RawNative::Tcp(native_port_));
  }
  for (auto& c : natives) EXPECT_TRUE(c.Hello("alice-token"));
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  EXPECT_TRUE(SourcesBecome("native_tcp", 0, 0));
  // RESP (one source, as every connection of this test) takes a full set too.
  std::vector<int> resp;
  for (int i = 0; i < kUnauthenticatedMax; ++i) resp.push_back(kt::ConnectTcp(d_->resp_port()));
  for (int fd : resp) EXPECT_EQ(RespCall(fd, "AUTH alice-token\r\n"), "+OK\r\n");
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  EXPECT_TRUE(SourcesBecome("resp", 0, 0));
  EXPECT_EQ(Refusals("unauthenticated_per_source"), 0);
  for (int fd : resp) ::close(fd);
}

// TLS fronts: a connection counts as unauthenticated from its TCP accept, through the
// handshake, until its HELLO/AUTH, and is closed by the same deadline; a handshake in progress
// takes a place (more are closed at accept), and a failed handshake gives it back.
TEST_F(PreauthE2eTest, TlsConnectionsCountFromTheirAcceptAndMeetTheSameDeadline) {
  // Every authenticated connection here must finish a TLS handshake and its AUTH or HELLO
  // within the deadline of its accept, on a machine that may be running other tests: a deadline
  // of 3 s rather than kAuthTimeoutMs, and waits of ten deadlines for the closes.
  constexpr int kTlsAuthTimeoutMs = 3 * kAuthTimeoutMs;
  constexpr int kTlsCloseWaitMs = 10 * kTlsAuthTimeoutMs;
  ASSERT_TRUE(StartDaemon(Limits(kTlsAuthTimeoutMs), true, TlsTables()));
  std::string error;
  auto resp_auth = kt::TlsTestConn::Connect(d_->resp_port(), pki_.ca_file, &error);
  ASSERT_NE(resp_auth, nullptr) << error;
  ASSERT_TRUE(resp_auth->Send("AUTH alice-token\r\n"));
  ASSERT_EQ(resp_auth->RecvUntil("\r\n"), "+OK\r\n");
  auto native_auth = ConnectNativeTcp("bob-token", /*tls=*/true);
  ASSERT_TRUE(native_auth.ok()) << native_auth.status().ToString();
  auto resp_silent = kt::TlsTestConn::Connect(d_->resp_port(), pki_.ca_file, &error);
  ASSERT_NE(resp_silent, nullptr) << error;
  auto native_silent = kt::TlsTestConn::Connect(native_port_, pki_.ca_file, &error);
  ASSERT_NE(native_silent, nullptr) << error;
  auto resp_trickle = kt::TlsTestConn::Connect(d_->resp_port(), pki_.ca_file, &error);
  ASSERT_NE(resp_trickle, nullptr) << error;
  bool trickle_closed = false;
  for (int waited_ms = 0; waited_ms < kTlsCloseWaitMs && !trickle_closed; waited_ms += 100) {
    trickle_closed = !resp_trickle->Send("PING\r\n") || resp_trickle->ClosedWithin(100);
  }
  EXPECT_TRUE(trickle_closed) << "a TLS RESP connection sending PINGs was not closed";
  EXPECT_TRUE(resp_silent->ClosedWithin(kTlsCloseWaitMs)) << "silent TLS RESP";
  EXPECT_TRUE(native_silent->ClosedWithin(kTlsCloseWaitMs)) << "silent TLS native";
  ASSERT_TRUE(resp_auth->Send("SET k v\r\n"));
  EXPECT_EQ(resp_auth->RecvUntil("\r\n"), "+OK\r\n");
  ExpectServed(native_auth->get());
  resp_silent.reset();
  native_silent.reset();
  resp_trickle.reset();
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, 0));
  // Handshakes that never start (kLongMs handshake timeout) hold the places.
  std::vector<int> handshaking;
  for (int i = 0; i < kUnauthenticatedMax; ++i) {
    handshaking.push_back(kt::ConnectTcp(d_->resp_port()));
  }
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, kUnauthenticatedMax));
  int extra = kt::ConnectTcp(d_->resp_port(), 0, kOtherHost);
  EXPECT_TRUE(FdClosedWithin(extra, kRefusedWaitMs)) << "a handshake over the cap was accepted";
  ::close(extra);
  EXPECT_EQ(Refusals("unauthenticated_connections"), 1);
  // Failed handshakes (plaintext to the TLS port) give their places back.
  for (int fd : handshaking) {
    ASSERT_TRUE(kt::SendAllRaw(fd, "PING\r\n", 6));
    EXPECT_TRUE(FdClosedWithin(fd, kCloseWaitMs));
    ::close(fd);
  }
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, 0));
  for (int round = 0; round < 2 * kUnauthenticatedMax; ++round) {
    auto c = kt::TlsTestConn::Connect(d_->resp_port(), pki_.ca_file, &error);
    ASSERT_NE(c, nullptr) << error;
    ASSERT_TRUE(c->Send("AUTH alice-token\r\n"));
    EXPECT_EQ(c->RecvUntil("\r\n"), "+OK\r\n");
  }
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
}

std::string PerSourceLimits(int front_max, int per_source_max) {
  return Limits(kLongMs, front_max) +
         "unauthenticated_connections_per_source_max = " + std::to_string(per_source_max) + "\n";
}

// One source that opens connections as fast as it can, and never authenticates, holds at most
// unauthenticated_connections_per_source_max of a TCP front's unauthenticated places: its
// others are closed at accept (counted as unauthenticated_per_source and in
// kvtier_connections_rejected_total), while clients of other hosts get in and authenticate.
// A place is given back when its connection authenticates, and when the front's own cap
// refuses a connection after its source's place was taken.
TEST_F(PreauthE2eTest, OneSourceCannotKeepOtherHostsOutOfATcpFront) {
  constexpr int kFrontMax = 8;
  constexpr int kPerSource = 3;
  constexpr int kFlood = 4 * kFrontMax;  // connections the flooder opens at once
  ASSERT_TRUE(StartDaemon(PerSourceLimits(kFrontMax, kPerSource)));
  const int64_t rejected_before = Sample("kvtier_connections_rejected_total");
  // RESP: the flood keeps kPerSource places, the rest are closed at accept.
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    flood.push_back(kt::ConnectTcp(d_->resp_port(), 0, kFlooder));
    ASSERT_GE(flood.back(), 0);
  }
  ASSERT_TRUE(RefusalsBecome("unauthenticated_per_source", kFlood - kPerSource));
  std::vector<int> resp_held = OpenOnesOnceClosed(flood, kFlood - kPerSource);
  EXPECT_EQ(resp_held.size(), static_cast<size_t>(kPerSource));
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, kPerSource));
  ASSERT_TRUE(SourcesBecome("resp", 1, kPerSource));
  EXPECT_EQ(Sample("kvtier_connections_rejected_total") - rejected_before, kFlood - kPerSource);
  EXPECT_EQ(Refusals("unauthenticated_connections"), 0) << "the front's cap was never reached";
  // The refusals are logged naming the source, not one line each (at most one per 10 s).
  const std::string log = d_->Log();
  const std::string line = "RESP front: closed a connection at accept: its source 127.0.0.1 ";
  size_t lines = 0;
  for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++lines;
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 3u) << "a line per refusal: " << kFlood - kPerSource << " refusals";
  // Another host gets in and works.
  int other = kt::ConnectTcp(d_->resp_port(), 0, kOtherHost);
  ASSERT_GE(other, 0);
  EXPECT_EQ(RespCall(other, "PING\r\n"), kNoAuth);
  EXPECT_EQ(RespCall(other, "AUTH alice-token\r\n"), "+OK\r\n");
  EXPECT_EQ(RespCall(other, "SET k1 v1\r\n"), "+OK\r\n");
  EXPECT_EQ(RespCall(other, "GET k1\r\n"), "$2\r\nv1\r\n");
  ::close(other);
  // A held connection that authenticates gives its source's place back: exactly one more of
  // the flooder's is accepted, the next is closed.
  EXPECT_EQ(RespCall(resp_held[0], "AUTH bob-token\r\n"), "+OK\r\n");
  ASSERT_TRUE(SourcesBecome("resp", 1, kPerSource - 1));
  resp_held.push_back(kt::ConnectTcp(d_->resp_port(), 0, kFlooder));
  EXPECT_EQ(RespCall(resp_held.back(), "PING\r\n"), kNoAuth);
  int over = kt::ConnectTcp(d_->resp_port(), 0, kFlooder);
  EXPECT_TRUE(FdClosedWithin(over, kRefusedWaitMs)) << "a connection over the source's cap";
  ::close(over);
  EXPECT_EQ(Refusals("unauthenticated_per_source"), kFlood - kPerSource + 1);
  // Fill the front from two more hosts: the third host takes kPerSource, the other host the
  // last places. The other host's next connection is refused by the front's cap after its
  // source's place was taken; that place is given back (its top stays at what it holds).
  std::vector<int> third, second;
  for (int i = 0; i < kPerSource; ++i)
    third.push_back(kt::ConnectTcp(d_->resp_port(), 0, kThirdHost));
  constexpr int kSecondHolds = kFrontMax - 2 * kPerSource;
  static_assert(kSecondHolds > 0 && kSecondHolds < kPerSource);
  for (int i = 0; i < kSecondHolds; ++i) {
    second.push_back(kt::ConnectTcp(d_->resp_port(), 0, kOtherHost));
  }
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, kFrontMax));
  ASSERT_TRUE(SourcesBecome("resp", 3, kPerSource));
  int front_full = kt::ConnectTcp(d_->resp_port(), 0, kOtherHost);
  EXPECT_TRUE(FdClosedWithin(front_full, kRefusedWaitMs)) << "a connection over the front's cap";
  ::close(front_full);
  EXPECT_EQ(Refusals("unauthenticated_connections"), 1);
  for (int fd : resp_held) ::close(fd);
  for (int fd : third) ::close(fd);
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, kSecondHolds));
  ASSERT_TRUE(SourcesBecome("resp", 1, kSecondHolds));
  // The other host holds kSecondHolds: exactly kPerSource - kSecondHolds more get in.
  for (int i = kSecondHolds; i < kPerSource; ++i) {
    second.push_back(kt::ConnectTcp(d_->resp_port(), 0, kOtherHost));
    EXPECT_EQ(RespCall(second.back(), "PING\r\n"), kNoAuth);
  }
  over = kt::ConnectTcp(d_->resp_port(), 0, kOtherHost);
  EXPECT_TRUE(FdClosedWithin(over, kRefusedWaitMs)) << "the refused place was not given back";
  ::close(over);
  for (int fd : second) ::close(fd);
  ASSERT_TRUE(UnauthenticatedBecome(0, 0, 0));
  ASSERT_TRUE(SourcesBecome("resp", 0, 0));

  // Native TCP: the same flood, and another host's tenant is served.
  const int64_t per_source_before = Refusals("unauthenticated_per_source");
  std::vector<int> native_flood;
  for (int i = 0; i < kFlood; ++i) {
    native_flood.push_back(kt::ConnectTcp(native_port_, 0, kFlooder));
    ASSERT_GE(native_flood.back(), 0);
  }
  ASSERT_TRUE(
      RefusalsBecome("unauthenticated_per_source", per_source_before + kFlood - kPerSource));
  std::vector<int> native_held = OpenOnesOnceClosed(native_flood, kFlood - kPerSource);
  EXPECT_EQ(native_held.size(), static_cast<size_t>(kPerSource));
  ASSERT_TRUE(UnauthenticatedBecome(0, kPerSource, 0));
  ASSERT_TRUE(SourcesBecome("native_tcp", 1, kPerSource));
  auto tenant = kt::RawNative::Tcp(native_port_, kOtherHost);
  ASSERT_TRUE(tenant.ok());
  EXPECT_TRUE(tenant.Hello("alice-token"));
  ExpectRawServed(&tenant, 3);
  // Nothing the flooder held was closed meanwhile (none was refused twice).
  for (int fd : native_held) EXPECT_TRUE(FdOpen(fd));
  // RESP: the flood, one over after an AUTH, one over the front's cap, one over at the end.
  EXPECT_EQ(Sample("kvtier_connections_rejected_total") - rejected_before,
            2 * (kFlood - kPerSource) + 3);
  for (int fd : native_held) ::close(fd);
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  EXPECT_TRUE(SourcesBecome("native_tcp", 0, 0));
}

// TLS fronts: a handshake in progress holds its source's place from the TCP accept, so the
// source's next connection is closed at accept while another host's completes its handshake
// and authenticates; a failed handshake gives the source's place back.
TEST_F(PreauthE2eTest, TlsHandshakesInProgressCountPerSource) {
  constexpr int kFrontMax = 8;
  constexpr int kPerSource = 3;
  ASSERT_TRUE(StartDaemon(PerSourceLimits(kFrontMax, kPerSource), true, TlsTables()));
  int64_t refused = 0;
  for (bool resp : {true, false}) {
    const uint16_t port = resp ? d_->resp_port() : native_port_;
    const std::string front = resp ? "resp" : "native_tcp";
    SCOPED_TRACE(front);
    for (int round = 0; round < 2; ++round) {  // the second: every place was given back
      // Handshakes that never start (kLongMs handshake timeout) hold the source's places.
      std::vector<int> handshaking;
      for (int i = 0; i < kPerSource; ++i) {
        handshaking.push_back(kt::ConnectTcp(port, 0, kFlooder));
      }
      ASSERT_TRUE(SourcesBecome(front, 1, kPerSource));
      int extra = kt::ConnectTcp(port, 0, kFlooder);
      EXPECT_TRUE(FdClosedWithin(extra, kRefusedWaitMs)) << "a handshake over the source's cap";
      ::close(extra);
      EXPECT_EQ(Refusals("unauthenticated_per_source"), ++refused);
      // Another host completes its handshake and authenticates.
      std::string error;
      auto other = kt::TlsTestConn::Connect(port, pki_.ca_file, &error, 5000, 0, kOtherHost);
      ASSERT_NE(other, nullptr) << error;
      if (resp) {
        ASSERT_TRUE(other->Send("AUTH alice-token\r\n"));
        EXPECT_EQ(other->RecvUntil("\r\n"), "+OK\r\n");
        ASSERT_TRUE(other->Send("SET k v\r\n"));
        EXPECT_EQ(other->RecvUntil("\r\n"), "+OK\r\n");
      } else {
        wire::HelloRequest hello;
        hello.token = "alice-token";
        const auto frame =
            wire::BuildFrame(static_cast<uint8_t>(Opcode::kHello), 0, 1, wire::EncodeHello(hello));
        ASSERT_TRUE(other->Send(std::string(frame.begin(), frame.end())));
        const std::string reply = other->Recv(wire::kHeaderBytes + 1);
        ASSERT_GT(reply.size(), wire::kHeaderBytes) << "no HELLO reply";
        EXPECT_EQ(static_cast<StatusCode>(reply[wire::kHeaderBytes]), StatusCode::kOk);
      }
      ASSERT_TRUE(SourcesBecome(front, 1, kPerSource)) << "the other host authenticated";
      other.reset();
      // Failed handshakes (plaintext to the TLS port) give the places back.
      for (int fd : handshaking) {
        ASSERT_TRUE(kt::SendAllRaw(fd, "PING\r\n", 6));
        EXPECT_TRUE(FdClosedWithin(fd, kCloseWaitMs));
        ::close(fd);
      }
      ASSERT_TRUE(SourcesBecome(front, 0, 0));
    }
  }
  EXPECT_TRUE(UnauthenticatedBecome(0, 0, 0));
  EXPECT_EQ(Refusals("unauthenticated_connections"), 0);
}

// True when this host can bind an IPv6 socket (a dual-stack listener needs one).
bool Ipv6Available() {
  int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A dual-stack front (resp_listen = "::", which with auth on needs TLS) sees IPv4 clients as
// IPv4-mapped IPv6 addresses (::ffff:127.0.0.1): each counts as its IPv4 address, so 127.0.0.1
// and 127.0.0.2 are two sources there as on an IPv4 front, and the log names 127.0.0.1.
TEST_F(PreauthE2eTest, ADualStackFrontCountsMappedClientsAsTheirIpv4Address) {
  if (!Ipv6Available()) GTEST_SKIP() << "no IPv6 on this host";
  constexpr int kPerSource = 3;
  ASSERT_TRUE(StartDaemon(PerSourceLimits(8, kPerSource), true,
                          "[server]\nresp_listen = \"::\"\n" + TlsTables()));
  std::vector<int> handshaking;
  for (int i = 0; i < kPerSource; ++i) {
    handshaking.push_back(kt::ConnectTcp(d_->resp_port(), 0, kFlooder));
  }
  ASSERT_TRUE(SourcesBecome("resp", 1, kPerSource));
  int extra = kt::ConnectTcp(d_->resp_port(), 0, kFlooder);
  EXPECT_TRUE(FdClosedWithin(extra, kRefusedWaitMs)) << "a handshake over the source's cap";
  ::close(extra);
  ASSERT_TRUE(RefusalsBecome("unauthenticated_per_source", 1));
  EXPECT_NE(d_->Log().find("RESP front: closed a connection at accept: its source 127.0.0.1 "),
            std::string::npos);
  std::string error;
  auto other = kt::TlsTestConn::Connect(d_->resp_port(), pki_.ca_file, &error, 5000, 0, kOtherHost);
  ASSERT_NE(other, nullptr) << error;
  ASSERT_TRUE(other->Send("AUTH alice-token\r\n"));
  EXPECT_EQ(other->RecvUntil("\r\n"), "+OK\r\n");
  for (int fd : handshaking) ::close(fd);
  EXPECT_TRUE(SourcesBecome("resp", 0, 0));
}

// Auth off: every connection is authenticated at accept. A tiny deadline and cap change
// nothing: connections beyond the cap are accepted, silent ones stay open past many times the
// deadline and are served; nothing is counted.
// The HTTP admin front (auth on): one source holds at most http_connections_per_source_max
// connections, whole lifetimes (requests there carry their own tokens; /readyz and /metrics
// need none), so a host holding idle connections cannot take the probes' and scrapers' places.
// Its further connections are closed at accept (reason http_per_source) while another host's
// requests are answered; a place is given back when its connection closes.
TEST_F(PreauthE2eTest, OneSourceCannotTakeTheHttpFront) {
  constexpr int kFrontMax = 8, kPerSource = 3, kFlood = 4 * kFrontMax;
  ASSERT_TRUE(StartDaemon("http_connections_max = " + std::to_string(kFrontMax) +
                          "\nhttp_connections_per_source_max = " + std::to_string(kPerSource) +
                          "\n"));
  // The flooder is 127.0.0.2 here: the test reads /metrics from 127.0.0.1.
  const char* flooder = kOtherHost;
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    flood.push_back(kt::ConnectTcp(d_->http_port(), 0, flooder));
    ASSERT_GE(flood.back(), 0);
  }
  ASSERT_TRUE(RefusalsBecome("http_per_source", kFlood - kPerSource));
  std::vector<int> held = OpenOnesOnceClosed(flood, kFlood - kPerSource);
  EXPECT_EQ(held.size(), static_cast<size_t>(kPerSource));
  EXPECT_EQ(Refusals("front_connections"), 0) << "the front's cap was never reached";
  // The reader's own connection is the second source while the page is rendered.
  EXPECT_EQ(Sample("kvtier_http_sources"), 2);
  EXPECT_EQ(Sample("kvtier_http_top_source_connections"), kPerSource);
  const std::string ready = kt::HttpRequest(d_->http_port(), "GET", "/readyz");
  EXPECT_EQ(ready.rfind("HTTP/1.1 200", 0), 0u) << ready.substr(0, 200);
  // The held connections are served (one request each, keep-alive).
  for (int fd : held) {
    const std::string req = "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n";
    ASSERT_TRUE(kt::SendAllRaw(fd, req.data(), req.size()));
    EXPECT_EQ(kt::RecvFor(fd, 12, 5000).rfind("HTTP/1.1 200", 0), 0u);
  }
  int over = kt::ConnectTcp(d_->http_port(), 0, flooder);
  EXPECT_TRUE(FdClosedWithin(over, kRefusedWaitMs)) << "a connection over the source's cap";
  ::close(over);
  EXPECT_EQ(Refusals("http_per_source"), kFlood - kPerSource + 1);
  // Closed, the places come back: the source gets kPerSource connections again.
  for (int fd : held) ::close(fd);
  bool back = false;
  for (int waited_ms = 0; waited_ms < kCloseWaitMs && !back; waited_ms += 20) {
    back = Sample("kvtier_http_top_source_connections") == 1;  // the reader alone
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(back) << "the closed connections' places were not given back";
  held.clear();
  for (int i = 0; i < kPerSource; ++i) held.push_back(kt::ConnectTcp(d_->http_port(), 0, flooder));
  for (int fd : held) {
    const std::string req = "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n";
    ASSERT_TRUE(kt::SendAllRaw(fd, req.data(), req.size()));
    EXPECT_EQ(kt::RecvFor(fd, 12, 5000).rfind("HTTP/1.1 200", 0), 0u);
  }
  EXPECT_EQ(Refusals("http_per_source"), kFlood - kPerSource + 1);
  for (int fd : held) ::close(fd);
}

// With auth off kvtierd serves loopback only, one source: the HTTP front's per-source cap is
// not applied (its gauges are absent), only http_connections_max.
TEST_F(PreauthE2eTest, WithAuthOffTheHttpFrontHasNoPerSourceCap) {
  ASSERT_TRUE(StartDaemon("http_connections_per_source_max = 2\n", /*auth=*/false));
  std::vector<int> idle;
  for (int i = 0; i < 5; ++i) idle.push_back(kt::ConnectTcp(d_->http_port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (int fd : idle) EXPECT_TRUE(FdOpen(fd));
  EXPECT_EQ(Refusals("http_per_source"), 0);
  EXPECT_EQ(Sample("kvtier_http_sources"), -1);
  for (int fd : idle) ::close(fd);
}

TEST_F(PreauthE2eTest, WithAuthOffNothingChanges) {
  constexpr int kTinyTimeoutMs = 200;
  ASSERT_TRUE(StartDaemon(Limits(kTinyTimeoutMs, 1), /*auth=*/false));
  std::vector<kt::RawNative> natives;
  std::vector<int> resp;
  for (int i = 0; i < 3; ++i) {
    natives.push_back(kt::RawNative::Unix(d_->socket()));
    natives.push_back(kt::RawNative::Tcp(native_port_));
    resp.push_back(kt::ConnectTcp(d_->resp_port()));
  }
  EXPECT_EQ(Unauthenticated("unix"), 0);
  EXPECT_EQ(Unauthenticated("native_tcp"), 0);
  EXPECT_EQ(Unauthenticated("resp"), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(10 * kTinyTimeoutMs));
  uint64_t id = 1;
  for (auto& c : natives) ExpectRawServed(&c, ++id);  // no HELLO needed with auth off
  for (int fd : resp) EXPECT_EQ(RespCall(fd, "SET k v\r\n"), "+OK\r\n");
  EXPECT_EQ(Refusals("auth_timeout"), 0);
  EXPECT_EQ(Refusals("unauthenticated_connections"), 0);
  // Three per front from one source, over the per-source cap (min(8, 1) = 1): not counted.
  EXPECT_EQ(Refusals("unauthenticated_per_source"), 0);
  EXPECT_EQ(Sources("native_tcp"), 0);
  EXPECT_EQ(Sources("resp"), 0);
  for (int fd : resp) ::close(fd);
}

}  // namespace
}  // namespace kvtier::daemon
