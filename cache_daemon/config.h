// kvtierd configuration: an options struct with embedded defaults, a TOML loader and the
// command-line overrides. Every key, its default and its meaning is listed in docs/CONFIG.md
// and deploy/kvtierd.toml; keep the three in step.
//
// Defaults work with no file at all: data under $XDG_STATE_HOME/kvtier (or ./kvtier-data),
// the native protocol on <data_dir>/kvtierd.sock, RESP and HTTP on 127.0.0.1 only.
//
// Thread safety: plain values; LoadConfig/ApplyFlag are not thread-safe on one object.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/client.h"  // DefaultDataDir()
#include "cache_daemon/cluster_config.h"
#include "common/host_port.h"  // IsLoopbackAddress, IsIpAddressOrLocalhost
#include "common/status.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

// [engram]: kvtierd serves Engram tables read-only through an embedded rdma::RowServer
// (cache_daemon/engram_serving.h). Off by default.
struct EngramServeOptions {
  bool enabled = false;
  std::string listen = "127.0.0.1:7301";  // row server "host:port" (numeric host)
  // The endpoint shards.toml names for this server; "" -> listen. Only the shards whose
  // `endpoint` equals it (as written) are served.
  std::string advertise;
  std::string dir;  // a `kvtier engram build` output directory (shards.toml + table files)
  uint64_t grant_ttl_ms = 600000;         // ENGRAM_GRANT with ttl 0 gets this (10 min)
  uint64_t grant_ttl_ms_max = 3600000;    // the longest grant a client may ask for (1 h)
  uint32_t grants_max = 65536;            // live grants over all tenants (RowServer)
  uint32_t grants_per_tenant_max = 4096;  // live grants of one tenant
  // RowServerOptions limits.
  uint32_t connections_max = 256;
  uint32_t attach_timeout_ms = 10000;  // a connection attaching no region this long is closed
  uint32_t body_timeout_ms = 10000;    // a request body unfinished this long closes it
  uint32_t regions_per_connection_max = 64;
  uint32_t batch_ops_max = 1024;              // 1..4096 (rdma::wire::kBatchOpsMax)
  uint32_t read_bytes_max = 1u << 20;         // one read op, 1..1 MiB
  uint64_t response_bytes_max = 16ull << 20;  // one read response, read_bytes_max..64 MiB
  // The verbs side of the row server (used only where built with RDMA and a device exists;
  // rdma::verbs::VerbsOptions, negotiated down with each client in VERBS_CONNECT).
  uint32_t verbs_path_mtu_max_bytes = 4096;  // 256, 512, 1024, 2048 or 4096
  uint32_t verbs_rd_atomic_max = 16;         // RDMA READs one queue pair accepts, 1..255
  uint32_t verbs_gid_index = 0;              // GID table index of the port, 0..255
  uint32_t verbs_registrations_max = 1024;   // table-row MRs, one per grant used over verbs

  // Filled by Finalize() from listen / advertise.
  std::string listen_host;
  uint16_t listen_port = 0;
};

// [tls]: TLS for the TCP fronts, terminated in-process (cache_daemon/tls_front.h). Each front
// opts in; a front bound to a non-loopback address must (Finalize).
struct TlsServeOptions {
  std::string cert_file;  // PEM certificate chain (leaf first); required when a front uses TLS
  std::string key_file;   // PEM private key of the leaf, unencrypted
  bool native = false;    // native protocol TCP port
  bool resp = false;      // RESP port
  bool http = false;      // HTTP admin port
  uint64_t handshake_timeout_ms = 10000;  // a TLS handshake must complete within this
  uint32_t handshakes_max = 256;          // handshakes in progress at once, all fronts

  bool any() const { return native || resp || http; }
};

struct DaemonOptions {
  // [server]
  std::string data_dir;     // "" -> DefaultDataDir()
  std::string socket_path;  // "" -> <data_dir>/kvtierd.sock; "off" disables
  // Default address of the data fronts (native TCP, RESP). Not the HTTP admin front's.
  std::string listen_address = "127.0.0.1";
  std::string native_listen;              // native TCP address; "" -> listen_address
  std::string resp_listen;                // RESP address; "" -> listen_address
  std::string http_listen = "127.0.0.1";  // HTTP admin address (loopback unless set)
  uint16_t native_port = 0;               // native protocol over TCP; 0 disables
  uint16_t resp_port = 6380;              // RESP front end; 0 disables
  uint16_t http_port = 9180;              // HTTP admin (/metrics); 0 disables
  // Host names (besides IP literals and localhost) the HTTP admin front answers under while
  // auth is off: a request whose Host header names another is refused (DNS rebinding).
  std::vector<std::string> http_allowed_hosts;
  uint32_t io_threads = 2;      // Asio I/O threads (RESP and HTTP run here)
  uint32_t worker_threads = 4;  // native-protocol request executors

  // [limits]
  uint64_t max_frame_bytes = (64ull << 20) + (1ull << 20);  // one native frame, header included
  uint32_t max_inflight_per_connection = 64;  // frames executing per connection (then backpressure)
  // Keys (units) in one native LOOKUP/PUT/GET/PREFETCH/PIN/UNPIN/DELETE, 1..4096 (the wire
  // format's kMaxBatchKeys). Advertised in the HELLO response; the client splits at it; a
  // request over it is answered invalid_argument and the connection stays open.
  uint32_t max_batch_keys = 4096;
  uint32_t max_connections = 1024;            // all fronts together; more are closed at once
  uint64_t frame_timeout_ms = 10000;          // a started frame / RESP command must complete
  uint64_t shm_max_bytes = 256ull << 20;      // shared-memory region per Unix connection
  uint64_t drain_timeout_ms = 30000;          // graceful shutdown waits this long for in-flight
  uint32_t resp_max_args = 65536;             // arguments in one RESP command
  uint64_t http_max_body_bytes = 1ull << 20;  // POST /v1/policy body
  // Connection budgets (docs/CONFIG.md "Connection limits"; each refusal is counted in
  // kvtier_connection_limit_refusals_total{reason}).
  uint64_t idle_timeout_ms =
      300000;  // no byte in or out and nothing executing: closed (all fronts)
  uint64_t reply_queue_bytes_max = 128ull << 20;  // replies queued on one connection: stop reading
  uint64_t preauth_frame_bytes_max = 16u << 10;   // one frame / RESP command before authentication
  uint64_t resp_command_bytes_max = (64ull << 20) + (1ull << 20);  // one RESP command, all args
  // RESP commands beyond GET/SET (docs/RESP.md); refusals counted as resp_multi / resp_keys.
  uint32_t resp_multi_commands_max = 65536;           // commands queued after MULTI
  uint64_t resp_multi_bytes_max = 128ull << 20;       // bytes queued after MULTI
  uint32_t resp_scan_count_max = 10000;               // SCAN COUNT is clamped to this
  uint64_t resp_keys_reply_bytes_max = 16u << 20;     // KEYS reply; beyond it an error (use SCAN)
  uint64_t resp_key_index_bytes_max = 256ull << 20;   // key names kept for SCAN/KEYS/DBSIZE
  uint64_t connection_memory_bytes_max = 1ull << 30;  // all connection buffers together
  // Large reply buffers kept for the next replies (cache_daemon/reply_buffers.h), outside
  // connection_memory_bytes_max; 0 keeps none.
  uint64_t reply_buffers_kept_bytes_max = 64ull << 20;
  // glibc malloc, set at start (docs/CONFIG.md, [limits]): the arenas (M_ARENA_MAX; 0 keeps
  // glibc's 8 per core) and the size from which an allocation is a mapping of its own, returned
  // to the system when freed (M_MMAP_THRESHOLD; 0 keeps glibc's, which rises to the largest
  // such block freed, up to 32 MiB, after which those blocks come from heaps that keep pages).
  uint32_t malloc_arenas_max = 2;
  uint64_t malloc_mmap_threshold_bytes = 0;
  uint32_t unix_connections_max = 512;  // per front; max_connections caps the sum
  uint32_t native_tcp_connections_max = 256;
  uint32_t resp_connections_max = 192;
  uint32_t http_connections_max = 64;
  uint32_t tenant_connections_max = 256;  // connections authenticated as one tenant (auth on)
  // Before authentication (auth on; the fronts that authenticate with HELLO/AUTH: Unix, native
  // TCP, RESP, TLS or not). A connection counts as unauthenticated from its accept until its
  // first successful HELLO/AUTH (a native one that loses its tenant to a failed HELLO/AUTH
  // counts again); the HTTP admin front authenticates each request and is not counted.
  uint64_t auth_timeout_ms = 10000;  // not authenticated this long after accept: closed
  // Unauthenticated connections per front; beyond it a new connection is closed at accept, so
  // clients that never authenticate cannot take the slots of *_connections_max.
  uint32_t unauthenticated_connections_max = 64;
  // Of those, per source on the TCP fronts (native TCP, RESP; TLS or not), so that one client
  // reconnecting as fast as it is closed cannot keep all of them (cache_daemon/source_limit.h):
  // 1..unauthenticated_connections_max; 0 (unset) -> Finalize() sets
  // min(kUnauthenticatedPerSourceDefault, unauthenticated_connections_max). Not on the Unix
  // socket (no source address; its clients are local, admitted by the socket's permissions).
  static constexpr uint32_t kUnauthenticatedPerSourceDefault = 8;
  uint32_t unauthenticated_connections_per_source_max = 0;
  // The bits of an IPv6 peer address that name its source (16..128): 64, as one host owns a
  // /64. An IPv4 source is its whole address; an IPv4-mapped IPv6 peer is its IPv4 address.
  uint32_t unauthenticated_source_ipv6_prefix_bits = 64;
  // Connections on the HTTP admin front per source (auth on; sources as above), so that one
  // host holding idle connections cannot take every place of http_connections_max and with
  // them /readyz and /metrics from the probes and scrapers: 1..http_connections_max; 0
  // (unset) -> min(kHttpPerSourceDefault, http_connections_max). With auth off kvtierd serves
  // only loopback, one source, and this is not applied.
  static constexpr uint32_t kHttpPerSourceDefault = 16;
  uint32_t http_connections_per_source_max = 0;

  // [auth]
  std::string tokens_file;               // "" -> auth off (loopback / Unix only)
  std::string server_secret_file;        // "" -> <data_dir>/server_secret (created on first start)
  uint32_t default_inflight_max = 1024;  // in-flight limit of tenant "default" (auth off)

  // [tls]
  TlsServeOptions tls;

  // [storage]
  storage::TierManagerOptions storage;  // data_dir is filled from data_dir above

  // [trace]
  std::string trace_path;              // "" -> off; written as zstd JSON Lines
  uint32_t trace_queue_depth = 65536;  // records buffered before new ones are dropped
  // What-if curves over the newest recorded lines (cache_daemon/whatif.h, GET /v1/whatif).
  uint32_t trace_whatif_window_records_max = 100000;  // 0 -> no what-if curves
  uint64_t trace_whatif_window_bytes_max = 16u << 20;
  uint64_t trace_whatif_interval_ms = 30000;  // recompute at most this often

  // [engram]
  EngramServeOptions engram;

  // [cluster] (cache_daemon/cluster_config.h, docs/CLUSTER.md)
  ClusterServeOptions cluster;

  // The file this came from ("" when none); SIGHUP re-reads its [policy] table.
  std::string config_path;
};

// Defaults, then the file (when path is not empty). InvalidArgument names the bad key.
// Unknown keys are errors, so a typo never silently changes nothing.
StatusOr<DaemonOptions> LoadConfig(const std::string& path);
StatusOr<DaemonOptions> ParseConfig(std::string_view toml_text);
// "section.key" of every key ParseConfig reads outside [policy] and [cluster], sorted (the
// shipped example's completeness is a test).
std::vector<std::string> ConfigKeyNames();

// Reads only the [policy] table of a config text (used on SIGHUP).
struct PolicySettings {
  std::string eviction, admission;
  policies::PolicyParams params;
};
StatusOr<PolicySettings> ParsePolicySettings(std::string_view toml_text);

// Fills derived defaults (data dir, socket, secret path, storage.data_dir, per-front listen
// addresses, engram listen host/port) and checks ranges and the security rules
// (PermissionDenied, naming the front, its address and the keys that fix it):
//   - with auth off, every enabled TCP front and engram.listen must be on a loopback address;
//   - every enabled TCP front on a non-loopback address must use TLS ([tls] <front> = true).
// InvalidArgument for an address that is not a numeric IPv4/IPv6 address or "localhost", or
// a TLS front without tls.cert_file / tls.key_file.
Status Finalize(DaemonOptions* options);
// The TCP-front part of Finalize (called by it): per-front addresses and [tls].
Status FinalizeFronts(DaemonOptions* options);
// The [engram] part of Finalize (called by it): InvalidArgument naming the key, or
// PermissionDenied for a non-loopback engram.listen with auth off.
Status FinalizeEngram(DaemonOptions* options);

}  // namespace kvtier::daemon
