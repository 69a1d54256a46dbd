// The RESP commands off the GET/SET hot path that read or list a tenant's keyspace: SET with
// NX/XX/GET/KEEPTTL, SETNX, SCAN, KEYS, TYPE. resp_session.cc dispatches them here; they
// answer into the connection's reply text. Semantics and limits: docs/RESP.md.
//
// Thread safety: as Service (called from any connection's strand).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/config.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/resp_commands.h"
#include "cache_daemon/service.h"
#include "cache_daemon/tenants.h"
#include "common/status.h"

namespace kvtier::daemon::internal {

struct RespKeyspaceContext {
  Service* service;
  const Tenant* tenant;
  const DaemonOptions* options;
  DaemonMetrics* metrics;
  int proto;         // 2 or 3 (HELLO): how nulls are written
  std::string* out;  // replies are appended here
  // The connection's reply budget: a SCAN lists names up to about this many bytes (one more
  // name at most), fewer than COUNT asks when they are long.
  uint64_t reply_bytes_max;
};

// Runs `cmd` (upper case) when it is SETNX, SCAN, KEYS or TYPE and returns its status code;
// nullopt when it is none of them. The argument count is checked here.
std::optional<StatusCode> RunRespKeyspaceCommand(const RespKeyspaceContext& c, std::string_view cmd,
                                                 const std::vector<std::string_view>& argv);

// SET key value with options that need the old value (SetOptions::plain() false).
StatusCode RunRespConditionalSet(const RespKeyspaceContext& c,
                                 const std::vector<std::string_view>& argv,
                                 const resp::SetOptions& o);

}  // namespace kvtier::daemon::internal
