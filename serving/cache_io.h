// CacheIo: the threads that make the server's kvtierd calls, so that no engine step waits on
// kvtierd (docs/SERVING.md, "kvtierd off the step thread").
//
// The scheduler's thread hands it jobs and never waits on one (but for the bound on saves below):
//   - a restore of a new request's prompt: SessionStore::Fetch (LOOKUP, the guard, the GETs of
//     the hit units, imported into a fresh state, and of the hot states that could continue
//     them). With a resident sequence that covers `resident_tokens` of the prompt, first one
//     LOOKUP: when kvtierd holds no more whole pages than that, the result says so
//     (use_resident) and nothing is fetched. With replay engines (CacheIoOptions::
//     replay_engine) the worker then completes the restore on its own engine (SessionCodec::
//     Complete: the hot state imported, or the bounded replay) and accounts it; otherwise the
//     scheduler takes finished restores (TakeRestores) and completes them on its engine;
//   - a save of a finished request: the units and hot state the scheduler encoded
//     (SessionCodec::PrepareSave) are put (SessionStore::PutSave), then the request's last
//     event is pushed: a client has its answer only once its turn is in kvtierd. A save that
//     fails is counted (kvtier_serve_save_failures_total) and reported (TakeSaveFailures) so the
//     sequence's cursor is set back and its next save puts those units again;
//   - the accounting of a restore the scheduler completed (SessionStore::Account: the guard's
//     replay speed).
//
// Jobs run on `threads` workers, taken oldest first, several at once: a restore never waits
// behind another request's restore or save while a worker is free, and the waits of calls in
// flight (kvtierd's reads from its SSD, the network) overlap. One sequence's saves run one at a
// time, in the order submitted (its last job, which pushes the request's last event, after
// every unit of the turn is put). Each worker has its own kvtierd connection per tenant (each
// with the tenant's token; a connection carries one call at a time), and every tenant's guard
// one cost model shared by the workers (each restore starts from it and writes back what it
// measured; of two restores of one tenant measured at once, the later write stands).
//
// kvtierd's health is shared: a connect or call that failed after half a timeout or more
// serves every request without the cache for 1 s, doubling up to daemon_retry_max_ms, and
// drops every worker's connections (each worker drops its own before its next call); failures
// of calls begun before an earlier failure was noted belong to that same outage and do not
// double the backoff. One that failed at once is tried again at the next job. A tenant that
// kvtierd names as another tenant's namespace is never cached.
//
// Saves hold their encoded bytes until they are put: SubmitSave waits while more than
// save_bytes_max are queued (kvtierd slower than generation slows generation; a turn is never
// dropped for room). Restores queued when Stop is called are dropped; saves are finished first.
//
// Thread safety: every method may be called from any thread; the scheduler is the one caller.
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
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "common/status.h"
#include "engine/session.h"
#include "serving/generation.h"
#include "serving/metrics.h"

namespace kvtier::serving {

// Default CacheIoOptions::save_bytes_max.
inline constexpr uint64_t kSaveBytesQueuedMaxDefault = uint64_t{256} << 20;
// Default and largest CacheIoOptions::threads.
inline constexpr uint64_t kCacheIoThreadsDefault = 2;
inline constexpr uint64_t kCacheIoThreadsMax = 64;

struct CacheIoOptions {
  // How to reach kvtierd (SchedulerOptions::daemon); each tenant's token replaces `token`.
  daemon::ClientOptions daemon;
  uint64_t daemon_retry_max_ms = 30000;
  engine::SessionOptions session;
  // EngineModelFingerprint of the engine's config and weights with session.unit_tokens.
  Digest fingerprint{};
  // The engine the stores are created for: only its config is read off its thread (SessionStore
  // ::Fetch never runs a pass).
  engine::Engine* engine = nullptr;
  // What every store's guard starts from (SessionStore::Fetch runs no engine pass, so it cannot
  // calibrate itself): the engine's forward speed, measured by the caller on the engine's
  // thread (engine::CalibrateCost).
  engine::CostModel cost_prior;
  uint64_t save_bytes_max = kSaveBytesQueuedMaxDefault;
  // Workers, each making one kvtierd call at a time (1..kCacheIoThreadsMax).
  uint64_t threads = kCacheIoThreadsDefault;
  // Each worker, as it starts, touches the global KV of a sequence of this many tokens in its
  // own memory and frees it, so that the first restore it imports finds those pages faulted in
  // (the allocator keeps what it frees: common/malloc_tuning.h). 0: none; at most
  // engine::kMaxSessionTokens.
  uint64_t prefault_tokens = 0;
  // Makes one worker's own engine (called once per worker, by Create, on its caller's thread;
  // an error fails Create). Each worker then completes its restores itself (SessionCodec::
  // Complete on that engine), so no replay runs on the scheduler's step thread and the workers
  // replay side by side. Every engine it makes must compute what `engine` computes, bit for
  // bit (the same config, weights and options that change results, on the CPU): a restored
  // state must not depend on the engine that completed it. Each holds its own scratch (engines
  // over the same weights share their packed copies: engine/matmul.h). Null (default): the
  // scheduler completes the restores.
  std::function<StatusOr<std::unique_ptr<engine::Engine>>()> replay_engine;
};

// Touches, on the calling thread, the global KV byte vectors of a sequence of `tokens` tokens of
// `engine` (ReserveKvTokens, every page written once) and frees them: with the allocator keeping
// what it frees (TuneMallocForServer), the thread's next restore of up to that many tokens
// imports into pages already faulted in. A CacheIo worker does this as it starts
// (CacheIoOptions::prefault_tokens).
void PrefaultKv(const engine::Engine& engine, uint64_t tokens);

class CacheIo {
 public:
  using Clock = std::chrono::steady_clock;

  // `wake` is called (on the worker) after each finished restore; metrics: not owned.
  static StatusOr<std::unique_ptr<CacheIo>> Create(const CacheIoOptions& options,
                                                   ServingMetrics* metrics,
                                                   std::function<void()> wake);
  ~CacheIo();  // Stop()

  struct RestoreResult {
    uint64_t id = 0;
    // kvtierd holds no more whole pages of the prompt than the resident sequence (or the LOOKUP
    // failed): continue the resident one; nothing was fetched.
    bool use_resident = false;
    // A store was asked (false: no cache for this request: kvtierd unavailable or in backoff,
    // or the tenant's namespace is another's). Then `status` and `fetched` hold Fetch's result.
    bool asked = false;
    Status status;
    engine::FetchedPrefix fetched;
    // Completed on the worker (replay_engine; `status` ok): the restored state, its last
    // token's logits and Complete's report, already accounted; `fetched` is empty. Otherwise
    // the scheduler completes `fetched`.
    bool completed = false;
    engine::SequenceState state;
    std::vector<float> logits;
    engine::ResumeReport report;
  };
  // Queues a restore of `prompt` for tenant (not owned; must outlive this object). `abandoned`
  // (if set; called on a worker) says the request's client left: a queued restore is then not
  // begun, and one under way stops before its next kvtierd read (SessionStore::Fetch); the
  // scheduler drops either result (its generation is cancelled).
  void SubmitRestore(uint64_t id, const Tenant* tenant, std::vector<int32_t> prompt,
                     size_t resident_tokens, std::function<bool()> abandoned = {});
  // The restores finished since the last call, in the order they finished.
  std::vector<RestoreResult> TakeRestores();

  // Queues the save of sequence seq_id, run after its earlier saves; `done` (if any) is pushed
  // to `gen` once it is put (or failed). Waits while the queued saves hold more than save_bytes_max
  // (one save alone is always taken).
  void SubmitSave(uint64_t seq_id, const Tenant* tenant, engine::PreparedSave save,
                  std::shared_ptr<Generation> gen, std::optional<GenerationEvent> done);
  struct SaveFailure {
    uint64_t seq_id = 0;
    int64_t units_saved = 0;  // the sequence's units [0, units_saved) are in kvtierd
  };
  std::vector<SaveFailure> TakeSaveFailures();

  // Queues SessionStore::Account of a restore completed for tenant.
  void Account(const Tenant* tenant, const engine::ResumeReport& report);

  // Whether kvtierd is in backoff now (a save would fail at once: the caller may skip
  // encoding it).
  bool in_backoff() const {
    return Clock::now().time_since_epoch().count() < retry_at_ticks_.load();
  }

  // Drops the queued restores, finishes the queued saves and ends the workers. Idempotent.
  void Stop();

 private:
  struct Job {
    enum class Kind { kRestore, kSave, kAccount } kind = Kind::kRestore;
    uint64_t id = 0;  // restore: its id; save: the sequence's
    const Tenant* tenant = nullptr;
    std::vector<int32_t> prompt;      // restore
    size_t resident_tokens = 0;       // restore
    std::function<bool()> abandoned;  // restore
    engine::PreparedSave save;
    std::shared_ptr<Generation> gen;
    std::optional<GenerationEvent> done;
    engine::ResumeReport report;  // account
  };
  // One worker's connection for one tenant.
  struct TenantStore {
    std::unique_ptr<daemon::Client> client;
    std::unique_ptr<engine::SessionStore> store;
    uint64_t outage = 0;  // outages_ when it was made: dropped once another outage is noted
  };
  // A worker: its thread, its connections and its engine (touched by that thread only).
  struct Worker {
    std::map<const Tenant*, TenantStore> stores;
    std::unique_ptr<engine::Engine> engine;     // replay_engine's; null without one
    std::optional<engine::SessionCodec> codec;  // over `engine`
    std::thread thread;
  };
  CacheIo(const CacheIoOptions& options, ServingMetrics* metrics, std::function<void()> wake);
  void Run(Worker* w);
  // The oldest job a worker may take now (a save whose sequence has one running may not);
  // jobs_.end() when none. Under mu_.
  std::deque<Job>::iterator NextJob();
  RestoreResult DoRestore(Worker* w, Job& job);
  void DoSave(Worker* w, Job& job);
  // SessionStore::Account of a completed restore, through w's store for tenant.
  void DoAccount(Worker* w, const Tenant* tenant, const engine::ResumeReport& report);
  // The queue's gauges (ServingMetrics::KvtierdQueue). Takes mu_: never call it holding mu_.
  void Publish();
  // w's store for tenant, connecting when it has none (or when an outage was noted since it
  // connected); null when there is no cache for the tenant now.
  engine::SessionStore* StoreFor(Worker* w, const Tenant* tenant);
  // After a call through w's store for tenant that began at `began`: when its connection
  // failed, DaemonFailed.
  void CheckDaemon(Worker* w, const Tenant* tenant, Clock::time_point began);
  // kvtierd failed (`why`) in an attempt that began at `began`: a new outage is noted (every
  // worker's connections are dropped before their next call), and a slow failure starts (or
  // doubles) the backoff, unless the attempt began before the last noted failure.
  void DaemonFailed(const Status& why, Clock::time_point began);
  // The tenant's shared cost model copied into `store` / `store`'s copied back (health_mu_).
  void LoadCost(const Tenant* tenant, engine::SessionStore* store);
  void KeepCost(const Tenant* tenant, engine::SessionStore* store);

  CacheIoOptions options_;
  ServingMetrics* metrics_;
  std::function<void()> wake_;

  std::mutex mu_;
  std::condition_variable cv_;       // jobs queued or a save ended, or stop
  std::condition_variable room_cv_;  // save bytes freed
  bool stop_ = false;
  std::deque<Job> jobs_;
  std::set<uint64_t> saving_;  // sequences with a save running
  uint64_t save_bytes_ = 0;    // encoded bytes of the queued and running saves
  int64_t restores_running_ = 0;
  std::vector<RestoreResult> restores_done_;
  std::vector<SaveFailure> save_failures_;

  // kvtierd's health, the tenants' namespaces and cost models, shared by the workers.
  std::mutex health_mu_;
  // kvtierd's tenant (HELLO's tenant name) of each tenant's stores: two tenants of this server
  // must never share one, or one's cache would serve the other's prompts.
  std::map<std::string, const Tenant*> daemon_tenants_;
  std::set<const Tenant*> shared_namespace_;  // tenants served without the cache for that
  std::map<const Tenant*, engine::CostModel> costs_;
  uint64_t outages_ = 0;                 // failures noted: a store made before one is dropped
  Clock::time_point last_failure_at_{};  // when the last failure was noted
  Clock::time_point retry_at_{};
  uint64_t backoff_ms_ = 0;
  bool unavailable_ = false;  // the last attempt failed (kvtier_serve_kvtierd_unavailable)
  // retry_at_ as Clock ticks, for in_backoff() on other threads (0: no backoff).
  std::atomic<Clock::rep> retry_at_ticks_{0};

  std::vector<Worker> workers_;
};

}  // namespace kvtier::serving
