// TcpTransport: the Transport (rdma/transport.h) over TCP with Boost.Asio, speaking the
// framed protocol of docs/format/wire.md ("Engram row transport (TCP)") to a RowServer.
//
// One TCP connection per transport; batches are pipelined on it and answered in order.
// Replies are received through a 16 KiB buffer (a small reply and the next one's header in one
// recv); a one-op reply's data lands in its destination, a multi-op reply's in one
// per-transport staging buffer (at most batch_ops_max * read_bytes_max), then scattered.
// Local buffer registration is bookkeeping only here (it bounds where replies may land).
//
// Thread safety: as Transport. The transport owns one I/O thread. Submit() from a callback
// (on that thread) never reconnects: on a disconnected transport it returns IOError.
//
// Latency: Submit() writes its frame on the calling thread (one non-blocking sendmsg) when the
// I/O thread is not writing, and hands the frame to the I/O thread only when the socket is full
// or earlier frames are still queued (their order is kept). Replies are read by the I/O thread
// when the socket becomes readable, or by a thread calling Poll(), whichever comes first (one
// reader at a time). Each saves a thread hand-off: on a loaded or virtualised host a wake-up of
// another thread costs tens of microseconds, more than the loopback round trip itself
// (docs/performance/engram-transport.md, "Round trip of one row batch").
#pragma once

#include <memory>
#include <string>

#include "rdma/transport.h"

namespace kvtier::rdma {

struct TcpEndpoint {
  std::string host;  // a numeric IPv4/IPv6 address (e.g. 127.0.0.1) or a resolvable name
  uint16_t port = 0;
};

class TcpTransport final : public Transport {
 public:
  // Does not connect (Connect(), OpenRegion() or Submit() do). InvalidArgument for limits
  // above the protocol ceilings (wire.h) or a zero port.
  static StatusOr<std::unique_ptr<TcpTransport>> Create(TcpEndpoint endpoint,
                                                        TransportOptions options);
  ~TcpTransport() override;

  Status Connect() override;
  Status Reconnect() override;
  StatusOr<RegionInfo> OpenRegion(const RegionCredentials& credentials) override;
  StatusOr<LocalBufferId> RegisterLocalBuffer(uint8_t* data, size_t size_bytes) override;
  Status UnregisterLocalBuffer(LocalBufferId id) override;
  Status Submit(std::span<const ReadOp> ops, ReadCallback done) override;
  // Reads and completes the replies already in the socket on the calling thread (never blocks).
  uint32_t Poll() override;
  void HoldWrites() override;
  void ReleaseWrites() override;
  // Test hook: while paused the I/O thread reads no replies (only Poll() callers do);
  // unpausing reads what arrived meanwhile.
  void TEST_PauseIoReads(bool paused);
  // Test hook: bytes received on the connection and not yet read (FIONREAD; 0 if none).
  size_t TEST_ReadableBytes();
  void Close() override;
  TransportCounters counters() const override;
  const char* name() const override { return "tcp"; }

  struct Impl;

 private:
  explicit TcpTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::rdma
