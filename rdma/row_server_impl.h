// Private to rdma/: the row server's state and its connections (row_server.h), split by
// concern:
//   row_server.h/.cc       the RowServer interface: regions (tables, caller memory), grants,
//                          Start/Stop on its own thread or a caller's io_context, counters;
//                          accepting connections
//   row_server_impl.h      RowServer::State (tables, grants, sessions, the verbs zones and
//                          the grants' registrations) and RowServerSession's declaration
//   row_server_session.cc  RowServerSession, one client connection: reading frames, the attach
//                          and body deadlines, kOpen, kRead, the verbs side channel's
//                          kVerbsConnect and kVerbsRegion, replies
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/accept_backoff.h"
#include "common/clock.h"
#include "common/logging.h"
#include "rdma/engram_table.h"
#include "rdma/row_server.h"
#include "rdma/verbs_plan.h"
#include "rdma/wire.h"
#ifdef KVTIER_WITH_RDMA
#include "rdma/verbs_device.h"
#endif

namespace kvtier::rdma {
namespace asio = boost::asio;
using asio::ip::tcp;

namespace internal {

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

}  // namespace internal

class RowServerSession;

struct RowServer::State {
  explicit State(RowServerOptions o) : options(std::move(o)) {
    clock = options.clock != nullptr ? options.clock : &DefaultSteadyClock();
  }
  RowServerOptions options;
  const Clock* clock;

  std::mutex mu;  // protects tables, grants, sessions, io, acceptor lifetime
  std::map<std::string, std::shared_ptr<const internal::Table>> tables_by_name;
  std::map<uint32_t, std::shared_ptr<const internal::Table>> tables_by_id;
  std::map<wire::GrantToken, internal::Grant> grants;
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
      unattached_closed{0}, bodies_timed_out{0}, accept_waits{0};
  AcceptBackoff accept_backoff{"Engram row server"};  // used on the acceptor's strand only

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
                                          const internal::Table& table) {
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
  std::shared_ptr<const internal::Table> FindTable(const std::string& name) {
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

  void Start();
  // The session's strand: Start() and Close() are called on it only.
  tcp::socket::executor_type executor() { return socket_.get_executor(); }
  void Close();

 private:
  struct Attached {
    std::shared_ptr<const internal::Table> table;
    wire::GrantToken token;
    std::string tenant;
  };

  // Checks the connection's deadlines every watch_period_ (a quarter of the shortest timeout,
  // so a deadline is enforced within a quarter more than it): no region attached
  // attach_timeout_ms after accept, or a request body unfinished body_timeout_ms after its
  // header, closes the connection. One timer per connection for its life, none per request
  // (arming a timer per request would cost the row path timer-queue updates and system calls).
  void Watch();

  void ReadHeader();
  void OnHeader();
  void Malformed(const Status& why);
  void OnBody();

  Status NoDevice();
  void HandleVerbsConnect();
  void HandleVerbsRegion();

  // While a queue pair exists: every verbs_grant_check_ms, destroy it (and close the
  // connection) when a grant of a region exposed over it has expired or been revoked.
  void CheckVerbsGrantsLater();

  void HandleOpen();

  // Checks every op; on success fills `out` with buffers into the mapped tables.
  // *guarded: a table of the batch whose copies must run inside its guard (RegisterMemory).
  Status CheckRead(const std::vector<wire::ReadOpWire>& ops, std::vector<asio::const_buffer>* out,
                   const internal::Table** guarded);

  void HandleRead();
  void Reply(const Status& status, std::vector<asio::const_buffer> data);
  // Reply(OK, data), after delay_ms (a test hook's delay; 0: now). The connection closes if
  // the timer is cancelled meanwhile.
  void ReplyOkAfter(uint32_t delay_ms, std::vector<asio::const_buffer> data);

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

}  // namespace kvtier::rdma
