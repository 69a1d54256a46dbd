// VerbsTransport: the Transport (rdma/transport.h) over libibverbs RC queue pairs with
// one-sided RDMA READs. Built only with KVTIER_WITH_RDMA.
//
// STATUS: compiled, linked and reviewed, but NEVER RUN ON AN RDMA DEVICE: the machine it was
// written on has none (ibv_get_device_list is empty). tests/rdma/verbs_transport_test.cc
// runs it against a RowServer on 127.0.0.1 where a device exists and skips itself otherwise.
// Treat it as untested until that test has passed on hardware (e.g. rdma_rxe soft-RoCE).
//
// How it works:
//   - Control: a TCP side channel to the RowServer (the row protocol, docs/format/wire.md)
//     carries kOpen, kVerbsConnect (QpParams both ways) and kVerbsRegion (the table rows'
//     address/rkey/length). It stays open for the queue pair's life: the server destroys its
//     end when the channel closes or a grant behind it lapses.
//   - Data: Submit() plans the batch (verbs::PlanReadChains: merged adjacent reads, chains
//     of at most send_queue_depth WRs, only the last WR of a chain signaled), bounds it
//     (reads_in_flight_max ops; send-queue WRs via verbs::InflightTracker) and posts it.
//   - Completions: one thread polls the CQ for poll_spin_us, then arms it and sleeps on the
//     completion channel (plus the async-event fd and a wakeup eventfd for Close()).
//   - Errors: a failed work completion, a fatal async QP event, a lost side channel, or a
//     batch older than request_timeout_ms puts the QP in kError; every batch in flight fails
//     with IOError naming the ibv_wc_status_str (never a key); the QP is destroyed and the
//     transport is disconnected. The next Submit() reconnects (reconnect_on_submit) with a
//     new QP and re-opens every region; RegionIds stay stable.
//   - Path: VERBS_CONNECT version 2 carries each end's path MTU, read depth and link
//     layer; both ends use the smaller MTU and depth (verbs::NegotiatePath).
//   - Reconnect: Submit() waits (or, from a callback, fails with IOError) until every open
//     region is re-attached; a Retry reply while re-attaching starts the connection over.
//   - Grants: all regions of one VerbsTransport must belong to one tenant (its trust zone,
//     one PD on the server); OpenRegion of another tenant is InvalidArgument. Because reads
//     are one-sided, an expired or revoked grant shows up as the server deregistering the
//     grant's MR (its rkey fails on every queue pair: a remote access error) and cutting the
//     queue pair: the batches in flight fail with IOError and the re-open on reconnect fails
//     with PermissionDenied, which later Submit()s of that region return (TcpTransport
//     reports PermissionDenied on the next batch itself).
//
// Thread safety: as Transport. Callbacks run on the completion thread; Submit() from a
// callback never reconnects (IOError when disconnected).
#pragma once

#include <memory>

#include "rdma/tcp_transport.h"
#include "rdma/transport.h"
#include "rdma/verbs_plan.h"

namespace kvtier::rdma {

class VerbsTransport final : public Transport {
 public:
  // Opens the local device (one PD and CQ for this transport's lifetime) and starts the
  // completion thread; does not connect. Unavailable without a device; InvalidArgument for
  // limits above the protocol ceilings or cq_depth < send_queue_depth.
  static StatusOr<std::unique_ptr<VerbsTransport>> Create(TcpEndpoint side_channel,
                                                          TransportOptions options,
                                                          verbs::VerbsOptions verbs_options);
  ~VerbsTransport() override;

  // Connects the side channel and creates the queue pair. With no region open yet it asks
  // the server whether it serves RDMA (kVerbsConnect before any kOpen): Unavailable when it
  // does not (the caller may fall back to TCP), OK otherwise; the queue pair is then brought
  // to RTS by the first OpenRegion().
  Status Connect() override;
  Status Reconnect() override;
  StatusOr<RegionInfo> OpenRegion(const RegionCredentials& credentials) override;
  StatusOr<LocalBufferId> RegisterLocalBuffer(uint8_t* data, size_t size_bytes) override;
  Status UnregisterLocalBuffer(LocalBufferId id) override;
  Status Submit(std::span<const ReadOp> ops, ReadCallback done) override;
  void Close() override;
  TransportCounters counters() const override;
  const char* name() const override { return "verbs"; }

  verbs::QpState qp_state() const;
  // Test hook: moves the current queue pair to IBV_QPS_ERR, so that every read in flight
  // completes with a flush error. IOError when there is no queue pair.
  Status TEST_ForceQpError();

  struct Impl;

 private:
  explicit VerbsTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::rdma
