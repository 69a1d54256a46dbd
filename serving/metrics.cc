#include "serving/metrics.h"

#include <charconv>
#include <cstdio>
#include <sstream>

namespace kvtier::serving {
namespace {

// Shortest text that reads back as the same double.
std::string Num(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// Label values: escape backslash, quote and newline (the text format's rule).
std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void Head(std::ostringstream& o, const char* name, const char* type, const char* help) {
  o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
}

void Hist(std::ostringstream& o, const char* name, const char* help, const Histogram& h) {
  Head(o, name, "histogram", help);
  uint64_t cum = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cum += h.counts[i];
    o << name << "_bucket{le=\"" << Num(h.bounds[i]) << "\"} " << cum << "\n";
  }
  o << name << "_bucket{le=\"+Inf\"} " << h.count << "\n";
  o << name << "_sum " << Num(h.sum) << "\n" << name << "_count " << h.count << "\n";
}

}  // namespace

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  ++counts[i];
  sum += v;
  ++count;
}

ServingMetrics::ServingMetrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}),
      tpot_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      batch_sequences_({1, 2, 4, 8, 16, 32, 64}),
      step_tokens_({1, 4, 16, 64, 256, 1024, 4096}) {}

void ServingMetrics::HttpRequest(int status) {
  std::lock_guard l(mu_);
  ++http_requests_[status];
}
void ServingMetrics::HttpRejected(const std::string& why) {
  std::lock_guard l(mu_);
  ++http_rejected_[why];
}
void ServingMetrics::ConnectionsOpen(int64_t n) {
  std::lock_guard l(mu_);
  connections_open_ = n;
}
void ServingMetrics::AcceptWait() {
  std::lock_guard l(mu_);
  ++accept_waits_;
}
void ServingMetrics::RequestDone(const std::string& tenant, const Usage& u, double cost,
                                 const std::string& finish_reason) {
  std::lock_guard l(mu_);
  TenantCounters& t = tenants_[tenant];
  ++t.requests;
  t.prompt += static_cast<uint64_t>(u.prompt_tokens);
  t.cached += static_cast<uint64_t>(u.cached_tokens);
  t.miss += static_cast<uint64_t>(u.miss_tokens());
  t.completion += static_cast<uint64_t>(u.completion_tokens);
  t.cost += cost;
  ++finish_[finish_reason];
}
void ServingMetrics::Ttft(double s) {
  std::lock_guard l(mu_);
  ttft_.Observe(s);
}
void ServingMetrics::Tpot(double s) {
  std::lock_guard l(mu_);
  tpot_.Observe(s);
}
void ServingMetrics::Step(int64_t sequences, int64_t tokens, int64_t prefill_tokens) {
  std::lock_guard l(mu_);
  ++steps_;
  prefill_tokens_ += static_cast<uint64_t>(prefill_tokens);
  batch_sequences_.Observe(static_cast<double>(sequences));
  step_tokens_.Observe(static_cast<double>(tokens));
}
void ServingMetrics::TenantStepTokens(const std::string& tenant, uint64_t tokens) {
  std::lock_guard l(mu_);
  tenants_[tenant].step_tokens += tokens;
}
void ServingMetrics::SpecRound(const std::vector<uint64_t>& drafted,
                               const std::vector<uint64_t>& accepted, uint64_t draft_passes) {
  std::lock_guard l(mu_);
  ++spec_rounds_;
  spec_draft_passes_ += draft_passes;
  uint64_t any = 0;
  for (size_t i = 0; i < drafted.size(); ++i) {
    ++spec_verifications_;
    spec_drafted_ += drafted[i];
    spec_accepted_ += i < accepted.size() ? accepted[i] : 0;
    ++spec_draft_length_[drafted[i]];
    any += drafted[i];
  }
  if (any == 0) ++spec_rounds_undrafted_;
}
void ServingMetrics::SpecRoundUndrafted(uint64_t sequences) {
  std::lock_guard l(mu_);
  ++spec_rounds_;
  ++spec_rounds_undrafted_;
  spec_verifications_ += sequences;
  spec_draft_length_[0] += sequences;
}
void ServingMetrics::Resume(bool hit, bool hot) {
  std::lock_guard l(mu_);
  ++resumes_;
  if (hit) ++resume_hits_;
  if (hot) ++hot_state_restores_;
}
void ServingMetrics::Replay(uint64_t tokens, bool on_step_thread) {
  std::lock_guard l(mu_);
  ++replays_;
  replay_tokens_ += tokens;
  if (on_step_thread) ++step_replays_;
}
void ServingMetrics::ResidentHit() {
  std::lock_guard l(mu_);
  ++resident_hits_;
}
void ServingMetrics::SwapOut() {
  std::lock_guard l(mu_);
  ++swap_outs_;
}
void ServingMetrics::SaveFailed() {
  std::lock_guard l(mu_);
  ++save_failures_;
}
void ServingMetrics::KvtierdFailed() {
  std::lock_guard l(mu_);
  ++kvtierd_failures_;
}
void ServingMetrics::KvtierdUnavailable(bool unavailable) {
  std::lock_guard l(mu_);
  kvtierd_unavailable_ = unavailable ? 1 : 0;
}
void ServingMetrics::KvtierdQueue(int64_t restores, int64_t save_bytes) {
  std::lock_guard l(mu_);
  kvtierd_restores_queued_ = restores;
  kvtierd_save_bytes_queued_ = save_bytes;
}
void ServingMetrics::Disconnect() {
  std::lock_guard l(mu_);
  ++disconnects_;
}
void ServingMetrics::RestoreAbandoned() {
  std::lock_guard l(mu_);
  ++restores_abandoned_;
}
void ServingMetrics::Gauges(int64_t q, int64_t a, int64_t r, int64_t rt) {
  std::lock_guard l(mu_);
  queue_depth_ = q;
  active_ = a;
  resident_ = r;
  resident_tokens_ = rt;
}

void ServingMetrics::LayerDeviceFailed(bool failed) {
  std::lock_guard l(mu_);
  layer_device_failed_ = failed ? 1 : 0;
}

std::string ServingMetrics::Render() const {
  std::lock_guard l(mu_);
  std::ostringstream o;
  Head(o, "kvtier_serve_http_requests_total", "counter", "HTTP requests answered, by status.");
  for (const auto& [code, n] : http_requests_)
    o << "kvtier_serve_http_requests_total{status=\"" << code << "\"} " << n << "\n";
  Head(o, "kvtier_serve_http_rejected_total", "counter",
       "Connections or requests refused by an HTTP limit, by limit.");
  for (const auto& [why, n] : http_rejected_)
    o << "kvtier_serve_http_rejected_total{limit=\"" << Escape(why) << "\"} " << n << "\n";
  Head(o, "kvtier_serve_accept_waits_total", "counter",
       "Accepts that failed and paused the HTTP front (no file descriptor or memory left).");
  o << "kvtier_serve_accept_waits_total " << accept_waits_ << "\n";
  Head(o, "kvtier_serve_connections_open", "gauge", "Open HTTP connections.");
  o << "kvtier_serve_connections_open " << connections_open_ << "\n";
  Head(o, "kvtier_serve_requests_finished_total", "counter",
       "Generations finished, by finish reason (stop, length, cancelled, error).");
  for (const auto& [why, n] : finish_)
    o << "kvtier_serve_requests_finished_total{reason=\"" << Escape(why) << "\"} " << n << "\n";
  struct Field {
    const char* name;
    const char* help;
    uint64_t TenantCounters::*member;
  };
  const Field fields[] = {
      {"kvtier_serve_prompt_tokens_total", "Prompt tokens, by tenant.", &TenantCounters::prompt},
      {"kvtier_serve_prompt_cache_hit_tokens_total",
       "Prompt tokens whose state came from the cache (restored or resident), by tenant.",
       &TenantCounters::cached},
      {"kvtier_serve_prompt_cache_miss_tokens_total", "Prompt tokens computed, by tenant.",
       &TenantCounters::miss},
      {"kvtier_serve_completion_tokens_total", "Completion tokens, by tenant.",
       &TenantCounters::completion},
      {"kvtier_serve_tenant_step_tokens_total",
       "Tokens engine steps ran for the tenant's sequences (decode and prefill), by tenant.",
       &TenantCounters::step_tokens},
  };
  for (const Field& f : fields) {
    Head(o, f.name, "counter", f.help);
    for (const auto& [tenant, t] : tenants_)
      o << f.name << "{tenant=\"" << Escape(tenant) << "\"} " << t.*f.member << "\n";
  }
  Head(o, "kvtier_serve_cost_total", "counter",
       "Billed cost of finished requests at the tenant's prices, by tenant.");
  for (const auto& [tenant, t] : tenants_)
    o << "kvtier_serve_cost_total{tenant=\"" << Escape(tenant) << "\"} " << Num(t.cost) << "\n";
  Hist(o, "kvtier_serve_ttft_seconds", "Time from admission to the first token.", ttft_);
  Hist(o, "kvtier_serve_tpot_seconds", "Time between consecutive output tokens.", tpot_);
  Hist(o, "kvtier_serve_batch_sequences", "Sequences served by one engine step.", batch_sequences_);
  Hist(o, "kvtier_serve_step_tokens", "Tokens one engine step ran through the model.",
       step_tokens_);
  const std::pair<const char*, uint64_t> counters[] = {
      {"kvtier_serve_resumes_total", resumes_},
      {"kvtier_serve_resume_hits_total", resume_hits_},
      {"kvtier_serve_hot_state_restores_total", hot_state_restores_},
      {"kvtier_serve_replays_total", replays_},
      {"kvtier_serve_replay_tokens_total", replay_tokens_},
      {"kvtier_serve_step_replays_total", step_replays_},
      {"kvtier_serve_resident_hits_total", resident_hits_},
      {"kvtier_serve_swap_outs_total", swap_outs_},
      {"kvtier_serve_save_failures_total", save_failures_},
      {"kvtier_serve_kvtierd_failures_total", kvtierd_failures_},
      {"kvtier_serve_disconnects_total", disconnects_},
      {"kvtier_serve_restores_abandoned_total", restores_abandoned_},
      {"kvtier_serve_steps_total", steps_},
      {"kvtier_serve_prefill_tokens_total", prefill_tokens_},
      {"kvtier_serve_spec_rounds_total", spec_rounds_},
      {"kvtier_serve_spec_rounds_undrafted_total", spec_rounds_undrafted_},
      {"kvtier_serve_spec_verifications_total", spec_verifications_},
      {"kvtier_serve_spec_drafted_tokens_total", spec_drafted_},
      {"kvtier_serve_spec_accepted_tokens_total", spec_accepted_},
      {"kvtier_serve_spec_draft_passes_total", spec_draft_passes_},
  };
  const char* helps[] = {
      "Admissions that looked the prompt up in kvtierd.",
      "Of those, admissions that restored at least one unit.",
      "Of those, exact restores from a hot state (no replay).",
      "Restores that rebuilt the SWA rings by bounded replay (no hot state to continue).",
      "Tokens those replays ran through the model.",
      "Of the replays, those run on the engine's step thread (--replays-on-step-thread, or a "
      "CUDA engine), delaying the running sequences; the rest ran on the kvtierd threads.",
      "Admissions that continued a sequence still resident in the engine.",
      "Idle sequences saved to kvtierd and dropped to make room in the KV pool.",
      "Saves to kvtierd that failed, or were skipped while kvtierd was unavailable (the "
      "request still succeeds; its next turn misses what was not saved).",
      "Connections to kvtierd that failed: could not connect, a handshake or call timed out "
      "(--kvtierd-timeout-ms), or kvtierd closed it.",
      "Requests whose client went away before they finished.",
      "Of those, restores whose client left while they were queued or under way: no kvtierd "
      "read is made once the client is seen gone.",
      "Engine steps (one ForwardBatch pass each).",
      "Prompt tokens prefilled in chunks by engine steps (beside the decode tokens).",
      "Speculative rounds (one per step with decoding sequences).",
      "Of those, rounds in which no sequence drafted (plain decode rows of the step's pass).",
      "Sequence verifications (one per sequence per speculative pass).",
      "Draft tokens verified.",
      "Of those, accepted (each also emitted; drafted >= accepted).",
      "Draft passes run (one per drafting sequence per drafted round; probes included).",
  };
  static_assert(sizeof(counters) / sizeof(counters[0]) == sizeof(helps) / sizeof(helps[0]),
                "one help line per counter");
  for (size_t i = 0; i < std::size(counters); ++i) {
    Head(o, counters[i].first, "counter", helps[i]);
    o << counters[i].first << " " << counters[i].second << "\n";
  }
  Head(o, "kvtier_serve_spec_draft_length_total", "counter",
       "Sequence verifications by the number of draft tokens verified (the draft scheduler's "
       "choice; 0 = a plain decode row).");
  for (const auto& [len, n] : spec_draft_length_)
    o << "kvtier_serve_spec_draft_length_total{length=\"" << len << "\"} " << n << "\n";
  const std::pair<const char*, int64_t> gauges[] = {
      {"kvtier_serve_queue_depth", queue_depth_},
      {"kvtier_serve_active_sequences", active_},
      {"kvtier_serve_resident_sequences", resident_},
      {"kvtier_serve_resident_tokens", resident_tokens_},
      {"kvtier_serve_layer_device_failed", layer_device_failed_},
      {"kvtier_serve_kvtierd_unavailable", kvtierd_unavailable_},
      {"kvtier_serve_kvtierd_restores_queued", kvtierd_restores_queued_},
      {"kvtier_serve_kvtierd_save_bytes_queued", kvtierd_save_bytes_queued_},
  };
  const char* ghelps[] = {
      "Requests waiting for admission.",
      "Sequences generating.",
      "Sequences in the KV pool (active and idle).",
      "Tokens held by the KV pool.",
      "1 once a call to the device of --layer-device failed: the engine dropped its device "
      "layers and every pass runs on the CPU since (restart to use the device again); else 0.",
      "1 from a failed connection to kvtierd until a connection succeeds: requests meanwhile "
      "are served without the cache (billed as misses, nothing saved); else 0.",
      "Admitted requests whose prompt kvtierd is being asked for (queued or running on the "
      "server's kvtierd thread); they hold their place in the KV pool meanwhile.",
      "Encoded bytes of finished turns waiting to be put to kvtierd (their requests' last "
      "events wait with them; at most 256 MiB, then the steps wait).",
  };
  static_assert(sizeof(gauges) / sizeof(gauges[0]) == sizeof(ghelps) / sizeof(ghelps[0]),
                "one help line per gauge");
  for (size_t i = 0; i < std::size(gauges); ++i) {
    Head(o, gauges[i].first, "gauge", ghelps[i]);
    o << gauges[i].first << " " << gauges[i].second << "\n";
  }
  return o.str();
}

}  // namespace kvtier::serving
