// The kvtier client library: how the engine and the `kvtier` CLI talk to kvtierd over the
// native protocol (docs/format/wire.md). It does not depend on the daemon or the store.
//
//   auto c = Client::Connect({.socket_path = "/run/kvtier/kvtierd.sock", .token = tok});
//   auto hit = (*c)->Lookup(chain);                      // longest hit prefix
//   (*c)->Put(units);                                    // a batch of units
//   (*c)->Get(chain, [](size_t i, const GetItem& g) {...});  // values over shared memory
//
// Transport: a Unix socket (default) or TCP. Over a Unix socket the client asks for a
// shared-memory region once (SHM_ATTACH; the daemon passes a memfd with SCM_RIGHTS), and
// bulk values of PUT and GET travel through it instead of the socket. Over TCP they are
// inline in the frames; with ClientOptions::tls the TCP connection is TLS (tls_client.h).
//
// Calls are pipelined: every call sends a frame with a fresh request id and returns a
// future; a reader thread completes futures as responses arrive (in any order). The sync
// calls are the async ones followed by get(). Batches larger than the daemon's limit
// (kMaxBatchKeys) are split by the client.
//
// Errors: each call returns the daemon's status (NotFound, Rejected for quota / limits,
// PermissionDenied, ...) or IOError when the connection fails; after a connection failure
// every pending and later call fails with IOError (reconnect with a new Client).
//
// Thread safety: a Client may be used from many threads at once.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_daemon/wire.h"
#include "common/status.h"

namespace kvtier::daemon {

// $XDG_STATE_HOME/kvtier, else $HOME/.local/state/kvtier, else ./kvtier-data: kvtierd's
// default data directory.
std::string DefaultDataDir();
// <DefaultDataDir()>/kvtierd.sock: where kvtierd listens with no configuration.
std::string DefaultSocketPath();

struct ClientOptions {
  // Unix socket path; used when tcp_port is 0.
  std::string socket_path;
  // TCP host and port of the native protocol (server.native_port).
  std::string tcp_host = "127.0.0.1";
  uint16_t tcp_port = 0;
  // TLS over TCP (the daemon's [tls] native = true); ignored over the Unix socket. The
  // daemon's certificate chain is always verified, against tls_ca_file ("" -> OpenSSL's
  // default trust store); its name must match tls_server_name ("" -> tcp_host; a DNS name or
  // an IP address) unless tls_verify_hostname is false. See cache_daemon/tls_client.h.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_server_name;
  bool tls_verify_hostname = true;
  // Authentication token; empty when the daemon runs without auth.
  std::string token;
  // Shared memory over the Unix socket (bytes requested; 0 disables).
  uint64_t shm_bytes = 64ull << 20;
  // Tokens per unit (recorded in daemon traces; 0 unknown).
  uint32_t unit_tokens = 0;
  // Bounds the connect, the handshake, each send and each call's wait for its reply.
  uint64_t timeout_ms = 30000;
  // A call that times out fails the connection (connection_status), and with it every call
  // waiting on it and every later one, at once: for callers that must not wait out one timeout
  // per call on a stalled daemon (the serving scheduler). Otherwise the connection stays, and a
  // late reply completes nothing (its shared-memory range is reused only after it arrives).
  bool close_on_timeout = false;
  // Largest frame the client accepts from the daemon.
  uint64_t max_frame_bytes = (64ull << 20) + (1ull << 20);
};

struct LookupResult {
  size_t hit_count = 0;
  std::vector<uint8_t> tiers;  // storage::Tier values: 0 hbm, 1 dram, 2 ssd
  uint8_t first_miss = 0;      // storage::MissReason
};

struct PutOptions {
  uint8_t kind = 0;          // policies::ObjectKind
  uint8_t highest_tier = 1;  // fastest tier allowed (1 dram, 2 ssd)
  bool allow_ssd = true;
  uint32_t recompute_tokens = 0;
  uint64_t ttl_ms = 0;
  // The turn the put belongs to (Client::NewTurn); 0: none (the batch is a request of its own).
  uint64_t turn = 0;
};

struct PutUnit {
  wire::Key key{};
  wire::Key parent{};              // zeros for the first unit of a chain
  std::span<const uint8_t> value;  // not retained after the call returns
};

struct GetItem {
  Status status;  // OK, NotFound, ...
  uint8_t tier = 255;
  std::span<const uint8_t> value;  // valid only inside the visitor
};

class Client {
 public:
  static StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  virtual ~Client() = default;

  virtual const wire::HelloResponse& hello() const = 0;
  virtual bool shm_attached() const = 0;
  // Ok when the shared-memory region is attached, or was not asked for (TCP, shm_bytes = 0,
  // no token against an auth daemon). Otherwise why the connection carries values over the
  // socket instead: the daemon's SHM_ATTACH status, Corruption for a region that is not what
  // the daemon said (a file shorter than granted, not sealed against shrinking), IOError when
  // the mapping failed. Not an error of the connection: every call works without the region.
  virtual Status shm_status() const = 0;
  // Ok while the connection is usable. Once it failed (closed by the daemon, a malformed frame,
  // a call that timed out), why: every call fails at once from then on; connect again.
  virtual Status connection_status() const = 0;

  // A fresh turn id (never 0). One engine turn (its LOOKUP, GET and PUT) passes the same id
  // to each call, so that the daemon's eviction policies see the turn as one request
  // (wire::kFlagTurn; the id is scoped to this connection). Against a daemon that does not
  // announce kFeatureTurns the id is not sent and each call is its own request, as before.
  virtual uint64_t NewTurn() = 0;

  // turn: as NewTurn describes; 0 for none.
  virtual std::future<StatusOr<LookupResult>> LookupAsync(std::span<const wire::Key> chain,
                                                          uint64_t turn) = 0;
  std::future<StatusOr<LookupResult>> LookupAsync(std::span<const wire::Key> chain) {
    return LookupAsync(chain, 0);
  }
  // One status per unit, in order.
  virtual std::future<StatusOr<std::vector<Status>>> PutAsync(std::span<const PutUnit> units,
                                                              const PutOptions& options) = 0;

  StatusOr<LookupResult> Lookup(std::span<const wire::Key> chain, uint64_t turn = 0) {
    return LookupAsync(chain, turn).get();
  }
  StatusOr<std::vector<Status>> Put(std::span<const PutUnit> units, const PutOptions& options) {
    return PutAsync(units, options).get();
  }
  // Calls visit(i, item) for each key in order. Over shared memory the daemon writes the
  // values into the region and item.value points into the calling thread's copy of them
  // (read out of the region's file with one pread: no socket copy, and none of a fresh
  // mapping's first-touch faults; the region itself when that copy cannot be made); it is
  // released when Get returns. Memory: each thread that calls Get keeps its copy buffer (up to
  // 32 MiB) for its next call. turn: as for LookupAsync.
  virtual Status Get(std::span<const wire::Key> keys, uint64_t turn,
                     const std::function<void(size_t, const GetItem&)>& visit) = 0;
  Status Get(std::span<const wire::Key> keys,
             const std::function<void(size_t, const GetItem&)>& visit) {
    return Get(keys, 0, visit);
  }
  // Convenience: copies each hit into (*values)[i]; misses leave an empty vector and set
  // (*found)[i] = false.
  Status GetCopy(std::span<const wire::Key> keys, std::vector<std::vector<uint8_t>>* values,
                 std::vector<bool>* found);

  virtual Status Prefetch(std::span<const wire::Key> keys) = 0;
  virtual Status Pin(std::span<const wire::Key> keys, uint64_t lease_ms) = 0;
  virtual Status Unpin(std::span<const wire::Key> keys) = 0;
  // Returns how many existed.
  virtual StatusOr<uint32_t> Delete(std::span<const wire::Key> keys) = 0;
  // Removes every unit of the caller's tenant.
  virtual Status DeleteAll() = 0;
  virtual StatusOr<std::string> StatsJson() = 0;
  virtual StatusOr<std::string> PolicyGet() = 0;
  // JSON: {"eviction": ..., "admission": ..., "params": {...}}. Returns the new policy JSON.
  virtual StatusOr<std::string> PolicySet(const std::string& json) = 0;
  // Flush and mark the daemon not ready; shutdown=true then stops it gracefully.
  virtual Status Drain(bool shutdown) = 0;

  // ENGRAM_GRANT: grants for the caller's tenant on `regions` of the Engram tables the
  // daemon serves (empty: all of them), each valid for ttl_ms (0: the daemon's default;
  // at most its engram.grant_ttl_ms_max). The response carries the row server endpoint, the
  // tenant to present, shards.toml and one secret token per region: keep the tokens out of
  // logs. NotFound when the daemon does not serve Engram or a region is unknown; Rejected at
  // the grant limits; InvalidArgument for more than kEngramRegionsMax names or a name
  // outside 1..256 bytes (checked here before sending).
  virtual StatusOr<wire::EngramGrantResponse> EngramGrant(std::span<const std::string> regions,
                                                          uint64_t ttl_ms) = 0;
  // ENGRAM_REPORT: adds an engine's fetch counter deltas (and its current reads_in_flight)
  // for one transport ("tcp" or "verbs") to the daemon's /metrics under the caller's
  // tenant. InvalidArgument for another transport name (checked here before sending).
  virtual Status EngramReport(const wire::EngramReport& report) = 0;

  // Sends raw bytes on the connection (tests of bad input only).
  virtual Status TEST_SendRaw(std::span<const uint8_t> bytes) = 0;
};

}  // namespace kvtier::daemon
