// The RESP front end's command vocabulary, apart from the connection: which commands exist
// and how many arguments each takes (checked when MULTI queues a command), the option
// grammars of SET and SCAN, and Redis's glob matching for SCAN MATCH / KEYS.
//
// Every function here is pure and judges client bytes: malformed input is an error whose
// message is the text Redis answers (without the leading "-"), never a crash or a silent
// default. docs/RESP.md lists the commands and their limits.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier::daemon::resp {

// Redis-style arity of a command the RESP front end implements (name in upper case): n > 0
// means exactly n arguments including the name, n < 0 at least -n; 0 means no such command.
int CommandArity(std::string_view upper_name);
// True when argc arguments (including the name) fit `arity` (non-zero).
bool ArityAllows(int arity, size_t argc);
// The commands with subcommands this front end implements (CLIENT, CONFIG; name in upper
// case). Their subcommands and Redis-style arities are a table in resp_commands.cc.
bool HasSubcommands(std::string_view upper_name);
// Redis's refusal of argv (its command upper_name, one of HasSubcommands; argv.size() >= 2)
// when its subcommand is not one of the table's (CLIENT SETNAME and HELP, CONFIG GET and HELP;
// every other, Redis's "ERR unknown subcommand 'x'. Try CLIENT HELP.") or its argument count
// does not fit ("ERR wrong number of arguments for 'client|setname' command"); empty when
// argv is a well-formed call. Checked when a command runs and when MULTI
// queues it (a refused one discards the transaction at EXEC, as in Redis).
std::string SubcommandError(std::string_view upper_name, std::span<const std::string_view> argv);
// The reply lines of `<name> HELP` (simple strings, Redis's layout: usage, then each
// subcommand and its description).
std::span<const std::string_view> SubcommandHelp(std::string_view upper_name);

// Redis's glob (stringmatchlen, case-sensitive): `*` any run, `?` one byte, `[abc]`, `[^a]`,
// `[a-z]` (reversed ranges allowed; bytes compared as signed char, as in Redis on x86-64, so
// 0x80..0xff come before 0x00), `\x` the byte x (also inside brackets); an unterminated
// `[` ends at the end of the pattern. Runs in O(|pattern| * |s|) time and O(1) space (no
// recursion, so no pattern can exhaust the stack).
// As in Redis, the empty string matches only the empty pattern (not even "*": KEYS and SCAN
// treat the pattern "*" as "every key" before they match).
bool GlobMatch(std::string_view pattern, std::string_view s);

// Redis's integer syntax (string2ll, what every integer argument of Redis is read with): an
// optional '-', then decimal digits without a leading zero ("0" alone is zero), in the int64
// range. No '+', no spaces, no "-0", no "007". False when `s` is anything else.
bool ParseRedisInt64(std::string_view s, int64_t* out);

// The message Redis answers a command it does not know (argv[0] is its name): "ERR unknown
// command '<name>', with args beginning with: '<arg>' '<arg>' ", the name cut at 128 bytes and
// arguments added while the list is under 128 bytes, each cut so that the list stays within
// 128; every part ends at its first NUL byte (Redis formats them as C strings).
std::string UnknownCommandMessage(std::span<const std::string_view> argv);

// Redis's bound on a relative expiry (EXPIRE, PEXPIRE, SET EX/PX): `v` seconds (`seconds`
// true) or milliseconds as milliseconds in *ttl_ms, which may be zero or negative (already
// expired). False when the milliseconds, or the absolute expiry now_unix_ms + *ttl_ms, do not
// fit a signed 64-bit integer: the command must answer "ERR invalid expire time in '<cmd>'
// command", never wrap (a wrapped expiry had the key expire at once, its reply a success).
bool RelativeExpiryMs(int64_t v, bool seconds, uint64_t now_unix_ms, int64_t* ttl_ms);

// The options after "EXPIRE key n" (or PEXPIRE), judged as Redis 7 does, in its order: an
// unknown word is "ERR Unsupported option <word>", NX with XX/GT/LT and GT with LT are "ERR ...
// not compatible". kvtier implements none of NX, XX, GT, LT: Ok only when there are no options,
// else "ERR EXPIRE options NX, XX, GT and LT are not supported" (docs/RESP.md).
Status CheckExpireOptions(std::span<const std::string_view> options);

// SET key value [NX | XX] [GET] [EX seconds | PX milliseconds | KEEPTTL].
struct SetOptions {
  enum class Cond : uint8_t { kAlways, kIfAbsent, kIfPresent };  // -, NX, XX
  Cond cond = Cond::kAlways;
  uint64_t ttl_ms = 0;  // EX/PX in milliseconds; 0: none
  bool keep_ttl = false;
  bool get = false;  // reply with the previous value
  // True when the SET needs nothing but a write (no condition, no read of the old value).
  bool plain() const { return cond == Cond::kAlways && !keep_ttl && !get; }
};
// Parses the options after "SET key value" at the time now_unix_ms, as Redis 7 does: all
// options first, then the expiry's operand. A repeated NX, XX, GET, KEEPTTL, EX or PX is
// allowed (the last EX / PX operand counts); NX with XX, KEEPTTL with EX/PX and EX with PX are
// not. InvalidArgument with Redis's message: "ERR syntax error" (unknown or conflicting
// option, missing operand; found before any operand is judged), "ERR value is not an integer
// or out of range" (ParseRedisInt64), "ERR invalid expire time in 'set' command" (<= 0, or an
// expiry RelativeExpiryMs refuses).
StatusOr<SetOptions> ParseSetOptions(std::span<const std::string_view> options,
                                     uint64_t now_unix_ms);

// SCAN cursor [MATCH pattern] [COUNT count] [TYPE type].
struct ScanOptions {
  uint64_t cursor = 0;
  std::string_view pattern;  // empty with has_pattern false: every key
  bool has_pattern = false;
  size_t count = 10;             // keys examined, clamped to count_max
  bool only_other_type = false;  // TYPE given and not "string": kvtier holds only strings
};
// Parses "SCAN ..." (argv[0] is the command name); views point into argv. COUNT above
// count_max is clamped (COUNT is a hint in Redis too); COUNT < 1 is "ERR syntax error"; a
// cursor that is not an unsigned 64-bit integer is "ERR invalid cursor".
StatusOr<ScanOptions> ParseScanOptions(std::span<const std::string_view> argv, size_t count_max);

// The command name as Redis quotes it in errors (lower case), at most 128 bytes.
std::string LowerName(std::string_view name);

// Whether Redis accepts `name` as a client name (CLIENT SETNAME, HELLO ... SETNAME): bytes '!'
// to '~' only, as Redis 7 checks (a space, a control byte or a byte over 0x7e is refused); the
// empty name is allowed (it clears the name).
bool ValidClientName(std::string_view name);
inline constexpr std::string_view kInvalidClientNameError =
    "ERR Client names cannot contain spaces, newlines or special characters.";

}  // namespace kvtier::daemon::resp
