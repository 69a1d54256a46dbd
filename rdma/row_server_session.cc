// RowServerSession (row_server_impl.h): one client connection of the row server. Reads a
// request (header, then body, within the body deadline), answers it (kOpen attaches a granted
// region; kRead checks every op against the connection's regions and grants and replies with
// the rows; kVerbsConnect / kVerbsRegion serve the verbs transport's side channel), repeats;
// closes the connection when no region is attached in time or a grant behind its queue pair
// lapses.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "rdma/row_server_impl.h"

namespace kvtier::rdma {

void RowServerSession::Start() {
  accepted_at_ = std::chrono::steady_clock::now();
  const uint32_t attach_ms = state_->options.attach_timeout_ms;
  const uint32_t body_ms = state_->options.body_timeout_ms;
  const uint32_t shortest_ms = attach_ms == 0 ? body_ms
                               : body_ms == 0 ? attach_ms
                                              : std::min(attach_ms, body_ms);
  if (shortest_ms > 0) {
    watch_period_ = std::chrono::milliseconds(std::max<uint32_t>(1, shortest_ms / 4));
    Watch();
  }
  ReadHeader();
}

void RowServerSession::Close() {
  boost::system::error_code ec;
  timer_.cancel();
  verbs_timer_.cancel();
  watch_timer_.cancel();
#ifdef KVTIER_WITH_RDMA
  qp_.reset();  // the connection is the queue pair's lease
#endif
  verbs_regions_.clear();
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
}

void RowServerSession::Watch() {
  watch_timer_.expires_after(watch_period_);
  watch_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || !self->socket_.is_open()) return;
    const auto now = std::chrono::steady_clock::now();
    const RowServerOptions& o = self->state_->options;
    if (o.attach_timeout_ms > 0 && self->attached_.empty() &&
        now - self->accepted_at_ >= std::chrono::milliseconds(o.attach_timeout_ms)) {
      self->state_->unattached_closed.fetch_add(1);
      return self->Close();
    }
    if (o.body_timeout_ms > 0 && self->reading_body_ &&
        now - self->body_started_at_ >= std::chrono::milliseconds(o.body_timeout_ms)) {
      self->state_->bodies_timed_out.fetch_add(1);
      return self->Close();
    }
    self->Watch();
  });
}

void RowServerSession::ReadHeader() {
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(header_),
                   [self](const boost::system::error_code& ec, size_t) {
                     if (ec) return self->Close();
                     self->OnHeader();
                   });
}

void RowServerSession::OnHeader() {
  if (Status st = wire::DecodeRequestHeader(header_.data(), &request_); !st.ok()) {
    return Malformed(st);
  }
  body_.resize(request_.body_bytes);
  auto self = shared_from_this();
  reading_body_ = true;
  body_started_at_ = std::chrono::steady_clock::now();
  asio::async_read(socket_, asio::buffer(body_),
                   [self](const boost::system::error_code& ec, size_t) {
                     self->reading_body_ = false;
                     if (ec) return self->Close();
                     self->OnBody();
                   });
}

void RowServerSession::Malformed(const Status& why) {
  state_->malformed_frames.fetch_add(1);
  KVTIER_LOG(kWarn) << "row server: closing connection after a malformed frame: " << why.ToString();
  Close();
}

void RowServerSession::OnBody() {
  switch (request_.type) {
    case wire::FrameType::kOpen:
      return HandleOpen();
    case wire::FrameType::kRead:
      return HandleRead();
    case wire::FrameType::kVerbsConnect:
      return HandleVerbsConnect();
    case wire::FrameType::kVerbsRegion:
      return HandleVerbsRegion();
  }
}

Status RowServerSession::NoDevice() {
  state_->verbs_unavailable.fetch_add(1);
  return Status::Unavailable("row server has no RDMA device");
}

void RowServerSession::HandleVerbsConnect() {
  verbs::QpParams peer;
  if (Status st = verbs::DecodeQpParams(body_, &peer); !st.ok()) return Malformed(st);
  if (!state_->VerbsServed()) return Reply(NoDevice(), {});
#ifdef KVTIER_WITH_RDMA
  if (qp_ != nullptr) {
    return Reply(Status::InvalidArgument("a queue pair is already connected here"), {});
  }
  // The trust zone is the tenant of a live grant attached on this connection.
  const Attached* grant = nullptr;
  for (const auto& [id, a] : attached_) {
    if (state_->GrantValid(a.token, a.table->name, a.tenant)) {
      grant = &a;
      break;
    }
  }
  if (grant == nullptr) {
    state_->permission_denied.fetch_add(1);
    return Reply(Status::PermissionDenied("open a region (kOpen) before kVerbsConnect"), {});
  }
  const std::string tenant = grant->tenant;
  StatusOr<std::shared_ptr<verbs::VerbsZone>> zone = state_->ZoneFor(tenant);
  if (!zone.ok()) return Reply(zone.status(), {});
  StatusOr<std::unique_ptr<verbs::VerbsQp>> qp =
      (*zone)->CreateQp(16, verbs::QpRole::kResponder);  // posts nothing: a shallow SQ
  if (!qp.ok()) return Reply(qp.status(), {});
  if (Status st = (*qp)->ConnectTo(peer); !st.ok()) return Reply(st, {});
  qp_ = std::move(qp).value();
  zone_ = std::move(zone).value();
  qp_tenant_ = tenant;
  state_->verbs_qps_created.fetch_add(1);
  verbs::QpParams mine = qp_->LocalParams();
  mine.version = peer.version;  // answer in the client's version (docs/format/wire.md)
  const size_t n = verbs::EncodeQpParams(mine, verbs_reply_.data());
  Reply(Status::Ok(), {asio::const_buffer(verbs_reply_.data(), n)});
  CheckVerbsGrantsLater();
#endif
}

void RowServerSession::HandleVerbsRegion() {
  uint32_t region_id = 0;
  if (Status st = wire::DecodeVerbsRegionRequest(body_, &region_id); !st.ok()) {
    return Malformed(st);
  }
  if (!state_->VerbsServed()) return Reply(NoDevice(), {});
#ifdef KVTIER_WITH_RDMA
  if (qp_ == nullptr) return Reply(Status::InvalidArgument("kVerbsConnect first"), {});
  auto it = attached_.find(region_id);
  if (it == attached_.end()) {
    return Reply(Status::Retry("region not opened on this connection"), {});
  }
  const Attached& a = it->second;
  const uint64_t expiry_us = state_->GrantExpiryUs(a.token, a.table->name, a.tenant);
  if (a.tenant != qp_tenant_ || expiry_us == 0) {
    state_->permission_denied.fetch_add(1);
    return Reply(Status::PermissionDenied("no valid grant of the queue pair's tenant"), {});
  }
  StatusOr<verbs::RemoteRegion> region =
      state_->RegionFor(a.token, qp_tenant_, expiry_us, *zone_, *a.table);
  if (!region.ok()) return Reply(region.status(), {});
  // RevokeGrant may have run between the check and the registration: check again, so a
  // registration never outlives its grant (RevokeGrant drops it after erasing the grant).
  if (!state_->GrantValid(a.token, a.table->name, a.tenant)) {
    state_->DropRegistration(a.token);
    state_->permission_denied.fetch_add(1);
    return Reply(Status::PermissionDenied("grant expired or revoked"), {});
  }
  verbs_regions_.insert(region_id);
  verbs::EncodeRemoteRegion(*region, verbs_reply_.data());
  Reply(Status::Ok(), {asio::const_buffer(verbs_reply_.data(), verbs::kRemoteRegionBytes)});
#endif
}

void RowServerSession::CheckVerbsGrantsLater() {
  verbs_timer_.expires_after(
      std::chrono::milliseconds(std::max<uint32_t>(1, state_->options.verbs_grant_check_ms)));
  auto self = shared_from_this();
  verbs_timer_.async_wait([self](const boost::system::error_code& ec) {
    if (ec) return;
    for (uint32_t id : self->verbs_regions_) {
      auto it = self->attached_.find(id);
      if (it == self->attached_.end() ||
          !self->state_->GrantValid(it->second.token, it->second.table->name, it->second.tenant)) {
        self->state_->verbs_qps_cut.fetch_add(1);
        KVTIER_LOG(kInfo) << "row server: a grant behind a queue pair lapsed; destroying "
                             "the queue pair and closing its connection";
        return self->Close();
      }
    }
    self->CheckVerbsGrantsLater();
  });
}

void RowServerSession::HandleOpen() {
  wire::OpenRequest req;
  if (Status st = wire::DecodeOpenRequest(body_, &req); !st.ok()) return Malformed(st);
  std::shared_ptr<const internal::Table> table = state_->FindTable(req.region_name);
  if (table == nullptr) return Reply(Status::NotFound("no such region"), {});
  if (!state_->GrantValid(req.token, req.region_name, req.tenant)) {
    state_->permission_denied.fetch_add(1);
    return Reply(Status::PermissionDenied("no valid grant for this region and tenant"), {});
  }
  if (attached_.count(table->id) == 0 &&
      attached_.size() >= state_->options.regions_per_connection_max) {
    return Reply(Status::Rejected("regions_per_connection_max reached"), {});
  }
  attached_[table->id] = Attached{table, req.token, req.tenant};
  const EngramTableHeader& h = table->header;
  wire::OpenReply reply{table->id,   h.row_stride_bytes, table->rows.size(),
                        h.row_begin, h.row_count,        h.row_dim};
  wire::EncodeOpenReply(reply, open_reply_.data());
  std::vector<asio::const_buffer> data = {
      asio::const_buffer(open_reply_.data(), open_reply_.size())};
  ReplyOkAfter(state_->options.TEST_open_delay_ms, std::move(data));
}

Status RowServerSession::CheckRead(const std::vector<wire::ReadOpWire>& ops,
                                   std::vector<asio::const_buffer>* out,
                                   const internal::Table** guarded) {
  const RowServerOptions& o = state_->options;
  if (ops.size() > o.batch_ops_max) return Status::InvalidArgument("batch over batch_ops_max");
  uint64_t total = 0;
  uint32_t checked_region = UINT32_MAX;  // grants are re-checked once per run of a region
  for (const wire::ReadOpWire& op : ops) {
    auto it = attached_.find(op.region_id);
    if (it == attached_.end()) {
      // Not a grant problem: the client's region ids belong to another connection (it
      // raced a reconnect). Retry tells it to re-open its regions and resend.
      return Status::Retry("region not opened on this connection");
    }
    const Attached& a = it->second;
    if (op.region_id != checked_region) {
      if (!state_->GrantValid(a.token, a.table->name, a.tenant)) {
        return Status::PermissionDenied("grant expired or revoked");
      }
      checked_region = op.region_id;
    }
    const std::span<const uint8_t> rows = a.table->rows;
    if (op.length_bytes == 0 || op.length_bytes > o.read_bytes_max) {
      return Status::InvalidArgument("op length out of range");
    }
    if (op.offset_bytes > rows.size() || rows.size() - op.offset_bytes < op.length_bytes) {
      return Status::InvalidArgument("read outside region");
    }
    total += op.length_bytes;
    if (total > o.response_bytes_max) return Status::InvalidArgument("response_bytes_max");
    out->emplace_back(rows.data() + op.offset_bytes, op.length_bytes);
    if (a.table->guard) *guarded = a.table.get();
  }
  return Status::Ok();
}

void RowServerSession::HandleRead() {
  std::vector<wire::ReadOpWire> ops;
  if (Status st = wire::DecodeReadOps(body_, request_.op_count, &ops); !st.ok()) {
    return Malformed(st);
  }
  std::vector<asio::const_buffer> data;
  data.reserve(ops.size());
  const internal::Table* guarded = nullptr;
  Status st = CheckRead(ops, &data, &guarded);
  if (!st.ok()) {
    if (st.IsPermissionDenied()) state_->permission_denied.fetch_add(1);
    return Reply(st, {});
  }
  state_->batches_served.fetch_add(1);
  state_->ops_served.fetch_add(ops.size());
  state_->bytes_served.fetch_add(asio::buffer_size(data));
  // Gather the rows into one contiguous reply buffer: one buffer per row would cost a
  // writev per 64 rows (Boost.Asio's limit); a copy of <= response_bytes_max is cheaper.
  // Memory a caller writes while serving is always copied, inside its guard.
  if (data.size() > 1 || guarded != nullptr) {
    reply_data_.resize(asio::buffer_size(data));
    auto copy = [&] { asio::buffer_copy(asio::buffer(reply_data_), data); };
    if (guarded != nullptr) {
      guarded->guard(copy);
    } else {
      copy();
    }
    data.assign(1, asio::const_buffer(reply_data_.data(), reply_data_.size()));
  }
  ReplyOkAfter(state_->options.TEST_response_delay_ms, std::move(data));
}

void RowServerSession::ReplyOkAfter(uint32_t delay_ms, std::vector<asio::const_buffer> data) {
  if (delay_ms == 0) return Reply(Status::Ok(), std::move(data));
  timer_.expires_after(std::chrono::milliseconds(delay_ms));
  auto self = shared_from_this();
  timer_.async_wait([self, data = std::move(data)](const boost::system::error_code& ec) mutable {
    if (ec) return self->Close();
    self->Reply(Status::Ok(), std::move(data));
  });
}

void RowServerSession::Reply(const Status& status, std::vector<asio::const_buffer> data) {
  wire::ResponseHeader h;
  h.type = request_.type;
  h.request_id = request_.request_id;
  h.code = status.code();
  message_ = status.message().substr(0, wire::kMessageBytesMax);
  h.message_bytes = static_cast<uint16_t>(message_.size());
  h.data_bytes = status.ok() ? asio::buffer_size(data) : 0;
  wire::EncodeResponseHeader(h, response_header_.data());
  std::vector<asio::const_buffer> out;
  out.reserve(data.size() + 2);
  out.emplace_back(response_header_.data(), response_header_.size());
  if (!message_.empty()) out.emplace_back(message_.data(), message_.size());
  if (status.ok()) out.insert(out.end(), data.begin(), data.end());
  auto self = shared_from_this();
  asio::async_write(socket_, out, [self](const boost::system::error_code& ec, size_t) {
    if (ec) return self->Close();
    self->ReadHeader();
  });
}

}  // namespace kvtier::rdma
