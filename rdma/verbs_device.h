// libibverbs device access for the verbs transport. Built only with KVTIER_WITH_RDMA.
//
// STATUS: this is the part of the VerbsTransport that is built and exercised so far: device
// discovery, one protection domain per trust zone, memory registration of a table region
// only (IBV_ACCESS_REMOTE_READ on exactly the mapped rows, never a pool), a completion
// queue with a completion channel and an RC queue pair brought to INIT. The data path
// (RTR/RTS with the peer's QpParams from the TCP side channel, posting the WR chains that
// verbs_plan.h plans, polling then waiting on the channel, teardown on IBV_WC errors) is
// NOT built yet: the row server does not answer the side-channel exchange, so no
// VerbsTransport implements Transport today. All row reads use TcpTransport.
//
// Thread safety: a VerbsZone is not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "rdma/verbs_plan.h"

namespace kvtier::rdma::verbs {

// Names of the RDMA devices present (ibv_get_device_list); empty without hardware.
std::vector<std::string> ListDevices();

// One trust zone on one device: a protection domain, a CQ with a completion channel and
// one RC queue pair. Memory registered here is reachable only through this zone's QPs.
class VerbsZone {
 public:
  // Opens `device` ("" = the first), allocates the PD, CQ (cq_depth entries) and an RC QP
  // (send_queue_depth WRs) and moves the QP to INIT on `port`. Unavailable when there is
  // no device; IOError when a verbs call fails.
  static StatusOr<std::unique_ptr<VerbsZone>> Open(const std::string& device, uint8_t port,
                                                   uint32_t cq_depth, uint32_t send_queue_depth);
  ~VerbsZone();
  VerbsZone(const VerbsZone&) = delete;
  VerbsZone& operator=(const VerbsZone&) = delete;

  // Registers [data, data + size_bytes) for remote reads (a served table region). Returns
  // the RemoteRegion a peer needs (address, rkey, length). The rkey is a secret: never log.
  StatusOr<RemoteRegion> RegisterRemoteReadable(const uint8_t* data, size_t size_bytes);
  // Registers a local destination buffer; returns its lkey.
  StatusOr<uint32_t> RegisterLocalWritable(uint8_t* data, size_t size_bytes);
  // This end's QP parameters for the side channel (QPN, PSN, LID, GID).
  QpParams LocalParams() const;

  struct Impl;

 private:
  explicit VerbsZone(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::rdma::verbs
