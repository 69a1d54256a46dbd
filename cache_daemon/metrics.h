// Daemon-side metrics and their Prometheus text rendering (written by hand; format 0.0.4).
//
// Counters are lock-free atomics updated on the request path. Labels carry only bounded,
// non-secret values: tier, op, code, reason, front, tenant name. Never a key or a hash.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/wire.h"
#include "rdma/row_server.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

// Operations with their own request counters and latency histogram.
enum class Op : uint8_t {
  kHello,
  kAuth,
  kShmAttach,
  kLookup,
  kPut,
  kGet,
  kPrefetch,
  kPin,
  kUnpin,
  kDelete,
  kStats,
  kPolicyGet,
  kPolicySet,
  kDrain,
  kRespGet,
  kRespSet,
  kRespMget,
  kRespMset,
  kRespDel,
  kRespExists,
  kRespExpire,
  kRespTtl,
  kRespOther,
  kEngramGrant,
  kEngramReport,
  kCount
};
const char* OpName(Op op);

// Why a connection limit ([limits]) refused something: the `reason` label of
// kvtier_connection_limit_refusals_total (docs/CONFIG.md names the key behind each).
enum class Refusal : uint8_t {
  kFrontConnections,   // accept over a front's *_connections_max
  kTenantConnections,  // HELLO/AUTH over tenant_connections_max
  kPreauthFrame,       // a frame over preauth_frame_bytes_max before authentication
  kUnauthenticated,    // a request other than HELLO/AUTH before authentication (auth on)
  kRespCommand,        // a RESP command over resp_command_bytes_max
  kReplyQueue,  // reading paused, or a GET value answered retry: reply_queue_bytes_max reached
  kMemory,      // as kReplyQueue, for connection_memory_bytes_max
  kIdle,        // closed after idle_timeout_ms without traffic
  kRespMulti,   // a command queued after MULTI over resp_multi_commands_max / _bytes_max
  kRespKeys,    // a KEYS reply over resp_keys_reply_bytes_max
  // Auth on, before authentication (docs/CONFIG.md "Connection limits"):
  kUnauthenticatedConnections,  // accept over unauthenticated_connections_max (front's)
  kAuthTimeout,                 // closed: not authenticated within auth_timeout_ms of accept
  kUnauthenticatedPerSource,    // accept over unauthenticated_connections_per_source_max
  kHttpPerSource,               // HTTP accept over http_connections_per_source_max
  kCount
};
const char* RefusalName(Refusal r);

// Fixed-bucket latency histogram in microseconds.
class LatencyHistogram {
 public:
  static constexpr std::array<uint64_t, 16> kBoundsUs = {
      10,   25,    50,    100,   250,    500,    1000,    2500,
      5000, 10000, 25000, 50000, 100000, 250000, 1000000, 5000000};
  void Observe(uint64_t us);
  // Cumulative counts per bound, then +Inf; sum in microseconds.
  void Snapshot(std::array<uint64_t, kBoundsUs.size() + 1>* cumulative, uint64_t* sum_us) const;

 private:
  std::array<std::atomic<uint64_t>, kBoundsUs.size() + 1> buckets_{};
  std::atomic<uint64_t> sum_us_{0};
};

// Engram fetch counters reported by engines (ENGRAM_REPORT), per (tenant, transport). Bounded:
// tenants are the tenants file's (fixed at start), transports the two known names. Only
// counts, never keys, row ids or tokens.
class EngramFetchMetrics {
 public:
  // (tenant name, tenant id) of every tenant; call once before Add/Render.
  void SetTenants(const std::vector<std::pair<std::string, uint64_t>>& tenants);
  // Adds a report's deltas (and sets its reads_in_flight gauge). NotFound for a tenant not
  // given to SetTenants; InvalidArgument for an unknown transport.
  Status Add(uint64_t tenant_id, const wire::EngramReport& report);
  // Sum of every tenant's counters for one transport (tests, `kvtier stats`).
  wire::EngramReport Total(std::string_view transport) const;

  struct Slot {
    std::array<std::atomic<uint64_t>, wire::kEngramReportCounters> v{};  // wire order
    std::atomic<uint64_t> reports{0};
  };
  // For rendering: tenant names and slots[tenant * kEngramTransports.size() + transport].
  const std::vector<std::string>& tenant_names() const { return names_; }
  const Slot& slot(size_t tenant, size_t transport) const {
    return slots_[tenant * wire::kEngramTransports.size() + transport];
  }

 private:
  std::vector<std::string> names_;
  std::map<uint64_t, size_t> index_;  // tenant id -> position; immutable after SetTenants
  std::unique_ptr<Slot[]> slots_;
};

class DaemonMetrics {
 public:
  static constexpr size_t kCodes = 10;  // StatusCode values

  void RecordRequest(Op op, StatusCode code, uint64_t latency_us);
  void AddBytes(bool in, uint64_t n) { (in ? bytes_in_ : bytes_out_).fetch_add(n); }

  std::atomic<uint64_t> connections_open{0};
  std::atomic<uint64_t> connections_total{0};
  std::atomic<uint64_t> connections_rejected{0};  // over max_connections or draining
  std::atomic<uint64_t> protocol_errors{0};       // malformed / oversized frames, bad RESP
  std::atomic<uint64_t> auth_failures{0};
  std::atomic<uint64_t> slow_client_disconnects{0};
  // Failed accepts after which a front paused before accepting again (no descriptor or
  // memory left: common/accept_backoff.h).
  std::atomic<uint64_t> accept_waits{0};
  std::atomic<uint64_t> tenant_inflight_rejections{0};
  std::atomic<uint64_t> trace_records_dropped{0};
  // Native turn ids forgotten (a connection's table full) or past their age limit.
  std::atomic<uint64_t> native_turns_restarted{0};
  // GET values the kernel refused to write into a connection's shared memory (answered retry).
  std::atomic<uint64_t> shm_write_failures{0};
  std::atomic<uint64_t> inflight{0};
  // RESP SETs, MSETs and DELs completed asynchronously under durability sync
  // (resp_durable_sets.h): batches completed (each one SSD commit at most) and SETs (each key
  // of an MSET) and DELs submitted, not done yet.
  std::atomic<uint64_t> resp_durable_set_batches{0};
  std::atomic<uint64_t> resp_durable_sets_pending{0};
  // Their replies written by the commit thread itself (resp_session.cc, DirectReply).
  std::atomic<uint64_t> resp_durable_set_direct_replies{0};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Refusal::kCount)> refusals{};
  void Refuse(Refusal r) { refusals[static_cast<size_t>(r)].fetch_add(1); }
  EngramFetchMetrics engram_fetch;

  struct Extra {
    bool ready = true;
    uint64_t uptime_s = 0;
    std::string eviction_policy, admission_policy;
    // (tenant name, tenant id) for per-tenant byte gauges.
    std::vector<std::pair<std::string, uint64_t>> tenants;
    // False: no series with a tenant label (kvtier_tenant_used_bytes is left out, the Engram
    // fetch families are summed over tenants per transport). /metrics without an admin token.
    bool tenant_series = true;
    // Set when [engram] serving is enabled: the row server's counters (transport "tcp").
    std::optional<rdma::RowServerCounters> engram_server;
    uint64_t engram_regions = 0;
    uint64_t engram_grants_issued = 0;
    uint64_t connection_buffer_bytes = 0;   // ConnectionMemory::used_bytes()
    uint64_t reply_buffers_kept_bytes = 0;  // ReplyBuffers::kept_bytes()
    uint64_t resp_key_index_bytes = 0;      // RespKeyIndex::bytes()
    uint64_t resp_keys_unindexed = 0;       // RespKeyIndex::unindexed()
    uint64_t resp_key_log_errors = 0;       // RespKeyIndex::log_errors()
    // Open connections per front: (front name, count).
    std::vector<std::pair<std::string, uint64_t>> front_connections;
    // Connections not yet authenticated per front that authenticates with HELLO/AUTH:
    // (front name, count); 0 with auth off.
    std::vector<std::pair<std::string, uint64_t>> unauthenticated_connections;
    // Per TCP front that counts them per source (auth on): (front name, SourcePlaces gauges).
    struct SourceGauges {
      std::string front;
      uint64_t sources = 0, top_places = 0;
    };
    std::vector<SourceGauges> unauthenticated_sources;
    // The HTTP front's per-source places (auth on); absent with auth off.
    std::optional<SourceGauges> http_sources;
  };
  // The whole /metrics page: daemon counters plus the storage snapshot.
  std::string RenderPrometheus(const storage::Stats& s, const Extra& extra) const;

 private:
  // The Engram families (page: the renderer's private page type).
  void RenderEngram(const Extra& extra, void* page) const;

  std::array<std::array<std::atomic<uint64_t>, kCodes>, static_cast<size_t>(Op::kCount)>
      requests_{};
  std::array<LatencyHistogram, static_cast<size_t>(Op::kCount)> latency_{};
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0};
};

// Escapes a label value (backslash, quote, newline) per the exposition format.
std::string EscapeLabel(std::string_view v);

}  // namespace kvtier::daemon
