// TcpTransport's reply reading (tcp_transport_impl.h): the reader state machine (header,
// message, data) over a receive buffer, run by the I/O thread when the socket is readable or
// by a Poll() caller, one reader at a time; completed batches' callbacks run afterwards, in
// completion order, outside the transport's locks.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "rdma/tcp_transport_impl.h"

namespace kvtier::rdma {

void TcpTransport::Impl::QueueCallbacks(std::vector<Done>* done) {
  if (done->empty()) return;
  std::lock_guard<std::mutex> lock(cb_mu);
  for (Done& d : *done) cb_queue.push_back(std::move(d));
  done->clear();
}

void TcpTransport::Impl::RunCallbacks() {
  std::unique_lock<std::mutex> lock(cb_mu);
  if (cb_running) return;
  cb_running = true;
  while (!cb_queue.empty()) {
    Done d = std::move(cb_queue.front());
    cb_queue.pop_front();
    lock.unlock();
    Finish(*d.p, d.status);
    lock.lock();
  }
  cb_running = false;
}

void TcpTransport::Impl::Finish(tcp_internal::Pending& p, const Status& status) {
  if (p.type == wire::FrameType::kRead) {
    if (p.done) p.done(status);
  } else if (p.open_done) {
    wire::OpenReply reply;
    Status st = status;
    if (st.ok()) st = wire::DecodeOpenReply(p.open_reply, &reply);
    p.open_done(st, reply);
  }
}

void TcpTransport::Impl::ResetReadLocked() {
  stage = Stage::kHeader;
  stage_got = 0;
  front = nullptr;
  rx_begin = rx_end = 0;
}

std::pair<uint8_t*, size_t> TcpTransport::Impl::StageTarget() {
  switch (stage) {
    case Stage::kHeader:
      return {reply_header.data(), reply_header.size()};
    case Stage::kMessage:
      return {reinterpret_cast<uint8_t*>(reply_message.data()), reply_message.size()};
    case Stage::kData:
      if (front->type == wire::FrameType::kOpen)
        return {front->open_reply.data(), front->open_reply.size()};
      if (front->dests.size() == 1)
        return {static_cast<uint8_t*>(front->dests.front().data()), front->dests.front().size()};
      // A multi-op reply is read into one staging buffer, then scattered.
      return {staging.data(), staging.size()};
  }
  return {nullptr, 0};
}

Status TcpTransport::Impl::AdvanceLocked(std::vector<Done>* done) {
  switch (stage) {
    case Stage::kHeader: {
      if (Status st = wire::DecodeResponseHeader(reply_header.data(), &reply); !st.ok())
        return Status::IOError("bad reply from row server: " + st.message());
      {
        std::lock_guard<std::mutex> lock(mu);
        front = pending.empty() ? nullptr : pending.front().get();
      }
      if (front == nullptr || front->request_id != reply.request_id || front->type != reply.type) {
        return Status::IOError("row server reply does not match the oldest request");
      }
      if (reply.code == StatusCode::kOk && reply.data_bytes != front->data_bytes)
        return Status::IOError("row server reply has the wrong data length");
      reply_message.resize(reply.message_bytes);
      stage = Stage::kMessage;
      return Status::Ok();
    }
    case Stage::kMessage:
      if (reply.code != StatusCode::kOk)
        return CompleteLocked(Status(reply.code, reply_message), done);
      if (front->type == wire::FrameType::kRead && front->dests.size() != 1)
        staging.resize(front->data_bytes);
      stage = Stage::kData;
      return Status::Ok();
    case Stage::kData:
      if (front->type == wire::FrameType::kRead && front->dests.size() != 1)
        asio::buffer_copy(front->dests, asio::buffer(staging));
      return CompleteLocked(Status::Ok(), done);
  }
  return Status::Ok();
}

Status TcpTransport::Impl::CompleteLocked(const Status& status, std::vector<Done>* done) {
  Done d;
  {
    std::lock_guard<std::mutex> lock(mu);
    d.p = std::move(pending.front());
    pending.pop_front();
    in_flight_ops -= d.p->ops;
    c.reads_in_flight = in_flight_ops;
    if (status.ok()) {
      if (d.p->type == wire::FrameType::kRead) c.bytes_read += d.p->data_bytes;
    } else {
      ++c.batches_failed;
    }
  }
  const bool retry = status.IsRetry() && d.p->type == wire::FrameType::kRead;
  d.status = status;
  done->push_back(std::move(d));
  stage = Stage::kHeader;
  front = nullptr;
  if (retry) {
    // The server does not know a region id sent on this connection (docs/format/wire.md):
    // its view of the connection and ours differ. Drop it; the next Submit() reconnects
    // and re-opens every region, and the batch's owner retries (RowFetcher does).
    return Status::IOError("row server has not opened a region of this connection");
  }
  return Status::Ok();
}

Status TcpTransport::Impl::DrainLocked(uint64_t* gen_out, std::vector<Done>* done,
                                       bool until_idle) {
  int sock = -1;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!connected || fd < 0) return Status::Ok();
    if (until_idle && pending.empty()) return Status::Ok();
    sock = fd;
    *gen_out = generation;
  }
  if (read_gen != *gen_out) {
    ResetReadLocked();
    read_gen = *gen_out;
  }
  while (true) {
    auto [target, size] = StageTarget();
    while (stage_got < size && rx_begin < rx_end) {
      const size_t n = std::min(size - stage_got, rx_end - rx_begin);
      std::memcpy(target + stage_got, rx.data() + rx_begin, n);
      stage_got += n;
      rx_begin += n;
    }
    if (stage_got == size) {
      stage_got = 0;
      KVTIER_RETURN_IF_ERROR(AdvanceLocked(done));
      if (until_idle && stage == Stage::kHeader && rx_begin == rx_end) {
        std::lock_guard<std::mutex> lock(mu);
        if (pending.empty()) return Status::Ok();
      }
      continue;
    }
    // Need bytes: a large remainder goes straight to its target, else through rx.
    const bool direct = size - stage_got >= rx.size();
    uint8_t* into = direct ? target + stage_got : rx.data();
    const size_t want = direct ? size - stage_got : rx.size();
    const ssize_t got = ::recv(sock, into, want, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::Ok();
    if (got < 0)
      return Status::IOError(std::string("connection to row server lost: ") + std::strerror(errno));
    if (got == 0) return Status::IOError("connection to row server lost: end of stream");
    if (direct) {
      stage_got += static_cast<size_t>(got);
    } else {
      rx_begin = 0;
      rx_end = static_cast<size_t>(got);
    }
  }
}

bool TcpTransport::Impl::DrainOnIo(uint64_t gen) {
  if (io_reads_paused.load()) return Current(gen);
  std::vector<Done> done;
  Status st;
  uint64_t read = gen;
  {
    std::lock_guard<std::mutex> read_lock(read_mu);
    st = DrainLocked(&read, &done, false);
    QueueCallbacks(&done);
  }
  RunCallbacks();
  if (!st.ok()) {
    if (Current(read)) FailAll(st);
    return false;
  }
  return Current(gen);
}

void TcpTransport::Impl::ArmRead(uint64_t gen) {
  socket.async_wait(tcp::socket::wait_read, [this, gen](const boost::system::error_code& ec) {
    if (!Current(gen)) return;
    if (ec) return FailAll(Status::IOError("connection to row server lost: " + ec.message()));
    if (!DrainOnIo(gen)) return;
    ArmRead(gen);
    // Bytes that arrived after that drain but before the wait was armed raised their
    // (edge-triggered) event with nothing waiting: read once more now that it is armed.
    DrainOnIo(gen);
  });
}

}  // namespace kvtier::rdma
