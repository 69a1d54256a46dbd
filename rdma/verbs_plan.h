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
  std::string device;     // "" = the first device ibv_get_device_list reports
  uint8_t port = 1;       // HCA port
  uint8_t gid_index = 0;  // GID table index; used when the port has no LID (RoCE)
  // WRs per QP (max_send_wr); bounds WRs in flight (a Submit() that would overflow it is
  // Rejected). VerbsTransport needs it >= TransportOptions::batch_ops_max.
  uint32_t send_queue_depth = 1024;
  uint32_t cq_depth = 1024;     // completion queue entries (>= send_queue_depth)
  uint32_t poll_spin_us = 50;   // busy-poll the CQ this long before sleeping on it
  uint32_t rd_atomic_max = 16;  // RDMA READs outstanding per QP (clamped to the device)
};

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

// One end's queue-pair parameters. The GID is used for RoCE (and IB with a GRH).
struct QpParams {
  uint32_t qpn = 0;
  uint32_t psn = 0;  // initial packet sequence number, 24 bits
  uint16_t lid = 0;
  uint8_t port = 1;
  uint8_t gid_index = 0;
  std::array<uint8_t, 16> gid{};
};
inline constexpr size_t kQpParamsBytes = wire::kQpParamsBytes;
void EncodeQpParams(const QpParams& p, uint8_t out[kQpParamsBytes]);
Status DecodeQpParams(std::span<const uint8_t> in, QpParams* out);  // Corruption on bad size
inline constexpr size_t kRemoteRegionBytes = wire::kRemoteRegionBytes;
void EncodeRemoteRegion(const RemoteRegion& r, uint8_t out[kRemoteRegionBytes]);
Status DecodeRemoteRegion(std::span<const uint8_t> in, RemoteRegion* out);

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
