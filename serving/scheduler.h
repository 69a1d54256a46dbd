// Scheduler: the one thread that drives the Engine for every request in flight
// (docs/SERVING.md, "Scheduling"; DESIGN §5 for save/resume).
//
// Admission (fair across tenants: the next request comes from the tenant with the fewest
// active sequences per unit of Tenant::weight, ties round robin): a request is admitted when fewer
// than active_sequences_max sequences are active and the KV pool has room for its prompt plus
// max_tokens (kv_pool_tokens_max; idle sequences are swapped out, least recently used first, to
// make room: their units are already saved, they are dropped). Its prompt's cached part is found at
// admission, in this order:
//   1. from the engine: an idle sequence of the same tenant whose tokens are a prefix of the
//      prompt is continued (exact, no replay);
//   2. from kvtierd (SessionStore::Restore with the tenant's token): the hit units are imported
//      and the hot state restored (page-aligned or mid-page: exact) or the SWA rings rebuilt
//      by bounded replay;
//   3. nothing (no cache, a miss, or the guard judged a full forward cheaper).
// While sequences are active, one step admits at most one request that fetched units from
// kvtierd (a restore costs in proportion to its hit). Admission computes nothing else: the
// prompt's remaining tokens are prefilled by the steps.
// Usage::cached_tokens is exactly the prompt tokens served by 1 (the resident sequence's
// tokens) or 2 (ResumeReport::restored_tokens; 0 when the guard recomputed).
//
// Steps: every step runs one Engine::ForwardBatch pass (one MatMul per weight over all rows;
// bit-identical to running each sequence alone) over at most step_tokens_max tokens, split
// across the tenants with work by weight (FairShares, fair_share.h); within a tenant's share:
//   - decode: each of its generating sequences samples one token from its logits and runs it,
//     starting at a rotating position so none is always left out;
//   - prefill: with the share left, the next chunk of at most prefill_chunk_tokens tokens of
//     each of its prefilling sequences, oldest admission first (and at least one token of the
//     oldest prompt when no share left room for any).
// With a draft (options.draft, --speculative) the decode rows are instead one speculative
// round (SpeculativeDecoder::RoundBatch: draft, verify in one ForwardBatch, accept, roll back)
// and the chunks a second pass; the round's emitted tokens go through the same usage, stop
// and limit checks one by one, and a request ending inside them is cut back to exactly the
// state plain decoding leaves (SpeculativeDecoder::TruncateRound).
// A prompt is therefore computed by the full forward in chunks (Engine::Forward semantics,
// never the CED prefill), so a computed, a resident-continued and a hot-state-restored prompt
// give the same state bit for bit, and a long prompt delays the running sequences by one
// chunk per step, not by its whole prefill. A sequence generates from the step after its last
// chunk. A finished request (eos, stop string, max_tokens, context limit) saves its new whole
// units and its hot state to kvtierd and stays resident as an idle sequence (at most
// idle_sequences_max; 0 drops it at once). A cancelled request (client gone) is saved and
// dropped at the next step.
//
// Thread safety: Submit and the Generation methods may be called from any thread; everything
// else runs on the scheduler's own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "common/status.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "serving/fair_share.h"
#include "serving/metrics.h"
#include "serving/openai_api.h"
#include "serving/usage.h"

namespace kvtier::serving {

// A customer: an API key maps to one (docs/SERVING.md, "API keys").
struct Tenant {
  std::string name;          // appears in logs and metric labels
  std::string daemon_token;  // kvtierd token: the daemon keeps each tenant's units apart
  Prices prices;
  // Share of admission and of every step's tokens against the other tenants with work
  // (1..kTenantWeightMax; fair_share.h).
  uint32_t weight = 1;
};

struct GenerationEvent {
  enum class Kind { kText, kDone, kError };
  Kind kind = Kind::kText;
  std::string text;           // kText: the next piece of output
  std::string finish_reason;  // kDone: stop | length
  uint64_t step = 0;          // the scheduler step that produced it (kText, kDone)
  Usage usage;                // kDone
  double cost = 0;            // kDone: at the tenant's prices
  ApiError error;             // kError
};

// One request in flight, shared by its HTTP connection and the scheduler.
class Generation {
 public:
  // Waits up to timeout_ms for the next event; false on timeout. After kDone or kError no
  // further event comes.
  bool Next(GenerationEvent* event, int timeout_ms);
  // The client went away: the scheduler drops the request at its next step.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  // The scheduler step at whose start the request was admitted; 0 before admission.
  uint64_t admitted_step() const { return admitted_step_.load(); }

 private:
  friend class Scheduler;
  void Push(GenerationEvent event);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerationEvent> events_;
  std::atomic<bool> cancelled_{false};
  std::atomic<uint64_t> admitted_step_{0};
};

struct GenerationParams {
  std::vector<int32_t> prompt;  // 1..context_tokens_max-1 tokens
  uint64_t max_tokens = 0;      // 0 = up to the context limit
  double temperature = 1.0;
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
};

// What one step ran (SchedulerOptions::step_observer).
struct StepReport {
  uint64_t step = 0;
  std::map<std::string, uint64_t> tokens_by_tenant;  // tokens run through the model, by tenant
};

struct SchedulerOptions {
  // How to reach kvtierd: its Unix socket (`socket_path`) or its native TCP front (`tcp_host`,
  // `tcp_port`, optionally TLS); neither = no cache (every prompt computed, nothing saved).
  // The token is each tenant's (ApiKeys), not this one's.
  // daemon.timeout_ms bounds every connect and call: kvtierd's calls run on the scheduler thread,
  // so a stalled kvtierd holds every sequence's step for that long.
  daemon::ClientOptions daemon;
  bool cache_enabled() const { return !daemon.socket_path.empty() || daemon.tcp_port != 0; }
  // After a connection to kvtierd fails slowly (a connect or call that took half a timeout or
  // more: kvtierd stalled or cut off), every request is served without the cache for a while,
  // then one connection is tried again: 1 s after the first such failure, doubling after each
  // up to this. A failure that comes at once (kvtierd not running) is tried again at the next
  // request.
  uint64_t daemon_retry_max_ms = 30000;
  engine::SessionOptions session;
  uint64_t queue_depth_max = 256;         // requests waiting for admission (more: 429)
  uint64_t active_sequences_max = 32;     // sequences generating at once
  uint64_t kv_pool_tokens_max = 1 << 20;  // tokens resident (active reservations + idle)
  uint64_t idle_sequences_max = 64;       // finished sequences kept resident; 0 = none
  uint64_t context_tokens_max = 8192;     // prompt + completion of one sequence
  // Tokens one step runs: decode tokens plus prefill chunks. At most kMaxTokensPerCall.
  uint64_t step_tokens_max = 256;
  // Largest prefill chunk of one sequence in one step; at most the engine's
  // EngineOptions::prefill_chunk_tokens (ForwardBatch refuses longer spans).
  uint64_t prefill_chunk_tokens = 256;
  // Speculative decoding (docs/SERVING.md, "Speculative decoding"): the DSpark draft (not
  // owned; null = off). Decode rows of the generating sequences then go through
  // SpeculativeDecoder::RoundBatch; draft_len fixes the draft tokens verified per sequence
  // (0..block size), unset = the load-aware DraftScheduler chooses.
  const engine::DSpark* draft = nullptr;
  std::optional<int> draft_len;
  // The clock the DraftScheduler times passes with (engine::CostClock); empty = the engine's
  // CPU time (engine::CpuCostClock), never the wall clock. A test hook.
  engine::CostClock draft_cost_clock;
  // Called on the scheduler's thread after every step that ran tokens (tests, tracing); must
  // not call back into the scheduler.
  std::function<void(const StepReport&)> step_observer;
};

// The largest verify pass the DraftScheduler's SPS table covers with --speculative: a step
// verifies R + B <= 64 tokens (R sequences, B draft tokens); with 64 or more sequences
// decoding, steps draft nothing.
inline constexpr int kSpecVerifyTokensMax = 64;

class Scheduler {
 public:
  // engine: not owned, used only by the scheduler's thread from now on. weights, metrics and
  // options.draft: not owned, must outlive the scheduler. With a draft and no fixed
  // draft_len, Create measures the engine's verify passes for the DraftScheduler (passes of
  // 1..kSpecVerifyTokensMax tokens: a few seconds on the miniature), and the steps keep the
  // table current with every pass of undrafted decode rows alone and every drafted round,
  // timed in CPU time (engine::CpuCostClock).
  // InvalidArgument when context_tokens_max > kv_pool_tokens_max or kMaxSessionTokens,
  // step_tokens_max or prefill_chunk_tokens > kMaxTokensPerCall, or a limit is 0.
  static StatusOr<std::unique_ptr<Scheduler>> Create(engine::Engine* engine,
                                                     const engine::ModelWeights& weights,
                                                     const SchedulerOptions& options,
                                                     ServingMetrics* metrics);
  ~Scheduler();  // Stop()

  // Queues a generation for `tenant` (not owned; must outlive the scheduler). Rejected when
  // the queue is full, InvalidArgument for a prompt over the context, Unavailable after Stop.
  StatusOr<std::shared_ptr<Generation>> Submit(const Tenant* tenant, GenerationParams params);
  // Submit's context check alone: InvalidArgument unless 0 < prompt_tokens <
  // context_tokens_max (a caller that can count a prompt's tokens before building them).
  Status CheckPromptTokens(uint64_t prompt_tokens) const;
  // Ends the thread; queued and active requests get a 503 error event.
  void Stop();

  const SchedulerOptions& options() const { return options_; }

 private:
  struct Pending {
    const Tenant* tenant;
    GenerationParams params;
    std::shared_ptr<Generation> gen;
    std::chrono::steady_clock::time_point arrival;
  };
  struct Seq;
  struct TenantStore {
    std::unique_ptr<daemon::Client> client;
    std::unique_ptr<engine::SessionStore> store;
    // kvtierd named another tenant's namespace for this tenant's token: never cached.
    bool shared_namespace = false;
  };

  Scheduler(engine::Engine* engine, const engine::ModelWeights* weights,
            const SchedulerOptions& options, ServingMetrics* metrics);
  void Run();
  // Admits queued requests while there is room; returns after the first that must wait.
  void Admit();
  // Sets up seq's state from its cached part; *fetched: units came from kvtierd.
  Status Start(Seq* seq, Pending& p, bool* fetched);
  void StepActive();
  // The decode rows of `batch` as one speculative round: when it drafts, one RoundBatch pass
  // of their own; finished sequences go to done_stop / done_length, failed ones to failed.
  // When it does not draft, the sequences go to *undrafted: the caller runs their pending
  // tokens as plain decode rows of the step's pass (SpeculativeDecoder::StepCapture /
  // FinishStep), then EndSpecRound.
  void SpecRound(const std::vector<Seq*>& batch, std::vector<Seq*>* done_stop,
                 std::vector<Seq*>* done_length, std::vector<Seq*>* failed,
                 std::vector<Status>* errors, std::map<const Tenant*, uint64_t>* step_tokens,
                 int64_t* tokens, int64_t* sequences, std::vector<Seq*>* undrafted);
  // Emits the tokens `out` a round of s emitted after n tokens ran (a request that ends inside
  // them keeps exactly the tokens plain decoding would have run) and takes the logits after
  // the kept ones; false (with the error in *error) when that fails.
  bool EndSpecRound(Seq* s, const std::vector<int32_t>& out, int64_t n,
                    std::vector<Seq*>* done_stop, std::vector<Seq*>* done_length, Status* error);
  enum class Emitted { kMore, kStop, kLength };
  // Emits `tok`, sampled after `ran` tokens of the sequence ran: usage, text events, stop
  // strings; kStop / kLength when the request ends with it.
  Emitted Emit(Seq* seq, int32_t tok, size_t ran);
  // Ends seq's request with `reason`; keeps or drops the sequence.
  void Finish(std::unique_ptr<Seq> seq, const std::string& reason);
  void Fail(std::unique_ptr<Seq> seq, const Status& status);
  void SaveSeq(Seq* seq);
  engine::SessionStore* StoreFor(const Tenant* tenant);
  // After a call through `tenant`'s store or client that began at `began`: when its connection
  // failed, DaemonFailed.
  void CheckDaemon(const Tenant* tenant, std::chrono::steady_clock::time_point began);
  // kvtierd failed (`why`) in an attempt that began at `began`: drops every tenant's connection
  // (the next request connects again), and when the attempt took half a timeout or more, serves
  // without the cache until the next attempt (the backoff above).
  void DaemonFailed(const Status& why, std::chrono::steady_clock::time_point began);
  // Whether kvtierd holds more whole pages of `prompt` than the `resident_tokens` of a resident
  // sequence cover (one LOOKUP, only when the prompt has whole pages past them); false without
  // a store or when the lookup fails.
  bool DaemonHoldsMore(const Tenant* tenant, const std::vector<int32_t>& prompt,
                       size_t resident_tokens);
  // Removes queued requests whose client went away (each counted as a disconnect), so that
  // they hold no place in queue_depth_max. Requires mu_.
  void DropCancelledLocked();
  uint64_t PoolTokens() const;
  void PublishGauges();

  engine::Engine* engine_;
  const engine::ModelWeights* weights_;
  SchedulerOptions options_;
  std::unique_ptr<engine::DraftScheduler> draft_scheduler_;  // with options_.draft
  ServingMetrics* metrics_;
  Digest fingerprint_{};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<const Tenant*, std::deque<Pending>> queues_;
  std::deque<const Tenant*> turn_;  // tenants with queued requests, in round-robin order
  uint64_t queued_ = 0;

  // Scheduler thread only.
  std::map<const Tenant*, TenantStore> stores_;
  // kvtierd's tenant (HELLO's tenant name) of each tenant's store: two tenants of this server
  // must never share one, or one's cache would serve the other's prompts.
  std::map<std::string, const Tenant*> daemon_tenants_;
  // kvtierd's backoff: no connection is tried before daemon_retry_at_ (daemon_backoff_ms_ 0:
  // kvtierd is healthy).
  std::chrono::steady_clock::time_point daemon_retry_at_{};
  uint64_t daemon_backoff_ms_ = 0;
  bool daemon_unavailable_ = false;  // the last attempt failed (kvtier_serve_kvtierd_unavailable)
  std::vector<std::unique_ptr<Seq>> active_;
  std::deque<std::unique_ptr<Seq>> idle_;  // least recently used first
  struct TenantShare {
    double credit = 0;  // FairShares' rounding credit
    size_t rotate = 0;  // first of the tenant's generating sequences served next
  };
  std::map<const Tenant*, TenantShare> shares_;
  uint64_t step_ = 0;  // steps begun
  std::thread thread_;
};

}  // namespace kvtier::serving
