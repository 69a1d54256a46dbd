#include "cache_daemon/metrics.h"

#include <cstdio>
#include <iterator>

namespace kvtier::daemon {

const char* RefusalName(Refusal r) {
  static constexpr const char* kNames[] = {"front_connections",
                                           "tenant_connections",
                                           "preauth_frame",
                                           "unauthenticated",
                                           "resp_command",
                                           "reply_queue",
                                           "memory",
                                           "idle",
                                           "resp_multi",
                                           "resp_keys",
                                           "unauthenticated_connections",
                                           "auth_timeout",
                                           "unauthenticated_per_source",
                                           "http_per_source"};
  static_assert(std::size(kNames) == static_cast<size_t>(Refusal::kCount));
  return kNames[static_cast<size_t>(r)];
}

const char* OpName(Op op) {
  static constexpr const char* kNames[] = {
      "hello",       "auth",       "shm_attach", "lookup",       "put",
      "get",         "prefetch",   "pin",        "unpin",        "delete",
      "stats",       "policy_get", "policy_set", "drain",        "resp_get",
      "resp_set",    "resp_mget",  "resp_mset",  "resp_del",     "resp_exists",
      "resp_expire", "resp_ttl",   "resp_other", "engram_grant", "engram_report"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Op::kCount));
  return kNames[static_cast<size_t>(op)];
}

void LatencyHistogram::Observe(uint64_t us) {
  size_t i = 0;
  while (i < kBoundsUs.size() && us > kBoundsUs[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_us_.fetch_add(us, std::memory_order_relaxed);
}

void LatencyHistogram::Snapshot(std::array<uint64_t, kBoundsUs.size() + 1>* cumulative,
                                uint64_t* sum_us) const {
  uint64_t acc = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    acc += buckets_[i].load(std::memory_order_relaxed);
    (*cumulative)[i] = acc;
  }
  *sum_us = sum_us_.load(std::memory_order_relaxed);
}

void DaemonMetrics::RecordRequest(Op op, StatusCode code, uint64_t latency_us) {
  size_t c = static_cast<size_t>(code);
  if (c >= kCodes) c = static_cast<size_t>(StatusCode::kInternal);
  requests_[static_cast<size_t>(op)][c].fetch_add(1, std::memory_order_relaxed);
  latency_[static_cast<size_t>(op)].Observe(latency_us);
}

void EngramFetchMetrics::SetTenants(const std::vector<std::pair<std::string, uint64_t>>& tenants) {
  names_.clear();
  index_.clear();
  for (const auto& [name, id] : tenants) {
    if (index_.emplace(id, names_.size()).second) names_.push_back(name);
  }
  slots_ = std::make_unique<Slot[]>(names_.size() * wire::kEngramTransports.size());
}

Status EngramFetchMetrics::Add(uint64_t tenant_id, const wire::EngramReport& report) {
  auto it = index_.find(tenant_id);
  if (it == index_.end()) return Status::NotFound("tenant has no engram metrics slot");
  int t = wire::EngramTransportIndex(report.transport);
  if (t < 0) return Status::InvalidArgument("unknown engram transport");
  Slot& s = slots_[it->second * wire::kEngramTransports.size() + static_cast<size_t>(t)];
  const uint64_t values[wire::kEngramReportCounters] = {
      report.rows_requested, report.rows_deduplicated, report.hot_cache_hits, report.rows_read,
      report.bytes_read,     report.late_rows,         report.stalls,         report.stall_us,
      report.retries,        report.fetches_failed,    report.reads_in_flight};
  for (size_t i = 0; i + 1 < wire::kEngramReportCounters; ++i) {
    s.v[i].fetch_add(values[i], std::memory_order_relaxed);
  }
  s.v[wire::kEngramReportCounters - 1].store(report.reads_in_flight, std::memory_order_relaxed);
  s.reports.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

wire::EngramReport EngramFetchMetrics::Total(std::string_view transport) const {
  wire::EngramReport r;
  r.transport = std::string(transport);
  int t = wire::EngramTransportIndex(transport);
  if (t < 0) return r;
  uint64_t* fields[wire::kEngramReportCounters] = {
      &r.rows_requested, &r.rows_deduplicated, &r.hot_cache_hits, &r.rows_read,
      &r.bytes_read,     &r.late_rows,         &r.stalls,         &r.stall_us,
      &r.retries,        &r.fetches_failed,    &r.reads_in_flight};
  for (size_t i = 0; i < names_.size(); ++i) {
    const Slot& s = slot(i, static_cast<size_t>(t));
    for (size_t k = 0; k < wire::kEngramReportCounters; ++k) *fields[k] += s.v[k].load();
  }
  return r;
}

std::string EscapeLabel(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

namespace {

class Page {
 public:
  void Family(const char* name, const char* type, const char* help) {
    out_ += "# HELP ";
    out_ += name;
    out_ += ' ';
    out_ += help;
    out_ += "\n# TYPE ";
    out_ += name;
    out_ += ' ';
    out_ += type;
    out_ += '\n';
  }
  void Sample(const std::string& name, const std::string& labels, double value) {
    out_ += name;
    if (!labels.empty()) out_ += "{" + labels + "}";
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %.17g\n", value);
    out_ += buf;
  }
  void Sample(const std::string& name, const std::string& labels, uint64_t value) {
    out_ += name;
    if (!labels.empty()) out_ += "{" + labels + "}";
    out_ += ' ' + std::to_string(value) + '\n';
  }
  // A family with one sample (no labels unless given).
  template <typename V>
  void One(const char* name, const char* type, const char* help, V value,
           const std::string& labels = "") {
    Family(name, type, help);
    Sample(name, labels, value);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace

void DaemonMetrics::RenderEngram(const Extra& extra, void* page) const {
  Page& p = *static_cast<Page*>(page);
  if (extra.engram_server) {
    const rdma::RowServerCounters& c = *extra.engram_server;
    const std::string tl = "transport=\"tcp\"";
    const struct {
      const char* name;
      const char* type;
      const char* help;
      uint64_t value;
    } server[] = {
        {"kvtier_engram_server_connections_accepted_total", "counter",
         "Engram row-server connections accepted.", c.connections_accepted},
        {"kvtier_engram_server_connections_open", "gauge", "Engram row-server connections open.",
         c.connections_active},
        {"kvtier_engram_server_connections_refused_total", "counter",
         "Engram row-server connections refused (engram.connections_max).", c.connections_refused},
        {"kvtier_engram_server_accept_waits_total", "counter",
         "Engram row-server accepts that failed and paused accepting (no descriptor or memory "
         "left).",
         c.accept_waits},
        {"kvtier_engram_server_malformed_frames_total", "counter",
         "Engram row-server connections closed for a malformed frame.", c.malformed_frames},
        {"kvtier_engram_server_unattached_closed_total", "counter",
         "Engram row-server connections closed for opening no region (engram.attach_timeout_ms).",
         c.unattached_closed},
        {"kvtier_engram_server_bodies_timed_out_total", "counter",
         "Engram row-server connections closed for an unfinished request body "
         "(engram.body_timeout_ms).",
         c.bodies_timed_out},
        {"kvtier_engram_server_batches_total", "counter", "Engram read batches served.",
         c.batches_served},
        {"kvtier_engram_server_ops_total", "counter", "Engram read ops (rows) served.",
         c.ops_served},
        {"kvtier_engram_server_bytes_total", "counter", "Engram row bytes served.", c.bytes_served},
        {"kvtier_engram_server_permission_denied_total", "counter",
         "Engram opens and batches refused for a missing, wrong or expired grant.",
         c.permission_denied},
    };
    for (const auto& f : server) p.One(f.name, f.type, f.help, f.value, tl);
    p.One("kvtier_engram_regions", "gauge", "Engram regions (table shards) served.",
          extra.engram_regions);
    p.One("kvtier_engram_grants_issued_total", "counter", "Engram grants issued.",
          extra.engram_grants_issued);
  }
  // Reported by engines (ENGRAM_REPORT); a (tenant, transport) appears once it has reported.
  const struct {
    const char* name;
    const char* type;
    const char* help;
    double scale;  // stall_us is rendered in seconds
  } fetch[wire::kEngramReportCounters] = {
      {"kvtier_engram_fetch_rows_requested_total", "counter",
       "Engram rows engines asked for, duplicates included.", 1},
      {"kvtier_engram_fetch_rows_deduplicated_total", "counter",
       "Engram rows served from another position of the same fetch.", 1},
      {"kvtier_engram_fetch_hot_cache_hits_total", "counter",
       "Engram rows served from the engines' hot-row caches.", 1},
      {"kvtier_engram_fetch_rows_read_total", "counter", "Engram rows read from row servers.", 1},
      {"kvtier_engram_fetch_bytes_read_total", "counter", "Engram bytes read from row servers.", 1},
      {"kvtier_engram_fetch_late_rows_total", "counter",
       "Engram rows not yet arrived when the engine needed them.", 1},
      {"kvtier_engram_fetch_stalls_total", "counter", "Engine waits that blocked on late rows.", 1},
      {"kvtier_engram_fetch_stall_seconds_total", "counter",
       "Time engines spent blocked on late Engram rows.", 1e-6},
      {"kvtier_engram_fetch_retries_total", "counter", "Engram read batches retried.", 1},
      {"kvtier_engram_fetch_failures_total", "counter", "Engram fetches that failed.", 1},
      {"kvtier_engram_fetch_reads_in_flight", "gauge",
       "Engram row reads in flight at the engine's last report.", 1},
  };
  const auto& names = engram_fetch.tenant_names();
  for (size_t k = 0; k < wire::kEngramReportCounters; ++k) {
    p.Family(fetch[k].name, fetch[k].type, fetch[k].help);
    if (!extra.tenant_series) {
      // Without an admin token: one sum over the tenants per transport, no tenant label.
      for (size_t x = 0; x < wire::kEngramTransports.size(); ++x) {
        uint64_t v = 0, reports = 0;
        for (size_t t = 0; t < names.size(); ++t) {
          const EngramFetchMetrics::Slot& s = engram_fetch.slot(t, x);
          reports += s.reports.load(std::memory_order_relaxed);
          v += s.v[k].load(std::memory_order_relaxed);
        }
        if (reports == 0) continue;
        std::string labels = std::string("transport=\"") + wire::kEngramTransports[x] + "\"";
        if (fetch[k].scale != 1) {
          p.Sample(fetch[k].name, labels, static_cast<double>(v) * fetch[k].scale);
        } else {
          p.Sample(fetch[k].name, labels, v);
        }
      }
      continue;
    }
    for (size_t t = 0; t < names.size(); ++t) {
      for (size_t x = 0; x < wire::kEngramTransports.size(); ++x) {
        const EngramFetchMetrics::Slot& s = engram_fetch.slot(t, x);
        if (s.reports.load(std::memory_order_relaxed) == 0) continue;
        std::string labels = "tenant=\"" + EscapeLabel(names[t]) + "\",transport=\"" +
                             wire::kEngramTransports[x] + "\"";
        uint64_t v = s.v[k].load(std::memory_order_relaxed);
        if (fetch[k].scale != 1) {
          p.Sample(fetch[k].name, labels, static_cast<double>(v) * fetch[k].scale);
        } else {
          p.Sample(fetch[k].name, labels, v);
        }
      }
    }
  }
}

std::string DaemonMetrics::RenderPrometheus(const storage::Stats& s, const Extra& extra) const {
  Page p;
  const std::pair<const char*, const storage::TierStats*> tiers[] = {
      {"hbm", &s.hbm}, {"dram", &s.dram}, {"ssd", &s.ssd}};
  p.Family("kvtier_tier_hits_total", "counter", "Reads served by a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_hits_total", std::string("tier=\"") + n + "\"", t->hits);
  p.Family("kvtier_misses_total", "counter", "Lookups and gets that missed, by reason.");
  const std::pair<const char*, uint64_t> misses[] = {{"never_stored", s.misses_never_stored},
                                                     {"evicted", s.misses_evicted},
                                                     {"expired", s.misses_expired},
                                                     {"checksum_failure", s.misses_checksum},
                                                     {"io_error", s.misses_io_error}};
  for (auto& [n, v] : misses)
    p.Sample("kvtier_misses_total", std::string("reason=\"") + n + "\"", v);
  p.Family("kvtier_tier_read_bytes_total", "counter", "Bytes read from a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_read_bytes_total", std::string("tier=\"") + n + "\"", t->bytes_read);
  p.Family("kvtier_tier_written_bytes_total", "counter", "Bytes written to a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_written_bytes_total", std::string("tier=\"") + n + "\"",
             t->bytes_written);
  p.Family("kvtier_tier_used_bytes", "gauge", "Bytes occupied in a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_used_bytes", std::string("tier=\"") + n + "\"", t->used_bytes);
  p.Family("kvtier_tier_capacity_bytes", "gauge", "Configured capacity of a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_capacity_bytes", std::string("tier=\"") + n + "\"", t->capacity_bytes);
  p.Family("kvtier_tier_objects", "gauge", "Units held by a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_objects", std::string("tier=\"") + n + "\"", t->objects);
  p.Family("kvtier_tier_objects_max", "gauge",
           "Units a tier may hold (storage.*_objects_max): beyond it a new unit evicts.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_objects_max", std::string("tier=\"") + n + "\"", t->objects_max);
  p.Family("kvtier_tier_evictions_total", "counter", "Units evicted from a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_evictions_total", std::string("tier=\"") + n + "\"", t->evictions);
  p.One("kvtier_admissions_total", "counter", "Units admitted by the admission policy.",
        s.admissions);
  p.One("kvtier_admission_rejections_total", "counter", "Units the admission policy refused.",
        s.admission_rejections);
  p.One("kvtier_admission_budget_bytes", "gauge",
        "Bytes the admission policy admits per window; 0 when it has no byte budget.",
        s.admission_budget_bytes);
  p.One("kvtier_admission_budget_spent_bytes", "gauge",
        "Bytes admitted in the admission policy's current budget window.",
        s.admission_budget_spent_bytes);
  p.One("kvtier_admission_budget_window_seconds", "gauge",
        "Length of the admission policy's budget window; 0 when it has no byte budget.",
        static_cast<double>(s.admission_budget_window_ms) / 1000.0);
  p.One("kvtier_checksum_failures_total", "counter", "Reads that failed verification.",
        s.checksum_failures);
  p.One("kvtier_io_errors_total", "counter", "Device I/O errors.", s.io_errors);
  p.One("kvtier_ssd_commits_total", "counter",
        "SSD commits (fdatasync + index write) that succeeded; concurrent writers share one.",
        s.ssd_commits);
  p.One("kvtier_ssd_syncs_total", "counter", "fdatasync calls made by SSD commits.", s.ssd_syncs);
  p.One("kvtier_ssd_index_syncs_total", "counter",
        "SSD commits that also synced the index WAL (deletes, flush, cleaning).",
        s.ssd_index_syncs);
  p.One("kvtier_ssd_index_reopens_total", "counter",
        "Failed SSD index writes after which the index was closed and opened again (RocksDB "
        "refuses every write after a failed WAL sync until then).",
        s.ssd_index_reopens);
  p.One("kvtier_ssd_commit_failures_total", "counter", "SSD commits that failed.",
        s.ssd_commit_failures);
  p.One("kvtier_ssd_index_load_failed", "gauge",
        "1 when the SSD index failed to load at start: puts that need room fail until a restart.",
        uint64_t{s.ssd_index_load_failed ? 1u : 0u});
  p.One("kvtier_ssd_commit_writers_total", "counter",
        "sync puts covered by SSD commits (divided by commits: writers per commit).",
        s.ssd_commit_writers);
  p.One("kvtier_ssd_commit_delays_total", "counter",
        "SSD commits whose leader waited for more sync writers (storage.ssd_commit_delay_us).",
        s.ssd_commit_delays);
  p.One("kvtier_ssd_commit_delay_seconds_total", "counter",
        "Time SSD commit leaders spent waiting for more sync writers.",
        static_cast<double>(s.ssd_commit_delay_us) / 1e6);
  p.One("kvtier_ssd_commit_delay_timeouts_total", "counter",
        "SSD commit delays that ended at storage.ssd_commit_delay_us, not when all had joined.",
        s.ssd_commit_delay_timeouts);
  p.One("kvtier_compressed_bytes_saved_total", "counter", "Bytes saved by compression.",
        s.compressed_bytes_saved);
  p.One("kvtier_ssd_segments_cleaned_total", "counter", "SSD segments cleaned (compacted).",
        s.segments_cleaned);
  p.One("kvtier_ssd_relocated_bytes_total", "counter",
        "Bytes of live records the SSD cleaner wrote again (cleaning's write amplification).",
        s.ssd_relocated_bytes);
  p.One("kvtier_ssd_disk_full_shrinks_total", "counter",
        "Times the SSD tier hit ENOSPC preparing a segment and lowered its segment limit to what "
        "the disk held.",
        s.ssd_disk_full_shrinks);
  p.One("kvtier_ssd_disk_free_shrinks_total", "counter",
        "Times the SSD data disk's free space fell below ssd_disk_free_min_bytes (room for the "
        "index) and the SSD tier lowered its segment limit.",
        s.ssd_disk_free_shrinks);
  p.One("kvtier_ssd_disk_full_open_drops_total", "counter",
        "Segments deleted at start (oldest first, their units dropped) because the disk had no "
        "room for the fresh segment a start appends to.",
        s.ssd_disk_full_open_drops);
  if (s.ssd_disk_free_bytes != UINT64_MAX) {
    p.One("kvtier_ssd_disk_free_bytes", "gauge",
          "Free bytes on the SSD tier's data disk at its last check.", s.ssd_disk_free_bytes);
  }
  p.One("kvtier_ssd_queue_depth", "gauge", "SSD I/O requests outstanding.", s.ssd_queue_depth);
  if (extra.tenant_series)
    p.Family("kvtier_tenant_used_bytes", "gauge", "Bytes stored per tenant.");
  for (const auto& [id, bytes] : s.tenant_bytes) {
    if (!extra.tenant_series) break;
    std::string name = "id-" + std::to_string(id);
    for (const auto& [tn, tid] : extra.tenants) {
      if (tid == id) name = tn;
    }
    p.Sample("kvtier_tenant_used_bytes", "tenant=\"" + EscapeLabel(name) + "\"", bytes);
  }

  p.Family("kvtier_requests_total", "counter", "Requests by operation and status code.");
  for (size_t op = 0; op < requests_.size(); ++op) {
    for (size_t c = 0; c < kCodes; ++c) {
      uint64_t v = requests_[op][c].load(std::memory_order_relaxed);
      if (v == 0) continue;
      p.Sample("kvtier_requests_total",
               std::string("op=\"") + OpName(static_cast<Op>(op)) + "\",code=\"" +
                   std::string(StatusCodeName(static_cast<StatusCode>(c))) + "\"",
               v);
    }
  }
  p.Family("kvtier_request_duration_seconds", "histogram", "Request latency by operation.");
  for (size_t op = 0; op < latency_.size(); ++op) {
    std::array<uint64_t, LatencyHistogram::kBoundsUs.size() + 1> cum{};
    uint64_t sum_us = 0;
    latency_[op].Snapshot(&cum, &sum_us);
    if (cum.back() == 0) continue;
    std::string opl = std::string("op=\"") + OpName(static_cast<Op>(op)) + "\"";
    for (size_t i = 0; i < LatencyHistogram::kBoundsUs.size(); ++i) {
      char le[32];
      std::snprintf(le, sizeof(le), "%g", LatencyHistogram::kBoundsUs[i] / 1e6);
      p.Sample("kvtier_request_duration_seconds_bucket", opl + ",le=\"" + le + "\"", cum[i]);
    }
    p.Sample("kvtier_request_duration_seconds_bucket", opl + ",le=\"+Inf\"", cum.back());
    p.Sample("kvtier_request_duration_seconds_sum", opl, static_cast<double>(sum_us) / 1e6);
    p.Sample("kvtier_request_duration_seconds_count", opl, cum.back());
  }
  p.Family("kvtier_network_bytes_total", "counter", "Bytes received and sent on all fronts.");
  p.Sample("kvtier_network_bytes_total", "direction=\"in\"", bytes_in_.load());
  p.Sample("kvtier_network_bytes_total", "direction=\"out\"", bytes_out_.load());
  p.One("kvtier_connections_open", "gauge", "Client connections open now.",
        connections_open.load());
  p.One("kvtier_connections_accepted_total", "counter", "Client connections accepted.",
        connections_total.load());
  p.One("kvtier_connections_rejected_total", "counter",
        "Connections closed at once (limit reached or draining).", connections_rejected.load());
  p.One("kvtier_accept_waits_total", "counter",
        "Failed accepts after which a front paused (no file descriptor or memory left).",
        accept_waits.load());
  p.One("kvtier_protocol_errors_total", "counter", "Malformed, truncated or oversized input.",
        protocol_errors.load());
  p.One("kvtier_auth_failures_total", "counter", "Failed AUTH attempts.", auth_failures.load());
  p.One("kvtier_slow_client_disconnects_total", "counter",
        "Connections closed because a frame did not complete within frame_timeout_ms.",
        slow_client_disconnects.load());
  p.Family("kvtier_connection_limit_refusals_total", "counter",
           "Things refused or connections closed by a [limits] connection limit, by reason.");
  for (size_t r = 0; r < refusals.size(); ++r) {
    p.Sample("kvtier_connection_limit_refusals_total",
             std::string("reason=\"") + RefusalName(static_cast<Refusal>(r)) + "\"",
             refusals[r].load());
  }
  p.One("kvtier_connection_buffer_bytes", "gauge",
        "Bytes held by connection buffers (limits.connection_memory_bytes_max).",
        extra.connection_buffer_bytes);
  p.One("kvtier_reply_buffers_kept_bytes", "gauge",
        "Bytes of large reply buffers kept for reuse (limits.reply_buffers_kept_bytes_max).",
        extra.reply_buffers_kept_bytes);
  p.One("kvtier_resp_key_index_bytes", "gauge",
        "Bytes of the RESP key-name index for SCAN/KEYS (limits.resp_key_index_bytes_max).",
        extra.resp_key_index_bytes);
  p.One("kvtier_resp_keys_unindexed_total", "counter",
        "RESP keys stored but not indexed for SCAN/KEYS/DBSIZE (index limits reached).",
        extra.resp_keys_unindexed);
  p.One("kvtier_resp_key_log_errors_total", "counter",
        "Failed writes or syncs of the RESP key-name log (<data_dir>/resp-names.log).",
        extra.resp_key_log_errors);
  if (!extra.front_connections.empty()) {
    p.Family("kvtier_front_connections_open", "gauge", "Client connections open per front.");
    for (const auto& [front, n] : extra.front_connections) {
      p.Sample("kvtier_front_connections_open", "front=\"" + front + "\"", n);
    }
  }
  if (!extra.unauthenticated_connections.empty()) {
    p.Family("kvtier_unauthenticated_connections_open", "gauge",
             "Client connections accepted and not yet authenticated, per front (auth on; "
             "limits.unauthenticated_connections_max).");
    for (const auto& [front, n] : extra.unauthenticated_connections) {
      p.Sample("kvtier_unauthenticated_connections_open", "front=\"" + front + "\"", n);
    }
  }
  if (!extra.unauthenticated_sources.empty()) {
    p.Family("kvtier_unauthenticated_sources", "gauge",
             "Source addresses (IPv4 address, IPv6 prefix) holding unauthenticated connections, "
             "per TCP front (auth on).");
    for (const auto& g : extra.unauthenticated_sources) {
      p.Sample("kvtier_unauthenticated_sources", "front=\"" + g.front + "\"", g.sources);
    }
    p.Family("kvtier_unauthenticated_top_source_connections", "gauge",
             "The most unauthenticated connections one source holds, per TCP front (auth on; "
             "limits.unauthenticated_connections_per_source_max).");
    for (const auto& g : extra.unauthenticated_sources) {
      p.Sample("kvtier_unauthenticated_top_source_connections", "front=\"" + g.front + "\"",
               g.top_places);
    }
  }
  if (extra.http_sources) {
    p.One("kvtier_http_sources", "gauge",
          "Source addresses (IPv4 address, IPv6 prefix) holding HTTP admin front connections "
          "(auth on).",
          extra.http_sources->sources);
    p.One("kvtier_http_top_source_connections", "gauge",
          "The most HTTP admin front connections one source holds (auth on; "
          "limits.http_connections_per_source_max).",
          extra.http_sources->top_places);
  }
  p.One("kvtier_tenant_inflight_rejections_total", "counter",
        "Requests refused by a tenant's in-flight limit.", tenant_inflight_rejections.load());
  p.One("kvtier_trace_records_dropped_total", "counter", "Trace records dropped (queue full).",
        trace_records_dropped.load());
  p.One("kvtier_native_turns_restarted_total", "counter",
        "Native turn ids that began a new request because their connection forgot them "
        "(table full or turn too old).",
        native_turns_restarted.load());
  p.One("kvtier_native_shm_write_failures_total", "counter",
        "GET values the kernel refused to write into a connection's shared memory (answered "
        "retry: the client fetches them inline).",
        shm_write_failures.load());
  p.One("kvtier_inflight_requests", "gauge", "Native requests executing now.", inflight.load());
  p.One("kvtier_resp_durable_set_batches_total", "counter",
        "Batches of RESP SETs and DELs completed under durability sync (one SSD commit each at "
        "most).",
        resp_durable_set_batches.load());
  p.One("kvtier_resp_durable_sets_pending", "gauge",
        "RESP SETs (each key of an MSET) and DELs under durability sync waiting for their "
        "batch's commit.",
        resp_durable_sets_pending.load());
  p.One("kvtier_resp_durable_set_direct_replies_total", "counter",
        "RESP SET and DEL replies under durability sync written by the thread that completed "
        "their commit (the command was the next reply of its connection).",
        resp_durable_set_direct_replies.load());
  p.One("kvtier_ready", "gauge", "1 when serving, 0 while draining.",
        uint64_t{extra.ready ? 1u : 0u});
  p.One("kvtier_uptime_seconds", "gauge", "Seconds since start.", extra.uptime_s);
  RenderEngram(extra, &p);
  p.Family("kvtier_policy_info", "gauge", "Active eviction and admission policies.");
  p.Sample("kvtier_policy_info",
           "eviction=\"" + EscapeLabel(extra.eviction_policy) + "\",admission=\"" +
               EscapeLabel(extra.admission_policy) + "\"",
           uint64_t{1});
  return p.Take();
}

}  // namespace kvtier::daemon
