// The engine's side of kvtierd's Engram serving ([engram], cache_daemon/engram_serving.h):
// getting grants from the daemons that serve the tables and reporting fetch counters back.
//
//   auto c = daemon::Client::Connect({.socket_path = sock, .token = tenant_token});
//   daemon::Client* daemons[] = {c->get()};
//   KVTIER_ASSIGN_OR_RETURN(auto rows, ConnectEngramViaDaemons(daemons, config, {}));
//   EngineOptions eo;  eo.engram_rows = rows.get();
//   ... generate ...
//   EngramStatsReporter reporter;
//   KVTIER_RETURN_IF_ERROR(reporter.Report(*c->get(), *rows));  // ENGRAM_REPORT
//
// ConnectEngramViaDaemons asks every daemon for grants on all the regions it serves
// (ENGRAM_GRANT); the daemons must all serve from the same shards.toml (one `kvtier engram
// build` output split across them by row range), and together they must grant every region
// of the layers in config.engram_layer_ids. It then opens a RemoteEngramRowSource over TCP
// with those grants. Tokens stay in memory: nothing here logs them.
//
// Errors: InvalidArgument for no daemons, a config without Engram, daemons that disagree on
// shards.toml or a region nobody granted; the daemon's errors (NotFound when it does not
// serve Engram, PermissionDenied, Rejected) and the row transport's (IOError) otherwise.
//
// Thread safety: ConnectEngramViaDaemons is a free function; an EngramStatsReporter is not
// thread-safe (one reporter per row source, called from one thread).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "cache_daemon/client.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/remote_engram.h"

namespace kvtier::engine {

// grant_ttl_ms 0 takes each daemon's default ttl.
StatusOr<std::unique_ptr<RemoteEngramRowSource>> ConnectEngramViaDaemons(
    std::span<daemon::Client* const> daemons, const EngineConfig& config,
    RemoteEngramOptions options, uint64_t grant_ttl_ms = 0);

// Pushes a row source's fetch counters to a daemon as deltas since the previous Report() of
// this reporter (the first report sends the totals), with the current reads in flight.
class EngramStatsReporter {
 public:
  // Labelled with the source's transport name ("tcp" or "verbs"). The daemon's errors are
  // returned; the baseline advances only when the report was accepted, so nothing is lost or
  // counted twice across a failed report.
  Status Report(daemon::Client& daemon, RemoteEngramRowSource& source);

 private:
  rdma::RowFetchStats last_{};
};

}  // namespace kvtier::engine
