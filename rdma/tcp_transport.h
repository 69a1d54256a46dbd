// TcpTransport: the Transport (rdma/transport.h) over TCP with Boost.Asio, speaking the
// framed protocol of docs/format/wire.md ("Engram row transport (TCP)") to a RowServer.
//
// One TCP connection per transport; batches are pipelined on it and answered in order.
// A one-op reply is read straight into its destination; a multi-op reply is read into one
// per-transport staging buffer (at most batch_ops_max * read_bytes_max) and scattered.
// Local buffer registration is bookkeeping only here (it bounds where replies may land).
//
// Thread safety: as Transport. The transport owns one I/O thread. Submit() from a callback
// (on that thread) never reconnects: on a disconnected transport it returns IOError.
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
  void Close() override;
  TransportCounters counters() const override;
  const char* name() const override { return "tcp"; }

  struct Impl;

 private:
  explicit TcpTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::rdma
