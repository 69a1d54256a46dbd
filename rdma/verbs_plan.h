// Hardware-free bookkeeping of the verbs transport (VerbsTransport, verbs_transport.h).
//
// Everything here is plain data and logic, always built and unit-tested without an RDMA
// device: the remote address/key table, the local memory-registration key table, the
// splitting of a read batch into RDMA READ work-request chains under the send-queue limit,
// the queue-pair connection state machine, the side-channel message codecs and the
// in-flight tracker that fails every outstanding batch when a queue pair errors.
//
// RDMA keys (rkey/lkey) are secrets of the peer relationship: nothing here logs them, and
// Status messages never contain them.
//
// Thread safety: none of these classes is thread-safe; VerbsTransport guards them.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "rdma/transport.h"

namespace kvtier::rdma::verbs {

// ---- options ----------------------------------------------------------------------------

// Device-level knobs of VerbsTransport (and of the row server's verbs side). Plain data so
// that the factory (transport_factory.h) can take it whether or not verbs are built.
struct VerbsOptions {
  std::string device;  // "" = the first device ibv_get_device_list reports
  uint8_t port = 1;    // HCA port (1..255)
  // GID table index of this end (< the port's GID table length, checked when a queue pair
  // is created); the GID there must be set when routing by GID (RoCE, or a peer without a
  // LID). Local only: each end names its own source GID, the peer's GID travels in
  // VERBS_CONNECT.
  uint8_t gid_index = 0;
  // WRs per QP (max_send_wr); bounds WRs in flight (a Submit() that would overflow it is
  // Rejected). VerbsTransport needs it >= TransportOptions::batch_ops_max.
  uint32_t send_queue_depth = 1024;
  uint32_t cq_depth = 1024;    // completion queue entries (>= send_queue_depth)
  uint32_t poll_spin_us = 50;  // busy-poll the CQ this long before sleeping on it
  // RDMA READs outstanding per QP, 1..255: the requester's max_rd_atomic / the responder's
  // max_dest_rd_atomic. Clamped to the device, then to the peer's (NegotiatePath).
  uint32_t rd_atomic_max = 16;
  // Largest path MTU this end uses: 256, 512, 1024, 2048 or 4096. Clamped to the port's
  // active MTU, then to the peer's (NegotiatePath).
  uint32_t path_mtu_max_bytes = 4096;
};

// InvalidArgument naming the field when an option is outside its range (above).
Status ValidateVerbsOptions(const VerbsOptions& options);

// Path MTU codes as libibverbs numbers them (enum ibv_mtu): 1 = 256 B ... 5 = 4096 B.
inline constexpr uint8_t kMtuCodeMin = 1, kMtuCodeMax = 5;
// The code of `bytes` (a power of two in 256..4096), or 0 for anything else.
uint8_t MtuCode(uint32_t bytes);
// Bytes of a valid code (256..4096), 0 for anything else.
uint32_t MtuBytes(uint8_t code);

// Link layers as libibverbs numbers them (IBV_LINK_LAYER_*).
inline constexpr uint8_t kLinkLayerUnspecified = 0, kLinkLayerInfiniBand = 1,
                         kLinkLayerEthernet = 2;

// ---- address and key tables -------------------------------------------------------------

// A remote region as the server registered it: ibv_mr of the table's mapping.
struct RemoteRegion {
  uint64_t addr = 0;  // remote virtual address of offset 0
  uint32_t rkey = 0;
  uint64_t length_bytes = 0;
};

class RemoteRegionTable {
 public:
  // InvalidArgument for a duplicate id or an empty region.
  Status Add(RegionId id, const RemoteRegion& region);
  // Remote address and rkey of [offset, offset + length) of `id`. NotFound for an unknown
  // region, InvalidArgument when the range leaves the region.
  Status Translate(RegionId id, uint64_t offset, uint32_t length, uint64_t* addr,
                   uint32_t* rkey) const;
  void Clear() { regions_.clear(); }
  size_t size() const { return regions_.size(); }

 private:
  std::map<RegionId, RemoteRegion> regions_;
};

// Registered local buffers (ibv_mr with IBV_ACCESS_LOCAL_WRITE) by address range.
class LocalKeyTable {
 public:
  // InvalidArgument for an empty range or one overlapping a registered buffer.
  Status Add(LocalBufferId id, uintptr_t start, size_t length_bytes, uint32_t lkey);
  Status Remove(LocalBufferId id);  // NotFound if absent
  // The lkey of the buffer that holds [p, p + length) entirely; InvalidArgument otherwise.
  StatusOr<uint32_t> Lookup(const uint8_t* p, size_t length) const;
  size_t size() const { return by_start_.size(); }

 private:
  struct Entry {
    size_t length_bytes;
    uint32_t lkey;
    LocalBufferId id;
  };
  std::map<uintptr_t, Entry> by_start_;
};

// ---- batching into work-request chains --------------------------------------------------

// One RDMA READ work request, ready for ibv_post_send.
struct PlannedRead {
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t length_bytes = 0;
  uint64_t wr_id = 0;     // MakeWrId(batch_seq, chain index) on every WR of a chain
  bool signaled = false;  // only the last WR of a chain asks for a completion
};

// wr_id layout: batch sequence in the high 48 bits, chain index in the low 16.
inline constexpr uint32_t kChainsPerBatchMax = 1u << 16;
inline uint64_t MakeWrId(uint64_t batch_seq, uint32_t chain) { return (batch_seq << 16) | chain; }
inline uint64_t WrIdBatch(uint64_t wr_id) { return wr_id >> 16; }

// Splits `ops` into chains of at most `wrs_per_chain_max` WRs (the QP's max_send_wr).
// Adjacent ops reading adjacent remote bytes into adjacent local bytes of one buffer are
// merged into one WR (up to `read_bytes_max`). InvalidArgument when an op fails Translate or
// Lookup or the batch needs more than kChainsPerBatchMax chains.
Status PlanReadChains(std::span<const ReadOp> ops, const RemoteRegionTable& remote,
                      const LocalKeyTable& local, uint32_t wrs_per_chain_max,
                      uint32_t read_bytes_max, uint64_t batch_seq,
                      std::vector<std::vector<PlannedRead>>* chains);

// ---- connection state machine -----------------------------------------------------------

enum class QpState : uint8_t {
  kDisconnected,  // no queue pair
  kExchanging,    // QP created (RESET->INIT), parameters being exchanged on the side channel
  kReadyToReceive,
  kReadyToSend,  // the only state in which work requests are posted
  kError,        // a completion failed or the QP went to IBV_QPS_ERR: tear down
  kClosed,       // terminal
};

enum class QpEvent : uint8_t {
  kConnect,     // kDisconnected -> kExchanging
  kPeerParams,  // kExchanging -> kReadyToReceive (modify to RTR done)
  kReady,       // kReadyToReceive -> kReadyToSend (modify to RTS done)
  kFailure,     // any live state -> kError (completion error, async event, exchange error)
  kTornDown,    // kError/kExchanging/kReadyToReceive -> kDisconnected (QP destroyed)
  kClose,       // any -> kClosed
};

const char* QpStateName(QpState s);

class QpStateMachine {
 public:
  // Applies `e`; InvalidArgument (state unchanged) for a transition the table forbids.
  Status Apply(QpEvent e);
  QpState state() const { return state_; }
  bool CanPost() const { return state_ == QpState::kReadyToSend; }
  // Connections made so far (kReady transitions).
  uint64_t connects() const { return connects_; }

 private:
  QpState state_ = QpState::kDisconnected;
  uint64_t connects_ = 0;
};

// ---- side-channel messages (carried inside the TCP row protocol) -------------------------

// One end's queue-pair parameters (the VERBS_CONNECT body, docs/format/wire.md). The GID
// is used for RoCE (and IB with a GRH).
struct QpParams {
  uint32_t qpn = 0;
  uint32_t psn = 0;  // initial packet sequence number, 24 bits
  uint16_t lid = 0;
  uint8_t port = 1;
  uint8_t gid_index = 0;
  std::array<uint8_t, 16> gid{};
  // Version 2: what this end can do (LocalPathCaps), for NegotiatePath. A decoded
  // version-1 body leaves path_mtu and rd_atomic 0 ("not said") and link_layer unspecified.
  uint8_t version = 2;
  uint8_t path_mtu = kMtuCodeMin;  // MtuCode: min(port active MTU, path_mtu_max_bytes)
  uint8_t rd_atomic = 1;           // 1..255: reads this end can keep outstanding / accept
  uint8_t link_layer = kLinkLayerInfiniBand;
};
inline constexpr size_t kQpParamsBytes = wire::kQpParamsBytes;      // version 2
inline constexpr size_t kQpParamsV1Bytes = wire::kQpParamsV1Bytes;  // version 1
// Writes `p` in its version's layout (40 bytes for version 2, 28 for version 1); returns the
// bytes written.
size_t EncodeQpParams(const QpParams& p, uint8_t out[kQpParamsBytes]);
// Decodes a 40-byte (version 2) or 28-byte (version 1) body. Corruption on any other size,
// qpn 0 or >= 2^24, psn >= 2^24, and in version 2 an unknown version byte, a path MTU code
// outside 1..5, rd_atomic 0, an unknown link layer or non-zero reserved bytes.
Status DecodeQpParams(std::span<const uint8_t> in, QpParams* out);

// ---- path negotiation (the attributes of INIT -> RTR -> RTS) --------------------------

// What the device reports for one port, as plain data (ibv_query_device/ibv_query_port).
struct DeviceCaps {
  uint8_t active_mtu = 0;            // MtuCode of the port's active MTU
  uint32_t max_qp_rd_atom = 0;       // reads one QP accepts as the responder
  uint32_t max_qp_init_rd_atom = 0;  // reads one QP keeps outstanding as the requester
  uint8_t link_layer = kLinkLayerUnspecified;
  uint32_t gid_table_len = 0;
  uint16_t lid = 0;
};

// Fills `local`'s capabilities (version 2, path_mtu, rd_atomic, link_layer, lid, port,
// gid_index) from the device and the options: path_mtu = min(active MTU, path_mtu_max),
// rd_atomic = min(rd_atomic_max, the device's depth for the role). InvalidArgument for bad
// options or a gid_index outside the port's GID table; Unavailable when the device has no
// usable MTU or read depth.
Status LocalPathCaps(const VerbsOptions& options, const DeviceCaps& caps, bool responder,
                     QpParams* local);

// The attributes one queue pair is brought to RTR/RTS with.
struct PathAttributes {
  uint8_t path_mtu = 0;   // MtuCode
  uint8_t rd_atomic = 0;  // requester max_rd_atomic == responder max_dest_rd_atomic
  bool use_grh = false;   // route by GID (RoCE, or a LID-less end): peer GID, local gid_index
};

// Both ends call this with (their own params, the peer's) and get the same answer: the
// smaller path MTU and the smaller read depth of the two, so that no response is larger
// than the requester's MTU and no requester keeps more reads outstanding than the responder
// accepts. A version-1 peer said nothing: the local values stand (the version-1 behaviour).
// InvalidArgument when the link layers differ, when routing by GID and either GID is zero,
// or when `local` itself is not a valid version-2 description.
StatusOr<PathAttributes> NegotiatePath(const QpParams& local, const QpParams& peer);
inline constexpr size_t kRemoteRegionBytes = wire::kRemoteRegionBytes;
// The VERBS_REGION reply's data: u64 addr, u32 rkey, u32 reserved (0), u64 length_bytes.
void EncodeRemoteRegion(const RemoteRegion& r, uint8_t out[kRemoteRegionBytes]);
// Corruption (and `out` untouched) on any other size, a non-zero reserved field or an empty
// region.
Status DecodeRemoteRegion(std::span<const uint8_t> in, RemoteRegion* out);

// ---- one memory registration per grant ---------------------------------------------------

// The row server's registrations of table rows, one per grant (not one per tenant and
// table). One-sided reads never reach the server, so the only way to end a grant's access
// is to make its rkey invalid: deregistering the grant's MR (ibv_dereg_mr) invalidates that
// rkey on every queue pair of the protection domain at once, including queue pairs of the
// same tenant that never opened the region but learned its address and rkey. Another grant
// of the same tenant and table has its own MR and rkey and is not affected.
//
// Cost: one ibv_reg_mr per live grant that was used over verbs (pinning is shared, but each
// MR has its own translation entries on the HCA: about 8 bytes per 4 KiB page of the table,
// so a 1 GiB table costs ~2 MiB of MTT per grant, and registering it takes milliseconds);
// bounded by registrations_max. A type-2 memory window per grant would be cheaper to
// create and invalidate but is bound to one queue pair and needs device support; MRs work
// everywhere.
//
// This class is the bookkeeping only; `deregister` does the verbs call (a fake in tests).
class GrantRegistrations {
 public:
  // Called with the tenant (its protection domain) and the registration to drop.
  using Deregister = std::function<void(const std::string& tenant, const RemoteRegion&)>;
  struct Entry {
    std::string tenant;
    uint32_t table_id = 0;
    uint64_t expiry_us = 0;
    RemoteRegion region;
  };

  GrantRegistrations(uint32_t registrations_max, Deregister deregister)
      : registrations_max_(registrations_max), deregister_(std::move(deregister)) {}
  // Does not deregister: the protection domains' owner drops their MRs with them.
  ~GrantRegistrations() = default;

  // The registration of grant `token`, or nullptr.
  const Entry* Find(const wire::GrantToken& token) const;
  // Records `entry`, registered for grant `token`. InvalidArgument when the token already
  // has one; Rejected at registrations_max (the caller deregisters what it registered).
  Status Add(const wire::GrantToken& token, Entry entry);
  // The grant was revoked: deregisters its registration. False when it had none.
  bool Revoke(const wire::GrantToken& token);
  // Deregisters every registration whose grant expired at or before now_us (a grant is
  // valid while now < expiry). Returns how many.
  size_t ExpireUntil(uint64_t now_us);
  size_t size() const { return entries_.size(); }

 private:
  uint32_t registrations_max_;
  Deregister deregister_;
  std::map<wire::GrantToken, Entry> entries_;
};

// ---- in-flight tracking -----------------------------------------------------------------

// Batches posted and not completed. Bounded by work requests (the send queue depth).
class InflightTracker {
 public:
  explicit InflightTracker(uint32_t wrs_max) : wrs_max_(wrs_max) {}
  // Rejected when `wrs` more would exceed wrs_max.
  Status Add(uint64_t batch_seq, uint32_t chains, uint32_t wrs, uint32_t ops, ReadCallback done);
  // A signaled completion of one chain of `wr_id`'s batch. Returns the batch's callback
  // (to be called with `status`) when this ends the batch: its last chain, or the first
  // failure (later completions of a failed batch are ignored). Unknown wr_ids return null.
  ReadCallback OnCompletion(uint64_t wr_id, const Status& status);
  // Removes every batch and returns their callbacks (the caller fails them).
  std::vector<ReadCallback> TakeAll();
  uint32_t wrs_in_flight() const { return wrs_in_flight_; }
  uint64_t ops_in_flight() const { return ops_in_flight_; }
  size_t batches() const { return batches_.size(); }

 private:
  struct Batch {
    uint32_t chains_left;
    uint32_t wrs;
    uint32_t ops;
    ReadCallback done;
  };
  uint32_t wrs_max_;
  uint32_t wrs_in_flight_ = 0;
  uint64_t ops_in_flight_ = 0;
  std::map<uint64_t, Batch> batches_;
};

}  // namespace kvtier::rdma::verbs
