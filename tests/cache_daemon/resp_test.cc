// RESP parser and encoders; the RESP key cache; and the RESP front end in-process over a
// real socket (fake store): pipelined replies byte-exact (small values copied, large ones
// written from the store's buffer), limits inside a pipeline, tenants on one connection.
#include "cache_daemon/resp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <random>
#include <thread>

#include "cache_daemon/daemon.h"
#include "cache_daemon/service.h"
#include "common/key_spec.h"
#include "tests/cache_daemon/fake_tier_manager.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/cache_daemon/resp_wire_util.h"

namespace kvtier::daemon::resp {
namespace {

namespace kt = kvtier::testing;

using Argv = std::vector<std::string>;

TEST(RespParser, MultibulkAcrossArbitrarySplits) {
  std::string wire = std::string("*3\r\n$3\r\nSET\r\n$3\r\nk\r1\r\n$5\r\nv") +
                     std::string(1, '\0') + "lue\r\n*1\r\n$4\r\nPING\r\n";
  for (size_t split = 1; split < wire.size(); ++split) {
    RespParser p;
    std::vector<Argv> cmds;
    Argv a;
    p.Append(std::string_view(wire).substr(0, split));
    while (*p.Next(&a)) cmds.push_back(a);
    p.Append(std::string_view(wire).substr(split));
    while (*p.Next(&a)) cmds.push_back(a);
    ASSERT_EQ(cmds.size(), 2u) << split;
    EXPECT_EQ(cmds[0], (Argv{"SET", "k\r1", std::string("v\0lue", 5)}));
    EXPECT_EQ(cmds[1], (Argv{"PING"}));
    EXPECT_EQ(p.buffered_bytes(), 0u);
  }
}

// What a parser yields for a stream fed in pieces of the given sizes (cycled), calling Next
// after each piece until it has nothing more: the commands, then "error: <status>" if it
// failed.
std::vector<Argv> ParseInPieces(const std::string& wire, const std::vector<size_t>& pieces,
                                RespLimits limits) {
  RespParser p(limits);
  std::vector<Argv> out;
  Argv a;
  size_t at = 0;
  for (size_t i = 0; at < wire.size(); ++i) {
    const size_t n = std::min(pieces[i % pieces.size()], wire.size() - at);
    p.Append(std::string_view(wire).substr(at, n));
    at += n;
    for (;;) {
      StatusOr<bool> got = p.Next(&a);
      if (!got.ok()) {
        out.push_back(Argv{"error: " + got.status().ToString()});
        return out;
      }
      if (!*got) break;
      out.push_back(a);
    }
  }
  return out;
}

// The commands a stream yields, and the error that ends it, do not depend on how its bytes
// are split into reads (the parse of an incomplete command resumes where it stopped).
TEST(RespParser, OutcomeDoesNotDependOnHowBytesAreSplit) {
  std::mt19937 rng(20261205);
  const RespLimits limits{
      .max_args = 12, .max_bulk_bytes = 300, .max_inline_bytes = 64, .max_command_bytes = 2000};
  auto arg = [&] {
    std::string s(rng() % 3 == 0 ? rng() % 300 : rng() % 12, 'x');
    for (char& c : s) c = "ab\r\n\0$*"[rng() % 7];
    return s;
  };
  for (int round = 0; round < 300; ++round) {
    std::string wire;
    const int commands = 1 + static_cast<int>(rng() % 8);
    for (int c = 0; c < commands; ++c) {
      switch (rng() % 6) {
        case 0:  // inline
          wire += "SET  k" + std::to_string(rng() % 100) + " v\t" + std::string(rng() % 40, 'w') +
                  (rng() % 2 ? "\r\n" : "\n");
          break;
        case 1:  // empty multibulk
          wire += rng() % 2 ? "*0\r\n" : "*-1\r\n";
          break;
        default: {
          const size_t n = 1 + rng() % 12;
          wire += "*" + std::to_string(n) + "\r\n";
          for (size_t i = 0; i < n; ++i) {
            std::string v = arg();
            // Leading zeros in a length are valid and make long header lines.
            wire += "$" + std::string(rng() % 4 == 0 ? rng() % 40 : 0, '0') +
                    std::to_string(v.size()) + "\r\n" + v + "\r\n";
          }
        }
      }
    }
    if (rng() % 3 == 0) {  // then a protocol error or a limit, sometimes
      const char* bad[] = {
          "*x\r\n",
          "*1\r\nX3\r\n",
          "*13\r\n",
          "*1\r\n$301\r\n",
          "*1\r\n$3\r\nabcXY",
          "*2\r\n$1999\r\n",
          "PING PING PING PING PING PING PING PING PING PING PING PING PING\n",
          "*1\r\n$00000000000000000000000000000000000000000000000000000000000001\r\n"};
      wire += bad[rng() % std::size(bad)];
    }
    const std::vector<Argv> whole = ParseInPieces(wire, {wire.size()}, limits);
    EXPECT_EQ(ParseInPieces(wire, {1}, limits), whole) << "round " << round;
    EXPECT_EQ(ParseInPieces(wire, {2, 1, 3}, limits), whole) << "round " << round;
    std::vector<size_t> random;
    for (int i = 0; i < 16; ++i) random.push_back(1 + rng() % 64);
    EXPECT_EQ(ParseInPieces(wire, random, limits), whole) << "round " << round;
  }
}

// The parser's work is linear in its input however the input is split: an incomplete
// command resumes at its first unfinished argument, and a line's search where the last one
// stopped. A command of 65,536 empty arguments sent one argument per read used to be
// re-parsed from its start on every read (2^31 argument headers for 393 KB); a long line or
// a long length header sent a byte at a time was searched again from its start.
TEST(RespParser, WorkIsLinearHoweverACommandIsSplit) {
  auto steps = [](const std::string& wire, size_t piece) {
    RespParser p;
    Argv a;
    size_t commands = 0;
    for (size_t at = 0; at < wire.size(); at += piece) {
      p.Append(std::string_view(wire).substr(at, piece));
      StatusOr<bool> got = p.Next(&a);
      EXPECT_TRUE(got.ok()) << got.status().ToString();
      commands += got.ok() && *got ? 1 : 0;
    }
    EXPECT_EQ(commands, 1u);
    EXPECT_EQ(p.buffered_bytes(), 0u);
    return p.parse_steps();
  };
  std::string many = "*65536\r\n";
  for (int i = 0; i < 65536; ++i) many += "$0\r\n\r\n";
  EXPECT_LE(steps(many, 6), 4 * many.size());
  EXPECT_LE(steps(many, 1), 4 * many.size());
  const std::string line = "SET k " + std::string(60000, 'v') + "\r\n";
  EXPECT_LE(steps(line, 1), 4 * line.size());
  const std::string long_header =
      "*1\r\n$" + std::string(60000, '0') + "100000\r\n" + std::string(100000, 'b') + "\r\n";
  EXPECT_LE(steps(long_header, 1), 4 * long_header.size());
}

TEST(RespParser, InlineCommands) {
  RespParser p;
  p.Append("PING\r\nset  a   b\nGET a\r\n");
  Argv a;
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, Argv{"PING"});
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, (Argv{"set", "a", "b"}));
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, (Argv{"GET", "a"}));
  EXPECT_FALSE(*p.Next(&a));
}

TEST(RespParser, ProtocolErrors) {
  const char* bad[] = {"*x\r\n", "*1\r\nX3\r\n", "*1\r\n$-5\r\n", "*1\r\n$3\r\nabcXY"};
  for (const char* b : bad) {
    RespParser p;
    p.Append(b);
    Argv a;
    StatusOr<bool> r = p.Next(&a);
    EXPECT_FALSE(r.ok()) << b;
    EXPECT_FALSE(p.Next(&a).ok()) << "parser must stay failed";
  }
}

TEST(RespParser, EnforcesLimits) {
  RespParser p(RespLimits{.max_args = 2, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  Argv a;
  p.Append("*3\r\n");
  EXPECT_FALSE(p.Next(&a).ok());
  RespParser q(RespLimits{.max_args = 2, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  q.Append("*1\r\n$5\r\n");
  EXPECT_FALSE(q.Next(&a).ok());
  RespParser r(RespLimits{.max_args = 8, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  r.Append(std::string(40, 'a'));  // an inline line that never ends
  EXPECT_FALSE(r.Next(&a).ok());
  RespParser s(RespLimits{.max_args = 8, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  s.Append(std::string(10, 'a'));  // still within the limit: incomplete, not an error
  StatusOr<bool> ok = s.Next(&a);
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(*ok);
}

// The command limit is judged from each "$N" header: a command announcing more is refused
// (Rejected) before its bytes arrive; one that fits exactly parses; a lowered limit applies
// to the next command.
TEST(RespParser, CommandBytesLimitFromTheHeader) {
  Argv a;
  RespParser p(RespLimits{.max_command_bytes = 64});
  p.Append("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1000\r\n");  // body never sent
  StatusOr<bool> big = p.Next(&a);
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(big.status().IsRejected()) << big.status().ToString();
  EXPECT_FALSE(p.Next(&a).ok()) << "the parser stays failed";
  // "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$N\r\n" + N bytes + "\r\n" is exactly 64 bytes for N = 37.
  std::string fits = "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$37\r\n" + std::string(37, 'v') + "\r\n";
  ASSERT_EQ(fits.size(), 64u);
  RespParser q(RespLimits{.max_command_bytes = 64});
  q.Append(fits);
  StatusOr<bool> ok = q.Next(&a);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(*ok);
  q.set_max_command_bytes(63);
  q.Append(fits);
  EXPECT_TRUE(q.Next(&a).status().IsRejected());
  RespParser r(RespLimits{.max_command_bytes = 16});
  r.Append("GET aaaaaaaaaaaaaaaaaaaaaaaa");  // an inline line past the limit, unfinished
  EXPECT_TRUE(r.Next(&a).status().IsRejected());
}

TEST(RespEncode, Replies) {
  std::string out;
  AppendSimple("OK", &out);
  AppendError("ERR bad\r\nthing", &out);
  AppendInteger(-2, &out);
  AppendBulk(std::string("a\0b", 3), &out);
  AppendNull(&out);
  AppendArrayHeader(2, &out);
  EXPECT_EQ(out, std::string("+OK\r\n-ERR bad  thing\r\n:-2\r\n$3\r\na\0b\r\n$-1\r\n*2\r\n", 45));
}

TEST(RespParser, ReadsIntoPrepareWriteAndHandsOutViews) {
  std::string big(100000, 'v');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>('a' + i % 26);
  std::string wire = "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$" + std::to_string(big.size()) + "\r\n" + big +
                     "\r\n" + "GET k\r\n*2\r\n$3\r\nGET\r\n$2\r\nk2\r\n";
  for (size_t chunk : {size_t{1}, size_t{7}, size_t{4096}, size_t{1} << 20}) {
    RespParser p;
    std::vector<std::vector<std::string>> cmds;
    std::vector<std::string_view> a;
    for (size_t off = 0; off < wire.size();) {
      std::span<uint8_t> dst = p.PrepareWrite(chunk);
      ASSERT_GE(dst.size(), chunk);
      size_t n = std::min(chunk, wire.size() - off);
      std::memcpy(dst.data(), wire.data() + off, n);
      p.Commit(n);
      off += n;
      while (*p.Next(&a)) cmds.emplace_back(a.begin(), a.end());
    }
    ASSERT_EQ(cmds.size(), 3u) << chunk;
    EXPECT_EQ(cmds[0], (Argv{"SET", "k", big})) << chunk;
    EXPECT_EQ(cmds[1], (Argv{"GET", "k"}));
    EXPECT_EQ(cmds[2], (Argv{"GET", "k2"}));
    EXPECT_EQ(p.buffered_bytes(), 0u);
  }
}

TEST(RespParser, BigBufferIsReleasedWhenDrained) {
  RespParser p;
  std::string big = "*2\r\n$4\r\nECHO\r\n$" + std::to_string(RespParser::kKeepBufferBytes * 2) +
                    "\r\n" + std::string(RespParser::kKeepBufferBytes * 2, 'x') + "\r\n";
  p.Append(big);
  std::vector<std::string_view> a;
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a[1].size(), RespParser::kKeepBufferBytes * 2);
  // Drained: the next read gets a small buffer again, not the old 8 MiB one.
  std::span<uint8_t> dst = p.PrepareWrite(1024);
  EXPECT_LT(dst.size(), RespParser::kKeepBufferBytes);
  p.Append("PING\r\n");
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, (std::vector<std::string_view>{"PING"}));
}

TEST(RespEncode, BulkHeaderAndLargeIntegers) {
  std::string out;
  AppendBulkHeader(57000, &out);
  AppendInteger(INT64_MIN, &out);
  AppendArrayHeader(0, &out);
  EXPECT_EQ(out, "$57000\r\n:-9223372036854775808\r\n*0\r\n");
}

Digest SaltOf(uint8_t b) {
  Digest d{};
  d.fill(b);
  return d;
}

TEST(RespKeyCache, BindsExactlyAsWithoutCacheAndNeverAcrossTenants) {
  Service svc(nullptr, nullptr, nullptr, nullptr, PolicySettings{});
  Tenant a, b;
  a.id = 1;
  a.salt = SaltOf(0xaa);
  b.id = 2;
  b.salt = SaltOf(0xbb);
  RespKeyCache cache;
  // More keys than slots (evictions), a long uncached key, and the same keys for both tenants,
  // interleaved on one cache as a connection that re-authenticates would use it.
  std::vector<std::string> keys;
  for (size_t i = 0; i < 3 * RespKeyCache::kSlots; ++i) keys.push_back("key:" + std::to_string(i));
  keys.push_back(std::string(RespKeyCache::kKeyBytesMax + 1, 'L'));
  keys.push_back("");
  for (int round = 0; round < 3; ++round) {
    for (const std::string& k : keys) {
      storage::Key ka = svc.BindResp(a, k), kb = svc.BindResp(b, k);
      ASSERT_NE(ka, kb) << k;
      EXPECT_EQ(svc.BindResp(a, k, &cache), ka) << k;
      EXPECT_EQ(svc.BindResp(b, k, &cache), kb) << k;
      EXPECT_EQ(svc.BindResp(a, k, &cache), ka) << k;
    }
  }
  EXPECT_GT(cache.hits(), 0u);
  // A tenant that shares the first 8 salt bytes (same slot) still misses the other's entry.
  Tenant c;
  c.id = 3;
  c.salt = a.salt;
  c.salt[31] ^= 1;
  cache.Insert(a.salt, "x", svc.BindResp(a, "x"));
  EXPECT_EQ(cache.Find(c.salt, "x"), nullptr);
  EXPECT_EQ(svc.BindResp(c, "x", &cache), svc.BindResp(c, "x"));
  EXPECT_NE(svc.BindResp(c, "x"), svc.BindResp(a, "x"));
  // The derivation itself is the documented one (docs/format/wire.md, "Keys and tenants").
  std::vector<uint8_t> pre = {0x01, 11, 0, 0, 0};
  for (char ch : std::string_view("kvtier.resp")) pre.push_back(static_cast<uint8_t>(ch));
  pre.insert(pre.end(), {0x05, 1, 0, 0, 0, 'k'});
  EXPECT_EQ(svc.BindResp(a, "k", &cache), StorageKey(a.salt, Sha256(pre)));
}

// The RESP port of an in-process daemon over the fake store.
class RespFrontTest : public ::testing::Test {
 protected:
  // reply_queue_bytes: limits.reply_queue_bytes_max (0: the default).
  void Start(bool auth, uint32_t max_args = 64, uint64_t max_value_bytes = 1u << 20,
             uint64_t reply_queue_bytes = 0) {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("kvresp" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(dir_);
    o_ = DaemonOptions{};
    o_.data_dir = dir_.string();
    o_.socket_path = (dir_ / "s.sock").string();
    o_.native_port = kt::FreePort();
    o_.resp_port = kt::FreePort();
    o_.http_port = kt::FreePort();
    o_.resp_max_args = max_args;
    o_.storage.max_value_bytes = max_value_bytes;
    if (reply_queue_bytes != 0) o_.reply_queue_bytes_max = reply_queue_bytes;
    std::vector<uint8_t> secret(32, 9);
    std::unique_ptr<TenantRegistry> tenants;
    if (auth) {
      auto hex = [](std::string_view tok) {
        return ToHex(Sha256(
            std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(tok.data()), tok.size())));
      };
      auto t = TenantRegistry::Parse("[[tenant]]\nname = \"alice\"\nid = 1\ntoken_sha256 = [\"" +
                                         hex("tok-alice") +
                                         "\"]\n[[tenant]]\nname = \"bob\"\nid = 2\n"
                                         "token_sha256 = [\"" +
                                         hex("tok-bob") + "\"]\n",
                                     secret);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      tenants = std::move(t).value();
      o_.tokens_file = "inline";
    } else {
      tenants = TenantRegistry::Open(secret, 64);
    }
    ASSERT_TRUE(Finalize(&o_).ok());
    auto d =
        Daemon::Start(o_, std::make_unique<kt::FakeTierManager>(), std::move(tenants), nullptr);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    daemon_ = std::move(d).value();
    fd_ = kt::ConnectTcp(o_.resp_port);
    ASSERT_GE(fd_, 0);
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
    if (daemon_) {
      daemon_->Shutdown();
      EXPECT_TRUE(daemon_->Wait().ok());
    }
    std::filesystem::remove_all(dir_);
  }
  // Sends cmds in one write and reads exactly want.size() bytes (or until timeout/close).
  std::string Roundtrip(const std::string& cmds, size_t want_bytes, bool* closed = nullptr) {
    EXPECT_TRUE(kt::SendAllRaw(fd_, cmds.data(), cmds.size()));
    return kt::RecvFor(fd_, want_bytes, 5000, closed);
  }

  std::filesystem::path dir_;
  DaemonOptions o_;
  std::unique_ptr<Daemon> daemon_;
  int fd_ = -1;
};

using kvtier::testing::Bulk;
using kvtier::testing::Cmd;

std::string Pattern(size_t n, int seed) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) ^ (i >> 9));
  return v;
}

TEST_F(RespFrontTest, PipelinedRepliesAreByteExact) {
  Start(false);
  // Values below and above the 16 KiB scatter threshold, with CR/LF/NUL bytes inside.
  const std::string small = Pattern(100, 1), edge = Pattern(16 * 1024, 2),
                    big = Pattern(200 * 1000, 3), empty;
  std::string sets = Cmd({"SET", "s", small}) + Cmd({"SET", "e", edge}) + Cmd({"SET", "b", big}) +
                     Cmd({"SET", "z", empty}) + "PING\r\n";
  std::string want = "+OK\r\n+OK\r\n+OK\r\n+OK\r\n+PONG\r\n";
  EXPECT_EQ(Roundtrip(sets, want.size()), want);
  // 60 pipelined rounds of GETs: about 13 MB of replies, more than the 8 MiB a connection
  // buffers before it writes, and far more than the socket takes at once.
  std::string gets, expect;
  for (int i = 0; i < 60; ++i) {
    gets += Cmd({"GET", "b"}) + Cmd({"GET", "s"}) + Cmd({"GET", "missing"}) + Cmd({"GET", "e"}) +
            Cmd({"MGET", "b", "nope", "s", "z"}) + Cmd({"GET", "z"});
    expect += Bulk(big) + Bulk(small) + "$-1\r\n" + Bulk(edge) + "*4\r\n" + Bulk(big) + "$-1\r\n" +
              Bulk(small) + Bulk(empty) + Bulk(empty);
  }
  std::string got = Roundtrip(gets, expect.size());
  ASSERT_EQ(got.size(), expect.size());
  EXPECT_TRUE(got == expect) << "first difference at byte "
                             << std::mismatch(got.begin(), got.end(), expect.begin()).first -
                                    got.begin();
  // The connection still works afterwards (buffers recycled, nothing left over).
  EXPECT_EQ(Roundtrip(Cmd({"GET", "b"}), big.size() + 10), Bulk(big));
}

// An MGET whose reply is many times the connection's reply budget (64 KiB here) is answered
// in parts as the earlier ones are written: byte-exact and in order with the commands
// pipelined before and after it, also inside MULTI/EXEC.
TEST_F(RespFrontTest, MgetOverTheReplyBudgetIsAnsweredInOrder) {
  Start(false, /*max_args=*/64, /*max_value_bytes=*/1u << 20, /*reply_queue_bytes=*/64u << 10);
  const std::string big = Pattern(200 * 1000, 4), small = Pattern(100, 5);
  std::string sets = Cmd({"SET", "b", big}) + Cmd({"SET", "s", small});
  EXPECT_EQ(Roundtrip(sets, 10), "+OK\r\n+OK\r\n");
  std::vector<std::string_view> mget = {"MGET"};
  std::string elements;
  for (int i = 0; i < 20; ++i) {
    mget.insert(mget.end(), {"b", "nope", "s"});
    elements += Bulk(big) + "$-1\r\n" + Bulk(small);
  }
  std::string mget_cmd = "*" + std::to_string(mget.size()) + "\r\n";
  for (std::string_view a : mget) mget_cmd += Bulk(a);
  const std::string mget_reply = "*60\r\n" + elements;
  std::string cmds, expect;
  for (int round = 0; round < 3; ++round) {
    cmds += Cmd({"GET", "s"}) + mget_cmd + Cmd({"GET", "s"}) + "MULTI\r\n" + mget_cmd +
            Cmd({"GET", "b"}) + mget_cmd + "EXEC\r\nPING\r\n";
    expect += Bulk(small) + mget_reply + Bulk(small) + "+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n" +
              "*3\r\n" + mget_reply + Bulk(big) + mget_reply + "+PONG\r\n";
  }
  std::string got = Roundtrip(cmds, expect.size());
  ASSERT_EQ(got.size(), expect.size());
  EXPECT_TRUE(got == expect) << "first difference at byte "
                             << std::mismatch(got.begin(), got.end(), expect.begin()).first -
                                    got.begin();
  EXPECT_EQ(Roundtrip(Cmd({"GET", "s"}), Bulk(small).size()), Bulk(small));
}

TEST_F(RespFrontTest, LimitsStillApplyInsideAPipeline) {
  Start(false, /*max_args=*/8, /*max_value_bytes=*/4096);
  // Commands before the bad one are answered in order; the oversized bulk is a protocol
  // error that closes the connection; nothing after it runs.
  std::string cmds = Cmd({"SET", "a", "1"}) + Cmd({"GET", "a"}) +
                     "*3\r\n$3\r\nSET\r\n$1\r\nc\r\n$" + std::to_string(4097) + "\r\n" +
                     Cmd({"SET", "after", "x"});
  bool closed = false;
  std::string got = Roundtrip(cmds, 1 << 20, &closed);
  EXPECT_EQ(got.substr(0, 12), "+OK\r\n$1\r\n1\r\n");
  EXPECT_EQ(got.substr(12, 20), "-ERR Protocol error:");
  EXPECT_TRUE(closed);
  ::close(fd_);
  // Too many arguments in one command, after a pipelined GET.
  fd_ = kt::ConnectTcp(o_.resp_port);
  ASSERT_GE(fd_, 0);
  std::string many = Cmd({"GET", "a"}) + Cmd({"MGET", "1", "2", "3", "4", "5", "6", "7", "8"});
  got = Roundtrip(many, 1 << 20, &closed);
  EXPECT_EQ(got.substr(0, 7), "$1\r\n1\r\n");
  EXPECT_EQ(got.substr(7, 20), "-ERR Protocol error:");
  EXPECT_TRUE(closed);
  ::close(fd_);
  // Nothing after the protocol error ran; the daemon still serves new connections.
  fd_ = kt::ConnectTcp(o_.resp_port);
  ASSERT_GE(fd_, 0);
  EXPECT_EQ(Roundtrip(Cmd({"GET", "after"}) + Cmd({"GET", "a"}), 12), "$-1\r\n$1\r\n1\r\n");
}

TEST_F(RespFrontTest, KeyCacheNeverCrossesTenantsOnOneConnection) {
  Start(true);
  // Same connection, same key, two tenants: the per-connection key cache must not hand
  // alice's storage key to bob after re-authentication (or back).
  auto expect = [&](const std::string& cmds, const std::string& want) {
    EXPECT_EQ(Roundtrip(cmds, want.size()), want) << cmds;
  };
  expect("AUTH tok-alice\r\n" + Cmd({"SET", "k", "alice"}) + Cmd({"GET", "k"}),
         "+OK\r\n+OK\r\n$5\r\nalice\r\n");
  expect("AUTH tok-bob\r\n" + Cmd({"GET", "k"}) + Cmd({"SET", "k", "bob"}) + Cmd({"GET", "k"}),
         "+OK\r\n$-1\r\n+OK\r\n$3\r\nbob\r\n");
  expect("AUTH tok-alice\r\n" + Cmd({"GET", "k"}), "+OK\r\n$5\r\nalice\r\n");
  expect("AUTH tok-bob\r\n" + Cmd({"GET", "k"}), "+OK\r\n$3\r\nbob\r\n");
}

}  // namespace
}  // namespace kvtier::daemon::resp
