#include "cache_daemon/resp_commands.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <iterator>
#include <limits>
#include <utility>

namespace kvtier::daemon::resp {
namespace {

using namespace std::string_view_literals;

bool EqualsUpper(std::string_view s, std::string_view upper) {
  if (s.size() != upper.size()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (std::toupper(static_cast<unsigned char>(s[i])) != upper[i]) return false;
  }
  return true;
}

bool ParseU64(std::string_view s, uint64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

Status Syntax() { return Status::InvalidArgument("ERR syntax error"); }

// Whether the pattern element at p[*i] (not '*') matches c; advances *i past the element.
bool MatchElement(std::string_view p, size_t* i, unsigned char c) {
  size_t n = p.size();
  if (p[*i] == '?') {
    ++*i;
    return true;
  }
  if (p[*i] == '[') {
    size_t j = *i + 1;
    bool negate = j < n && p[j] == '^';
    if (negate) ++j;
    bool match = false;
    while (j < n) {
      if (p[j] == '\\' && j + 1 < n) {
        match |= static_cast<unsigned char>(p[j + 1]) == c;
        j += 2;
      } else if (p[j] == ']') {
        ++j;
        break;
      } else if (j + 2 < n && p[j + 1] == '-') {
        // Redis compares a range's bytes as (signed) char, as x86-64 builds have it: 0x80..0xff
        // sort below 0x00, so [\xff-b] holds \xff and 0x00..'b', not 'b'..\xff.
        auto lo = static_cast<signed char>(p[j]);
        auto hi = static_cast<signed char>(p[j + 2]);
        if (lo > hi) std::swap(lo, hi);
        const auto sc = static_cast<signed char>(c);
        match |= sc >= lo && sc <= hi;
        j += 3;
      } else {
        match |= static_cast<unsigned char>(p[j]) == c;
        ++j;
      }
    }
    *i = j;
    return negate ? !match : match;
  }
  if (p[*i] == '\\' && *i + 1 < n) ++*i;
  return static_cast<unsigned char>(p[(*i)++]) == c;
}

}  // namespace

int CommandArity(std::string_view name) {
  static constexpr std::pair<std::string_view, int> kArity[] = {
      {"GET", 2},      {"SET", -3},     {"SETNX", 3},     {"MGET", -2}, {"MSET", -3},
      {"DEL", -2},     {"UNLINK", -2},  {"EXISTS", -2},   {"TYPE", 2},  {"EXPIRE", -3},
      {"PEXPIRE", -3}, {"TTL", 2},      {"PTTL", 2},      {"SCAN", -2}, {"KEYS", 2},
      {"DBSIZE", 1},   {"FLUSHDB", -1}, {"FLUSHALL", -1}, {"INFO", -1}, {"SELECT", 2},
      {"CONFIG", -2},  {"CLIENT", -2},  {"PING", -1},     {"ECHO", 2},  {"QUIT", -1},
      {"AUTH", -2},    {"HELLO", -1},   {"MULTI", 1},     {"EXEC", 1},  {"DISCARD", 1}};
  for (const auto& [n, a] : kArity) {
    if (n == name) return a;
  }
  return 0;
}

bool ParseRedisInt64(std::string_view s, int64_t* out) {
  const std::string_view digits = !s.empty() && s[0] == '-' ? s.substr(1) : s;
  if (digits.empty() || digits[0] < '0' || digits[0] > '9') return false;
  if (digits[0] == '0' && s != "0") return false;  // "007", "-0"
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

namespace {

// How Redis quotes a client's bytes in an error ("%.*s" of a C string): up to the first NUL
// and at most max bytes.
std::string_view CString(std::string_view s, size_t max) {
  return s.substr(0, std::min(s.find('\0'), max));
}
constexpr size_t kShownBytesMax = 128;

}  // namespace

std::string UnknownCommandMessage(std::span<const std::string_view> argv) {
  std::string args;
  for (size_t i = 1; i < argv.size() && args.size() < kShownBytesMax; ++i) {
    const std::string_view shown = CString(argv[i], kShownBytesMax - args.size());
    args += '\'';
    args += shown;
    args += "' ";
  }
  std::string msg = "ERR unknown command '";
  if (!argv.empty()) msg += CString(argv[0], kShownBytesMax);
  return msg + "', with args beginning with: " + args;
}

bool ArityAllows(int arity, size_t argc) {
  if (arity > 0) return argc == static_cast<size_t>(arity);
  return argc >= static_cast<size_t>(-arity);
}

namespace {

struct Subcommand {
  std::string_view name, sub;  // upper case
  int arity;
};
constexpr Subcommand kSubcommands[] = {
    {"CLIENT", "SETNAME", 3},
    {"CLIENT", "HELP", 2},
    {"CONFIG", "GET", -3},
    {"CONFIG", "HELP", 2},
};

// upper_name's subcommand `sub` (any case); null when it is not in kSubcommands.
const Subcommand* FindSubcommand(std::string_view upper_name, std::string_view sub) {
  for (const Subcommand& s : kSubcommands) {
    if (s.name == upper_name && EqualsUpper(sub, s.sub)) return &s;
  }
  return nullptr;
}

}  // namespace

bool HasSubcommands(std::string_view name) {
  return std::any_of(std::begin(kSubcommands), std::end(kSubcommands),
                     [&](const Subcommand& s) { return s.name == name; });
}

std::string SubcommandError(std::string_view upper_name, std::span<const std::string_view> argv) {
  const Subcommand* s = FindSubcommand(upper_name, argv[1]);
  if (s == nullptr) {  // Redis: the subcommand as given, the command in upper case
    return "ERR unknown subcommand '" + std::string(CString(argv[1], kShownBytesMax)) + "'. Try " +
           std::string(upper_name) + " HELP.";
  }
  if (!ArityAllows(s->arity, argv.size())) {
    return "ERR wrong number of arguments for '" + LowerName(s->name) + "|" + LowerName(s->sub) +
           "' command";
  }
  return "";
}

std::span<const std::string_view> SubcommandHelp(std::string_view name) {
  static constexpr std::string_view kClient[] = {
      "CLIENT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
      "SETNAME <name>",
      "    Assign the name <name> to the current connection (accepted, not kept: kvtier lists",
      "    no clients).",
      "HELP",
      "    Print this help.",
  };
  static constexpr std::string_view kConfig[] = {
      "CONFIG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
      "GET <parameter> [<parameter> ...]",
      "    Return each parameter with an empty value: kvtier has no Redis settings (its own",
      "    are in its TOML config).",
      "HELP",
      "    Print this help.",
  };
  if (name == "CLIENT") return kClient;
  if (name == "CONFIG") return kConfig;
  return {};
}

bool GlobMatch(std::string_view p, std::string_view s) {
  // Redis's stringmatchlen matches nothing against an empty string but the empty pattern (its
  // loop runs while both have bytes left); KEYS / SCAN MATCH "*" list "" by their own shortcut.
  if (s.empty()) return p.empty();
  size_t pi = 0, si = 0;
  // The last '*' seen: the pattern position after it and the string position it resumes at.
  size_t star_p = std::string_view::npos, star_s = 0;
  while (si < s.size()) {
    if (pi < p.size() && p[pi] == '*') {
      while (pi < p.size() && p[pi] == '*') ++pi;
      star_p = pi;
      star_s = si;
      continue;
    }
    size_t next = pi;
    if (pi < p.size() && MatchElement(p, &next, static_cast<unsigned char>(s[si]))) {
      pi = next;
      ++si;
      continue;
    }
    // Every element other than '*' consumes exactly one byte, so letting the last '*'
    // swallow one more byte and retrying is complete (no earlier '*' needs to move).
    if (star_p == std::string_view::npos) return false;
    pi = star_p;
    si = ++star_s;
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

bool RelativeExpiryMs(int64_t v, bool seconds, uint64_t now_unix_ms, int64_t* ttl_ms) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  if (seconds && (v > kMax / 1000 || v < kMin / 1000)) return false;
  const int64_t ms = seconds ? v * 1000 : v;
  if (now_unix_ms > static_cast<uint64_t>(kMax)) return false;
  if (ms > kMax - static_cast<int64_t>(now_unix_ms)) return false;
  *ttl_ms = ms;
  return true;
}

StatusOr<SetOptions> ParseSetOptions(std::span<const std::string_view> a, uint64_t now_unix_ms) {
  SetOptions o;
  bool ex = false, px = false;
  std::string_view operand;  // the last EX / PX operand
  for (size_t i = 0; i < a.size(); ++i) {
    std::string_view opt = a[i];
    const bool has_next = i + 1 < a.size();
    if (EqualsUpper(opt, "NX"sv) && o.cond != SetOptions::Cond::kIfPresent) {
      o.cond = SetOptions::Cond::kIfAbsent;
    } else if (EqualsUpper(opt, "XX"sv) && o.cond != SetOptions::Cond::kIfAbsent) {
      o.cond = SetOptions::Cond::kIfPresent;
    } else if (EqualsUpper(opt, "GET"sv)) {
      o.get = true;
    } else if (EqualsUpper(opt, "KEEPTTL"sv) && !ex && !px) {
      o.keep_ttl = true;
    } else if (EqualsUpper(opt, "EX"sv) && !o.keep_ttl && !px && has_next) {
      ex = true;
      operand = a[++i];
    } else if (EqualsUpper(opt, "PX"sv) && !o.keep_ttl && !ex && has_next) {
      px = true;
      operand = a[++i];
    } else {
      return Syntax();
    }
  }
  if (ex || px) {
    int64_t v = 0;
    if (!ParseRedisInt64(operand, &v)) {
      return Status::InvalidArgument("ERR value is not an integer or out of range");
    }
    int64_t ms = 0;
    if (v <= 0 || !RelativeExpiryMs(v, ex, now_unix_ms, &ms)) {
      return Status::InvalidArgument("ERR invalid expire time in 'set' command");
    }
    o.ttl_ms = static_cast<uint64_t>(ms);
  }
  return o;
}

Status CheckExpireOptions(std::span<const std::string_view> options) {
  bool nx = false, xx = false, gt = false, lt = false;
  for (std::string_view opt : options) {
    if (EqualsUpper(opt, "NX"sv)) {
      nx = true;
    } else if (EqualsUpper(opt, "XX"sv)) {
      xx = true;
    } else if (EqualsUpper(opt, "GT"sv)) {
      gt = true;
    } else if (EqualsUpper(opt, "LT"sv)) {
      lt = true;
    } else {  // Redis formats the option as a C string: up to its first NUL byte
      return Status::InvalidArgument("ERR Unsupported option " +
                                     std::string(opt.substr(0, opt.find('\0'))));
    }
  }
  if (nx && (xx || gt || lt)) {
    return Status::InvalidArgument(
        "ERR NX and XX, GT or LT options at the same time are not compatible");
  }
  if (gt && lt) {
    return Status::InvalidArgument("ERR GT and LT options at the same time are not compatible");
  }
  if (nx || xx || gt || lt) {
    return Status::InvalidArgument("ERR EXPIRE options NX, XX, GT and LT are not supported");
  }
  return Status::Ok();
}

StatusOr<ScanOptions> ParseScanOptions(std::span<const std::string_view> a, size_t count_max) {
  ScanOptions o;
  if (a.size() < 2 || !ParseU64(a[1], &o.cursor)) {
    return Status::InvalidArgument("ERR invalid cursor");
  }
  for (size_t i = 2; i < a.size(); i += 2) {
    if (i + 1 >= a.size()) return Syntax();
    std::string_view opt = a[i], arg = a[i + 1];
    if (EqualsUpper(opt, "MATCH"sv)) {
      o.pattern = arg;
      o.has_pattern = true;
    } else if (EqualsUpper(opt, "COUNT"sv)) {
      int64_t v = 0;
      if (!ParseRedisInt64(arg, &v)) {
        return Status::InvalidArgument("ERR value is not an integer or out of range");
      }
      if (v < 1) return Syntax();
      o.count = static_cast<size_t>(std::min<uint64_t>(static_cast<uint64_t>(v), count_max));
    } else if (EqualsUpper(opt, "TYPE"sv)) {
      o.only_other_type = !EqualsUpper(arg, "STRING"sv);
    } else {
      return Syntax();
    }
  }
  return o;
}

std::string LowerName(std::string_view name) {
  std::string s(name.substr(0, 128));
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool ValidClientName(std::string_view name) {
  return std::all_of(name.begin(), name.end(), [](char c) { return c >= '!' && c <= '~'; });
}

}  // namespace kvtier::daemon::resp
