// EngramServing: kvtierd's read-only Engram table server ([engram] in docs/CONFIG.md).
//
// Open() reads <engram.dir>/shards.toml (the `kvtier engram build` output, engine/
// engram_export.h), validates every `[[engram.<layer>.shard]]` array as an rdma::ShardMap,
// and registers with an embedded rdma::RowServer the shards whose `endpoint` is this server's
// engram.advertise endpoint (host and port compared as parsed), each from its table file
// <dir>/<region>.engram. So one shards.toml shards tables by row range across several kvtierd.
// Every served file is memory-mapped read-only and its header must match its shard's row
// range. Start() binds engram.listen on the daemon's io_context; Stop() closes it.
//
// Grants (ENGRAM_GRANT): Grant() issues one RowServer grant per region for a tenant, with a
// ttl <= engram.grant_ttl_ms_max, all or nothing. A tenant holds at most
// grants_per_tenant_max live grants (Rejected beyond; expired ones are forgotten first).
// Tokens leave this class only in the returned struct; nothing here logs them.
//
// Errors: Open(): InvalidArgument for a bad shards.toml, no shard assigned to this endpoint,
// an unsafe region name or a table whose header does not match its shard; NotFound/IOError/
// Corruption (with the path) for a missing or unreadable file. Start(): IOError naming the
// endpoint. Grant(): NotFound (unknown region), InvalidArgument (bad ttl, duplicate or too
// many names), Rejected (grant limits).
//
// Thread safety: Grant(), Revoke(), counters() and the accessors are thread-safe; Start() and
// Stop() are called by the daemon's lifecycle only. Ownership: owns its RowServer and mappings.
#pragma once

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>
// (must precede boost/asio.hpp)
#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cache_daemon/config.h"
#include "cache_daemon/wire.h"
#include "common/clock.h"
#include "common/status.h"
#include "rdma/row_server.h"

namespace kvtier::daemon {

// Regions one daemon serves (a shards.toml with more assigned to one endpoint is refused).
inline constexpr size_t kEngramServedRegionsMax = wire::kEngramRegionsMax;

class EngramServing {
 public:
  // options must be Finalize()d with enabled = true. clock (not owned, may be null for the
  // default steady clock) times grant expiry.
  static StatusOr<std::unique_ptr<EngramServing>> Open(const EngramServeOptions& options,
                                                       const Clock* clock = nullptr);
  ~EngramServing();

  Status Start(boost::asio::io_context& io);
  void Stop();

  // Issues grants for `tenant` on `regions` (empty: every served region), ttl_ms 0 meaning
  // the configured default. Fills endpoint, tenant, ttl and regions of the response; the
  // caller adds shards_toml (shards_toml()).
  StatusOr<wire::EngramGrantResponse> Grant(const std::string& tenant,
                                            std::span<const std::string> regions, uint64_t ttl_ms);
  // Revokes grants issued by Grant() (e.g. when the reply cannot be sent). Best effort.
  void Revoke(const std::string& tenant, std::span<const wire::EngramGrantedRegion> grants);

  const std::vector<std::string>& regions() const { return regions_; }
  const std::string& endpoint() const { return options_.advertise; }
  const std::string& shards_toml() const { return shards_toml_; }
  uint16_t port() const { return server_->port(); }
  rdma::RowServerCounters counters() const { return server_->counters(); }
  uint64_t grants_issued() const;

 private:
  EngramServing(const EngramServeOptions& options, const Clock* clock);
  Status Load();

  EngramServeOptions options_;
  const Clock* clock_;
  std::unique_ptr<rdma::RowServer> server_;
  std::string shards_toml_;
  std::vector<std::string> regions_;  // served, sorted; immutable after Open

  mutable std::mutex mu_;
  // tenant -> steady-clock expiry (ms) of each live grant issued to it; protected by mu_.
  std::map<std::string, std::vector<uint64_t>> live_;
  uint64_t grants_issued_ = 0;  // protected by mu_
};

}  // namespace kvtier::daemon
