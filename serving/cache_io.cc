#include "serving/cache_io.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace kvtier::serving {

StatusOr<std::unique_ptr<CacheIo>> CacheIo::Create(const CacheIoOptions& options,
                                                   ServingMetrics* metrics,
                                                   std::function<void()> wake) {
  if (options.engine == nullptr || metrics == nullptr)
    return Status::InvalidArgument("cache io: engine and metrics are required");
  if (options.save_bytes_max == 0)
    return Status::InvalidArgument("cache io: save_bytes_max must be > 0");
  if (options.threads == 0 || options.threads > kCacheIoThreadsMax)
    return Status::InvalidArgument("cache io: threads must be 1.." +
                                   std::to_string(kCacheIoThreadsMax));
  if (options.prefault_tokens > engine::kMaxSessionTokens)
    return Status::InvalidArgument("cache io: prefault_tokens must be at most " +
                                   std::to_string(engine::kMaxSessionTokens));
  // The stores' options are checked once here, not at each tenant's first connection.
  KVTIER_RETURN_IF_ERROR(
      engine::SessionCodec::Create(options.engine, options.fingerprint, options.session).status());
  std::unique_ptr<CacheIo> io(new CacheIo(options, metrics, std::move(wake)));
  io->workers_.resize(options.threads);  // never resized again: each thread holds its Worker
  if (options.replay_engine) {
    for (Worker& w : io->workers_) {
      KVTIER_ASSIGN_OR_RETURN(w.engine, options.replay_engine());
      if (w.engine == nullptr) return Status::InvalidArgument("cache io: replay_engine made none");
      KVTIER_ASSIGN_OR_RETURN(
          engine::SessionCodec codec,
          engine::SessionCodec::Create(w.engine.get(), options.fingerprint, options.session));
      w.codec.emplace(std::move(codec));
    }
  }
  for (Worker& w : io->workers_) w.thread = std::thread([p = io.get(), w = &w] { p->Run(w); });
  return io;
}

CacheIo::CacheIo(const CacheIoOptions& options, ServingMetrics* metrics, std::function<void()> wake)
    : options_(options), metrics_(metrics), wake_(std::move(wake)) {}

CacheIo::~CacheIo() { Stop(); }

void CacheIo::Stop() {
  {
    std::lock_guard l(mu_);
    stop_ = true;
    std::erase_if(jobs_, [](const Job& j) { return j.kind == Job::Kind::kRestore; });
  }
  cv_.notify_all();
  room_cv_.notify_all();
  for (Worker& w : workers_)
    if (w.thread.joinable()) w.thread.join();
}

void CacheIo::SubmitRestore(uint64_t id, const Tenant* tenant, std::vector<int32_t> prompt,
                            size_t resident_tokens, std::function<bool()> abandoned) {
  Job j;
  j.kind = Job::Kind::kRestore;
  j.id = id;
  j.tenant = tenant;
  j.prompt = std::move(prompt);
  j.resident_tokens = resident_tokens;
  j.abandoned = std::move(abandoned);
  {
    std::lock_guard l(mu_);
    if (stop_) return;  // the scheduler is stopping: its requests get their 503
    jobs_.push_back(std::move(j));
  }
  cv_.notify_all();
  Publish();  // the gauge counts it while every worker is busy (or stalled) with another job
}

std::vector<CacheIo::RestoreResult> CacheIo::TakeRestores() {
  std::lock_guard l(mu_);
  return std::exchange(restores_done_, {});
}

void CacheIo::SubmitSave(uint64_t seq_id, const Tenant* tenant, engine::PreparedSave save,
                         std::shared_ptr<Generation> gen, std::optional<GenerationEvent> done) {
  const uint64_t bytes = save.bytes();
  Job j;
  j.kind = Job::Kind::kSave;
  j.id = seq_id;
  j.tenant = tenant;
  j.save = std::move(save);
  j.gen = std::move(gen);
  j.done = std::move(done);
  {
    std::unique_lock l(mu_);
    room_cv_.wait(l, [&] {
      return stop_ || save_bytes_ == 0 || save_bytes_ + bytes <= options_.save_bytes_max;
    });
    if (!stop_) {
      save_bytes_ += bytes;
      jobs_.push_back(std::move(j));
      l.unlock();
      cv_.notify_all();
      Publish();
      return;
    }
  }
  // Stopped (not reached while the scheduler runs: it stops CacheIo after its own thread).
  metrics_->SaveFailed();
  if (j.done && j.gen != nullptr) j.gen->Push(std::move(*j.done));
}

std::vector<CacheIo::SaveFailure> CacheIo::TakeSaveFailures() {
  std::lock_guard l(mu_);
  return std::exchange(save_failures_, {});
}

void CacheIo::Account(const Tenant* tenant, const engine::ResumeReport& report) {
  Job j;
  j.kind = Job::Kind::kAccount;
  j.tenant = tenant;
  j.report = report;
  {
    std::lock_guard l(mu_);
    if (stop_) return;
    jobs_.push_back(std::move(j));
  }
  cv_.notify_all();
}

std::deque<CacheIo::Job>::iterator CacheIo::NextJob() {
  return std::find_if(jobs_.begin(), jobs_.end(), [&](const Job& j) {
    return j.kind != Job::Kind::kSave || !saving_.contains(j.id);
  });
}

void PrefaultKv(const engine::Engine& engine, uint64_t tokens) {
  engine::SequenceState st = engine.NewSequence();
  engine::ReserveKvTokens(&st, static_cast<int64_t>(tokens));
  for (engine::KvSourceCache& k : st.kv) {
    for (std::vector<uint8_t>* v : {&k.main_data, &k.main_scales, &k.index_data, &k.index_scales})
      v->resize(v->capacity());  // zero-filled: every page written once
  }
}

void CacheIo::Run(Worker* w) {
  if (options_.prefault_tokens > 0) PrefaultKv(*options_.engine, options_.prefault_tokens);
  while (true) {
    Job job;
    {
      std::unique_lock l(mu_);
      auto next = jobs_.end();
      cv_.wait(l, [&] {
        next = NextJob();
        return next != jobs_.end() || (stop_ && jobs_.empty());
      });
      if (next == jobs_.end()) return;  // stopped, every save done
      job = std::move(*next);
      jobs_.erase(next);
      if (job.kind == Job::Kind::kRestore) ++restores_running_;
      if (job.kind == Job::Kind::kSave) saving_.insert(job.id);
    }
    Publish();
    switch (job.kind) {
      case Job::Kind::kRestore: {
        RestoreResult r = DoRestore(w, job);
        {
          std::lock_guard l(mu_);
          restores_done_.push_back(std::move(r));
          --restores_running_;
        }
        if (wake_) wake_();
        break;
      }
      case Job::Kind::kSave: {
        const uint64_t bytes = job.save.bytes();
        DoSave(w, job);
        {
          std::lock_guard l(mu_);
          save_bytes_ -= bytes;
          saving_.erase(job.id);
        }
        room_cv_.notify_all();
        cv_.notify_all();  // the sequence's next save may start
        break;
      }
      case Job::Kind::kAccount:
        DoAccount(w, job.tenant, job.report);
        break;
    }
    Publish();
  }
}

void CacheIo::Publish() {
  // Under mu_: the scheduler's thread and the workers all publish, and a count taken before the
  // other's must not be written after it (ServingMetrics never calls back here).
  std::lock_guard l(mu_);
  int64_t restores = restores_running_;
  for (const Job& j : jobs_) restores += j.kind == Job::Kind::kRestore;
  metrics_->KvtierdQueue(restores, static_cast<int64_t>(save_bytes_));
}

CacheIo::RestoreResult CacheIo::DoRestore(Worker* w, Job& job) {
  RestoreResult r;
  r.id = job.id;
  // A client that left while its restore waited behind others costs kvtierd nothing.
  auto gone = [&] { return job.abandoned && job.abandoned(); };
  if (gone()) {
    metrics_->RestoreAbandoned();
    return r;
  }
  engine::SessionStore* store = StoreFor(w, job.tenant);
  if (store == nullptr) return r;
  if (gone()) {  // it left while this worker connected
    metrics_->RestoreAbandoned();
    return r;
  }
  const size_t unit = options_.session.unit_tokens;
  if (job.resident_tokens > 0) {
    // A resident sequence covers resident_tokens: worth a fetch only when kvtierd holds more
    // whole pages (a later turn swapped out while an earlier one stayed resident).
    if (job.prompt.size() / unit * unit <= job.resident_tokens) {
      r.use_resident = true;
      return r;
    }
    const std::vector<Digest> chain =
        engine::SessionChainKeys(options_.fingerprint, job.prompt, static_cast<uint32_t>(unit));
    const Clock::time_point t0 = Clock::now();
    auto hit = w->stores[job.tenant].client->Lookup(chain);
    CheckDaemon(w, job.tenant, t0);
    if (!hit.ok() || std::min<size_t>(hit->hit_count, chain.size()) * unit <= job.resident_tokens) {
      r.use_resident = true;
      return r;
    }
    store = StoreFor(w, job.tenant);  // still connected after the LOOKUP?
    if (store == nullptr) {
      r.use_resident = true;
      return r;
    }
  }
  r.asked = true;
  const Clock::time_point t0 = Clock::now();
  LoadCost(job.tenant, store);
  StatusOr<engine::FetchedPrefix> f = store->Fetch(job.prompt, job.abandoned);
  KeepCost(job.tenant, store);
  CheckDaemon(w, job.tenant, t0);  // a failed lookup or fetch recomputes; a failed kvtierd waits
  if (gone()) {  // it stopped at (or finished past) the check before a read: dropped either way
    metrics_->RestoreAbandoned();
    return r;
  }
  if (!f.ok()) {
    r.status = f.status();
    return r;
  }
  if (!w->codec) {
    r.fetched = std::move(f).value();
    return r;
  }
  // Completed here, on this worker's engine: the step thread only takes the state.
  StatusOr<engine::ResumeReport> rep =
      w->codec->Complete(job.prompt, std::move(f).value(), &r.state, &r.logits);
  if (!rep.ok()) {
    r.status = rep.status();
    return r;
  }
  r.completed = true;
  r.report = std::move(rep).value();
  DoAccount(w, job.tenant, r.report);
  return r;
}

void CacheIo::DoSave(Worker* w, Job& job) {
  engine::SessionStore* store = StoreFor(w, job.tenant);
  if (store == nullptr) {
    // kvtierd is unavailable (or this tenant's namespace is another's): the turn is not saved,
    // and its next turn misses it; the sequence's cursor is set back so a later save puts it.
    bool shared;
    {
      std::lock_guard l(health_mu_);
      shared = shared_namespace_.contains(job.tenant);
    }
    if (!shared) metrics_->SaveFailed();
    std::lock_guard l(mu_);
    save_failures_.push_back({job.id, job.save.first_unit});
  } else {
    const Clock::time_point t0 = Clock::now();
    int64_t stored = 0;
    Status s = store->PutSave(job.save, &stored);
    if (!s.ok()) {
      metrics_->SaveFailed();
      KVTIER_LOG(kWarn) << "serve: tenant " << job.tenant->name
                        << ": save failed: " << s.ToString();
      CheckDaemon(w, job.tenant, t0);
      std::lock_guard l(mu_);
      save_failures_.push_back({job.id, job.save.first_unit + stored});
    }
  }
  if (job.done && job.gen != nullptr) job.gen->Push(std::move(*job.done));
}

void CacheIo::DoAccount(Worker* w, const Tenant* tenant, const engine::ResumeReport& report) {
  // SessionStore::Account folds the restore into the tenant's shared model, through this
  // worker's store (none: no cache now, as for a restore without it: nothing is learnt).
  engine::SessionStore* store = StoreFor(w, tenant);
  if (store == nullptr) return;
  std::lock_guard l(health_mu_);  // one step: no other worker's write between load and keep
  engine::CostModel& shared = costs_.try_emplace(tenant, options_.cost_prior).first->second;
  *store->cost_model() = shared;
  store->Account(report);
  shared = *store->cost_model();
}

void CacheIo::LoadCost(const Tenant* tenant, engine::SessionStore* store) {
  std::lock_guard l(health_mu_);
  *store->cost_model() = costs_.try_emplace(tenant, options_.cost_prior).first->second;
}

void CacheIo::KeepCost(const Tenant* tenant, engine::SessionStore* store) {
  std::lock_guard l(health_mu_);
  costs_[tenant] = *store->cost_model();
}

engine::SessionStore* CacheIo::StoreFor(Worker* w, const Tenant* tenant) {
  TenantStore& ts = w->stores[tenant];
  {
    std::lock_guard l(health_mu_);
    if (ts.store != nullptr && ts.outage != outages_) {  // made before kvtierd last failed
      ts.store.reset();
      ts.client.reset();
    }
    if (ts.store != nullptr) return ts.store.get();
    if (shared_namespace_.contains(tenant)) return nullptr;
    // kvtierd stalled lately: no cache until the next attempt.
    if (backoff_ms_ > 0 && Clock::now() < retry_at_) return nullptr;
  }
  // (Re)connect: a failed connection is dropped (CheckDaemon) and tried again at the next job
  // (after the backoff, if it failed slowly).
  daemon::ClientOptions co = options_.daemon;
  co.token = tenant->daemon_token;
  co.unit_tokens = options_.session.unit_tokens;
  co.close_on_timeout = true;  // a stalled kvtierd costs one timeout (CheckDaemon), not one a call
  const Clock::time_point t0 = Clock::now();
  auto client = daemon::Client::Connect(co);
  if (!client.ok()) {
    KVTIER_LOG(kWarn) << "serve: tenant " << tenant->name
                      << ": kvtierd unreachable, serving without cache: "
                      << client.status().ToString();
    // A daemon that cannot be reached, or did not answer in time, is down for every tenant; a
    // refusal of this tenant's token is this tenant's alone (tried again at its next job).
    if (client.status().code() == StatusCode::kIOError ||
        client.status().code() == StatusCode::kUnavailable) {
      DaemonFailed(client.status(), t0);
    }
    return nullptr;
  }
  auto store = engine::SessionStore::Create(options_.engine, client->get(), options_.fingerprint,
                                            options_.session);
  if (!store.ok()) {
    KVTIER_LOG(kWarn) << "serve: session store: " << store.status().ToString();
    return nullptr;
  }
  std::lock_guard l(health_mu_);
  if (unavailable_ && t0 >= last_failure_at_) {
    KVTIER_LOG(kInfo) << "serve: kvtierd reachable again";
    unavailable_ = false;
    backoff_ms_ = 0;
    retry_at_ticks_.store(0);
    metrics_->KvtierdUnavailable(false);
  }
  // kvtierd keeps units apart by its own tenant: one whose auth is off (every client its
  // default tenant) or a token shared by two tenants would let one tenant's prompts hit the
  // other's units. Such a tenant is served without the cache.
  const std::string& ns = (*client)->hello().tenant_name;
  if (auto [it, fresh] = daemon_tenants_.emplace(ns, tenant); !fresh && it->second != tenant) {
    KVTIER_LOG(kError) << "serve: tenant " << tenant->name << " is kvtierd tenant \"" << ns
                       << "\", as tenant " << it->second->name
                       << " is: serving it without cache (give each tenant its own kvtierd "
                          "token, and turn kvtierd's auth on)";
    shared_namespace_.insert(tenant);
    return nullptr;
  }
  ts.client = std::move(client).value();
  ts.store = std::move(store).value();
  ts.outage = outages_;
  return ts.store.get();
}

void CacheIo::CheckDaemon(Worker* w, const Tenant* tenant, Clock::time_point began) {
  auto it = w->stores.find(tenant);
  if (it == w->stores.end() || it->second.client == nullptr) return;
  const Status why = it->second.client->connection_status();
  if (!why.ok()) DaemonFailed(why, began);
}

void CacheIo::DaemonFailed(const Status& why, Clock::time_point began) {
  metrics_->KvtierdFailed();
  const Clock::time_point now = Clock::now();
  const auto cost_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - began).count();
  std::lock_guard l(health_mu_);
  metrics_->KvtierdUnavailable(true);
  unavailable_ = true;
  // Every worker's connections go (each drops its own before its next call): a stalled kvtierd
  // would hold each one's next call for the whole timeout.
  ++outages_;
  // An attempt begun before the last noted failure met the same outage (several workers' calls
  // in flight when kvtierd stalled): it is not a second failure of a retry.
  const bool same_outage = began < last_failure_at_;
  last_failure_at_ = now;
  if (same_outage) return;
  // A failure that came at once (kvtierd not running: refused, or its connection closed) cost
  // nothing, and the next job tries again at once: kvtierd is used again as soon as it is
  // back. One that took half a timeout or more would cost as much again at each attempt: the
  // next is put off, 1 s, doubling up to daemon_retry_max_ms.
  std::string next = "at the next request";
  if (static_cast<uint64_t>(cost_ms) * 2 >= options_.daemon.timeout_ms) {
    backoff_ms_ = backoff_ms_ == 0 ? std::min<uint64_t>(1000, options_.daemon_retry_max_ms)
                                   : std::min(backoff_ms_ * 2, options_.daemon_retry_max_ms);
    retry_at_ = now + std::chrono::milliseconds(backoff_ms_);
    retry_at_ticks_.store(retry_at_.time_since_epoch().count());
    next = "in " + std::to_string(backoff_ms_) + " ms";
  }
  KVTIER_LOG(kWarn) << "serve: kvtierd failed after " << cost_ms << " ms (" << why.ToString()
                    << "): serving without cache, next attempt " << next;
}

}  // namespace kvtier::serving
