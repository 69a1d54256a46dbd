#include "engine/engram_daemon.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

namespace kvtier::engine {

StatusOr<std::unique_ptr<RemoteEngramRowSource>> ConnectEngramViaDaemons(
    std::span<daemon::Client* const> daemons, const EngineConfig& config,
    RemoteEngramOptions options, uint64_t grant_ttl_ms) {
  if (daemons.empty()) return Status::InvalidArgument("engram: no daemon to ask for grants");
  if (config.engram_layer_ids.empty())
    return Status::InvalidArgument("engram: the model config has no Engram layers");
  RemoteEngramConfig rc;
  rc.layer_ids = config.engram_layer_ids;
  for (size_t i = 0; i < daemons.size(); ++i) {
    if (daemons[i] == nullptr) return Status::InvalidArgument("engram: null daemon client");
    KVTIER_ASSIGN_OR_RETURN(daemon::wire::EngramGrantResponse grant,
                            daemons[i]->EngramGrant({}, grant_ttl_ms));
    if (i == 0) {
      rc.shard_map_toml = grant.shards_toml;
      rc.tenant = grant.tenant;
    } else if (grant.shards_toml != rc.shard_map_toml) {
      return Status::InvalidArgument("engram: daemon " + grant.endpoint +
                                     " serves from a different shards.toml than " +
                                     "the first daemon");
    } else if (grant.tenant != rc.tenant) {
      return Status::InvalidArgument("engram: daemon " + grant.endpoint +
                                     " granted to another tenant");
    }
    for (const daemon::wire::EngramGrantedRegion& r : grant.regions) {
      rdma::wire::GrantToken token;
      static_assert(sizeof(token) == sizeof(r.token));
      std::copy(r.token.begin(), r.token.end(), token.begin());
      rc.tokens[r.name] = token;
    }
  }
  // Connect names the region that has no token (InvalidArgument) when a daemon is missing.
  return RemoteEngramRowSource::Connect(config.engram_head_dim, rc, std::move(options));
}

Status EngramStatsReporter::Report(daemon::Client& daemon, RemoteEngramRowSource& source) {
  const rdma::RowFetchStats f = source.stats().fetch;
  // Counters are monotonic; a source replaced under the same reporter restarts them, which
  // reads as a negative delta: report zero then and take the new baseline.
  auto delta = [](uint64_t cur, uint64_t prev) { return cur >= prev ? cur - prev : 0; };
  daemon::wire::EngramReport r;
  r.transport = source.transport_name();
  r.rows_requested = delta(f.rows_requested, last_.rows_requested);
  r.rows_deduplicated = delta(f.rows_deduplicated, last_.rows_deduplicated);
  r.hot_cache_hits = delta(f.hot_cache_hits, last_.hot_cache_hits);
  r.rows_read = delta(f.rows_read, last_.rows_read);
  r.bytes_read = delta(f.bytes_read, last_.bytes_read);
  r.late_rows = delta(f.late_rows, last_.late_rows);
  r.stalls = delta(f.stalls, last_.stalls);
  r.stall_us = delta(f.stall_us, last_.stall_us);
  r.retries = delta(f.retries, last_.retries);
  r.fetches_failed = delta(f.fetches_failed, last_.fetches_failed);
  r.reads_in_flight = f.reads_in_flight;
  KVTIER_RETURN_IF_ERROR(daemon.EngramReport(r));
  last_ = f;
  return Status::Ok();
}

}  // namespace kvtier::engine
