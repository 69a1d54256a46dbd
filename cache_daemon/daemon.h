// Daemon: kvtierd's server. It owns the store, a fixed pool of Asio I/O threads, a pool of
// worker threads for native requests, and the listeners:
//   native protocol  Unix socket (shared-memory bulk data) and optional TCP (inline data)
//   RESP             TCP, Redis-compatible subset
//   HTTP admin       TCP, /metrics /healthz /readyz /v1/stats /v1/policy /v1/unit (Boost.Beast)
//
// Lifecycle: Start() binds every listener or fails (IOError naming the endpoint). Shutdown()
// begins a graceful stop: listeners close, connections stop reading new requests, requests
// already received run to completion and their responses are written (bounded by
// drain_timeout_ms), then the store is flushed (Flush(): everything acknowledged becomes
// durable) and the threads stop. Wait() blocks until that is done and returns the flush
// status.
//
// Thread safety: Shutdown(), shutdown_requested(), ReloadPolicy(), SetReady() may be called
// from any thread, including a signal-handling thread.
#pragma once

#include <memory>

#include "cache_daemon/config.h"
#include "cache_daemon/tenants.h"
#include "cache_daemon/trace_writer.h"
#include "common/status.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

class Daemon {
 public:
  virtual ~Daemon() = default;

  // options must be Finalize()d. The daemon takes ownership of store, tenants and trace
  // (trace may be null).
  static StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options,
                                                 std::unique_ptr<storage::TierManager> store,
                                                 std::unique_ptr<TenantRegistry> tenants,
                                                 std::unique_ptr<TraceWriter> trace);

  virtual void Shutdown() = 0;
  virtual bool shutdown_requested() const = 0;
  virtual Status Wait() = 0;
  // Re-reads [policy] from the config file (no-op OK when there is none) and applies it.
  virtual Status ReloadPolicy() = 0;
};

}  // namespace kvtier::daemon
