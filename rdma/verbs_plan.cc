#include "rdma/verbs_plan.h"

#include <algorithm>
#include <cstring>

#include "common/endian.h"

namespace kvtier::rdma::verbs {

Status RemoteRegionTable::Add(RegionId id, const RemoteRegion& region) {
  if (region.length_bytes == 0) return Status::InvalidArgument("empty remote region");
  if (!regions_.emplace(id, region).second) return Status::InvalidArgument("duplicate region");
  return Status::Ok();
}

Status RemoteRegionTable::Translate(RegionId id, uint64_t offset, uint32_t length, uint64_t* addr,
                                    uint32_t* rkey) const {
  auto it = regions_.find(id);
  if (it == regions_.end()) return Status::NotFound("unknown remote region");
  const RemoteRegion& r = it->second;
  if (length == 0 || offset > r.length_bytes || r.length_bytes - offset < length) {
    return Status::InvalidArgument("read outside region");
  }
  *addr = r.addr + offset;
  *rkey = r.rkey;
  return Status::Ok();
}

Status LocalKeyTable::Add(LocalBufferId id, uintptr_t start, size_t length_bytes, uint32_t lkey) {
  if (length_bytes == 0) return Status::InvalidArgument("empty local buffer");
  auto next = by_start_.lower_bound(start);
  if ((next != by_start_.end() && next->first < start + length_bytes) ||
      (next != by_start_.begin() &&
       std::prev(next)->first + std::prev(next)->second.length_bytes > start)) {
    return Status::InvalidArgument("buffer overlaps a registered buffer");
  }
  by_start_[start] = Entry{length_bytes, lkey, id};
  return Status::Ok();
}

Status LocalKeyTable::Remove(LocalBufferId id) {
  for (auto it = by_start_.begin(); it != by_start_.end(); ++it) {
    if (it->second.id == id) {
      by_start_.erase(it);
      return Status::Ok();
    }
  }
  return Status::NotFound("no such local buffer");
}

StatusOr<uint32_t> LocalKeyTable::Lookup(const uint8_t* p, size_t length) const {
  const auto start = reinterpret_cast<uintptr_t>(p);
  auto it = by_start_.upper_bound(start);
  if (p == nullptr || it == by_start_.begin()) {
    return Status::InvalidArgument("destination outside registered buffers");
  }
  --it;
  if (start + length > it->first + it->second.length_bytes) {
    return Status::InvalidArgument("destination outside registered buffers");
  }
  return it->second.lkey;
}

Status PlanReadChains(std::span<const ReadOp> ops, const RemoteRegionTable& remote,
                      const LocalKeyTable& local, uint32_t wrs_per_chain_max,
                      uint32_t read_bytes_max, uint64_t batch_seq,
                      std::vector<std::vector<PlannedRead>>* chains) {
  chains->clear();
  if (ops.empty()) return Status::InvalidArgument("empty batch");
  if (wrs_per_chain_max == 0) return Status::InvalidArgument("wrs_per_chain_max is 0");
  std::vector<PlannedRead> wrs;
  wrs.reserve(ops.size());
  for (const ReadOp& op : ops) {
    PlannedRead w;
    KVTIER_RETURN_IF_ERROR(
        remote.Translate(op.region, op.offset_bytes, op.length_bytes, &w.remote_addr, &w.rkey));
    KVTIER_ASSIGN_OR_RETURN(w.lkey, local.Lookup(op.dest, op.length_bytes));
    w.local_addr = reinterpret_cast<uintptr_t>(op.dest);
    w.length_bytes = op.length_bytes;
    if (!wrs.empty()) {
      PlannedRead& prev = wrs.back();
      const bool adjacent = prev.rkey == w.rkey && prev.lkey == w.lkey &&
                            prev.remote_addr + prev.length_bytes == w.remote_addr &&
                            prev.local_addr + prev.length_bytes == w.local_addr &&
                            uint64_t{prev.length_bytes} + w.length_bytes <= read_bytes_max;
      if (adjacent) {
        prev.length_bytes += w.length_bytes;
        continue;
      }
    }
    wrs.push_back(w);
  }
  const size_t n_chains = (wrs.size() + wrs_per_chain_max - 1) / wrs_per_chain_max;
  if (n_chains > kChainsPerBatchMax) return Status::InvalidArgument("batch needs too many chains");
  for (size_t c = 0; c < n_chains; ++c) {
    const size_t begin = c * wrs_per_chain_max;
    const size_t end = std::min(wrs.size(), begin + wrs_per_chain_max);
    std::vector<PlannedRead> chain(wrs.begin() + begin, wrs.begin() + end);
    for (PlannedRead& w : chain) w.wr_id = MakeWrId(batch_seq, static_cast<uint32_t>(c));
    chain.back().signaled = true;
    chains->push_back(std::move(chain));
  }
  return Status::Ok();
}

const char* QpStateName(QpState s) {
  switch (s) {
    case QpState::kDisconnected:
      return "disconnected";
    case QpState::kExchanging:
      return "exchanging";
    case QpState::kReadyToReceive:
      return "ready_to_receive";
    case QpState::kReadyToSend:
      return "ready_to_send";
    case QpState::kError:
      return "error";
    case QpState::kClosed:
      return "closed";
  }
  return "unknown";
}

Status QpStateMachine::Apply(QpEvent e) {
  const QpState s = state_;
  bool allowed = false;
  QpState next = s;
  switch (e) {
    case QpEvent::kConnect:
      allowed = s == QpState::kDisconnected;
      next = QpState::kExchanging;
      break;
    case QpEvent::kPeerParams:
      allowed = s == QpState::kExchanging;
      next = QpState::kReadyToReceive;
      break;
    case QpEvent::kReady:
      allowed = s == QpState::kReadyToReceive;
      next = QpState::kReadyToSend;
      break;
    case QpEvent::kFailure:
      allowed = s == QpState::kExchanging || s == QpState::kReadyToReceive ||
                s == QpState::kReadyToSend || s == QpState::kError;
      next = QpState::kError;
      break;
    case QpEvent::kTornDown:
      allowed = s == QpState::kError || s == QpState::kExchanging || s == QpState::kReadyToReceive;
      next = QpState::kDisconnected;
      break;
    case QpEvent::kClose:
      allowed = true;
      next = QpState::kClosed;
      break;
  }
  if (!allowed) {
    return Status::InvalidArgument(std::string("queue pair event not allowed in state ") +
                                   QpStateName(s));
  }
  if (e == QpEvent::kReady) ++connects_;
  state_ = next;
  return Status::Ok();
}

namespace {
using le::Get32;
using le::Get64;
using le::Put32;
using le::Put64;
}  // namespace

size_t EncodeQpParams(const QpParams& p, uint8_t out[kQpParamsBytes]) {
  const size_t n = p.version == 1 ? kQpParamsV1Bytes : kQpParamsBytes;
  std::memset(out, 0, n);
  Put32(out + 0, p.qpn);
  Put32(out + 4, p.psn & 0xffffff);
  out[8] = static_cast<uint8_t>(p.lid);
  out[9] = static_cast<uint8_t>(p.lid >> 8);
  out[10] = p.port;
  out[11] = p.gid_index;
  std::memcpy(out + 12, p.gid.data(), 16);
  if (n == kQpParamsBytes) {
    out[28] = 2;
    out[29] = p.path_mtu;
    out[30] = p.rd_atomic;
    out[31] = p.link_layer;
  }
  return n;
}

Status DecodeQpParams(std::span<const uint8_t> in, QpParams* out) {
  if (in.size() != kQpParamsBytes && in.size() != kQpParamsV1Bytes) {
    return Status::Corruption("queue pair params size");
  }
  QpParams p;
  p.qpn = Get32(in.data());
  p.psn = Get32(in.data() + 4);
  if (p.qpn == 0 || p.qpn > 0xffffff || p.psn > 0xffffff) {
    return Status::Corruption("queue pair number or psn out of range");
  }
  p.lid = static_cast<uint16_t>(in[8] | (in[9] << 8));
  p.port = in[10];
  p.gid_index = in[11];
  std::memcpy(p.gid.data(), in.data() + 12, 16);
  if (in.size() == kQpParamsV1Bytes) {
    p.version = 1;
    p.path_mtu = 0;
    p.rd_atomic = 0;
    p.link_layer = kLinkLayerUnspecified;
  } else {
    if (in[28] != 2) return Status::Corruption("queue pair params version is not 2");
    p.version = 2;
    p.path_mtu = in[29];
    p.rd_atomic = in[30];
    p.link_layer = in[31];
    if (MtuBytes(p.path_mtu) == 0) return Status::Corruption("path MTU code out of range");
    if (p.rd_atomic == 0) return Status::Corruption("read depth 0");
    if (p.link_layer > kLinkLayerEthernet) return Status::Corruption("unknown link layer");
    for (size_t i = 32; i < kQpParamsBytes; ++i) {
      if (in[i] != 0) return Status::Corruption("reserved queue pair params bytes not zero");
    }
  }
  *out = p;
  return Status::Ok();
}

uint8_t MtuCode(uint32_t bytes) {
  for (uint8_t code = kMtuCodeMin; code <= kMtuCodeMax; ++code) {
    if (MtuBytes(code) == bytes) return code;
  }
  return 0;
}

uint32_t MtuBytes(uint8_t code) {
  if (code < kMtuCodeMin || code > kMtuCodeMax) return 0;
  return 128u << code;
}

Status ValidateVerbsOptions(const VerbsOptions& o) {
  if (o.port == 0) return Status::InvalidArgument("verbs port must be 1..255");
  if (o.send_queue_depth == 0 || o.cq_depth < o.send_queue_depth) {
    return Status::InvalidArgument("verbs send_queue_depth must be in [1, cq_depth]");
  }
  if (o.rd_atomic_max == 0 || o.rd_atomic_max > 255) {
    return Status::InvalidArgument("verbs rd_atomic_max must be 1..255");
  }
  if (MtuCode(o.path_mtu_max_bytes) == 0) {
    return Status::InvalidArgument("verbs path_mtu_max_bytes must be 256, 512, 1024, 2048 or 4096");
  }
  return Status::Ok();
}

Status LocalPathCaps(const VerbsOptions& options, const DeviceCaps& caps, bool responder,
                     QpParams* local) {
  KVTIER_RETURN_IF_ERROR(ValidateVerbsOptions(options));
  if (options.gid_index >= caps.gid_table_len) {
    return Status::InvalidArgument("verbs gid_index " + std::to_string(options.gid_index) +
                                   " is outside the port's GID table (" +
                                   std::to_string(caps.gid_table_len) + " entries)");
  }
  if (MtuBytes(caps.active_mtu) == 0) {
    return Status::Unavailable("the RDMA port reports no usable active MTU");
  }
  const uint32_t device_depth = responder ? caps.max_qp_rd_atom : caps.max_qp_init_rd_atom;
  if (device_depth == 0) return Status::Unavailable("the RDMA device allows no RDMA READ depth");
  local->version = 2;
  local->path_mtu = std::min(caps.active_mtu, MtuCode(options.path_mtu_max_bytes));
  local->rd_atomic = static_cast<uint8_t>(std::min({options.rd_atomic_max, device_depth, 255u}));
  local->link_layer =
      caps.link_layer == kLinkLayerEthernet ? kLinkLayerEthernet : kLinkLayerInfiniBand;
  local->lid = caps.lid;
  local->port = options.port;
  local->gid_index = options.gid_index;
  return Status::Ok();
}

namespace {
bool ZeroGid(const std::array<uint8_t, 16>& gid) {
  return std::all_of(gid.begin(), gid.end(), [](uint8_t b) { return b == 0; });
}
}  // namespace

StatusOr<PathAttributes> NegotiatePath(const QpParams& local, const QpParams& peer) {
  if (local.version != 2 || MtuBytes(local.path_mtu) == 0 || local.rd_atomic == 0 ||
      (local.link_layer != kLinkLayerInfiniBand && local.link_layer != kLinkLayerEthernet)) {
    return Status::InvalidArgument("local queue pair capabilities not set (LocalPathCaps)");
  }
  PathAttributes a;
  a.path_mtu = local.path_mtu;
  a.rd_atomic = local.rd_atomic;
  if (peer.version >= 2) {
    const uint8_t peer_layer =
        peer.link_layer == kLinkLayerEthernet ? kLinkLayerEthernet : kLinkLayerInfiniBand;
    if (peer_layer != local.link_layer) {
      return Status::InvalidArgument("the ends' link layers differ (InfiniBand and Ethernet)");
    }
    if (MtuBytes(peer.path_mtu) == 0 || peer.rd_atomic == 0) {
      return Status::InvalidArgument("peer queue pair capabilities out of range");
    }
    a.path_mtu = std::min(local.path_mtu, peer.path_mtu);
    a.rd_atomic = std::min(local.rd_atomic, peer.rd_atomic);
  }
  a.use_grh = local.link_layer == kLinkLayerEthernet || local.lid == 0 || peer.lid == 0;
  if (a.use_grh && (ZeroGid(local.gid) || ZeroGid(peer.gid))) {
    return Status::InvalidArgument(
        "routing by GID but a GID is zero (check gid_index on both ends)");
  }
  return a;
}

const GrantRegistrations::Entry* GrantRegistrations::Find(const wire::GrantToken& token) const {
  auto it = entries_.find(token);
  return it == entries_.end() ? nullptr : &it->second;
}

Status GrantRegistrations::Add(const wire::GrantToken& token, Entry entry) {
  if (entries_.count(token) != 0) {
    return Status::InvalidArgument("the grant already has a registration");
  }
  if (entries_.size() >= registrations_max_) {
    return Status::Rejected("verbs registrations_max reached (one per grant)");
  }
  entries_.emplace(token, std::move(entry));
  return Status::Ok();
}

bool GrantRegistrations::Revoke(const wire::GrantToken& token) {
  auto it = entries_.find(token);
  if (it == entries_.end()) return false;
  Entry e = std::move(it->second);
  entries_.erase(it);
  deregister_(e.tenant, e.region);
  return true;
}

size_t GrantRegistrations::ExpireUntil(uint64_t now_us) {
  std::vector<Entry> expired;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.expiry_us <= now_us) {
      expired.push_back(std::move(it->second));
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  for (const Entry& e : expired) deregister_(e.tenant, e.region);
  return expired.size();
}

void EncodeRemoteRegion(const RemoteRegion& r, uint8_t out[kRemoteRegionBytes]) {
  std::memset(out, 0, kRemoteRegionBytes);
  Put64(out, r.addr);
  Put32(out + 8, r.rkey);
  Put64(out + 16, r.length_bytes);
}

Status DecodeRemoteRegion(std::span<const uint8_t> in, RemoteRegion* out) {
  if (in.size() != kRemoteRegionBytes) return Status::Corruption("remote region size");
  if (Get32(in.data() + 12) != 0) return Status::Corruption("reserved remote region bytes");
  RemoteRegion r;
  r.addr = Get64(in.data());
  r.rkey = Get32(in.data() + 8);
  r.length_bytes = Get64(in.data() + 16);
  if (r.length_bytes == 0) return Status::Corruption("empty remote region");
  *out = r;
  return Status::Ok();
}

Status InflightTracker::Add(uint64_t batch_seq, uint32_t chains, uint32_t wrs, uint32_t ops,
                            ReadCallback done) {
  if (chains == 0 || wrs == 0) return Status::InvalidArgument("empty batch");
  if (uint64_t{wrs_in_flight_} + wrs > wrs_max_) return Status::Rejected("send queue full");
  if (!batches_.emplace(batch_seq, Batch{chains, wrs, ops, std::move(done)}).second) {
    return Status::InvalidArgument("duplicate batch sequence");
  }
  wrs_in_flight_ += wrs;
  ops_in_flight_ += ops;
  return Status::Ok();
}

ReadCallback InflightTracker::OnCompletion(uint64_t wr_id, const Status& status) {
  auto it = batches_.find(WrIdBatch(wr_id));
  if (it == batches_.end()) return nullptr;
  Batch& b = it->second;
  if (status.ok() && --b.chains_left > 0) return nullptr;
  ReadCallback done = std::move(b.done);
  wrs_in_flight_ -= b.wrs;
  ops_in_flight_ -= b.ops;
  batches_.erase(it);
  return done;
}

std::vector<ReadCallback> InflightTracker::TakeAll() {
  std::vector<ReadCallback> out;
  for (auto& [seq, b] : batches_) out.push_back(std::move(b.done));
  batches_.clear();
  wrs_in_flight_ = 0;
  ops_in_flight_ = 0;
  return out;
}

}  // namespace kvtier::rdma::verbs
