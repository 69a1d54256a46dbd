// VerbsTransport (verbs_transport.h): the Transport interface over the state in
// verbs_transport_impl.h: Create, Connect / Reconnect, OpenRegion, local buffers, Submit,
// Close, counters.
#include "rdma/verbs_transport.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "rdma/verbs_transport_impl.h"

namespace kvtier::rdma {

StatusOr<std::unique_ptr<VerbsTransport>> VerbsTransport::Create(
    TcpEndpoint endpoint, TransportOptions options, verbs::VerbsOptions verbs_options) {
  if (endpoint.port == 0 || endpoint.host.empty()) {
    return Status::InvalidArgument("row server endpoint needs a host and a port");
  }
  if (options.batch_ops_max == 0 || options.batch_ops_max > wire::kBatchOpsMax ||
      options.read_bytes_max == 0 || options.read_bytes_max > wire::kReadBytesMax ||
      options.reads_in_flight_max == 0 || options.request_timeout_ms == 0) {
    return Status::InvalidArgument("transport limits out of range");
  }
  // Every batch must fit the send queue on its own (WRs <= ops after merging), and every
  // signaled completion in flight must fit the CQ.
  if (verbs_options.send_queue_depth < options.batch_ops_max ||
      verbs_options.cq_depth < verbs_options.send_queue_depth) {
    return Status::InvalidArgument("verbs send_queue_depth must be in [batch_ops_max, cq_depth]");
  }
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<verbs::VerbsZone> zone,
                          verbs::VerbsZone::Open(verbs_options));
  auto impl = std::make_unique<Impl>(std::move(endpoint), options, std::move(verbs_options));
  impl->zone = std::move(zone);
  impl->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0) return Status::IOError("eventfd failed");
  Impl* raw = impl.get();
  std::promise<void> started;
  try {
    impl->side = std::make_unique<internal::SideChannel>([raw](uint64_t gen) {
      std::lock_guard<std::mutex> lock(raw->mu);
      raw->RequestFailureLocked(gen, Status::IOError("verbs side channel to row server lost"));
    });
    raw->thread = std::thread([raw, &started] {
      raw->completion_thread_id = std::this_thread::get_id();
      started.set_value();
      raw->CompletionLoop();
    });
  } catch (const std::system_error& e) {  // memory or the thread limit ran out
    close(impl->wake_fd);                 // the side channel (if made) stops with impl
    return Status::Unavailable(std::string("cannot start the transport's threads: ") + e.what());
  }
  started.get_future().wait();
  return std::unique_ptr<VerbsTransport>(new VerbsTransport(std::move(impl)));
}

VerbsTransport::VerbsTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

VerbsTransport::~VerbsTransport() {
  Close();
  impl_->side.reset();
  if (impl_->wake_fd >= 0) close(impl_->wake_fd);
}

Status VerbsTransport::Connect() {
  if (impl_->OnCompletionThread()) return Status::IOError("cannot connect from a callback");
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  return impl_->EnsureConnected();
}

Status VerbsTransport::Reconnect() {
  Impl& d = *impl_;
  if (d.OnCompletionThread()) return Status::IOError("cannot reconnect from a callback");
  std::lock_guard<std::mutex> lock(d.connect_mu);
  {
    std::unique_lock<std::mutex> state_lock(d.mu);
    if (d.closed) return Status::Unavailable("transport closed");
    const uint64_t before = d.teardowns;
    d.reconnect_request = true;
    d.Wake();
    d.cv.wait(state_lock, [&] { return d.teardowns != before || d.stop; });
  }
  return d.EnsureConnected();
}

StatusOr<RegionInfo> VerbsTransport::OpenRegion(const RegionCredentials& credentials) {
  Impl& d = *impl_;
  if (d.OnCompletionThread()) return Status::IOError("cannot open a region from a callback");
  if (credentials.region_name.empty() || credentials.region_name.size() > wire::kNameBytesMax ||
      credentials.tenant.empty() || credentials.tenant.size() > wire::kNameBytesMax) {
    return Status::InvalidArgument("region name and tenant must be 1..256 bytes");
  }
  std::lock_guard<std::mutex> lock(d.connect_mu);
  {
    std::lock_guard<std::mutex> state_lock(d.mu);
    if (!d.regions.empty() && d.regions.front().credentials.tenant != credentials.tenant) {
      return Status::InvalidArgument(
          "a verbs transport serves one tenant (one trust zone); use another transport");
    }
  }
  KVTIER_RETURN_IF_ERROR(d.EnsureConnected());
  auto attached = d.Attach(credentials);
  if (!attached.ok()) {
    if (attached.status().IsIOError() || attached.status().IsRetry()) d.DropConnection();
    return attached.status();
  }
  std::lock_guard<std::mutex> state_lock(d.mu);
  const wire::OpenReply& reply = attached->first;
  internal::RegionEntry entry;
  entry.credentials = credentials;
  entry.server_id = reply.region_id;
  entry.info = RegionInfo{static_cast<RegionId>(d.regions.size()),
                          reply.size_bytes,
                          reply.row_stride_bytes,
                          reply.row_dim,
                          reply.row_begin,
                          reply.row_count};
  KVTIER_RETURN_IF_ERROR(d.remote.Add(entry.info.id, attached->second));
  d.regions.push_back(entry);
  return entry.info;
}

StatusOr<LocalBufferId> VerbsTransport::RegisterLocalBuffer(uint8_t* data, size_t size_bytes) {
  Impl& d = *impl_;
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty buffer");
  std::lock_guard<std::mutex> lock(d.mu);
  KVTIER_ASSIGN_OR_RETURN(uint32_t lkey, d.zone->RegisterLocalWritable(data, size_bytes));
  const LocalBufferId id = d.next_buffer_id++;
  if (Status st = d.local.Add(id, reinterpret_cast<uintptr_t>(data), size_bytes, lkey); !st.ok()) {
    (void)d.zone->Deregister(data);
    return st;
  }
  d.buffers[id] = data;
  return id;
}

Status VerbsTransport::UnregisterLocalBuffer(LocalBufferId id) {
  Impl& d = *impl_;
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.buffers.find(id);
  if (it == d.buffers.end()) return Status::NotFound("no such buffer");
  KVTIER_RETURN_IF_ERROR(d.local.Remove(id));
  uint8_t* data = it->second;
  d.buffers.erase(it);
  return d.zone->Deregister(data);
}

Status VerbsTransport::Submit(std::span<const ReadOp> ops, ReadCallback done) {
  Impl& d = *impl_;
  bool need_connect = false;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return Status::Unavailable("transport closed");
    need_connect = !(d.ready && d.ConnectedLocked());
  }
  if (need_connect) {
    if (!d.options.reconnect_on_submit || d.OnCompletionThread()) {
      return Status::IOError("not connected to row server");
    }
    std::lock_guard<std::mutex> lock(d.connect_mu);
    KVTIER_RETURN_IF_ERROR(d.EnsureConnected());
  }
  if (ops.empty()) return Status::InvalidArgument("empty batch");
  if (ops.size() > d.options.batch_ops_max) {
    return Status::InvalidArgument("batch over batch_ops_max");
  }
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.closed) return Status::Unavailable("transport closed");
  uint64_t bytes = 0;
  for (const ReadOp& op : ops) {
    if (op.region >= d.regions.size()) return Status::InvalidArgument("unknown region");
    if (!d.regions[op.region].attach_status.ok()) return d.regions[op.region].attach_status;
    if (op.length_bytes == 0 || op.length_bytes > d.options.read_bytes_max) {
      return Status::InvalidArgument("op length_bytes out of range");
    }
    bytes += op.length_bytes;
  }
  if (!d.ready || d.sm.state() != verbs::QpState::kReadyToSend) {
    return Status::IOError("queue pair not ready (connection to row server lost)");
  }
  if (d.tracker.ops_in_flight() + ops.size() > d.options.reads_in_flight_max) {
    return Status::Rejected("reads_in_flight_max reached");
  }
  const uint64_t seq = d.next_batch_seq++;
  std::vector<std::vector<verbs::PlannedRead>> chains;
  KVTIER_RETURN_IF_ERROR(verbs::PlanReadChains(ops, d.remote, d.local,
                                               d.verbs_options.send_queue_depth,
                                               d.options.read_bytes_max, seq, &chains));
  uint32_t wrs = 0;
  for (const auto& chain : chains) wrs += static_cast<uint32_t>(chain.size());
  Impl* raw = &d;
  ReadCallback wrapped = [raw, bytes, done = std::move(done)](const Status& s) {
    {
      std::lock_guard<std::mutex> lock(raw->mu);
      if (s.ok()) {
        raw->c.bytes_read += bytes;
      } else {
        ++raw->c.batches_failed;
      }
    }
    if (done) done(s);
  };
  KVTIER_RETURN_IF_ERROR(d.tracker.Add(seq, static_cast<uint32_t>(chains.size()), wrs,
                                       static_cast<uint32_t>(ops.size()), std::move(wrapped)));
  d.deadlines_us[seq] = internal::NowUs() + uint64_t{d.options.request_timeout_ms} * 1000;
  ++d.c.batches_submitted;
  d.c.ops_submitted += ops.size();
  d.c.reads_in_flight = d.tracker.ops_in_flight();
  for (const auto& chain : chains) {
    if (Status st = d.qp->PostReadChain(chain); !st.ok()) {
      // The batch is accepted; the completion thread fails it (and everything else in
      // flight) and tears the queue pair down.
      d.RequestFailureLocked(d.side_gen, st);
      break;
    }
  }
  return Status::Ok();
}

void VerbsTransport::Close() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return;
    d.closed = true;
  }
  // Wait for a connect in progress (bounded by connect_timeout_ms + request_timeout_ms per
  // side-channel call); later ones see `closed`.
  std::lock_guard<std::mutex> connect_lock(d.connect_mu);
  {
    std::lock_guard<std::mutex> lock(d.mu);
    d.stop = true;
    (void)d.sm.Apply(verbs::QpEvent::kClose);
    d.Wake();
  }
  if (d.thread.joinable()) d.thread.join();  // the loop's exit fails in-flight: Unavailable
  d.side->Close();
}

TransportCounters VerbsTransport::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->c;
}

verbs::QpState VerbsTransport::qp_state() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->sm.state();
}

Status VerbsTransport::TEST_ForceQpError() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->qp == nullptr) return Status::IOError("no queue pair");
  return impl_->qp->ForceError();
}

}  // namespace kvtier::rdma
