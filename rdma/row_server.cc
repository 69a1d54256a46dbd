#include "rdma/row_server.h"

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "rdma/engram_table.h"
#include "rdma/verbs_plan.h"
#ifdef KVTIER_WITH_RDMA
#include "rdma/verbs_device.h"
#endif

namespace kvtier::rdma {
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

struct Grant {
  std::string region_name;
  std::string tenant;
  uint64_t expiry_us = 0;
};

// A region: an Engram table's rows (a read-only mapping) or caller memory (RegisterMemory).
struct Table {
  uint32_t id = 0;
  std::string name;
  EngramTableHeader header;           // what OPEN reports
  std::span<const uint8_t> rows;      // the readable bytes, offset 0 = rows.data()
  std::shared_ptr<const void> owner;  // keeps `rows` alive
  RowServer::MemoryGuard guard;       // RegisterMemory's: TCP copies of `rows` run inside it
};

}  // namespace

class RowServerSession;

struct RowServer::State {
  explicit State(RowServerOptions o) : options(std::move(o)) {
    clock = options.clock != nullptr ? options.clock : &DefaultSteadyClock();
  }
  RowServerOptions options;
  const Clock* clock;

  std::mutex mu;  // protects tables, grants, sessions, io, acceptor lifetime
  std::map<std::string, std::shared_ptr<const Table>> tables_by_name;
  std::map<uint32_t, std::shared_ptr<const Table>> tables_by_id;
  std::map<wire::GrantToken, Grant> grants;
  std::list<std::weak_ptr<RowServerSession>> sessions;
  // The io_context serving; null before Start() and after Stop(). Its run() may be called by
  // several threads (kvtierd's server.io_threads), so nothing below runs outside a strand:
  // the acceptor's handlers, Stop()'s closing and the registration sweep run on the
  // acceptor's strand (acceptor->get_executor()); each session's handlers and its Close()
  // run on the session's own strand (its socket's executor).
  asio::io_context* io = nullptr;
  std::unique_ptr<asio::io_context> own_io;
  std::unique_ptr<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::atomic<uint16_t> port{0};
  bool started = false;

  std::atomic<uint64_t> connections_accepted{0}, connections_active{0}, connections_refused{0},
      malformed_frames{0}, batches_served{0}, ops_served{0}, bytes_served{0}, permission_denied{0},
      verbs_unavailable{0}, verbs_qps_created{0}, verbs_qps_cut{0}, verbs_registrations_cut{0},
      unattached_closed{0}, bodies_timed_out{0};

#ifdef KVTIER_WITH_RDMA
  // Declared after the tables: zones (and their MRs of table rows) go first.
  std::mutex verbs_mu;                                             // protects the members below
  int devices_present = -1;                                        // -1: not probed yet
  std::map<std::string, std::shared_ptr<verbs::VerbsZone>> zones;  // by tenant (trust zone)
  // Table rows registered for remote reads: one MR per grant (verbs_plan.h says why).
  verbs::GrantRegistrations registrations{
      options.verbs_registrations_max,
      [this](const std::string& tenant, const verbs::RemoteRegion& r) {
        // verbs_mu is held (every GrantRegistrations call is made under it).
        auto it = zones.find(tenant);
        if (it == zones.end()) return;
        if (Status st = it->second->DeregisterRemote(r.rkey); !st.ok()) {
          KVTIER_LOG(kWarn) << "row server: deregistering a grant's table rows failed: "
                            << st.ToString();
        }
        verbs_registrations_cut.fetch_add(1);
      }};
  std::unique_ptr<asio::steady_timer> registration_sweep;  // on the server's io_context

  bool VerbsServed() {
    if (!options.verbs_enabled) return false;
    std::lock_guard<std::mutex> lock(verbs_mu);
    if (devices_present < 0) devices_present = verbs::ListDevices().empty() ? 0 : 1;
    return devices_present == 1;
  }
  StatusOr<std::shared_ptr<verbs::VerbsZone>> ZoneFor(const std::string& tenant) {
    std::lock_guard<std::mutex> lock(verbs_mu);
    auto it = zones.find(tenant);
    if (it != zones.end()) return it->second;
    KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<verbs::VerbsZone> zone,
                            verbs::VerbsZone::Open(options.verbs));
    zones[tenant] = zone;
    return zone;
  }
  // The registration of `table`'s rows for grant `token` (of `tenant`, expiring at
  // expiry_us), made on first use: exactly the rows, never the header or anything else of
  // the mapping.
  StatusOr<verbs::RemoteRegion> RegionFor(const wire::GrantToken& token, const std::string& tenant,
                                          uint64_t expiry_us, verbs::VerbsZone& zone,
                                          const Table& table) {
    std::lock_guard<std::mutex> lock(verbs_mu);
    if (const verbs::GrantRegistrations::Entry* e = registrations.Find(token)) {
      if (e->tenant != tenant || e->table_id != table.id) {
        return Status::PermissionDenied("the grant does not cover this region");
      }
      return e->region;
    }
    const std::span<const uint8_t> rows = table.rows;
    KVTIER_ASSIGN_OR_RETURN(verbs::RemoteRegion r,
                            zone.RegisterRemoteReadable(rows.data(), rows.size()));
    if (Status st = registrations.Add(token, {tenant, table.id, expiry_us, r}); !st.ok()) {
      (void)zone.DeregisterRemote(r.rkey);
      return st;
    }
    return r;
  }
  // A grant ended (revoked, or found invalid after registering): cut its rkey everywhere.
  void DropRegistration(const wire::GrantToken& token) {
    std::lock_guard<std::mutex> lock(verbs_mu);
    registrations.Revoke(token);
  }
  // Every verbs_grant_check_ms: deregister the MRs of expired grants, whether or not a
  // connection still uses them. Runs on the acceptor's strand, as does Stop()'s reset of
  // the timer, which ends the loop (on another thread the reset could free the timer while
  // this re-arms it).
  void SweepRegistrationsLater(const std::shared_ptr<State>& self) {
    if (registration_sweep == nullptr) return;
    registration_sweep->expires_after(
        std::chrono::milliseconds(std::max<uint32_t>(1, options.verbs_grant_check_ms)));
    registration_sweep->async_wait(
        [weak = std::weak_ptr<State>(self)](const boost::system::error_code& ec) {
          auto state = weak.lock();
          if (ec || state == nullptr) return;
          {
            std::lock_guard<std::mutex> lock(state->verbs_mu);
            state->registrations.ExpireUntil(state->clock->NowUs());
          }
          state->SweepRegistrationsLater(state);
        });
  }
#else
  bool VerbsServed() { return false; }
#endif

  // Whether `token` currently grants `tenant` access to `region_name`.
  bool GrantValid(const wire::GrantToken& token, const std::string& region_name,
                  const std::string& tenant) {
    return GrantExpiryUs(token, region_name, tenant) != 0;
  }
  // The expiry of the grant if it is valid now (as GrantValid), else 0.
  uint64_t GrantExpiryUs(const wire::GrantToken& token, const std::string& region_name,
                         const std::string& tenant) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = grants.find(token);
    const bool valid = it != grants.end() && it->second.region_name == region_name &&
                       it->second.tenant == tenant && clock->NowUs() < it->second.expiry_us;
    return valid ? it->second.expiry_us : 0;
  }
  std::shared_ptr<const Table> FindTable(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = tables_by_name.find(name);
    return it == tables_by_name.end() ? nullptr : it->second;
  }
};

// One client connection: reads a frame, answers it, repeats. All handlers run on the
// session's strand (the socket's executor, which the timers share); one request is handled
// at a time (clients pipeline through the socket buffer). Close() closes the socket, so it
// must run on that strand too: Stop() posts it there. Called on two threads at once (the
// session closing itself on a client's EOF, Stop() closing every session), it closed one
// socket twice concurrently and corrupted the reactor's descriptor state.
class RowServerSession : public std::enable_shared_from_this<RowServerSession> {
 public:
  RowServerSession(tcp::socket socket, std::shared_ptr<RowServer::State> state)
      : socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        verbs_timer_(socket_.get_executor()),
        watch_timer_(socket_.get_executor()),
        state_(std::move(state)) {}
  ~RowServerSession() { state_->connections_active.fetch_sub(1); }

  void Start() {
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
  // The session's strand: Start() and Close() are called on it only.
  tcp::socket::executor_type executor() { return socket_.get_executor(); }
  void Close() {
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

 private:
  struct Attached {
    std::shared_ptr<const Table> table;
    wire::GrantToken token;
    std::string tenant;
  };

  // Checks the connection's deadlines every watch_period_ (a quarter of the shortest timeout,
  // so a deadline is enforced within a quarter more than it): no region attached
  // attach_timeout_ms after accept, or a request body unfinished body_timeout_ms after its
  // header, closes the connection. One timer per connection for its life, none per request
  // (arming a timer per request would cost the row path timer-queue updates and system calls).
  void Watch() {
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

  void ReadHeader() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(header_),
                     [self](const boost::system::error_code& ec, size_t) {
                       if (ec) return self->Close();
                       self->OnHeader();
                     });
  }

  void OnHeader() {
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

  void Malformed(const Status& why) {
    state_->malformed_frames.fetch_add(1);
    KVTIER_LOG(kWarn) << "row server: closing connection after a malformed frame: "
                      << why.ToString();
    Close();
  }

  void OnBody() {
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

  Status NoDevice() {
    state_->verbs_unavailable.fetch_add(1);
    return Status::Unavailable("row server has no RDMA device");
  }

  void HandleVerbsConnect() {
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

  void HandleVerbsRegion() {
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

  // While a queue pair exists: every verbs_grant_check_ms, destroy it (and close the
  // connection) when a grant of a region exposed over it has expired or been revoked.
  void CheckVerbsGrantsLater() {
    verbs_timer_.expires_after(
        std::chrono::milliseconds(std::max<uint32_t>(1, state_->options.verbs_grant_check_ms)));
    auto self = shared_from_this();
    verbs_timer_.async_wait([self](const boost::system::error_code& ec) {
      if (ec) return;
      for (uint32_t id : self->verbs_regions_) {
        auto it = self->attached_.find(id);
        if (it == self->attached_.end() ||
            !self->state_->GrantValid(it->second.token, it->second.table->name,
                                      it->second.tenant)) {
          self->state_->verbs_qps_cut.fetch_add(1);
          KVTIER_LOG(kInfo) << "row server: a grant behind a queue pair lapsed; destroying "
                               "the queue pair and closing its connection";
          return self->Close();
        }
      }
      self->CheckVerbsGrantsLater();
    });
  }

  void HandleOpen() {
    wire::OpenRequest req;
    if (Status st = wire::DecodeOpenRequest(body_, &req); !st.ok()) return Malformed(st);
    std::shared_ptr<const Table> table = state_->FindTable(req.region_name);
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
    const uint32_t delay_ms = state_->options.TEST_open_delay_ms;
    if (delay_ms == 0) return Reply(Status::Ok(), std::move(data));
    timer_.expires_after(std::chrono::milliseconds(delay_ms));
    auto self = shared_from_this();
    timer_.async_wait([self, data = std::move(data)](const boost::system::error_code& ec) mutable {
      if (ec) return self->Close();
      self->Reply(Status::Ok(), std::move(data));
    });
  }

  // Checks every op; on success fills `out` with buffers into the mapped tables.
  // *guarded: a table of the batch whose copies must run inside its guard (RegisterMemory).
  Status CheckRead(const std::vector<wire::ReadOpWire>& ops, std::vector<asio::const_buffer>* out,
                   const Table** guarded) {
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

  void HandleRead() {
    std::vector<wire::ReadOpWire> ops;
    if (Status st = wire::DecodeReadOps(body_, request_.op_count, &ops); !st.ok()) {
      return Malformed(st);
    }
    std::vector<asio::const_buffer> data;
    data.reserve(ops.size());
    const Table* guarded = nullptr;
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
    const uint32_t delay_ms = state_->options.TEST_response_delay_ms;
    if (delay_ms == 0) return Reply(Status::Ok(), std::move(data));
    timer_.expires_after(std::chrono::milliseconds(delay_ms));
    auto self = shared_from_this();
    timer_.async_wait([self, data = std::move(data)](const boost::system::error_code& ec) mutable {
      if (ec) return self->Close();
      self->Reply(Status::Ok(), std::move(data));
    });
  }

  void Reply(const Status& status, std::vector<asio::const_buffer> data) {
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

  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::steady_timer verbs_timer_;
  asio::steady_timer watch_timer_;  // Watch(): the attach and body deadlines
  std::chrono::steady_clock::duration watch_period_{};
  std::chrono::steady_clock::time_point accepted_at_{};
  std::chrono::steady_clock::time_point body_started_at_{};
  bool reading_body_ = false;  // a request's body is being read (since body_started_at_)
  std::shared_ptr<RowServer::State> state_;
  std::array<uint8_t, wire::kHeaderBytes> header_{};
  std::array<uint8_t, wire::kHeaderBytes> response_header_{};
  std::array<uint8_t, wire::kOpenReplyBytes> open_reply_{};
  wire::RequestHeader request_;
  std::vector<uint8_t> body_;
  std::string message_;
  std::vector<uint8_t> reply_data_;  // a read batch's rows, contiguous (HandleRead)
  std::map<uint32_t, Attached> attached_;
  std::set<uint32_t> verbs_regions_;  // table ids whose RemoteRegion this connection got
  std::array<uint8_t, std::max(wire::kQpParamsBytes, wire::kRemoteRegionBytes)> verbs_reply_{};
#ifdef KVTIER_WITH_RDMA
  std::shared_ptr<verbs::VerbsZone> zone_;
  std::unique_ptr<verbs::VerbsQp> qp_;
  std::string qp_tenant_;
#endif
};

namespace {

// Accepts the next connection on `io` (the acceptor's handler runs on its strand; each
// accepted socket gets a strand of its own, its session's).
void Accept(std::shared_ptr<RowServer::State> state, asio::io_context* io) {
  tcp::acceptor* acceptor = state->acceptor.get();
  if (acceptor == nullptr) return;  // stopped (Stop() frees it on this strand)
  acceptor->async_accept(
      asio::make_strand(*io), [state, io](const boost::system::error_code& ec, tcp::socket socket) {
        if (ec == asio::error::operation_aborted) return;
        {
          std::lock_guard<std::mutex> lock(state->mu);
          if (state->acceptor == nullptr || !state->acceptor->is_open()) return;
        }
        if (!ec) {
          if (state->connections_active.load() >= state->options.connections_max) {
            state->connections_refused.fetch_add(1);
            boost::system::error_code ignored;
            socket.close(ignored);
          } else {
            boost::system::error_code ignored;
            socket.set_option(tcp::no_delay(true), ignored);
            state->connections_accepted.fetch_add(1);
            state->connections_active.fetch_add(1);
            auto session = std::make_shared<RowServerSession>(std::move(socket), state);
            {
              std::lock_guard<std::mutex> lock(state->mu);
              state->sessions.remove_if(
                  [](const std::weak_ptr<RowServerSession>& w) { return w.expired(); });
              state->sessions.push_back(session);
            }
            // On the session's strand; a close Stop() posts later runs after it.
            asio::post(session->executor(), [session] { session->Start(); });
          }
        }
        Accept(state, io);
      });
}

wire::GrantToken RandomToken() {
  std::random_device rd;  // getrandom(2) on Linux
  wire::GrantToken t;
  for (size_t i = 0; i < t.size(); i += 4) {
    const uint32_t v = rd();
    for (size_t j = 0; j < 4; ++j) t[i + j] = static_cast<uint8_t>(v >> (8 * j));
  }
  return t;
}

}  // namespace

RowServer::RowServer(RowServerOptions options)
    : state_(std::make_shared<State>(std::move(options))) {}

RowServer::~RowServer() { Stop(); }

Status RowServer::RegisterTable(const std::string& name, const std::string& path) {
  if (name.empty() || name.size() > wire::kNameBytesMax) {
    return Status::InvalidArgument("region name must be 1..256 bytes");
  }
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<const MappedTable> mapped, MappedTable::Open(path));
  auto table = std::make_shared<Table>();
  table->header = mapped->header();
  table->rows = mapped->rows();
  table->owner = std::move(mapped);
  return AddRegion(name, std::move(table));
}

Status RowServer::RegisterMemory(const std::string& name, std::span<const uint8_t> bytes,
                                 uint32_t stride_bytes, std::shared_ptr<const void> owner,
                                 MemoryGuard guard) {
  if (name.empty() || name.size() > wire::kNameBytesMax) {
    return Status::InvalidArgument("region name must be 1..256 bytes");
  }
  if (bytes.empty() || stride_bytes == 0 || bytes.size() % stride_bytes != 0) {
    return Status::InvalidArgument("memory region must be a non-empty multiple of its stride");
  }
  auto table = std::make_shared<Table>();
  table->header.row_stride_bytes = stride_bytes;
  table->header.row_count = bytes.size() / stride_bytes;
  table->rows = bytes;
  table->owner = std::move(owner);
  table->guard = std::move(guard);
  return AddRegion(name, std::move(table));
}

Status RowServer::AddRegion(const std::string& name, std::shared_ptr<void> region) {
  auto table = std::static_pointer_cast<Table>(std::move(region));
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->tables_by_name.count(name) != 0) {
    return Status::InvalidArgument("region already registered: " + name);
  }
  table->id = static_cast<uint32_t>(state_->tables_by_id.size() + 1);
  table->name = name;
  state_->tables_by_name[name] = table;
  state_->tables_by_id[table->id] = table;
  return Status::Ok();
}

StatusOr<wire::GrantToken> RowServer::IssueGrant(const std::string& region_name,
                                                 const std::string& tenant, uint64_t ttl_ms) {
  wire::GrantToken token = RandomToken();
  KVTIER_RETURN_IF_ERROR(AddGrant(token, region_name, tenant, ttl_ms));
  return token;
}

Status RowServer::AddGrant(const wire::GrantToken& token, const std::string& region_name,
                           const std::string& tenant, uint64_t ttl_ms) {
  if (tenant.empty() || tenant.size() > wire::kNameBytesMax) {
    return Status::InvalidArgument("tenant must be 1..256 bytes");
  }
  if (ttl_ms == 0 || ttl_ms > state_->options.grant_ttl_ms_max) {
    return Status::InvalidArgument("ttl_ms out of range");
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->tables_by_name.count(region_name) == 0) {
    return Status::NotFound("no such region: " + region_name);
  }
  if (state_->grants.count(token) != 0) return Status::InvalidArgument("grant token in use");
  const uint64_t now_us = state_->clock->NowUs();
  if (state_->grants.size() >= state_->options.grants_max) {
    std::erase_if(state_->grants, [now_us](const auto& g) { return g.second.expiry_us <= now_us; });
    if (state_->grants.size() >= state_->options.grants_max) {
      return Status::Rejected("grants_max reached");
    }
  }
  state_->grants[token] = Grant{region_name, tenant, now_us + ttl_ms * 1000};
  return Status::Ok();
}

Status RowServer::RevokeGrant(const wire::GrantToken& token) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->grants.erase(token) == 0) return Status::NotFound("no such grant");
  }
#ifdef KVTIER_WITH_RDMA
  // One-sided reads never reach the server: deregistering the grant's MR is what cuts them,
  // on every queue pair at once (connections using the grant are also closed by their
  // grant check).
  state_->DropRegistration(token);
#endif
  return Status::Ok();
}

Status RowServer::StartOn(asio::io_context& io) {
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(state_->options.bind_address, ec);
  if (ec) return Status::InvalidArgument("bad bind_address: " + state_->options.bind_address);
  auto acceptor = std::make_unique<tcp::acceptor>(asio::make_strand(io));
  const tcp::endpoint endpoint(address, state_->options.port);
  acceptor->open(endpoint.protocol(), ec);
  if (!ec) acceptor->set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor->bind(endpoint, ec);
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::IOError("row server cannot listen on " + state_->options.bind_address + ":" +
                           std::to_string(state_->options.port) + ": " + ec.message());
  }
  state_->port.store(acceptor->local_endpoint().port());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->acceptor = std::move(acceptor);
    state_->io = &io;
  }
  const tcp::acceptor::executor_type strand = state_->acceptor->get_executor();
#ifdef KVTIER_WITH_RDMA
  state_->registration_sweep = std::make_unique<asio::steady_timer>(strand);
  asio::post(strand, [state = state_] { state->SweepRegistrationsLater(state); });
#endif
  asio::post(strand, [state = state_, io = &io] { Accept(state, io); });
  return Status::Ok();
}

namespace {
// A busy-polling server thread yields its core at most this often.
constexpr uint64_t kBusyPollYieldUs = 200;
}  // namespace

Status RowServer::Start() {
  if (state_->options.busy_poll_us > kRowServerBusyPollMaxUs)
    return Status::InvalidArgument("busy_poll_us over kRowServerBusyPollMaxUs");
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->started) return Status::InvalidArgument("row server already started");
    state_->started = true;
    state_->own_io = std::make_unique<asio::io_context>(1);
    state_->work = std::make_unique<asio::executor_work_guard<asio::io_context::executor_type>>(
        state_->own_io->get_executor());
  }
  KVTIER_RETURN_IF_ERROR(StartOn(*state_->own_io));
  asio::io_context* io = state_->own_io.get();
  const uint64_t busy_poll_us = state_->options.busy_poll_us;
  state_->thread = std::thread([io, busy_poll_us] {
    if (busy_poll_us == 0) {
      io->run();
      return;
    }
    // Busy polling: after each handler keep polling (non-blocking) for busy_poll_us before
    // blocking, so a request arriving meanwhile needs no wake-up of this thread.
    const Clock& clock = DefaultSteadyClock();
    uint64_t last_us = clock.NowUs(), yielded_us = last_us;
    while (!io->stopped()) {
      const uint64_t now_us = clock.NowUs();
      if (io->poll() > 0) {
        last_us = now_us;
      } else if (now_us - last_us >= busy_poll_us) {
        io->run_one();
        last_us = clock.NowUs();
      } else if (now_us - yielded_us >= kBusyPollYieldUs) {
        // Now and then let a thread of equal real-time priority on this core run (a waiter
        // for this server's reply, or the thread that is to send its request): a SCHED_FIFO
        // server that never yields starves it for the whole window. Not on every poll: the
        // clients' transport threads would take every reply from the waiters spinning for it.
        std::this_thread::yield();
        yielded_us = now_us;
      }
    }
  });
  return Status::Ok();
}

Status RowServer::Start(asio::io_context& io) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->started) return Status::InvalidArgument("row server already started");
    state_->started = true;
  }
  return StartOn(io);
}

namespace {

// Fulfils a promise when the last reference goes: when every close posted by Stop() has run
// (or, if the io_context stopped first, has been destroyed with it).
struct ClosedSignal {
  std::promise<void> promise;
  ~ClosedSignal() { promise.set_value(); }
};

// Frees the acceptor and the sweep timer when the last reference goes: after Stop()'s close
// ran on their strand, or when the io_context is destroyed without running it. Either way
// before the io_context's services go: the strand they hold unregisters from its service
// when freed, so neither may outlive the io_context (kvtierd destroys its io_context before
// the EngramServing that owns this server).
class StrandObjectsRelease {
 public:
  explicit StrandObjectsRelease(std::shared_ptr<RowServer::State> state)
      : state_(std::move(state)) {}
  StrandObjectsRelease(const StrandObjectsRelease&) = delete;
  StrandObjectsRelease& operator=(const StrandObjectsRelease&) = delete;
  ~StrandObjectsRelease() {
    std::unique_ptr<tcp::acceptor> acceptor;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      acceptor = std::move(state_->acceptor);
    }
#ifdef KVTIER_WITH_RDMA
    // Not just cancel(): a sweep that already expired would run and re-arm, keeping the
    // io_context busy for ever. With the timer gone, SweepRegistrationsLater stops.
    state_->registration_sweep.reset();
#endif
  }

 private:
  std::shared_ptr<RowServer::State> state_;
};

}  // namespace

void RowServer::Stop() {
  std::optional<tcp::acceptor::executor_type> strand;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->io == nullptr) return;
    state_->io = nullptr;
    strand = state_->acceptor->get_executor();  // set with io; freed by `release` below
  }
  auto state = state_;
  auto closed = std::make_shared<ClosedSignal>();
  std::future<void> done = closed->promise.get_future();
  // `release` is moved into the handler, so its last reference goes with the handler: on the
  // strand right after the handler ran (serialized with the sweep, which reads the timer that
  // `release` frees), or with the io_context. A copy kept here could be the last one and free
  // the timer on this thread while a sweep runs on the strand.
  auto release = std::make_shared<StrandObjectsRelease>(state_);
  // On the acceptor's strand (serialized with its accept handler and the sweep); each
  // session is closed on its own strand.
  asio::post(*strand, [state, closed, release = std::move(release)] {
    std::list<std::weak_ptr<RowServerSession>> sessions;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      boost::system::error_code ec;
      if (state->acceptor != nullptr) state->acceptor->close(ec);
      sessions.swap(state->sessions);
    }
    for (auto& weak : sessions) {
      if (auto s = weak.lock()) asio::post(s->executor(), [s, closed] { s->Close(); });
    }
  });
  closed.reset();
  strand.reset();
  if (state_->own_io != nullptr) {
    done.wait();
    state_->work.reset();
    state_->thread.join();
    state_->own_io.reset();
  } else {
    // Embedded: the caller's io_context runs the close; wait briefly for it.
    (void)done.wait_for(std::chrono::seconds(2));
  }
  state_->port.store(0);
}

uint16_t RowServer::port() const { return state_->port.load(); }

RowServerCounters RowServer::counters() const {
  const State& s = *state_;
  return RowServerCounters{
      s.connections_accepted.load(), s.connections_active.load(), s.connections_refused.load(),
      s.malformed_frames.load(),     s.batches_served.load(),     s.ops_served.load(),
      s.bytes_served.load(),         s.permission_denied.load(),  s.verbs_unavailable.load(),
      s.verbs_qps_created.load(),    s.verbs_qps_cut.load(),      s.verbs_registrations_cut.load(),
      s.unattached_closed.load(),    s.bodies_timed_out.load()};
}

}  // namespace kvtier::rdma
