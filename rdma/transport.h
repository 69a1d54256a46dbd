// Transport: one-sided reads of registered remote memory (the Engram row data path).
//
// A Transport connects one client to one remote row server. The server exposes read-only
// *regions* (memory-mapped Engram tables); the client attaches to a region with a grant
// (OpenRegion) and then reads (region, offset, length) ranges into *local registered
// buffers*, in batches, asynchronously. Two implementations share these semantics:
//
//   TcpTransport   (rdma/tcp_transport.h)   Boost.Asio, a framed protocol; always built.
//   VerbsTransport (rdma/verbs_transport.h) libibverbs RC queue pairs, RDMA READ; built when
//                                           KVTIER_WITH_RDMA is defined.
//
// Semantics every implementation keeps:
//   - A batch completes exactly once: its callback runs with OK (every op's bytes are in
//     place) or with the first error; on error the destination bytes are unspecified.
//   - Reads in flight are bounded (TransportOptions::reads_in_flight_max, counted in ops).
//     Submit() over the bound returns Rejected at once and the callback is never called.
//   - When the connection drops, every batch in flight completes with IOError (never hangs:
//     a request_timeout_ms also fails a silent peer) and the transport is disconnected. The
//     next Submit()/Reconnect() reconnects and re-attaches every open region (the server may
//     have restarted; client RegionIds stay stable across reconnects).
//   - Grants: a read of a region whose grant is missing, revoked or expired completes with
//     PermissionDenied. Grant tokens and RDMA keys are secrets: never logged.
//
// Ownership: the caller owns every registered buffer and must keep it alive (and not
// unregister it) until all batches that write into it have completed. The Transport does
// not retain `ops` after Submit() returns.
//
// Thread safety: all methods are thread-safe. Callbacks run on the transport's internal
// I/O thread, or on a thread inside Poll() (TCP: one at a time, in completion order); they
// must not block for long and must not call Close() or Poll() (they may Submit()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "common/status.h"
#include "rdma/wire.h"

namespace kvtier::rdma {

// A client-side handle of an opened remote region; stable across reconnects.
using RegionId = uint32_t;
// A client-side handle of a registered local buffer.
using LocalBufferId = uint32_t;

// What a client presents to open a region: the region's name on the server, the tenant the
// grant was issued to, and the grant's secret token (RowServer::IssueGrant).
struct RegionCredentials {
  std::string region_name;
  std::string tenant;
  wire::GrantToken token{};
};

// What the server reports about an opened region (an Engram table shard).
struct RegionInfo {
  RegionId id = 0;
  uint64_t size_bytes = 0;        // readable bytes: offsets in [0, size_bytes)
  uint32_t row_stride_bytes = 0;  // bytes per row (codes + scales + padding)
  uint32_t row_dim = 0;           // elements per row
  uint64_t row_begin = 0;         // global row number of offset 0
  uint64_t row_count = 0;
};

// One read: `length_bytes` at `offset_bytes` of `region` into `dest`, which must lie
// entirely inside one buffer registered with RegisterLocalBuffer().
struct ReadOp {
  RegionId region = 0;
  uint64_t offset_bytes = 0;
  uint32_t length_bytes = 0;
  uint8_t* dest = nullptr;
};

// Called once per batch with OK or the first error.
using ReadCallback = std::function<void(const Status&)>;

struct TransportOptions {
  // Ops submitted and not yet completed, across batches. Over it Submit() returns Rejected.
  uint32_t reads_in_flight_max = 4096;
  // Ops per batch; a longer Submit() is InvalidArgument (split it; RowFetcher does).
  uint32_t batch_ops_max = 1024;
  // Bytes of one op (never more than wire::kReadBytesMax).
  uint32_t read_bytes_max = 64 << 10;
  // A batch not answered within this fails with IOError and the connection is dropped.
  uint32_t request_timeout_ms = 5000;
  // Connecting (TCP, or the verbs side channel) gives up after this with IOError.
  uint32_t connect_timeout_ms = 2000;
  // Submit() on a disconnected transport reconnects first (else it returns IOError).
  bool reconnect_on_submit = true;
};

// Counters of one transport; monotonic except reads_in_flight.
struct TransportCounters {
  uint64_t batches_submitted = 0;
  uint64_t batches_failed = 0;
  uint64_t ops_submitted = 0;
  uint64_t bytes_read = 0;
  uint64_t reads_in_flight = 0;      // ops, current value
  uint64_t connects = 0;             // successful (re)connects
  uint64_t disconnects = 0;          // connections lost or closed with reads in flight or not
  uint64_t batches_sent_inline = 0;  // batches whose frame Submit()'s caller wrote itself (TCP)
  uint64_t sends = 0;                // write calls on the connection (TCP: sendmsg / writes)
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Connects if not connected (re-attaching open regions). OK if already connected.
  // IOError when the server cannot be reached within connect_timeout_ms.
  virtual Status Connect() = 0;

  // Drops the current connection (batches in flight fail with IOError) and connects again.
  virtual Status Reconnect() = 0;

  // Attaches a region. Connects first if needed. PermissionDenied for a missing, expired or
  // mismatched grant; NotFound when the server has no such region.
  virtual StatusOr<RegionInfo> OpenRegion(const RegionCredentials& credentials) = 0;

  // Registers [data, data + size_bytes) as a read destination (verbs: an ibv_mr with local
  // write access). InvalidArgument for null or empty ranges.
  virtual StatusOr<LocalBufferId> RegisterLocalBuffer(uint8_t* data, size_t size_bytes) = 0;
  virtual Status UnregisterLocalBuffer(LocalBufferId id) = 0;

  // Submits a batch of reads. Returns a non-OK status (and never calls `done`) when the
  // batch is rejected up front: InvalidArgument (empty, too long, unknown region, range
  // outside the region or outside registered memory), Rejected (reads in flight bound),
  // IOError/Unavailable (not connected and reconnecting failed or is disabled).
  // Otherwise returns OK and calls `done` exactly once, later, on the I/O thread.
  virtual Status Submit(std::span<const ReadOp> ops, ReadCallback done) = 0;

  // Completes, on the calling thread, batches whose replies have already arrived: their
  // callbacks run here (under no transport lock) instead of on the I/O thread. Never waits for
  // the network; returns how many batches it completed (0 also when another thread is reading
  // them just now: that thread completes them). A waiter that spins on Poll() for a moment
  // before blocking saves two thread wake-ups per batch (the I/O thread's and its own), tens of
  // microseconds each on a loaded or virtualised host (RowFetcher::Wait does). The default
  // completes nothing: the implementation's own thread does it all (verbs may poll its
  // completion queue here).
  virtual uint32_t Poll() { return 0; }

  // Between HoldWrites() and ReleaseWrites() (counted: pairs may nest, also from several
  // callers) Submit() queues its request instead of sending it; the outermost ReleaseWrites()
  // sends everything queued at once (TCP: one sendmsg for several batches, e.g. both Engram
  // layers' rows of a step). Meanwhile other threads' batches wait too: hold briefly. The
  // default sends at once (verbs posts each batch's work requests as it is submitted).
  virtual void HoldWrites() {}
  virtual void ReleaseWrites() {}

  // Fails everything in flight with Unavailable and disconnects; Submit() afterwards
  // returns Unavailable. Idempotent; also done by the destructor.
  virtual void Close() = 0;

  virtual TransportCounters counters() const = 0;
  // "tcp" or "verbs" (a metrics label).
  virtual const char* name() const = 0;
};

// Submits `ops` and blocks until the batch completes (a convenience for tests, tools and
// the benchmark). Returns Submit()'s error or the batch's status.
Status ReadSync(Transport& transport, std::span<const ReadOp> ops);

}  // namespace kvtier::rdma
