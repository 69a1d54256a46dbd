// Scheduler: the one thread that drives the Engine for every request in flight
// (docs/SERVING.md, "Scheduling"; DESIGN §5 for save/resume).
//
// Admission (fair across tenants: the next request comes from the tenant with the fewest active
// sequences per unit of Tenant::weight, ties round robin): a request is admitted when fewer
// than active_sequences_max sequences are active or restoring and the KV pool has room for its
// prompt plus max_tokens (kv_pool_tokens_max; idle sequences are swapped out, least recently
// used first, to make room: their units are already saved, they are dropped). Its prompt's
// cached part is found at admission, in this order:
//   1. from the engine: an idle sequence of the same tenant whose tokens are a prefix of the
//      prompt is continued (exact, no replay), unless kvtierd holds more whole pages of it;
//   2. from kvtierd: the sequence waits (restoring, holding its slot and reservation) while
//      a CacheIo worker fetches the hit units and hot states (SessionStore::Fetch with the
//      tenant's token); the steps go on meanwhile. The first step after the fetch completes
//      it on the engine (SessionCodec::Complete: the hot state restored, page-aligned or
//      mid-page: exact, or the SWA rings rebuilt by bounded replay);
//   3. nothing (no cache, kvtierd unavailable, a miss, or the guard judged a full forward
//      cheaper).
// While sequences are active, one step completes at most one restore that replays (its replay
// costs engine time); restores from a hot state (a copy) are all completed at once. Admission
// computes nothing else: the prompt's remaining tokens are prefilled by the steps.
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
// chunk. A finished request (eos, stop string, max_tokens, context limit) encodes its new whole
// units and its hot state (SessionCodec::PrepareSave) and CacheIo puts them to kvtierd, then
// pushes the request's last event; the sequence stays resident as an idle sequence at once (at
// most idle_sequences_max; 0 drops it). A cancelled request (client gone) is saved and dropped at
// the next step. No step waits on kvtierd (CacheIo), but for CacheIo's bound on queued saves.
//
// Thread safety: Submit and the Generation methods may be called from any thread; everything
// else runs on the scheduler's own thread, and kvtierd's calls on CacheIo's workers (cache_io.h).
#pragma once

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
#include "serving/cache_io.h"
#include "serving/fair_share.h"
#include "serving/generation.h"
#include "serving/metrics.h"
#include "serving/openai_api.h"
#include "serving/usage.h"

namespace kvtier::serving {

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
  // daemon.timeout_ms bounds every connect and call; they run on CacheIo's workers, so a
  // stalled kvtierd delays the requests that restore or save through it, not the steps.
  daemon::ClientOptions daemon;
  bool cache_enabled() const { return !daemon.socket_path.empty() || daemon.tcp_port != 0; }
  // After a connection to kvtierd fails slowly (a connect or call that took half a timeout or
  // more: kvtierd stalled or cut off), every request is served without the cache for a while,
  // then one connection is tried again: 1 s after the first such failure, doubling after each
  // up to this. A failure that comes at once (kvtierd not running) is tried again at the next
  // request.
  uint64_t daemon_retry_max_ms = 30000;
  // Encoded bytes of finished turns waiting to be put to kvtierd (CacheIoOptions::save_bytes_max).
  uint64_t save_bytes_max = kSaveBytesQueuedMaxDefault;
  // CacheIo's workers: kvtierd calls in flight at once (CacheIoOptions::threads).
  uint64_t kvtierd_threads = kCacheIoThreadsDefault;
  // Makes each CacheIo worker's own engine (CacheIoOptions::replay_engine): restores are then
  // completed (the hot state imported, or the bounded replay) on the kvtierd threads, side by
  // side, and a step only takes their states. Every engine it makes must compute what the
  // scheduler's engine computes, bit for bit. Null: the step thread completes them, at most one
  // that replays per step while other sequences are active.
  std::function<StatusOr<std::unique_ptr<engine::Engine>>()> replay_engine;
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
  // timed in CPU time (engine::CpuCostClock). With the cache, Create times a 32-token forward
  // for the restore guard (CacheIoOptions::cost_prior) and starts CacheIo.
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
  // Ends the thread; queued, restoring and active requests get a 503 error event; the saves of
  // requests finished before are put (and their last events pushed) before it returns.
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

  Scheduler(engine::Engine* engine, const engine::ModelWeights* weights,
            const SchedulerOptions& options, ServingMetrics* metrics);
  void Run();
  // Admits queued requests while there is room; returns after the first that must wait.
  void Admit();
  // Sets up seq from its cached part: a resident sequence, or a restore queued on CacheIo
  // (*restoring: the sequence waits in restoring_ for it).
  Status Start(Seq* seq, Pending& p, bool* restoring);
  // Completes the restores CacheIo finished (without replay engines at most one that replays
  // here per step while others are active) and moves their sequences to active_.
  void FinishRestores();
  // Sets up seq's state from a finished restore; *replayed: it ran a bounded replay here.
  Status StartRestored(Seq* seq, CacheIo::RestoreResult& r, bool* replayed);
  // Gives a sequence's resident candidate (held while it restored) back to the idle pool.
  void ReturnResident(Seq* seq);
  // Swaps out idle sequences, least recently used first, while the pool or the idle count is
  // over its limit.
  void TrimIdle();
  // Sets back the cursors of sequences whose save failed (CacheIo::TakeSaveFailures).
  void ApplySaveFailures();
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
  // Encodes seq's unsaved units and hot state and hands them to CacheIo, which pushes `done`
  // (if any) once they are put; without the cache, pushes it now.
  void SaveSeq(Seq* seq, std::optional<GenerationEvent> done);
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
  // With the cache: the engine's side of save and resume, and the thread that talks to kvtierd.
  std::optional<engine::SessionCodec> codec_;
  std::unique_ptr<CacheIo> cache_io_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<const Tenant*, std::deque<Pending>> queues_;
  std::deque<const Tenant*> turn_;  // tenants with queued requests, in round-robin order
  uint64_t queued_ = 0;
  uint64_t wake_ = 0;  // bumped by Submit and by each finished restore

  // Scheduler thread only.
  std::vector<std::unique_ptr<Seq>> active_;
  std::vector<std::unique_ptr<Seq>> restoring_;        // admitted, waiting for CacheIo's restore
  std::deque<CacheIo::RestoreResult> restores_ready_;  // taken from CacheIo, not yet completed
  uint64_t next_seq_id_ = 1;
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
