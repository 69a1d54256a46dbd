// VerbsTransport's connection on the caller's threads (verbs_transport_impl.h): the side-channel
// calls (kOpen, kVerbsConnect, kVerbsRegion), attaching regions, and (re)connecting the queue
// pair with every open region re-attached.
#include <array>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "rdma/verbs_transport_impl.h"

namespace kvtier::rdma {

StatusOr<std::vector<uint8_t>> VerbsTransport::Impl::Call(std::vector<uint8_t> frame,
                                                          uint64_t request_id,
                                                          wire::FrameType type) {
  return side->Call(std::move(frame), request_id, type, options.request_timeout_ms);
}

uint64_t VerbsTransport::Impl::NextRequestId() {
  std::lock_guard<std::mutex> lock(mu);
  return next_request_id++;
}

StatusOr<wire::OpenReply> VerbsTransport::Impl::OpenOnWire(const RegionCredentials& cred) {
  const uint64_t id = NextRequestId();
  KVTIER_ASSIGN_OR_RETURN(
      std::vector<uint8_t> data,
      Call(wire::BuildOpenRequest(id, {cred.token, cred.region_name, cred.tenant}), id,
           wire::FrameType::kOpen));
  wire::OpenReply reply;
  KVTIER_RETURN_IF_ERROR(wire::DecodeOpenReply(data, &reply));
  return reply;
}

Status VerbsTransport::Impl::ExchangeQpParams(bool probe_only) {
  verbs::QpParams mine;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (qp == nullptr) return Status::IOError("no queue pair");
    mine = qp->LocalParams();
  }
  std::array<uint8_t, verbs::kQpParamsBytes> encoded{};
  const size_t n = verbs::EncodeQpParams(mine, encoded.data());
  const uint64_t id = NextRequestId();
  StatusOr<std::vector<uint8_t>> data =
      Call(wire::BuildVerbsConnectRequest(id, std::span<const uint8_t>(encoded.data(), n)), id,
           wire::FrameType::kVerbsConnect);
  if (probe_only) {
    // Before any kOpen a server with RDMA answers PermissionDenied (it needs a grant to
    // pick the tenant's protection domain); one without answers Unavailable.
    if (data.ok() || data.status().IsPermissionDenied()) return Status::Ok();
    return data.status();
  }
  KVTIER_RETURN_IF_ERROR(data.status());
  verbs::QpParams peer;
  KVTIER_RETURN_IF_ERROR(verbs::DecodeQpParams(*data, &peer));
  std::lock_guard<std::mutex> lock(mu);
  if (qp == nullptr) return Status::IOError("queue pair torn down during the exchange");
  KVTIER_RETURN_IF_ERROR(qp->ConnectTo(peer));
  KVTIER_RETURN_IF_ERROR(sm.Apply(verbs::QpEvent::kPeerParams));
  KVTIER_RETURN_IF_ERROR(sm.Apply(verbs::QpEvent::kReady));
  return Status::Ok();
}

StatusOr<verbs::RemoteRegion> VerbsTransport::Impl::RegionOnWire(uint32_t server_id) {
  const uint64_t id = NextRequestId();
  KVTIER_ASSIGN_OR_RETURN(
      std::vector<uint8_t> data,
      Call(wire::BuildVerbsRegionRequest(id, server_id), id, wire::FrameType::kVerbsRegion));
  verbs::RemoteRegion r;
  KVTIER_RETURN_IF_ERROR(verbs::DecodeRemoteRegion(data, &r));
  return r;
}

void VerbsTransport::Impl::DropConnection() {
  {
    std::lock_guard<std::mutex> lock(mu);
    qp.reset();
    if (sm.state() != verbs::QpState::kDisconnected && sm.state() != verbs::QpState::kClosed) {
      (void)sm.Apply(verbs::QpEvent::kFailure);
      (void)sm.Apply(verbs::QpEvent::kTornDown);
    }
    remote.Clear();
    ready = false;
  }
  side->Close();
}

StatusOr<std::pair<wire::OpenReply, verbs::RemoteRegion>> VerbsTransport::Impl::Attach(
    const RegionCredentials& credentials) {
  KVTIER_ASSIGN_OR_RETURN(wire::OpenReply reply, OpenOnWire(credentials));
  bool exchanging = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    exchanging = sm.state() == verbs::QpState::kExchanging;
  }
  if (exchanging) KVTIER_RETURN_IF_ERROR(ExchangeQpParams(/*probe_only=*/false));
  KVTIER_ASSIGN_OR_RETURN(verbs::RemoteRegion r, RegionOnWire(reply.region_id));
  if (r.length_bytes != reply.size_bytes) {
    return Status::Corruption("remote region length differs from the region's size");
  }
  return std::make_pair(reply, r);
}

Status VerbsTransport::Impl::EnsureConnected() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (closed) return Status::Unavailable("transport closed");
    if (ready && ConnectedLocked()) return Status::Ok();
  }
  // A connection left half-made (a region not re-attached) is started afresh.
  DropConnection();
  StatusOr<uint64_t> gen = side->Connect(endpoint, options.connect_timeout_ms);
  if (!gen.ok()) return gen.status();
  StatusOr<std::unique_ptr<verbs::VerbsQp>> new_qp =
      zone->CreateQp(verbs_options.send_queue_depth, verbs::QpRole::kReader);
  if (!new_qp.ok()) {
    side->Close();
    return new_qp.status();
  }
  std::vector<RegionCredentials> creds;
  {
    std::lock_guard<std::mutex> lock(mu);
    qp = std::move(new_qp).value();
    side_gen = *gen;
    (void)sm.Apply(verbs::QpEvent::kConnect);
    for (const internal::RegionEntry& r : regions) creds.push_back(r.credentials);
  }
  if (creds.empty()) {
    if (Status st = ExchangeQpParams(/*probe_only=*/true); !st.ok()) {
      DropConnection();
      return st;
    }
  }
  for (size_t i = 0; i < creds.size(); ++i) {
    auto attached = Attach(creds[i]);
    // Retry: the server does not know a region of this connection (docs/format/wire.md);
    // like a lost connection, start over on the next attempt.
    if (!attached.ok() && (attached.status().IsIOError() || attached.status().IsUnavailable() ||
                           attached.status().IsRetry())) {
      DropConnection();
      return attached.status();
    }
    std::lock_guard<std::mutex> lock(mu);
    internal::RegionEntry& r = regions[i];
    if (!attached.ok()) {
      r.attach_status = attached.status().WithContext("re-attaching region after reconnect");
      continue;
    }
    const wire::OpenReply& reply = attached->first;
    if (reply.size_bytes != r.info.size_bytes ||
        reply.row_stride_bytes != r.info.row_stride_bytes || reply.row_begin != r.info.row_begin) {
      r.attach_status = Status::Corruption("region changed shape across a reconnect");
      continue;
    }
    r.server_id = reply.region_id;
    r.attach_status = remote.Add(static_cast<RegionId>(i), attached->second);
  }
  // When every region failed to re-attach (e.g. all grants revoked) the QP stays in
  // kExchanging and Submit() reports each region's attach_status.
  std::lock_guard<std::mutex> lock(mu);
  if (qp == nullptr || side_gen != *gen) {
    return Status::IOError("connection to row server lost while re-attaching regions");
  }
  ready = true;
  ++c.connects;
  return Status::Ok();
}

}  // namespace kvtier::rdma
