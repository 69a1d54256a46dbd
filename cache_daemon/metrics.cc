#include "cache_daemon/metrics.h"

#include <cstdio>

namespace kvtier::daemon {

const char* OpName(Op op) {
  static constexpr const char* kNames[] = {
      "hello",      "auth",        "shm_attach",  "lookup",   "put",       "get",
      "prefetch",   "pin",         "unpin",       "delete",   "stats",     "policy_get",
      "policy_set", "drain",       "resp_get",    "resp_set", "resp_mget", "resp_mset",
      "resp_del",   "resp_exists", "resp_expire", "resp_ttl", "resp_other"};
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
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace

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
                                                     {"checksum_failure", s.misses_checksum}};
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
  p.Family("kvtier_tier_evictions_total", "counter", "Units evicted from a tier.");
  for (auto& [n, t] : tiers)
    p.Sample("kvtier_tier_evictions_total", std::string("tier=\"") + n + "\"", t->evictions);
  p.Family("kvtier_admissions_total", "counter", "Units admitted by the admission policy.");
  p.Sample("kvtier_admissions_total", "", s.admissions);
  p.Family("kvtier_admission_rejections_total", "counter", "Units the admission policy refused.");
  p.Sample("kvtier_admission_rejections_total", "", s.admission_rejections);
  p.Family("kvtier_checksum_failures_total", "counter", "Reads that failed verification.");
  p.Sample("kvtier_checksum_failures_total", "", s.checksum_failures);
  p.Family("kvtier_io_errors_total", "counter", "Device I/O errors.");
  p.Sample("kvtier_io_errors_total", "", s.io_errors);
  p.Family("kvtier_compressed_bytes_saved_total", "counter", "Bytes saved by compression.");
  p.Sample("kvtier_compressed_bytes_saved_total", "", s.compressed_bytes_saved);
  p.Family("kvtier_ssd_segments_cleaned_total", "counter", "SSD segments cleaned (compacted).");
  p.Sample("kvtier_ssd_segments_cleaned_total", "", s.segments_cleaned);
  p.Family("kvtier_ssd_queue_depth", "gauge", "SSD I/O requests outstanding.");
  p.Sample("kvtier_ssd_queue_depth", "", s.ssd_queue_depth);
  p.Family("kvtier_tenant_used_bytes", "gauge", "Bytes stored per tenant.");
  for (const auto& [id, bytes] : s.tenant_bytes) {
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
  p.Family("kvtier_connections_open", "gauge", "Client connections open now.");
  p.Sample("kvtier_connections_open", "", connections_open.load());
  p.Family("kvtier_connections_accepted_total", "counter", "Client connections accepted.");
  p.Sample("kvtier_connections_accepted_total", "", connections_total.load());
  p.Family("kvtier_connections_rejected_total", "counter",
           "Connections closed at once (limit reached or draining).");
  p.Sample("kvtier_connections_rejected_total", "", connections_rejected.load());
  p.Family("kvtier_protocol_errors_total", "counter", "Malformed, truncated or oversized input.");
  p.Sample("kvtier_protocol_errors_total", "", protocol_errors.load());
  p.Family("kvtier_auth_failures_total", "counter", "Failed AUTH attempts.");
  p.Sample("kvtier_auth_failures_total", "", auth_failures.load());
  p.Family("kvtier_slow_client_disconnects_total", "counter",
           "Connections closed because a frame did not complete within frame_timeout_ms.");
  p.Sample("kvtier_slow_client_disconnects_total", "", slow_client_disconnects.load());
  p.Family("kvtier_tenant_inflight_rejections_total", "counter",
           "Requests refused by a tenant's in-flight limit.");
  p.Sample("kvtier_tenant_inflight_rejections_total", "", tenant_inflight_rejections.load());
  p.Family("kvtier_trace_records_dropped_total", "counter", "Trace records dropped (queue full).");
  p.Sample("kvtier_trace_records_dropped_total", "", trace_records_dropped.load());
  p.Family("kvtier_inflight_requests", "gauge", "Native requests executing now.");
  p.Sample("kvtier_inflight_requests", "", inflight.load());
  p.Family("kvtier_ready", "gauge", "1 when serving, 0 while draining.");
  p.Sample("kvtier_ready", "", uint64_t{extra.ready ? 1u : 0u});
  p.Family("kvtier_uptime_seconds", "gauge", "Seconds since start.");
  p.Sample("kvtier_uptime_seconds", "", extra.uptime_s);
  p.Family("kvtier_policy_info", "gauge", "Active eviction and admission policies.");
  p.Sample("kvtier_policy_info",
           "eviction=\"" + EscapeLabel(extra.eviction_policy) + "\",admission=\"" +
               EscapeLabel(extra.admission_policy) + "\"",
           uint64_t{1});
  return p.Take();
}

}  // namespace kvtier::daemon
