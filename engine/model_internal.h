// Engine internals shared by the files of its implementation (model.cc: the passes over the
// layers; model_attention.cc: attention, compressor and indexer; model_moe.cc: the routed
// experts; model_engram.cc: Engram rows and their prefetch; model_batch.cc: ForwardBatch). Not
// part of the engine's interface: include it only from those files.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "engine/device/layers.h"
#include "engine/model.h"
#include "engine/scratch.h"
#include "kernels/quant.h"

namespace kvtier::engine {
namespace model_detail {

using kernels::Backend;
using kernels::QuantFormat;

// The engine quantises with the vectorised codec too (AVX2 where the CPU has it; bit-identical to
// the scalar reference, tests/kernels): the SWA entries and index queries of every token pass
// through it, a few percent of a decode step with the reference.
inline constexpr Backend kQuantBackend = Backend::kAuto;
// Attention and the indexer dequantise the global KV they read with the vectorised codec
// (AVX2 where the CPU has it; bit-identical to the reference, tests/kernels).
inline constexpr Backend kCacheReadBackend = Backend::kAuto;
// Smallest attention core (multiply-adds over every head and key of the call's rows) whose heads
// are split over the threads when there are fewer rows than threads: below it (the trained
// miniature's two heads of 64 against ~32 keys) the hand-off costs more than the heads.
inline constexpr int64_t kAttnSplitMinWork = int64_t{1} << 14;
// Index key rows dequantised per pass of the indexer (a 4 KiB buffer at index_head_dim 32).
inline constexpr int64_t kIndexRowsPerPass = 32;
// Query rows of one sequence the indexer scores together (SelectTopk): each block of index keys
// is dequantised once for all of them and multiplied with every row's heads in one HcMixDots.
inline constexpr int kIndexQueryRowsPerGroup = 16;
// Pools of at most this many threads run a sublayer's mHC mixes beside the sublayer whatever
// the rows (MixesBesideSublayer): the mixes are about an eighth of a pass, so one worker
// finishes them within the others' share of the sublayer up to ~7 threads; 4 leaves room for
// other models.
inline constexpr int kSideMixThreadsMax = 4;

// A sublayer's mHC mixes (mixes over rows [0, n)) and the sublayer itself (returns Status);
// returns the sublayer's status once both are done. The mixes read only the stream and the
// sublayer only the normed input, so the mixes may run on a worker beside the sublayer (the
// worker then joins the sublayer's sections) instead of in a section of their own: with fewer
// rows than threads (decode), and at any row count in pools of up to kSideMixThreadsMax
// threads (one section and its barrier less per sublayer: a 6-token verify pass 26 % faster
// with 2 threads, a 256-token one 5 %). With more threads, many rows' mixes on one worker
// could outlast the sublayer's share of the others. `sublayer` is a template parameter, not a
// std::function, so that a call allocates nothing.
template <typename Sublayer>
Status MixesBesideSublayer(ThreadPool* pool, int n, RangeFn mixes, Sublayer&& sublayer) {
  const std::function<void()> all_mixes = [&] { mixes(0, n); };  // two references: no allocation
  std::optional<ThreadPool::Side> side;
  const int threads = pool->threads();
  if (threads > 1 && (n < threads || threads <= kSideMixThreadsMax)) {
    side.emplace(pool, &all_mixes);
  } else {
    pool->ParallelFor(n, mixes);
  }
  return sublayer();  // the side task is joined before the return completes
}

// fn(begin, end) over [0, n): split over `pool`, or in one call on the caller when pool is null
// (a loop already running inside a pool's worker).
inline void ForRange(ThreadPool* pool, int64_t n, RangeFn fn) {
  if (n <= 0) return;
  if (pool == nullptr) {
    fn(0, n);
  } else {
    pool->ParallelFor(n, fn);
  }
}

// The layers [l_begin, l_end) of a pass of n rows on the device layers (engine/device/layers.h),
// for Engine::RunLayers and ForwardBatch alike: the residual x and pre (host rows) uploaded,
// then per layer the Engram rows applied here to the residual (engram(l) on x, downloaded and
// uploaded around it), the residual and the attention sublayer's normed input downloaded into x
// and xn only where wants_capture(l) (then record(l) reads them), heads(l) running the attention
// heads on the device (Engine::DeviceAttnProject, the caches' part here, then
// Engine::DeviceAttention), and the rest of the layer on the device. The pass's residual stays on
// the device (the caller reads it back or runs the head there).
template <typename Engram, typename WantsCapture, typename Record, typename Heads>
Status RunDeviceLayers(device::DeviceLayers& dev, const EngineConfig& c, int n, int l_begin,
                       int l_end, float* x, const float* pre, float* xn, Engram&& engram,
                       WantsCapture&& wants_capture, Record&& record, Heads&& heads) {
  KVTIER_RETURN_IF_ERROR(dev.Begin(n, x, pre));
  for (int l = l_begin; l < l_end; ++l) {
    bool x_current = false;  // x here holds the device's residual
    if (c.IsEngramLayer(l)) {
      KVTIER_RETURN_IF_ERROR(dev.Residual(x));
      KVTIER_RETURN_IF_ERROR(engram(l));
      KVTIER_RETURN_IF_ERROR(dev.SetResidual(x));
      x_current = true;
    }
    const bool capture = wants_capture(l);
    KVTIER_RETURN_IF_ERROR(dev.AttentionInput(l, capture ? xn : nullptr));
    if (capture) {
      if (!x_current) KVTIER_RETURN_IF_ERROR(dev.Residual(x));
      record(l);
    }
    KVTIER_RETURN_IF_ERROR(heads(l));
    KVTIER_RETURN_IF_ERROR(dev.AttentionOutput(l, nullptr));
    KVTIER_RETURN_IF_ERROR(dev.Ffn(l));
  }
  return Status::Ok();
}

}  // namespace model_detail

struct Engine::LayerWeights {
  const float* hc_fn[2] = {};
  const float* hc_scale[2] = {};
  const float* hc_base[2] = {};
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float *wq_a = nullptr, *q_norm = nullptr, *wq_b = nullptr, *wkv = nullptr,
              *kv_norm = nullptr, *wo_a = nullptr, *wo_b = nullptr, *sink = nullptr;
  const float *c_wkv = nullptr, *c_wgate = nullptr, *c_norm = nullptr;
  const float *i_wk = nullptr, *i_kn_w = nullptr, *i_kn_b = nullptr;
  const float *i_wq_b = nullptr, *i_wproj = nullptr;
  const float *gate = nullptr, *gate_bias = nullptr;
  std::vector<const float*> w1, w2, w3;
  const float *s_w1 = nullptr, *s_w2 = nullptr, *s_w3 = nullptr;
  const float *e_wkv = nullptr, *e_qn = nullptr, *e_kn = nullptr;
  const std::vector<double>* rope = nullptr;
  // The packed copies of the matrices above (PackMatMulWeights; null where a matrix is absent or
  // the scalar kernel runs), handed to MatMul so that no call looks its weight up.
  const PackedMatrix *pk_wq_a = nullptr, *pk_wq_b = nullptr, *pk_wkv = nullptr, *pk_wo_b = nullptr;
  const PackedMatrix *pk_c_wkv = nullptr, *pk_c_wgate = nullptr, *pk_i_wk = nullptr,
                     *pk_i_wq_b = nullptr, *pk_i_wproj = nullptr;
  const PackedMatrix *pk_gate = nullptr, *pk_s_w1 = nullptr, *pk_s_w2 = nullptr, *pk_s_w3 = nullptr,
                     *pk_e_wkv = nullptr;
  std::vector<const PackedMatrix*> pk_wo_a;  // per output group
  std::vector<const PackedMatrix*> pk_w1, pk_w2, pk_w3;
};

// SharedAttentionRuntime (reference §2): one slot each, written by sources before the
// consumers in later layers read them, within one pass over the layers.
struct Engine::Runtime {
  KvSourceCache* src = nullptr;
  std::vector<std::vector<int32_t>> topk;        // per batch token: entry indices
  std::vector<std::vector<uint8_t>> candidates;  // per batch token: block mask; empty: none
  // SelectTopk's scratch, reused layer to layer: a row group's index scores (row-major, one row
  // per query row over the group's visible entries), their head weights and the key runs scored.
  std::vector<float> index_scores, index_head_weights;
  std::vector<int64_t> index_runs;

  // A pass's start: as a new Runtime, keeping the scratch's capacity (the passes of a thread
  // reuse one Runtime; a scratch that grew past kScratchKeepBytes is released).
  void Reset() {
    src = nullptr;
    ClearTopk();
    ClearCandidates();
    TrimScratch(index_scores);
    TrimScratch(index_head_weights);
    TrimScratch(index_runs);
  }
  // topk and candidates as n empty lists. Their lists' buffers are kept in spares between
  // uses (a decode step would otherwise allocate them anew in every indexed layer).
  void ResizeTopk(size_t n) { Refill(topk, spare_topk, n); }
  void ResizeCandidates(size_t n) { Refill(candidates, spare_candidates, n); }
  void ClearTopk() { Refill(topk, spare_topk, 0); }
  void ClearCandidates() { Refill(candidates, spare_candidates, 0); }

 private:
  std::vector<std::vector<int32_t>> spare_topk;
  std::vector<std::vector<uint8_t>> spare_candidates;

  template <typename T>
  static void Refill(std::vector<std::vector<T>>& lists, std::vector<std::vector<T>>& spare,
                     size_t n) {
    for (auto& v : lists) {
      v.clear();
      if (v.capacity() * sizeof(T) <= kScratchKeepBytes) spare.push_back(std::move(v));
    }
    lists.clear();
    lists.resize(n);
    // The last list given back is the last taken: a pass of the same n gives each row the
    // buffer it had, sized for it.
    for (size_t i = n; i-- > 0 && !spare.empty();) {
      lists[i] = std::move(spare.back());
      spare.pop_back();
    }
  }
};

// For a thread's EngramRowBatch kept across passes: releases buffers a long prefill chunk grew
// past kScratchKeepBytes.
inline void TrimEngramRows(EngramRowBatch& b) {
  TrimScratch(b.row_ids);
  TrimScratch(b.data);
  TrimScratch(b.scales);
}

// One batch of Engram rows the engine requested (own step or prefetch) and still holds.
struct Engine::EngramPending {
  int slot = 0;
  int64_t p0 = 0;  // positions [p0, p0 + n)
  int n = 0;
  EngramRowBatch batch;   // row_ids: n x columns, token-major
  bool prefetch = false;  // requested ahead of its step
  bool waited = false;    // Wait() returned (status, batch.data/scales valid)
  Status status;
  bool discarded = false;  // no step will use it; waited (in order) and dropped
  bool used = false;       // served a step
  int64_t claim_end = -1;  // end of the running step that claimed it; -1: none
  int64_t end() const { return p0 + n; }

  // As a new one for (slot, p0, n), keeping the batch's buffers' capacity (Engine reuses
  // waited and dropped batches: engram_free_).
  void Reset(int slot_in, int64_t p0_in, int n_in) {
    slot = slot_in;
    p0 = p0_in;
    n = n_in;
    batch.slot = slot_in;
    batch.row_ids.clear();
    batch.data.clear();
    batch.scales.clear();
    batch.stalled = false;
    prefetch = waited = discarded = used = false;
    status = Status::Ok();
    claim_end = -1;
  }
  size_t BufferBytes() const {
    return batch.row_ids.capacity() * sizeof(int64_t) + batch.data.capacity() +
           batch.scales.capacity();
  }
};
}  // namespace kvtier::engine
