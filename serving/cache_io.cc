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
  // The stores' options are checked once here, not at each tenant's first connection.
  KVTIER_RETURN_IF_ERROR(
      engine::SessionCodec::Create(options.engine, options.fingerprint, options.session).status());
  std::unique_ptr<CacheIo> io(new CacheIo(options, metrics, std::move(wake)));
  io->thread_ = std::thread([p = io.get()] { p->Run(); });
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
  if (thread_.joinable()) thread_.join();
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
  Publish();  // the gauge counts it while CacheIo's thread is busy (or stalled) with another
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

void CacheIo::Run() {
  while (true) {
    Job job;
    {
      std::unique_lock l(mu_);
      cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopped, every save done
      job = std::move(jobs_.front());
      jobs_.pop_front();
      running_restore_ = job.kind == Job::Kind::kRestore;
    }
    Publish();
    switch (job.kind) {
      case Job::Kind::kRestore: {
        RestoreResult r = DoRestore(job);
        {
          std::lock_guard l(mu_);
          restores_done_.push_back(std::move(r));
          running_restore_ = false;
        }
        if (wake_) wake_();
        break;
      }
      case Job::Kind::kSave: {
        const uint64_t bytes = job.save.bytes();
        DoSave(job);
        {
          std::lock_guard l(mu_);
          save_bytes_ -= bytes;
        }
        room_cv_.notify_all();
        break;
      }
      case Job::Kind::kAccount:
        if (auto it = stores_.find(job.tenant); it != stores_.end() && it->second.store != nullptr)
          it->second.store->Account(job.report);
        break;
    }
    Publish();
  }
}

void CacheIo::Publish() {
  // Under mu_: the scheduler's thread and CacheIo's both publish, and a count taken before the
  // other's must not be written after it (ServingMetrics never calls back here).
  std::lock_guard l(mu_);
  int64_t restores = running_restore_ ? 1 : 0;
  for (const Job& j : jobs_) restores += j.kind == Job::Kind::kRestore;
  metrics_->KvtierdQueue(restores, static_cast<int64_t>(save_bytes_));
}

CacheIo::RestoreResult CacheIo::DoRestore(Job& job) {
  RestoreResult r;
  r.id = job.id;
  // A client that left while its restore waited behind others costs kvtierd nothing.
  auto gone = [&] { return job.abandoned && job.abandoned(); };
  if (gone()) {
    metrics_->RestoreAbandoned();
    return r;
  }
  engine::SessionStore* store = StoreFor(job.tenant);
  if (store == nullptr) return r;
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
    auto hit = stores_[job.tenant].client->Lookup(chain);
    CheckDaemon(job.tenant, t0);
    if (!hit.ok() || std::min<size_t>(hit->hit_count, chain.size()) * unit <= job.resident_tokens) {
      r.use_resident = true;
      return r;
    }
    store = StoreFor(job.tenant);  // still connected after the LOOKUP?
    if (store == nullptr) {
      r.use_resident = true;
      return r;
    }
  }
  r.asked = true;
  const Clock::time_point t0 = Clock::now();
  StatusOr<engine::FetchedPrefix> f = store->Fetch(job.prompt, job.abandoned);
  CheckDaemon(job.tenant, t0);  // a failed lookup or fetch recomputes; a failed kvtierd waits
  if (gone()) {  // it stopped at (or finished past) the check before a read: dropped either way
    metrics_->RestoreAbandoned();
    return r;
  }
  if (f.ok()) {
    r.fetched = std::move(f).value();
  } else {
    r.status = f.status();
  }
  return r;
}

void CacheIo::DoSave(Job& job) {
  engine::SessionStore* store = StoreFor(job.tenant);
  if (store == nullptr) {
    // kvtierd is unavailable (or this tenant's namespace is another's): the turn is not saved,
    // and its next turn misses it; the sequence's cursor is set back so a later save puts it.
    if (!stores_[job.tenant].shared_namespace) metrics_->SaveFailed();
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
      CheckDaemon(job.tenant, t0);
      std::lock_guard l(mu_);
      save_failures_.push_back({job.id, job.save.first_unit + stored});
    }
  }
  if (job.done && job.gen != nullptr) job.gen->Push(std::move(*job.done));
}

engine::SessionStore* CacheIo::StoreFor(const Tenant* tenant) {
  TenantStore& ts = stores_[tenant];
  if (ts.store != nullptr) return ts.store.get();
  if (ts.shared_namespace) return nullptr;
  // kvtierd stalled lately: no cache until the next attempt.
  if (backoff_ms_ > 0 && Clock::now() < retry_at_) return nullptr;
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
  if (unavailable_) {
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
    ts.shared_namespace = true;
    return nullptr;
  }
  auto store = engine::SessionStore::Create(options_.engine, client->get(), options_.fingerprint,
                                            options_.session);
  if (!store.ok()) {
    KVTIER_LOG(kWarn) << "serve: session store: " << store.status().ToString();
    return nullptr;
  }
  *(*store)->cost_model() = options_.cost_prior;
  ts.client = std::move(client).value();
  ts.store = std::move(store).value();
  return ts.store.get();
}

void CacheIo::CheckDaemon(const Tenant* tenant, Clock::time_point began) {
  auto it = stores_.find(tenant);
  if (it == stores_.end() || it->second.client == nullptr) return;
  const Status why = it->second.client->connection_status();
  if (!why.ok()) DaemonFailed(why, began);
}

void CacheIo::DaemonFailed(const Status& why, Clock::time_point began) {
  metrics_->KvtierdFailed();
  metrics_->KvtierdUnavailable(true);
  unavailable_ = true;
  // A failure that came at once (kvtierd not running: refused, or its connection closed) cost
  // nothing, and the next job tries again at once: kvtierd is used again as soon as it is
  // back. One that took half a timeout or more (stalled, cut off) would cost as much again at
  // each attempt: the next is put off, 1 s, doubling up to daemon_retry_max_ms.
  const auto cost_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began).count();
  std::string next = "at the next request";
  if (static_cast<uint64_t>(cost_ms) * 2 >= options_.daemon.timeout_ms) {
    backoff_ms_ = backoff_ms_ == 0 ? std::min<uint64_t>(1000, options_.daemon_retry_max_ms)
                                   : std::min(backoff_ms_ * 2, options_.daemon_retry_max_ms);
    retry_at_ = Clock::now() + std::chrono::milliseconds(backoff_ms_);
    retry_at_ticks_.store(retry_at_.time_since_epoch().count());
    next = "in " + std::to_string(backoff_ms_) + " ms";
  }
  KVTIER_LOG(kWarn) << "serve: kvtierd failed after " << cost_ms << " ms (" << why.ToString()
                    << "): serving without cache, next attempt " << next;
  // Every tenant's connection goes: a stalled kvtierd would hold each one's next call for the
  // whole timeout.
  for (auto& [t, ts] : stores_) {
    ts.store.reset();
    ts.client.reset();
  }
}

}  // namespace kvtier::serving
