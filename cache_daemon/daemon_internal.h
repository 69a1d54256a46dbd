// Private to kvtierd: state shared by the listeners and connection sessions.
#pragma once

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>
// (must precede boost/asio.hpp)
#include <atomic>
#include <boost/asio.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "cache_daemon/config.h"
#include "cache_daemon/engram_serving.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/service.h"
#include "cache_daemon/tenants.h"
#include "cache_daemon/tls_front.h"

namespace kvtier::daemon::internal {

namespace asio = boost::asio;

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
  const TlsFront* tls = nullptr;    // null when no front uses TLS
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
};

// Each takes a connected socket and runs the session until the peer or the daemon closes it.
// The socket is a TCP connection, or for a TLS front the plaintext end of the TLS relay's
// socketpair (tls_front.h); nothing in a session depends on which.
void StartNativeSession(Shared* shared, asio::generic::stream_protocol::socket socket,
                        bool is_unix);
void StartRespSession(Shared* shared, asio::generic::stream_protocol::socket socket);
void StartHttpSession(Shared* shared, asio::generic::stream_protocol::socket socket);

// The /metrics page (also used by tests through the HTTP port). tenant_series = false leaves
// out every series with a tenant label (DaemonMetrics::Extra::tenant_series).
std::string RenderMetrics(Shared* shared, bool tenant_series = true);

}  // namespace kvtier::daemon::internal
