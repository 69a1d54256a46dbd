#include "rdma/verbs_transport.h"

#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/logging.h"
#include "rdma/verbs_device.h"

namespace kvtier::rdma {
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

uint64_t NowUs() { return DefaultSteadyClock().NowUs(); }

// The TCP control channel: one request at a time (callers serialise), replies read by a
// loop that also notices the server closing the connection (which it does when it cuts the
// queue pair). Owns an I/O thread.
class SideChannel {
 public:
  // `lost(generation)` runs on the channel's thread when a connection of that generation
  // drops by itself (not after Close()).
  explicit SideChannel(std::function<void(uint64_t)> lost) : lost_(std::move(lost)) {
    thread_ = std::thread([this] { io_.run(); });
  }
  ~SideChannel() {
    Close();
    work_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

  // Connects (closing any previous connection). Returns the new generation.
  StatusOr<uint64_t> Connect(const TcpEndpoint& endpoint, uint32_t timeout_ms) {
    Close();
    auto result = std::make_shared<std::promise<boost::system::error_code>>();
    std::future<boost::system::error_code> done = result->get_future();
    asio::post(io_, [this, endpoint, timeout_ms, result] {
      boost::system::error_code ec;
      socket_.close(ec);
      tcp::resolver resolver(io_);
      auto endpoints = resolver.resolve(endpoint.host, std::to_string(endpoint.port), ec);
      if (ec) return result->set_value(ec);
      auto connecting = std::make_shared<bool>(true);
      timer_.expires_after(std::chrono::milliseconds(timeout_ms));
      timer_.async_wait([this, connecting](const boost::system::error_code& tec) {
        if (!tec && *connecting) {
          boost::system::error_code ignored;
          socket_.close(ignored);  // aborts the connect
        }
      });
      asio::async_connect(
          socket_, endpoints,
          [this, result, connecting](const boost::system::error_code& cec, const tcp::endpoint&) {
            *connecting = false;
            timer_.cancel();
            if (!cec) {
              boost::system::error_code ignored;
              socket_.set_option(tcp::no_delay(true), ignored);
              uint64_t gen = 0;
              {
                std::lock_guard<std::mutex> lock(mu_);
                connected_ = true;
                gen = ++generation_;
              }
              ReadHeader(gen);
            }
            result->set_value(cec);
          });
    });
    const boost::system::error_code ec = done.get();
    if (ec) {
      return Status::IOError("cannot connect the verbs side channel to " + endpoint.host + ":" +
                             std::to_string(endpoint.port) + ": " + ec.message());
    }
    std::lock_guard<std::mutex> lock(mu_);
    return generation_;
  }

  // Sends one request frame and waits for its reply's data (an error reply's Status).
  StatusOr<std::vector<uint8_t>> Call(std::vector<uint8_t> frame, uint64_t request_id,
                                      wire::FrameType type, uint32_t timeout_ms) {
    auto waiter = std::make_shared<Waiter>();
    waiter->request_id = request_id;
    waiter->type = type;
    std::future<StatusOr<std::vector<uint8_t>>> reply = waiter->promise.get_future();
    uint64_t gen = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!connected_) return Status::IOError("verbs side channel not connected");
      if (waiter_ != nullptr) return Status::Internal("side channel call already in progress");
      waiter_ = waiter;
      gen = generation_;
    }
    auto bytes = std::make_shared<std::vector<uint8_t>>(std::move(frame));
    asio::post(io_, [this, gen, bytes] {
      asio::async_write(socket_, asio::buffer(*bytes),
                        [this, gen, bytes](const boost::system::error_code& ec, size_t) {
                          if (ec) Lost(gen, Status::IOError("side channel write: " + ec.message()));
                        });
    });
    if (reply.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
      asio::post(io_, [this, gen] {
        Lost(gen, Status::IOError("row server did not answer the side channel in time"));
      });
      return Status::IOError(
          "row server did not answer the side channel within "
          "request_timeout_ms");
    }
    return reply.get();
  }

  // Closes the connection without calling `lost`; with `only_gen` != 0, only when the
  // current connection is of that generation. Never call on the channel's own thread.
  void Close(uint64_t only_gen = 0) {
    std::shared_ptr<Waiter> waiter;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!connected_ || (only_gen != 0 && only_gen != generation_)) return;
      connected_ = false;
      ++generation_;
      waiter.swap(waiter_);
    }
    if (waiter != nullptr) waiter->promise.set_value(Status::IOError("side channel closed"));
    std::promise<void> closed;
    std::future<void> done = closed.get_future();
    asio::post(io_, [this, &closed] {
      boost::system::error_code ec;
      socket_.shutdown(tcp::socket::shutdown_both, ec);
      socket_.close(ec);
      closed.set_value();
    });
    done.wait();
  }

 private:
  struct Waiter {
    uint64_t request_id = 0;
    wire::FrameType type = wire::FrameType::kOpen;
    std::promise<StatusOr<std::vector<uint8_t>>> promise;
  };

  // ---- I/O thread ----
  void Lost(uint64_t gen, const Status& why) {
    std::shared_ptr<Waiter> waiter;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gen != generation_ || !connected_) return;
      connected_ = false;
      waiter.swap(waiter_);
    }
    boost::system::error_code ec;
    socket_.close(ec);
    if (waiter != nullptr) waiter->promise.set_value(why);
    lost_(gen);
  }

  void ReadHeader(uint64_t gen) {
    asio::async_read(
        socket_, asio::buffer(header_), [this, gen](const boost::system::error_code& ec, size_t) {
          if (ec) {
            return Lost(gen, Status::IOError("verbs side channel lost: " + ec.message()));
          }
          OnHeader(gen);
        });
  }

  void OnHeader(uint64_t gen) {
    if (Status st = wire::DecodeResponseHeader(header_.data(), &reply_); !st.ok()) {
      return Lost(gen, Status::IOError("bad side-channel reply: " + st.message()));
    }
    bool matches = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      matches = waiter_ != nullptr && waiter_->request_id == reply_.request_id &&
                waiter_->type == reply_.type;
    }
    if (!matches) return Lost(gen, Status::IOError("side-channel reply matches no request"));
    const uint64_t want = wire::FixedReplyDataBytes(reply_.type);
    if (reply_.code == StatusCode::kOk && (want == 0 || reply_.data_bytes != want)) {
      return Lost(gen, Status::IOError("side-channel reply has the wrong data length"));
    }
    message_.resize(reply_.message_bytes);
    data_.resize(reply_.code == StatusCode::kOk ? want : 0);
    std::array<asio::mutable_buffer, 2> bufs = {asio::buffer(message_), asio::buffer(data_)};
    asio::async_read(socket_, bufs, [this, gen](const boost::system::error_code& ec, size_t) {
      if (ec) return Lost(gen, Status::IOError("verbs side channel lost: " + ec.message()));
      std::shared_ptr<Waiter> waiter;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (gen != generation_) return;
        waiter.swap(waiter_);
      }
      if (waiter == nullptr) {
        return Lost(gen, Status::IOError("side-channel reply matches no request"));
      }
      if (reply_.code != StatusCode::kOk) {
        waiter->promise.set_value(Status(reply_.code, message_));
      } else {
        waiter->promise.set_value(data_);
      }
      ReadHeader(gen);
    });
  }

  std::function<void(uint64_t)> lost_;
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_{io_.get_executor()};
  tcp::socket socket_{io_};
  asio::steady_timer timer_{io_};
  std::thread thread_;

  std::mutex mu_;  // connected_, generation_, waiter_
  bool connected_ = false;
  uint64_t generation_ = 0;
  std::shared_ptr<Waiter> waiter_;

  // I/O thread only.
  std::array<uint8_t, wire::kHeaderBytes> header_{};
  wire::ResponseHeader reply_;
  std::string message_;
  std::vector<uint8_t> data_;
};

struct RegionEntry {
  RegionCredentials credentials;
  RegionInfo info;
  uint32_t server_id = 0;
  Status attach_status;  // non-OK when re-attaching after a reconnect failed
};

}  // namespace

struct VerbsTransport::Impl {
  Impl(TcpEndpoint e, TransportOptions o, verbs::VerbsOptions v)
      : endpoint(std::move(e)),
        options(o),
        verbs_options(std::move(v)),
        tracker(verbs_options.send_queue_depth) {}

  TcpEndpoint endpoint;
  TransportOptions options;
  verbs::VerbsOptions verbs_options;
  std::shared_ptr<verbs::VerbsZone> zone;
  std::unique_ptr<SideChannel> side;
  int wake_fd = -1;
  std::thread thread;
  std::thread::id completion_thread_id;

  std::mutex connect_mu;  // serialises Connect / Reconnect / OpenRegion / reconnecting Submit
  mutable std::mutex mu;  // everything below
  std::condition_variable cv;
  bool closed = false;
  bool stop = false;
  uint64_t side_gen = 0;  // the side channel generation the QP belongs to
  // Connected and every open region re-attached (its RemoteRegion known): only then may
  // reads be submitted. Cleared by every teardown.
  bool ready = false;
  std::unique_ptr<verbs::VerbsQp> qp;
  verbs::QpStateMachine sm;
  verbs::RemoteRegionTable remote;
  verbs::LocalKeyTable local;
  verbs::InflightTracker tracker;
  std::map<uint64_t, uint64_t> deadlines_us;  // batch seq -> deadline
  std::vector<RegionEntry> regions;           // index = client RegionId
  std::map<LocalBufferId, uint8_t*> buffers;
  LocalBufferId next_buffer_id = 1;
  uint64_t next_request_id = 1;
  uint64_t next_batch_seq = 1;
  Status failure_request;          // non-OK: the completion thread must tear down
  uint64_t failure_gen = 0;        // ... the QP of this side-channel generation
  bool reconnect_request = false;  // Reconnect(): tear down whatever is there
  uint64_t teardowns = 0;          // completed teardowns (Reconnect waits on it)
  TransportCounters c;

  bool OnCompletionThread() const { return std::this_thread::get_id() == completion_thread_id; }

  void Wake() const {
    const uint64_t one = 1;
    ssize_t n = write(wake_fd, &one, sizeof(one));
    (void)n;
  }

  // Asks the completion thread to tear down the QP of side-channel generation `gen` with
  // `why`. Caller holds mu.
  void RequestFailureLocked(uint64_t gen, const Status& why) {
    if (failure_request.ok()) {
      failure_request = why;
      failure_gen = gen;
    }
    Wake();
  }

  bool ConnectedLocked() const {
    return qp != nullptr && (sm.state() == verbs::QpState::kReadyToSend ||
                             sm.state() == verbs::QpState::kExchanging);
  }

  // ---- completion thread -----------------------------------------------------------------

  // Fails everything in flight with `why`, destroys the QP, closes the side channel.
  void Teardown(const Status& why) {
    std::vector<ReadCallback> failed;
    bool had_qp = false;
    uint64_t gen = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      had_qp = qp != nullptr;
      gen = side_gen;
      if (sm.state() != verbs::QpState::kDisconnected && sm.state() != verbs::QpState::kClosed) {
        (void)sm.Apply(verbs::QpEvent::kFailure);
      }
      failed = tracker.TakeAll();
      deadlines_us.clear();
      qp.reset();  // ibv_destroy_qp
      DrainCq();   // its flushed completions (posting is under mu: no new QP meanwhile)
      if (sm.state() == verbs::QpState::kError) (void)sm.Apply(verbs::QpEvent::kTornDown);
      remote.Clear();
      ready = false;
      c.reads_in_flight = 0;
      if (had_qp) ++c.disconnects;
      ++teardowns;
    }
    if (had_qp) side->Close(gen);  // only that connection: a caller may have reconnected
    cv.notify_all();
    if (had_qp) {
      KVTIER_LOG(kWarn) << "verbs transport: queue pair torn down: " << why.message();
    }
    for (ReadCallback& cb : failed) cb(why);
  }

  void DrainCq() {
    ibv_wc wc[32];
    while (ibv_poll_cq(zone->cq(), 32, wc) > 0) {
    }
  }

  // Polls once; returns the number of completions handled (or -1 after a teardown).
  int PollOnce() {
    ibv_wc wc[32];
    const int n = ibv_poll_cq(zone->cq(), 32, wc);
    if (n < 0) {
      Teardown(Status::IOError("ibv_poll_cq failed"));
      return -1;
    }
    std::vector<ReadCallback> done;
    Status failure;
    {
      std::lock_guard<std::mutex> lock(mu);
      const uint32_t current_qpn = qp != nullptr ? qp->qpn() : 0;
      for (int i = 0; i < n; ++i) {
        if (wc[i].qp_num != current_qpn) continue;  // a torn-down QP's flush
        if (wc[i].status != IBV_WC_SUCCESS) {
          if (failure.ok()) {
            failure = Status::IOError(std::string("RDMA READ failed: ") +
                                      verbs::WcStatusName(wc[i].status));
          }
          continue;
        }
        if (ReadCallback cb = tracker.OnCompletion(wc[i].wr_id, Status::Ok())) {
          deadlines_us.erase(verbs::WrIdBatch(wc[i].wr_id));
          done.push_back(std::move(cb));
        }
      }
      c.reads_in_flight = tracker.ops_in_flight();
    }
    for (ReadCallback& cb : done) cb(Status::Ok());
    if (!failure.ok()) {
      Teardown(failure);
      return -1;
    }
    return n;
  }

  void HandleAsyncEvents() {
    ibv_async_event ev;
    while (ibv_get_async_event(zone->context(), &ev) == 0) {
      bool fatal = false;
      switch (ev.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR: {
          std::lock_guard<std::mutex> lock(mu);
          fatal = qp != nullptr && ev.element.qp != nullptr && ev.element.qp->qp_num == qp->qpn();
          break;
        }
        case IBV_EVENT_CQ_ERR:
        case IBV_EVENT_DEVICE_FATAL:
        case IBV_EVENT_PORT_ERR:
          fatal = true;
          break;
        default:
          break;
      }
      const std::string name = ibv_event_type_str(ev.event_type);
      ibv_ack_async_event(&ev);
      if (fatal) Teardown(Status::IOError("queue pair async event: " + name));
    }
  }

  // Handles a requested failure and expired deadlines.
  void CheckFailuresAndDeadlines() {
    Status why;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (reconnect_request) {
        why = Status::IOError("reconnecting");
        reconnect_request = false;
        failure_request = Status::Ok();
      } else if (!failure_request.ok()) {
        if (failure_gen == side_gen) why = failure_request;
        failure_request = Status::Ok();
      } else if (!deadlines_us.empty() && deadlines_us.begin()->second < NowUs()) {
        why = Status::IOError("no RDMA completion within request_timeout_ms");
      }
    }
    if (!why.ok()) Teardown(why);
  }

  void CompletionLoop() {
    using Clock = std::chrono::steady_clock;
    auto idle_since = Clock::now();
    const auto spin = std::chrono::microseconds(verbs_options.poll_spin_us);
    const int wait_ms =
        static_cast<int>(std::clamp<uint32_t>(options.request_timeout_ms / 4, 1, 100));
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) break;
      }
      if (PollOnce() != 0) {
        idle_since = Clock::now();
        CheckFailuresAndDeadlines();
        continue;
      }
      if (Clock::now() - idle_since < spin) continue;
      // Arm, re-poll (a completion may have landed before arming), then sleep.
      if (ibv_req_notify_cq(zone->cq(), 0) != 0) {
        Teardown(Status::IOError("ibv_req_notify_cq failed"));
      } else if (PollOnce() != 0) {
        idle_since = Clock::now();
        continue;
      }
      pollfd fds[3] = {
          {zone->completion_fd(), POLLIN, 0}, {zone->async_fd(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
      (void)poll(fds, 3, wait_ms);
      if (fds[0].revents & POLLIN) {
        ibv_cq* ev_cq = nullptr;
        void* ev_ctx = nullptr;
        if (ibv_get_cq_event(zone->channel(), &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
      }
      if (fds[1].revents & POLLIN) HandleAsyncEvents();
      if (fds[2].revents & POLLIN) {
        uint64_t v = 0;
        ssize_t n = read(wake_fd, &v, sizeof(v));
        (void)n;
      }
      CheckFailuresAndDeadlines();
      idle_since = Clock::now();
    }
    Teardown(Status::Unavailable("transport closed"));
  }

  // ---- caller threads (hold connect_mu) -------------------------------------------------

  StatusOr<std::vector<uint8_t>> Call(std::vector<uint8_t> frame, uint64_t request_id,
                                      wire::FrameType type) {
    return side->Call(std::move(frame), request_id, type, options.request_timeout_ms);
  }

  uint64_t NextRequestId() {
    std::lock_guard<std::mutex> lock(mu);
    return next_request_id++;
  }

  StatusOr<wire::OpenReply> OpenOnWire(const RegionCredentials& cred) {
    const uint64_t id = NextRequestId();
    KVTIER_ASSIGN_OR_RETURN(
        std::vector<uint8_t> data,
        Call(wire::BuildOpenRequest(id, {cred.token, cred.region_name, cred.tenant}), id,
             wire::FrameType::kOpen));
    wire::OpenReply reply;
    KVTIER_RETURN_IF_ERROR(wire::DecodeOpenReply(data, &reply));
    return reply;
  }

  // kVerbsConnect with this QP's params; on OK the QP goes RTR/RTS towards the server's.
  Status ExchangeQpParams(bool probe_only) {
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

  StatusOr<verbs::RemoteRegion> RegionOnWire(uint32_t server_id) {
    const uint64_t id = NextRequestId();
    KVTIER_ASSIGN_OR_RETURN(
        std::vector<uint8_t> data,
        Call(wire::BuildVerbsRegionRequest(id, server_id), id, wire::FrameType::kVerbsRegion));
    verbs::RemoteRegion r;
    KVTIER_RETURN_IF_ERROR(verbs::DecodeRemoteRegion(data, &r));
    return r;
  }

  // Drops a half-made connection (nothing can be in flight: the QP never reached RTS
  // since the last teardown).
  void DropConnection() {
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

  // Opens region `credentials` on the wire and fetches its RemoteRegion, bringing the QP to
  // RTS first if this is the connection's first region.
  StatusOr<std::pair<wire::OpenReply, verbs::RemoteRegion>> Attach(
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

  Status EnsureConnected() {
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
      for (const RegionEntry& r : regions) creds.push_back(r.credentials);
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
      RegionEntry& r = regions[i];
      if (!attached.ok()) {
        r.attach_status = attached.status().WithContext("re-attaching region after reconnect");
        continue;
      }
      const wire::OpenReply& reply = attached->first;
      if (reply.size_bytes != r.info.size_bytes ||
          reply.row_stride_bytes != r.info.row_stride_bytes ||
          reply.row_begin != r.info.row_begin) {
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
};

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
  impl->side = std::make_unique<SideChannel>([raw](uint64_t gen) {
    std::lock_guard<std::mutex> lock(raw->mu);
    raw->RequestFailureLocked(gen, Status::IOError("verbs side channel to row server lost"));
  });
  std::promise<void> started;
  raw->thread = std::thread([raw, &started] {
    raw->completion_thread_id = std::this_thread::get_id();
    started.set_value();
    raw->CompletionLoop();
  });
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
  RegionEntry entry;
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
  d.deadlines_us[seq] = NowUs() + uint64_t{d.options.request_timeout_ms} * 1000;
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
