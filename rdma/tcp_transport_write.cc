// TcpTransport's writes (tcp_transport_impl.h): a request's frame joins the outbox with its
// Pending; the submitting thread sends the outbox itself (one non-blocking sendmsg) unless the
// I/O thread is writing, which then takes the outbox with gathered asynchronous writes.
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "rdma/tcp_transport_impl.h"

namespace kvtier::rdma {

bool TcpTransport::Impl::AppendLocked(std::unique_ptr<tcp_internal::Pending> p,
                                      std::vector<uint8_t> frame) {
  const bool may_hold = p->type == wire::FrameType::kRead;
  pending.push_back(std::move(p));
  outbox.push_back(std::move(frame));
  if (io_writes) return false;                   // it takes the outbox when its write completes
  if (hold_depth > 0 && may_hold) return false;  // ReleaseWrites() sends it
  if (WriteOutboxLocked()) return false;
  io_writes = true;
  return true;
}

bool TcpTransport::Impl::WriteOutboxLocked() {
  if (fd < 0) return false;
  constexpr size_t kIovMax = 64;
  while (!outbox.empty()) {
    iovec iov[kIovMax];
    size_t n = 0;
    for (; n < outbox.size() && n < kIovMax; ++n) {
      iov[n].iov_base = outbox[n].data();
      iov[n].iov_len = outbox[n].size();
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    const ssize_t sent = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    ++c.sends;
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;  // full (EAGAIN) or broken: the I/O thread's write decides
    size_t left = static_cast<size_t>(sent), done = 0;
    while (done < outbox.size() && left >= outbox[done].size()) left -= outbox[done++].size();
    outbox.erase(outbox.begin(), outbox.begin() + static_cast<std::ptrdiff_t>(done));
    if (left > 0) {  // a frame went out in part: keep its tail
      outbox.front().erase(outbox.front().begin(),
                           outbox.front().begin() + static_cast<std::ptrdiff_t>(left));
      return false;
    }
  }
  return true;
}

void TcpTransport::Impl::Kick(uint64_t gen) {
  asio::post(io, [this, gen] { Flush(gen); });
}

void TcpTransport::Impl::Flush(uint64_t gen) {
  if (!TakeOutbox(gen)) return;
  WriteNext(gen);
}

bool TcpTransport::Impl::TakeOutbox(uint64_t gen) {
  std::lock_guard<std::mutex> lock(mu);
  if (gen != generation || !connected) return false;  // those frames' batches already failed
  for (auto& f : outbox) write_queue.push_back(std::move(f));
  outbox.clear();
  if (write_queue.empty() && !writing) {
    io_writes = false;
    return false;
  }
  if (!writing) ++c.sends;  // WriteNext writes them
  return true;
}

void TcpTransport::Impl::WriteNext(uint64_t gen) {
  if (writing || write_queue.empty()) return;
  writing = true;
  writing_now.swap(write_queue);
  write_buffers.clear();
  for (const auto& f : writing_now) write_buffers.emplace_back(asio::buffer(f));
  asio::async_write(socket, write_buffers,
                    [this, gen](const boost::system::error_code& ec, size_t) {
                      if (!Current(gen)) return;
                      writing = false;
                      if (ec) return FailAll(Status::IOError("row server write: " + ec.message()));
                      writing_now.clear();
                      if (TakeOutbox(gen)) WriteNext(gen);
                    });
}

}  // namespace kvtier::rdma
