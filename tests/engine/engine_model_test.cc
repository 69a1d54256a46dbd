// The miniature model end to end: exactness of the caches, CED, the candidate pool, mHC,
// determinism across thread counts, state export/import.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "engine/state_io.h"
#include "engine_test_util.h"
#include "kernels/quant.h"

namespace kvtier::engine {
namespace {

using testutil::Argmax;
using testutil::BitEqual;
using testutil::MakeEngine;
using testutil::MiniConfig;
using testutil::Prompt;

constexpr int kV = 512;

// Greedy-decodes `steps` tokens after `prefill_logits`; returns the generated tokens and each
// step's logits (row i predicts generated token i).
void Greedy(Engine* e, SequenceState* st, std::vector<float> prefill_logits, int steps,
            std::vector<int32_t>* gen, std::vector<std::vector<float>>* rows) {
  std::vector<float> logits = std::move(prefill_logits);
  for (int i = 0; i < steps; ++i) {
    rows->push_back(logits);
    const int32_t tok = Argmax(logits.data(), kV);
    gen->push_back(tok);
    if (i + 1 < steps) {
      ASSERT_TRUE(e->Decode(st, tok, &logits).ok());
    }
  }
}

// Full forward over prompt + gen[0..k-1]: row P-1+i must equal decode step i.
void ExpectMatchesFullForward(Engine* e, const std::vector<int32_t>& prompt,
                              const std::vector<int32_t>& gen,
                              const std::vector<std::vector<float>>& rows) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end() - 1);
  SequenceState st = e->NewSequence();
  std::vector<float> full;
  ASSERT_TRUE(e->Forward(&st, all, true, &full).ok());
  for (size_t i = 0; i < rows.size(); ++i) {
    const float* row = full.data() + (prompt.size() - 1 + i) * kV;
    EXPECT_TRUE(BitEqual(row, rows[i].data(), kV)) << "generated token " << i;
  }
}

TEST(EngineModel, DecodeAfterFullPrefillEqualsFullForwardExactly) {
  auto e = MakeEngine();
  // 21 tokens: longer than W (16) and odd, so a compressor group is held back in kv_state.
  const auto prompt = Prompt(21);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, prompt, false, &logits).ok());
  std::vector<int32_t> gen;
  std::vector<std::vector<float>> rows;
  Greedy(e.get(), &st, logits, 6, &gen, &rows);
  ExpectMatchesFullForward(e.get(), prompt, gen, rows);
  for (float v : rows[0]) ASSERT_TRUE(std::isfinite(v));
}

TEST(EngineModel, ChunkedPrefillEqualsOneShot) {
  auto e = MakeEngine();
  const auto prompt = Prompt(23, 5);
  SequenceState a = e->NewSequence(), b = e->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(e->Forward(&a, prompt, false, &la).ok());
  ASSERT_TRUE(e->Forward(&b, std::span(prompt).first(9), false, &lb).ok());
  ASSERT_TRUE(e->Forward(&b, std::span(prompt).subspan(9), false, &lb).ok());
  EXPECT_TRUE(BitEqual(la.data(), lb.data(), kV));
}

TEST(EngineModel, CedPrefillEqualsFullForwardUpToW) {
  auto e = MakeEngine();
  for (int n : {1, 7, 16}) {
    SCOPED_TRACE(n);
    const auto prompt = Prompt(n, 11);
    SequenceState full = e->NewSequence(), ced = e->NewSequence();
    std::vector<float> lf, lc;
    ASSERT_TRUE(e->Forward(&full, prompt, false, &lf).ok());
    ASSERT_TRUE(e->PrefillCed(&ced, prompt, &lc).ok());
    EXPECT_TRUE(BitEqual(lf.data(), lc.data(), kV));
    if (n == 7) {
      std::vector<int32_t> gen;
      std::vector<std::vector<float>> rows;
      Greedy(e.get(), &ced, lc, 5, &gen, &rows);
      ExpectMatchesFullForward(e.get(), prompt, gen, rows);
    }
  }
}

// CED extend of an appended turn. A turn of at most W tokens goes through the decoder whole,
// continuing its rings: equal to the full forward over the same state (the model notes' CED
// exactness, §1), and to the full forward of the whole text while it is at most W tokens. A
// longer turn replays only its last W tokens in the decoder: equal to CED prefill of the whole
// text. Global KV equals the full forward's in every case; decoding continues identically.
TEST(EngineModel, CedExtendEqualsForwardUpToWAndCedPrefillOfTheWholeText) {
  auto e = MakeEngine();
  const auto a = Prompt(37, 5);
  std::vector<float> la;
  // Up to W: equal to Forward over the same state.
  for (int k : {1, 9, 16}) {
    SCOPED_TRACE(k);
    const auto b = Prompt(k, 40 + k);
    SequenceState fwd = e->NewSequence(), ext = e->NewSequence();
    ASSERT_TRUE(e->PrefillCed(&fwd, a, &la).ok());
    ASSERT_TRUE(e->PrefillCed(&ext, a, &la).ok());
    std::vector<float> lf, lx;
    ASSERT_TRUE(e->Forward(&fwd, b, false, &lf).ok());
    ASSERT_TRUE(e->ExtendCed(&ext, b, &lx).ok());
    EXPECT_TRUE(BitEqual(lf.data(), lx.data(), kV));
    EXPECT_EQ(ext.swa[8].valid_from, fwd.swa[8].valid_from);  // the rings continued
    ASSERT_TRUE(e->Decode(&fwd, 9, &lf).ok());
    ASSERT_TRUE(e->Decode(&ext, 9, &lx).ok());
    EXPECT_TRUE(BitEqual(lf.data(), lx.data(), kV));
  }
  // A whole text of at most W tokens: equal to the full forward from position 0.
  {
    const auto t = Prompt(14, 8);
    SequenceState full = e->NewSequence(), ext = e->NewSequence();
    std::vector<float> lf, lx;
    ASSERT_TRUE(e->Forward(&full, t, false, &lf).ok());
    ASSERT_TRUE(e->ExtendCed(&ext, std::span(t).first(6), &lx).ok());
    ASSERT_TRUE(e->ExtendCed(&ext, std::span(t).subspan(6), &lx).ok());
    EXPECT_TRUE(BitEqual(lf.data(), lx.data(), kV));
  }
  // Longer than W: equal to CED prefill of the whole text, global KV equal to the full forward.
  for (int k : {17, 45}) {
    SCOPED_TRACE(k);
    const auto b = Prompt(k, 60 + k);
    std::vector<int32_t> whole(a);
    whole.insert(whole.end(), b.begin(), b.end());
    SequenceState ced = e->NewSequence(), ext = e->NewSequence(), full = e->NewSequence();
    std::vector<float> lc, lx, lf;
    ASSERT_TRUE(e->PrefillCed(&ced, whole, &lc).ok());
    ASSERT_TRUE(e->PrefillCed(&ext, a, &la).ok());
    ASSERT_TRUE(e->ExtendCed(&ext, b, &lx).ok());
    ASSERT_TRUE(e->Forward(&full, whole, false, &lf).ok());
    EXPECT_TRUE(BitEqual(lc.data(), lx.data(), kV));
    EXPECT_EQ(ext.swa[8].valid_from, static_cast<int64_t>(whole.size()) - 16);
    for (size_t s = 0; s < full.kv.size(); ++s) {
      EXPECT_EQ(ext.kv[s].main_data, full.kv[s].main_data);
      EXPECT_EQ(ext.kv[s].index_data, full.kv[s].index_data);
      EXPECT_EQ(ext.kv[s].kv_state, full.kv[s].kv_state);
    }
    ASSERT_TRUE(e->Decode(&ced, 11, &lc).ok());
    ASSERT_TRUE(e->Decode(&ext, 11, &lx).ok());
    EXPECT_TRUE(BitEqual(lc.data(), lx.data(), kV));
  }
}

TEST(EngineModel, CedGlobalKvEqualsFullForwardForAnyLength) {
  auto e = MakeEngine();
  const auto prompt = Prompt(45, 3);  // > W and odd
  SequenceState full = e->NewSequence(), ced = e->NewSequence();
  std::vector<float> lf, lc;
  ASSERT_TRUE(e->Forward(&full, prompt, false, &lf).ok());
  ASSERT_TRUE(e->PrefillCed(&ced, prompt, &lc).ok());
  ASSERT_EQ(full.kv.size(), 4u);
  for (size_t s = 0; s < full.kv.size(); ++s) {
    SCOPED_TRACE(full.kv[s].layer);
    EXPECT_EQ(full.kv[s].consumed, 45);
    EXPECT_EQ(full.kv[s].entries(), 45 / full.kv[s].ratio);
    EXPECT_EQ(full.kv[s].main_data, ced.kv[s].main_data);
    EXPECT_EQ(full.kv[s].main_scales, ced.kv[s].main_scales);
    EXPECT_EQ(full.kv[s].index_data, ced.kv[s].index_data);
    EXPECT_EQ(full.kv[s].index_scales, ced.kv[s].index_scales);
    EXPECT_EQ(full.kv[s].kv_state, ced.kv[s].kv_state);  // the held-back partial group
  }
  // The decoder ran only over the last W tokens: its rings start at the replay start.
  EXPECT_EQ(ced.swa[8].valid_from, 45 - 16);
  EXPECT_EQ(ced.swa[7].valid_from, 0);
  // Decoding continues from the CED state.
  std::vector<float> next;
  ASSERT_TRUE(e->Decode(&ced, Argmax(lc.data(), kV), &next).ok());
  for (float v : next) ASSERT_TRUE(std::isfinite(v));
}

TEST(EngineModel, CandidatePoolCoversEveryPositionUpTo512SoReindexIsAFullTopK) {
  auto with_pool = MakeEngine(2, true);
  auto without = MakeEngine(2, false);
  const auto prompt = Prompt(100, 9);
  StepTrace trace;
  with_pool->set_trace(&trace);
  SequenceState a = with_pool->NewSequence(), b = without->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(with_pool->Forward(&a, prompt, true, &la).ok());
  ASSERT_TRUE(without->Forward(&b, prompt, true, &lb).ok());
  ASSERT_EQ(trace.candidate_visible.size(), 100u);
  for (size_t t = 0; t < 100; ++t) {
    EXPECT_EQ(trace.candidate_visible[t], static_cast<int64_t>(t + 1));  // ratio 1 source
    EXPECT_EQ(trace.candidate_pool[t], trace.candidate_visible[t]);
  }
  EXPECT_TRUE(BitEqual(la.data(), lb.data(), la.size()));
  // Reindex layers select min(16, visible) entries in position order, ties to lowest index.
  for (int layer : {10, 12, 14}) {
    const auto& sel = trace.topk[layer];
    ASSERT_EQ(sel.size(), 100u);
    for (size_t t = 0; t < 100; ++t) {
      ASSERT_EQ(sel[t].size(), std::min<size_t>(16, t + 1));
      EXPECT_TRUE(std::is_sorted(sel[t].begin(), sel[t].end()));
    }
  }
  // Reuse layers reuse the previous selection.
  EXPECT_EQ(trace.topk[11], trace.topk[10]);
  // The index picks different entries for different queries (not just the first 16).
  std::set<std::vector<int32_t>> distinct(trace.topk[10].begin() + 40, trace.topk[10].end());
  EXPECT_GT(distinct.size(), 10u);
}

TEST(EngineModel, MhcCombIsDoublyStochasticInEverySublayer) {
  auto e = MakeEngine();
  StepTrace trace;
  e->set_trace(&trace);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, Prompt(12), false, &logits).ok());
  ASSERT_EQ(trace.comb.size(), 32u);
  for (const auto& sub : trace.comb) {
    ASSERT_EQ(sub.size(), 12u);
    for (const auto& comb : sub) {
      for (int i = 0; i < 4; ++i) {
        float rs = 0, cs = 0;
        for (int j = 0; j < 4; ++j) {
          rs += comb[i * 4 + j];
          cs += comb[j * 4 + i];
        }
        EXPECT_NEAR(rs, 1.0f, 1e-5);
        EXPECT_NEAR(cs, 1.0f, 1e-5);
      }
    }
  }
}

TEST(EngineModel, IdenticalAcrossRunsAndThreadCounts) {
  const auto prompt = Prompt(30, 4);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3, 1}) {
    auto e = MakeEngine(threads);
    SequenceState st = e->NewSequence();
    std::vector<float> logits, all;
    ASSERT_TRUE(e->PrefillCed(&st, prompt, &logits).ok());
    all = logits;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(e->Decode(&st, Argmax(logits.data(), kV), &logits).ok());
      all.insert(all.end(), logits.begin(), logits.end());
    }
    results.push_back(all);
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_TRUE(BitEqual(results[0].data(), results[i].data(), results[0].size())) << i;
  }
}

// A verify pass (6 rows of one sequence) over a context whose index keys span several blocks of
// the indexer (its rows score each block together, the blocks split over the threads) gives the
// same bits with 1, 2 and 3 threads, and each of its rows equals a Decode of that token.
TEST(EngineModel, VerifyPassOverManyIndexBlocksIsIdenticalAcrossThreadCounts) {
  const auto prompt = Prompt(72, 5);
  const auto block = Prompt(6, 6);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    auto e = MakeEngine(threads);
    SequenceState st = e->NewSequence();
    std::vector<float> logits, all;
    ASSERT_TRUE(e->Forward(&st, prompt, false, &logits).ok());
    SequenceState single = st;
    ASSERT_TRUE(e->Forward(&st, block, true, &all).ok());
    for (size_t i = 0; i < block.size(); ++i) {
      ASSERT_TRUE(e->Decode(&single, block[i], &logits).ok());
      EXPECT_TRUE(BitEqual(logits.data(), all.data() + i * kV, kV))
          << "threads " << threads << " row " << i;
    }
    results.push_back(all);
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_TRUE(BitEqual(results[0].data(), results[i].data(), results[0].size())) << i;
  }
}

// A decode step with 2 and 3 threads hands sections to the workers (the attention heads among
// them) and with 1 thread none; the logits are the same bits either way (above).
TEST(EngineModel, DecodeHandsSectionsToWorkersOnlyWithThreads) {
  const auto prompt = Prompt(20, 5);
  for (int threads : {1, 2, 3}) {
    auto e = MakeEngine(threads);
    SequenceState st = e->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(e->PrefillCed(&st, prompt, &logits).ok());
    const int64_t before = e->pool_dispatches();
    ASSERT_TRUE(e->Decode(&st, Argmax(logits.data(), kV), &logits).ok());
    const int64_t step = e->pool_dispatches() - before;
    if (threads == 1) {
      EXPECT_EQ(step, 0);
    } else {
      EXPECT_GE(step, 16) << "threads " << threads;  // at least the 16 layers' attention heads
    }
  }
}

TEST(EngineModel, SensibleInitialScales) {
  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, Prompt(24, 2), true, &logits).ok());
  double sum = 0, sq = 0;
  for (float v : logits) {
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  const double mean = sum / logits.size();
  const double sd = std::sqrt(sq / logits.size() - mean * mean);
  EXPECT_GT(sd, 0.05);
  EXPECT_LT(sd, 50.0);
  // Different positions predict different tokens (the network is not collapsed).
  std::set<int32_t> argmaxes;
  for (int t = 0; t < 24; ++t) argmaxes.insert(Argmax(logits.data() + t * kV, kV));
  EXPECT_GT(argmaxes.size(), 3u);
  // Router: several experts in use, none taking every token. Engram gates: not saturated.
  StepTrace trace;
  e->set_trace(&trace);
  SequenceState st2 = e->NewSequence();
  ASSERT_TRUE(e->Forward(&st2, Prompt(48, 6), false, &logits).ok());
  for (int l = 0; l < 16; ++l) {
    int used = 0;
    int64_t most = 0;
    for (int64_t c : trace.expert_tokens[l]) {
      used += c > 0;
      most = std::max(most, c);
    }
    EXPECT_GE(used, 6) << "layer " << l;
    EXPECT_LT(most, 48) << "layer " << l;
  }
  ASSERT_EQ(trace.engram_gates.size(), 2u);
  for (const auto& g : trace.engram_gates) {
    ASSERT_EQ(g.size(), 48u * 4);
    float lo = 1, hi = 0;
    for (float v : g) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    EXPECT_GT(lo, 0.01f);
    EXPECT_LT(hi, 0.99f);
    EXPECT_GT(hi - lo, 0.05f);  // gates respond to the input
  }
  // SWA entries are stored in FP8 and the global KV in FP4: nonzero scales, values in range.
  for (const KvSourceCache& k : st.kv) {
    std::vector<float> v(static_cast<size_t>(k.entries()) * k.head_dim);
    ASSERT_TRUE(kernels::Dequantize(kernels::QuantFormat::kFp4E4M3x16, k.main_data.data(),
                                    k.main_scales.data(), k.entries(), k.head_dim, v.data())
                    .ok());
    for (float x : v) ASSERT_LT(std::fabs(x), 100.0f);
  }
}

// A row source that records what the engine asks for and serves from the weights' tables:
// the plug point of a remote prefetching source.
class RecordingRowSource : public EngramRowSource {
 public:
  explicit RecordingRowSource(const ModelWeights& w) {
    std::vector<LocalEngramRowSource::Table> tables;
    for (int l : {1, 6}) {
      const std::string p = "layers." + std::to_string(l) + ".engram.";
      const Tensor* d = w.Find(p + "table");
      const Tensor* s = w.Find(p + "table_scale");
      tables.push_back({d->bytes.data(), s->bytes.data(), d->shape[0]});
    }
    local_ = std::make_unique<LocalEngramRowSource>(32, std::move(tables));
  }
  int row_dim() const override { return 32; }
  Status Request(EngramRowBatch* b) override {
    requested.push_back({b->slot, b->row_ids.size()});
    events.push_back("R" + std::to_string(b->slot));
    return local_->Request(b);
  }
  Status Wait(EngramRowBatch* b) override {
    ++waits;
    events.push_back("W" + std::to_string(b->slot));
    return local_->Wait(b);
  }
  std::vector<std::pair<int, size_t>> requested;
  int waits = 0;
  std::vector<std::string> events;

 private:
  std::unique_ptr<LocalEngramRowSource> local_;
};

TEST(EngineModel, EngramRowsComeThroughThePluggableRowSource) {
  RecordingRowSource rows(*testutil::MiniWeights());
  EngineOptions o;
  o.threads = 2;
  o.engram_rows = &rows;
  auto custom = Engine::Create(MiniConfig(), testutil::MiniWeights(), o);
  ASSERT_TRUE(custom.ok());
  auto plain = MakeEngine();
  const auto prompt = Prompt(9, 31);
  SequenceState a = (*custom)->NewSequence(), b = plain->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE((*custom)->Forward(&a, prompt, false, &la).ok());
  ASSERT_TRUE((*custom)->Decode(&a, 40, &la).ok());
  ASSERT_TRUE(plain->Forward(&b, prompt, false, &lb).ok());
  ASSERT_TRUE(plain->Decode(&b, 40, &lb).ok());
  EXPECT_TRUE(BitEqual(la.data(), lb.data(), kV));
  // Per step, one batch per Engram layer, both requested before the first layer runs:
  // 12 columns (3 orders x 4 heads) per token.
  ASSERT_EQ(rows.requested.size(), 4u);
  EXPECT_EQ(rows.requested[0], std::make_pair(0, size_t{9 * 12}));
  EXPECT_EQ(rows.requested[1], std::make_pair(1, size_t{9 * 12}));
  EXPECT_EQ(rows.requested[2], std::make_pair(0, size_t{12}));
  EXPECT_EQ(rows.waits, 4);
  EXPECT_EQ(rows.events,
            (std::vector<std::string>{"R0", "R1", "W0", "W1", "R0", "R1", "W0", "W1"}));
}

TEST(EngineModel, RejectsBadInput) {
  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  std::vector<int32_t> bad = {5, 512};
  EXPECT_TRUE(e->Forward(&st, bad, false, &logits).IsInvalidArgument());
  EXPECT_TRUE(e->Forward(&st, {}, false, &logits).IsInvalidArgument());
  EXPECT_TRUE(st.tokens.empty());
  ASSERT_TRUE(e->Forward(&st, Prompt(3), false, &logits).ok());
  EXPECT_TRUE(e->PrefillCed(&st, Prompt(3), &logits).IsInvalidArgument());
}

TEST(EngineState, ExportedGlobalKvIs222_5BytesPerToken) {
  auto layout = EngineKvLayout(MiniConfig());
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_DOUBLE_EQ(layout->bytes_per_token, 222.5);
  EXPECT_EQ(layout->bytes_per_unit, 14240u);
  const UnitPayloadLayout pl = UnitPayloadLayout::For(*layout);
  EXPECT_EQ(pl.payload_bytes, 14240u);

  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, Prompt(67, 8), false, &logits).ok());
  EXPECT_EQ(ExportablePages(pl, st), 1);
  auto page = ExportUnitPayload(pl, st, 0);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(page->size(), 14240u);
  EXPECT_DOUBLE_EQ(static_cast<double>(page->size()) / 64, 222.5);
  EXPECT_TRUE(ExportUnitPayload(pl, st, 1).status().IsNotFound());
  // The payload is the stored FP4 bytes: the layer-8 source's first main row is in its region.
  const SourceRegions& s8 = pl.sources.back();
  EXPECT_EQ(s8.layer_id, 8u);
  EXPECT_EQ(0, std::memcmp(page->data() + s8.main_data.offset_bytes, st.kv[3].main_data.data(),
                           s8.main_data.size_bytes));

  // Import into a fresh state, export again: the same bytes; the values are the same FP4.
  SequenceState fresh = e->NewSequence();
  std::vector<int32_t> toks(st.tokens.begin(), st.tokens.begin() + 64);
  ASSERT_TRUE(ImportUnitPayload(pl, *page, toks, &fresh).ok());
  auto again = ExportUnitPayload(pl, fresh, 0);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *page);
  for (size_t s = 0; s < st.kv.size(); ++s) {
    const KvSourceCache &f = fresh.kv[s], &o = st.kv[s];
    ASSERT_EQ(f.entries(), 64 / f.ratio);
    EXPECT_TRUE(std::equal(f.main_data.begin(), f.main_data.end(), o.main_data.begin()));
    EXPECT_TRUE(std::equal(f.index_data.begin(), f.index_data.end(), o.index_data.begin()));
  }
  std::vector<uint8_t> truncated(page->begin(), page->end() - 1);
  SequenceState other = e->NewSequence();
  EXPECT_TRUE(ImportUnitPayload(pl, truncated, toks, &other).IsCorruption());
}

// A CED prefill of `prompt` on a fresh engine, and the unit payload layout of its model.
struct PrefilledForUnits {
  std::unique_ptr<Engine> engine;
  SequenceState st;
  UnitPayloadLayout pl;
};
PrefilledForUnits PrefillForUnits(const std::vector<int32_t>& prompt) {
  PrefilledForUnits p{MakeEngine(), {}, {}};
  p.st = p.engine->NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(p.engine->PrefillCed(&p.st, prompt, &logits).ok());
  auto layout = EngineKvLayout(MiniConfig());
  EXPECT_TRUE(layout.ok());
  if (layout.ok()) p.pl = UnitPayloadLayout::For(*layout);
  return p;
}

TEST(EngineState, EncodedUnitsRoundTripAndAreVerified) {
  const auto prompt = Prompt(128, 14);
  PrefilledForUnits p = PrefillForUnits(prompt);
  Engine* e = p.engine.get();
  const SequenceState& st = p.st;
  const UnitPayloadLayout& pl = p.pl;
  ASSERT_EQ(ExportablePages(pl, st), 2);
  SequenceState back = e->NewSequence();
  for (int64_t page = 0; page < 2; ++page) {
    UnitIdentity id;
    id.model_fingerprint[0] = 0x42;
    id.key[0] = static_cast<uint8_t>(page + 1);
    id.first_token_position = static_cast<uint64_t>(page) * 64;
    auto unit = ExportUnit(pl, id, st, page);
    ASSERT_TRUE(unit.ok()) << unit.status().ToString();
    EXPECT_EQ(unit->size(), kUnitHeaderBytes + 14240);
    std::span<const int32_t> toks(prompt.data() + page * 64, 64);
    UnitDecodeOptions opts;
    opts.expected_key = id.key;
    std::vector<uint8_t> flipped = *unit;
    flipped[kUnitHeaderBytes + 100] ^= 0x10;
    EXPECT_TRUE(ImportUnit(pl, flipped, opts, toks, &back).IsCorruption());
    ASSERT_TRUE(ImportUnit(pl, *unit, opts, toks, &back).ok());
  }
  for (size_t s = 0; s < st.kv.size(); ++s) {
    EXPECT_EQ(back.kv[s].main_data, st.kv[s].main_data);
    EXPECT_EQ(back.kv[s].index_scales, st.kv[s].index_scales);
  }
}

// ReserveKvTokens makes room for the units a restore imports: they append in place (no
// vector moves), ending with capacity equal to the stored bytes; an import that stops short
// gives the rest back with ShrinkKvToFit.
TEST(EngineState, ReservedImportsAppendInPlace) {
  const auto prompt = Prompt(256, 15);
  PrefilledForUnits p = PrefillForUnits(prompt);
  Engine* e = p.engine.get();
  const SequenceState& st = p.st;
  const UnitPayloadLayout& pl = p.pl;
  ASSERT_EQ(ExportablePages(pl, st), 4);
  auto vectors = [](SequenceState& s) {
    std::vector<std::vector<uint8_t>*> v;
    for (KvSourceCache& k : s.kv) {
      for (auto* x : {&k.main_data, &k.main_scales, &k.index_data, &k.index_scales}) v.push_back(x);
    }
    return v;
  };
  for (const int64_t pages : {4, 2}) {
    SequenceState back = e->NewSequence();
    ReserveKvTokens(&back, 256);
    std::vector<const uint8_t*> where;
    for (auto* v : vectors(back)) where.push_back(v->data());
    for (int64_t page = 0; page < pages; ++page) {
      auto payload = ExportUnitPayload(pl, st, page);
      ASSERT_TRUE(payload.ok());
      std::span<const int32_t> toks(prompt.data() + page * 64, 64);
      ASSERT_TRUE(ImportUnitPayload(pl, *payload, toks, &back).ok());
    }
    const auto after = vectors(back);
    for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i]->data(), where[i]) << i;
    if (pages < 4) {
      EXPECT_GT(KvCacheBytes(back).global_kv_bytes, KvCacheBytes(back).stored_bytes);
      ShrinkKvToFit(&back);
    }
    const KvMemory m = KvCacheBytes(back);
    EXPECT_EQ(m.global_kv_bytes, m.stored_bytes) << pages;
    for (size_t s = 0; s < st.kv.size(); ++s) {
      const size_t n = back.kv[s].main_data.size();
      EXPECT_TRUE(std::equal(back.kv[s].main_data.begin(), back.kv[s].main_data.end(),
                             st.kv[s].main_data.begin()));
      EXPECT_EQ(n, st.kv[s].main_data.size() * static_cast<size_t>(pages) / 4) << s;
    }
  }
}

TEST(EngineState, UnitsPlusSwaBlobResumeExactly) {
  auto e = MakeEngine();
  const auto prompt = Prompt(64, 12);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->PrefillCed(&st, prompt, &logits).ok());
  auto layout = EngineKvLayout(MiniConfig());
  ASSERT_TRUE(layout.ok());
  const UnitPayloadLayout pl = UnitPayloadLayout::For(*layout);
  auto page = ExportUnitPayload(pl, st, 0);
  ASSERT_TRUE(page.ok());
  std::vector<uint8_t> blob = ExportSwaRings(st);

  SequenceState resumed = e->NewSequence();
  ASSERT_TRUE(ImportUnitPayload(pl, *page, prompt, &resumed).ok());
  ASSERT_TRUE(ImportSwaRings(blob, &resumed).ok());
  // The import appends the stored FP4 bytes as they are (the engine dequantises what it reads).
  ASSERT_EQ(resumed.kv.size(), st.kv.size());
  for (size_t i = 0; i < st.kv.size(); ++i) {
    EXPECT_EQ(resumed.kv[i].entries(), st.kv[i].entries());
    EXPECT_EQ(resumed.kv[i].main_data, st.kv[i].main_data);
    EXPECT_EQ(resumed.kv[i].main_scales, st.kv[i].main_scales);
    EXPECT_EQ(resumed.kv[i].index_data, st.kv[i].index_data);
    EXPECT_EQ(resumed.kv[i].index_scales, st.kv[i].index_scales);
  }
  ASSERT_EQ(resumed.swa.size(), st.swa.size());
  for (size_t l = 0; l < st.swa.size(); ++l) {
    ASSERT_EQ(resumed.swa[l].values.size(), st.swa[l].values.size());
    EXPECT_TRUE(
        BitEqual(resumed.swa[l].values.data(), st.swa[l].values.data(), st.swa[l].values.size()));
  }
  // Every slot an import writes takes a new stamp (SwaRing's contract: a device's copy of the
  // slot's old bytes must not pass for the new ones), the second import's too.
  std::vector<uint64_t> first;
  for (const SwaRing& r : resumed.swa) {
    for (uint64_t stamp : r.stamps) {
      EXPECT_NE(stamp, 0u);
      first.push_back(stamp);
    }
  }
  ASSERT_TRUE(ImportSwaRings(blob, &resumed).ok());
  size_t at = 0;
  for (const SwaRing& r : resumed.swa) {
    for (uint64_t stamp : r.stamps) EXPECT_NE(stamp, first[at++]);
  }
  const int32_t next = Argmax(logits.data(), kV);
  std::vector<float> a, b;
  ASSERT_TRUE(e->Decode(&st, next, &a).ok());
  ASSERT_TRUE(e->Decode(&resumed, next, &b).ok());
  EXPECT_TRUE(BitEqual(a.data(), b.data(), kV));

  std::vector<uint8_t> damaged = blob;
  damaged[40] ^= 1;
  SequenceState s2 = e->NewSequence();
  ASSERT_TRUE(ImportUnitPayload(pl, *page, prompt, &s2).ok());
  EXPECT_TRUE(ImportSwaRings(damaged, &s2).IsCorruption());
}

TEST(EngineState, BoundedReplayAfterImportReusesGlobalKv) {
  auto e = MakeEngine();
  const auto prompt = Prompt(64, 13);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->PrefillCed(&st, prompt, &logits).ok());
  auto layout = EngineKvLayout(MiniConfig());
  ASSERT_TRUE(layout.ok());
  const UnitPayloadLayout pl = UnitPayloadLayout::For(*layout);
  auto page = ExportUnitPayload(pl, st, 0);
  ASSERT_TRUE(page.ok());
  SequenceState r = e->NewSequence();
  ASSERT_TRUE(ImportUnitPayload(pl, *page, prompt, &r).ok());
  // Without SWA the state cannot be extended until the replay rebuilt it.
  std::vector<float> tmp;
  EXPECT_TRUE(e->Decode(&r, 5, &tmp).IsInvalidArgument());
  std::vector<float> replay_logits;
  ASSERT_TRUE(e->ReplayTail(&r, &replay_logits).ok());
  for (const SwaRing& ring : r.swa) {
    EXPECT_EQ(ring.valid_from, 64 - 16);  // replay_start = hit - min(W, hit)
    EXPECT_EQ(ring.end, 64);
  }
  for (size_t s = 0; s < st.kv.size(); ++s) EXPECT_EQ(r.kv[s].main_data, st.kv[s].main_data);
  ASSERT_TRUE(e->Decode(&r, Argmax(replay_logits.data(), kV), &tmp).ok());
  for (float v : tmp) ASSERT_TRUE(std::isfinite(v));
}

TEST(EngineWeights, SafetensorsRoundTripGivesTheSameModel) {
  const std::string path = ::testing::TempDir() + "/kvtier_engine_weights.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, testutil::MiniWeights()->file).ok());
  auto loaded = LoadWeights(MiniConfig(), path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::remove(path.c_str());
  EngineOptions o;
  o.threads = 2;
  auto e2 =
      Engine::Create(MiniConfig(), std::make_shared<const ModelWeights>(std::move(*loaded)), o);
  ASSERT_TRUE(e2.ok());
  auto e1 = MakeEngine();
  const auto prompt = Prompt(10);
  SequenceState a = e1->NewSequence(), b = (*e2)->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(e1->Forward(&a, prompt, false, &la).ok());
  ASSERT_TRUE((*e2)->Forward(&b, prompt, false, &lb).ok());
  EXPECT_TRUE(BitEqual(la.data(), lb.data(), kV));
  // Init is deterministic per seed and differs across seeds.
  auto again = InitWeights(MiniConfig(), 7);
  auto other = InitWeights(MiniConfig(), 8);
  ASSERT_TRUE(again.ok() && other.ok());
  EXPECT_EQ(again->file.tensors.at("layers.3.attn.wq_b.weight").bytes,
            testutil::MiniWeights()->file.tensors.at("layers.3.attn.wq_b.weight").bytes);
  EXPECT_NE(other->file.tensors.at("layers.3.attn.wq_b.weight").bytes,
            testutil::MiniWeights()->file.tensors.at("layers.3.attn.wq_b.weight").bytes);
}

// The engine keeps the global KV as the FP4 bytes units store (no fp32 copy): per cached token
// its global KV memory is within 1.5x of the stored bytes (the rest, SWA rings and partial
// groups, does not grow with the sequence). Prefill appends a chunk at once and decode one
// entry at a time, the case where std::vector's doubling would reach 2x.
TEST(EngineMemory, GlobalKvWithinBoundOfStoredBytes) {
  auto e = MakeEngine();
  const auto prompt = Prompt(130, 21);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->PrefillCed(&st, prompt, &logits).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e->Decode(&st, 7 + i, &logits).ok());
  const EngineConfig& c = e->config();
  using kernels::QuantFormat;
  const size_t main_row = kernels::DataBytes(QuantFormat::kFp4E4M3x16, c.head_dim) +
                          kernels::ScaleBytes(QuantFormat::kFp4E4M3x16, c.head_dim);
  const size_t index_row = kernels::DataBytes(QuantFormat::kFp4Ue8m0x32, c.index_head_dim) +
                           kernels::ScaleBytes(QuantFormat::kFp4Ue8m0x32, c.index_head_dim);
  size_t stored = 0;
  for (const KvSourceCache& k : st.kv) {
    ASSERT_EQ(k.entries(), 134 / k.ratio);
    stored += static_cast<size_t>(k.entries()) * (main_row + index_row);
  }
  const KvMemory m = KvCacheBytes(st);
  EXPECT_EQ(m.stored_bytes, stored);
  EXPECT_LE(m.global_kv_bytes, stored * 3 / 2);
  // The constant part: W slots per layer (FP8 + ue8m0 + fp32, and the slot's 8-byte stamp) and
  // the partial groups.
  size_t fixed = 0;
  for (const KvSourceCache& k : st.kv) fixed += 2 * static_cast<size_t>(k.ratio) * c.head_dim * 4;
  fixed += static_cast<size_t>(c.num_hidden_layers) * c.sliding_window *
           (c.head_dim * 5 + c.head_dim / 32 + sizeof(uint64_t));
  EXPECT_EQ(m.fixed_bytes, fixed);
}

}  // namespace
}  // namespace kvtier::engine
