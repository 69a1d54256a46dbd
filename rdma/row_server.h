// RowServer: serves Engram tables read-only to many engines over the TCP row transport
// (docs/format/wire.md, "Engram row transport (TCP)").
//
//   RowServer server(RowServerOptions{.bind_address = "127.0.0.1", .port = 0});
//   KVTIER_RETURN_IF_ERROR(server.RegisterTable("engram.l1.s0", "/data/l1.s0.engram"));
//   KVTIER_ASSIGN_OR_RETURN(auto token, server.IssueGrant("engram.l1.s0", "tenant-a", 60000));
//   KVTIER_RETURN_IF_ERROR(server.Start());          // its own I/O thread
//   ... clients OpenRegion({"engram.l1.s0", "tenant-a", token}) and read rows ...
//   server.Stop();
//
// Regions are table files memory-mapped read-only (rdma/engram_table.h), or caller memory
// (RegisterMemory: the cluster's staging ring, cluster/staging_server.h); a read batch's
// rows are copied from the mapping into one per-connection reply buffer (at most
// response_bytes_max, kept for the connection's life) and written with one write. A *grant* is
// (region, tenant, expiry) named by a random 128-bit token; a connection attaches a region by
// presenting name, tenant and token (kOpen), and every read batch re-checks that the grant still
// exists and has not expired (by options.clock). Reads without a valid grant fail with
// PermissionDenied; reads naming a region not opened on the connection get Retry (the
// client's ids are another connection's); the connection stays up. A malformed frame (bad
// magic, version, type, a length over the limits) closes that connection; the server and
// other connections are unaffected. A connection that attaches no region within
// attach_timeout_ms of being accepted, or leaves a request's body unfinished for
// body_timeout_ms, is closed too. Tokens are never logged.
//
// RDMA side channel (KVTIER_WITH_RDMA and a device only): after a kOpen, kVerbsConnect
// creates an RC queue pair in the protection domain of the tenant's trust zone (one PD per
// tenant), brings it to RTS towards the client's QpParams and replies with the server's;
// kVerbsRegion registers that table's rows (never the header, never a pool) in the tenant's
// PD once per grant and replies address/rkey/length. Revoking a grant deregisters its MR at
// once and an expired grant's MR is deregistered within verbs_grant_check_ms: that
// invalidates the rkey on every queue pair, also other connections of the same tenant. The
// TCP connection is the queue pair's lease as well: when it closes, or a grant of a region
// exposed over it expires or is revoked (checked every verbs_grant_check_ms), the queue
// pair is destroyed. RDMA keys are never logged.
// This path has only been compiled, never run on an RDMA device.
//
// Embedding: Start(io_context&) runs the server on a caller's io_context (kvtierd), which
// any number of threads may run: each connection's handlers run on a strand of its own,
// the listener's on another. Start() creates and runs its own thread. Stop() closes the
// listener and every connection (clients see their reads in flight fail), each on its own
// strand, and waits for those closes (embedded: at most 2 s, the caller's threads run
// them) and, in own-thread mode, joins.
//
// Thread safety: all methods are thread-safe. Tables and grants may change while serving.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "rdma/verbs_plan.h"
#include "rdma/wire.h"

namespace boost::asio {
class io_context;
}  // namespace boost::asio

namespace kvtier::rdma {

// Upper bound on RowServerOptions::busy_poll_us.
inline constexpr uint64_t kRowServerBusyPollMaxUs = 1000000;

struct RowServerOptions {
  // Loopback by default: exposing tables is an explicit choice.
  std::string bind_address = "127.0.0.1";
  // 0 picks a free port; port() reports the bound one.
  uint16_t port = 0;
  // Connections beyond this are accepted and closed at once.
  uint32_t connections_max = 256;
  // A connection that has attached no region (no successful OPEN) this long after it was
  // accepted is closed: connection slots are for clients holding grants, and one that
  // connects and sends nothing (or half a frame) would otherwise hold its slot for ever.
  // Attached connections may stay idle indefinitely (an engine between steps). 0 = never.
  // Both deadlines are checked by one timer per connection every quarter of the shorter one,
  // so each is enforced within a quarter more than it.
  uint32_t attach_timeout_ms = 10000;
  // A request whose header has arrived must have its whole body within this long, else the
  // connection is closed (a client that announces a body and sends it slowly or never). 0 =
  // never.
  uint32_t body_timeout_ms = 10000;
  // Regions one connection may attach.
  uint32_t regions_per_connection_max = 64;
  // Ops in one read batch (at most wire::kBatchOpsMax); more is an InvalidArgument reply.
  uint32_t batch_ops_max = 1024;
  // Bytes of one op (at most wire::kReadBytesMax).
  uint32_t read_bytes_max = 1 << 20;
  // Bytes of one response (at most wire::kResponseDataBytesMax).
  uint64_t response_bytes_max = 16ull << 20;
  // Live grants; IssueGrant() first drops expired ones, then returns Rejected.
  uint32_t grants_max = 65536;
  // The longest grant IssueGrant() accepts.
  uint64_t grant_ttl_ms_max = 24ull * 3600 * 1000;
  // Time source for grant expiry; nullptr = DefaultSteadyClock(). Not owned; must outlive
  // the server.
  const Clock* clock = nullptr;
  // The verbs side channel (kVerbsConnect / kVerbsRegion, docs/format/wire.md). Served only
  // when built with KVTIER_WITH_RDMA, `verbs_enabled` is set and a device exists; otherwise
  // both frames get an Unavailable reply ("row server has no RDMA device") and the
  // connection stays up (clients fall back to TCP reads).
  bool verbs_enabled = true;
  // Device, port, GID index and queue depths of the server's zones (one PD per tenant).
  verbs::VerbsOptions verbs;
  // How often a connection with a queue pair re-checks the grants of the regions it
  // exposed over RDMA; when one has expired or was revoked, the queue pair is destroyed
  // and the connection closed (one-sided reads bypass the server, so this is what cuts
  // access).
  uint32_t verbs_grant_check_ms = 100;
  // Table-row registrations for remote reads, one per grant used over verbs (an expired or
  // revoked grant's registration is dropped: that is what invalidates its rkey on every
  // queue pair). Over it, VERBS_REGION answers Rejected.
  uint32_t verbs_registrations_max = 1024;
  // Own-thread mode (Start()) only: after handling anything the server thread keeps polling
  // its sockets without blocking for this long before it sleeps, so that a request arriving
  // within it is read at once instead of after a wake-up of the thread (tens of microseconds
  // on a loaded or virtualised host, paid also by the sender). It keeps one core busy while
  // requests come closer than this (yielding every 200 us, so that a thread of equal
  // real-time priority on its core still runs). 0 (default): block at once. At most
  // kRowServerBusyPollMaxUs.
  uint64_t busy_poll_us = 0;
  // Test hook: delay every read response by this many ms (makes reads "in flight").
  uint32_t TEST_response_delay_ms = 0;
  // Test hook: delay every OPEN reply by this many ms (a slow re-attach after a reconnect).
  uint32_t TEST_open_delay_ms = 0;
};

struct RowServerCounters {
  uint64_t connections_accepted = 0;
  uint64_t connections_active = 0;
  uint64_t connections_refused = 0;  // over connections_max
  uint64_t malformed_frames = 0;     // connections closed for a bad frame
  uint64_t batches_served = 0;
  uint64_t ops_served = 0;
  uint64_t bytes_served = 0;
  uint64_t permission_denied = 0;  // opens and batches refused for a missing/expired grant
  uint64_t verbs_unavailable = 0;  // side-channel frames answered Unavailable (no device)
  uint64_t verbs_qps_created = 0;
  uint64_t verbs_qps_cut = 0;            // queue pairs destroyed because a grant lapsed
  uint64_t verbs_registrations_cut = 0;  // grant MRs deregistered (revoked or expired)
  uint64_t unattached_closed = 0;        // closed with no region attached after attach_timeout_ms
  uint64_t bodies_timed_out = 0;         // closed with a body unfinished after body_timeout_ms
  uint64_t accept_waits = 0;  // failed accepts that paused accepting (no descriptor or memory)
};

class RowServer {
 public:
  explicit RowServer(RowServerOptions options);
  ~RowServer();  // Stop()
  RowServer(const RowServer&) = delete;
  RowServer& operator=(const RowServer&) = delete;

  // Maps the table file at `path` read-only and serves it as region `name` (1..256 bytes).
  // InvalidArgument for a duplicate or bad name; the table's own errors otherwise.
  Status RegisterTable(const std::string& name, const std::string& path);
  // Serves caller memory [bytes.data(), +bytes.size()) as region `name` (OPEN reports
  // row_stride_bytes = stride_bytes, row_count = size / stride, row_begin = row_dim = 0).
  // Exactly these bytes are readable (and, over verbs, registered), nothing around them.
  // `owner` keeps the memory alive while the server may read it. The server never writes
  // it; the caller may, while clients read it. With `guard` set, the TCP server copies each
  // read batch's bytes of this region inside guard(copy) (the caller runs copy under the
  // lock its writes take), so TCP reads never race those writes; RDMA reads bypass the
  // server and cannot be guarded, so the caller's format must detect torn or reused bytes
  // either way (cluster/staging_ring.h does). InvalidArgument for a duplicate or bad name, an
  // empty range or a size not a multiple of stride_bytes.
  using MemoryGuard = std::function<void(const std::function<void()>& copy)>;
  Status RegisterMemory(const std::string& name, std::span<const uint8_t> bytes,
                        uint32_t stride_bytes, std::shared_ptr<const void> owner,
                        MemoryGuard guard = nullptr);

  // Issues a grant on region `region_name` to `tenant`, valid for ttl_ms (1..
  // grant_ttl_ms_max). NotFound for an unknown region; Rejected at grants_max.
  StatusOr<wire::GrantToken> IssueGrant(const std::string& region_name, const std::string& tenant,
                                        uint64_t ttl_ms);
  // Installs a grant with a token issued elsewhere: by a control plane that hands the same
  // grant to several servers, or by this server before a restart (grants live in memory).
  // InvalidArgument for a token already in use or a bad ttl; NotFound for an unknown region.
  Status AddGrant(const wire::GrantToken& token, const std::string& region_name,
                  const std::string& tenant, uint64_t ttl_ms);
  // Revokes a grant at once (later batches on it are PermissionDenied). NotFound if absent.
  Status RevokeGrant(const wire::GrantToken& token);

  // Binds and serves on an own I/O thread. IOError when the address cannot be bound;
  // InvalidArgument if already started.
  Status Start();
  // Binds and serves on `io` (not owned; must outlive Stop()); the caller runs it.
  Status Start(boost::asio::io_context& io);
  // Closes the listener and all connections. Idempotent.
  void Stop();

  // The bound port (0 before Start()).
  uint16_t port() const;
  RowServerCounters counters() const;

  struct State;  // implementation detail (row_server_impl.h)

 private:
  Status StartOn(boost::asio::io_context& io);
  Status AddRegion(const std::string& name, std::shared_ptr<void> region);  // a Table
  std::shared_ptr<State> state_;
};

}  // namespace kvtier::rdma
