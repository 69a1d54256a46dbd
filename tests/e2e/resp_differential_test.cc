// Differential test of the RESP front: seeded random command sequences sent to the real kvtierd
// and to a real redis-server (Debian's 7.0), every reply compared byte for byte. docs/RESP.md
// promises Redis 7 grammar and error texts for the commands it lists; the differences it
// allows are normalised in one place, kAllowedDifferences / Allowed() below, each citing the
// docs. kvtierd runs with auth on (redis-server with the same token as requirepass, so one
// AUTH works on both) under its default durability and under "sync", whose SETs, MSETs and
// DELs complete on another code path (docs/RESP.md "Durable SETs and DELs under sync"), and
// with auth off (redis-server without requirepass: its user default takes any password).
//
// The generator works on a small key space (binary keys, the empty key) so commands collide:
// GET, SET with every option combination and invalid ones, SETNX, MSET, MGET, DEL/UNLINK,
// EXISTS, TYPE, EXPIRE/PEXPIRE, TTL/PTTL, DBSIZE, KEYS, SELECT, FLUSHDB/FLUSHALL, AUTH,
// MULTI/EXEC/DISCARD, PING/ECHO, unknown commands, wrong arity, commands kvtierd does not
// support (only "both answer an error" is checked), random name case, pipelined batches.
//
// - RESP3: a connection opens with AUTH, HELLO 3 AUTH or HELLO 2 AUTH (or first a HELLO
//   refused for want of AUTH), and the sequence switches it with HELLO 3 / HELLO 2 and sends
//   HELLO's wrong forms (NOPROTO, versions that are not integers, AUTH or SETNAME without
//   their operands, client names Redis refuses, also by CLIENT SETNAME, a wrong token once).
//   Every reply of a RESP3 connection is compared byte for byte like any other (nulls "_",
//   EXEC's array, MGET's missing keys, SET NX/XX unmet, SET GET); of a HELLO that succeeds
//   only its type (map or array) is compared, its fields are kvtier's own (docs/RESP.md).
// - Expiries: now and then a step gives keys expiries of a few milliseconds (SET ... PX,
//   PEXPIRE) and the run sleeps until they have expired on both servers (kExpiryWait), so
//   every later command meets expired keys: GET, EXISTS, TTL, DEL, SET NX/XX, KEYS, SCAN and
//   DBSIZE must treat them as Redis does (it found DEL counting an expired key as deleted).
// - Before AUTH: a connection may open by pipelining every command of CommandsBeforeAuth
//   (each command kvtierd knows, wrong arities, unknown (sub)commands, MULTI/EXEC) before its
//   AUTH, every reply compared byte for byte: only AUTH, HELLO and QUIT are served.
// - Several connections: a seed runs one, two or three connections to each server, every step
//   on one of them in the generated order (sent, its replies read, then the next step), so
//   writes of one are read by the others, a MULTI of one queues while others write and its
//   EXEC must see the state at EXEC time, and expiries set on one are read on another.
// - SCAN: its cursor and order are kvtier's own (docs/RESP.md), so a SCAN iteration (COUNT
//   1..20, MATCH or not, TYPE or not) is checked by property against redis-server's KEYS of the
//   same pattern, read on an extra connection before every SCAN call: every name a call lists
//   exists then; a name that existed for the whole iteration (at each of its calls: the key
//   space is read between steps) is listed; an iteration with no step in between lists
//   exactly redis's KEYS, each name once. An iteration runs all at once or one SCAN call after
//   each of the following steps (of any connection). SCAN's errors are compared byte for byte.
//
// Default run (label e2e): a few seeds of a few hundred steps per durability.
// KVTIER_RESP_DIFF_SLOW (label slow): many more. KVTIER_RESP_DIFF_SEED=<n> in the environment
// replays one seed. A divergence prints the seed, the command's index, the command and both
// replies, and a reproducer shrunk from the sequence (replayed against both servers) with the
// divergence the reproducer itself shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/key_spec.h"
#include "tests/crash/resp_client.h"
#include "tests/e2e/kvtierd_test.h"
#include "tests/e2e/redis_server.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;
using crash::RespClient;
using crash::RespReply;
using Cmd = std::vector<std::string>;

// One step: a command, or a pipeline of several, sent on one connection (of each server); or a
// SCAN iteration (one command, kScanIteration).
struct Step {
  size_t conn = 0;
  std::vector<Cmd> cmds;
};

// A step's command that is not sent as it is: a SCAN iteration of kvtierd, checked by
// property (ScanRun). Its operands: COUNT, TYPE ("" for none), "all" (every call at once) or
// "interleaved" (one call after each later step), then MATCH's pattern where it has one.
constexpr char kScanIteration[] = "<SCAN iteration>";
bool IsScanIteration(const Cmd& c) { return !c.empty() && c[0] == kScanIteration; }

// The last command of an expiry step (Generator::ExpiryStep), not sent: once the step's
// commands (each giving a key an expiry of at most kShortExpiryMsMax) are answered by both
// servers, the run sleeps kExpiryWaitMs, so every such key has expired on both before the next
// step reads anything. Then every key is read once on redis-server (Conns::TouchOnRedis),
// which deletes those it finds expired: Redis's DBSIZE counts expired keys it has not met yet
// (until its active expiry samples them), kvtierd's does not.
constexpr char kExpiryWait[] = "<expiry wait>";
bool IsExpiryWait(const Cmd& c) { return !c.empty() && c[0] == kExpiryWait; }
constexpr uint32_t kShortExpiryMsMax = 30;
constexpr int kExpiryWaitMs = 100;

// How a connection opens (both servers alike): AUTH, HELLO 3 AUTH, HELLO 2 AUTH, or a HELLO 3
// without AUTH (refused, its error compared) then HELLO 3 AUTH.
// kCommandsBeforeAuth: every command of kCommandsBeforeAuth pipelined before AUTH, each reply
// compared byte for byte (a connection that has not authenticated is refused everything but
// AUTH, HELLO and QUIT, and its state must not change).
enum class Opening {
  kAuth,
  kHello3Auth,
  kHello2Auth,
  kRefusedHelloThenHello3Auth,
  kCommandsBeforeAuth
};
const std::vector<Cmd>& CommandsBeforeAuth() {
  static const std::vector<Cmd> kCmds = {{"PING"},
                                         {"ECHO", "x"},
                                         {"GET", "a"},
                                         {"get", "a"},
                                         {"SET", "a", "1"},
                                         {"SET", "a", "1", "NX", "GET", "PX", "100"},
                                         {"SET", "a"},
                                         {"SETNX", "a", "1"},
                                         {"MSET", "a", "1", "b", "2"},
                                         {"MGET", "a", "b"},
                                         {"DEL", "a"},
                                         {"UNLINK", "a"},
                                         {"EXISTS", "a"},
                                         {"TYPE", "a"},
                                         {"EXPIRE", "a", "10"},
                                         {"PEXPIRE", "a", "x"},
                                         {"TTL", "a"},
                                         {"PTTL", "a"},
                                         {"DBSIZE"},
                                         {"KEYS", "*"},
                                         {"SCAN", "0"},
                                         {"SCAN", "x", "COUNT", "0"},
                                         {"SELECT", "0"},
                                         {"SELECT", "1"},
                                         {"FLUSHDB"},
                                         {"FLUSHALL", "ASYNC"},
                                         {"MULTI"},
                                         {"SET", "b", "2"},
                                         {"EXEC"},
                                         {"DISCARD"},
                                         {"INFO"},
                                         {"CONFIG", "GET", "x"},
                                         {"CONFIG", "HELP"},
                                         {"CLIENT", "SETNAME", "n"},
                                         {"client", "help"},
                                         {"CLIENT", "NOSUCH"},
                                         {"nosuchcommand", "a"},
                                         {"AUTH"},
                                         {"HELLO", "x"},
                                         {"HELLO", "3", "SETNAME", "n"}};
  return kCmds;
}
const char* OpenName(Opening o) {
  switch (o) {
    case Opening::kCommandsBeforeAuth:
      return "commands before AUTH, then AUTH";
    case Opening::kAuth:
      return "AUTH";
    case Opening::kHello3Auth:
      return "HELLO 3 AUTH";
    case Opening::kHello2Auth:
      return "HELLO 2 AUTH";
    case Opening::kRefusedHelloThenHello3Auth:
      return "HELLO 3 (refused: no AUTH), HELLO 3 AUTH";
  }
  return "";
}

// Expiry steps per 1,000 steps (each sleeps kExpiryWaitMs): the slow run's are fewer, so its
// 300,000 steps per durability sleep about two minutes.
#ifdef KVTIER_RESP_DIFF_SLOW
constexpr int kSeeds = 200;
constexpr int kStepsPerSeed = 1500;
constexpr uint32_t kExpiryStepsPerMille = 4;
#else
constexpr int kSeeds = 12;
constexpr int kStepsPerSeed = 400;
constexpr uint32_t kExpiryStepsPerMille = 20;
#endif
// The default run's seeds are kFirstSeed, kFirstSeed + 1, ...: the same commands every run.
constexpr uint64_t kFirstSeed = 20260301;
constexpr int kPipelineCommandsMax = 24;
constexpr int kReplyTimeoutMs = 20000;
// Replays the shrinking of a divergence may spend.
constexpr int kShrinkReplaysMax = 400;
// SCAN calls one iteration may take before it counts as never ending.
constexpr size_t kScanCallsMax = 2000;
constexpr char kToken[] = "resp-diff-token";

std::string Upper(std::string_view s) {
  std::string u(s);
  for (char& c : u) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return u;
}

// Bytes as a C string literal would show them, cut at 160 bytes.
std::string Shown(std::string_view s) {
  constexpr size_t kShownBytesMax = 160;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kShownBytesMax; ++i) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c == '\\' || c == '"') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (s.size() > kShownBytesMax) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string Shown(const Cmd& c) {
  std::string out;
  for (const std::string& a : c) out += (out.empty() ? "\"" : " \"") + Shown(a) + "\"";
  return out;
}

// The encoding of a parsed reply, as the server sent it (RESP2 or RESP3): how EXEC's
// elements are compared once one of them needed a normalisation.
std::string Encode(const RespReply& r) {
  auto aggregate = [&](char type, size_t n) {
    std::string out = type + std::to_string(n) + "\r\n";
    for (const RespReply& e : r.elems) out += Encode(e);
    return out;
  };
  auto blob = [&](char type) {
    return type + std::to_string(r.str.size()) + "\r\n" + r.str + "\r\n";
  };
  switch (r.type) {
    case RespReply::Type::kSimple:
      return "+" + r.str + "\r\n";
    case RespReply::Type::kError:
      return "-" + r.str + "\r\n";
    case RespReply::Type::kInteger:
      return ":" + std::to_string(r.integer) + "\r\n";
    case RespReply::Type::kBulk:
      return blob('$');
    case RespReply::Type::kNil:
      return "$-1\r\n";
    case RespReply::Type::kArray:
      return aggregate('*', r.elems.size());
    case RespReply::Type::kNull:
      return "_\r\n";
    case RespReply::Type::kBool:
      return r.integer != 0 ? "#t\r\n" : "#f\r\n";
    case RespReply::Type::kDouble:
      return "," + r.str + "\r\n";
    case RespReply::Type::kBigNumber:
      return "(" + r.str + "\r\n";
    case RespReply::Type::kVerbatim:
      return blob('=');
    case RespReply::Type::kBlobError:
      return blob('!');
    case RespReply::Type::kMap:
      return aggregate('%', r.elems.size() / 2);
    case RespReply::Type::kSet:
      return aggregate('~', r.elems.size());
  }
  return "";
}

// ---- The differences docs/RESP.md allows, and the only place they are normalised ----------
//
// docs/RESP.md "Differences from Redis" lists them; the generator sends only the commands of
// rows it can compare (not INFO, CONFIG GET, EXAT/PXAT with a valid time, EXPIRE NX|XX|GT|LT,
// AUTH or HELLO inside MULTI, AUTH with another user name, a SCAN cursor Redis reads with
// strtoul and kvtier refuses, such as "-1" or "", a connection's third failed AUTH, after which
// kvtierd closes it).
//
// ttl-timing: TTL, PTTL compared as -2, -1 exactly, >= 0 as "some expiry" (docs: "Differences
//   from Redis", last paragraph: the two servers read their clocks at different moments; the
//   generator's expiries are >= 100 s, so none passes during a run).
// keys-order: KEYS compared as the sorted list of its names (docs: order of KEYS / SCAN names).
// unsupported: INCR, HGET, LPUSH, GETDEL, WATCH, OBJECT, SET .. EXAT/PXAT: both are errors
//   (docs: commands of other types; SET ... EXAT/PXAT).
// hello-fields: a HELLO both accept: the same reply type (a map in RESP3, an array in RESP2),
//   not its fields (docs: HELLO, INFO, CONFIG GET answer kvtier's own fields); a refused
//   HELLO is compared byte for byte.
// scan-order: a SCAN that lists names is not compared with Redis's at all: the generator sends
//   valid SCANs only as a SCAN iteration of kvtierd, checked by property (ScanRun; docs: order
//   of KEYS / SCAN names, SCAN cursor). Refused SCANs are compared byte for byte.
//
// Elements of an EXEC reply are compared under the rule of the command queued at their place.
struct AllowedDifference {
  const char* rule;
  const char* docs;
};
constexpr AllowedDifference kAllowedDifferences[] = {
    {"ttl-timing", "docs/RESP.md \"Differences from Redis\": TTL compared as -2/-1/some"},
    {"keys-order", "docs/RESP.md \"Differences from Redis\": order of KEYS names"},
    {"unsupported", "docs/RESP.md \"Differences from Redis\": commands of other types"},
    {"hello-fields", "docs/RESP.md \"Differences from Redis\": HELLO's fields are kvtier's"},
    {"scan-order", "docs/RESP.md \"Differences from Redis\": SCAN cursor and order (ScanRun)"},
};

// Commands kvtierd does not implement, generated only so that both must answer an error.
bool Unsupported(const Cmd& c) {
  const std::string n = Upper(c[0]);
  if (n == "INCR" || n == "HGET" || n == "LPUSH" || n == "GETDEL" || n == "WATCH" ||
      n == "OBJECT") {
    return true;
  }
  if (n == "SET") {
    for (size_t i = 3; i < c.size(); ++i) {
      const std::string o = Upper(c[i]);
      if (o == "EXAT" || o == "PXAT") return true;
    }
  }
  return false;
}

// The rule under which a kvtierd reply that differs from Redis's is still right, or nullptr
// when it must be the same bytes. `kv` and `rd` are the parsed replies; `queued` are the
// commands an EXEC ran (its reply's elements pair with them).
const char* Allowed(const Cmd& c, const RespReply& kv, const RespReply& rd,
                    const std::vector<Cmd>& queued) {
  using T = RespReply::Type;
  const std::string n = Upper(c[0]);
  if (Unsupported(c)) {
    return kv.type == T::kError && rd.type == T::kError ? kAllowedDifferences[2].rule : nullptr;
  }
  if ((n == "TTL" || n == "PTTL") && c.size() == 2) {
    const bool same = kv.type == T::kInteger && rd.type == T::kInteger &&
                      (kv.integer == rd.integer || (kv.integer >= 0 && rd.integer >= 0));
    return same ? kAllowedDifferences[0].rule : nullptr;
  }
  if (n == "HELLO" && kv.type != T::kError && rd.type != T::kError) {
    return kv.type == rd.type ? kAllowedDifferences[3].rule : nullptr;
  }
  if (n == "KEYS" && c.size() == 2 && kv.type == T::kArray && rd.type == T::kArray) {
    std::vector<std::string> a, b;
    for (const RespReply& e : kv.elems) a.push_back(Encode(e));
    for (const RespReply& e : rd.elems) b.push_back(Encode(e));
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    return a == b ? kAllowedDifferences[1].rule : nullptr;
  }
  if (n == "EXEC" && c.size() == 1 && kv.type == T::kArray && rd.type == T::kArray &&
      kv.elems.size() == rd.elems.size() && kv.elems.size() == queued.size()) {
    const char* rule = nullptr;
    for (size_t i = 0; i < queued.size(); ++i) {
      if (Encode(kv.elems[i]) == Encode(rd.elems[i])) continue;
      rule = Allowed(queued[i], kv.elems[i], rd.elems[i], {});
      if (rule == nullptr) return nullptr;
    }
    return rule;
  }
  return nullptr;
}

// ---- The generator ----------------------------------------------------------------------

// Random commands over a small key space; the same seed gives the same commands.
class Generator {
 public:
  // A seed runs one, two or three connections (each server alike), each opened one of the
  // ways of Opening. With auth_off (neither server asks for a password) a connection opens
  // with AUTH or HELLO ... AUTH (user default takes any password on both): a HELLO without
  // AUTH is not refused there, and commands before AUTH run, so neither opening compares.
  explicit Generator(uint64_t seed, bool auth_off = false) : rng_(seed) {
    std::string all(256, '\0');
    for (int i = 0; i < 256; ++i) all[static_cast<size_t>(i)] = static_cast<char>(i);
    keys_ = {"a", "b", "c", "key:1", "A", "", std::string("\0\r\n\xff", 4), all};
    static const Opening kOpens[] = {Opening::kAuth,
                                     Opening::kAuth,
                                     Opening::kAuth,
                                     Opening::kHello3Auth,
                                     Opening::kHello3Auth,
                                     Opening::kHello2Auth,
                                     Opening::kRefusedHelloThenHello3Auth};
    for (uint32_t n = 1 + Pick(3); n > 0; --n) {
      opens_.push_back(Pick(8) == 0 ? Opening::kCommandsBeforeAuth : kOpens[Pick(7)]);
      if (auth_off && opens_.back() == Opening::kRefusedHelloThenHello3Auth) {
        opens_.back() = Opening::kHello3Auth;
      }
      if (auth_off && opens_.back() == Opening::kCommandsBeforeAuth) opens_.back() = Opening::kAuth;
    }
    multi_.assign(opens_.size(), false);
    wrong_token_.assign(opens_.size(), false);
  }

  const std::vector<std::string>& keys() const { return keys_; }
  const std::vector<Opening>& opens() const { return opens_; }

  // One step on a random connection: a lone command (most), a pipeline of
  // 2..kPipelineCommandsMax, or (3 %, on a connection with no transaction open) a SCAN
  // iteration.
  Step NextStep() {
    Step s;
    s.conn = Pick(static_cast<uint32_t>(opens_.size()));
    if (Pick(100) < 3 && !multi_[s.conn]) {
      s.cmds.push_back(ScanIteration());
      return s;
    }
    if (Pick(1000) < kExpiryStepsPerMille && !multi_[s.conn]) return ExpiryStep(s.conn);
    const int n = Pick(10) < 7 ? 1 : 2 + static_cast<int>(Pick(kPipelineCommandsMax - 1));
    for (int i = 0; i < n; ++i) {
      s.cmds.push_back(Next(s.conn));
      // Where a transaction is open, as Redis's rules put it (Conns::Track): MULTI opens one;
      // EXEC (of any arity: a malformed one discards it) and DISCARD close it.
      const std::string name = Upper(s.cmds.back()[0]);
      if (name == "MULTI" && s.cmds.back().size() == 1) multi_[s.conn] = true;
      if (name == "EXEC" || (name == "DISCARD" && s.cmds.back().size() == 1)) {
        multi_[s.conn] = false;
      }
    }
    return s;
  }

  // One to three commands giving keys expiries of 1..kShortExpiryMsMax ms (SET ... PX, with
  // NX, XX or GET at times, and PEXPIRE), then kExpiryWait: keys expire between two steps, never
  // while one reads them. Each on a key of its own: a command after another of the same key
  // would find it expired or not depending on how fast each server ran the pipeline. Only on a
  // connection with no transaction open.
  Step ExpiryStep(size_t conn) {
    Step s;
    s.conn = conn;
    std::set<std::string> used;
    for (uint32_t n = 1 + Pick(3); n > 0; --n) {
      const std::string key = Key();
      if (!used.insert(key).second) continue;
      const std::string ms = std::to_string(1 + Pick(kShortExpiryMsMax));
      if (Pick(3) == 0) {
        s.cmds.push_back({Name("PEXPIRE"), key, ms});
        continue;
      }
      Cmd c = {Name("SET"), key, Value(), Name("PX"), ms};
      static const char* kOptions[] = {"NX", "XX", "GET"};
      if (Pick(3) == 0) c.push_back(Name(kOptions[Pick(3)]));
      s.cmds.push_back(std::move(c));
    }
    s.cmds.push_back({kExpiryWait});
    return s;
  }

  // A random command for connection `conn`. Inside a transaction no AUTH (with a token) and
  // no HELLO: kvtierd refuses them there, Redis 7 queues them (docs/RESP.md "Transactions":
  // AUTH/HELLO are not allowed), and the transaction's outcome would then differ.
  Cmd Next(size_t conn) {
    Cmd c = Any(conn);
    const std::string n = Upper(c[0]);
    if (multi_[conn] && ((n == "AUTH" && c.size() > 1) || n == "HELLO")) {
      return {Name("GET"), Key()};
    }
    return c;
  }

 private:
  Cmd Any(size_t conn) {
    const uint32_t p = Pick(100);
    if (p < 12) return {Name("GET"), Key()};
    if (p < 28) return Set();
    if (p < 31) return {Name("SETNX"), Key(), Value()};
    if (p < 36) {  // MSET: pairs, sometimes a key short
      Cmd c = {Name("MSET")};
      for (uint32_t i = 1 + Pick(4); i > 0; --i) {
        c.push_back(Key());
        c.push_back(Value());
      }
      if (Pick(6) == 0) c.pop_back();
      return c;
    }
    if (p < 40) return WithKeys(Name("MGET"), 1 + Pick(5));
    if (p < 45) return WithKeys(Name(Pick(2) ? "DEL" : "UNLINK"), 1 + Pick(4));
    if (p < 49) return WithKeys(Name("EXISTS"), 1 + Pick(5));
    if (p < 51) return {Name("TYPE"), Key()};
    if (p < 57) {
      const bool seconds = Pick(2) == 0;
      return {Name(seconds ? "EXPIRE" : "PEXPIRE"), Key(), Expiry(/*set=*/false, seconds)};
    }
    if (p < 63) return {Name(Pick(2) ? "TTL" : "PTTL"), Key()};
    if (p < 65) return {Name("DBSIZE")};
    if (p < 73) {
      const uint32_t t = Pick(20);
      return {Name(t < 8 ? "MULTI" : t < 15 ? "EXEC" : "DISCARD")};
    }
    if (p < 76) return Pick(2) ? Cmd{Name("PING")} : Cmd{Name("ECHO"), Value()};
    if (p < 79) return Unknown();
    if (p < 87) return WrongArity();
    if (p < 89) return {Name("KEYS"), Pattern()};
    if (p < 90) {
      static const char* kDbs[] = {"0", "1", "-1", "00", "abc", "", "15", "2147483648"};
      return {Name("SELECT"), kDbs[Pick(8)]};
    }
    if (p < 91) {  // rare: empties the key space
      Cmd c = {Name(Pick(2) ? "FLUSHDB" : "FLUSHALL")};
      static const char* kOpts[] = {"ASYNC", "sync", "bogus"};
      if (Pick(3) == 0) c.push_back(kOpts[Pick(3)]);
      return c;
    }
    if (p < 92) return Pick(2) ? Cmd{Name("AUTH"), kToken} : Cmd{Name("AUTH"), "default", kToken};
    if (p < 95) return UnsupportedCommand();
    if (p < 97) return Hello(conn);
    if (p < 98) return RefusedScan();
    if (p < 99) return SubcommandCall();
    return {Name("GET"), Key()};
  }

  uint32_t Pick(uint32_t n) { return static_cast<uint32_t>(rng_() % n); }

  // The name in upper case mostly, else lower or mixed case.
  std::string Name(std::string_view upper) {
    std::string s(upper);
    const uint32_t how = Pick(10);
    for (char& c : s) {
      if (how == 7 || (how > 7 && Pick(2) == 0)) {
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      }
    }
    return s;
  }

  std::string Key() { return keys_[Pick(static_cast<uint32_t>(keys_.size()))]; }

  std::string Bytes(size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng_());
    return s;
  }

  std::string Value() {
    const uint32_t p = Pick(20);
    if (p < 2) return "";
    if (p < 12) return Bytes(1 + Pick(16));
    if (p < 18) return Bytes(17 + Pick(300));
    return Bytes(1000 + Pick(4000));
  }

  Cmd WithKeys(std::string name, uint32_t n) {
    Cmd c = {std::move(name)};
    for (; n > 0; --n) c.push_back(Key());
    return c;
  }

  // An expiry operand: valid ones are long (no key expires during a run), the invalid ones
  // cover zero, negatives, overflow of the unit and of now + n, and what is not an integer.
  std::string Expiry(bool set, bool seconds) {
    static const char* kValidSeconds[] = {"1000", "86400", "100000000", "9223372036854"};
    static const char* kValidMs[] = {"100000", "86400000", "9223370000000000000"};
    static const char* kInvalid[] = {"0",
                                     "-1",
                                     "-1000",
                                     "abc",
                                     "",
                                     "1.5",
                                     "007",
                                     "+5",
                                     " 5",
                                     "-0",
                                     "9223372036854775807",
                                     "9223372036854775808",
                                     "-9223372036854775808",
                                     "-9223372036854775809",
                                     "9223372036854775",
                                     "9223372036854775000"};
    constexpr uint32_t kInvalidCount = sizeof(kInvalid) / sizeof(kInvalid[0]);
    if (Pick(10) < (set ? 6u : 5u)) {
      return seconds ? kValidSeconds[Pick(4)] : kValidMs[Pick(3)];
    }
    return kInvalid[Pick(kInvalidCount)];
  }

  Cmd Set() {
    Cmd c = {Name("SET"), Key(), Value()};
    std::vector<Cmd> opts;
    if (Pick(2) == 0) {  // a valid combination, in a random order
      const uint32_t cond = Pick(3), exp = Pick(4);
      if (cond == 1) opts.push_back({"NX"});
      if (cond == 2) opts.push_back({"XX"});
      if (Pick(3) == 0) opts.push_back({"GET"});
      if (exp == 1) opts.push_back({"EX", Expiry(true, true)});
      if (exp == 2) opts.push_back({"PX", Expiry(true, false)});
      if (exp == 3) opts.push_back({"KEEPTTL"});
    } else {  // anything: duplicates, conflicts, missing operands, unknown words
      static const char* kWords[] = {"NX", "XX", "GET", "KEEPTTL", "EX", "PX", "ex", "Px", "FOO"};
      for (uint32_t i = Pick(5); i > 0; --i) {
        std::string w = kWords[Pick(9)];
        const std::string u = Upper(w);
        if ((u == "EX" || u == "PX") && Pick(6) != 0) {
          opts.push_back({w, Expiry(true, u == "EX")});
        } else {
          opts.push_back({w});
        }
      }
    }
    std::shuffle(opts.begin(), opts.end(), rng_);
    for (Cmd& o : opts) {
      for (std::string& w : o) c.push_back(Pick(5) == 0 ? Name(Upper(w)) : w);
    }
    return c;
  }

  std::string Pattern() {
    static const char* kParts[] = {"*", "?", "a", "b", "[", "]", "^",     "-",    "\\",  "k",
                                   "e", "y", ":", "1", "A", "c", "[a-c]", "[^a]", "\xff"};
    constexpr uint32_t kPartCount = sizeof(kParts) / sizeof(kParts[0]);
    std::string s;
    for (uint32_t i = Pick(6); i > 0; --i) s += kParts[Pick(kPartCount)];
    return Pick(8) == 0 ? "*" : s;
  }

  // An argument for the commands whose arguments do not matter: a key, a number or a word.
  std::string Arg() {
    static const char* kWords[] = {"0", "1", "-1", "x", "NX", "ex", "100000"};
    return Pick(2) ? Key() : kWords[Pick(7)];
  }

  Cmd Unknown() {
    static const char* kNames[] = {"FOO", "GETT", "nosuch", "S E T", "", "x\r\ny"};
    Cmd c = {kNames[Pick(6)]};
    if (Pick(6) == 0) c[0] = std::string("a\0b", 3);
    if (Pick(6) == 0) c[0] = std::string(200, 'Z');
    for (uint32_t i = Pick(5); i > 0; --i) {
      const uint32_t p = Pick(4);
      c.push_back(p == 0 ? Bytes(Pick(8)) : p == 1 ? std::string(40 + Pick(100), 'q') : Arg());
    }
    return c;
  }

  // A known command with an argument count Redis refuses.
  Cmd WrongArity() {
    struct Arity {
      const char* name;
      uint32_t wrong[3];  // argument counts (after the name) that are wrong
    };
    static const Arity kArity[] = {
        {"GET", {0, 2, 3}},    {"SET", {0, 1, 1}},     {"SETNX", {0, 1, 3}},
        {"MGET", {0, 0, 0}},   {"MSET", {0, 1, 3}},    {"DEL", {0, 0, 0}},
        {"UNLINK", {0, 0, 0}}, {"EXISTS", {0, 0, 0}},  {"TYPE", {0, 2, 3}},
        {"EXPIRE", {0, 1, 1}}, {"PEXPIRE", {0, 1, 1}}, {"TTL", {0, 2, 3}},
        {"PTTL", {0, 2, 2}},   {"DBSIZE", {1, 2, 2}},  {"KEYS", {0, 2, 3}},
        {"SELECT", {0, 2, 2}}, {"PING", {2, 3, 3}},    {"ECHO", {0, 2, 3}},
        {"MULTI", {1, 2, 2}},  {"EXEC", {1, 2, 2}},    {"DISCARD", {1, 1, 2}},
        {"SCAN", {0, 0, 0}},   {"AUTH", {0, 0, 3}},    {"FLUSHDB", {2, 2, 3}},
    };
    constexpr uint32_t kCount = sizeof(kArity) / sizeof(kArity[0]);
    const Arity& a = kArity[Pick(kCount)];
    Cmd c = {Name(a.name)};
    for (uint32_t i = a.wrong[Pick(3)]; i > 0; --i) c.push_back(Arg());
    return c;
  }

  Cmd UnsupportedCommand() {
    switch (Pick(8)) {
      case 0:
        return {Name("INCR")};
      case 1:
        return {Name("HGET"), Key()};
      case 2:
        return {Name("LPUSH"), Key()};
      case 3:
        return {Name("GETDEL")};
      case 4:
        return {Name("WATCH")};
      case 5:
        return {Name("OBJECT")};
      case 6:
        return {Name("SET"), Key(), Value(), Pick(2) ? "EXAT" : "pxat", "not-a-number"};
      default:  // Redis 7's NX|XX|GT|LT are not supported; other words are errors on both
        return {Name(Pick(2) ? "EXPIRE" : "PEXPIRE"), Key(), Pick(2) ? "100000" : "x",
                Pick(2) ? "BOGUS" : "1"};
    }
  }

  // HELLO: switching to RESP3 and back (most), with AUTH, and its refused forms.
  Cmd Hello(size_t conn) {
    const uint32_t p = Pick(16);
    if (p < 5) return {Name("HELLO"), "3"};
    if (p < 8) return {Name("HELLO"), "2"};
    if (p < 9) return {Name("HELLO")};
    if (p < 10) {  // NOPROTO, or not an integer
      static const char* kVersions[] = {"4", "1",   "0",  "-1", "abc",
                                        "",  "3.0", "03", "+3", "9223372036854775808"};
      return {Name("HELLO"), kVersions[Pick(10)]};
    }
    const std::string v = Pick(3) != 0 ? "3" : "2";
    if (p < 12) {
      Cmd c = {Name("HELLO"), v, Name("AUTH"), "default", kToken};
      if (Pick(3) == 0) {  // a client name, after or before AUTH
        const auto at = Pick(2) != 0 ? c.end() : c.begin() + 2;
        c.insert(at, {Name("SETNAME"), "cl-1"});
      }
      return c;
    }
    if (p < 13) {  // an option without its operands, or an unknown one
      static const Cmd kWrong[] = {{"AUTH"},
                                   {"AUTH", "default"},
                                   {"SETNAME"},
                                   {"FOO"},
                                   {"AUTH", "default", kToken, "SETNAME"},
                                   {"SETNAME", "x", "AUTH", "default"}};
      Cmd c = {Name("HELLO"), v};
      for (const std::string& w : kWrong[Pick(6)]) c.push_back(w);
      if (Pick(6) == 0) c.erase(c.begin() + 1);  // no version: "AUTH" is not an integer
      return c;
    }
    if (p < 15) {  // client names, some of which Redis refuses (spaces, control bytes)
      Cmd c = {Name("HELLO"), v, Name("SETNAME"), ClientName()};
      if (Pick(4) == 0) c.insert(c.begin() + 2, {Name("SETNAME"), "first"});
      return c;
    }
    // A wrong token, at most once per connection: kvtierd closes a connection at its third
    // failed AUTH (docs/RESP.md), redis-server does not.
    if (wrong_token_[conn]) return {Name("HELLO"), v};
    wrong_token_[conn] = true;
    return {Name("HELLO"), v, Name("AUTH"), "default", "wrong-token"};
  }

  // A client name, some of which Redis refuses (spaces, control bytes, bytes over '~').
  // CLIENT and CONFIG: SETNAME mostly, else calls both refuse (a subcommand neither
  // implements, a wrong argument count), which inside MULTI discard the transaction. Not HELP
  // (each lists its own subcommands), CONFIG GET of a parameter (kvtier's own fields) or a
  // subcommand Redis has and kvtier does not (docs/RESP.md).
  Cmd SubcommandCall() {
    switch (Pick(10)) {
      case 0:
        return {Name(Pick(2) ? "CLIENT" : "CONFIG")};
      case 1:
        return {Name("CLIENT"), Name("SETNAME")};
      case 2:
        return {Name("CLIENT"), Name("SETNAME"), ClientName(), Arg()};
      case 3:
        return {Name(Pick(2) ? "CLIENT" : "CONFIG"), Pick(2) ? "nosuch" : "B O G U S"};
      case 4:
        return {Name("CONFIG"), Name("GET")};
      default:
        return {Name("CLIENT"), Name("SETNAME"), ClientName()};
    }
  }

  std::string ClientName() {
    static const char* kNames[] = {"cl-1", "", "a b", "x\r\ny", "\xff", "~!", "tab\t", "\x7f"};
    return kNames[Pick(8)];
  }

  // A SCAN both must refuse (compared byte for byte): a cursor both refuse, or a bad option.
  // Not a cursor Redis reads with strtoul and kvtier refuses ("-1", "", "+5": docs/RESP.md).
  Cmd RefusedScan() {
    static const char* kCursors[] = {"abc", "1x", " 5", "0x10", "99999999999999999999"};
    static const Cmd kOptions[] = {{"COUNT", "0"},
                                   {"COUNT", "-1"},
                                   {"COUNT", "abc"},
                                   {"COUNT", "007"},
                                   {"COUNT", ""},
                                   {"MATCH"},
                                   {"COUNT"},
                                   {"TYPE"},
                                   {"BOGUS", "x"},
                                   {"MATCH", "*", "COUNT", "0"},
                                   {"COUNT", "5", "MATCH"}};
    constexpr uint32_t kOptionCount = sizeof(kOptions) / sizeof(kOptions[0]);
    Cmd c = {Name("SCAN")};
    const uint32_t p = Pick(3);
    c.push_back(p == 0 ? kCursors[Pick(5)] : "0");
    if (p != 0 || Pick(2) == 0) {
      for (const std::string& w : kOptions[Pick(kOptionCount)]) c.push_back(w);
    }
    return c;
  }

  // A SCAN iteration (kScanIteration): COUNT 1..20, TYPE none, string or another, MATCH or
  // not, all at once or interleaved with the steps that follow.
  Cmd ScanIteration() {
    static const char* kTypes[] = {"", "", "", "string", "STRING", "hash", "none"};
    const bool all = Pick(2) != 0;
    // An interleaved one mostly with a small COUNT, so that steps run between its calls.
    const uint32_t count = all || Pick(4) == 0 ? 1 + Pick(20) : 1 + Pick(3);
    Cmd c = {kScanIteration, std::to_string(count), kTypes[Pick(7)], all ? "all" : "interleaved"};
    if (Pick(2) == 0) c.push_back(Pattern());
    return c;
  }

  std::mt19937_64 rng_;
  std::vector<std::string> keys_;
  std::vector<Opening> opens_;
  std::vector<bool> multi_;        // per connection: a transaction is open after the steps so far
  std::vector<bool> wrong_token_;  // per connection: a wrong token was generated
};

// ---- Running a sequence against both servers --------------------------------------------

// What the run exercised, printed at its end (the replays of a shrinking are not counted).
struct Coverage {
  size_t commands = 0;
  size_t resp3_commands = 0;     // sent on a connection in RESP3
  size_t execs_interleaved = 0;  // EXECs run after another connection's step while they queued
  size_t scans = 0;              // SCAN iterations checked
  size_t scans_interleaved = 0;  // of them, with steps between their calls
  size_t scan_calls = 0;
  size_t expiry_waits = 0;  // expiry steps: keys expired between two steps
};

// A SCAN iteration of kvtierd in progress on one connection (a kScanIteration step), and what
// it must list: redis-server's KEYS of its pattern (those of its TYPE, where it has one), read
// before each call.
struct ScanRun {
  size_t conn = 0;
  Cmd marker;  // the step's command: COUNT, TYPE, "all"/"interleaved"[, MATCH's pattern]
  std::string cursor = "0";
  size_t calls = 0;
  bool steps_between = false;         // a step ran between two of its calls
  std::set<std::string> always;       // the names that matched at every call so far
  std::map<std::string, int> listed;  // the names its calls listed, and how often

  bool all() const { return marker[3] == "all"; }
  const std::string& count() const { return marker[1]; }
  const std::string& type() const { return marker[2]; }
  bool has_pattern() const { return marker.size() > 4; }
  std::string pattern() const { return has_pattern() ? marker[4] : "*"; }
};

// How a SCAN iteration step reads in a reproducer.
std::string ShownScan(const Cmd& m) {
  std::string out = "SCAN iteration COUNT " + m[1];
  if (!m[2].empty()) out += " TYPE " + m[2];
  if (m.size() > 4) out += " MATCH \"" + Shown(m[4]) + "\"";
  return out + (m[3] == "all" ? " (every call at once)" : " (a call after each later step)");
}

std::string ShownSet(const std::set<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "\"" : ", \"") + Shown(n) + "\"";
  return "{" + out + "}";
}

// The connections to each server, opened as Opening says, the transaction state and protocol
// version their replies imply, and one more connection to redis-server that reads its key
// space for the SCAN checks (never in a transaction).
class Conns {
 public:
  // Connects and opens every connection; "" or why it failed (a refused HELLO whose replies
  // differ is a divergence too).
  std::string Open(uint16_t kv_port, uint16_t redis_port, const std::vector<Opening>& opens,
                   bool auth_off) {
    conns_.clear();
    for (size_t i = 0; i < opens.size(); ++i) {
      const Opening o = opens[i];
      auto kv = RespClient::Connect(kv_port, kReplyTimeoutMs);
      auto rd = RespClient::Connect(redis_port, kReplyTimeoutMs);
      if (!kv.ok() || !rd.ok()) {
        return "connect: " + (kv.ok() ? rd.status() : kv.status()).ToString();
      }
      Conn c;
      c.kv = std::move(kv).value();
      c.rd = std::move(rd).value();
      std::vector<Cmd> cmds;
      if (o == Opening::kRefusedHelloThenHello3Auth) cmds.push_back({"HELLO", "3"});
      if (o == Opening::kCommandsBeforeAuth) cmds = CommandsBeforeAuth();
      if (o == Opening::kAuth || o == Opening::kCommandsBeforeAuth) {
        // Without a password on either server a lone one is an error: user default takes any.
        cmds.push_back(auth_off ? Cmd{"AUTH", "default", kToken} : Cmd{"AUTH", kToken});
      } else {
        cmds.push_back({"HELLO", o == Opening::kHello2Auth ? "2" : "3", "AUTH", "default", kToken});
      }
      c.proto =
          o == Opening::kAuth || o == Opening::kHello2Auth || o == Opening::kCommandsBeforeAuth ? 2
                                                                                                : 3;
      std::vector<std::string> kv_raw, rd_raw;
      auto kr = c.kv->Pipeline(cmds, &kv_raw);
      auto rr = c.rd->Pipeline(cmds, &rd_raw);
      if (!kr.ok() || !rr.ok()) {
        return "opening connection " + std::to_string(i) + ": no reply: kvtierd " +
               kr.status().ToString() + ", redis " + rr.status().ToString();
      }
      for (size_t k = 0; k < cmds.size(); ++k) {
        const bool last = k + 1 == cmds.size();
        const bool agree =
            last ? (*kr)[k].type != RespReply::Type::kError && (*kr)[k].type == (*rr)[k].type
                 : kv_raw[k] == rd_raw[k];
        if (!agree) {
          return "opening connection " + std::to_string(i) + " (" + OpenName(o) +
                 "), command: " + Shown(cmds[k]) + "\n  kvtierd: \"" + Shown(kv_raw[k]) +
                 "\"\n  redis:   \"" + Shown(rd_raw[k]) + "\"";
        }
      }
      conns_.push_back(std::move(c));
    }
    auto obs = RespClient::Connect(redis_port, kReplyTimeoutMs);
    if (!obs.ok()) return "connect: " + obs.status().ToString();
    observer_ = std::move(obs).value();
    auto r = observer_->Call({"AUTH", "default", kToken});
    if (!r.ok() || r->type != RespReply::Type::kSimple) return "observer's AUTH failed";
    return "";
  }

  // Reads every key once on redis-server (EXISTS, which deletes a key it finds expired): ""
  // or what failed.
  std::string TouchOnRedis(const std::vector<std::string>& keys) {
    std::vector<Cmd> touch;
    for (const std::string& k : keys) touch.push_back({"EXISTS", k});
    auto r = observer_->Pipeline(touch);
    return r.ok() ? "" : "redis-server's EXISTS failed: " + r.status().ToString();
  }

  // Sends one step to both servers on its connection and compares every reply. Returns ""
  // when all agree (or differ as kAllowedDifferences allows), else a description of the
  // first divergence, with *at the index of the diverging command within the step.
  std::string Run(const Step& step, size_t* at, Coverage* cov) {
    Conn& c = conns_[step.conn];
    std::vector<std::string> kv_raw, rd_raw;
    auto kv = c.kv->Pipeline(step.cmds, &kv_raw);
    auto rd = c.rd->Pipeline(step.cmds, &rd_raw);
    if (!kv.ok() || !rd.ok()) {
      *at = 0;
      return "no reply on connection " + std::to_string(step.conn) + ": kvtierd " +
             kv.status().ToString() + ", redis " + rd.status().ToString();
    }
    for (size_t j = 0; j < conns_.size(); ++j) {
      if (j != step.conn && conns_[j].in_multi) conns_[j].interleaved = true;
    }
    for (size_t i = 0; i < step.cmds.size(); ++i) {
      const Cmd& cmd = step.cmds[i];
      if (kv_raw[i] != rd_raw[i] && Allowed(cmd, (*kv)[i], (*rd)[i], c.queued) == nullptr) {
        *at = i;
        return "connection " + std::to_string(step.conn) + " (RESP" + std::to_string(c.proto) +
               "), command: " + Shown(cmd) + "\n  kvtierd: \"" + Shown(kv_raw[i]) +
               "\"\n  redis:   \"" + Shown(rd_raw[i]) + "\"";
      }
      if (cov != nullptr) {
        ++cov->commands;
        if (c.proto == 3) ++cov->resp3_commands;
      }
      Track(&c, cmd, (*rd)[i], cov);
    }
    return "";
  }

  size_t size() const { return conns_.size(); }
  bool in_multi(size_t conn) const { return conns_[conn].in_multi; }

  // One SCAN call of an iteration on kvtierd, checked against redis-server's key space now:
  // every name it lists matches and exists. "" or what went wrong.
  std::string ScanCall(ScanRun* s) {
    std::set<std::string> now;
    if (std::string why = Matching(*s, &now); !why.empty()) return why;
    if (s->calls == 0) {
      s->always = now;
    } else {
      std::erase_if(s->always, [&](const std::string& n) { return now.count(n) == 0; });
    }
    Cmd cmd = {"SCAN", s->cursor};
    if (s->has_pattern()) cmd.insert(cmd.end(), {"MATCH", s->pattern()});
    cmd.insert(cmd.end(), {"COUNT", s->count()});
    if (!s->type().empty()) cmd.insert(cmd.end(), {"TYPE", s->type()});
    std::string raw;
    auto r = conns_[s->conn].kv->Call(std::vector<std::string_view>(cmd.begin(), cmd.end()), &raw);
    if (!r.ok()) return "no reply to " + Shown(cmd) + ": " + r.status().ToString();
    using T = RespReply::Type;
    bool shaped = r->type == T::kArray && r->elems.size() == 2 && r->elems[0].type == T::kBulk &&
                  !r->elems[0].str.empty() && r->elems[1].type == T::kArray &&
                  std::all_of(r->elems[0].str.begin(), r->elems[0].str.end(),
                              [](char ch) { return ch >= '0' && ch <= '9'; });
    for (size_t i = 0; shaped && i < r->elems[1].elems.size(); ++i) {
      shaped = r->elems[1].elems[i].type == T::kBulk;
    }
    if (!shaped) return "call " + Shown(cmd) + " answered \"" + Shown(raw) + "\"";
    for (const RespReply& e : r->elems[1].elems) {
      if (now.count(e.str) == 0) {
        return "call " + std::to_string(s->calls + 1) + ", " + Shown(cmd) + ", listed \"" +
               Shown(e.str) +
               "\", which redis-server does not hold (matching) then: " + ShownSet(now);
      }
      ++s->listed[e.str];
    }
    s->cursor = r->elems[0].str;
    if (++s->calls >= kScanCallsMax && s->cursor != "0") {
      return "no end after " + std::to_string(s->calls) + " calls (cursor " + s->cursor + ")";
    }
    return "";
  }

 private:
  struct Conn {
    std::unique_ptr<RespClient> kv, rd;
    int proto = 2;
    bool in_multi = false;
    bool interleaved = false;  // another connection ran a step while the transaction queued
    std::vector<Cmd> queued;
  };

  // Follows MULTI / EXEC / DISCARD and HELLO from Redis's replies (the reference), so that an
  // EXEC's elements pair with the commands it queued. A malformed EXEC ends the transaction
  // too (Redis discards it: "EXECABORT Transaction discarded because of: wrong number ...").
  static void Track(Conn* c, const Cmd& cmd, const RespReply& r, Coverage* cov) {
    const std::string n = Upper(cmd[0]);
    if (!c->in_multi) {
      if (n == "MULTI" && r.type == RespReply::Type::kSimple) {
        c->in_multi = true;
        c->interleaved = false;
        c->queued.clear();
      }
      if (n == "HELLO" && cmd.size() > 1 && r.type != RespReply::Type::kError) {
        c->proto = cmd[1] == "3" ? 3 : 2;
      }
      return;
    }
    if (n == "EXEC" || (n == "DISCARD" && cmd.size() == 1)) {
      if (n == "EXEC" && r.type == RespReply::Type::kArray && c->interleaved && cov != nullptr) {
        ++cov->execs_interleaved;
      }
      c->in_multi = false;
      c->queued.clear();
    } else if (r.type == RespReply::Type::kSimple && r.str == "QUEUED") {
      c->queued.push_back(cmd);
    }
  }

  // redis-server's names matching the iteration's pattern (and TYPE), read now.
  std::string Matching(const ScanRun& s, std::set<std::string>* out) {
    auto keys = observer_->Call({"KEYS", s.pattern()});
    if (!keys.ok() || keys->type != RespReply::Type::kArray) return "redis-server's KEYS failed";
    std::vector<Cmd> types;
    for (const RespReply& e : keys->elems) {
      if (s.type().empty()) {
        out->insert(e.str);
      } else {
        types.push_back({"TYPE", e.str});
      }
    }
    if (types.empty()) return "";
    auto t = observer_->Pipeline(types);
    if (!t.ok()) return "redis-server's TYPE failed";
    for (size_t i = 0; i < types.size(); ++i) {
      if (Upper((*t)[i].str) == Upper(s.type())) out->insert(types[i][1]);
    }
    return "";
  }

  std::vector<Conn> conns_;
  std::unique_ptr<RespClient> observer_;
};

// What a finished SCAN iteration must have listed: every name that matched at every call
// (existed for the whole iteration), and with no step between its calls, each name once.
std::string ScanCheck(const ScanRun& s) {
  for (const std::string& n : s.always) {
    if (s.listed.count(n) == 0) {
      return "never listed \"" + Shown(n) + "\", which existed (matching) at each of its " +
             std::to_string(s.calls) + " calls";
    }
  }
  if (!s.steps_between) {
    for (const auto& [n, times] : s.listed) {
      if (times > 1) {
        return "listed \"" + Shown(n) + "\" " + std::to_string(times) +
               " times, with no step between its calls";
      }
    }
  }
  return "";
}

class RespDifferentialTest : public kt::KvtierdTest,
                             public ::testing::WithParamInterface<const char*> {
 protected:
  RespDifferentialTest() : KvtierdTest("kvtier_resp_diff") {}

  void SetUp() override {
    KvtierdTest::SetUp();
    if (::testing::Test::IsSkipped()) return;
    if (!kt::RedisServerInstalled()) {
      GTEST_SKIP() << "redis-server is not installed (deploy/install-deps.sh installs it)";
    }
    std::ofstream(dir_ / "tokens.toml")
        << "[[tenant]]\nname = \"diff\"\nid = 1\n"
        << "token_sha256 = [\"" << TokenSha256Hex(kToken) << "\"]\n";
    const std::string durability = auth_off() ? "default" : GetParam();
    d_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 67108864\nssd_capacity_bytes = 134217728\n"
        "ssd_segment_bytes = 4194304\n" +
        (durability == "default" ? std::string() : "durability = \"" + durability + "\"\n") +
        (auth_off() ? std::string()
                    : "[auth]\ntokens_file = \"" + (dir_ / "tokens.toml").string() + "\"\n"));
    ASSERT_TRUE(d_->Start()) << d_->Log();
    std::filesystem::create_directories(dir_ / "redis");
    redis_port_ = kt::FreePort();
    // One database: kvtierd has only db 0, so SELECT 1 is out of range on both.
    std::vector<std::string> args = {"--databases", "1"};
    if (!auth_off()) args.insert(args.end(), {"--requirepass", kToken});
    redis_ = kt::StartRedisServer(redis_port_, (dir_ / "redis").string(), args);
    ASSERT_GT(redis_, 0) << "redis-server did not start on port " << redis_port_;
  }

  // The parameter "auth_off": neither server asks for a password (default durability).
  static bool auth_off() { return std::string_view(GetParam()) == "auth_off"; }

  void TearDown() override {
    kt::StopRedisServer(redis_);
    redis_ = -1;
    KvtierdTest::TearDown();
  }

  // Where a replay diverged: the step, the command's index within it, the command (a SCAN
  // iteration's kScanIteration command), and what went wrong. An empty `why`: all agreed.
  struct Divergence {
    std::string why;
    size_t step = 0, cmd = 0;
    Cmd command;
  };

  // Advances the SCAN iterations in progress: one call each (an "all" one: every call), or
  // with to_end every call; a finished one is checked and dropped. An iteration whose
  // connection queues a transaction waits. "" or what went wrong, *which its command.
  static std::string Advance(Conns* c, std::vector<ScanRun>* scans, bool to_end, Cmd* which,
                             Coverage* cov) {
    for (auto it = scans->begin(); it != scans->end();) {
      ScanRun& s = *it;
      std::string why;
      bool done = false;
      while (!c->in_multi(s.conn)) {
        why = c->ScanCall(&s);
        if (!why.empty()) break;
        if (s.cursor == "0") {
          why = ScanCheck(s);
          done = true;
          break;
        }
        if (!to_end && !s.all()) break;
      }
      if (!why.empty()) {
        *which = s.marker;
        return "connection " + std::to_string(s.conn) + ", " + ShownScan(s.marker) + ": " + why;
      }
      if (!done) {
        ++it;
        continue;
      }
      if (cov != nullptr) {
        ++cov->scans;
        cov->scans_interleaved += s.steps_between ? 1 : 0;
        cov->scan_calls += s.calls;
      }
      it = scans->erase(it);
    }
    return "";
  }

  // Runs steps from an emptied key space on fresh connections, then compares the whole key
  // space (after DISCARDs of open transactions and the end of SCAN iterations in progress).
  Divergence Replay(const std::vector<Opening>& opens, const std::vector<Step>& steps,
                    const std::vector<std::string>& keys, Coverage* cov = nullptr) {
    Divergence d;
    Conns c;
    d.why = c.Open(d_->resp_port(), redis_port_, opens, auth_off());
    if (!d.why.empty()) {
      d.command = {"<opening the connections>"};
      return d;
    }
    const Step flush = {0, {{"FLUSHALL"}}};
    d.why = c.Run(flush, &d.cmd, nullptr);
    if (!d.why.empty()) {
      d.command = flush.cmds[0];
      return d;
    }
    std::vector<ScanRun> scans;  // in progress, at most one per connection
    auto run = [&](const Step& s, size_t index) {
      for (ScanRun& r : scans) r.steps_between = true;
      if (IsScanIteration(s.cmds[0])) {
        // A connection's next iteration starts once its last one has ended.
        if (std::none_of(scans.begin(), scans.end(),
                         [&](const ScanRun& r) { return r.conn == s.conn; })) {
          scans.push_back(ScanRun{.conn = s.conn, .marker = s.cmds[0]});
        }
      } else if (IsExpiryWait(s.cmds.back())) {
        Step sent = s;
        sent.cmds.pop_back();
        d.why = c.Run(sent, &d.cmd, cov);
        if (!d.why.empty()) {
          d.step = index;
          d.command = s.cmds[d.cmd];
          return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(kExpiryWaitMs));
        d.why = c.TouchOnRedis(keys);
        if (!d.why.empty()) {
          d.step = index;
          d.command = s.cmds.back();
          return false;
        }
        if (cov != nullptr) ++cov->expiry_waits;
      } else {
        d.why = c.Run(s, &d.cmd, cov);
        if (!d.why.empty()) {
          d.step = index;
          d.command = s.cmds[d.cmd];
          return false;
        }
      }
      d.why = Advance(&c, &scans, false, &d.command, cov);
      d.step = index;
      d.cmd = 0;
      return d.why.empty();
    };
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!run(steps[i], i)) return d;
    }
    // The end: every transaction discarded, every iteration run to its end, then the key space
    // compared on the first connection and DBSIZE on each.
    for (size_t k = 0; k < c.size(); ++k) {
      if (c.in_multi(k) && !run({k, {{"DISCARD"}}}, steps.size())) break;
    }
    if (d.why.empty()) d.why = Advance(&c, &scans, true, &d.command, cov);
    if (d.why.empty()) {
      std::vector<Step> end;
      Cmd mget = {"MGET"}, exists = {"EXISTS"};
      for (const std::string& k : keys) {
        mget.push_back(k);
        exists.push_back(k);
        end.push_back({0, {{"TYPE", k}, {"PTTL", k}}});
      }
      end.push_back({0, {mget, exists, {"DBSIZE"}, {"KEYS", "*"}}});
      for (size_t k = 1; k < c.size(); ++k) end.push_back({k, {{"DBSIZE"}}});
      for (const Step& s : end) {
        if (!run(s, steps.size())) break;
      }
    }
    if (!d.why.empty()) {
      if (d.step == steps.size()) d.why = "after the sequence, " + d.why;
    }
    return d;
  }

  // The smallest sub-sequence of steps (commands removed one chunk at a time, then one by
  // one) that still diverges, within kShrinkReplaysMax replays.
  // The divergence must stay at the same command (`command`), not move to another one.
  std::vector<Step> Shrink(const std::vector<Opening>& opens, std::vector<Step> steps,
                           const std::vector<std::string>& keys, const Cmd& command) {
    int replays = 0;
    auto diverges = [&](const std::vector<Step>& s) {
      ++replays;
      Divergence d = Replay(opens, s, keys);
      return !d.why.empty() && d.command == command;
    };
    // Flatten into single commands, keeping each command's step (and its connection) so
    // pipelines stay pipelines. An expiry step stays whole: without its wait, its keys would
    // expire while later steps read them.
    struct Flat {
      size_t step, conn;
      std::vector<Cmd> cmds;
    };
    std::vector<Flat> flat;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (IsExpiryWait(steps[i].cmds.back())) {
        flat.push_back({i, steps[i].conn, steps[i].cmds});
        continue;
      }
      for (const Cmd& c : steps[i].cmds) flat.push_back({i, steps[i].conn, {c}});
    }
    auto rebuild = [](const std::vector<Flat>& f) {
      std::vector<Step> out;
      size_t last = SIZE_MAX;
      for (const Flat& e : f) {
        if (e.step != last) out.push_back({e.conn, {}});
        out.back().cmds.insert(out.back().cmds.end(), e.cmds.begin(), e.cmds.end());
        last = e.step;
      }
      return out;
    };
    for (size_t chunk = std::max<size_t>(flat.size() / 2, 1); chunk >= 1; chunk /= 2) {
      for (size_t start = 0; start < flat.size() && replays < kShrinkReplaysMax;) {
        std::vector<Flat> cut = flat;
        cut.erase(cut.begin() + static_cast<ptrdiff_t>(start),
                  cut.begin() + static_cast<ptrdiff_t>(std::min(start + chunk, cut.size())));
        if (diverges(rebuild(cut))) {
          flat = std::move(cut);
        } else {
          start += chunk;
        }
      }
      if (chunk == 1) break;
    }
    return rebuild(flat);
  }

  pid_t redis_ = -1;
  uint16_t redis_port_ = 0;
};

TEST_P(RespDifferentialTest, EveryReplyIsRedisOrAnAllowedDifference) {
  std::vector<uint64_t> seeds;
  if (const char* s = std::getenv("KVTIER_RESP_DIFF_SEED")) {
    seeds.push_back(std::strtoull(s, nullptr, 10));
  } else {
    for (int i = 0; i < kSeeds; ++i) seeds.push_back(kFirstSeed + static_cast<uint64_t>(i));
  }
  Coverage cov;
  for (uint64_t seed : seeds) {
    Generator g(seed, auth_off());
    std::vector<Step> steps;
    for (int i = 0; i < kStepsPerSeed; ++i) steps.push_back(g.NextStep());
    const Divergence d = Replay(g.opens(), steps, g.keys(), &cov);
    if (d.why.empty()) continue;
    size_t index = 0;  // the diverging command's index in the whole sequence
    for (size_t i = 0; i < d.step && i < steps.size(); ++i) index += steps[i].cmds.size();
    index += d.cmd;
    std::vector<Step> prefix(
        steps.begin(), steps.begin() + static_cast<ptrdiff_t>(std::min(d.step + 1, steps.size())));
    std::string opened, repro;
    for (size_t i = 0; i < g.opens().size(); ++i) {
      opened += (i == 0 ? "" : "; ") + std::string("c") + std::to_string(i) + ": " +
                OpenName(g.opens()[i]);
    }
    const std::vector<Step> shrunk = Shrink(g.opens(), prefix, g.keys(), d.command);
    for (const Step& s : shrunk) {
      for (size_t i = 0; i < s.cmds.size(); ++i) {
        repro += (i == 0 ? "  c" + std::to_string(s.conn) + ": " : "      | ") +
                 (IsScanIteration(s.cmds[i]) ? ShownScan(s.cmds[i]) : Shown(s.cmds[i])) + "\n";
      }
    }
    ADD_FAILURE() << "durability " << GetParam() << ", seed " << seed << " (replay with "
                  << "KVTIER_RESP_DIFF_SEED=" << seed << "), command " << index << ":\n  " << d.why
                  << "\nshrunk reproducer (after FLUSHALL; connections opened with " << opened
                  << "; \"cN:\" is the connection a step is sent on, \"|\" marks a command "
                  << "pipelined with the one before; the key space is then compared):\n"
                  << repro << "which diverges with:\n  " << Replay(g.opens(), shrunk, g.keys()).why;
    return;
  }
  std::printf(
      "durability %s: %zu seeds, %zu commands (%zu on RESP3 connections), %zu EXECs after "
      "another connection's steps, %zu SCAN iterations (%zu interleaved, %zu calls), %zu "
      "waits for short expiries, every reply agreed\n",
      GetParam(), seeds.size(), cov.commands, cov.resp3_commands, cov.execs_interleaved, cov.scans,
      cov.scans_interleaved, cov.scan_calls, cov.expiry_waits);
}

INSTANTIATE_TEST_SUITE_P(Durability, RespDifferentialTest,
                         ::testing::Values("default", "sync", "auth_off"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param);
                         });

}  // namespace
}  // namespace kvtier::daemon
