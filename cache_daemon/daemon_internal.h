// Private to kvtierd: state shared by the listeners and connection sessions.
#pragma once

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>
// (must precede boost/asio.hpp)
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "cache_daemon/cluster_node.h"
#include "cache_daemon/config.h"
#include "cache_daemon/engram_serving.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/reply_buffers.h"
#include "cache_daemon/resp_durable_sets.h"
#include "cache_daemon/service.h"
#include "cache_daemon/source_limit.h"
#include "cache_daemon/tenants.h"
#include "cache_daemon/tls_front.h"
#include "cache_daemon/whatif.h"

namespace kvtier::daemon::internal {

namespace asio = boost::asio;

// The listener a connection came in on; each has its own connection limit ([limits]).
enum class Front : uint8_t { kUnix, kNativeTcp, kResp, kHttp, kCount };
const char* FrontName(Front f);

// The memory every connection buffer together may hold (limits.connection_memory_bytes_max):
// read buffers, request frames received and executing, replies queued. Sessions report what
// they hold with Adjust(); a session does not start a read while Over(), so the total can
// exceed the limit by at most one read chunk per connection plus replies already being built.
// Thread-safe.
class ConnectionMemory {
 public:
  explicit ConnectionMemory(uint64_t limit_bytes) : limit_bytes_(limit_bytes) {}
  // Moves *charged to now_bytes, updating the total by the difference.
  void Adjust(uint64_t* charged, uint64_t now_bytes) {
    if (now_bytes == *charged) return;  // the common case: no shared write
    if (now_bytes > *charged) {
      used_.fetch_add(now_bytes - *charged);
    } else {
      used_.fetch_sub(*charged - now_bytes);
    }
    *charged = now_bytes;
  }
  // For bytes outside a session's own tally (replies being built on a worker).
  void Charge(uint64_t n) { used_.fetch_add(n); }
  void Release(uint64_t n) { used_.fetch_sub(n); }
  bool Over() const { return used_.load() >= limit_bytes_; }
  uint64_t used_bytes() const { return used_.load(); }

 private:
  const uint64_t limit_bytes_;
  std::atomic<uint64_t> used_{0};
};

class Session {
 public:
  virtual ~Session() = default;
  // Closes the socket (posted to the session's strand). Idempotent.
  virtual void Close() = 0;
  // True while a request is executing or a reply is being written.
  virtual bool Busy() const = 0;
};

struct Shared {
  const DaemonOptions* options = nullptr;
  Service* service = nullptr;
  DaemonMetrics* metrics = nullptr;
  const TenantRegistry* tenants = nullptr;
  asio::io_context* io = nullptr;
  asio::thread_pool* workers = nullptr;
  EngramServing* engram = nullptr;  // null when [engram] serving is off
  ClusterNode* cluster = nullptr;   // null when [cluster] is off
  ConnectionMemory* memory = nullptr;
  ReplyBuffers* reply_buffers = nullptr;  // large reply buffers kept for reuse
  // Plain RESP SETs completed asynchronously: set under durability sync with an SSD tier
  // (resp_durable_sets.h), null otherwise (SETs then run on the connection's strand).
  RespDurableSets* durable_sets = nullptr;
  // Connections open per front (incremented at admission, decremented when the connection's
  // ConnectionCount is destroyed).
  std::array<std::atomic<uint32_t>, static_cast<size_t>(Front::kCount)> front_open{};
  const TlsFront* tls = nullptr;   // null when no front uses TLS
  const WhatIf* whatif = nullptr;  // null when no trace window is recorded
  std::atomic<bool> draining{false};
  std::atomic<bool> ready{true};
  uint64_t start_us = 0;
  std::function<void()> request_shutdown;

  std::mutex sessions_mu;
  std::map<uint64_t, std::weak_ptr<Session>> sessions;  // protected by sessions_mu
  uint64_t next_session_id = 1;                         // protected by sessions_mu

  uint64_t Register(const std::shared_ptr<Session>& s) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    uint64_t id = next_session_id++;
    sessions[id] = s;
    return id;
  }
  void Unregister(uint64_t id) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    sessions.erase(id);
  }

  // Connections authenticated as one tenant (limits.tenant_connections_max). Counted only
  // with auth on; the tenant "default" of an auth-off daemon is limited by the fronts alone.
  // False (and counted as a refusal) when the tenant is at its limit.
  bool AcquireTenantConnection(const Tenant* t);
  void ReleaseTenantConnection(const Tenant* t);

  std::mutex tenant_conns_mu;
  std::map<uint64_t, uint32_t> tenant_conns;  // tenant id -> connections; by tenant_conns_mu

  // True when a connection on `front` must authenticate before it is served: auth on, and
  // a front whose connections authenticate with HELLO/AUTH (not HTTP, whose requests each
  // carry their own token and are answered without one too).
  bool FrontAuthenticates(Front front) const;
  // Takes a place among the front's unauthenticated connections
  // (limits.unauthenticated_connections_max) and, for a connection with a source (a TCP
  // front's, where CountsSources), one of its source's places there
  // (limits.unauthenticated_connections_per_source_max); false, counted as a refusal of the
  // limit reached, when either is at its limit (the source's is checked first, so a source at
  // its limit takes nothing of the front's). Release gives back both; `source` must be the
  // one the place was taken with.
  bool AcquireUnauthenticated(Front front, const std::optional<SourceKey>& source);
  void ReleaseUnauthenticated(Front front, const std::optional<SourceKey>& source);
  // Whether `front` counts its connections per source (SourceKeyOf of the peer's address): a
  // TCP front that authenticates (FrontAuthenticates); not the Unix socket or HTTP, nor with
  // auth off.
  bool CountsSources(Front front) const;
  // Connections per front holding such a place (kvtier_unauthenticated_connections_open).
  std::array<std::atomic<uint32_t>, static_cast<size_t>(Front::kCount)> unauthenticated_open{};
  // Their places per source on the TCP fronts that authenticate with HELLO/AUTH (native TCP,
  // RESP); null for the Unix socket and the HTTP front. Set before the fronts accept; with
  // auth off they stay empty (CountsSources is false).
  std::array<std::unique_ptr<SourcePlaces>, static_cast<size_t>(Front::kCount)>
      unauthenticated_sources{};
  // The HTTP admin front's connections per source (limits.http_connections_per_source_max),
  // whole lifetimes (HTTP has no connection-level authentication); null with auth off. Set
  // before the fronts accept.
  std::unique_ptr<SourcePlaces> http_sources;
};

// What a front's admission gave a connection at accept (the daemon's Admit).
struct Admission {
  Front front = Front::kUnix;
  // Holds a place in shared->unauthenticated_open[front] (FrontAuthenticates(front)), and
  // with a source one in shared->unauthenticated_sources[front] too.
  bool unauthenticated = false;
  std::optional<SourceKey> source;  // a TCP front's, where Shared::CountsSources or HTTP's
  uint64_t accepted_ms = 0;         // steady clock (IdleWatch::NowMs) at accept
  // Holds a place of `source` in shared->http_sources (the HTTP front, auth on), given back
  // with the connection.
  bool http_source_place = false;
};

// One connection's place in the counts its front's admission checks: shared->front_open[front]
// and, until the connection authenticates, shared->unauthenticated_open[front] and its
// source's place, or on the HTTP front (auth on) its source's place in shared->http_sources
// for its whole life (all taken by the caller at admission and handed over here), and
// metrics->connections_open (taken here).
// All are given back when the last owner lets go: the session, and on a TLS front also the
// relay, which can outlive its session while it writes the session's last replies to the
// client (tls_front.h); so a connection closed unauthenticated counts as unauthenticated
// until it is gone. The unauthenticated place is given back earlier by Authenticated().
// Thread-safe.
class ConnectionCount {
 public:
  ConnectionCount(Shared* shared, const Admission& admission)
      : shared_(shared),
        front_(admission.front),
        accepted_ms_(admission.accepted_ms),
        source_(admission.source),
        http_source_place_(admission.http_source_place),
        unauthenticated_(admission.unauthenticated) {
    shared_->metrics->connections_open.fetch_add(1);
    shared_->metrics->connections_total.fetch_add(1);
  }
  ~ConnectionCount() {
    if (unauthenticated_.exchange(false)) shared_->ReleaseUnauthenticated(front_, source_);
    if (http_source_place_) shared_->http_sources->Release(*source_);
    shared_->front_open[static_cast<size_t>(front_)].fetch_sub(1);
    shared_->metrics->connections_open.fetch_sub(1);
  }
  ConnectionCount(const ConnectionCount&) = delete;
  ConnectionCount& operator=(const ConnectionCount&) = delete;

  // True while the connection holds an unauthenticated place: it must authenticate by
  // AuthDeadlineMs().
  bool unauthenticated() const { return unauthenticated_.load(); }
  // When an unauthenticated connection is closed: limits.auth_timeout_ms after its accept.
  uint64_t AuthDeadlineMs() const { return accepted_ms_ + shared_->options->auth_timeout_ms; }
  // The connection authenticated: its unauthenticated place is given back (no-op when none).
  void Authenticated() {
    if (unauthenticated_.exchange(false)) shared_->ReleaseUnauthenticated(front_, source_);
  }
  // The connection lost its tenant (native: a failed HELLO/AUTH after a successful one, auth
  // on): it takes an unauthenticated place again. False (counted) at the front's limit or
  // its source's.
  bool Deauthenticated() {
    if (unauthenticated_.load()) return true;
    if (!shared_->AcquireUnauthenticated(front_, source_)) return false;
    unauthenticated_.store(true);
    return true;
  }

 private:
  Shared* const shared_;
  const Front front_;
  const uint64_t accepted_ms_;
  const std::optional<SourceKey> source_;
  const bool http_source_place_;
  std::atomic<bool> unauthenticated_;
};

// Each takes a connected socket and runs the session until the peer or the daemon closes it;
// the session holds `count` (made by the caller after admission) until it ends. The socket is
// a TCP connection, or for a TLS front the plaintext end of the TLS relay's socketpair
// (tls_front.h); nothing in a session depends on which.
void StartNativeSession(Shared* shared, asio::generic::stream_protocol::socket socket, bool is_unix,
                        std::shared_ptr<ConnectionCount> count);
void StartRespSession(Shared* shared, asio::generic::stream_protocol::socket socket,
                      std::shared_ptr<ConnectionCount> count);
void StartHttpSession(Shared* shared, asio::generic::stream_protocol::socket socket,
                      std::shared_ptr<ConnectionCount> count);

// Closes a session after limits.idle_timeout_ms without a byte read or written and with no
// request executing. Owned by a session, used on its strand only: Touch() on every read or
// write completion, Arm() once at the start; busy() tells whether requests are executing.
// busy() is sampled only when the deadline passes, so a session also calls Touch() when a
// busy state that no read or write completion ends (a memory-gate hold) ends.
class IdleWatch {
 public:
  template <typename Executor>
  IdleWatch(const Executor& ex, uint64_t timeout_ms) : timer_(ex), timeout_ms_(timeout_ms) {}
  void Touch(uint64_t now_ms) { last_ms_ = now_ms; }
  // Calls on_idle (on the timer's executor) once the connection has been idle long enough;
  // keep_alive is held by the pending wait (the session's shared_ptr).
  template <typename KeepAlive, typename Busy, typename OnIdle>
  void Arm(uint64_t now_ms, KeepAlive keep_alive, Busy busy, OnIdle on_idle) {
    if (last_ms_ == 0) last_ms_ = now_ms;
    uint64_t due = last_ms_ + timeout_ms_;
    uint64_t wait_ms = due > now_ms ? due - now_ms : 0;
    timer_.expires_after(std::chrono::milliseconds(wait_ms));
    timer_.async_wait([this, keep_alive, busy, on_idle](boost::system::error_code ec) {
      if (ec) return;
      uint64_t now = NowMs();
      if (!busy() && now >= last_ms_ + timeout_ms_) return on_idle();
      if (busy()) last_ms_ = now;
      Arm(now, keep_alive, busy, on_idle);
    });
  }
  void Cancel() { timer_.cancel(); }
  static uint64_t NowMs();

 private:
  asio::steady_timer timer_;
  const uint64_t timeout_ms_;
  uint64_t last_ms_ = 0;
};

// Closes a connection that has not authenticated by its deadline (limits.auth_timeout_ms, auth
// on), whatever it sends meanwhile: bytes that keep the idle watch and the frame timer content
// (HELLOs without a token, refused commands, PINGs) do not move it. Owned by a session, used on
// its strand only: Arm() when the connection starts unauthenticated (or becomes so again),
// Disarm() when it authenticates or closes. on_late runs on the timer's executor, once per Arm.
class AuthDeadline {
 public:
  template <typename Executor>
  explicit AuthDeadline(const Executor& ex) : timer_(ex) {}
  // deadline_ms on IdleWatch::NowMs()'s clock; replaces an earlier Arm.
  template <typename KeepAlive, typename OnLate>
  void Arm(uint64_t deadline_ms, KeepAlive keep_alive, OnLate on_late) {
    deadline_ms_ = deadline_ms;
    const uint64_t now_ms = IdleWatch::NowMs();
    timer_.expires_after(
        std::chrono::milliseconds(deadline_ms > now_ms ? deadline_ms - now_ms : 0));
    timer_.async_wait([this, keep_alive, on_late, deadline_ms](boost::system::error_code ec) {
      // A wait that completed before a Disarm or a later Arm cancelled it is stale.
      if (ec || deadline_ms_ != deadline_ms) return;
      deadline_ms_ = 0;
      on_late();
    });
  }
  void Disarm() {
    deadline_ms_ = 0;
    timer_.cancel();
  }

 private:
  asio::steady_timer timer_;
  uint64_t deadline_ms_ = 0;  // 0: not armed
};

// Holds a session's reads while limits.connection_memory_bytes_max is spent (the daemon-wide
// ConnectionMemory is Over()): counts one refusal per pause and retries every kRetryMs. Owned
// by a session, used on its strand only.
class MemoryGate {
 public:
  static constexpr uint64_t kRetryMs = 5;
  template <typename Executor>
  explicit MemoryGate(const Executor& ex) : timer_(ex) {}
  // True when the session may read now. Otherwise the session is paused: retry (which holds
  // the session alive) runs after kRetryMs, and false is returned.
  template <typename Retry>
  bool AllowsRead(Shared* shared, Retry retry) {
    if (!shared->memory->Over()) {
      paused_ = false;
      return true;
    }
    if (!paused_) shared->metrics->Refuse(Refusal::kMemory);
    paused_ = true;
    timer_.expires_after(std::chrono::milliseconds(kRetryMs));
    timer_.async_wait([retry](boost::system::error_code ec) {
      if (!ec) retry();
    });
    return false;
  }
  bool paused() const { return paused_; }
  void Cancel() { timer_.cancel(); }

 private:
  asio::steady_timer timer_;
  bool paused_ = false;
};

// The /metrics page (also used by tests through the HTTP port). tenant_series = false leaves
// out every series with a tenant label (DaemonMetrics::Extra::tenant_series).
std::string RenderMetrics(Shared* shared, bool tenant_series = true);

}  // namespace kvtier::daemon::internal
