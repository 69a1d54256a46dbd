// Serving metrics, rendered in the Prometheus text format on GET /metrics (docs/SERVING.md,
// "Metrics"; every name starts with kvtier_serve_).
//
// Thread safety: every method may be called from any thread (one mutex; updates are a few
// additions per request or engine step).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "serving/usage.h"

namespace kvtier::serving {

// A fixed-bucket histogram (upper bounds ascending; +Inf implied).
struct Histogram {
  explicit Histogram(std::vector<double> bounds)
      : bounds(std::move(bounds)), counts(this->bounds.size() + 1) {}
  void Observe(double v);
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // per bucket (not cumulative); last = above every bound
  double sum = 0;
  uint64_t count = 0;
};

class ServingMetrics {
 public:
  ServingMetrics();

  // HTTP front.
  void HttpRequest(int status);               // every answered request, by status
  void HttpRejected(const std::string& why);  // connections_max, header_bytes_max, ...
  void ConnectionsOpen(int64_t n);
  void AcceptWait();  // a failed accept paused the front (no descriptor or memory left)

  // A finished generation (stream or not): tokens, hits, cost, latencies.
  void RequestDone(const std::string& tenant, const Usage& usage, double cost,
                   const std::string& finish_reason);
  void Ttft(double seconds);
  void Tpot(double seconds);
  // One engine step: sequences in it, tokens it ran through the model, and how many of
  // those were prefill chunks' (the rest are decode tokens).
  void Step(int64_t sequences, int64_t tokens, int64_t prefill_tokens);
  // Tokens one step ran for `tenant`'s sequences (its fair share in use).
  void TenantStepTokens(const std::string& tenant, uint64_t tokens);
  // One speculative verify pass (--speculative): per sequence in it, the draft tokens it
  // verified and how many of them were accepted; and the draft passes the round ran (probes
  // and rounds that then verified no draft token included).
  void SpecRound(const std::vector<uint64_t>& drafted, const std::vector<uint64_t>& accepted,
                 uint64_t draft_passes = 0);
  // The same for a round of `sequences` sequences that drafted nothing (SpecRound with that
  // many zeros, without building them: the usual round when drafting does not pay).
  void SpecRoundUndrafted(uint64_t sequences);
  void Resume(bool from_daemon_hit, bool hot_state);  // an admission that asked kvtierd
  // A restore that rebuilt its SWA rings by bounded replay of `tokens` tokens, on the engine's
  // step thread or (on_step_thread false) on a kvtierd thread's own engine.
  void Replay(uint64_t tokens, bool on_step_thread);
  void ResidentHit();  // an admission served from the pool
  void SwapOut();      // an idle sequence saved and dropped
  void SaveFailed();
  // A connection to kvtierd that failed (connect, handshake, a call timed out or closed): the
  // server serves without the cache until `unavailable` turns false again.
  void KvtierdFailed();
  void KvtierdUnavailable(bool unavailable);
  // CacheIo's queue (serving/cache_io.h): restores queued or running, and the encoded bytes of
  // finished turns not yet put.
  void KvtierdQueue(int64_t restores, int64_t save_bytes);
  void Disconnect();  // a request whose client went away before it finished
  // A restore whose client left while it was queued or under way (CacheIo): no kvtierd read
  // after that.
  void RestoreAbandoned();
  void Gauges(int64_t queue_depth, int64_t active_sequences, int64_t resident_sequences,
              int64_t resident_tokens);
  // Whether the engine's device layers failed (Engine::DeviceFailure: its passes run on the CPU
  // since).
  void LayerDeviceFailed(bool failed);

  std::string Render() const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> http_requests_;
  std::map<std::string, uint64_t> http_rejected_;
  int64_t connections_open_ = 0;
  uint64_t accept_waits_ = 0;
  std::map<std::string, uint64_t> finish_;
  struct TenantCounters {
    uint64_t requests = 0, prompt = 0, cached = 0, miss = 0, completion = 0, step_tokens = 0;
    double cost = 0;
  };
  std::map<std::string, TenantCounters> tenants_;
  Histogram ttft_, tpot_, batch_sequences_, step_tokens_;
  uint64_t resumes_ = 0, resume_hits_ = 0, hot_state_restores_ = 0, resident_hits_ = 0;
  uint64_t replays_ = 0, replay_tokens_ = 0, step_replays_ = 0;
  uint64_t swap_outs_ = 0, save_failures_ = 0, disconnects_ = 0, kvtierd_failures_ = 0;
  uint64_t restores_abandoned_ = 0, steps_ = 0, prefill_tokens_ = 0;
  uint64_t spec_rounds_ = 0, spec_rounds_undrafted_ = 0, spec_verifications_ = 0;
  uint64_t spec_drafted_ = 0, spec_accepted_ = 0, spec_draft_passes_ = 0;
  std::map<uint64_t, uint64_t> spec_draft_length_;  // verifications by draft tokens verified
  int64_t queue_depth_ = 0, active_ = 0, resident_ = 0, resident_tokens_ = 0;
  int64_t layer_device_failed_ = 0, kvtierd_unavailable_ = 0;
  int64_t kvtierd_restores_queued_ = 0, kvtierd_save_bytes_queued_ = 0;
};

}  // namespace kvtier::serving
