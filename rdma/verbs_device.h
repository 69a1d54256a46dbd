// libibverbs device access for the verbs transport. Built only with KVTIER_WITH_RDMA.
//
// What: device discovery; a VerbsZone per trust zone (one protection domain, one completion
// queue with a completion channel); memory registration of a table region only
// (IBV_ACCESS_REMOTE_READ on exactly the mapped rows, never a pool; the row server makes
// one such MR per grant, verbs::GrantRegistrations) and of local
// destination buffers (IBV_ACCESS_LOCAL_WRITE); RC queue pairs created in a zone's PD,
// brought RESET -> INIT -> RTR -> RTS with the peer's QpParams (path MTU and read depth
// negotiated with the peer by verbs::NegotiatePath, a GRH with the peer's GID when routing
// by GID, i.e. RoCE or a LID-less end), posting of the
// RDMA READ chains that verbs_plan.h plans, and the CQ / async-event primitives the
// VerbsTransport completion thread and the row server use.
//
// STATUS: compiled and linked wherever libibverbs is found; NEVER RUN ON HARDWARE. The
// machine this was written on has no RDMA device, so every path below ibv_open_device has
// only been compiled; tests/rdma/verbs_transport_test.cc exercises it against a real device
// and skips itself (GTEST_SKIP) where ibv_get_device_list is empty.
//
// Errors: Unavailable when there is no device; NotFound for an unknown device name;
// IOError (naming the verbs call and errno) when a verbs call fails. RDMA keys never
// appear in a Status message or a log line.
//
// Ownership: a VerbsQp keeps its zone's PD/CQ alive (shared). Memory registered through a
// zone stays registered until Deregister() or the zone's last user goes away; the caller
// keeps the memory alive that long.
//
// Thread safety: libibverbs calls are thread-safe; a VerbsZone's registration table is
// guarded internally, so all VerbsZone methods may be called from any thread. A VerbsQp is
// not thread-safe (its owner serialises posting and state changes).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "rdma/verbs_plan.h"

struct ibv_context;
struct ibv_cq;
struct ibv_comp_channel;
struct ibv_qp;

namespace kvtier::rdma::verbs {

// Names of the RDMA devices present (ibv_get_device_list); empty without hardware.
std::vector<std::string> ListDevices();

class VerbsQp;

// Which end of the one-sided read a queue pair is.
enum class QpRole : uint8_t {
  kReader,    // client: posts RDMA READs, grants no remote access
  kResponder  // server: remote read access to MRs of its PD, posts nothing
};

// One trust zone on one device: a protection domain and a CQ with a completion channel.
// Memory registered here is reachable only through QPs of this zone.
class VerbsZone {
 public:
  // Opens `options.device` ("" = the first) and allocates the PD and CQ (cq_depth).
  // Unavailable when there is no device; IOError when a verbs call fails.
  static StatusOr<std::shared_ptr<VerbsZone>> Open(const VerbsOptions& options);
  ~VerbsZone();
  VerbsZone(const VerbsZone&) = delete;
  VerbsZone& operator=(const VerbsZone&) = delete;

  // Registers [data, data + size_bytes) for remote reads (a served table region). Returns
  // the RemoteRegion a peer needs (address, rkey, length). The rkey is a secret: never log.
  StatusOr<RemoteRegion> RegisterRemoteReadable(const uint8_t* data, size_t size_bytes);
  // Deregisters the remote-readable MR with `rkey`: from then on no queue pair of this zone
  // can read through that key (reads in flight on it fail with a remote access error).
  // NotFound if there is none.
  Status DeregisterRemote(uint32_t rkey);
  // Registers a local destination buffer; returns its lkey.
  StatusOr<uint32_t> RegisterLocalWritable(uint8_t* data, size_t size_bytes);
  // Deregisters the local-buffer MR that starts at `data`. NotFound if none.
  Status Deregister(const void* data);

  // Creates an RC QP (send_queue_depth WRs) in this zone's PD on its CQ and moves it to
  // INIT. Its LocalParams() go to the peer over the side channel.
  StatusOr<std::unique_ptr<VerbsQp>> CreateQp(uint32_t send_queue_depth, QpRole role);

  // Completion primitives (for one consumer thread).
  ibv_cq* cq() const;
  ibv_comp_channel* channel() const;
  ibv_context* context() const;
  // The fd that becomes readable when the channel has an event; set non-blocking.
  int completion_fd() const;
  // The device's async event fd (QP fatal errors), set non-blocking.
  int async_fd() const;

  struct Impl;

 private:
  explicit VerbsZone(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
  friend class VerbsQp;
};

// One RC queue pair of a zone.
class VerbsQp {
 public:
  ~VerbsQp();  // ibv_destroy_qp
  VerbsQp(const VerbsQp&) = delete;
  VerbsQp& operator=(const VerbsQp&) = delete;

  // This end's parameters for the side channel (QPN, PSN, LID, GID).
  const QpParams& LocalParams() const { return local_; }
  uint32_t qpn() const { return local_.qpn; }
  // INIT -> RTR -> RTS towards `peer`. IOError naming the transition on failure.
  Status ConnectTo(const QpParams& peer);
  // Posts one chain (linked WRs, one SGE each) of RDMA READs. IOError when ibv_post_send
  // fails (the QP is then unusable).
  Status PostReadChain(std::span<const PlannedRead> chain);
  // Moves the QP to IBV_QPS_ERR (flushes every posted WR with an error completion). Used by
  // tests to force a queue-pair error.
  Status ForceError();

 private:
  friend class VerbsZone;
  VerbsQp() = default;
  std::shared_ptr<VerbsZone::Impl> zone_;
  ibv_qp* qp_ = nullptr;
  QpRole role_ = QpRole::kReader;
  QpParams local_;
};

// Human-readable name of an ibv_wc_status value (ibv_wc_status_str).
const char* WcStatusName(int wc_status);

}  // namespace kvtier::rdma::verbs
