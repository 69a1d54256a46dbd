#include "rdma/tcp_transport.h"

#include <sys/ioctl.h>

#include <future>
#include <iterator>
#include <memory>
#include <mutex>
#include <span>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "rdma/tcp_transport_impl.h"

namespace kvtier::rdma {

Status TcpTransport::Impl::Plan(std::span<const ReadOp> ops,
                                std::vector<wire::ReadOpWire>* wire_ops,
                                tcp_internal::Pending* p) const {
  if (ops.empty()) return Status::InvalidArgument("empty batch");
  if (ops.size() > options.batch_ops_max)
    return Status::InvalidArgument("batch over batch_ops_max");
  wire_ops->reserve(ops.size());
  p->dests.reserve(ops.size());
  for (const ReadOp& op : ops) {
    if (op.region >= regions.size()) return Status::InvalidArgument("unknown region");
    const tcp_internal::RegionEntry& r = regions[op.region];
    if (!r.attach_status.ok()) return r.attach_status;
    if (op.length_bytes == 0 || op.length_bytes > options.read_bytes_max) {
      return Status::InvalidArgument("op length_bytes out of range");
    }
    if (op.offset_bytes > r.info.size_bytes ||
        r.info.size_bytes - op.offset_bytes < op.length_bytes) {
      return Status::InvalidArgument("read outside region");
    }
    const auto dest = reinterpret_cast<uintptr_t>(op.dest);
    auto it = buffers_by_address.upper_bound(dest);
    if (op.dest == nullptr || it == buffers_by_address.begin() ||
        dest + op.length_bytes > std::prev(it)->first + std::prev(it)->second.size_bytes) {
      return Status::InvalidArgument("destination outside registered buffers");
    }
    wire_ops->push_back(wire::ReadOpWire{r.server_id, op.length_bytes, op.offset_bytes});
    p->dests.emplace_back(op.dest, op.length_bytes);
    p->data_bytes += op.length_bytes;
  }
  p->ops = static_cast<uint32_t>(ops.size());
  return Status::Ok();
}

StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Create(TcpEndpoint endpoint,
                                                             TransportOptions options) {
  if (endpoint.port == 0 || endpoint.host.empty()) {
    return Status::InvalidArgument("row server endpoint needs a host and a port");
  }
  if (options.batch_ops_max == 0 || options.batch_ops_max > wire::kBatchOpsMax ||
      options.read_bytes_max == 0 || options.read_bytes_max > wire::kReadBytesMax ||
      options.reads_in_flight_max == 0 || options.request_timeout_ms == 0 ||
      uint64_t{options.batch_ops_max} * options.read_bytes_max > wire::kResponseDataBytesMax) {
    return Status::InvalidArgument("transport limits out of range");
  }
  auto impl = std::make_unique<Impl>(std::move(endpoint), options);
  Impl* raw = impl.get();
  std::promise<void> started;
  try {
    raw->thread = std::thread([raw, &started] {
      raw->io_thread_id = std::this_thread::get_id();
      started.set_value();
      raw->io.run();
    });
  } catch (const std::system_error& e) {  // memory or the thread limit ran out
    return Status::Unavailable(std::string("cannot start the transport's I/O thread: ") + e.what());
  }
  started.get_future().wait();
  asio::post(raw->io, [raw] { raw->Tick(); });
  return std::unique_ptr<TcpTransport>(new TcpTransport(std::move(impl)));
}

TcpTransport::TcpTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpTransport::~TcpTransport() { Close(); }

Status TcpTransport::Connect() {
  if (impl_->OnIoThread()) return Status::IOError("cannot connect from a transport callback");
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  return impl_->EnsureConnected();
}

Status TcpTransport::Reconnect() {
  if (impl_->OnIoThread()) return Status::IOError("cannot reconnect from a transport callback");
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  {
    std::lock_guard<std::mutex> state_lock(impl_->mu);
    if (impl_->closed) return Status::Unavailable("transport closed");
  }
  impl_->RunOnIo([this] { impl_->FailAll(Status::IOError("reconnecting")); });
  return impl_->EnsureConnected();
}

StatusOr<RegionInfo> TcpTransport::OpenRegion(const RegionCredentials& credentials) {
  if (impl_->OnIoThread()) return Status::IOError("cannot open a region from a callback");
  if (credentials.region_name.empty() || credentials.region_name.size() > wire::kNameBytesMax ||
      credentials.tenant.empty() || credentials.tenant.size() > wire::kNameBytesMax) {
    return Status::InvalidArgument("region name and tenant must be 1..256 bytes");
  }
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  KVTIER_RETURN_IF_ERROR(impl_->EnsureConnected());
  KVTIER_ASSIGN_OR_RETURN(wire::OpenReply reply, impl_->OpenOnWire(credentials));
  std::lock_guard<std::mutex> state_lock(impl_->mu);
  tcp_internal::RegionEntry entry;
  entry.credentials = credentials;
  entry.server_id = reply.region_id;
  entry.info = RegionInfo{static_cast<RegionId>(impl_->regions.size()),
                          reply.size_bytes,
                          reply.row_stride_bytes,
                          reply.row_dim,
                          reply.row_begin,
                          reply.row_count};
  impl_->regions.push_back(entry);
  return entry.info;
}

StatusOr<LocalBufferId> TcpTransport::RegisterLocalBuffer(uint8_t* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty buffer");
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto start = reinterpret_cast<uintptr_t>(data);
  auto next = impl_->buffers_by_address.lower_bound(start);
  if ((next != impl_->buffers_by_address.end() && next->first < start + size_bytes) ||
      (next != impl_->buffers_by_address.begin() &&
       std::prev(next)->first + std::prev(next)->second.size_bytes > start)) {
    return Status::InvalidArgument("buffer overlaps a registered buffer");
  }
  const LocalBufferId id = impl_->next_buffer_id++;
  impl_->buffers_by_address[start] = tcp_internal::Buffer{size_bytes, id};
  impl_->buffers_by_id[id] = start;
  return id;
}

Status TcpTransport::UnregisterLocalBuffer(LocalBufferId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->buffers_by_id.find(id);
  if (it == impl_->buffers_by_id.end()) return Status::NotFound("no such buffer");
  impl_->buffers_by_address.erase(it->second);
  impl_->buffers_by_id.erase(it);
  return Status::Ok();
}

Status TcpTransport::Submit(std::span<const ReadOp> ops, ReadCallback done) {
  Impl& d = *impl_;
  bool need_connect = false;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return Status::Unavailable("transport closed");
    need_connect = !d.ready;
  }
  if (need_connect) {
    if (!d.options.reconnect_on_submit || d.OnIoThread()) {
      return Status::IOError("not connected to row server");
    }
    std::lock_guard<std::mutex> lock(d.connect_mu);
    KVTIER_RETURN_IF_ERROR(d.EnsureConnected());
  }
  auto p = std::make_unique<tcp_internal::Pending>();
  std::vector<wire::ReadOpWire> wire_ops;
  uint64_t gen = 0;
  bool kick = false;
  std::vector<uint8_t> frame;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return Status::Unavailable("transport closed");
    if (!d.ready) return Status::IOError("connection to row server lost");
    KVTIER_RETURN_IF_ERROR(d.Plan(ops, &wire_ops, p.get()));
    if (d.in_flight_ops + ops.size() > d.options.reads_in_flight_max) {
      return Status::Rejected("reads_in_flight_max reached");
    }
    p->type = wire::FrameType::kRead;
    p->request_id = d.next_request_id++;
    p->deadline_us = tcp_internal::NowUs() + uint64_t{d.options.request_timeout_ms} * 1000;
    p->done = std::move(done);
    frame = wire::BuildReadRequest(p->request_id, wire_ops);
    d.in_flight_ops += p->ops;
    d.c.reads_in_flight = d.in_flight_ops;
    ++d.c.batches_submitted;
    const size_t outbox_before = d.outbox.size();
    d.c.ops_submitted += p->ops;
    gen = d.generation;
    kick = d.AppendLocked(std::move(p), std::move(frame));
    if (outbox_before == 0 && d.outbox.empty()) ++d.c.batches_sent_inline;
  }
  if (kick) d.Kick(gen);
  return Status::Ok();
}

void TcpTransport::HoldWrites() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ++impl_->hold_depth;
}

void TcpTransport::ReleaseWrites() {
  Impl& d = *impl_;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.hold_depth == 0 || --d.hold_depth > 0) return;
    if (d.outbox.empty() || d.io_writes || !d.connected) return;
    if (d.WriteOutboxLocked()) return;
    d.io_writes = true;
    gen = d.generation;
  }
  d.Kick(gen);
}

void TcpTransport::TEST_PauseIoReads(bool paused) {
  impl_->io_reads_paused.store(paused);
  // A drain already running on the I/O thread finishes before this returns.
  if (paused) impl_->RunOnIo([] {});
  if (!paused) {
    // Replies that arrived while paused raised their edge already: read them now.
    impl_->RunOnIo([this] {
      uint64_t gen = 0;
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        gen = impl_->generation;
      }
      impl_->DrainOnIo(gen);
    });
  }
}

size_t TcpTransport::TEST_ReadableBytes() {
  std::lock_guard<std::mutex> read_lock(impl_->read_mu);
  std::lock_guard<std::mutex> lock(impl_->mu);
  int n = 0;
  if (impl_->fd < 0 || ::ioctl(impl_->fd, FIONREAD, &n) != 0) return 0;
  return static_cast<size_t>(n);
}

uint32_t TcpTransport::Poll() {
  Impl& d = *impl_;
  std::vector<Impl::Done> done;
  size_t completed = 0;
  Status st;
  uint64_t gen = 0;
  {
    // The I/O thread is reading: it completes what arrived.
    std::unique_lock<std::mutex> read_lock(d.read_mu, std::try_to_lock);
    if (!read_lock.owns_lock()) return 0;
    st = d.DrainLocked(&gen, &done, true);
    completed = done.size();
    d.QueueCallbacks(&done);
  }
  d.RunCallbacks();
  if (!st.ok()) {
    asio::post(d.io, [&d, gen, st] {
      if (d.Current(gen)) d.FailAll(st);
    });
  }
  return static_cast<uint32_t>(completed);
}

void TcpTransport::Close() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return;
    d.closed = true;
  }
  // Fail what is in flight (this also ends a connect or re-attach in progress), then wait
  // for that caller to leave: it still needs the I/O thread (its own RunOnIo calls).
  d.RunOnIo([&d] { d.FailAll(Status::Unavailable("transport closed")); });
  std::lock_guard<std::mutex> connect_lock(d.connect_mu);
  d.RunOnIo([&d] {
    d.FailAll(Status::Unavailable("transport closed"));
    d.tick.cancel();
    d.connect_timer.cancel();
  });
  d.work.reset();
  d.io.stop();
  if (d.thread.joinable()) d.thread.join();
}

TransportCounters TcpTransport::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->c;
}

}  // namespace kvtier::rdma