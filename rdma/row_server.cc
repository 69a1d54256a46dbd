#include "rdma/row_server.h"

#include <chrono>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "rdma/engram_table.h"
#include "rdma/row_server_impl.h"

namespace kvtier::rdma {

namespace {

// Accepts the next connection on `io` (the acceptor's handler runs on its strand; each
// accepted socket gets a strand of its own, its session's).
void Accept(std::shared_ptr<RowServer::State> state, asio::io_context* io) {
  tcp::acceptor* acceptor = state->acceptor.get();
  if (acceptor == nullptr) return;  // stopped (Stop() frees it on this strand)
  acceptor->async_accept(
      asio::make_strand(*io), [state, io, acceptor_executor = acceptor->get_executor()](
                                  const boost::system::error_code& ec, tcp::socket socket) {
        if (ec == asio::error::operation_aborted) return;
        {
          std::lock_guard<std::mutex> lock(state->mu);
          if (state->acceptor == nullptr || !state->acceptor->is_open()) return;
        }
        if (ec) {
          // No descriptor or memory left: wait on the acceptor's strand before accepting
          // again instead of spinning (common/accept_backoff.h).
          const auto wait = state->accept_backoff.Failed(ec.value());
          if (wait.count() > 0) {
            state->accept_waits.fetch_add(1);
            auto timer = std::make_shared<asio::steady_timer>(acceptor_executor, wait);
            timer->async_wait(
                [state, io, timer](const boost::system::error_code&) { Accept(state, io); });
            return;
          }
        } else {
          state->accept_backoff.Succeeded();
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
  auto table = std::make_shared<internal::Table>();
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
  auto table = std::make_shared<internal::Table>();
  table->header.row_stride_bytes = stride_bytes;
  table->header.row_count = bytes.size() / stride_bytes;
  table->rows = bytes;
  table->owner = std::move(owner);
  table->guard = std::move(guard);
  return AddRegion(name, std::move(table));
}

Status RowServer::AddRegion(const std::string& name, std::shared_ptr<void> region) {
  auto table = std::static_pointer_cast<internal::Table>(std::move(region));
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
  state_->grants[token] = internal::Grant{region_name, tenant, now_us + ttl_ms * 1000};
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
      s.unattached_closed.load(),    s.bodies_timed_out.load(),   s.accept_waits.load()};
}

}  // namespace kvtier::rdma