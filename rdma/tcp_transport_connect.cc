// TcpTransport's connection (tcp_transport_impl.h): connecting the socket on the I/O thread
// for a caller, opening regions on the wire, (re)connecting with every open region
// re-attached; and on the I/O thread, dropping the connection (FailAll) and failing it when a
// request is past its deadline (Tick).
#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "rdma/tcp_transport_impl.h"

namespace kvtier::rdma {

void TcpTransport::Impl::FailAll(const Status& status) {
  std::vector<Done> failed;
  {
    // No reader is inside the socket while it closes (a Poll() caller reads its fd).
    std::lock_guard<std::mutex> read_lock(read_mu);
    ResetReadLocked();
    std::lock_guard<std::mutex> lock(mu);
    if (connected) ++c.disconnects;
    connected = false;
    ready = false;
    ++generation;
    for (auto& p : pending) failed.push_back(Done{std::move(p), status});
    pending.clear();
    outbox.clear();
    io_writes = false;
    fd = -1;
    in_flight_ops = 0;
    c.batches_failed += failed.size();
    c.reads_in_flight = 0;
    // Closed under read_mu: a reader that took the lock after this sees !connected.
    boost::system::error_code ec;
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
    QueueCallbacks(&failed);  // after the batches already completed, still under read_mu
  }
  write_queue.clear();
  writing_now.clear();
  writing = false;
  RunCallbacks();
}

void TcpTransport::Impl::Tick() {
  const uint32_t period_ms = std::max<uint32_t>(10, options.request_timeout_ms / 4);
  tick.expires_after(std::chrono::milliseconds(period_ms));
  tick.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    bool expired = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) return;
      expired =
          connected && !pending.empty() && pending.front()->deadline_us < tcp_internal::NowUs();
    }
    if (expired) {
      FailAll(Status::IOError("row server did not answer within request_timeout_ms"));
    }
    Tick();
  });
}

Status TcpTransport::Impl::ConnectSocket() {
  std::promise<boost::system::error_code> result;
  asio::post(io, [&] {
    boost::system::error_code ec;
    socket.close(ec);
    tcp::resolver resolver(io);
    auto endpoints = resolver.resolve(endpoint.host, std::to_string(endpoint.port), ec);
    if (ec) return result.set_value(ec);
    connecting = true;
    connect_timer.expires_after(std::chrono::milliseconds(options.connect_timeout_ms));
    connect_timer.async_wait([this](const boost::system::error_code& tec) {
      if (!tec && connecting) {
        boost::system::error_code ignored;
        socket.close(ignored);  // aborts the connect
      }
    });
    asio::async_connect(
        socket, endpoints,
        [this, &result](const boost::system::error_code& cec, const tcp::endpoint&) {
          connect_timer.cancel();
          connecting = false;
          if (!cec) {
            boost::system::error_code ignored;
            socket.set_option(tcp::no_delay(true), ignored);
            uint64_t gen = 0;
            {
              std::lock_guard<std::mutex> lock(mu);
              connected = true;
              fd = socket.native_handle();
              io_writes = false;
              gen = ++generation;
            }
            ArmRead(gen);
            DrainOnIo(gen);
          }
          result.set_value(cec);
        });
  });
  const boost::system::error_code ec = result.get_future().get();
  if (ec) {
    return Status::IOError("cannot connect to row server " + endpoint.host + ":" +
                           std::to_string(endpoint.port) + ": " + ec.message());
  }
  return Status::Ok();
}

StatusOr<wire::OpenReply> TcpTransport::Impl::OpenOnWire(const RegionCredentials& cred) {
  auto p = std::make_unique<tcp_internal::Pending>();
  std::promise<StatusOr<wire::OpenReply>> result;
  p->type = wire::FrameType::kOpen;
  p->data_bytes = wire::kOpenReplyBytes;
  p->open_done = [&result](const Status& st, const wire::OpenReply& r) {
    if (st.ok()) {
      result.set_value(r);
    } else {
      result.set_value(st);
    }
  };
  uint64_t gen = 0;
  bool kick = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!connected) return Status::IOError("not connected to row server");
    p->request_id = next_request_id++;
    p->deadline_us = tcp_internal::NowUs() + uint64_t{options.request_timeout_ms} * 1000;
    std::vector<uint8_t> frame = wire::BuildOpenRequest(
        p->request_id, wire::OpenRequest{cred.token, cred.region_name, cred.tenant});
    gen = generation;
    kick = AppendLocked(std::move(p), std::move(frame));
  }
  if (kick) Kick(gen);
  return result.get_future().get();
}

Status TcpTransport::Impl::EnsureConnected() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (closed) return Status::Unavailable("transport closed");
    if (ready) return Status::Ok();
  }
  if (Status st = ConnectAndReattach(); !st.ok()) {
    RunOnIo([this] { FailAll(Status::IOError("connecting to row server failed")); });
    return st;
  }
  return Status::Ok();
}

Status TcpTransport::Impl::ConnectAndReattach() {
  // A connection left half-made (socket up, regions not re-attached) is started afresh.
  RunOnIo([this] { FailAll(Status::IOError("reconnecting")); });
  KVTIER_RETURN_IF_ERROR(ConnectSocket());
  std::vector<RegionCredentials> creds;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const tcp_internal::RegionEntry& r : regions) creds.push_back(r.credentials);
    gen = generation;
  }
  std::vector<StatusOr<wire::OpenReply>> replies;
  for (const RegionCredentials& cred : creds) {
    StatusOr<wire::OpenReply> reply = OpenOnWire(cred);
    // A lost connection, or a server that no longer knows what it just answered: start
    // over on the next attempt (Retry and IOError are what RowFetcher retries).
    if (!reply.ok() && (reply.status().IsIOError() || reply.status().IsRetry())) {
      return reply.status().WithContext("re-attaching region after reconnect");
    }
    replies.push_back(std::move(reply));
  }
  std::lock_guard<std::mutex> lock(mu);
  if (closed) return Status::Unavailable("transport closed");
  if (!connected || generation != gen) {
    return Status::IOError("connection to row server lost while re-attaching regions");
  }
  for (size_t i = 0; i < replies.size(); ++i) {
    tcp_internal::RegionEntry& r = regions[i];
    const StatusOr<wire::OpenReply>& reply = replies[i];
    if (!reply.ok()) {
      r.attach_status = reply.status().WithContext("re-attaching region after reconnect");
    } else if (reply->size_bytes != r.info.size_bytes ||
               reply->row_stride_bytes != r.info.row_stride_bytes ||
               reply->row_begin != r.info.row_begin) {
      r.attach_status = Status::Corruption("region changed shape across a reconnect");
    } else {
      r.server_id = reply->region_id;
      r.attach_status = Status::Ok();
    }
  }
  ready = true;
  ++c.connects;
  return Status::Ok();
}

}  // namespace kvtier::rdma
