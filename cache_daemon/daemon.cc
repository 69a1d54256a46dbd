#include "cache_daemon/daemon.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <condition_variable>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "cache_daemon/daemon_internal.h"
#include "cache_daemon/shm_writer.h"
#include "cache_daemon/worker_warm.h"
#include "common/accept_backoff.h"
#include "common/clock.h"
#include "common/logging.h"

namespace kvtier::daemon {
namespace internal {

const char* FrontName(Front f) {
  static constexpr const char* kNames[] = {"unix", "native_tcp", "resp", "http"};
  return kNames[static_cast<size_t>(f)];
}

uint64_t IdleWatch::NowMs() { return DefaultSteadyClock().NowMs(); }

bool Shared::AcquireTenantConnection(const Tenant* t) {
  if (t == nullptr || !tenants->auth_enabled()) return true;
  std::lock_guard<std::mutex> lock(tenant_conns_mu);
  uint32_t& n = tenant_conns[t->id];
  if (n >= options->tenant_connections_max) {
    metrics->Refuse(Refusal::kTenantConnections);
    return false;
  }
  ++n;
  return true;
}

void Shared::ReleaseTenantConnection(const Tenant* t) {
  if (t == nullptr || !tenants->auth_enabled()) return;
  std::lock_guard<std::mutex> lock(tenant_conns_mu);
  auto it = tenant_conns.find(t->id);
  if (it == tenant_conns.end()) return;
  if (--it->second == 0) tenant_conns.erase(it);
}

bool Shared::FrontAuthenticates(Front front) const {
  return tenants->auth_enabled() && front != Front::kHttp;
}

bool Shared::CountsSources(Front front) const {
  return FrontAuthenticates(front) &&
         unauthenticated_sources[static_cast<size_t>(front)] != nullptr;
}

bool Shared::AcquireUnauthenticated(Front front, const std::optional<SourceKey>& source) {
  SourcePlaces* per_source = unauthenticated_sources[static_cast<size_t>(front)].get();
  if (source && !per_source->Acquire(*source, IdleWatch::NowMs())) {
    metrics->Refuse(Refusal::kUnauthenticatedPerSource);
    return false;
  }
  auto& open = unauthenticated_open[static_cast<size_t>(front)];
  if (open.fetch_add(1) >= options->unauthenticated_connections_max) {
    open.fetch_sub(1);
    if (source) per_source->Release(*source);
    metrics->Refuse(Refusal::kUnauthenticatedConnections);
    return false;
  }
  return true;
}

void Shared::ReleaseUnauthenticated(Front front, const std::optional<SourceKey>& source) {
  unauthenticated_open[static_cast<size_t>(front)].fetch_sub(1);
  if (source) unauthenticated_sources[static_cast<size_t>(front)]->Release(*source);
}

std::string RenderMetrics(Shared* shared, bool tenant_series) {
  DaemonMetrics::Extra extra;
  extra.tenant_series = tenant_series;
  extra.ready = shared->ready.load() && !shared->draining.load();
  extra.uptime_s = (DefaultSteadyClock().NowUs() - shared->start_us) / 1000000;
  PolicySettings p = shared->service->policy();
  extra.eviction_policy = p.eviction;
  extra.admission_policy = p.admission;
  for (const auto& t : shared->tenants->tenants()) extra.tenants.emplace_back(t->name, t->id);
  if (shared->engram != nullptr) {
    extra.engram_server = shared->engram->counters();
    extra.engram_regions = shared->engram->regions().size();
    extra.engram_grants_issued = shared->engram->grants_issued();
  }
  extra.connection_buffer_bytes = shared->memory->used_bytes();
  extra.reply_buffers_kept_bytes = shared->reply_buffers->kept_bytes();
  extra.resp_key_index_bytes = shared->service->resp_index().bytes();
  extra.resp_keys_unindexed = shared->service->resp_index().unindexed();
  extra.resp_key_log_errors = shared->service->resp_index().log_errors();
  for (size_t f = 0; f < shared->front_open.size(); ++f) {
    extra.front_connections.emplace_back(FrontName(static_cast<Front>(f)),
                                         shared->front_open[f].load());
  }
  for (Front f : {Front::kUnix, Front::kNativeTcp, Front::kResp}) {
    extra.unauthenticated_connections.emplace_back(
        FrontName(f), shared->unauthenticated_open[static_cast<size_t>(f)].load());
  }
  for (Front f : {Front::kNativeTcp, Front::kResp}) {
    const SourcePlaces* places = shared->unauthenticated_sources[static_cast<size_t>(f)].get();
    if (places == nullptr) continue;
    const SourcePlaces::Gauges g = places->gauges();
    extra.unauthenticated_sources.push_back(
        {.front = FrontName(f), .sources = g.sources, .top_places = g.top_places});
  }
  if (shared->http_sources != nullptr) {
    const SourcePlaces::Gauges g = shared->http_sources->gauges();
    extra.http_sources = DaemonMetrics::Extra::SourceGauges{
        .front = FrontName(Front::kHttp), .sources = g.sources, .top_places = g.top_places};
  }
  std::string page = shared->metrics->RenderPrometheus(shared->service->store()->GetStats(), extra);
  if (shared->tls != nullptr) page += shared->tls->RenderPrometheus();
  if (shared->cluster != nullptr) page += shared->cluster->RenderPrometheus();
  return page;
}

}  // namespace internal

namespace {

namespace asio = boost::asio;
using internal::Front;
using internal::Shared;
using Tcp = asio::ip::tcp;
using Local = asio::local::stream_protocol;

// True when something answers on the Unix socket path (another daemon is running).
bool SocketInUse(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  bool in_use = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return in_use;
}

class DaemonImpl final : public Daemon {
 public:
  DaemonImpl(const DaemonOptions& options, std::unique_ptr<storage::TierManager> store,
             std::unique_ptr<TenantRegistry> tenants, std::unique_ptr<TraceWriter> trace)
      : options_(options),
        store_(std::move(store)),
        tenants_(std::move(tenants)),
        trace_(std::move(trace)),
        workers_(options.worker_threads),
        memory_(options.connection_memory_bytes_max),
        reply_buffers_(options.reply_buffers_kept_bytes_max),
        service_(store_.get(), tenants_.get(), &metrics_, trace_.get(),
                 PolicySettings{options.storage.eviction_policy, options.storage.admission_policy,
                                options.storage.policy_params},
                 options.resp_key_index_bytes_max) {
    shared_.options = &options_;
    shared_.service = &service_;
    shared_.metrics = &metrics_;
    shared_.memory = &memory_;
    shared_.reply_buffers = &reply_buffers_;
    shared_.tenants = tenants_.get();
    shared_.io = &io_;
    shared_.workers = &workers_;
    shared_.start_us = DefaultSteadyClock().NowUs();
    shared_.request_shutdown = [this] { Shutdown(); };
    shared_.unauthenticated_sources[static_cast<size_t>(Front::kNativeTcp)] =
        std::make_unique<SourcePlaces>("kvtierd native TCP front",
                                       options_.unauthenticated_connections_per_source_max);
    shared_.unauthenticated_sources[static_cast<size_t>(Front::kResp)] =
        std::make_unique<SourcePlaces>("kvtierd RESP front",
                                       options_.unauthenticated_connections_per_source_max);
    if (tenants_->auth_enabled()) {
      shared_.http_sources = std::make_unique<SourcePlaces>(
          "kvtierd HTTP front", options_.http_connections_per_source_max);
    }
    internal::WarmShmStage();  // the first GET over shared memory copies into warm pages
    // Each worker's first SHA-256, stack and heap pages now, not inside the first request it
    // runs (worker_warm.h).
    const size_t warmed =
        internal::RunOncePerThread(workers_, options.worker_threads, internal::WarmWorkerThread,
                                   internal::kWarmWorkersTimeoutMs);
    if (warmed < options.worker_threads) {
      KVTIER_LOG(kWarn) << "only " << warmed << " of " << options.worker_threads
                        << " worker threads warmed at startup";
    }
    std::vector<std::pair<std::string, uint64_t>> names;
    for (const auto& t : tenants_->tenants()) names.emplace_back(t->name, t->id);
    metrics_.engram_fetch.SetTenants(names);
    if (trace_ != nullptr && trace_->window() != nullptr) {
      whatif_ = std::make_unique<WhatIf>(
          trace_->window(), WhatIfOptions{.interval_ms = options_.trace_whatif_interval_ms},
          [this] {
            return WhatIfLive{service_.policy().eviction, options_.storage.dram_capacity_bytes};
          });
      shared_.whatif = whatif_.get();
    }
  }

  ~DaemonImpl() override {
    Shutdown();
    (void)Wait();
  }

  Status Listen() {
    for (const auto& t : tenants_->tenants()) store_->SetTenantQuota(t->id, t->quota_bytes);
    // RESP key names survive a restart wherever the units can (an SSD tier): docs/RESP.md.
    if (options_.storage.ssd_capacity_bytes > 0) {
      const storage::Durability mode = options_.storage.durability;
      // The log is checkpointed and synced on the group-commit clock under batched, every
      // second under sync (its SETs' units carry their names; the log's sync is not on their
      // path), and at a graceful stop under none.
      const uint64_t names_sync_ms =
          mode == storage::Durability::kBatched ? options_.storage.group_commit_ms
          : mode == storage::Durability::kSync  ? RespKeyIndex::kSyncCheckpointIntervalMs
                                                : 0;
      KVTIER_RETURN_IF_ERROR(
          service_.PersistRespNames(options_.storage.data_dir + "/resp-names.log",
                                    mode == storage::Durability::kSync, names_sync_ms));
      // Under sync a SET waits for disks: it completes asynchronously, sharing commits.
      if (mode == storage::Durability::kSync) {
        durable_sets_ = std::make_unique<RespDurableSets>(
            &service_, &metrics_,
            [this](std::function<void()> task) { asio::post(io_, std::move(task)); });
        shared_.durable_sets = durable_sets_.get();
      }
    }
    // Engram tables are validated before any listener opens: a bad [engram] fails the start.
    if (options_.engram.enabled) {
      KVTIER_ASSIGN_OR_RETURN(engram_, EngramServing::Open(options_.engram));
    }
    // Certificate and key are loaded before any listener opens: a bad [tls] fails the start.
    if (options_.tls.any()) {
      KVTIER_ASSIGN_OR_RETURN(tls_, TlsFront::Create(options_.tls,
                                                     /*write_stall_ms=*/options_.idle_timeout_ms));
      shared_.tls = tls_.get();
    }
    boost::system::error_code ec;
    // Before any port is bound: a second daemon on the same socket says so, not that a port
    // is taken.
    if (!options_.socket_path.empty() && SocketInUse(options_.socket_path)) {
      return Status::IOError("another daemon is listening on " + options_.socket_path);
    }
    auto open_tcp = [&](uint16_t port, const std::string& address,
                        std::optional<Tcp::acceptor>* acc, const char* what) -> Status {
      if (port == 0) return Status::Ok();
      auto addr = asio::ip::make_address(address == "localhost" ? "127.0.0.1" : address, ec);
      if (ec) return Status::InvalidArgument(std::string("bad ") + what + " address " + address);
      Tcp::endpoint ep(addr, port);
      acc->emplace(accept_strand_);
      (*acc)->open(ep.protocol(), ec);
      if (!ec) (*acc)->set_option(asio::socket_base::reuse_address(true), ec);
      if (!ec) (*acc)->bind(ep, ec);
      if (!ec) (*acc)->listen(asio::socket_base::max_listen_connections, ec);
      if (ec) {
        return Status::IOError(std::string("bind ") + what + " " + address + ":" +
                               std::to_string(port) + ": " + ec.message());
      }
      return Status::Ok();
    };
    KVTIER_RETURN_IF_ERROR(
        open_tcp(options_.native_port, options_.native_listen, &native_tcp_, "native"));
    KVTIER_RETURN_IF_ERROR(open_tcp(options_.resp_port, options_.resp_listen, &resp_, "resp"));
    KVTIER_RETURN_IF_ERROR(open_tcp(options_.http_port, options_.http_listen, &http_, "http"));
    if (engram_) {
      KVTIER_RETURN_IF_ERROR(engram_->Start(io_));
      shared_.engram = engram_.get();
    }
    // [cluster]: peer front, membership in etcd, router in the Service's native path.
    if (options_.cluster.enabled) {
      KVTIER_ASSIGN_OR_RETURN(
          cluster_, ClusterNode::Start(options_, &service_, tenants_.get(), &reply_buffers_));
      shared_.cluster = cluster_.get();
    }
    // The Unix socket listens last: once it accepts, every other front is listening too (a
    // client or a test that waits for it may use any front), and a front that failed to bind
    // has failed the start before it ever accepted.
    if (!options_.socket_path.empty()) {
      // Checked again: another daemon may have taken the socket while the fronts above opened.
      if (SocketInUse(options_.socket_path)) {
        return Status::IOError("another daemon is listening on " + options_.socket_path);
      }
      ::unlink(options_.socket_path.c_str());
      unix_.emplace(accept_strand_);
      unix_->open(Local(), ec);
      if (!ec) unix_->bind(Local::endpoint(options_.socket_path), ec);
      socket_bound_ = !ec;  // the file is this daemon's from here
      if (!ec) unix_->listen(asio::socket_base::max_listen_connections, ec);
      if (ec) return Status::IOError("bind " + options_.socket_path + ": " + ec.message());
      ::chmod(options_.socket_path.c_str(), 0660);
      AcceptUnix();
    }
    if (native_tcp_) AcceptTcp(&*native_tcp_, Front::kNativeTcp);
    if (resp_) AcceptTcp(&*resp_, Front::kResp);
    if (http_) AcceptTcp(&*http_, Front::kHttp);
    for (uint32_t i = 0; i < options_.io_threads; ++i) {
      io_threads_.emplace_back([this] { io_.run(); });
    }
    auto front = [](const std::string& address, uint16_t port, bool tls) {
      if (port == 0) return std::string("off");
      return address + ":" + std::to_string(port) + (tls ? "+tls" : "");
    };
    KVTIER_LOG(kInfo) << "kvtierd serving: socket=" << options_.socket_path << " native="
                      << front(options_.native_listen, options_.native_port, options_.tls.native)
                      << " resp="
                      << front(options_.resp_listen, options_.resp_port, options_.tls.resp)
                      << " http="
                      << front(options_.http_listen, options_.http_port, options_.tls.http)
                      << " auth=" << (tenants_->auth_enabled() ? "on" : "off")
                      << " engram=" << (engram_ ? options_.engram.listen : std::string("off"));
    return Status::Ok();
  }

  void Shutdown() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_started_) return;
    shutdown_started_ = true;
    shutdown_thread_ = std::thread([this] { RunShutdown(); });
  }

  bool shutdown_requested() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return shutdown_started_;
  }

  Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_; });
    if (shutdown_thread_.joinable()) shutdown_thread_.join();
    return final_status_;
  }

  Status ReloadPolicy() override {
    if (options_.config_path.empty()) return Status::Ok();
    std::ifstream in(options_.config_path, std::ios::binary);
    if (!in) return Status::IOError("cannot reopen " + options_.config_path);
    std::stringstream ss;
    ss << in.rdbuf();
    KVTIER_ASSIGN_OR_RETURN(PolicySettings p, ParsePolicySettings(ss.str()));
    KVTIER_RETURN_IF_ERROR(service_.SetPolicy(p));
    KVTIER_LOG(kInfo) << "SIGHUP: policy reloaded: " << service_.PolicyJson();
    return Status::Ok();
  }

 private:
  // A front's admission (Admit) not yet handed to a session; given back unless taken.
  struct AdmissionHold {
    AdmissionHold(Shared* shared, const internal::Admission& admission)
        : shared(shared), admission(admission) {}
    ~AdmissionHold() {
      if (taken) return;
      shared->front_open[static_cast<size_t>(admission.front)].fetch_sub(1);
      if (admission.unauthenticated) {
        shared->ReleaseUnauthenticated(admission.front, admission.source);
      }
      if (admission.http_source_place) shared->http_sources->Release(*admission.source);
    }
    Shared* shared;
    internal::Admission admission;
    bool taken = false;
  };

  // An admitted connection's count (Admit took its places).
  std::shared_ptr<internal::ConnectionCount> Counted(const internal::Admission& admission) {
    return std::make_shared<internal::ConnectionCount>(&shared_, admission);
  }

  // Counts the connection in its front, and with auth on in the front's unauthenticated
  // connections (and their places of `source`, a TCP connection's, where Shared::CountsSources),
  // or on the HTTP front in its source's places (Shared::http_sources), on success; its
  // ConnectionCount (Counted) uncounts it. nullopt: the connection is to be closed
  // at once (counted in connections_rejected and, for a limit of [limits], in its refusal
  // reason).
  std::optional<internal::Admission> Admit(Front front,
                                           const std::optional<SourceKey>& source = std::nullopt) {
    if (shared_.draining.load() || metrics_.connections_open.load() >= options_.max_connections) {
      metrics_.connections_rejected.fetch_add(1);
      return std::nullopt;
    }
    const uint32_t limits[] = {options_.unix_connections_max, options_.native_tcp_connections_max,
                               options_.resp_connections_max, options_.http_connections_max};
    auto& open = shared_.front_open[static_cast<size_t>(front)];
    if (open.fetch_add(1) >= limits[static_cast<size_t>(front)]) {
      open.fetch_sub(1);
      metrics_.connections_rejected.fetch_add(1);
      metrics_.Refuse(Refusal::kFrontConnections);
      return std::nullopt;
    }
    internal::Admission admission{.front = front,
                                  .unauthenticated = false,
                                  .source = source,
                                  .accepted_ms = internal::IdleWatch::NowMs()};
    if (front == Front::kHttp && source && shared_.http_sources != nullptr) {
      // One of its source's places for the connection's whole life.
      if (!shared_.http_sources->Acquire(*source, admission.accepted_ms)) {
        open.fetch_sub(1);
        metrics_.connections_rejected.fetch_add(1);
        metrics_.Refuse(Refusal::kHttpPerSource);
        return std::nullopt;
      }
      admission.http_source_place = true;
    }
    if (shared_.FrontAuthenticates(front)) {
      // Unauthenticated until its first successful HELLO/AUTH (the session's deadline).
      if (!shared_.AcquireUnauthenticated(front, source)) {
        open.fetch_sub(1);
        metrics_.connections_rejected.fetch_add(1);
        return std::nullopt;
      }
      admission.unauthenticated = true;
    }
    return admission;
  }

  void AcceptUnix() {
    unix_->async_accept(asio::make_strand(io_), [this](boost::system::error_code ec,
                                                       Local::socket s) {
      if (ec == asio::error::operation_aborted || !unix_->is_open()) return;
      if (ec) {
        AcceptAgainAfterFailure(Front::kUnix, ec, [this] { AcceptUnix(); });
        return;
      }
      accept_backoff_[static_cast<size_t>(Front::kUnix)].Succeeded();
      if (std::optional<internal::Admission> admission = Admit(Front::kUnix)) {
        internal::StartNativeSession(&shared_, asio::generic::stream_protocol::socket(std::move(s)),
                                     /*is_unix=*/true, Counted(*admission));
      }
      AcceptUnix();
    });
  }

  // After a failed accept: accepts again at once when only that connection failed, else
  // after the front's backoff (accept_backoff.h: a full descriptor table must not spin the
  // I/O threads). `accept` runs unless the daemon is shutting down.
  void AcceptAgainAfterFailure(Front front, boost::system::error_code ec,
                               std::function<void()> accept) {
    const auto wait = accept_backoff_[static_cast<size_t>(front)].Failed(ec.value());
    if (wait.count() == 0) {
      accept();
      return;
    }
    metrics_.accept_waits.fetch_add(1);
    auto timer = std::make_shared<asio::steady_timer>(accept_strand_, wait);
    timer->async_wait([this, timer, accept = std::move(accept)](boost::system::error_code) {
      if (!shared_.draining.load()) accept();
    });
  }

  void AcceptTcp(Tcp::acceptor* acc, Front front) {
    acc->async_accept(asio::make_strand(io_), [this, acc, front](boost::system::error_code ec,
                                                                 Tcp::socket s) {
      if (ec == asio::error::operation_aborted || !acc->is_open()) return;
      if (ec) {
        AcceptAgainAfterFailure(front, ec, [this, acc, front] { AcceptTcp(acc, front); });
        return;
      }
      accept_backoff_[static_cast<size_t>(front)].Succeeded();
      // The peer's address, only where the per-source limits count it (one getpeername per
      // accept); a connection whose peer is already gone (ENOTCONN) has none and is closed as
      // any refused one.
      std::optional<SourceKey> source;
      if (shared_.CountsSources(front) ||
          (front == Front::kHttp && shared_.http_sources != nullptr)) {
        boost::system::error_code peer_ec;
        const Tcp::endpoint peer = s.remote_endpoint(peer_ec);
        if (peer_ec) {
          metrics_.connections_rejected.fetch_add(1);
          AcceptTcp(acc, front);
          return;
        }
        source = SourceKeyOf(peer.address(), options_.unauthenticated_source_ipv6_prefix_bits);
      }
      if (std::optional<internal::Admission> admitted = Admit(front, source)) {
        if (UsesTls(front)) {
          // The session starts on the plaintext end once the handshake is done. Until
          // then the admission is held here: a handshake that fails or times out never
          // starts a session, so the front's count is given back when `admission` dies.
          // From then on the session and the relay share the connection's count, given
          // back when both are gone (the relay can outlive the session).
          // The handshake counts against the front's unauthenticated connections and the
          // authentication deadline runs from the TCP accept (as PostgreSQL's
          // authentication_timeout includes its SSL handshake).
          auto admission = std::make_shared<AdmissionHold>(&shared_, *admitted);
          tls_->Accept(
              std::move(s), [this] { return shared_.draining.load(); },
              [this, front, admission](TlsFront::GenericSocket plain) {
                admission->taken = true;
                std::shared_ptr<internal::ConnectionCount> count = Counted(admission->admission);
                StartFront(front, std::move(plain), count);
                return std::shared_ptr<void>(std::move(count));
              });
        } else if (front == Front::kNativeTcp) {
          boost::system::error_code ignored;
          s.set_option(Tcp::no_delay(true), ignored);
          internal::StartNativeSession(&shared_,
                                       asio::generic::stream_protocol::socket(std::move(s)),
                                       /*is_unix=*/false, Counted(*admitted));
        } else {
          StartFront(front, asio::generic::stream_protocol::socket(std::move(s)),
                     Counted(*admitted));
        }
      }
      AcceptTcp(acc, front);
    });
  }

  bool UsesTls(Front front) const {
    return front == Front::kNativeTcp ? options_.tls.native
           : front == Front::kResp    ? options_.tls.resp
                                      : options_.tls.http;
  }
  void StartFront(Front front, asio::generic::stream_protocol::socket s,
                  std::shared_ptr<internal::ConnectionCount> count) {
    if (front == Front::kNativeTcp) {
      internal::StartNativeSession(&shared_, std::move(s), /*is_unix=*/false, std::move(count));
    } else if (front == Front::kResp) {
      internal::StartRespSession(&shared_, std::move(s), std::move(count));
    } else {
      internal::StartHttpSession(&shared_, std::move(s), std::move(count));
    }
  }

  std::vector<std::shared_ptr<internal::Session>> LiveSessions() {
    std::vector<std::shared_ptr<internal::Session>> out;
    std::lock_guard<std::mutex> lock(shared_.sessions_mu);
    for (auto& [id, w] : shared_.sessions) {
      if (auto s = w.lock()) out.push_back(std::move(s));
    }
    return out;
  }

  void RunShutdown() {
    KVTIER_LOG(kInfo) << "shutting down: no new connections, finishing in-flight requests";
    shared_.draining.store(true);
    shared_.ready.store(false);
    asio::post(accept_strand_, [this] {
      boost::system::error_code ec;
      if (unix_) unix_->close(ec);
      if (native_tcp_) native_tcp_->close(ec);
      if (resp_) resp_->close(ec);
      if (http_) http_->close(ec);
    });
    // The Engram row server closes its listener and connections now (reads in flight fail
    // on the clients, which retry elsewhere or report the error).
    if (engram_) engram_->Stop();
    // Wait for requests already received to finish and their replies to be written.
    uint64_t deadline = DefaultSteadyClock().NowMs() + options_.drain_timeout_ms;
    for (;;) {
      bool busy = metrics_.inflight.load() > 0;
      for (auto& s : LiveSessions()) busy = busy || s->Busy();
      if (!busy) break;
      if (DefaultSteadyClock().NowMs() >= deadline) {
        KVTIER_LOG(kWarn) << "drain timeout: closing connections with requests in flight";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (auto& s : LiveSessions()) s->Close();
    workers_.join();
    // Leave the cluster (lease revoked: peers stop routing here at once).
    if (cluster_) cluster_->Stop();
    // Let the close handlers run, then stop the I/O threads.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    io_.stop();
    for (auto& t : io_threads_) t.join();
    // SETs still pending finish (durably) before the store is flushed.
    if (durable_sets_) durable_sets_->Stop();
    Status st = store_->Flush();
    if (!st.ok()) {
      KVTIER_LOG(kError) << "flush at shutdown failed: " << st.ToString();
    }
    Status names = service_.resp_index().Flush();
    if (!names.ok()) {
      KVTIER_LOG(kError) << "RESP name log flush at shutdown failed: " << names.ToString();
      if (st.ok()) st = names;
    }
    if (trace_) {
      Status ts = trace_->Close();
      if (!ts.ok()) {
        KVTIER_LOG(kError) << "trace close failed: " << ts.ToString();
      }
    }
    if (socket_bound_) ::unlink(options_.socket_path.c_str());
    KVTIER_LOG(kInfo) << "shutdown complete: " << st.ToString();
    std::lock_guard<std::mutex> lock(mu_);
    final_status_ = st;
    done_ = true;
    done_cv_.notify_all();
  }

  DaemonOptions options_;
  std::unique_ptr<storage::TierManager> store_;
  std::unique_ptr<TenantRegistry> tenants_;
  std::unique_ptr<TraceWriter> trace_;
  DaemonMetrics metrics_;
  asio::thread_pool workers_;
  internal::ConnectionMemory memory_;
  internal::ReplyBuffers reply_buffers_;
  Service service_;
  std::unique_ptr<RespDurableSets> durable_sets_;  // durability sync with an SSD tier only
  Shared shared_;
  std::unique_ptr<EngramServing> engram_;  // [engram]; null when off
  std::unique_ptr<ClusterNode> cluster_;   // [cluster]; null when off
  std::unique_ptr<TlsFront> tls_;          // [tls]; null when no front uses it
  std::unique_ptr<WhatIf> whatif_;         // what-if curves; null without a trace window
  // Declared after everything sessions touch: destroying io_ destroys pending handlers and
  // with them the last session references, whose destructors use shared_ and metrics_.
  asio::io_context io_;
  // The acceptors' executor: their accept handlers, the backoff timers and the close at
  // shutdown run one at a time (an acceptor is not safe to use from two threads at once).
  asio::strand<asio::io_context::executor_type> accept_strand_ = asio::make_strand(io_);
  std::optional<Local::acceptor> unix_;
  // This daemon bound options_.socket_path (only then does its shutdown remove the file: a
  // daemon refused because another serves that socket leaves it alone). Set by Listen().
  bool socket_bound_ = false;
  std::optional<Tcp::acceptor> native_tcp_, resp_, http_;
  // One per front, indexed by Front; used on accept_strand_ only.
  AcceptBackoff accept_backoff_[static_cast<size_t>(Front::kCount)] = {
      AcceptBackoff("kvtierd Unix socket"), AcceptBackoff("kvtierd native TCP front"),
      AcceptBackoff("kvtierd RESP front"), AcceptBackoff("kvtierd HTTP front")};
  std::vector<std::thread> io_threads_;

  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  bool shutdown_started_ = false;  // protected by mu_
  bool done_ = false;              // protected by mu_
  Status final_status_;            // protected by mu_
  std::thread shutdown_thread_;
};

}  // namespace

StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options,
                                                std::unique_ptr<storage::TierManager> store,
                                                std::unique_ptr<TenantRegistry> tenants,
                                                std::unique_ptr<TraceWriter> trace) {
  auto d =
      std::make_unique<DaemonImpl>(options, std::move(store), std::move(tenants), std::move(trace));
  Status st = d->Listen();
  if (!st.ok()) {
    // Not started: make the destructor's Shutdown/Wait trivial.
    d->Shutdown();
    (void)d->Wait();
    return st;
  }
  return std::unique_ptr<Daemon>(std::move(d));
}

}  // namespace kvtier::daemon
