#include "serving/scheduler.h"

#include <algorithm>

#include "common/logging.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

namespace kvtier::serving {

using Clock = std::chrono::steady_clock;
using engine::ByteTokenizer;

namespace {

// n printable byte tokens: the prompts Create measures the engine with.
std::vector<int32_t> ProbeTokens(size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i)
    t[i] = ByteTokenizer::kByteBase + static_cast<int32_t>('a' + i % 26);
  return t;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Length of the longest prefix of `s` that does not end inside a UTF-8 sequence (at most the
// last 3 bytes are held back).
size_t CompleteUtf8Prefix(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
    size_t len = 1;
    if ((c & 0xE0) == 0xC0)
      len = 2;
    else if ((c & 0xF0) == 0xE0)
      len = 3;
    else if ((c & 0xF8) == 0xF0)
      len = 4;
    return len > back ? n - back : n;
  }
  return n;
}

GenerationEvent ErrorEvent(const ApiError& error) {
  GenerationEvent e;
  e.kind = GenerationEvent::Kind::kError;
  e.error = error;
  return e;
}

}  // namespace

struct Scheduler::Seq {
  uint64_t id = 0;  // names the sequence to CacheIo (a save's failure)
  const Tenant* tenant = nullptr;
  engine::SequenceState state;
  std::vector<float> logits;  // of the last token in state
  engine::SaveCursor cursor;
  Clock::time_point last_used;
  // The request being generated (null while idle).
  std::shared_ptr<Generation> gen;
  GenerationParams params;
  std::optional<engine::Sampler> sampler;
  Clock::time_point arrival, last_token;
  std::string text;    // output so far (stop strings removed at the end)
  size_t emitted = 0;  // bytes of text sent
  Usage usage;
  uint64_t reserved = 0;  // pool tokens reserved while active (prompt + max_tokens)
  // --speculative: the decoder from the first decode token on (it holds the pending token,
  // emitted and not yet run); while prefilling, the draft's rows of the prompt's last
  // positions, from the chunks' captured attention inputs.
  std::unique_ptr<engine::SpeculativeDecoder> spec;
  engine::DraftContext draft_ctx;
  engine::AttnInputCapture capture;
  // While restoring: the idle sequence that prefixes the prompt, continued when kvtierd holds
  // no more of it (else given back to the idle pool).
  std::unique_ptr<Seq> resident;
  // Still prefilling: the state does not yet hold every prompt token (it only ever holds a
  // prefix of the prompt until then, and grows past it while generating).
  bool prefilling() const { return state.tokens.size() < params.prompt.size(); }
};

StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(engine::Engine* engine,
                                                       const engine::ModelWeights& weights,
                                                       const SchedulerOptions& options,
                                                       ServingMetrics* metrics) {
  if (options.queue_depth_max == 0 || options.active_sequences_max == 0 ||
      options.context_tokens_max < 2 || options.step_tokens_max == 0 ||
      options.prefill_chunk_tokens == 0)
    return Status::InvalidArgument(
        "serve: queue, active, context, step and prefill chunk limits must be > 0");
  if (options.context_tokens_max > options.kv_pool_tokens_max)
    return Status::InvalidArgument("serve: context_tokens_max exceeds kv_pool_tokens_max");
  // Prompts are prefilled in chunks, so one sequence is bounded by what the session store
  // saves and resumes, not by one engine call.
  if (options.context_tokens_max > engine::kMaxSessionTokens)
    return Status::InvalidArgument(
        "serve: context_tokens_max exceeds the session store's kMaxSessionTokens (4194304)");
  if (options.step_tokens_max > engine::kMaxTokensPerCall ||
      options.prefill_chunk_tokens > engine::kMaxTokensPerCall)
    return Status::InvalidArgument(
        "serve: step_tokens_max and prefill_chunk_tokens are at most kMaxTokensPerCall (65536): "
        "a step is one engine call");
  if (options.draft != nullptr && options.draft_len &&
      (*options.draft_len < 0 || *options.draft_len > options.draft->dconfig().block_size))
    return Status::InvalidArgument("serve: draft_len outside [0, the draft's block size]");
  std::unique_ptr<Scheduler> s(new Scheduler(engine, &weights, options, metrics));
  if (options.draft != nullptr)
    s->draft_scheduler_ = std::make_unique<engine::DraftScheduler>(
        kSpecVerifyTokensMax,
        options.draft_cost_clock ? options.draft_cost_clock : engine::CpuCostClock(*engine));
  if (options.draft != nullptr && !options.draft_len) {
    // The verify-pass table, measured on a short prefilled sequence; the moving averages of
    // the real passes keep it current.
    engine::SequenceState base = engine->NewSequence();
    std::vector<float> logits;
    KVTIER_RETURN_IF_ERROR(engine->Forward(&base, ProbeTokens(64), false, &logits));
    KVTIER_RETURN_IF_ERROR(engine::MeasureSps(engine, base, 3, s->draft_scheduler_.get()));
  }
  if (options.cache_enabled()) {
    CacheIoOptions co;
    co.daemon = options.daemon;
    co.daemon_retry_max_ms = options.daemon_retry_max_ms;
    co.session = options.session;
    co.engine = engine;
    co.save_bytes_max = options.save_bytes_max;
    co.threads = options.kvtierd_threads;
    co.prefault_tokens = options.context_tokens_max;
    co.replay_engine = options.replay_engine;
    KVTIER_ASSIGN_OR_RETURN(
        co.fingerprint,
        engine::EngineModelFingerprint(engine->config(), weights, options.session.unit_tokens));
    KVTIER_ASSIGN_OR_RETURN(engine::SessionCodec codec,
                            engine::SessionCodec::Create(engine, co.fingerprint, options.session));
    s->codec_.emplace(std::move(codec));
    // The guard's forward speed, measured here on the engine's thread (CacheIo's stores never
    // run the engine).
    KVTIER_RETURN_IF_ERROR(
        engine::CalibrateCost(engine, ProbeTokens(32), /*ced=*/false, &co.cost_prior));
    Scheduler* p = s.get();
    KVTIER_ASSIGN_OR_RETURN(s->cache_io_, CacheIo::Create(co, metrics, [p] {
                              {
                                std::lock_guard l(p->mu_);
                                ++p->wake_;
                              }
                              p->cv_.notify_all();
                            }));
  }
  s->thread_ = std::thread([p = s.get()] { p->Run(); });
  return s;
}

Scheduler::Scheduler(engine::Engine* engine, const engine::ModelWeights* weights,
                     const SchedulerOptions& options, ServingMetrics* metrics)
    : engine_(engine), weights_(weights), options_(options), metrics_(metrics) {}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Stop() {
  {
    std::lock_guard l(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // After the steps: the turns finished before the stop are still saved (and answered).
  if (cache_io_ != nullptr) cache_io_->Stop();
}

Status Scheduler::CheckPromptTokens(uint64_t prompt_tokens) const {
  if (prompt_tokens == 0 || prompt_tokens >= options_.context_tokens_max)
    return Status::InvalidArgument("prompt of " + std::to_string(prompt_tokens) +
                                   " tokens; this server's context is " +
                                   std::to_string(options_.context_tokens_max) +
                                   " tokens (prompt + at least one completion token)");
  return Status::Ok();
}

StatusOr<std::shared_ptr<Generation>> Scheduler::Submit(const Tenant* tenant,
                                                        GenerationParams params) {
  KVTIER_RETURN_IF_ERROR(CheckPromptTokens(params.prompt.size()));
  const uint64_t room = options_.context_tokens_max - params.prompt.size();
  if (params.max_tokens == 0 || params.max_tokens > room) params.max_tokens = room;
  auto gen = std::make_shared<Generation>();
  {
    std::lock_guard l(mu_);
    if (stop_) return Status::Unavailable("serve: shutting down");
    if (queued_ >= options_.queue_depth_max) DropCancelledLocked();
    if (queued_ >= options_.queue_depth_max)
      return Status::Rejected("serve: " + std::to_string(queued_) +
                              " requests queued (queue_depth_max)");
    auto& q = queues_[tenant];
    if (q.empty()) turn_.push_back(tenant);
    q.push_back(Pending{tenant, std::move(params), gen, Clock::now()});
    ++queued_;
    ++wake_;
  }
  cv_.notify_all();
  return gen;
}

void Scheduler::DropCancelledLocked() {
  for (auto t = turn_.begin(); t != turn_.end();) {
    std::deque<Pending>& q = queues_[*t];
    const size_t before = q.size();
    std::erase_if(q, [](const Pending& p) { return p.gen->cancelled(); });
    for (size_t i = q.size(); i < before; ++i) metrics_->Disconnect();
    queued_ -= before - q.size();
    t = q.empty() ? turn_.erase(t) : std::next(t);
  }
}

uint64_t Scheduler::PoolTokens() const {
  uint64_t n = 0;
  for (const auto& s : active_) n += s->reserved;
  for (const auto& s : restoring_) n += s->reserved;
  for (const auto& s : idle_) n += s->state.tokens.size();
  return n;
}

void Scheduler::PublishGauges() {
  uint64_t q;
  {
    std::lock_guard l(mu_);
    q = queued_;
  }
  const size_t active = active_.size() + restoring_.size();
  metrics_->Gauges(static_cast<int64_t>(q), static_cast<int64_t>(active),
                   static_cast<int64_t>(active + idle_.size()), static_cast<int64_t>(PoolTokens()));
  metrics_->LayerDeviceFailed(!engine_->DeviceFailure().ok());
}

void Scheduler::Run() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock l(mu_);
      // A step runs while sequences are active or requests wait with nothing restoring (then
      // one is admitted: the pool and the slots are free); otherwise after a new request or a
      // finished restore (requests kept out by restoring ones wait for those to finish).
      cv_.wait(l, [&] {
        return stop_ || !active_.empty() || wake_ != seen || (queued_ > 0 && restoring_.empty());
      });
      if (stop_) break;
      seen = wake_;
    }
    ++step_;
    if (cache_io_ != nullptr) {
      ApplySaveFailures();
      FinishRestores();
    }
    Admit();
    StepActive();
    PublishGauges();
  }
  // Shutdown: every request still queued, restoring or active gets a 503.
  ApiError e;
  e.status = 503;
  e.type = "server_error";
  e.message = "the server is shutting down";
  std::lock_guard l(mu_);
  for (auto& [t, q] : queues_)
    for (Pending& p : q) p.gen->Push(ErrorEvent(e));
  for (auto& s : restoring_) s->gen->Push(ErrorEvent(e));
  for (auto& s : active_) s->gen->Push(ErrorEvent(e));
}

void Scheduler::Admit() {
  // Admission computes nothing: a request is set up from a resident sequence or waits for its
  // restore (FinishRestores).
  std::map<const Tenant*, uint64_t> active_by_tenant;
  for (const auto& s : active_) ++active_by_tenant[s->tenant];
  for (const auto& s : restoring_) ++active_by_tenant[s->tenant];
  {
    std::lock_guard l(mu_);
    DropCancelledLocked();
  }
  while (active_.size() + restoring_.size() < options_.active_sequences_max) {
    Pending p;
    {
      std::lock_guard l(mu_);
      if (turn_.empty()) return;
      // The tenant with the fewest active sequences per unit of weight; ties to the one
      // first in turn (round robin).
      auto pick = turn_.begin();
      for (auto it = turn_.begin(); it != turn_.end(); ++it) {
        const double mine = static_cast<double>(active_by_tenant[*it]) / (*it)->weight;
        const double best = static_cast<double>(active_by_tenant[*pick]) / (*pick)->weight;
        if (mine < best) pick = it;
      }
      const Tenant* t = *pick;
      auto& q = queues_[t];
      const uint64_t need = q.front().params.prompt.size() + q.front().params.max_tokens;
      // Room in the pool: idle sequences may be swapped out; active reservations may not.
      uint64_t active_reserved = 0;
      for (const auto& s : active_) active_reserved += s->reserved;
      for (const auto& s : restoring_) active_reserved += s->reserved;
      if (active_reserved + need > options_.kv_pool_tokens_max) return;  // wait for a finish
      p = std::move(q.front());
      q.pop_front();
      --queued_;
      turn_.erase(pick);
      if (!q.empty()) turn_.push_back(t);
    }
    if (p.gen->cancelled()) {
      metrics_->Disconnect();
      continue;
    }
    p.gen->admitted_step_.store(step_);
    auto seq = std::make_unique<Seq>();
    seq->id = next_seq_id_++;
    bool restoring = false;
    Status s = Start(seq.get(), p, &restoring);
    if (!s.ok()) {
      Fail(std::move(seq), s);
      continue;
    }
    ++active_by_tenant[seq->tenant];
    (restoring ? restoring_ : active_).push_back(std::move(seq));
  }
}

Status Scheduler::Start(Seq* seq, Pending& p, bool* restoring) {
  *restoring = false;
  seq->tenant = p.tenant;
  seq->gen = p.gen;
  seq->arrival = p.arrival;
  seq->params = std::move(p.params);
  const std::vector<int32_t>& prompt = seq->params.prompt;
  seq->sampler.emplace(seq->params.temperature, seq->params.top_p, seq->params.seed);
  seq->usage.prompt_tokens = static_cast<int64_t>(prompt.size());
  seq->reserved = prompt.size() + seq->params.max_tokens;
  if (options_.draft != nullptr) {
    seq->capture.layers = options_.draft->target_layers();
    seq->capture.record_normed = false;  // the draft's context reads stream_mean only
  }

  // 1. A resident idle sequence of the same tenant whose tokens prefix the prompt.
  auto best = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it) {
    const auto& toks = (*it)->state.tokens;
    if ((*it)->tenant != seq->tenant || toks.empty() || toks.size() > prompt.size()) continue;
    if (!std::equal(toks.begin(), toks.end(), prompt.begin())) continue;
    if (best == idle_.end() || toks.size() > (*best)->state.tokens.size()) best = it;
  }
  if (best != idle_.end()) {
    seq->resident = std::move(*best);
    idle_.erase(best);
  }
  // Make room: swap out idle sequences, least recently used first (the resident candidate is
  // within seq's reservation).
  uint64_t pool = PoolTokens() + seq->reserved;
  while (pool > options_.kv_pool_tokens_max && !idle_.empty()) {
    pool -= idle_.front()->state.tokens.size();
    idle_.pop_front();  // its units were saved when its request finished
    metrics_->SwapOut();
  }

  // A shorter resident sequence must not hide a longer hit in kvtierd (a later turn of the
  // conversation swapped out while an earlier one, or a repeat of it, stayed resident): with
  // whole pages past it, CacheIo asks kvtierd first. While kvtierd is in backoff nothing is
  // asked.
  const bool cache = cache_io_ != nullptr && !cache_io_->in_backoff();
  const size_t unit = options_.session.unit_tokens;
  if (seq->resident != nullptr &&
      (!cache || prompt.size() / unit * unit <= seq->resident->state.tokens.size())) {
    CacheIo::RestoreResult r;
    r.use_resident = true;
    bool replayed = false;
    return StartRestored(seq, r, &replayed);
  }
  if (cache) {
    const size_t resident = seq->resident != nullptr ? seq->resident->state.tokens.size() : 0;
    cache_io_->SubmitRestore(seq->id, seq->tenant, prompt, resident,
                             [gen = seq->gen] { return gen->cancelled(); });
    *restoring = true;
    return Status::Ok();
  }
  seq->state = engine_->NewSequence();
  return Status::Ok();
}

void Scheduler::FinishRestores() {
  for (CacheIo::RestoreResult& r : cache_io_->TakeRestores())
    restores_ready_.push_back(std::move(r));
  while (!restores_ready_.empty()) {
    CacheIo::RestoreResult r = std::move(restores_ready_.front());
    restores_ready_.pop_front();
    auto it = std::find_if(restoring_.begin(), restoring_.end(),
                           [&](const auto& s) { return s->id == r.id; });
    if (it == restoring_.end()) continue;
    if ((*it)->gen->cancelled()) {  // the client left while its prompt was fetched
      std::unique_ptr<Seq> seq = std::move(*it);
      restoring_.erase(it);
      metrics_->Disconnect();
      ReturnResident(seq.get());
      continue;
    }
    const bool others_active = !active_.empty();
    bool replayed = false;
    // Set up while still in restoring_: its reservation counts when a resident goes back.
    Status s = StartRestored(it->get(), r, &replayed);
    std::unique_ptr<Seq> seq = std::move(*it);
    restoring_.erase(it);
    if (!s.ok()) {
      ReturnResident(seq.get());
      Fail(std::move(seq), s);
      continue;
    }
    active_.push_back(std::move(seq));
    // A replay here is engine work that delays the running sequences' next token: one per
    // step while others run. A hot state is a copy, and a restore a kvtierd thread completed
    // is done: every such restore finished is started now, and their suffixes are prefilled
    // together in the next step.
    if (replayed && others_active) break;
  }
}

Status Scheduler::StartRestored(Seq* seq, CacheIo::RestoreResult& r, bool* replayed) {
  *replayed = false;
  if (r.use_resident && seq->resident != nullptr) {
    // The rest of the prompt (past the state's tokens) is prefilled by the steps.
    std::unique_ptr<Seq> resident = std::move(seq->resident);
    seq->id = resident->id;  // a failed save of its last turn still finds it
    seq->state = std::move(resident->state);
    seq->logits = std::move(resident->logits);
    seq->cursor = std::move(resident->cursor);
    seq->usage.cached_tokens = static_cast<int64_t>(seq->state.tokens.size());
    metrics_->ResidentHit();
    return Status::Ok();
  }
  ReturnResident(seq);  // kvtierd holds more (or the resident went away)
  if (!r.asked) {       // no cache for this request now
    seq->state = engine_->NewSequence();
    return Status::Ok();
  }
  KVTIER_RETURN_IF_ERROR(r.status);
  engine::ResumeReport rep;
  if (r.completed) {  // on a kvtierd thread, which accounted it
    rep = std::move(r.report);
    seq->state = std::move(r.state);
    seq->logits = std::move(r.logits);
  } else {
    KVTIER_ASSIGN_OR_RETURN(
        rep, codec_->Complete(seq->params.prompt, std::move(r.fetched), &seq->state, &seq->logits));
    cache_io_->Account(seq->tenant, rep);
  }
  // replay_tokens is 0 for a hot state and a recompute (engine/session.h).
  *replayed = !r.completed && rep.replay_tokens > 0;
  seq->cursor.turn = rep.turn;  // the turn's PUT joins its LOOKUP and GET (one request)
  if (!rep.recomputed) {
    seq->usage.cached_tokens = rep.restored_tokens;
    seq->cursor.units_saved = rep.units_used;
  }
  metrics_->Resume(!rep.recomputed && rep.units_used > 0, rep.hot_state_restored);
  if (rep.replay_tokens > 0) metrics_->Replay(static_cast<uint64_t>(rep.replay_tokens), *replayed);
  KVTIER_LOG(kDebug) << "serve: tenant " << seq->tenant->name << " resume: " << rep.decision
                     << "; lookup " << rep.lookup_s << " s, units " << rep.fetch_s
                     << " s, hot states " << rep.hot_state_fetch_s << " s, replay " << rep.replay_s
                     << " s";
  return Status::Ok();
}

void Scheduler::ReturnResident(Seq* seq) {
  if (seq->resident == nullptr) return;
  std::unique_ptr<Seq> r = std::move(seq->resident);
  if (options_.idle_sequences_max == 0) return;
  // Back in its place by last use (idle_ is least recently used first).
  auto at = std::upper_bound(idle_.begin(), idle_.end(), r->last_used,
                             [](Clock::time_point t, const auto& s) { return t < s->last_used; });
  idle_.insert(at, std::move(r));
  TrimIdle();
}

void Scheduler::TrimIdle() {
  while (!idle_.empty() && (idle_.size() > options_.idle_sequences_max ||
                            PoolTokens() > options_.kv_pool_tokens_max)) {
    idle_.pop_front();  // its units were saved when its request finished
    metrics_->SwapOut();
  }
}

void Scheduler::ApplySaveFailures() {
  for (const CacheIo::SaveFailure& f : cache_io_->TakeSaveFailures()) {
    auto rewind = [&](Seq* s) {
      if (s != nullptr && s->id == f.seq_id)
        s->cursor.units_saved = std::min(s->cursor.units_saved, f.units_saved);
    };
    for (const auto& s : active_) rewind(s.get());
    for (const auto& s : idle_) rewind(s.get());
    for (const auto& s : restoring_) rewind(s->resident.get());
  }
}

Scheduler::Emitted Scheduler::Emit(Seq* s, int32_t tok, size_t ran) {
  const auto now = Clock::now();
  if (s->usage.completion_tokens == 0) {
    metrics_->Ttft(Seconds(s->arrival, now));
  } else {
    metrics_->Tpot(Seconds(s->last_token, now));
  }
  s->last_token = now;
  ++s->usage.completion_tokens;
  bool stop = tok == ByteTokenizer::kEos;
  if (!stop && tok >= ByteTokenizer::kByteBase && tok < ByteTokenizer::kByteBase + 256)
    s->text.push_back(static_cast<char>(tok - ByteTokenizer::kByteBase));
  size_t hold = 0;  // bytes that could still become a stop string
  for (const std::string& st : s->params.stop) {
    const size_t from = s->text.size() >= st.size() + 1 ? s->text.size() - st.size() - 1 : 0;
    if (size_t at = s->text.find(st, std::min(from, s->text.size())); at != std::string::npos) {
      s->text.resize(at);
      stop = true;
      break;
    }
    hold = std::max(hold, st.size() - 1);
  }
  if (stop) return Emitted::kStop;
  if (s->usage.completion_tokens >= static_cast<int64_t>(s->params.max_tokens) ||
      ran + 1 >= options_.context_tokens_max)
    return Emitted::kLength;
  size_t safe = s->text.size() > hold ? s->text.size() - hold : 0;
  safe = std::min(safe, CompleteUtf8Prefix(s->text.substr(0, safe)));
  if (safe > s->emitted) {
    GenerationEvent e;
    e.text = s->text.substr(s->emitted, safe - s->emitted);
    e.step = step_;
    s->gen->Push(std::move(e));
    s->emitted = safe;
  }
  return Emitted::kMore;
}

void Scheduler::StepActive() {
  if (active_.empty()) return;
  // Each tenant's work, tenants in the order their oldest active sequence was admitted:
  // one decode token per generating sequence, the next chunk of each prefilling one.
  struct Work {
    const Tenant* tenant;
    std::vector<Seq*> generating, prefilling;
    uint64_t demand = 0;
  };
  std::vector<Work> work;
  std::vector<Seq*> cancelled;
  for (const auto& up : active_) {
    Seq* s = up.get();
    if (s->gen->cancelled()) {
      cancelled.push_back(s);
      continue;
    }
    auto w = std::find_if(work.begin(), work.end(),
                          [&](const Work& x) { return x.tenant == s->tenant; });
    if (w == work.end()) w = work.insert(work.end(), Work{s->tenant, {}, {}, 0});
    if (s->prefilling()) {
      w->prefilling.push_back(s);
      w->demand += std::min<uint64_t>(s->params.prompt.size() - s->state.tokens.size(),
                                      options_.prefill_chunk_tokens);
    } else {
      w->generating.push_back(s);
      w->demand += 1;
    }
  }
  // The step's budget shared by weight (FairShares); within a tenant its decode tokens first,
  // from a rotating start so none of its sequences is always left out, then its prompts'
  // chunks, oldest admission first.
  std::vector<uint64_t> demand;
  std::vector<uint32_t> weight;
  std::vector<double> credit;
  for (const Work& w : work) {
    demand.push_back(w.demand);
    weight.push_back(w.tenant->weight);
    credit.push_back(shares_[w.tenant].credit);
  }
  const std::vector<uint64_t> given = FairShares(demand, weight, options_.step_tokens_max, &credit);
  std::vector<Seq*> batch, chunked;
  std::vector<std::span<const int32_t>> chunks;
  std::map<const Tenant*, uint64_t> step_tokens;
  for (size_t i = 0; i < work.size(); ++i) {
    Work& w = work[i];
    TenantShare& sh = shares_[w.tenant];
    sh.credit = credit[i];
    uint64_t g = given[i];
    if (const size_t n = w.generating.size(); n > 0) {
      const size_t take = std::min<size_t>(n, g);
      sh.rotate %= n;
      for (size_t k = 0; k < take; ++k) batch.push_back(w.generating[(sh.rotate + k) % n]);
      sh.rotate = (sh.rotate + take) % n;
      g -= take;
    }
    for (Seq* s : w.prefilling) {
      if (g == 0) break;
      const size_t at = s->state.tokens.size();
      const size_t len =
          std::min<size_t>({s->params.prompt.size() - at, options_.prefill_chunk_tokens, g});
      chunked.push_back(s);
      chunks.push_back(std::span<const int32_t>(s->params.prompt).subspan(at, len));
      g -= len;
    }
  }
  // At least one token when a prompt waits, so that it always progresses: the oldest's.
  if (chunked.empty()) {
    for (const auto& up : active_) {
      Seq* s = up.get();
      if (!s->prefilling() || s->gen->cancelled()) continue;
      chunked.push_back(s);
      chunks.push_back(
          std::span<const int32_t>(s->params.prompt).subspan(s->state.tokens.size(), 1));
      break;
    }
  }
  std::vector<Seq*> done_stop, done_length, failed, decoding;
  std::vector<int32_t> next;
  std::vector<Status> errors;
  int64_t tokens = 0, prefill_tokens = 0, spec_sequences = 0;
  // Speculative sequences in an undrafted round: plain decode rows of the pass below.
  std::vector<Seq*> undrafted;
  if (options_.draft != nullptr) {
    // Speculative: a drafted round is one RoundBatch pass of its own; the chunks follow.
    SpecRound(batch, &done_stop, &done_length, &failed, &errors, &step_tokens, &tokens,
              &spec_sequences, &undrafted);
    batch.clear();
  }
  for (Seq* s : undrafted) {
    decoding.push_back(s);
    next.push_back(s->spec->pending());
  }
  for (Seq* s : batch) {
    const int32_t tok = s->sampler->Sample(s->logits);
    switch (Emit(s, tok, s->state.tokens.size())) {
      case Emitted::kStop:
        done_stop.push_back(s);
        continue;
      case Emitted::kLength:
        done_length.push_back(s);
        continue;
      case Emitted::kMore:
        break;
    }
    decoding.push_back(s);
    next.push_back(tok);
  }
  // One pass over the weights for every decode token and prefill chunk (ForwardBatch).
  const size_t undrafted_rows = undrafted.size();  // the first rows of `decoding`
  if (!decoding.empty() || !chunked.empty()) {
    std::vector<Seq*> run = decoding;
    run.insert(run.end(), chunked.begin(), chunked.end());
    std::vector<engine::SequenceState*> states;
    std::vector<std::span<const int32_t>> spans;
    for (size_t i = 0; i < decoding.size(); ++i) spans.emplace_back(&next[i], 1);
    spans.insert(spans.end(), chunks.begin(), chunks.end());
    for (Seq* s : run) states.push_back(&s->state);
    for (size_t i = 0; i < run.size(); ++i) step_tokens[run[i]->tenant] += spans[i].size();
    for (const auto& c : chunks) prefill_tokens += static_cast<int64_t>(c.size());
    // With a draft, the chunks record the attention inputs of the prompt's last W + 1
    // positions for the draft's context, the undrafted decode rows the draft's target layers
    // of their position (kept by their decoder until it drafts again).
    std::vector<engine::AttnInputCapture*> caps;
    if (options_.draft != nullptr) {
      const int64_t keep = engine_->config().sliding_window + 1;
      for (size_t i = 0; i < run.size(); ++i) {
        Seq* s = run[i];
        if (i < undrafted_rows) {
          caps.push_back(s->spec->StepCapture(s->state, static_cast<int>(undrafted_rows)));
          continue;
        }
        s->capture.from_pos =
            std::max<int64_t>(static_cast<int64_t>(s->state.tokens.size()),
                              static_cast<int64_t>(s->params.prompt.size()) - keep);
        caps.push_back(&s->capture);
      }
    }
    std::vector<int64_t> before;
    for (Seq* s : run) before.push_back(static_cast<int64_t>(s->state.tokens.size()));
    std::vector<std::vector<float>> logits;
    // A pass of the undrafted decode rows alone is what the draft scheduler compares drafting
    // with: its SPS table learns it (in the scheduler's clock, CPU time; one such pass in
    // DraftScheduler::kUndraftedTimedEvery, as a CPU-clock read costs a system call).
    const bool timed = !options_.draft_len && undrafted_rows > 0 && run.size() == undrafted_rows &&
                       draft_scheduler_->TimeUndrafted(static_cast<int>(undrafted_rows));
    const double c0 = timed ? draft_scheduler_->Now() : 0;
    Status ds = engine_->ForwardBatch(states, spans, &logits, nullptr, caps);
    if (ds.ok() && timed)
      draft_scheduler_->RecordUndrafted(static_cast<int>(undrafted_rows),
                                        draft_scheduler_->Now() - c0);
    tokens += static_cast<int64_t>(decoding.size()) + prefill_tokens;
    std::vector<int32_t> out;
    for (size_t i = 0; i < run.size(); ++i) {
      Status si = ds;
      if (i < undrafted_rows) {
        out.clear();
        if (si.ok()) si = run[i]->spec->FinishStep(&run[i]->state, logits[i], &out);
        if (si.ok() && EndSpecRound(run[i], out, before[i], &done_stop, &done_length, &si))
          continue;
        failed.push_back(run[i]);
        errors.push_back(si);
        continue;
      }
      if (si.ok() && !caps.empty()) {
        const int64_t from = run[i]->capture.from_pos;
        const int64_t end = before[i] + static_cast<int64_t>(spans[i].size());
        if (from < end)
          si = options_.draft->Observe(run[i]->capture, from, end - from, &run[i]->draft_ctx);
      }
      if (si.ok()) {
        run[i]->logits = std::move(logits[i]);
      } else {
        failed.push_back(run[i]);
        errors.push_back(si);
      }
    }
    if (undrafted_rows > 0) metrics_->SpecRoundUndrafted(undrafted_rows);
  }
  metrics_->Step(static_cast<int64_t>(decoding.size() + chunked.size()) + spec_sequences, tokens,
                 prefill_tokens);
  for (const auto& [t, n] : step_tokens) metrics_->TenantStepTokens(t->name, n);
  if (options_.step_observer) {
    StepReport r;
    r.step = step_;
    for (const auto& [t, n] : step_tokens) r.tokens_by_tenant[t->name] = n;
    options_.step_observer(r);
  }
  auto take = [&](Seq* s) {
    auto it = std::find_if(active_.begin(), active_.end(), [&](auto& p) { return p.get() == s; });
    std::unique_ptr<Seq> owned = std::move(*it);
    active_.erase(it);
    return owned;
  };
  for (Seq* s : cancelled) Finish(take(s), "cancelled");
  for (Seq* s : done_stop) Finish(take(s), "stop");
  for (Seq* s : done_length) Finish(take(s), "length");
  for (size_t i = 0; i < failed.size(); ++i) Fail(take(failed[i]), errors[i]);
}

void Scheduler::SpecRound(const std::vector<Seq*>& batch, std::vector<Seq*>* done_stop,
                          std::vector<Seq*>* done_length, std::vector<Seq*>* failed,
                          std::vector<Status>* errors,
                          std::map<const Tenant*, uint64_t>* step_tokens, int64_t* tokens,
                          int64_t* sequences, std::vector<Seq*>* undrafted) {
  std::vector<Seq*> round;
  for (Seq* s : batch) {
    if (s->spec == nullptr) {
      // The first token after the prompt is sampled from the prefill's logits, as without a
      // draft; the decoder starts with it pending.
      const int32_t tok = s->sampler->Sample(s->logits);
      const Emitted e = Emit(s, tok, s->state.tokens.size());
      if (e != Emitted::kMore) {
        (e == Emitted::kStop ? done_stop : done_length)->push_back(s);
        continue;
      }
      engine::SpeculativeOptions so;
      so.scheduler = !options_.draft_len.has_value();
      so.draft_len = options_.draft_len.value_or(0);
      s->spec = std::make_unique<engine::SpeculativeDecoder>(
          engine_, options_.draft, weights_, draft_scheduler_.get(), so, &*s->sampler);
      Status st = s->spec->Attach(tok, std::move(s->draft_ctx));
      s->draft_ctx.Clear();
      if (!st.ok()) {
        failed->push_back(s);
        errors->push_back(st);
        continue;
      }
    }
    round.push_back(s);
  }
  if (round.empty()) return;
  std::vector<engine::SpeculativeDecoder*> decs;
  for (Seq* s : round) decs.push_back(s->spec.get());
  if (!engine::SpeculativeDecoder::DraftsRound(decs)) {
    *undrafted = std::move(round);
    return;
  }
  std::vector<engine::SequenceState*> states;
  std::vector<int64_t> n;
  std::vector<engine::SpeculativeStats> before;
  for (Seq* s : round) {
    states.push_back(&s->state);
    n.push_back(static_cast<int64_t>(s->state.tokens.size()));
    before.push_back(s->spec->stats());
  }
  *sequences += static_cast<int64_t>(round.size());
  std::vector<std::vector<int32_t>> outs(round.size());
  Status rs = engine::SpeculativeDecoder::RoundBatch(decs, states, &outs, true);
  if (!rs.ok()) {
    for (Seq* s : round) {
      failed->push_back(s);
      errors->push_back(rs);
    }
    return;
  }
  std::vector<uint64_t> drafted, accepted;
  uint64_t draft_passes = 0;
  for (size_t i = 0; i < round.size(); ++i) {
    Seq* s = round[i];
    const engine::SpeculativeStats& now = s->spec->stats();
    draft_passes += now.drafts - before[i].drafts;
    drafted.push_back(now.drafted - before[i].drafted);
    accepted.push_back(now.accepted - before[i].accepted);
    (*step_tokens)[s->tenant] += 1 + drafted.back();
    *tokens += static_cast<int64_t>(1 + drafted.back());
    Status st;
    if (!EndSpecRound(s, outs[i], n[i], done_stop, done_length, &st)) {
      failed->push_back(s);
      errors->push_back(st);
    }
  }
  metrics_->SpecRound(drafted, accepted, draft_passes);
}

bool Scheduler::EndSpecRound(Seq* s, const std::vector<int32_t>& out, int64_t n,
                             std::vector<Seq*>* done_stop, std::vector<Seq*>* done_length,
                             Status* error) {
  // Emit the round's tokens one by one; out[j] was sampled after n + 1 + j tokens ran.
  Emitted e = Emitted::kMore;
  size_t j = 0;
  for (; j < out.size() && e == Emitted::kMore; ++j)
    e = Emit(s, out[j], static_cast<size_t>(n) + 1 + j);
  Status st;
  if (e == Emitted::kMore) {
    st = s->spec->RoundLogits(static_cast<int64_t>(s->state.tokens.size()), &s->logits);
  } else {
    st = s->spec->TruncateRound(&s->state, n + static_cast<int64_t>(j), &s->logits);
    if (st.ok()) (e == Emitted::kStop ? done_stop : done_length)->push_back(s);
  }
  *error = st;
  return st.ok();
}

void Scheduler::SaveSeq(Seq* seq, std::optional<GenerationEvent> done) {
  if (cache_io_ == nullptr) {
    if (done) seq->gen->Push(std::move(*done));
    return;
  }
  // A call's worth of units per job, so that CacheIo's bound on queued bytes holds for long
  // sequences too; the last job carries the hot state and the request's last event.
  while (true) {
    auto save = codec_->PrepareSave(seq->state, seq->logits, &seq->cursor,
                                    options_.session.max_units_per_call);
    if (!save.ok()) {
      metrics_->SaveFailed();
      KVTIER_LOG(kWarn) << "serve: tenant " << seq->tenant->name
                        << ": save failed: " << save.status().ToString();
      if (done) seq->gen->Push(std::move(*done));
      return;
    }
    const bool last = save->complete;
    cache_io_->SubmitSave(seq->id, seq->tenant, std::move(save).value(), seq->gen,
                          last ? std::move(done) : std::nullopt);
    if (last) return;
  }
}

void Scheduler::Finish(std::unique_ptr<Seq> seq, const std::string& reason) {
  const double cost = Cost(seq->usage, seq->tenant->prices);
  metrics_->RequestDone(seq->tenant->name, seq->usage, cost, reason);
  if (reason == "cancelled") {
    metrics_->Disconnect();
  } else if (seq->text.size() > seq->emitted) {
    GenerationEvent e;
    e.text = seq->text.substr(seq->emitted);
    e.step = step_;
    seq->gen->Push(std::move(e));
  }
  // The last event goes out once the turn is saved: once a client has its answer (a whole
  // response, or a stream's usage chunk), the turn's units and hot state are in kvtierd, so its
  // next turn finds them whichever server it is sent to (on any node of a kvtierd cluster).
  std::optional<GenerationEvent> done;
  if (reason != "cancelled") {
    done.emplace();
    done->kind = GenerationEvent::Kind::kDone;
    done->finish_reason = reason;
    done->usage = seq->usage;
    done->cost = cost;
    done->step = step_;
  }
  SaveSeq(seq.get(), std::move(done));
  KVTIER_LOG(kInfo) << "serve: tenant " << seq->tenant->name << " " << reason
                    << " prompt_tokens=" << seq->usage.prompt_tokens
                    << " cached_tokens=" << seq->usage.cached_tokens
                    << " completion_tokens=" << seq->usage.completion_tokens << " cost=" << cost;
  seq->gen.reset();
  seq->spec.reset();  // holds the sampler
  seq->draft_ctx.Clear();
  seq->sampler.reset();
  seq->text.clear();
  if (reason == "cancelled" || options_.idle_sequences_max == 0) return;  // dropped
  seq->last_used = Clock::now();
  idle_.push_back(std::move(seq));
  TrimIdle();
}

void Scheduler::Fail(std::unique_ptr<Seq> seq, const Status& status) {
  KVTIER_LOG(kWarn) << "serve: generation failed: " << status.ToString();
  ApiError e;
  e.status = status.code() == StatusCode::kInvalidArgument ? 400 : 500;
  e.type = e.status == 400 ? "invalid_request_error" : "server_error";
  e.message = status.ToString();
  metrics_->RequestDone(seq->tenant->name, Usage{}, 0, "error");
  seq->gen->Push(ErrorEvent(e));
}

}  // namespace kvtier::serving
