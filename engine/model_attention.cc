// Engine: the attention sublayer (reference §2-§5). Three phases, so that ForwardBatch runs the
// per-row work once over every sequence's rows and only the core per sequence:
//   AttnProject  per row: q (low-rank, normed, RoPE), the SWA entry (FP8 round trip), the
//                indexer's query and head weights;
//   AttnCore     per sequence: AttnSelect (the compressor's global KV, top-k selection), sparse
//                attention over [selected entries] + [SWA window], SwaPush (the ring update);
//   AttnOutput   per row: the grouped output projection.
// On the device layers (EngineOptions::layer_device) AttnCoreKeys takes AttnCore's place: the
// same selection and ring update, with each row's keys gathered as stored bytes (AttnGather) for
// the device's attention (DeviceAttention) instead of the arithmetic here.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "engine/model_internal.h"
#include "engine/scratch.h"

namespace kvtier::engine {

namespace {
using model_detail::ForRange;
using model_detail::kAttnSplitMinWork;
using model_detail::kCacheReadBackend;
using model_detail::kIndexRowsPerPass;
using model_detail::kQuantBackend;
using model_detail::QuantFormat;
}  // namespace

Status Engine::Compress(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                        ThreadPool* pool, const float* ckv_rows, const float* cgate_rows) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  KvSourceCache* k = nullptr;
  for (KvSourceCache& kc : st->kv) {
    if (kc.layer == layer) k = &kc;
  }
  if (k == nullptr) return Status::Internal("engine: no cache for kv source");
  const int64_t first = std::max(p0, k->consumed);
  if (first >= p0 + n) return Status::Ok();  // already projected (CED replay, import)
  if (k->consumed < p0) return Status::Internal("engine: compressor input has a gap");
  const int D = c.hidden_size, hd = c.head_dim, id = c.index_head_dim, m = k->ratio;
  const int rd = c.qk_rope_head_dim;
  const int rows = static_cast<int>(p0 + n - first);
  // The projections of rows [first, p0 + n): given, or taken here.
  // This thread's buffers, reused call to call (released on the way out past 1 MiB).
  thread_local std::vector<float> own_kv, own_gate, latents;
  thread_local std::vector<int64_t> entry_ids;
  const ScopeExit trim([&] {
    TrimScratch(own_kv);
    TrimScratch(own_gate);
    TrimScratch(latents);
    TrimScratch(entry_ids);
  });
  const float* ckv = ckv_rows != nullptr ? ckv_rows + (first - p0) * hd : nullptr;
  const float* cg = cgate_rows != nullptr ? cgate_rows + (first - p0) * hd : nullptr;
  if (ckv == nullptr || (m > 1 && cg == nullptr)) {
    if (xa == nullptr) return Status::Internal("engine: compressor rows without their input");
    const float* xin = xa + (first - p0) * D;
    own_kv.resize(static_cast<size_t>(rows) * hd);
    own_gate.resize(m > 1 ? own_kv.size() : 0);
    MatMulPart proj[2] = {{xin, rows, D, lw.c_wkv, lw.pk_c_wkv, hd, own_kv.data()},
                          {xin, rows, D, lw.c_wgate, lw.pk_c_wgate, hd, own_gate.data()}};
    MmMany(pool, std::span<MatMulPart>(proj, m > 1 ? 2 : 1));
    ckv = own_kv.data();
    cg = own_gate.data();
  }
  // Collect finished groups: latent (pre-RoPE, normalised) per entry.
  latents.clear();
  entry_ids.clear();
  latents.reserve(static_cast<size_t>(rows / m + 1) * hd);
  for (int r = 0; r < rows; ++r) {
    const int64_t p = first + r;
    const int slot = static_cast<int>(p % m);
    if (m > 1) {
      std::memcpy(k->kv_state.data() + static_cast<int64_t>(slot) * hd,
                  ckv + static_cast<int64_t>(r) * hd, hd * 4);
      std::memcpy(k->score_state.data() + static_cast<int64_t>(slot) * hd,
                  cg + static_cast<int64_t>(r) * hd, hd * 4);
      if (slot != m - 1) continue;
    }
    latents.resize(latents.size() + hd);  // this entry's latent, written in place
    float* lat = latents.data() + latents.size() - hd;
    if (m == 1) {
      std::memcpy(lat, ckv + static_cast<int64_t>(r) * hd, hd * 4);
    } else {
      // Per-channel softmax over the m tokens of the group.
      for (int ch = 0; ch < hd; ++ch) {
        float mx = -INFINITY;
        for (int j = 0; j < m; ++j) mx = std::max(mx, k->score_state[j * hd + ch]);
        float den = 0, num = 0;
        for (int j = 0; j < m; ++j) {
          const float e = std::exp(k->score_state[j * hd + ch] - mx);
          den += e;
          num += e * k->kv_state[j * hd + ch];
        }
        lat[ch] = num / den;
      }
    }
    RmsNorm(lat, lw.c_norm, hd, c.rms_norm_eps, lat);
    entry_ids.push_back(p / m);
  }
  k->consumed = p0 + n;
  const int ne = static_cast<int>(entry_ids.size());
  if (ne == 0) return Status::Ok();
  if (entry_ids[0] != k->entries())
    return Status::Internal("engine: compressed entry out of order");
  // Indexer keys from the pre-RoPE latent: k = k_norm(wk(latent)), RoPE, FP4 (ue8m0 / 32).
  thread_local std::vector<float> ik_slot;
  Scratch<float> ik(ik_slot, static_cast<size_t>(ne) * id);
  Mm(pool, latents.data(), ne, hd, lw.i_wk, lw.pk_i_wk, id, ik.data());
  for (int e = 0; e < ne; ++e) {
    float* kk = ik.data() + static_cast<int64_t>(e) * id;
    LayerNorm(kk, lw.i_kn_w, lw.i_kn_b, id, c.rms_norm_eps, kk);
    ApplyRope(kk + id - rd, *lw.rope, entry_ids[e] * m, false);
    ApplyRope(latents.data() + static_cast<int64_t>(e) * hd + hd - rd, *lw.rope, entry_ids[e] * m,
              false);
  }
  auto append = [&](QuantFormat fmt, const float* v, int dim, std::vector<uint8_t>* data,
                    std::vector<uint8_t>* scales) -> Status {
    const size_t d0 = AppendKvBytes(data, ne * kernels::DataBytes(fmt, dim));
    const size_t s0 = AppendKvBytes(scales, ne * kernels::ScaleBytes(fmt, dim));
    return kernels::Quantize(fmt, v, ne, dim, data->data() + d0, scales->data() + s0,
                             kQuantBackend);
  };
  KVTIER_RETURN_IF_ERROR(
      append(QuantFormat::kFp4E4M3x16, latents.data(), hd, &k->main_data, &k->main_scales));
  KVTIER_RETURN_IF_ERROR(
      append(QuantFormat::kFp4Ue8m0x32, ik.data(), id, &k->index_data, &k->index_scales));
  k->n_entries += ne;
  return Status::Ok();
}

Status Engine::SelectTopk(int layer, int64_t p0, int n, const float* iq, const float* wts,
                          Runtime* rt, ThreadPool* pool) {
  const EngineConfig& c = config_;
  const int IH = c.index_n_heads, id = c.index_head_dim;
  const KvSourceCache* src = rt->src;
  const int m = src->ratio;
  const float wscale = 1.0f / std::sqrt(static_cast<float>(id)) / std::sqrt(static_cast<float>(IH));
  const bool is_candidate_source = layer == c.candidate_source_layer_id;
  const bool restrict = c.layer_modes[layer] == LayerMode::kReindex &&
                        options_.use_candidate_pool && !rt->candidates.empty();
  const int bs = c.candidate_block_size;
  rt->ResizeTopk(n);
  if (is_candidate_source) rt->ResizeCandidates(n);
  std::vector<int64_t> cand_visible(trace_ != nullptr ? n : 0, 0), cand_pool(cand_visible.size());
  // Entries row t sees (nondecreasing in t).
  auto visible = [&](int64_t t) { return std::min<int64_t>((p0 + t + 1) / m, src->entries()); };
  // Index keys are read as their FP4 bytes and dequantised (exactly) a block of rows at a time;
  // a Reindex layer reads and scores only the rows of its candidate pools. The rows of a group
  // (one sequence's, e.g. a verify pass's) share every key they see: a block of keys is
  // dequantised once and scored against all of the group's rows, and each row then reads its
  // own visible (and, on a Reindex layer, eligible) entries. Every score is still the sum over
  // the heads in order of ReLU(Dot(q_h, k)) * (w_h * wscale) (HcMixDots: Dot's bits).
  const QuantFormat ifmt = QuantFormat::kFp4Ue8m0x32;
  const size_t idb = kernels::DataBytes(ifmt, id), isb = kernels::ScaleBytes(ifmt, id);
  std::atomic<bool> failed{false};
  for (int g0 = 0; g0 < n; g0 += model_detail::kIndexQueryRowsPerGroup) {
    const int gn = std::min(model_detail::kIndexQueryRowsPerGroup, n - g0);
    const int64_t nv_max = visible(g0 + gn - 1);
    if (nv_max <= 0) continue;  // no row of the group sees an entry
    const int M = gn * IH;      // query vectors of the group: row-major, heads within a row
    // The runs of entries to score, [runs[2i], runs[2i + 1]), each at most kIndexRowsPerPass.
    std::vector<int64_t>& runs = rt->index_runs;
    runs.clear();
    auto add_run = [&](int64_t j0, int64_t j1) {
      for (; j0 < j1; j0 += kIndexRowsPerPass) {
        runs.push_back(j0);
        runs.push_back(std::min<int64_t>(j1, j0 + kIndexRowsPerPass));
      }
    };
    if (restrict) {  // blocks in any of the group's candidate pools
      const int64_t nb = (nv_max + bs - 1) / bs;
      int64_t run0 = -1;
      for (int64_t bi = 0; bi <= nb; ++bi) {
        bool any = false;
        for (int t = 0; bi < nb && t < gn && !any; ++t) {
          const std::vector<uint8_t>& mask = rt->candidates[g0 + t];
          any = bi < static_cast<int64_t>(mask.size()) && mask[bi] != 0;
        }
        if (any && run0 < 0) run0 = bi * bs;
        if (!any && run0 >= 0) {
          add_run(run0, std::min<int64_t>(nv_max, bi * bs));
          run0 = -1;
        }
      }
    } else {
      add_run(0, nv_max);
    }
    std::vector<float>& hw = rt->index_head_weights;
    hw.resize(static_cast<size_t>(M));
    for (int i = 0; i < M; ++i) hw[i] = wts[static_cast<int64_t>(g0) * IH + i] * wscale;
    std::vector<float>& scores = rt->index_scores;
    ResizeGeometric(scores, static_cast<size_t>(gn) * nv_max);
    const float* q = iq + static_cast<int64_t>(g0) * IH * id;
    const int64_t n_runs = static_cast<int64_t>(runs.size() / 2);
    ForRange(pool, n_runs, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> keys_slot, dots_slot;
      Scratch<float> keys(keys_slot, static_cast<size_t>(kIndexRowsPerPass) * id),
          dots(dots_slot, static_cast<size_t>(kIndexRowsPerPass) * M);
      for (int64_t r = b; r < e; ++r) {
        const int64_t j0 = runs[2 * r], j1 = runs[2 * r + 1];
        const int nk = static_cast<int>(j1 - j0);
        if (!kernels::Dequantize(ifmt, src->index_data.data() + j0 * idb,
                                 src->index_scales.data() + j0 * isb, nk, id, keys.data(),
                                 kCacheReadBackend)
                 .ok()) {
          failed = true;
          return;
        }
        // dots[(t * IH + h) * nk + j] = Dot(key j0 + j; q of row t, head h), which is Dot(q, key)
        // (the same products, summed in the same order).
        HcMixDots(keys.data(), nk, q, M, id, dots.data(), /*avx2=*/true);
        // s = 0, then per head in order s += ReLU(dot) * weight: four keys per vector step, each
        // lane the scalar loop's products and sums (ReLU as std::max(dot, 0): -0.0 and NaN kept).
        typedef float V4 __attribute__((vector_size(16)));
        typedef int32_t I4 __attribute__((vector_size(16)));
        const V4 zero = {0, 0, 0, 0};
        for (int t = 0; t < gn; ++t) {
          float* srow = scores.data() + static_cast<int64_t>(t) * nv_max + j0;
          const float* dt = dots.data() + static_cast<int64_t>(t) * IH * nk;
          const float* wt = hw.data() + static_cast<int64_t>(t) * IH;
          int j = 0;
          for (; j + 4 <= nk; j += 4) {
            V4 s = zero;
            for (int h = 0; h < IH; ++h) {
              V4 d;
              std::memcpy(&d, dt + static_cast<int64_t>(h) * nk + j, sizeof d);
              const I4 neg = d < zero;
              const V4 relu = reinterpret_cast<V4>(reinterpret_cast<I4>(d) & ~neg);
              const V4 w = {wt[h], wt[h], wt[h], wt[h]};
              const V4 p = relu * w;
              s += p;
            }
            std::memcpy(srow + j, &s, sizeof s);
          }
          for (; j < nk; ++j) {
            float s = 0;
            for (int h = 0; h < IH; ++h) {
              s += std::max(dt[static_cast<int64_t>(h) * nk + j], 0.0f) * wt[h];
            }
            srow[j] = s;
          }
        }
      }
    });
    if (failed) return Status::Internal("engine: index keys could not be dequantised");
    // Each row's selection over its own entries.
    ForRange(pool, gn, [&](int64_t b, int64_t e) {
      thread_local std::vector<int32_t> eligible, blocks, top;
      thread_local std::vector<float> bscore;
      for (int64_t ti = b; ti < e; ++ti) {
        const int64_t t = g0 + ti;
        const int64_t nv = visible(t);
        if (nv <= 0) continue;
        const float* score = scores.data() + ti * nv_max;
        eligible.clear();
        if (restrict) {
          const std::vector<uint8_t>& mask = rt->candidates[t];
          const int64_t nb = std::min<int64_t>((nv + bs - 1) / bs, mask.size());
          for (int64_t bi = 0; bi < nb; ++bi) {
            if (!mask[bi]) continue;
            const int64_t j1 = std::min<int64_t>(nv, (bi + 1) * bs);
            for (int64_t j = bi * bs; j < j1; ++j) eligible.push_back(static_cast<int32_t>(j));
          }
          TopKByScore(score, eligible.data(), static_cast<int64_t>(eligible.size()), c.index_topk,
                      &rt->topk[t]);
          continue;
        }
        if (is_candidate_source) {
          const int64_t nb = (nv + bs - 1) / bs;
          ResizeGeometric(bscore, static_cast<size_t>(nb));
          std::fill(bscore.begin(), bscore.end(), -INFINITY);
          for (int64_t j = 0; j < nv; ++j) bscore[j / bs] = std::max(bscore[j / bs], score[j]);
          bscore[nb - 1] = INFINITY;  // the block holding the newest position is pinned
          blocks.resize(nb);
          for (int64_t i = 0; i < nb; ++i) blocks[i] = static_cast<int32_t>(i);
          TopKByScore(bscore.data(), blocks.data(), nb, c.candidate_topk_blocks, &top);
          std::vector<uint8_t>& mask = rt->candidates[t];
          ResizeGeometric(mask, static_cast<size_t>(nb));  // a list from Refill: empty
          std::fill(mask.begin(), mask.end(), uint8_t{0});
          int64_t pool_positions = 0;
          for (int32_t bi : top) {
            mask[bi] = 1;
            pool_positions += std::min<int64_t>(bs, nv - static_cast<int64_t>(bi) * bs);
          }
          if (trace_ != nullptr) {
            cand_visible[t] = nv;
            cand_pool[t] = pool_positions;
          }
        }
        ResizeGeometric(eligible, static_cast<size_t>(nv));
        for (int64_t j = 0; j < nv; ++j) eligible[j] = static_cast<int32_t>(j);
        TopKByScore(score, eligible.data(), nv, c.index_topk, &rt->topk[t]);
      }
      TrimScratch(eligible);
      TrimScratch(blocks);
      TrimScratch(top);
      TrimScratch(bscore);
    });
  }
  if (trace_ != nullptr && is_candidate_source) {  // appended chunk by chunk
    trace_->candidate_visible.insert(trace_->candidate_visible.end(), cand_visible.begin(),
                                     cand_visible.end());
    trace_->candidate_pool.insert(trace_->candidate_pool.end(), cand_pool.begin(), cand_pool.end());
  }
  return Status::Ok();
}

void Engine::ShapeAttnRows(int layer, int n, AttnRows* a) const {
  const EngineConfig& c = config_;
  const LayerMode mode = c.layer_modes[layer];
  const bool indexed = mode == LayerMode::kFull || mode == LayerMode::kReindex;
  const bool compress = mode == LayerMode::kFull && layers_[layer].c_wkv != nullptr;
  const bool gated = compress && c.ratio(layer) > 1;
  const size_t rows = static_cast<size_t>(n), hd = c.head_dim;
  a->q.resize(rows * c.num_attention_heads * hd);
  a->kv.resize(rows * hd);
  a->iq.resize(indexed ? rows * c.index_n_heads * c.index_head_dim : 0);
  a->wts.resize(indexed ? rows * c.index_n_heads : 0);
  a->ckv.resize(compress ? rows * hd : 0);
  a->cgate.resize(gated ? rows * hd : 0);
}

Status Engine::AttnProject(int layer, int n, const float* xa, const int64_t* pos, AttnRows* a) {
  AttnProducts(layer, n, xa, a);
  return AttnRotate(layer, n, pos, a);
}

void Engine::AttnProducts(int layer, int n, const float* xa, AttnRows* a) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim;
  const int ql = c.q_lora_rank, IH = c.index_n_heads, id = c.index_head_dim;
  ShapeAttnRows(layer, n, a);
  a->qr.resize(static_cast<size_t>(n) * ql);
  // The products of xa (q's low rank, the SWA entry, the indexer's head weights), then those of
  // the normed low-rank q (q, the indexer's query): one call each, so a decode step hands each
  // group to the threads once.
  // On a kFull layer also the compressor's (its weights once for all the sequences' rows).
  const bool indexed = !a->iq.empty(), compress = !a->ckv.empty(), gated = !a->cgate.empty();
  MatMulPart from_x[5] = {{xa, n, D, lw.wq_a, lw.pk_wq_a, ql, a->qr.data()},
                          {xa, n, D, lw.wkv, lw.pk_wkv, hd, a->kv.data()}};
  size_t n_from_x = 2;
  if (indexed) from_x[n_from_x++] = {xa, n, D, lw.i_wproj, lw.pk_i_wproj, IH, a->wts.data()};
  if (compress) from_x[n_from_x++] = {xa, n, D, lw.c_wkv, lw.pk_c_wkv, hd, a->ckv.data()};
  if (gated) from_x[n_from_x++] = {xa, n, D, lw.c_wgate, lw.pk_c_wgate, hd, a->cgate.data()};
  MmMany(pool_.get(), std::span<MatMulPart>(from_x, n_from_x));
  RmsNormRows(a->qr.data(), n, lw.q_norm, ql, c.rms_norm_eps, a->qr.data());
  MatMulPart from_q[2] = {{a->qr.data(), n, ql, lw.wq_b, lw.pk_wq_b, H * hd, a->q.data()},
                          {a->qr.data(), n, ql, lw.i_wq_b, lw.pk_i_wq_b, IH * id, a->iq.data()}};
  MmMany(pool_.get(), std::span<MatMulPart>(from_q, indexed ? 2 : 1));
  RmsNormRows(a->kv.data(), n, lw.kv_norm, hd, c.rms_norm_eps, a->kv.data());
}

Status Engine::AttnRotate(int layer, int n, const int64_t* pos, AttnRows* a) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int H = c.num_attention_heads, hd = c.head_dim, rd = c.qk_rope_head_dim;
  const int IH = c.index_n_heads, id = c.index_head_dim;
  const bool indexed = !a->iq.empty();
  // Each row's RoPE rotation once, for its q heads, its SWA entry, its indexer heads (here) and
  // the inverse RoPE of its attention output (AttnCore).
  const int np = static_cast<int>(lw.rope->size());
  a->rope_c.resize(static_cast<size_t>(n) * np);
  a->rope_s.resize(a->rope_c.size());
  for (int t = 0; t < n; ++t) {
    RopeRotation(*lw.rope, pos[t], a->rope_c.data() + static_cast<int64_t>(t) * np,
                 a->rope_s.data() + static_cast<int64_t>(t) * np);
  }
  auto rope = [&](float* x, int t) {
    ApplyRopeRotation(x, a->rope_c.data() + static_cast<int64_t>(t) * np,
                      a->rope_s.data() + static_cast<int64_t>(t) * np, np, false);
  };
  for (int t = 0; t < n && !a->q.empty(); ++t) {  // q is empty where the device rotates it
    for (int h = 0; h < H; ++h)
      rope(a->q.data() + (static_cast<int64_t>(t) * H + h) * hd + hd - rd, t);
  }
  // SWA entries of these rows: kv_norm(wkv x) (AttnProducts), RoPE, FP8 e4m3 + ue8m0/32 (and
  // back).
  for (int t = 0; t < n; ++t) rope(a->kv.data() + static_cast<int64_t>(t) * hd + hd - rd, t);
  a->kv_data.resize(static_cast<size_t>(n) * hd);
  a->kv_scales.resize(static_cast<size_t>(n) * hd / 32);
  KVTIER_RETURN_IF_ERROR(kernels::Quantize(QuantFormat::kFp8Ue8m0x32, a->kv.data(), n, hd,
                                           a->kv_data.data(), a->kv_scales.data(), kQuantBackend));
  KVTIER_RETURN_IF_ERROR(kernels::Dequantize(QuantFormat::kFp8Ue8m0x32, a->kv_data.data(),
                                             a->kv_scales.data(), n, hd, a->kv.data(),
                                             kQuantBackend));
  // The indexer's query (Full and Reindex layers): RoPE, then the FP4 QAT of the reference
  // (ue8m0 per 32).
  if (indexed) {
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < IH; ++h) {
        rope(a->iq.data() + (static_cast<int64_t>(t) * IH + h) * id + id - rd, t);
      }
    }
    KVTIER_RETURN_IF_ERROR(kernels::RoundTrip(QuantFormat::kFp4Ue8m0x32, a->iq.data(),
                                              static_cast<size_t>(n) * IH, id, kQuantBackend));
  }
  return Status::Ok();
}

Status Engine::AttnSelect(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                          const AttnRows& a, int64_t row0, Runtime* rt, ThreadPool* pool) {
  const EngineConfig& c = config_;
  const int hd = c.head_dim;
  const LayerMode mode = c.layer_modes[layer];
  SwaRing& ring = st->swa[layer];
  if (ring.end != p0) {
    if (ring.valid_from < p0) return Status::Internal("engine: SWA ring has a gap");
    ring.end = p0;
  }
  // Compressed entries: sources write, then this layer (and later ones) read.
  if (mode != LayerMode::kSwaOnly) {
    if (mode == LayerMode::kFull) {
      KVTIER_RETURN_IF_ERROR(Compress(layer, st, p0, n, xa, pool,
                                      a.ckv.empty() ? nullptr : a.ckv.data() + row0 * hd,
                                      a.cgate.empty() ? nullptr : a.cgate.data() + row0 * hd));
      for (KvSourceCache& k : st->kv) {
        if (k.layer == layer) rt->src = &k;
      }
      if (layer != c.candidate_source_layer_id) rt->ClearCandidates();
    }
    if (rt->src == nullptr || rt->src->layer != c.kv_source_of_layer[layer])
      return Status::Internal("engine: shared runtime has no kv source for this layer");
    if (mode == LayerMode::kFull || mode == LayerMode::kReindex) {
      const int IH = c.index_n_heads, id = c.index_head_dim;
      KVTIER_RETURN_IF_ERROR(SelectTopk(layer, p0, n, a.iq.data() + row0 * IH * id,
                                        a.wts.data() + row0 * IH, rt, pool));
    } else if (static_cast<int>(rt->topk.size()) != n) {
      return Status::Internal("engine: reuse layer without top-k");
    }
    if (trace_ != nullptr) {
      trace_->topk[layer].insert(trace_->topk[layer].end(), rt->topk.begin(), rt->topk.end());
    }
  }
  return Status::Ok();
}

void Engine::SwaPush(int layer, SequenceState* st, int64_t p0, int n, const AttnRows& a,
                     int64_t row0) const {
  const int hd = config_.head_dim, W = config_.sliding_window, sb = hd / 32;
  SwaRing& ring = st->swa[layer];
  const float* kv = a.kv.data() + row0 * hd;
  const uint8_t* kv_data = a.kv_data.data() + row0 * hd;
  const uint8_t* kv_scales = a.kv_scales.data() + row0 * sb;
  for (int64_t p = std::max<int64_t>(p0, p0 + n - W); p < p0 + n; ++p) {
    const int64_t slot = p % W, t = p - p0;
    std::memcpy(ring.values.data() + slot * hd, kv + t * hd, hd * 4);
    std::memcpy(ring.data.data() + slot * hd, kv_data + t * hd, hd);
    std::memcpy(ring.scales.data() + slot * sb, kv_scales + t * sb, sb);
    ring.Stamp(slot);
  }
  ring.end = p0 + n;
}

Status Engine::AttnCore(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                        const AttnRows& a, int64_t row0, Runtime* rt, ThreadPool* pool, float* o) {
  KVTIER_RETURN_IF_ERROR(AttnSelect(layer, st, p0, n, xa, a, row0, rt, pool));
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int H = c.num_attention_heads, hd = c.head_dim;
  const int rd = c.qk_rope_head_dim, W = c.sliding_window;
  const LayerMode mode = c.layer_modes[layer];
  const SwaRing& ring = st->swa[layer];
  const float* q = a.q.data() + row0 * H * hd;
  const float* kv = a.kv.data() + row0 * hd;

  // Sparse attention over [selected compressed entries] + [SWA window], one latent as K and V.
  // Per query token the keys are gathered once into one buffer of rows (compressed entries
  // dequantised from their FP4 bytes, SWA keys copied) and every head runs against them: the
  // heads' logits in one HcMixDots (each a Dot), their weighted sums in one WeightedRowSums
  // (each Axpy's sums), so every output is what one Dot and one Axpy per (head, key) gave.
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const KvSourceCache* src = rt->src;
  const QuantFormat mfmt = QuantFormat::kFp4E4M3x16;
  const size_t mdb = kernels::DataBytes(mfmt, hd), msb = kernels::ScaleBytes(mfmt, hd);
  // Gathers token t's keys into rows of `keys`; returns their number, or -1 when an entry could
  // not be dequantised.
  auto gather = [&](int64_t t, std::vector<float>* keys) -> int64_t {
    const int64_t p = p0 + t;
    const int64_t lo = std::max<int64_t>(std::max(ring.valid_from, p - W + 1), 0);
    const std::vector<int32_t>* sel = mode != LayerMode::kSwaOnly ? &rt->topk[t] : nullptr;
    const int64_t n_sel = sel != nullptr ? static_cast<int64_t>(sel->size()) : 0;
    ResizeGeometric(*keys, static_cast<size_t>(n_sel + std::max<int64_t>(p - lo + 1, 0)) * hd);
    // Selected entries (index order), a run of consecutive entries in one call.
    for (int64_t i = 0; i < n_sel;) {
      const int64_t j = (*sel)[i];
      int64_t run = 1;
      while (i + run < n_sel && (*sel)[i + run] == j + run) ++run;
      if (!kernels::Dequantize(mfmt, src->main_data.data() + j * mdb,
                               src->main_scales.data() + j * msb, run, hd, keys->data() + i * hd,
                               kCacheReadBackend)
               .ok()) {
        return -1;
      }
      i += run;
    }
    int64_t nk = n_sel;
    for (int64_t s = lo; s <= p; ++s) {
      const float* key = nullptr;
      if (s >= p0) {
        key = kv + (s - p0) * hd;
      } else if (ring.Has(s)) {
        key = ring.values.data() + (s % W) * hd;
      }
      if (key == nullptr) continue;
      std::memcpy(keys->data() + nk * hd, key, static_cast<size_t>(hd) * 4);
      ++nk;
    }
    return nk;
  };
  // Heads [h0, h1) of token t against its nk gathered keys; dots and w are scratch.
  auto attend = [&](int64_t t, int h0, int h1, const float* keys, int64_t nk,
                    std::vector<float>* dots, std::vector<float>* w) {
    const int hn = h1 - h0, nki = static_cast<int>(nk);
    dots->resize(static_cast<size_t>(nk) * hn);
    w->resize(dots->size());
    const float* qt = q + (t * H + h0) * hd;
    HcMixDots(qt, hn, keys, nki, hd, dots->data(), /*avx2=*/true);  // dots[i * hn + h - h0]
    for (int h = h0; h < h1; ++h) {
      float* lg = w->data() + static_cast<int64_t>(h - h0) * nk;
      const float* dh = dots->data() + (h - h0);
      const float sink = lw.sink[h];
      float mx = sink;
      for (int64_t i = 0; i < nk; ++i) {
        lg[i] = dh[i * hn] * scale;
        mx = std::max(mx, lg[i]);
      }
      float den = std::exp(sink - mx);
      for (int64_t i = 0; i < nk; ++i) {
        lg[i] = std::exp(lg[i] - mx);
        den += lg[i];
      }
      for (int64_t i = 0; i < nk; ++i) lg[i] = lg[i] / den;
    }
    float* ot = o + (t * H + h0) * hd;
    WeightedRowSums(w->data(), hn, keys, nki, hd, ot, /*avx2=*/true);
    // Inverse RoPE on the output, with the rotation AttnProject took for this row (row0 + t,
    // at position p0 + t).
    const int np = static_cast<int>(lw.rope->size());
    const float* rc = a.rope_c.data() + (row0 + t) * np;
    const float* rs = a.rope_s.data() + (row0 + t) * np;
    for (int h = 0; h < hn; ++h)
      ApplyRopeRotation(ot + static_cast<int64_t>(h) * hd + hd - rd, rc, rs, np, true);
  };
  std::atomic<bool> failed{false};
  if (pool != nullptr && pool->threads() > 1 && n < pool->threads()) {
    // Fewer tokens than threads (decode): the keys are gathered once per token, then the
    // threads take (token, head) pairs, one contiguous share each. A head's output is computed
    // by the same code either way, so the bits do not depend on the split.
    thread_local std::vector<std::vector<float>> keys_slot;  // reused call to call
    thread_local std::vector<int64_t> nk_slot;
    std::vector<std::vector<float>>& keys = keys_slot;  // the workers read them through these
    std::vector<int64_t>& nk = nk_slot;
    if (keys.size() < static_cast<size_t>(n)) keys.resize(n);
    nk.resize(n);
    ScopeExit trim([&] {
      for (auto& k : keys) TrimScratch(k);
    });
    for (int64_t t = 0; t < n; ++t) {
      nk[t] = gather(t, &keys[t]);
      if (nk[t] < 0) return Status::Internal("engine: global KV entries could not be dequantised");
    }
    auto heads = [&](int64_t b, int64_t e) {
      thread_local std::vector<float> dots, w;
      for (int64_t i = b; i < e;) {  // the share's heads of one token at a time
        const int64_t t = i / H;
        const int h0 = static_cast<int>(i % H);
        const int h1 = static_cast<int>(std::min<int64_t>(H, h0 + (e - i)));
        attend(t, h0, h1, keys[t].data(), nk[t], &dots, &w);
        i += h1 - h0;
      }
      TrimScratch(dots);
      TrimScratch(w);
    };
    int64_t work = 0;  // multiply-adds: a dot product and an axpy per head and key
    for (int64_t t = 0; t < n; ++t) work += nk[t] * H * 2 * hd;
    if (work >= kAttnSplitMinWork) {
      pool->ParallelFor(static_cast<int64_t>(n) * H, heads, 1);
    } else {
      heads(0, static_cast<int64_t>(n) * H);  // a hand-off would cost more than it saves
    }
  } else {
    ForRange(pool, n, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> keys, dots, w;  // reused call to call
      for (int64_t t = b; t < e; ++t) {
        const int64_t nk = gather(t, &keys);
        if (nk < 0) {
          failed = true;
          return;
        }
        attend(t, 0, H, keys.data(), nk, &dots, &w);
      }
      TrimScratch(keys);
      TrimScratch(dots);
      TrimScratch(w);
    });
  }
  if (failed) return Status::Internal("engine: global KV entries could not be dequantised");
  SwaPush(layer, st, p0, n, a, row0);
  return Status::Ok();
}

Status Engine::AttnGather(int layer, const SequenceState& st, int64_t p0, int n, const AttnRows& a,
                          int64_t row0, const Runtime& rt, AttnKeyRows* out) const {
  const EngineConfig& c = config_;
  const int hd = c.head_dim, W = c.sliding_window;
  const LayerMode mode = c.layer_modes[layer];
  const SwaRing& ring = st.swa[layer];
  const size_t sb = hd / 32;
  out->src = nullptr;
  out->swa_data.clear();
  out->swa_scales.clear();
  out->keys.clear();
  out->key_off.assign(1, 0);
  // The rows' selected entries once each (sorted); the device reads them from its copy of src.
  std::vector<int32_t>& sel = out->sel;
  sel.clear();
  if (mode != LayerMode::kSwaOnly) {
    for (int t = 0; t < n; ++t) sel.insert(sel.end(), rt.topk[t].begin(), rt.topk[t].end());
    std::sort(sel.begin(), sel.end());
    sel.erase(std::unique(sel.begin(), sel.end()), sel.end());
    if (!sel.empty() && (sel.front() < 0 || sel.back() >= rt.src->entries()))
      return Status::Internal("engine: a selected entry outside the global KV");
    if (!sel.empty()) out->src = rt.src;
  }
  // The window's entries once each, oldest first: the ring's before p0, these rows' from p0;
  // those from kept on are in the ring once the rows are pushed (named by slot), the older ones
  // the push overwrites are copied (prefill rows more than W before the pass's end).
  const int64_t s_lo = std::max<int64_t>(std::max(ring.valid_from, p0 - W + 1), 0);
  const int64_t kept = p0 + n - W;
  out->ring = nullptr;
  out->ring_end = p0 + n;
  std::vector<int32_t>& swa_of = out->swa_of;  // position s_lo + i -> SWA entry, or -1
  swa_of.assign(static_cast<size_t>(p0 + n - s_lo), -1);
  out->swa_slot.clear();
  int32_t n_swa = 0, n_copied = 0;
  for (int64_t s = s_lo; s < p0 + n; ++s) {
    if (s < p0 && !ring.Has(s)) continue;
    swa_of[s - s_lo] = n_swa++;
    if (s >= kept) {
      out->swa_slot.push_back(static_cast<int32_t>(s % W));
      out->ring = &ring;
      continue;
    }
    const uint8_t* data =
        s >= p0 ? a.kv_data.data() + (row0 + s - p0) * hd : ring.data.data() + (s % W) * hd;
    const uint8_t* scales =
        s >= p0 ? a.kv_scales.data() + (row0 + s - p0) * sb : ring.scales.data() + (s % W) * sb;
    out->swa_data.insert(out->swa_data.end(), data, data + hd);
    out->swa_scales.insert(out->swa_scales.end(), scales, scales + sb);
    out->swa_slot.push_back(~n_copied++);
  }
  // Each row's list, in AttnCore's gather order: its selected entries (a global entry j as j's
  // place in sel), then its window (SWA entry j as ~j, told apart when the pass's lists merge).
  for (int t = 0; t < n; ++t) {
    if (mode != LayerMode::kSwaOnly) {
      for (int32_t e : rt.topk[t]) {
        out->keys.push_back(
            static_cast<int32_t>(std::lower_bound(sel.begin(), sel.end(), e) - sel.begin()));
      }
    }
    const int64_t p = p0 + t;
    const int64_t lo = std::max<int64_t>(std::max(ring.valid_from, p - W + 1), 0);
    for (int64_t s = lo; s <= p; ++s) {
      const int32_t j = swa_of[s - s_lo];
      if (j >= 0) out->keys.push_back(~j);
    }
    out->key_off.push_back(static_cast<int32_t>(out->keys.size()));
  }
  return Status::Ok();
}

Status Engine::AttnCoreKeys(int layer, SequenceState* st, int64_t p0, int n, const AttnRows& a,
                            int64_t row0, Runtime* rt, ThreadPool* pool, AttnKeyRows* keys) {
  KVTIER_RETURN_IF_ERROR(AttnSelect(layer, st, p0, n, nullptr, a, row0, rt, pool));
  KVTIER_RETURN_IF_ERROR(AttnGather(layer, *st, p0, n, a, row0, *rt, keys));
  SwaPush(layer, st, p0, n, a, row0);
  return Status::Ok();
}

Status Engine::DeviceAttention(int layer, std::span<AttnKeyRows* const> seqs, const AttnRows& a) {
  const EngineConfig& c = config_;
  const int hd = c.head_dim;
  if (static_cast<int>(a.rope_c.size()) % (c.qk_rope_head_dim / 2) != 0 ||
      layers_[layer].rope->size() * 2 != static_cast<size_t>(c.qk_rope_head_dim))
    return Status::Internal("engine: rotations of another width than the device's");
  // The sequences' tables side by side (every global entry, then every SWA entry) and their
  // lists one after another, each index moved to its sequence's place; each sequence's cache and
  // ring named for the device's mirrors of them.
  thread_local AttnKeyRows merged_slot;
  thread_local std::vector<device::DeviceLayers::KvSource> sources_slot;
  thread_local std::vector<device::DeviceLayers::SwaSource> rings_slot;
  thread_local std::vector<int32_t> main_source_slot, main_entry_slot;
  thread_local std::vector<int32_t> swa_source_slot, swa_entry_slot;
  AttnKeyRows& m = merged_slot;
  std::vector<device::DeviceLayers::KvSource>& sources = sources_slot;
  std::vector<device::DeviceLayers::SwaSource>& rings = rings_slot;
  std::vector<int32_t>& main_source = main_source_slot;
  std::vector<int32_t>& main_entry = main_entry_slot;
  std::vector<int32_t>& swa_source = swa_source_slot;
  std::vector<int32_t>& swa_entry = swa_entry_slot;
  sources.clear();
  rings.clear();
  main_source.clear();
  main_entry.clear();
  swa_source.clear();
  swa_entry.clear();
  m.swa_data.clear();
  m.swa_scales.clear();
  m.keys.clear();
  m.key_off.assign(1, 0);
  int64_t main = 0, swa = 0;
  int32_t nr = 0;  // rings read by slot; the uploaded entries are source nr
  for (const AttnKeyRows* r : seqs) {
    main += static_cast<int64_t>(r->sel.size());
    swa += static_cast<int64_t>(r->swa_slot.size());
    nr += r->ring != nullptr ? 1 : 0;
  }
  int64_t main_at = 0, swa_at = 0;
  int32_t uploaded_at = 0;
  const bool one = seqs.size() == 1;  // a single sequence's uploaded bytes are read in place
  for (const AttnKeyRows* r : seqs) {
    if (r->src != nullptr) {
      const KvSourceCache& k = *r->src;
      device::DeviceLayers::KvSource s;
      s.id = &k;
      s.epoch = k.epoch.value();
      s.parent_epoch = k.parent_epoch;
      s.parent_keep = k.parent_keep;
      s.entries = k.entries();
      s.data = k.main_data.data();
      s.scales = k.main_scales.data();
      for (int32_t e : r->sel) {
        main_source.push_back(static_cast<int32_t>(sources.size()));
        main_entry.push_back(e);
      }
      sources.push_back(s);
    }
    const int32_t ring = static_cast<int32_t>(rings.size());
    for (int32_t j : r->swa_slot) {
      swa_source.push_back(j >= 0 ? ring : nr);
      swa_entry.push_back(j >= 0 ? j : uploaded_at + ~j);
    }
    if (r->ring != nullptr) {
      const SwaRing& w = *r->ring;
      if (w.end != r->ring_end)
        return Status::Internal(
            "engine: the SWA ring was not pushed before the device's attention");
      device::DeviceLayers::SwaSource s;
      s.id = &w;
      s.slots = w.window;
      s.stamps = w.stamps.data();
      s.data = w.data.data();
      s.scales = w.scales.data();
      rings.push_back(s);
    }
    if (!one) {
      m.swa_data.insert(m.swa_data.end(), r->swa_data.begin(), r->swa_data.end());
      m.swa_scales.insert(m.swa_scales.end(), r->swa_scales.begin(), r->swa_scales.end());
    }
    const int32_t base = static_cast<int32_t>(m.keys.size());
    for (int32_t key : r->keys) {
      m.keys.push_back(static_cast<int32_t>(key >= 0 ? main_at + key : main + swa_at + ~key));
    }
    for (size_t t = 1; t < r->key_off.size(); ++t) m.key_off.push_back(base + r->key_off[t]);
    main_at += static_cast<int64_t>(r->sel.size());
    swa_at += static_cast<int64_t>(r->swa_slot.size());
    uploaded_at += static_cast<int32_t>(r->swa_data.size() / hd);
  }
  device::DeviceLayers::AttentionKeys k;
  k.sources = sources;
  k.main_source = main_source.data();
  k.main_entry = main_entry.data();
  k.main = main;
  k.rings = rings;
  k.swa_source = swa_source.data();
  k.swa_entry = swa_entry.data();
  k.swa = swa;
  const AttnKeyRows& up = one ? *seqs[0] : m;
  k.swa_data = up.swa_data.data();
  k.swa_scales = up.swa_scales.data();
  k.uploaded = uploaded_at;
  k.keys = m.keys.data();
  k.key_off = m.key_off.data();
  k.rope_c = a.rope_c.data();
  k.rope_s = a.rope_s.data();
  const Status s = device_->Attention(layer, k);
  TrimKeyRows(m);
  for (auto* v : {&main_source, &main_entry, &swa_source, &swa_entry}) TrimScratch(*v);
  return s;
}

void Engine::TrimKeyRows(AttnKeyRows& r) {
  for (auto* v : {&r.swa_data, &r.swa_scales}) TrimScratch(*v);
  for (auto* v : {&r.sel, &r.swa_slot, &r.swa_of, &r.keys, &r.key_off}) TrimScratch(*v);
}

void Engine::AttnOutput(int layer, int n, const float* o, float* out) {
  // Grouped output projection: wo_a is block-diagonal over o_groups, then wo_b.
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim;
  const int G = c.o_groups, ol = c.o_lora_rank, gin = (H / G) * hd;
  // Every group's inputs gathered (og: group-major), then all groups' products in one call.
  thread_local std::vector<float> oa_slot, tmp_slot, og_slot;
  thread_local std::vector<MatMulPart> parts;
  Scratch<float> oa(oa_slot, static_cast<size_t>(n) * G * ol),
      tmp(tmp_slot, static_cast<size_t>(n) * G * ol), og(og_slot, static_cast<size_t>(n) * G * gin);
  parts.resize(G);
  for (int g = 0; g < G; ++g) {
    float* ogg = og.data() + static_cast<int64_t>(g) * n * gin;
    for (int t = 0; t < n; ++t) {
      std::memcpy(ogg + static_cast<int64_t>(t) * gin,
                  o + static_cast<int64_t>(t) * H * hd + static_cast<int64_t>(g) * gin, gin * 4);
    }
    parts[g] = {ogg,
                n,
                gin,
                lw.wo_a + static_cast<int64_t>(g) * ol * gin,
                lw.pk_wo_a[g],
                ol,
                tmp.data() + static_cast<int64_t>(g) * n * ol};
  }
  MmMany(pool_.get(), parts);
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < n; ++t) {
      std::memcpy(oa.data() + (static_cast<int64_t>(t) * G + g) * ol,
                  tmp.data() + (static_cast<int64_t>(g) * n + t) * ol, ol * 4);
    }
  }
  Mm(pool_.get(), oa.data(), n, G * ol, lw.wo_b, lw.pk_wo_b, D, out);
}

Status Engine::Attention(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                         Runtime* rt, float* out) {
  const EngineConfig& c = config_;
  thread_local std::vector<int64_t> pos_slot;
  thread_local std::vector<float> o_slot;
  Scratch<int64_t> pos(pos_slot, static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) pos[t] = p0 + t;
  AttnRows& a = attn_rows_;
  KVTIER_RETURN_IF_ERROR(AttnProject(layer, n, xa, pos.data(), &a));
  Scratch<float> o(o_slot, static_cast<size_t>(n) * c.num_attention_heads * c.head_dim);
  KVTIER_RETURN_IF_ERROR(AttnCore(layer, st, p0, n, xa, a, 0, rt, pool_.get(), o.data()));
  AttnOutput(layer, n, o.data(), out);
  return Status::Ok();
}

}  // namespace kvtier::engine
