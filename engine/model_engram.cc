// Engine: Engram rows (model.h "Engram prefetch"): row ids, requests, waits, lookahead and
// hints, and the Engram layer itself (ApplyEngram).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "engine/model_internal.h"
#include "engine/scratch.h"

namespace kvtier::engine {

namespace {
using model_detail::Backend;
using model_detail::kQuantBackend;
using model_detail::QuantFormat;
}  // namespace

// ---- Engram prefetch -------------------------------------------------------------------
//
// engram_queue_[slot] holds every batch requested for that Engram layer and not yet consumed
// or dropped, in request order; Waits are made in that order. A step *claims* the batch that
// covers its positions with equal row ids (requesting one if none does), and every other
// batch of the slot that cannot serve a later step (it ends within the step, or covers it
// with other row ids) is discarded: waited in turn, then dropped, never used.

Status Engine::EngramRowIds(int slot, std::span<const int32_t> toks, int64_t toks_p0, int64_t p0,
                            int n, std::vector<int64_t>* rows) const {
  // Only the last max_ngram-1 tokens before the batch matter (the n-gram history).
  const int64_t start = std::max<int64_t>(0, p0 - (config_.engram_max_ngram_size - 1));
  if (start < toks_p0 || p0 + n > toks_p0 + static_cast<int64_t>(toks.size()))
    return Status::Internal("engine: engram rows without their n-gram history");
  thread_local std::vector<int64_t> t;  // the tokens as int64, reused call to call
  t.assign(toks.begin() + (start - toks_p0), toks.begin() + (p0 + n - toks_p0));
  Status s = engram_hash_->RowIds(slot, t, static_cast<size_t>(p0 - start), rows);
  TrimScratch(t);
  return s;
}

void Engine::WaitEngram(EngramPending* e) {
  const auto t0 = std::chrono::steady_clock::now();
  e->status = rows_->Wait(&e->batch);
  e->waited = true;
  ++stats_.engram_waits;
  if (e->batch.stalled) {
    ++stats_.engram_stalls;
    stats_.engram_stall_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }
}

void Engine::DiscardEngram(EngramPending* e) {
  if (e->discarded) return;
  e->discarded = true;
  if (e->prefetch && !e->used) ++stats_.engram_prefetches_discarded;
}

void Engine::ReapEngram(int slot) {
  // Waited and dropped batches leave the queue (in order) for the free list, or are freed.
  auto& q = engram_queue_[slot];
  size_t kept = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    if (!(q[i]->discarded && q[i]->waited)) {
      if (kept != i) q[kept] = std::move(q[i]);
      ++kept;
    } else if (engram_free_.size() < kEngramFreeMax && q[i]->BufferBytes() <= kScratchKeepBytes) {
      engram_free_.push_back(std::move(q[i]));
    } else {
      q[i].reset();
    }
  }
  q.resize(kept);
}

std::unique_ptr<Engine::EngramPending> Engine::NewEngramPending(int slot, int64_t p0, int n) {
  std::unique_ptr<EngramPending> e;
  if (engram_free_.empty()) {
    e = std::make_unique<EngramPending>();
  } else {
    e = std::move(engram_free_.back());
    engram_free_.pop_back();
  }
  e->Reset(slot, p0, n);
  return e;
}

Status Engine::RequestEngram(std::unique_ptr<EngramPending> e, bool own, EngramPending** out) {
  auto& q = engram_queue_[e->slot];
  if (!own && static_cast<int>(q.size()) >= options_.engram_prefetch_batches_max) {
    ++stats_.engram_prefetches_rejected;
    return Status::Rejected("engine: engram_prefetch_batches_max batches already held");
  }
  Status s = rows_->Request(&e->batch);
  if (s.IsRejected() && own) {
    // The source's per-slot bound is taken by earlier batches: wait for them (in order; they
    // stay held with their rows) and ask once more.
    for (auto& o : q) {
      if (!o->waited) WaitEngram(o.get());
    }
    ReapEngram(e->slot);
    s = rows_->Request(&e->batch);
  }
  if (!s.ok()) {
    if (!own && s.IsRejected()) ++stats_.engram_prefetches_rejected;
    return s;
  }
  ++stats_.engram_requests;
  if (!own) ++stats_.engram_prefetches_issued;
  e->prefetch = !own;
  *out = e.get();
  q.push_back(std::move(e));
  return Status::Ok();
}

Status Engine::EnsureEngram(const Step& s, std::span<const int32_t> toks, int64_t toks_p0, bool own,
                            std::vector<EngramPending*>* claimed, const std::vector<Step>* plan,
                            size_t step) {
  const EngineConfig& c = config_;
  const size_t C = static_cast<size_t>(engram_hash_->num_columns());
  const int64_t s_end = s.p0 + s.n;
  // Whether `e` covers a later step of the plan within the lookahead (positions may go back
  // within a call: CED's decoder pass re-reads layer d's last positions).
  auto planned = [&](const EngramPending& e) {
    if (plan == nullptr) return false;
    const int layer = c.engram_layer_ids[e.slot];
    const size_t last =
        std::min(plan->size(), step + 1 + static_cast<size_t>(options_.engram_lookahead_chunks));
    for (size_t j = step + 1; j < last; ++j) {
      const Step& t = (*plan)[j];
      if (layer >= t.l_begin && layer < t.l_end && e.p0 <= t.p0 && t.p0 + t.n <= e.end())
        return true;
    }
    return false;
  };
  // The step's batches of all Engram layers leave together (one message per row server).
  struct Hold {
    EngramRowSource* rows;
    explicit Hold(EngramRowSource* r) : rows(r) { rows->HoldRequests(true); }
    ~Hold() { rows->HoldRequests(false); }
  } hold(rows_);
  for (int l = s.l_begin; l < s.l_end; ++l) {
    if (!c.IsEngramLayer(l)) continue;
    const int slot = c.EngramSlot(l);
    thread_local std::vector<int64_t> ids_slot;  // copied into a new batch's row_ids
    std::vector<int64_t>& ids = ids_slot;
    KVTIER_RETURN_IF_ERROR(EngramRowIds(slot, toks, toks_p0, s.p0, s.n, &ids));
    EngramPending* match = nullptr;
    for (auto& e : engram_queue_[slot]) {
      if (own) e->claim_end = -1;  // claims last one step
      if (e->discarded) continue;
      const bool covers = e->p0 <= s.p0 && s_end <= e->end();
      // A batch the running step consumes to its end is gone before a later step runs.
      const bool consumed_now = e->claim_end >= e->end();
      if (covers && match == nullptr && !consumed_now &&
          std::equal(ids.begin(), ids.end(),
                     e->batch.row_ids.begin() + static_cast<size_t>(s.p0 - e->p0) * C)) {
        match = e.get();
        continue;
      }
      if (own && (covers || e->end() <= s_end) && !planned(*e)) DiscardEngram(e.get());
    }
    if (match == nullptr) {
      auto e = NewEngramPending(slot, s.p0, s.n);
      e->batch.row_ids.assign(ids.begin(), ids.end());
      Status r = RequestEngram(std::move(e), own, &match);
      if (!r.ok()) {
        return own ? r.WithContext("engram layer " + std::to_string(l) + " (slot " +
                                   std::to_string(slot) + ")")
                   : r;
      }
    }
    if (own) {
      match->claim_end = s_end;
      (*claimed)[slot] = match;
    }
  }
  return Status::Ok();
}

Status Engine::BeginEngramStep(const SequenceState& st, const std::vector<Step>& plan, size_t step,
                               std::vector<EngramPending*>* claimed) {
  if (engram_hash_ == nullptr) return Status::Ok();
  claimed->assign(engram_queue_.size(), nullptr);
  KVTIER_RETURN_IF_ERROR(EnsureEngram(plan[step], st.tokens, 0, true, claimed, &plan, step));
  // Lookahead: the next steps' rows, while this one computes. A refused prefetch is simply
  // requested again when its step runs.
  const size_t last =
      std::min(plan.size(), step + 1 + static_cast<size_t>(options_.engram_lookahead_chunks));
  for (size_t j = step + 1; j < last; ++j) {
    if (!EnsureEngram(plan[j], st.tokens, 0, false, nullptr).ok()) break;
  }
  return Status::Ok();
}

Status Engine::TakeEngram(int layer, EngramPending* e, int64_t p0, int n, EngramRowBatch* out) {
  const EngineConfig& c = config_;
  const int slot = c.EngramSlot(layer);
  const int ed = c.engram_head_dim;
  const size_t C = static_cast<size_t>(engram_hash_->num_columns());
  auto& q = engram_queue_[slot];
  auto where = [&]() {
    return "engram layer " + std::to_string(layer) + " (slot " + std::to_string(slot) +
           "), positions [" + std::to_string(p0) + ", " + std::to_string(p0 + n) + ")";
  };
  if (e == nullptr) return Status::Internal("engine: " + where() + " has no requested rows");
  // Waits come in request order: first every older batch of the slot.
  for (auto& o : q) {
    if (o.get() == e) break;
    if (!o->waited) WaitEngram(o.get());
  }
  if (!e->waited) WaitEngram(e);
  if (!e->status.ok() && e->prefetch) {
    // A prefetched read failed (e.g. its row server went away while it was in flight and the
    // fetcher's retries ran out): ask once more now, as this step's own read.
    ++stats_.engram_prefetches_failed;
    DiscardEngram(e);
    auto again = NewEngramPending(slot, p0, n);
    const size_t off = static_cast<size_t>(p0 - e->p0) * C;
    again->batch.row_ids.assign(e->batch.row_ids.begin() + off,
                                e->batch.row_ids.begin() + off + static_cast<size_t>(n) * C);
    KVTIER_RETURN_IF_ERROR(RequestEngram(std::move(again), true, &e).WithContext(where()));
    for (auto& o : q) {
      if (!o->waited) WaitEngram(o.get());  // older ones first, then e (the newest)
    }
  }
  if (!e->status.ok()) {
    Status s = e->status.WithContext(where());
    DiscardEngram(e);
    ReapEngram(slot);
    return s;
  }
  const size_t rows = static_cast<size_t>(n) * C;
  if (e->batch.data.size() != static_cast<size_t>(e->n) * C * ed ||
      e->batch.scales.size() != static_cast<size_t>(e->n) * C * (ed / 32))
    return Status::Internal("engine: engram row source returned a short batch");
  if (e->prefetch && !e->used) ++stats_.engram_prefetches_consumed;
  e->used = true;
  e->claim_end = -1;
  const bool whole = e->p0 == p0 && e->n == n;
  if (whole) {  // out's old buffers go to e, which is reused for a later request
    out->data.swap(e->batch.data);
    out->scales.swap(e->batch.scales);
  } else {
    const size_t off = static_cast<size_t>(p0 - e->p0) * C;
    out->data.assign(e->batch.data.begin() + off * ed, e->batch.data.begin() + (off + rows) * ed);
    out->scales.assign(e->batch.scales.begin() + off * (ed / 32),
                       e->batch.scales.begin() + (off + rows) * (ed / 32));
  }
  out->slot = slot;
  if (p0 + n == e->end()) {  // fully consumed (no later step starts inside it)
    e->discarded = true;     // not counted: it was used
  }
  ReapEngram(slot);
  return Status::Ok();
}

Status Engine::PrefetchPlan(const std::vector<Step>& plan, std::span<const int32_t> toks,
                            int64_t toks_p0) {
  if (engram_hash_ == nullptr) return Status::Ok();
  int64_t covered = 0;
  for (const Step& s : plan) {
    Status r = EnsureEngram(s, toks, toks_p0, false, nullptr);
    if (!r.ok()) {
      return r.WithContext("engine: engram prefetch stopped after " + std::to_string(covered) +
                           " tokens");
    }
    covered += s.n;
  }
  return Status::Ok();
}

Status Engine::PrefetchEngram(const SequenceState& st, std::span<const int32_t> upcoming) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(upcoming));
  if (engram_hash_ == nullptr) return Status::Ok();
  const int64_t p = static_cast<int64_t>(st.tokens.size());
  const int64_t hist = std::min<int64_t>(p, config_.engram_max_ngram_size - 1);
  std::vector<int32_t> toks(st.tokens.end() - hist, st.tokens.end());
  toks.insert(toks.end(), upcoming.begin(), upcoming.end());
  std::vector<Step> plan;
  AppendChunks(p, static_cast<int64_t>(upcoming.size()), 0, config_.num_hidden_layers, &plan);
  return PrefetchPlan(plan, toks, p - hist);
}

Status Engine::PrefetchEngramReplay(std::span<const int32_t> tokens) {
  return PrefetchEngramReplay(tokens, config_.sliding_window);
}

Status Engine::PrefetchEngramReplay(std::span<const int32_t> tokens, int64_t replay_tokens) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens));
  if (replay_tokens < config_.sliding_window)
    return Status::InvalidArgument("engine: replay_tokens must be at least the sliding window");
  if (engram_hash_ == nullptr) return Status::Ok();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t r = std::min<int64_t>(n, replay_tokens);
  std::vector<Step> plan;
  AppendChunks(n - r, r, 0, config_.num_hidden_layers, &plan);
  return PrefetchPlan(plan, tokens, 0);
}

Status Engine::ApplyEngram(int layer, const EngramRowBatch& batch, int n, float* x) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int slot = c.EngramSlot(layer);
  const int D = c.hidden_size, hc = c.hc_mult, ed = c.engram_head_dim;
  const int C = engram_hash_->num_columns();
  if (batch.data.size() != static_cast<size_t>(n) * C * ed ||
      batch.scales.size() != static_cast<size_t>(n) * C * (ed / 32))
    return Status::Internal("engine: engram rows of the wrong size");
  // This thread's buffers, reused call to call (each is written whole before it is read).
  thread_local std::vector<float> emb_slot, kv_slot, gates_slot;
  Scratch<float> emb(emb_slot, static_cast<size_t>(n) * C * ed);
  KVTIER_RETURN_IF_ERROR(kernels::Dequantize(QuantFormat::kFp8Ue8m0x32, batch.data.data(),
                                             batch.scales.data(), static_cast<size_t>(n) * C, ed,
                                             emb.data(), kQuantBackend));
  const int kvw = (hc + 1) * D;
  Scratch<float> kv(kv_slot, static_cast<size_t>(n) * kvw);
  Mm(pool_.get(), emb.data(), n, C * ed, lw.e_wkv, lw.pk_e_wkv, kvw, kv.data());
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  Scratch<float> gates(gates_slot, static_cast<size_t>(n) * hc);
  pool_->ParallelFor(n, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> tmp_slot;
    Scratch<float> tmp(tmp_slot, static_cast<size_t>(D));
    for (int64_t t = b; t < e; ++t) {
      const float* kvt = kv.data() + t * kvw;
      const float* value = kvt + static_cast<int64_t>(hc) * D;
      for (int cp = 0; cp < hc; ++cp) {
        float* h = x + (t * hc + cp) * D;
        const float* key = kvt + static_cast<int64_t>(cp) * D;
        const float* qw = lw.e_qn + static_cast<int64_t>(cp) * D;
        const float* kw = lw.e_kn + static_cast<int64_t>(cp) * D;
        double sh = 0, sk = 0;
        for (int d = 0; d < D; ++d) {
          sh += static_cast<double>(h[d]) * h[d];
          sk += static_cast<double>(key[d]) * key[d];
          tmp[d] = h[d] * qw[d] * kw[d];
        }
        const float rh = static_cast<float>(1.0 / std::sqrt(sh / D + c.rms_norm_eps));
        const float rk = static_cast<float>(1.0 / std::sqrt(sk / D + c.rms_norm_eps));
        const float g = Dot(tmp.data(), key, D) * rh * rk * inv_sqrt_d;
        const float signed_sqrt = g >= 0 ? std::sqrt(g) : -std::sqrt(-g);
        const float gate = Sigmoid(signed_sqrt);
        gates[t * hc + cp] = gate;
        Axpy(gate, value, D, h);
      }
    }
  });
  if (trace_ != nullptr) {
    auto& g = trace_->engram_gates[slot];
    g.insert(g.end(), gates.begin(), gates.end());
  }
  return Status::Ok();
}

}  // namespace kvtier::engine
