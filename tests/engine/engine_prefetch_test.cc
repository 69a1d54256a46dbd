// Chunked prefill and Engram prefetch across steps (engine side of issue 8): chunked ==
// unchunked bit for bit for Forward, PrefillCed and ReplayTail; the lookahead requests chunk
// i+1's rows before chunk i waits (and not with lookahead 0); hints are consumed, stale or
// mismatched hints are discarded and never used for other tokens; bounded prefetch and a
// source that refuses (Rejected) never hang and never change results; a failed read names the
// Engram layer.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::BitEqual;
using testutil::MiniConfig;
using testutil::MiniWeights;
using testutil::Prompt;

constexpr int kV = 512;
constexpr size_t kCols = 12;  // 3 orders x 4 heads on the miniature

std::unique_ptr<Engine> Make(const EngineConfig& config, std::shared_ptr<const ModelWeights> w,
                             int chunk, int lookahead, EngramRowSource* rows = nullptr,
                             int prefetch_max = 16) {
  EngineOptions o;
  o.threads = 2;
  o.engram_rows = rows;
  o.prefill_chunk_tokens = chunk;
  o.engram_lookahead_chunks = lookahead;
  o.engram_prefetch_batches_max = prefetch_max;
  auto e = Engine::Create(config, std::move(w), o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

std::unique_ptr<Engine> Make(int chunk, int lookahead, EngramRowSource* rows = nullptr,
                             int prefetch_max = 16) {
  return Make(MiniConfig(), MiniWeights(), chunk, lookahead, rows, prefetch_max);
}

// Serves rows from the weights' tables and records every call: "R<slot>@<first position>" for
// a Request, "W<slot>@<first position>" for a Wait (position = row index / columns of the
// batch's first row is not recoverable, so the test tags batches by the order of Requests).
// Optional faults: a per-slot bound on outstanding requests (Rejected over it) and failing
// Waits.
class RecordingSource : public EngramRowSource {
 public:
  RecordingSource(const EngineConfig& config, const ModelWeights& w) {
    std::vector<LocalEngramRowSource::Table> tables;
    for (int l : config.engram_layer_ids) {
      const std::string p = "layers." + std::to_string(l) + ".engram.";
      const Tensor* d = w.Find(p + "table");
      const Tensor* s = w.Find(p + "table_scale");
      tables.push_back({d->bytes.data(), s->bytes.data(), d->shape[0]});
    }
    outstanding_.assign(tables.size(), 0);
    local_ = std::make_unique<LocalEngramRowSource>(config.engram_head_dim, std::move(tables));
  }
  int row_dim() const override { return local_->row_dim(); }
  Status Request(EngramRowBatch* b) override {
    if (per_slot_max > 0 && outstanding_[b->slot] >= per_slot_max) {
      ++rejected;
      return Status::Rejected("test source: slot bound");
    }
    const int id = next_id_++;
    ids_[b] = id;
    events.push_back("R" + std::to_string(b->slot) + "#" + std::to_string(id));
    rows_requested.push_back(b->row_ids.size());
    ++outstanding_[b->slot];
    return local_->Request(b);
  }
  Status Wait(EngramRowBatch* b) override {
    const int id = ids_.at(b);
    ids_.erase(b);
    --outstanding_[b->slot];
    events.push_back("W" + std::to_string(b->slot) + "#" + std::to_string(id));
    ++waits;
    if (fail_waits > 0) {
      --fail_waits;
      b->data.clear();
      b->scales.clear();
      return Status::IOError("test source: row server gone");
    }
    Status s = local_->Wait(b);
    b->stalled = true;  // count every wait as late: the engine's stall counter must follow
    return s;
  }
  int requests() const { return next_id_; }

  std::vector<std::string> events;
  std::vector<size_t> rows_requested;
  int waits = 0;
  int rejected = 0;
  int per_slot_max = 0;  // 0: unbounded
  int fail_waits = 0;    // the next this-many Waits fail

 private:
  std::unique_ptr<LocalEngramRowSource> local_;
  std::map<const EngramRowBatch*, int> ids_;
  std::vector<int> outstanding_;
  int next_id_ = 0;
};

// prompt (all logits) + decode steps; every logit concatenated.
Status RunSeq(Engine* e, const std::vector<int32_t>& prompt, int decode_steps,
              std::vector<float>* all) {
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  KVTIER_RETURN_IF_ERROR(e->Forward(&st, prompt, true, &logits));
  all->insert(all->end(), logits.begin(), logits.end());
  const auto next = Prompt(decode_steps, 77);
  for (int i = 0; i < decode_steps; ++i) {
    KVTIER_RETURN_IF_ERROR(e->Decode(&st, next[i], &logits));
    all->insert(all->end(), logits.begin(), logits.end());
  }
  return Status::Ok();
}

TEST(EnginePrefetch, OptionsAreBounded) {
  EngineOptions o;
  o.engram_lookahead_chunks = kMaxEngramLookaheadChunks + 1;
  EXPECT_TRUE(Engine::Create(MiniConfig(), MiniWeights(), o).status().IsInvalidArgument());
  o = EngineOptions{};
  o.prefill_chunk_tokens = 0;
  EXPECT_TRUE(Engine::Create(MiniConfig(), MiniWeights(), o).status().IsInvalidArgument());
  o = EngineOptions{};
  o.engram_prefetch_batches_max = 0;
  EXPECT_TRUE(Engine::Create(MiniConfig(), MiniWeights(), o).status().IsInvalidArgument());
}

TEST(EnginePrefetch, ChunkedEqualsUnchunkedForForwardCedAndReplay) {
  const auto prompt = Prompt(45, 3);  // chunks of 8: 5 full + 5 tokens
  auto whole = Make(256, 1);
  std::vector<float> ref;
  ASSERT_TRUE(RunSeq(whole.get(), prompt, 3, &ref).ok());
  SequenceState ced_ref = whole->NewSequence();
  std::vector<float> ced_ref_logits, replay_ref;
  ASSERT_TRUE(whole->PrefillCed(&ced_ref, prompt, &ced_ref_logits).ok());
  SequenceState full = whole->NewSequence();
  std::vector<float> tmp;
  ASSERT_TRUE(whole->Forward(&full, prompt, false, &tmp).ok());
  SequenceState rep_ref = full;
  ASSERT_TRUE(whole->ReplayTail(&rep_ref, &replay_ref).ok());
  for (int chunk : {3, 8}) {
    for (int la : {0, 1, 2}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + " lookahead " + std::to_string(la));
      auto e = Make(chunk, la);
      std::vector<float> got;
      ASSERT_TRUE(RunSeq(e.get(), prompt, 3, &got).ok());
      ASSERT_EQ(got.size(), ref.size());
      EXPECT_TRUE(BitEqual(got.data(), ref.data(), ref.size()));
      SequenceState ced = e->NewSequence();
      std::vector<float> ced_logits;
      ASSERT_TRUE(e->PrefillCed(&ced, prompt, &ced_logits).ok());
      EXPECT_TRUE(BitEqual(ced_logits.data(), ced_ref_logits.data(), kV));
      ASSERT_EQ(ced.kv.size(), ced_ref.kv.size());
      for (size_t k = 0; k < ced.kv.size(); ++k) {
        EXPECT_EQ(ced.kv[k].main_data, ced_ref.kv[k].main_data);
        EXPECT_EQ(ced.kv[k].index_data, ced_ref.kv[k].index_data);
      }
      SequenceState rep = full;
      std::vector<float> replay;
      ASSERT_TRUE(e->ReplayTail(&rep, &replay).ok());
      EXPECT_TRUE(BitEqual(replay.data(), replay_ref.data(), kV));
      // Every prefetch is accounted for once the calls are over.
      const EngineStats& s = e->stats();
      EXPECT_EQ(s.engram_prefetches_issued,
                s.engram_prefetches_consumed + s.engram_prefetches_discarded);
      if (la == 0) {
        EXPECT_EQ(s.engram_prefetches_issued, 0u);
      } else {
        EXPECT_GT(s.engram_prefetches_consumed, 0u);
      }
    }
  }
}

// Lookahead 1 over 3 chunks: chunk i+1's Requests come before chunk i's Waits.
TEST(EnginePrefetch, LookaheadRequestsTheNextChunkBeforeThisChunkWaits) {
  const auto prompt = Prompt(24, 5);
  std::vector<float> ref;
  {
    auto plain = Make(256, 0);
    ASSERT_TRUE(RunSeq(plain.get(), prompt, 0, &ref).ok());
  }
  using V = std::vector<std::string>;
  const std::map<int, V> expected = {
      {0, V{"R0#0", "R1#1", "W0#0", "W1#1", "R0#2", "R1#3", "W0#2", "W1#3", "R0#4", "R1#5", "W0#4",
            "W1#5"}},
      {1, V{"R0#0", "R1#1", "R0#2", "R1#3", "W0#0", "W1#1", "R0#4", "R1#5", "W0#2", "W1#3", "W0#4",
            "W1#5"}},
      {2, V{"R0#0", "R1#1", "R0#2", "R1#3", "R0#4", "R1#5", "W0#0", "W1#1", "W0#2", "W1#3", "W0#4",
            "W1#5"}},
  };
  for (const auto& [la, want] : expected) {
    SCOPED_TRACE("lookahead " + std::to_string(la));
    RecordingSource rows(MiniConfig(), *MiniWeights());
    auto e = Make(8, la, &rows);
    std::vector<float> got;
    ASSERT_TRUE(RunSeq(e.get(), prompt, 0, &got).ok());
    EXPECT_TRUE(BitEqual(got.data(), ref.data(), ref.size()));
    EXPECT_EQ(rows.events, want);
    EXPECT_EQ(rows.rows_requested, std::vector<size_t>(6, 8 * kCols));
    const EngineStats& s = e->stats();
    EXPECT_EQ(s.engram_requests, 6u);
    EXPECT_EQ(s.engram_prefetches_issued, la == 0 ? 0u : 4u);
    EXPECT_EQ(s.engram_prefetches_consumed, la == 0 ? 0u : 4u);
    EXPECT_EQ(s.engram_waits, 6u);
    EXPECT_EQ(s.engram_stalls, 6u);  // the source marks every wait late
  }
}

// Engram layers in the decoder too (6: encoder, 8: the decoder's KV source, which CED's
// compressor pass and its decoder pass both read, 11: decoder): CED stays exact when chunked
// with lookahead, and the decoder's rows are requested while the encoder still runs.
TEST(EnginePrefetch, CedWithEngramInEncoderAndDecoder) {
  EngineConfig c = MiniConfig();
  c.engram_layer_ids = {6, 8, 11};
  ASSERT_TRUE(c.Validate().ok());
  auto w = InitWeights(c, 11);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  auto whole = Make(c, weights, 256, 0);
  const auto short_prompt = Prompt(14, 8);  // n <= W: CED == Forward
  const auto long_prompt = Prompt(37, 9);
  std::vector<float> fwd, ced_short_ref, ced_long_ref;
  SequenceState a = whole->NewSequence(), b = whole->NewSequence(), b2 = whole->NewSequence();
  ASSERT_TRUE(whole->Forward(&a, short_prompt, false, &fwd).ok());
  ASSERT_TRUE(whole->PrefillCed(&b, short_prompt, &ced_short_ref).ok());
  EXPECT_TRUE(BitEqual(fwd.data(), ced_short_ref.data(), kV));
  ASSERT_TRUE(whole->PrefillCed(&b2, long_prompt, &ced_long_ref).ok());
  for (int la : {0, 1, 2}) {
    SCOPED_TRACE("lookahead " + std::to_string(la));
    RecordingSource rows(c, *weights);
    auto e = Make(c, weights, 4, la, &rows);
    SequenceState s1 = e->NewSequence(), s2 = e->NewSequence();
    std::vector<float> l1, l2;
    ASSERT_TRUE(e->PrefillCed(&s1, short_prompt, &l1).ok());
    EXPECT_TRUE(BitEqual(l1.data(), fwd.data(), kV));
    rows.events.clear();
    ASSERT_TRUE(e->PrefillCed(&s2, long_prompt, &l2).ok());
    EXPECT_TRUE(BitEqual(l2.data(), ced_long_ref.data(), kV));
    const std::vector<std::string> events = rows.events;  // the long CED's calls only
    // Decode after CED equals decode after the unchunked CED.
    std::vector<float> d_ref, d_got;
    ASSERT_TRUE(whole->Decode(&b2, 40, &d_ref).ok());
    ASSERT_TRUE(e->Decode(&s2, 40, &d_got).ok());
    EXPECT_TRUE(BitEqual(d_ref.data(), d_got.data(), kV));
    b2 = whole->NewSequence();
    ASSERT_TRUE(whole->PrefillCed(&b2, long_prompt, &ced_long_ref).ok());
    // The decoder slot (2: layer 11) is requested before the encoder's last wait when the
    // lookahead reaches across the phases; with 0 it comes after every encoder wait.
    size_t first_r2 = events.size(), last_w0 = 0;
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i].rfind("R2", 0) == 0) first_r2 = std::min(first_r2, i);
      if (events[i].rfind("W0", 0) == 0) last_w0 = i;
    }
    ASSERT_LT(first_r2, events.size());
    if (la == 0) {
      EXPECT_GT(first_r2, last_w0);
    }
    // 10 compressor chunks (slot 1: layer 8) lie between the encoder and the decoder pass; a
    // lookahead of 1-2 steps requests the decoder's rows before the compressor's last waits.
    int w1_before = 0;
    for (size_t i = 0; i < first_r2; ++i) w1_before += events[i].rfind("W1", 0) == 0;
    if (la == 0) {
      EXPECT_EQ(w1_before, 10);
    } else {
      EXPECT_EQ(w1_before, 10 - la);
      EXPECT_GT(e->stats().engram_prefetches_consumed, 0u);
    }
    // Nothing the lookahead requested is dropped, although the decoder pass goes back to
    // positions the compressor pass already passed (layer 8 is read by both).
    EXPECT_EQ(e->stats().engram_prefetches_discarded, 0u);
    EXPECT_EQ(e->stats().engram_prefetches_issued, e->stats().engram_prefetches_consumed);
  }
}

TEST(EnginePrefetch, HintsAreConsumedByDecodeAndForward) {
  const auto prompt = Prompt(20, 12);
  const auto next = Prompt(6, 13);
  std::vector<float> ref;
  {
    auto plain = Make(256, 0);
    SequenceState st = plain->NewSequence();
    std::vector<float> l;
    ASSERT_TRUE(plain->Forward(&st, prompt, false, &l).ok());
    ref = l;
    for (int32_t t : next) {
      ASSERT_TRUE(plain->Decode(&st, t, &l).ok());
      ref.insert(ref.end(), l.begin(), l.end());
    }
  }
  RecordingSource rows(MiniConfig(), *MiniWeights());
  auto e = Make(8, 1, &rows);
  SequenceState st = e->NewSequence();
  // A prompt streaming in: hinted before it runs (3 chunks of 8 on the Forward's grid).
  ASSERT_TRUE(e->PrefetchEngram(st, prompt).ok());
  EXPECT_EQ(rows.requests(), 6);
  std::vector<float> got, l;
  ASSERT_TRUE(e->Forward(&st, prompt, false, &l).ok());
  EXPECT_EQ(rows.requests(), 6);  // nothing requested again
  got = l;
  // Accepted tokens hinted early: one batch per slot serves all six decode steps.
  ASSERT_TRUE(e->PrefetchEngram(st, next).ok());
  EXPECT_EQ(rows.requests(), 8);
  for (int32_t t : next) {
    ASSERT_TRUE(e->Decode(&st, t, &l).ok());
    got.insert(got.end(), l.begin(), l.end());
  }
  EXPECT_EQ(rows.requests(), 8);
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_TRUE(BitEqual(got.data(), ref.data(), ref.size()));
  const EngineStats& s = e->stats();
  EXPECT_EQ(s.engram_prefetches_issued, 8u);
  EXPECT_EQ(s.engram_prefetches_consumed, 8u);
  EXPECT_EQ(s.engram_prefetches_discarded, 0u);
}

TEST(EnginePrefetch, MismatchedAndStaleHintsAreDiscardedNeverUsed) {
  const auto prompt = Prompt(10, 21);
  std::vector<float> ref;
  auto plain = Make(256, 0);
  SequenceState ps = plain->NewSequence();
  std::vector<float> l;
  ASSERT_TRUE(plain->Forward(&ps, prompt, false, &l).ok());
  ASSERT_TRUE(plain->Decode(&ps, 50, &l).ok());
  ref = l;
  ASSERT_TRUE(plain->Decode(&ps, 60, &l).ok());
  ref.insert(ref.end(), l.begin(), l.end());

  RecordingSource rows(MiniConfig(), *MiniWeights());
  auto e = Make(8, 1, &rows);
  SequenceState st = e->NewSequence();
  ASSERT_TRUE(e->Forward(&st, prompt, false, &l).ok());
  // Hinted tokens 51, 52 that are never accepted: 50 runs instead (same position, other
  // n-grams); the hint's rows must not be used.
  const std::vector<int32_t> wrong = {51, 52};
  ASSERT_TRUE(e->PrefetchEngram(st, wrong).ok());
  // A hint for a position the sequence will already have passed.
  ASSERT_TRUE(e->Decode(&st, 50, &l).ok());
  std::vector<float> got = l;
  ASSERT_TRUE(e->Decode(&st, 60, &l).ok());
  got.insert(got.end(), l.begin(), l.end());
  EXPECT_TRUE(BitEqual(got.data(), ref.data(), ref.size()));
  const EngineStats& s = e->stats();
  EXPECT_EQ(s.engram_prefetches_issued, 2u + 2u);  // lookahead of the 10-token prompt + hint
  EXPECT_EQ(s.engram_prefetches_discarded, 2u);    // the hint, both slots
  EXPECT_EQ(s.engram_prefetches_issued,
            s.engram_prefetches_consumed + s.engram_prefetches_discarded);
  // Every request was waited for (a discarded batch too: the source may write into it).
  EXPECT_EQ(rows.waits, rows.requests());
}

TEST(EnginePrefetch, BoundsRefusePrefetchesWithoutChangingResultsOrHanging) {
  const auto prompt = Prompt(40, 31);
  std::vector<float> ref;
  {
    auto plain = Make(256, 0);
    ASSERT_TRUE(RunSeq(plain.get(), prompt, 2, &ref).ok());
  }
  // The engine's bound: at most 2 prefetched batches per slot; a 5-chunk hint is refused
  // after the first two chunks.
  {
    RecordingSource rows(MiniConfig(), *MiniWeights());
    auto e = Make(8, 2, &rows, /*prefetch_max=*/2);
    SequenceState st = e->NewSequence();
    Status h = e->PrefetchEngram(st, prompt);
    EXPECT_TRUE(h.IsRejected()) << h.ToString();
    EXPECT_NE(h.message().find("after 16 tokens"), std::string::npos) << h.ToString();
    std::vector<float> got, l;
    ASSERT_TRUE(e->Forward(&st, prompt, true, &l).ok());
    got = l;
    const auto next = Prompt(2, 77);
    for (int32_t t : next) {
      ASSERT_TRUE(e->Decode(&st, t, &l).ok());
      got.insert(got.end(), l.begin(), l.end());
    }
    EXPECT_TRUE(BitEqual(got.data(), ref.data(), ref.size()));
    EXPECT_GT(e->stats().engram_prefetches_rejected, 0u);
  }
  // The source's bound: one outstanding request per slot. Every lookahead prefetch is
  // Rejected by the source; each chunk then requests its own rows.
  {
    RecordingSource rows(MiniConfig(), *MiniWeights());
    rows.per_slot_max = 1;
    auto e = Make(8, 2, &rows);
    std::vector<float> got;
    ASSERT_TRUE(RunSeq(e.get(), prompt, 2, &got).ok());
    EXPECT_TRUE(BitEqual(got.data(), ref.data(), ref.size()));
    EXPECT_GT(rows.rejected, 0);
    EXPECT_EQ(e->stats().engram_prefetches_rejected, static_cast<uint64_t>(rows.rejected));
    // Two outstanding per slot: the next chunk is prefetched, the one after is refused.
    RecordingSource rows2(MiniConfig(), *MiniWeights());
    rows2.per_slot_max = 2;
    auto e2 = Make(8, 2, &rows2);
    ASSERT_TRUE(e2->PrefetchEngram(e2->NewSequence(), Prompt(3, 1)).ok());  // holds one slot
    std::vector<float> got2;
    ASSERT_TRUE(RunSeq(e2.get(), prompt, 2, &got2).ok());
    EXPECT_TRUE(BitEqual(got2.data(), ref.data(), ref.size()));
  }
}

TEST(EnginePrefetch, FailedReadNamesTheLayerAndFailedPrefetchIsAskedAgain) {
  const auto prompt = Prompt(24, 41);
  std::vector<float> ref;
  {
    auto plain = Make(256, 0);
    ASSERT_TRUE(RunSeq(plain.get(), prompt, 0, &ref).ok());
  }
  // The first wait (chunk 0's own read, slot 0) fails: the step stops, naming layer 1.
  {
    RecordingSource rows(MiniConfig(), *MiniWeights());
    rows.fail_waits = 1;
    auto e = Make(8, 1, &rows);
    SequenceState st = e->NewSequence();
    std::vector<float> l;
    Status s = e->Forward(&st, prompt, false, &l);
    ASSERT_TRUE(s.IsIOError()) << s.ToString();
    EXPECT_NE(s.message().find("engram layer 1 (slot 0), positions [0, 8)"), std::string::npos)
        << s.ToString();
    EXPECT_TRUE(l.empty());
  }
  // A prefetched read that failed is requested once more as the step's own read.
  {
    RecordingSource rows(MiniConfig(), *MiniWeights());
    auto e = Make(8, 1, &rows);
    SequenceState st = e->NewSequence();
    ASSERT_TRUE(e->PrefetchEngram(st, prompt).ok());  // 6 prefetches
    rows.fail_waits = 1;                              // chunk 0, slot 0
    std::vector<float> l;
    Status s = e->Forward(&st, prompt, true, &l);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(BitEqual(l.data(), ref.data(), ref.size()));
    EXPECT_EQ(e->stats().engram_prefetches_failed, 1u);
    EXPECT_EQ(rows.requests(), 7);
  }
  // Every read fails (the prefetch and the read asked again): the error names the layer.
  {
    RecordingSource rows(MiniConfig(), *MiniWeights());
    auto e = Make(8, 1, &rows);
    SequenceState st = e->NewSequence();
    ASSERT_TRUE(e->PrefetchEngram(st, prompt).ok());
    rows.fail_waits = 1000;
    std::vector<float> l;
    Status s = e->Forward(&st, prompt, true, &l);
    ASSERT_TRUE(s.IsIOError()) << s.ToString();
    EXPECT_NE(s.message().find("engram layer 1 (slot 0), positions [0, 8)"), std::string::npos)
        << s.ToString();
    EXPECT_EQ(e->stats().engram_prefetches_failed, 1u);
    EXPECT_TRUE(l.empty());
  }
}

}  // namespace
}  // namespace kvtier::engine
