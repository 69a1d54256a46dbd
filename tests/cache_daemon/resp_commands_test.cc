// The RESP front end's command vocabulary (glob, SET/SCAN option grammars, arity), the MULTI
// queue and its limits, and the key-name index behind SCAN/KEYS with its cursor guarantee.
#include "cache_daemon/resp_commands.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/resp_key_index.h"
#include "cache_daemon/resp_transaction.h"
#include "cache_daemon/service.h"
#include "tests/cache_daemon/fake_tier_manager.h"

namespace kvtier::daemon {
namespace {

using resp::GlobMatch;
using SV = std::vector<std::string_view>;

TEST(RespGlob, RedisSemantics) {
  struct Case {
    std::string_view pattern, s;
    bool match;
  };
  const Case cases[] = {
      {"*", "", false},  // Redis: "" matches only ""; KEYS/SCAN list it for "*" themselves
      {"**", "", false},
      {"?*", "", false},
      {"*", "abc", true},
      {"", "", true},
      {"", "a", false},
      {"a*", "abc", true},
      {"a*c", "abc", true},
      {"a*c", "abd", false},
      {"a**c", "ac", true},
      {"h?llo", "hello", true},
      {"h?llo", "hllo", false},
      {"h[ae]llo", "hallo", true},
      {"h[ae]llo", "hillo", false},
      {"h[^e]llo", "hallo", true},
      {"h[^e]llo", "hello", false},
      {"h[a-b]llo", "hbllo", true},
      {"h[a-b]llo", "hcllo", false},
      {"h[b-a]llo", "hallo", true},  // reversed range
      {"h\\*llo", "h*llo", true},
      {"h\\*llo", "hello", false},
      {"h\\?", "h?", true},
      {"h\\?", "hx", false},
      {"[\\]]", "]", true},
      {"[\\-]", "-", true},
      {"[abc", "b", true},  // unterminated bracket ends at the pattern's end
      // Range bytes compare as signed char, as Redis's stringmatchlen on x86-64: \xff is -1.
      {"[\xff-b]", "A", true},
      {"[\xff-b]", "\xff", true},
      {"[\xff-b]", "c", false},
      {"[a-\x80]", "b", false},
      {"[a-\x80]", "\xc0", true},
      {"a[", "a", false},
      {"\\", "\\", true},  // a lone trailing backslash is literal
      {"*a*b*c*", "xxaxxbxxcxx", true},
      {"*a*b*c*", "xxaxxcxxbxx", false},
      {"a?c", std::string_view("a\0c", 3), true},
      {"lmcache:*@meta", "lmcache:model@0@abc@meta", true},
      {"lmcache:*@meta", "lmcache:model@0@abc@kv", false},
      {"[]", "a", false},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(GlobMatch(c.pattern, c.s), c.match) << c.pattern << " vs " << c.s;
  }
}

TEST(RespGlob, PathologicalPatternIsBoundedAndCorrect) {
  // Redis once recursed per '*'; here many stars over a long non-matching key stay O(n*m).
  std::string pattern;
  for (int i = 0; i < 64; ++i) pattern += "*a";
  pattern += "*b";
  std::string s(20000, 'a');
  EXPECT_FALSE(GlobMatch(pattern, s));
  s.back() = 'b';
  EXPECT_TRUE(GlobMatch(pattern, s));
}

TEST(RespSetOptions, GrammarAndRedisErrors) {
  constexpr uint64_t kNowMs = 1'700'000'000'000;  // a unix time in ms (2023)
  auto parse = [](SV v) { return resp::ParseSetOptions(v, kNowMs); };
  auto o = parse({});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->plain());
  o = parse({"nx", "Px", "1500"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->cond, resp::SetOptions::Cond::kIfAbsent);
  EXPECT_EQ(o->ttl_ms, 1500u);
  EXPECT_FALSE(o->plain());
  o = parse({"EX", "2"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->ttl_ms, 2000u);
  EXPECT_TRUE(o->plain());  // an expiry alone needs no read
  o = parse({"XX", "KEEPTTL", "GET"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->cond, resp::SetOptions::Cond::kIfPresent);
  EXPECT_TRUE(o->keep_ttl && o->get);

  auto err = [&](SV v) {
    auto r = parse(v);
    return r.ok() ? std::string("ok") : r.status().message();
  };
  EXPECT_EQ(err({"NX", "XX"}), "ERR syntax error");
  // Redis 7 allows a repeated option; the last EX / PX operand counts, and every option is
  // judged before the operand (these were errors, or the operand's error, here).
  EXPECT_EQ(err({"NX", "NX"}), "ok");
  EXPECT_EQ(err({"KEEPTTL", "KEEPTTL", "GET", "GET"}), "ok");
  o = parse({"EX", "ten", "EX", "3"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->ttl_ms, 3000u);
  EXPECT_EQ(err({"EX", "ten", "FOO"}), "ERR syntax error");
  EXPECT_EQ(err({"EX", "0", "XX", "NX"}), "ERR syntax error");
  EXPECT_EQ(err({"XX", "NX"}), "ERR syntax error");
  EXPECT_EQ(err({"EX", "1", "KEEPTTL"}), "ERR syntax error");
  EXPECT_EQ(err({"PX", "1", "EX", "1"}), "ERR syntax error");
  // Redis's integer syntax: no leading zero, no '+', no "-0".
  EXPECT_EQ(err({"EX", "007"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"PX", "+5"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"PX", "-0"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"EX", "1", "PX", "1"}), "ERR syntax error");
  EXPECT_EQ(err({"KEEPTTL", "EX", "1"}), "ERR syntax error");
  EXPECT_EQ(err({"EX"}), "ERR syntax error");
  EXPECT_EQ(err({"BOGUS"}), "ERR syntax error");
  EXPECT_EQ(err({"EX", "ten"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"EX", "99999999999999999999"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"EX", "0"}), "ERR invalid expire time in 'set' command");
  EXPECT_EQ(err({"PX", "-5"}), "ERR invalid expire time in 'set' command");
  // Seconds that overflow as milliseconds are refused, never wrapped.
  EXPECT_EQ(err({"EX", "9223372036854775807"}), "ERR invalid expire time in 'set' command");
  // So is an expiry whose absolute time (now + ttl) overflows int64, as in Redis.
  EXPECT_EQ(err({"PX", "9223372036854775807"}), "ERR invalid expire time in 'set' command");
  EXPECT_EQ(err({"EX", "9223372036854775"}), "ERR invalid expire time in 'set' command");
  const int64_t last_ms = std::numeric_limits<int64_t>::max() - static_cast<int64_t>(kNowMs);
  EXPECT_EQ(err({"PX", std::to_string(last_ms + 1)}), "ERR invalid expire time in 'set' command");
  o = parse({"PX", std::to_string(last_ms)});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->ttl_ms, static_cast<uint64_t>(last_ms));
}

TEST(RespInteger, RedisSyntaxOnly) {
  int64_t v = 7;
  EXPECT_TRUE(resp::ParseRedisInt64("0", &v));
  EXPECT_EQ(v, 0);
  EXPECT_TRUE(resp::ParseRedisInt64("-12", &v));
  EXPECT_EQ(v, -12);
  EXPECT_TRUE(resp::ParseRedisInt64("9223372036854775807", &v));
  EXPECT_EQ(v, std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(resp::ParseRedisInt64("-9223372036854775808", &v));
  EXPECT_EQ(v, std::numeric_limits<int64_t>::min());
  for (std::string_view bad : {"", "-", "007", "00", "-0", "-01", "+5", " 5", "5 ", "1.5", "0x1",
                               "9223372036854775808", "-9223372036854775809", "1e3"}) {
    EXPECT_FALSE(resp::ParseRedisInt64(bad, &v)) << bad;
  }
}

TEST(RespExpireOptions, RedisErrorsThenNotSupported) {
  auto err = [](SV v) {
    Status st = resp::CheckExpireOptions(v);
    return st.ok() ? std::string("ok") : st.message();
  };
  EXPECT_EQ(err({}), "ok");
  EXPECT_EQ(err({"BOGUS"}), "ERR Unsupported option BOGUS");
  EXPECT_EQ(err({std::string_view("a\0b", 3)}), "ERR Unsupported option a");
  EXPECT_EQ(err({"nx", "BOGUS"}), "ERR Unsupported option BOGUS");
  EXPECT_EQ(err({"NX", "xx"}),
            "ERR NX and XX, GT or LT options at the same time are not compatible");
  EXPECT_EQ(err({"gt", "LT"}), "ERR GT and LT options at the same time are not compatible");
  EXPECT_EQ(err({"GT"}), "ERR EXPIRE options NX, XX, GT and LT are not supported");
}

TEST(RespUnknownCommand, RedisMessage) {
  auto msg = [](SV v) { return resp::UnknownCommandMessage(v); };
  EXPECT_EQ(msg({"FOO"}), "ERR unknown command 'FOO', with args beginning with: ");
  EXPECT_EQ(msg({"foo", "a", ""}), "ERR unknown command 'foo', with args beginning with: 'a' '' ");
  // C strings: each part ends at its first NUL.
  EXPECT_EQ(msg({std::string_view("f\0o", 3), std::string_view("x\0y", 3)}),
            "ERR unknown command 'f', with args beginning with: 'x' ");
  // The name is cut at 128 bytes; arguments are added while the list is under 128 bytes, each
  // cut to what is left of the 128.
  const std::string name(200, 'n'), a(100, 'a'), b(100, 'b');
  EXPECT_EQ(msg({name, a, b, "c"}), "ERR unknown command '" + std::string(128, 'n') +
                                        "', with args beginning with: '" + a + "' '" +
                                        std::string(25, 'b') + "' ");
}

// Redis 7 refuses a client name with a byte outside '!'..'~' (found by the differential test:
// kvtierd accepted any name, so HELLO 3 SETNAME "a b" switched to RESP3 where Redis refuses).
TEST(RespClientName, RedisCharacters) {
  EXPECT_TRUE(resp::ValidClientName(""));
  EXPECT_TRUE(resp::ValidClientName("cl-1"));
  EXPECT_TRUE(resp::ValidClientName("!~"));
  for (std::string_view bad : {"a b", "x\r\ny", "tab\t", "\x7f", "\xff", "\x20"}) {
    EXPECT_FALSE(resp::ValidClientName(bad)) << bad;
  }
  EXPECT_FALSE(resp::ValidClientName(std::string_view("a\0b", 3)));
}

TEST(RespExpiry, RelativeExpiryIsRefusedWhereItWouldOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr uint64_t kNowMs = 1'700'000'000'000;
  int64_t ms = 7;
  EXPECT_TRUE(resp::RelativeExpiryMs(5, true, kNowMs, &ms));
  EXPECT_EQ(ms, 5000);
  EXPECT_TRUE(resp::RelativeExpiryMs(5, false, kNowMs, &ms));
  EXPECT_EQ(ms, 5);
  EXPECT_TRUE(resp::RelativeExpiryMs(-3, true, kNowMs, &ms));  // already expired: allowed
  EXPECT_EQ(ms, -3000);
  EXPECT_TRUE(resp::RelativeExpiryMs(kMin, false, kNowMs, &ms));
  EXPECT_EQ(ms, kMin);
  ms = 7;
  // 18446744073709552 s is 2^64 ms and a little: it used to wrap to 448 ms.
  EXPECT_FALSE(resp::RelativeExpiryMs(18446744073709552, true, kNowMs, &ms));
  EXPECT_FALSE(resp::RelativeExpiryMs(kMax / 1000 + 1, true, 0, &ms));
  EXPECT_FALSE(resp::RelativeExpiryMs(kMin / 1000 - 1, true, 0, &ms));
  EXPECT_FALSE(resp::RelativeExpiryMs(kMax, false, 1, &ms));
  EXPECT_FALSE(resp::RelativeExpiryMs(kMax - static_cast<int64_t>(kNowMs) + 1, false, kNowMs, &ms));
  EXPECT_EQ(ms, 7) << "*ttl_ms is left alone when refused";
  EXPECT_TRUE(resp::RelativeExpiryMs(kMax - static_cast<int64_t>(kNowMs), false, kNowMs, &ms));
  EXPECT_EQ(ms, kMax - static_cast<int64_t>(kNowMs));
  EXPECT_TRUE(resp::RelativeExpiryMs(kMax / 1000, true, 0, &ms));
}

TEST(RespScanOptions, GrammarClampAndErrors) {
  auto o = resp::ParseScanOptions(SV{"SCAN", "0"}, 100);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->cursor, 0u);
  EXPECT_FALSE(o->has_pattern);
  o = resp::ParseScanOptions(
      SV{"SCAN", "18446744073709551615", "match", "k*", "COUNT", "99999999999"}, 100);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->cursor, 18446744073709551615ull);
  EXPECT_EQ(o->pattern, "k*");
  EXPECT_EQ(o->count, 100u);  // clamped
  o = resp::ParseScanOptions(SV{"SCAN", "0", "TYPE", "hash"}, 100);
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->only_other_type);
  auto err = [](SV v) {
    auto r = resp::ParseScanOptions(v, 100);
    return r.ok() ? std::string("ok") : r.status().message();
  };
  EXPECT_EQ(err({"SCAN", "-1"}), "ERR invalid cursor");
  EXPECT_EQ(err({"SCAN", "x"}), "ERR invalid cursor");
  EXPECT_EQ(err({"SCAN", "0", "COUNT", "0"}), "ERR syntax error");
  EXPECT_EQ(err({"SCAN", "0", "COUNT", "-3"}), "ERR syntax error");
  EXPECT_EQ(err({"SCAN", "0", "COUNT", "many"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"SCAN", "0", "COUNT", "010"}), "ERR value is not an integer or out of range");
  EXPECT_EQ(err({"SCAN", "0", "MATCH"}), "ERR syntax error");
  EXPECT_EQ(err({"SCAN", "0", "LIMIT", "3"}), "ERR syntax error");
}

TEST(RespArity, KnownCommandsAndCounts) {
  EXPECT_TRUE(resp::ArityAllows(resp::CommandArity("GET"), 2));
  EXPECT_FALSE(resp::ArityAllows(resp::CommandArity("GET"), 3));
  EXPECT_TRUE(resp::ArityAllows(resp::CommandArity("SET"), 7));
  EXPECT_FALSE(resp::ArityAllows(resp::CommandArity("SET"), 2));
  EXPECT_TRUE(resp::ArityAllows(resp::CommandArity("MGET"), 2));
  EXPECT_FALSE(resp::ArityAllows(resp::CommandArity("MGET"), 1));
  EXPECT_EQ(resp::CommandArity("NOSUCH"), 0);
  EXPECT_EQ(resp::CommandArity("get"), 0);  // the caller upper-cases
}

// CLIENT and CONFIG: Redis 7.0's refusals of an unknown subcommand and of a subcommand's
// argument count, word for word (redis-server 7.0.15; kvtier_resp_differential_test compares
// them live, in and out of MULTI).
TEST(RespSubcommands, RedisRefusals) {
  // The caller passes the command upper-cased (as the session does).
  auto error = [](SV v) {
    std::string upper(v[0]);
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return resp::SubcommandError(upper, v);
  };
  EXPECT_EQ(error({"CLIENT", "SETNAME", "cl-1"}), "");
  EXPECT_EQ(error({"client", "setname", "cl-1"}), "");
  EXPECT_EQ(error({"CONFIG", "GET", "save"}), "");
  EXPECT_EQ(error({"CONFIG", "get", "save", "appendonly"}), "");
  EXPECT_EQ(error({"CLIENT", "help"}), "");
  EXPECT_EQ(error({"CLIENT", "SETNAME"}),
            "ERR wrong number of arguments for 'client|setname' command");
  EXPECT_EQ(error({"Client", "SetName", "a", "b"}),
            "ERR wrong number of arguments for 'client|setname' command");
  EXPECT_EQ(error({"config", "GET"}), "ERR wrong number of arguments for 'config|get' command");
  EXPECT_EQ(error({"CONFIG", "HELP", "x"}),
            "ERR wrong number of arguments for 'config|help' command");
  // The subcommand as given, up to its first NUL and 128 bytes; the command in upper case.
  EXPECT_EQ(error({"client", "foo"}), "ERR unknown subcommand 'foo'. Try CLIENT HELP.");
  EXPECT_EQ(error({"config", "Set", "a", "b"}), "ERR unknown subcommand 'Set'. Try CONFIG HELP.");
  EXPECT_EQ(error({"CLIENT", std::string_view("x\0y", 3)}),
            "ERR unknown subcommand 'x'. Try CLIENT HELP.");
  EXPECT_EQ(error({"CLIENT", std::string(200, 's')}),
            "ERR unknown subcommand '" + std::string(128, 's') + "'. Try CLIENT HELP.");
  EXPECT_TRUE(resp::HasSubcommands("CLIENT"));
  EXPECT_FALSE(resp::HasSubcommands("GET"));
  EXPECT_EQ(resp::SubcommandHelp("CLIENT").front().substr(0, 19), "CLIENT <subcommand>");
  EXPECT_TRUE(resp::SubcommandHelp("GET").empty());
}

TEST(RespTransaction, QueuesCopiesAndReplaysInOrder) {
  resp::RespTransaction t({.commands_max = 10, .bytes_max = 1 << 20});
  EXPECT_FALSE(t.queuing());
  t.Begin();
  ASSERT_TRUE(t.queuing());
  std::string buf = "SET k1 v1";
  ASSERT_TRUE(t.Queue(SV{std::string_view(buf).substr(0, 3), std::string_view(buf).substr(4, 2),
                         std::string_view(buf).substr(7, 2)})
                  .ok());
  buf.assign("XXXXXXXXX");  // the caller's bytes change after queuing: the queue kept a copy
  ASSERT_TRUE(t.Queue(SV{"GET", "k1"}).ok());
  ASSERT_TRUE(t.Queue(SV{"PING"}).ok());
  bool aborted = true;
  ASSERT_EQ(t.StartExec(&aborted), 3u);
  EXPECT_FALSE(aborted);
  EXPECT_TRUE(t.executing());
  std::vector<std::string_view> argv;
  t.Command(0, &argv);
  EXPECT_EQ(argv, (SV{"SET", "k1", "v1"}));
  t.Command(1, &argv);
  EXPECT_EQ(argv, (SV{"GET", "k1"}));
  t.Command(2, &argv);
  EXPECT_EQ(argv, (SV{"PING"}));
  t.Finish();
  EXPECT_FALSE(t.queuing() || t.executing());
  EXPECT_EQ(t.held_bytes(), 0u);
}

TEST(RespTransaction, FlagAbortsExec) {
  resp::RespTransaction t({});
  t.Begin();
  ASSERT_TRUE(t.Queue(SV{"GET", "k"}).ok());
  t.Flag();
  bool aborted = false;
  EXPECT_EQ(t.StartExec(&aborted), 0u);
  EXPECT_TRUE(aborted);
  EXPECT_FALSE(t.queuing() || t.executing() || t.flagged());
}

TEST(RespTransaction, CommandLimitFreesQueueAndStaysBounded) {
  resp::RespTransaction t({.commands_max = 100, .bytes_max = 1 << 20});
  t.Begin();
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(t.Queue(SV{"SET", "key", "value"}).ok());
  Status st = t.Queue(SV{"SET", "key", "value"});
  EXPECT_TRUE(st.IsRejected());
  EXPECT_NE(st.message().find("limits.resp_multi_commands_max"), std::string::npos);
  EXPECT_TRUE(t.flagged());
  EXPECT_TRUE(t.queuing());
  EXPECT_EQ(t.held_bytes(), 0u);  // freed at once
  // A hostile client keeps sending: answered, never stored.
  for (int i = 0; i < 100000; ++i) ASSERT_TRUE(t.Queue(SV{"SET", "key", "value"}).ok());
  EXPECT_EQ(t.held_bytes(), 0u);
  EXPECT_EQ(t.size(), 0u);
  bool aborted = false;
  t.StartExec(&aborted);
  EXPECT_TRUE(aborted);
}

TEST(RespTransaction, ByteLimitCountsArgumentsAndOverhead) {
  resp::RespTransaction t({.commands_max = 1 << 20, .bytes_max = 4096});
  t.Begin();
  // Empty arguments still cost kArgOverheadBytes each: a flood of them hits the byte limit.
  std::vector<std::string_view> empties(100, std::string_view());
  size_t queued = 0;
  Status st;
  while ((st = t.Queue(empties)).ok()) ++queued;
  EXPECT_TRUE(st.IsRejected());
  EXPECT_NE(st.message().find("limits.resp_multi_bytes_max"), std::string::npos);
  EXPECT_EQ(queued, 4096 / (100 * resp::RespTransaction::kArgOverheadBytes +
                            resp::RespTransaction::kCommandOverheadBytes));
  EXPECT_EQ(t.held_bytes(), 0u);
}

storage::Key KeyWithPrefix(uint64_t prefix, uint8_t tail) {
  storage::Key k{};
  for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
  k[31] = tail;
  return k;
}

TEST(RespKeyIndex, CursorIsNeverZeroForAKey) {
  EXPECT_EQ(RespKeyIndex::CursorOf(KeyWithPrefix(0, 0)), 1u);
  EXPECT_EQ(RespKeyIndex::CursorOf(KeyWithPrefix(~0ull, 0)), 1ull << 63);
}

TEST(RespKeyIndex, EntriesSharingAPositionAreNeverSplit) {
  RespKeyIndex idx(1000, 1 << 20);
  // 0x10 and 0x11 differ only in the bit CursorOf drops: one position, three entries.
  (void)idx.Add(1, KeyWithPrefix(0x10, 1), "a");
  (void)idx.Add(1, KeyWithPrefix(0x10, 2), "b");
  (void)idx.Add(1, KeyWithPrefix(0x11, 0), "c");
  (void)idx.Add(1, KeyWithPrefix(0x20, 0), "d");
  std::vector<RespKeyIndex::Entry> out;
  uint64_t next = idx.Scan(1, 0, 1, &out);
  EXPECT_EQ(out.size(), 3u);
  EXPECT_EQ(next, RespKeyIndex::CursorOf(KeyWithPrefix(0x20, 0)));
  next = idx.Scan(1, next, 1, &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].name, "d");
  EXPECT_EQ(next, 0u);
  EXPECT_EQ(idx.Scan(2, 0, 10, &out), 0u);  // another tenant sees nothing
  EXPECT_TRUE(out.empty());
}

// The SCAN guarantee: every key present for a whole iteration is returned, whatever is
// added and removed between the steps.
TEST(RespKeyIndex, FullIterationUnderChurnReturnsEveryStableKey) {
  std::mt19937_64 rng(7);
  auto random_key = [&] {
    storage::Key k;
    for (auto& b : k) b = static_cast<uint8_t>(rng());
    return k;
  };
  for (size_t count : {1u, 3u, 10u, 1000u}) {
    RespKeyIndex idx(1 << 20, 1 << 30);
    std::vector<storage::Key> stable, churn;
    for (int i = 0; i < 500; ++i) {
      stable.push_back(random_key());
      (void)idx.Add(9, stable.back(), "s" + std::to_string(i));
    }
    std::set<std::string> seen;
    uint64_t cursor = 0;
    int steps = 0;
    do {
      std::vector<RespKeyIndex::Entry> out;
      cursor = idx.Scan(9, cursor, count, &out);
      for (auto& e : out) seen.insert(e.name);
      // Churn between steps: add new keys anywhere, remove some of the added ones.
      for (int j = 0; j < 5; ++j) {
        churn.push_back(random_key());
        (void)idx.Add(9, churn.back(), "c");
      }
      if (churn.size() > 3) {
        idx.Remove(9, churn[rng() % churn.size()]);
      }
      ASSERT_LT(++steps, 100000);
    } while (cursor != 0);
    for (int i = 0; i < 500; ++i) {
      EXPECT_TRUE(seen.count("s" + std::to_string(i))) << "count " << count << " key " << i;
    }
  }
}

TEST(RespKeyIndex, LimitsCountUnindexedAndRemoveFreesBytes) {
  RespKeyIndex idx(3, 10 * RespKeyIndex::kEntryOverheadBytes);
  for (uint8_t i = 0; i < 5; ++i) (void)idx.Add(1, KeyWithPrefix(i << 8, i), "n");
  EXPECT_EQ(idx.size(1), 3u);
  EXPECT_EQ(idx.unindexed(), 2u);
  (void)idx.Add(1, KeyWithPrefix(0, 0), "n");  // already indexed: no-op, not counted
  EXPECT_EQ(idx.unindexed(), 2u);
  // The byte budget is over all tenants.
  std::string big(8 * RespKeyIndex::kEntryOverheadBytes, 'x');
  (void)idx.Add(2, KeyWithPrefix(1, 1), big);
  EXPECT_EQ(idx.size(2), 0u);
  EXPECT_EQ(idx.unindexed(), 3u);
  uint64_t before = idx.bytes();
  EXPECT_EQ(before, 3 * (1 + RespKeyIndex::kEntryOverheadBytes));
  idx.Remove(1, KeyWithPrefix(0, 0));
  EXPECT_EQ(idx.bytes(), before - 1 - RespKeyIndex::kEntryOverheadBytes);
  idx.RemoveTenant(1);
  EXPECT_EQ(idx.bytes(), 0u);
  EXPECT_EQ(idx.size(1), 0u);
}

// Service's RESP commands over a fake store: the conditional SET and the SCAN step.
class RespServiceTest : public ::testing::Test {
 protected:
  RespServiceTest()
      : tenants_(TenantRegistry::Open(std::vector<uint8_t>(32, 7), 1024)),
        svc_(&store_, tenants_.get(), &metrics_, nullptr, PolicySettings{}) {}
  const Tenant& tenant() { return *tenants_->default_tenant(); }

  kvtier::testing::FakeTierManager store_;
  DaemonMetrics metrics_;
  std::unique_ptr<TenantRegistry> tenants_;
  Service svc_;
};

// A plain SET or DEL of a key from another connection never lands between a conditional
// command's read and its write. Here one is sent (another thread) right after EXPIRE's read
// and given 300 ms: it used to land there, and EXPIRE then put the old value back with its
// TTL, over the acknowledged SET (v1 instead of v2) or after the acknowledged DEL (the key
// back). Now it waits for EXPIRE's write: the SET's value stays (without a TTL, as a SET
// after the EXPIRE), the DEL removes the key. The same for SET ... XX.
TEST_F(RespServiceTest, APlainSetOrDelNeverLandsInsideAConditionalCommand) {
  // Runs `write` on another thread right after the store's next read (the conditional's) and
  // gives it 300 ms to land before that read returns; `writer` is joined by the caller.
  std::thread writer;
  auto during_next_read = [&](std::function<void()> write) {
    store_.AfterNextGet([&writer, write] {
      auto wrote = std::make_shared<std::promise<void>>();
      std::future<void> landed = wrote->get_future();
      writer = std::thread([write, wrote] {
        write();
        wrote->set_value();
      });
      (void)landed.wait_for(std::chrono::milliseconds(300));
    });
  };
  std::string v;

  ASSERT_TRUE(svc_.RespSet(tenant(), "a", "v1", 0).ok());
  during_next_read([&] { EXPECT_TRUE(svc_.RespSet(tenant(), "a", "v2", 0).ok()); });
  ASSERT_TRUE(svc_.RespExpire(tenant(), "a", 60000).ok());
  writer.join();
  ASSERT_TRUE(svc_.RespGet(tenant(), "a", &v).ok());
  EXPECT_EQ(v, "v2") << "EXPIRE put the old value back over an acknowledged SET";
  EXPECT_EQ(svc_.RespTtlMs(tenant(), "a"), -1) << "the SET came after the EXPIRE";

  during_next_read([&] { EXPECT_TRUE(svc_.RespDel(tenant(), "a").ok()); });
  ASSERT_TRUE(svc_.RespExpire(tenant(), "a", 60000).ok());
  writer.join();
  EXPECT_TRUE(svc_.RespGet(tenant(), "a", &v).IsNotFound()) << "EXPIRE brought a deleted key back";

  ASSERT_TRUE(svc_.RespSet(tenant(), "b", "v1", 0).ok());
  during_next_read([&] { EXPECT_TRUE(svc_.RespSet(tenant(), "b", "v3", 0).ok()); });
  resp::SetOptions xx;
  xx.cond = resp::SetOptions::Cond::kIfPresent;
  xx.keep_ttl = true;
  bool written = false;
  ASSERT_TRUE(svc_.RespSetIf(tenant(), "b", "v2", xx, &written, nullptr).ok());
  writer.join();
  EXPECT_TRUE(written);
  ASSERT_TRUE(svc_.RespGet(tenant(), "b", &v).ok());
  EXPECT_EQ(v, "v3") << "SET XX overwrote an acknowledged SET that came after its read";
}

TEST_F(RespServiceTest, SetNxFromManyThreadsHasExactlyOneWriterPerKey) {
  constexpr int kThreads = 8, kKeys = 2000;
  std::vector<std::atomic<int>> writers(kKeys);
  std::vector<std::thread> threads;
  resp::SetOptions nx;
  nx.cond = resp::SetOptions::Cond::kIfAbsent;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kKeys; ++k) {
        bool written = false;
        ASSERT_TRUE(svc_.RespSetIf(tenant(), "k" + std::to_string(k), std::to_string(t), nx,
                                   &written, nullptr)
                        .ok());
        if (written) writers[k].fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int k = 0; k < kKeys; ++k) ASSERT_EQ(writers[k].load(), 1) << "key " << k;
}

TEST_F(RespServiceTest, ConditionsGetAndKeepTtl) {
  resp::SetOptions o;
  bool written = false;
  std::optional<std::string> old;
  o.cond = resp::SetOptions::Cond::kIfPresent;
  ASSERT_TRUE(svc_.RespSetIf(tenant(), "a", "1", o, &written, &old).ok());
  EXPECT_FALSE(written);
  EXPECT_FALSE(old.has_value());
  ASSERT_TRUE(svc_.RespSet(tenant(), "a", "1", 60000).ok());
  o.keep_ttl = o.get = true;
  ASSERT_TRUE(svc_.RespSetIf(tenant(), "a", "2", o, &written, &old).ok());
  EXPECT_TRUE(written);
  EXPECT_EQ(old, std::optional<std::string>("1"));
  int64_t ttl = svc_.RespTtlMs(tenant(), "a");
  EXPECT_GT(ttl, 50000);
  EXPECT_LE(ttl, 60000);
  o = resp::SetOptions{};
  o.get = true;  // without KEEPTTL the expiry goes
  ASSERT_TRUE(svc_.RespSetIf(tenant(), "a", "3", o, &written, &old).ok());
  EXPECT_EQ(old, std::optional<std::string>("2"));
  EXPECT_EQ(svc_.RespTtlMs(tenant(), "a"), -1);
}

TEST_F(RespServiceTest, ScanFiltersAndDropsKeysTheStoreLost) {
  for (int i = 0; i < 50; ++i)
    ASSERT_TRUE(svc_.RespSet(tenant(), "k" + std::to_string(i), "v", 0).ok());
  // The store loses one key behind the index's back (eviction).
  ASSERT_TRUE(store_.Delete(svc_.BindResp(tenant(), "k7")).ok());
  std::set<std::string> seen;
  std::vector<std::string> names;
  uint64_t cursor = 0;
  do {
    cursor = svc_.RespScan(
        tenant(), cursor, 4, [](std::string_view n) { return n != "k3"; }, &names);
    seen.insert(names.begin(), names.end());
  } while (cursor != 0);
  EXPECT_EQ(seen.size(), 48u);
  EXPECT_FALSE(seen.count("k7") || seen.count("k3"));
  EXPECT_EQ(svc_.resp_index().size(tenant().id), 49u);  // k7 pruned, k3 (unmatched) kept
  EXPECT_EQ(svc_.RespDbSize(tenant()), 49u);
}

}  // namespace
}  // namespace kvtier::daemon
