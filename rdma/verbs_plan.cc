#include "rdma/verbs_plan.h"

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

void EncodeQpParams(const QpParams& p, uint8_t out[kQpParamsBytes]) {
  std::memset(out, 0, kQpParamsBytes);
  Put32(out + 0, p.qpn);
  Put32(out + 4, p.psn & 0xffffff);
  out[8] = static_cast<uint8_t>(p.lid);
  out[9] = static_cast<uint8_t>(p.lid >> 8);
  out[10] = p.port;
  out[11] = p.gid_index;
  std::memcpy(out + 12, p.gid.data(), 16);
}

Status DecodeQpParams(std::span<const uint8_t> in, QpParams* out) {
  if (in.size() != kQpParamsBytes) return Status::Corruption("queue pair params size");
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
  *out = p;
  return Status::Ok();
}

void EncodeRemoteRegion(const RemoteRegion& r, uint8_t out[kRemoteRegionBytes]) {
  std::memset(out, 0, kRemoteRegionBytes);
  Put64(out, r.addr);
  Put32(out + 8, r.rkey);
  Put64(out + 16, r.length_bytes);
}

Status DecodeRemoteRegion(std::span<const uint8_t> in, RemoteRegion* out) {
  if (in.size() != kRemoteRegionBytes) return Status::Corruption("remote region size");
  out->addr = Get64(in.data());
  out->rkey = Get32(in.data() + 8);
  out->length_bytes = Get64(in.data() + 16);
  if (out->length_bytes == 0) return Status::Corruption("empty remote region");
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
