// Engine::ForwardBatch: continuous batching of several sequences in one pass (model.h).
#include <algorithm>
#include <cstring>

#include "engine/model_internal.h"
#include "engine/scratch.h"

namespace kvtier::engine {

// Continuous batching (model.h). Added beside Forward rather than folded into RunLayers so
// that the single-sequence path stays as it is.
Status Engine::ForwardBatch(std::span<SequenceState* const> states,
                            std::span<const std::span<const int32_t>> tokens,
                            std::vector<std::vector<float>>* last_logits,
                            std::vector<std::vector<float>>* all_logits,
                            std::span<AttnInputCapture* const> captures) {
  const size_t k = states.size();
  if (k == 0 || tokens.size() != k)
    return Status::InvalidArgument("engine: ForwardBatch needs one token span per state");
  if (!captures.empty() && captures.size() != k)
    return Status::InvalidArgument("engine: ForwardBatch needs no capture or one per state");
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult, V = c.vocab_size, L = c.num_hidden_layers;
  thread_local std::vector<int64_t> off_slot, p0_slot;  // reused pass to pass
  Scratch<int64_t> off(off_slot, k + 1), p0(p0_slot, k);
  off[0] = 0;
  for (size_t i = 0; i < k; ++i) {
    KVTIER_RETURN_IF_ERROR(CheckTokens(tokens[i]));
    if (tokens[i].size() > static_cast<size_t>(options_.prefill_chunk_tokens))
      return Status::InvalidArgument("engine: ForwardBatch span over prefill_chunk_tokens");
    if (states[i] == nullptr) return Status::InvalidArgument("engine: null state");
    KVTIER_RETURN_IF_ERROR(CheckExtendable(*states[i]));
    for (size_t j = 0; j < i; ++j) {
      if (states[j] == states[i]) return Status::InvalidArgument("engine: a state twice");
    }
    off[i + 1] = off[i] + static_cast<int64_t>(tokens[i].size());
  }
  const int64_t total = off[k];
  if (total > static_cast<int64_t>(kMaxTokensPerCall))
    return Status::InvalidArgument("engine: more than kMaxTokensPerCall tokens in one call");
  ResetTrace();
  for (AttnInputCapture* cap : captures) {
    if (cap != nullptr) cap->Clear();
  }
  // This thread's buffers, reused pass to pass (every element is written before it is read).
  thread_local std::vector<float> x_slot, pre_slot, xn_slot, f_slot, post_slot, comb_slot,
      next_pre_slot, o_slot;
  thread_local std::vector<int64_t> pos_slot;
  thread_local std::vector<Runtime> rt_slot;
  std::vector<Runtime>& rt = rt_slot;  // this thread's, also inside the workers' lambdas
  Scratch<float> x(x_slot, static_cast<size_t>(total) * hc * D),
      pre(pre_slot, static_cast<size_t>(total) * hc);
  for (size_t i = 0; i < k; ++i) {
    p0[i] = static_cast<int64_t>(states[i]->tokens.size());
    states[i]->tokens.insert(states[i]->tokens.end(), tokens[i].begin(), tokens[i].end());
    Embed(tokens[i], x.data() + off[i] * hc * D, pre.data() + off[i] * hc);
  }
  const int n = static_cast<int>(total);
  if (rt.size() < k) rt.resize(k);  // never shrunk: a smaller batch keeps the others' spares
  for (Runtime& r : rt) r.Reset();
  Scratch<float> xn(xn_slot, static_cast<size_t>(n) * D), f(f_slot, static_cast<size_t>(n) * D);
  Scratch<float> post(post_slot, static_cast<size_t>(n) * hc),
      comb(comb_slot, static_cast<size_t>(n) * hc * hc),
      next_pre(next_pre_slot, static_cast<size_t>(n) * hc);
  const int H = c.num_attention_heads, hd = c.head_dim;
  Scratch<float> o(o_slot, static_cast<size_t>(n) * H * hd);
  Scratch<int64_t> pos(pos_slot, static_cast<size_t>(n));
  int64_t max_rows = 0;
  for (size_t i = 0; i < k; ++i) {
    for (int64_t r = off[i]; r < off[i + 1]; ++r) pos[r] = p0[i] + (r - off[i]);
    max_rows = std::max(max_rows, off[i + 1] - off[i]);
  }
  const int threads = pool_->threads();
  const bool across_sequences = threads > 1 && static_cast<int>(k) >= threads &&
                                max_rows * threads <= total && trace_ == nullptr;
  thread_local std::vector<Status> core_status_slot;
  std::vector<Status>& core_status = core_status_slot;
  core_status.assign(k, Status::Ok());
  const ThreadPool::Hold hold(pool_.get());  // no sleeping between this pass's sections
  // Layer l's Engram on the residual xh (host rows): per sequence, claimed and taken before the
  // next sequence's rows are requested, so the position-keyed Engram queue never holds two
  // sequences' claims at once; then applied to every row in one call (ApplyEngram is row by
  // row; one pass over its weight). The buffers are this thread's, reused pass to pass
  // (TakeEngram trades them with the batches it takes).
  auto engram = [&](int l, float* xh) -> Status {
    thread_local EngramRowBatch all_slot, rows_slot;
    thread_local std::vector<Step> one_slot;
    thread_local std::vector<EngramPending*> claimed_slot;
    EngramRowBatch &all = all_slot, &rows = rows_slot;
    all.data.clear();
    all.scales.clear();
    for (size_t i = 0; i < k; ++i) {
      const int ni = static_cast<int>(off[i + 1] - off[i]);
      std::vector<Step>& one = one_slot;
      one.assign(1, Step{p0[i], ni, l, l + 1});
      std::vector<EngramPending*>& claimed = claimed_slot;
      KVTIER_RETURN_IF_ERROR(BeginEngramStep(*states[i], one, 0, &claimed));
      KVTIER_RETURN_IF_ERROR(TakeEngram(l, claimed[c.EngramSlot(l)], p0[i], ni, &rows));
      if (k == 1) {
        all.data.swap(rows.data);
        all.scales.swap(rows.scales);
      } else {
        all.data.insert(all.data.end(), rows.data.begin(), rows.data.end());
        all.scales.insert(all.scales.end(), rows.scales.begin(), rows.scales.end());
      }
    }
    KVTIER_RETURN_IF_ERROR(ApplyEngram(l, all, n, xh));
    TrimEngramRows(all);
    TrimEngramRows(rows);
    return Status::Ok();
  };
  // Sequence i's attention inputs of layer l (residual xh, normed xnh) into its capture.
  auto record = [&](int l, const float* xh, const float* xnh) {
    for (size_t i = 0; i < captures.size(); ++i) {
      if (captures[i] != nullptr)
        captures[i]->Record(l, p0[i], static_cast<int>(off[i + 1] - off[i]), hc, D,
                            xh + off[i] * hc * D, xnh + off[i] * D);
    }
  };
  // Whether some sequence's capture records layer l.
  auto wants_capture = [&](int l) {
    return std::any_of(captures.begin(), captures.end(),
                       [l](AttnInputCapture* p) { return p != nullptr && p->Slot(l) >= 0; });
  };
  // The per-sequence attention core of layer l over attn_rows_ (AttnProject's or
  // DeviceAttnProject's, over every row at once) into o, sequences spread over the threads when
  // no sequence outweighs a thread's share. xnh: the normed rows, or null where attn_rows_
  // carries the compressor's rows (always: ShapeAttnRows sizes them on every compressing layer).
  // On the device path (device_keys) each sequence's keys are gathered into key_rows[i] instead,
  // for DeviceAttention.
  thread_local std::vector<AttnKeyRows> key_rows_slot;
  thread_local std::vector<AttnKeyRows*> key_ptrs_slot;
  std::vector<AttnKeyRows>& key_rows = key_rows_slot;
  auto cores = [&](int l, const float* xnh, bool device_keys) -> Status {
    auto core = [&](size_t i, ThreadPool* pool) {
      const int ni = static_cast<int>(off[i + 1] - off[i]);
      if (device_keys)
        return AttnCoreKeys(l, states[i], p0[i], ni, attn_rows_, off[i], &rt[i], pool,
                            &key_rows[i]);
      return AttnCore(l, states[i], p0[i], ni, xnh != nullptr ? xnh + off[i] * D : nullptr,
                      attn_rows_, off[i], &rt[i], pool, o.data() + off[i] * H * hd);
    };
    if (across_sequences) {
      pool_->ParallelFor(static_cast<int64_t>(k), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) core_status[i] = core(static_cast<size_t>(i), nullptr);
      });
      for (const Status& cs : core_status) KVTIER_RETURN_IF_ERROR(cs);
    } else {
      for (size_t i = 0; i < k; ++i) KVTIER_RETURN_IF_ERROR(core(i, pool_.get()));
    }
    return Status::Ok();
  };
  // The attention sublayer of layer l from the normed rows xnh into fh.
  auto attention = [&](int l, const float* xnh, float* fh) -> Status {
    KVTIER_RETURN_IF_ERROR(AttnProject(l, n, xnh, pos.data(), &attn_rows_));
    KVTIER_RETURN_IF_ERROR(cores(l, xnh, false));
    AttnOutput(l, n, o.data(), fh);
    return Status::Ok();
  };
  // The head's rows: every row (all_logits) or each sequence's last.
  thread_local std::vector<int64_t> head_rows_slot;
  std::vector<int64_t>& head_rows = head_rows_slot;
  head_rows.clear();
  if (all_logits == nullptr) {
    for (size_t i = 0; i < k; ++i) head_rows.push_back(off[i + 1] - 1);
  }
  const int64_t head_n = all_logits != nullptr ? n : static_cast<int64_t>(k);
  // This thread's logits buffer, reused pass to pass (the head writes every element).
  thread_local std::vector<float> out_slot;
  Scratch<float> out(out_slot, static_cast<size_t>(head_n) * V);
  if (device_ != nullptr && trace_ == nullptr) {
    // The layers and the head on the device; the caches' part of attention and Engram here.
    if (key_rows.size() < k) key_rows.resize(k);  // never shrunk, as rt
    std::vector<AttnKeyRows*>& key_ptrs = key_ptrs_slot;
    key_ptrs.resize(k);
    for (size_t i = 0; i < k; ++i) key_ptrs[i] = &key_rows[i];
    ScopeExit trim([&] {
      for (AttnKeyRows& r : key_rows) TrimKeyRows(r);
    });
    Status s = model_detail::RunDeviceLayers(
        *device_, c, n, 0, L, x.data(), pre.data(), xn.data(),
        [&](int l) { return engram(l, x.data()); }, wants_capture,
        [&](int l) { record(l, x.data(), xn.data()); },
        [&](int l) -> Status {
          KVTIER_RETURN_IF_ERROR(DeviceAttnProject(l, n, pos.data(), &attn_rows_));
          KVTIER_RETURN_IF_ERROR(cores(l, nullptr, true));
          return DeviceAttention(l, key_ptrs, attn_rows_);
        });
    if (s.ok()) s = device_->Head(head_rows, out.data());
    KVTIER_RETURN_IF_ERROR(AfterDevicePass(std::move(s)));
  } else {
    for (int l = 0; l < L; ++l) {
      const LayerWeights& lw = layers_[l];
      if (c.IsEngramLayer(l)) KVTIER_RETURN_IF_ERROR(engram(l, x.data()));
      for (int s = 0; s < 2; ++s) {
        PreMix(n, x.data(), pre.data(), s == 0 ? lw.attn_norm : lw.ffn_norm, xn.data());
        if (s == 0) record(l, x.data(), xn.data());
        auto mixes = [&](int64_t b, int64_t e) {  // a range's rows share fn's reads
          HcMixesRows(static_cast<int>(e - b), x.data() + b * hc * D, hc, D, lw.hc_fn[s],
                      lw.hc_scale[s], lw.hc_base[s], c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                      next_pre.data() + b * hc, post.data() + b * hc, comb.data() + b * hc * hc);
        };
        KVTIER_RETURN_IF_ERROR(
            model_detail::MixesBesideSublayer(pool_.get(), n, mixes, [&]() -> Status {
              if (s == 0) return attention(l, xn.data(), f.data());
              Moe(l, n, xn.data(), f.data());
              return Status::Ok();
            }));
        if (trace_ != nullptr) {
          auto& tc = trace_->comb[2 * l + s];
          for (int t = 0; t < n; ++t) {
            tc.emplace_back(comb.begin() + static_cast<int64_t>(t) * hc * hc,
                            comb.begin() + static_cast<int64_t>(t + 1) * hc * hc);
          }
        }
        MixSublayer(n, x.data(), f.data(), post.data(), comb.data());
        std::memcpy(pre.data(), next_pre.data(), next_pre.size() * 4);
      }
    }
    if (all_logits != nullptr) {
      Head(n, x.data(), pre.data(), out.data());
    } else {  // the head over each sequence's last row only
      thread_local std::vector<float> xl_slot, pl_slot;
      Scratch<float> xl(xl_slot, k * hc * D), pl(pl_slot, k * hc);
      for (size_t i = 0; i < k; ++i) {
        const int64_t r = head_rows[i];
        std::memcpy(xl.data() + i * hc * D, x.data() + r * hc * D, static_cast<size_t>(hc) * D * 4);
        std::memcpy(pl.data() + i * hc, pre.data() + r * hc, static_cast<size_t>(hc) * 4);
      }
      Head(static_cast<int>(k), xl.data(), pl.data(), out.data());
    }
  }
  last_logits->resize(k);
  if (all_logits != nullptr) {  // the last rows are among every row's
    all_logits->resize(k);
    for (size_t i = 0; i < k; ++i) {
      (*all_logits)[i].assign(out.begin() + off[i] * V, out.begin() + off[i + 1] * V);
      (*last_logits)[i].assign(out.begin() + (off[i + 1] - 1) * V, out.begin() + off[i + 1] * V);
    }
    return Status::Ok();
  }
  for (size_t i = 0; i < k; ++i)
    (*last_logits)[i].assign(out.begin() + i * V, out.begin() + (i + 1) * V);
  return Status::Ok();
}

}  // namespace kvtier::engine
