#include "cache_daemon/resp_keyspace.h"

#include "cache_daemon/resp.h"

namespace kvtier::daemon::internal {
namespace {

using namespace std::string_view_literals;

// Index entries examined per step of KEYS.
constexpr size_t kKeysStepEntries = 1024;
// Reply bytes counted per KEYS name besides the name ("$<len>\r\n...\r\n").
constexpr uint64_t kKeysReplyOverheadBytes = 16;

StatusCode Error(const RespKeyspaceContext& c, const Status& st) {
  std::string msg = st.message();
  // Parse errors already carry Redis's prefix ("ERR ...").
  resp::AppendError(st.IsRejected()          ? "OOM command not allowed: " + msg
                    : st.IsInvalidArgument() ? msg
                                             : "ERR " + st.ToString(),
                    c.out);
  return st.code();
}

StatusCode WrongArgs(const RespKeyspaceContext& c, std::string_view cmd) {
  resp::AppendError("ERR wrong number of arguments for '" + resp::LowerName(cmd) + "' command",
                    c.out);
  return StatusCode::kInvalidArgument;
}

void Null(const RespKeyspaceContext& c) {
  if (c.proto == 3)
    resp::AppendNull3(c.out);
  else
    resp::AppendNull(c.out);
}

StatusCode Scan(const RespKeyspaceContext& c, const std::vector<std::string_view>& a) {
  StatusOr<resp::ScanOptions> o = resp::ParseScanOptions(a, c.options->resp_scan_count_max);
  if (!o.ok()) return Error(c, o.status());
  std::vector<std::string> names;
  // "*" is every key before any matching, as in Redis (GlobMatch("*", "") is false).
  const bool every = !o->has_pattern || o->pattern == "*";
  auto want = [&](std::string_view name) {
    return !o->only_other_type && (every || resp::GlobMatch(o->pattern, name));
  };
  uint64_t next =
      c.service->RespScan(*c.tenant, o->cursor, o->count, want, &names, c.reply_bytes_max);
  resp::AppendArrayHeader(2, c.out);
  resp::AppendBulk(std::to_string(next), c.out);
  resp::AppendArrayHeader(names.size(), c.out);
  for (const std::string& n : names) resp::AppendBulk(n, c.out);
  return StatusCode::kOk;
}

// KEYS pattern: a whole SCAN, answered at once, bounded by resp_keys_reply_bytes_max.
StatusCode Keys(const RespKeyspaceContext& c, std::string_view pattern) {
  uint64_t limit = c.options->resp_keys_reply_bytes_max;
  std::vector<std::string> all, step;
  uint64_t bytes = 0, cursor = 0;
  // "*" is every key before any matching, as in Redis (GlobMatch("*", "") is false).
  auto want = [&](std::string_view name) {
    return pattern == "*" || resp::GlobMatch(pattern, name);
  };
  do {
    cursor = c.service->RespScan(*c.tenant, cursor, kKeysStepEntries, want, &step);
    for (std::string& n : step) {
      bytes += n.size() + kKeysReplyOverheadBytes;
      if (bytes > limit) {
        c.metrics->Refuse(Refusal::kRespKeys);
        resp::AppendError("ERR KEYS reply over limits.resp_keys_reply_bytes_max (" +
                              std::to_string(limit) + " bytes); use SCAN",
                          c.out);
        return StatusCode::kRejected;
      }
      all.push_back(std::move(n));
    }
  } while (cursor != 0);
  resp::AppendArrayHeader(all.size(), c.out);
  for (const std::string& n : all) resp::AppendBulk(n, c.out);
  return StatusCode::kOk;
}

}  // namespace

StatusCode RunRespConditionalSet(const RespKeyspaceContext& c,
                                 const std::vector<std::string_view>& a,
                                 const resp::SetOptions& o) {
  bool written = false;
  std::optional<std::string> old;
  Status st = c.service->RespSetIf(*c.tenant, a[1], a[2], o, &written, o.get ? &old : nullptr);
  if (!st.ok()) return Error(c, st);
  if (o.get) {
    if (old.has_value())
      resp::AppendBulk(*old, c.out);
    else
      Null(c);
  } else if (written) {
    resp::AppendSimple("OK", c.out);
  } else {
    Null(c);  // NX/XX condition not met
  }
  return StatusCode::kOk;
}

std::optional<StatusCode> RunRespKeyspaceCommand(const RespKeyspaceContext& c, std::string_view cmd,
                                                 const std::vector<std::string_view>& a) {
  if (cmd == "SETNX"sv) {
    if (a.size() != 3) return WrongArgs(c, cmd);
    resp::SetOptions o;
    o.cond = resp::SetOptions::Cond::kIfAbsent;
    bool written = false;
    Status st = c.service->RespSetIf(*c.tenant, a[1], a[2], o, &written, nullptr);
    if (!st.ok()) return Error(c, st);
    resp::AppendInteger(written ? 1 : 0, c.out);
    return StatusCode::kOk;
  }
  if (cmd == "SCAN"sv) {
    if (a.size() < 2) return WrongArgs(c, cmd);
    return Scan(c, a);
  }
  if (cmd == "KEYS"sv) {
    if (a.size() != 2) return WrongArgs(c, cmd);
    return Keys(c, a[1]);
  }
  if (cmd == "TYPE"sv) {
    if (a.size() != 2) return WrongArgs(c, cmd);
    resp::AppendSimple(c.service->RespExists(*c.tenant, a[1]) ? "string" : "none", c.out);
    return StatusCode::kOk;
  }
  return std::nullopt;
}

}  // namespace kvtier::daemon::internal
