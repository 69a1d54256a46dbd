// Session save and resume through the real kvtierd (label e2e): exact restore from the hot
// state, bounded replay against its in-process reference, a daemon restart, a corrupted unit
// on SSD, another tenant, and the never-slower-than-recompute guard.
//
// References (docs/RESUME.md, "Fidelity"):
//   (a) uninterrupted   the original state continues in memory;
//   (b) exact restore   units + hot state; equals (a) bit for bit;
//   (c) bounded replay  units + ReplayTail; equals the "CED prefill with bounded ring rebuild"
//                       of the same tokens (PrefillCed of the hit, ReplayTail, full forward of
//                       the suffix) bit for bit, and (a) when the history fits one window.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "common/checksum.h"
#include "common/key_spec.h"
#include "engine/session.h"
#include "engine/state_io.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/kvtierd_test.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

namespace kt = kvtier::testing;
using testutil::Argmax;
using testutil::MakeEngine;
using testutil::MiniConfig;
using testutil::MiniWeights;
using testutil::Prompt;

// Logits of `steps` greedy steps: row 0 is `logits`, row k the logits after k decodes.
std::vector<std::vector<float>> Continue(Engine* e, SequenceState* st, std::vector<float> logits,
                                         int steps) {
  std::vector<std::vector<float>> rows;
  for (int k = 0; k < steps; ++k) {
    rows.push_back(logits);
    if (k + 1 == steps) break;
    const int32_t next = Argmax(logits.data(), static_cast<int>(logits.size()));
    Status s = e->Decode(st, next, &logits);
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (!s.ok()) break;
  }
  return rows;
}

// Bit-for-bit equality of two logit sequences.
::testing::AssertionResult SameLogits(const std::vector<std::vector<float>>& a,
                                      const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "lengths differ";
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].size() != b[k].size() ||
        std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "logits differ at step " << k;
  }
  return ::testing::AssertionSuccess();
}

// (c)'s reference: CED prefill of the first hit_tokens, bounded ring rebuild (ReplayTail),
// then the full forward over the rest.
std::vector<float> CedWithBoundedRings(Engine* e, std::span<const int32_t> tokens,
                                       size_t hit_tokens, SequenceState* st,
                                       int64_t replay_tokens = kDefaultReplayWindows * 16) {
  std::vector<float> logits;
  *st = e->NewSequence();
  EXPECT_TRUE(e->PrefillCed(st, tokens.first(hit_tokens), &logits).ok());
  EXPECT_TRUE(e->ReplayTail(st, replay_tokens, &logits).ok());
  if (hit_tokens < tokens.size()) {
    EXPECT_TRUE(e->Forward(st, tokens.subspan(hit_tokens), false, &logits).ok());
  }
  return logits;
}

class ResumeTest : public kt::KvtierdTest {
 protected:
  ResumeTest() : KvtierdTest("kvtier_resume") {}
  void SetUp() override {
    KvtierdTest::SetUp();
    engine_ = MakeEngine();
  }
  void StartDaemon(const std::string& extra = "") {
    d_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 33554432\nssd_capacity_bytes = 268435456\n"
        "ssd_segment_bytes = 16777216\n"
        "durability = \"batched\"\ngroup_commit_ms = 5\n" +
        extra);
    ASSERT_TRUE(d_->Start()) << d_->Log();
  }
  std::unique_ptr<daemon::Client> Connect(const std::string& token = "") {
    daemon::ClientOptions o;
    o.socket_path = d_->socket();
    o.token = token;
    o.shm_bytes = 16u << 20;
    auto c = daemon::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  std::unique_ptr<SessionStore> Store(daemon::Client* c, SessionOptions o = {}) {
    auto fp = EngineModelFingerprint(MiniConfig(), *MiniWeights(), o.unit_tokens);
    EXPECT_TRUE(fp.ok());
    auto s = SessionStore::Create(engine_.get(), c, *fp, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  // CED prefill of `tokens` and a save of every whole unit (hot state when page-aligned).
  SequenceState SaveSession(SessionStore* store, std::span<const int32_t> tokens,
                            std::vector<float>* logits) {
    SequenceState st = engine_->NewSequence();
    EXPECT_TRUE(store->Prefill(&st, tokens, logits).ok());
    SaveCursor cursor;
    Status s = store->Save(st, *logits, &cursor);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return st;
  }

  std::unique_ptr<Engine> engine_;
};

// (b): units + hot state restore the session exactly, after a prefill and after a save at an
// interval during generation.
TEST_F(ResumeTest, ExactRestoreEqualsUninterrupted) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  constexpr int kSteps = 64;
  {
    SessionOptions o;
    auto store = Store(c.get(), o);
    const auto tokens = Prompt(128, 21);
    std::vector<float> logits;
    SequenceState a = SaveSession(store.get(), tokens, &logits);
    const auto ref = Continue(engine_.get(), &a, logits, kSteps);

    auto fresh = Store(c.get(), o);  // a new engine process would have no in-memory state
    SequenceState r;
    std::vector<float> rl;
    auto rep = fresh->Resume(tokens, &r, &rl);
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_TRUE(rep->hot_state_restored);
    EXPECT_EQ(rep->units_used, 2);
    EXPECT_EQ(rep->replay_tokens, 0);
    EXPECT_FALSE(rep->recomputed);
    EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, kSteps), ref));
  }
  {
    // Generation with a save every 64 tokens: prefill 100, decode past 128.
    SessionOptions o;
    o.save_interval_tokens = 64;
    auto store = Store(c.get(), o);
    const auto prompt = Prompt(100, 22);
    SequenceState a = engine_->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(store->Prefill(&a, prompt, &logits).ok());
    SaveCursor cursor;
    ASSERT_TRUE(store->Save(a, logits, &cursor).ok());
    EXPECT_EQ(cursor.units_saved, 1);
    while (a.tokens.size() < 128) {
      ASSERT_TRUE(engine_->Decode(&a, Argmax(logits.data(), 512), &logits).ok());
      ASSERT_TRUE(store->MaybeSave(a, logits, &cursor).ok());
    }
    EXPECT_EQ(cursor.units_saved, 2);
    EXPECT_EQ(store->stats().hot_states_put, 2u);  // at 100 (with its tail) and at 128
    const std::vector<int32_t> tokens = a.tokens;
    const auto ref = Continue(engine_.get(), &a, logits, kSteps);
    auto fresh = Store(c.get(), o);
    SequenceState r;
    std::vector<float> rl;
    auto rep = fresh->Resume(tokens, &r, &rl);
    ASSERT_TRUE(rep.ok());
    EXPECT_TRUE(rep->hot_state_restored);
    EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, kSteps), ref));
  }
}

// (b) mid-page: a session that ends 36 tokens past its last whole page keeps that partial
// page's global KV with its hot state, so a resume of it (and of a longer prompt that continues
// it) restores every one of its tokens exactly, without replay; Restore leaves the suffix to
// the caller, whose full forward gives the same logits.
TEST_F(ResumeTest, MidPageHotStateRestoresExactly) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  constexpr int kSteps = 16;
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  auto store = Store(c.get(), o);
  const auto tokens = Prompt(100, 23);
  std::vector<float> logits;
  SequenceState a = SaveSession(store.get(), tokens, &logits);
  EXPECT_EQ(store->stats().hot_states_put, 1u);
  std::vector<int32_t> longer = tokens;
  for (int32_t t : Prompt(20, 24)) longer.push_back(t);
  SequenceState a2 = a;
  std::vector<float> l2;
  ASSERT_TRUE(engine_->Forward(&a2, std::span(longer).subspan(100), false, &l2).ok());
  const auto ref = Continue(engine_.get(), &a, logits, kSteps);
  const auto ref2 = Continue(engine_.get(), &a2, l2, kSteps);

  auto fresh = Store(c.get(), o);
  SequenceState r;
  std::vector<float> rl;
  auto rep = fresh->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_TRUE(rep->hot_state_restored);
  EXPECT_EQ(rep->units_used, 1);
  EXPECT_EQ(rep->hot_tail_tokens, 36);
  EXPECT_EQ(rep->restored_tokens, 100);
  EXPECT_EQ(rep->replay_tokens, 0);
  EXPECT_EQ(rep->suffix_tokens, 0);
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, kSteps), ref));

  // Restore of the longer prompt: the 100 tokens come back exactly, the caller runs the rest.
  SequenceState r2;
  std::vector<float> rl2;
  auto rep2 = fresh->Restore(longer, &r2, &rl2);
  ASSERT_TRUE(rep2.ok()) << rep2.status().ToString();
  EXPECT_TRUE(rep2->hot_state_restored);
  EXPECT_EQ(rep2->restored_tokens, 100);
  EXPECT_EQ(rep2->suffix_tokens, 20);
  ASSERT_EQ(r2.tokens.size(), 100u);
  ASSERT_TRUE(engine_->Forward(&r2, std::span(longer).subspan(100), false, &rl2).ok());
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r2, rl2, kSteps), ref2));

  // A prompt that differs inside the tail finds no hot state for it: the page-aligned
  // boundary has none either, so the rings are replayed and only the whole unit counts.
  std::vector<int32_t> other = tokens;
  other[80] = (other[80] + 1) % 256;
  SequenceState r3;
  std::vector<float> rl3;
  auto rep3 = fresh->Restore(other, &r3, &rl3);
  ASSERT_TRUE(rep3.ok());
  EXPECT_FALSE(rep3->hot_state_restored);
  EXPECT_EQ(rep3->restored_tokens, 64);
  EXPECT_EQ(rep3->replay_tokens, kDefaultReplayWindows * 16);
  EXPECT_EQ(r3.tokens.size(), 64u);
}

// kvtierd's misses over a resume that restores a hot state must be real ones. The resume used
// to ask for the hot state of every tail length 1..63 the prompt allowed and the page-aligned
// one in one GET, so restoring a state 36 tokens past its page (MidPageHotStateRestoresExactly's
// session) counted 36 misses of keys never written (`never_stored`): the operator's hit ratio
// and its alert read them as cache misses. Now the page's hot-state index names the tails kept:
// no miss. Two tails kept past one page (a branch, 20 and 36 tokens, other ids) both restore.
TEST_F(ResumeTest, HotStateRestoreAsksOnlyForKeysThatWereWritten) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  auto store = Store(c.get(), o);
  const auto tokens = Prompt(100, 23);
  std::vector<float> logits;
  SaveSession(store.get(), tokens, &logits);
  const std::vector<int32_t> branch = [&] {  // 84 tokens, other ids from 64 on
    std::vector<int32_t> b(tokens.begin(), tokens.begin() + 84);
    for (int32_t& t : std::span(b).subspan(64)) t = (t + 7) % 256;
    return b;
  }();
  SaveSession(store.get(), branch, &logits);
  EXPECT_EQ(store->stats().hot_states_put, 2u);

  auto misses = [&] {
    auto j = c->StatsJson();
    EXPECT_TRUE(j.ok());
    const nlohmann::json stats = nlohmann::json::parse(*j);
    uint64_t sum = 0;
    for (const auto& [reason, n] : stats.at("misses").items()) sum += n.get<uint64_t>();
    return sum;
  };
  auto fresh = Store(c.get(), o);
  for (const auto* prompt : {&tokens, &branch}) {
    const uint64_t before = misses();
    SequenceState r;
    std::vector<float> rl;
    auto rep = fresh->Resume(*prompt, &r, &rl);
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_TRUE(rep->hot_state_restored);
    EXPECT_EQ(rep->hot_tail_tokens, static_cast<int64_t>(prompt->size()) - 64);
    EXPECT_EQ(rep->replay_tokens, 0);
    EXPECT_EQ(misses(), before) << "a resume that restored everything counted misses";
  }
}

// A page-aligned hot state continues every prompt that extends its page; a tail state only
// those that repeat its tail. Many branches saved past one page (each its own tail state, more
// than the page's index lists) must not push the page-aligned one out of the index: a new
// branch then restores it and replays nothing. The index used to keep only the most recent
// kHotStateIndexEntriesMax states, so after that many branches every new one replayed (found by
// the serving transport benchmark: restores of a long history slowed by its replay). The most
// recent branches still restore their own tails.
TEST_F(ResumeTest, ThePageAlignedHotStateOutlivesTheBranchesPastIt) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  auto store = Store(c.get(), o);
  const auto base = Prompt(128, 29);  // two whole pages: a hot state at the boundary
  std::vector<float> logits;
  SaveSession(store.get(), base, &logits);
  // Branch k: the two pages and 5 tokens of its own past them.
  auto branch = [&](int k) {
    std::vector<int32_t> b = base;
    for (int i = 0; i < 5; ++i) b.push_back((k * 5 + i) % 200 + 20);
    return b;
  };
  constexpr int kBranches = static_cast<int>(kHotStateIndexEntriesMax) + 2;
  for (int k = 0; k < kBranches; ++k) SaveSession(store.get(), branch(k), &logits);
  EXPECT_EQ(store->stats().hot_states_put, static_cast<uint64_t>(kBranches) + 1);

  auto fresh = Store(c.get(), o);
  std::vector<int32_t> other = base;  // a branch never saved
  for (int i = 0; i < 7; ++i) other.push_back(250 - i);
  struct Case {
    std::vector<int32_t> prompt;
    int64_t tail;
  };
  for (const Case& k :
       {Case{other, 0}, Case{branch(kBranches - 1), 5}, Case{branch(kBranches - 2), 5}}) {
    SequenceState r;
    std::vector<float> rl;
    auto rep = fresh->Resume(k.prompt, &r, &rl);
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_TRUE(rep->hot_state_restored) << "tail " << k.tail;
    EXPECT_EQ(rep->hot_tail_tokens, k.tail);
    EXPECT_EQ(rep->replay_tokens, 0) << "tail " << k.tail;
  }
}

// A hot state the daemon returns under another page's key (a daemon bug, or a hostile daemon)
// is refused and the resume replays: session A's blob, PUT under session B's hot-state key
// (same length, same shapes: every check but the binding passes), used to be restored for B as
// an exact restore, so B decoded from A's rings and logits. Now B's resume equals its bounded
// replay reference bit for bit.
TEST_F(ResumeTest, HotStateUnderAnotherKeyIsRefused) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  auto store = Store(c.get(), o);
  const auto a = Prompt(128, 41), b = Prompt(128, 42);
  std::vector<float> logits;
  SaveSession(store.get(), a, &logits);
  SaveSession(store.get(), b, &logits);
  auto fp = EngineModelFingerprint(MiniConfig(), *MiniWeights(), o.unit_tokens);
  ASSERT_TRUE(fp.ok());
  const Digest key_a = SwaBlobKey(SessionChainKeys(*fp, a, o.unit_tokens).back());
  const Digest key_b = SwaBlobKey(SessionChainKeys(*fp, b, o.unit_tokens).back());
  std::vector<uint8_t> blob_a;
  ASSERT_TRUE(c->Get(std::span<const daemon::wire::Key>(&key_a, 1), 0,
                     [&](size_t, const daemon::GetItem& item) {
                       ASSERT_TRUE(item.status.ok()) << item.status.ToString();
                       blob_a.assign(item.value.begin(), item.value.end());
                     })
                  .ok());
  ASSERT_FALSE(blob_a.empty());
  daemon::PutUnit u;
  u.key = key_b;
  u.value = blob_a;
  daemon::PutOptions po;
  po.kind = 1;  // SWA, DRAM only, as Save puts it
  po.allow_ssd = false;
  po.highest_tier = 1;
  po.ttl_ms = o.hot_state_ttl_ms;
  auto put = c->Put(std::span<const daemon::PutUnit>(&u, 1), po);
  ASSERT_TRUE(put.ok() && put->size() == 1 && (*put)[0].ok());

  SequenceState ref_st;
  const auto ref =
      Continue(engine_.get(), &ref_st, CedWithBoundedRings(engine_.get(), b, b.size(), &ref_st), 8);
  auto fresh = Store(c.get(), o);
  SequenceState r;
  std::vector<float> rl;
  auto rep = fresh->Resume(b, &r, &rl);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_EQ(rep->units_used, 2);
  EXPECT_FALSE(rep->hot_state_restored);
  EXPECT_EQ(rep->replay_tokens, kDefaultReplayWindows * 16);
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 8), ref));
}

// (c): bounded replay equals the CED prefill with bounded ring rebuild, bit for bit, with and
// without an uncached suffix.
TEST_F(ResumeTest, BoundedReplayEqualsCedWithBoundedRingRebuild) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.keep_hot_state = false;
  o.guard = GuardMode::kAlwaysFetch;
  auto store = Store(c.get(), o);
  for (auto [n, seed] : {std::pair{128, 31}, std::pair{200, 32}}) {
    SCOPED_TRACE(n);
    const auto tokens = Prompt(n, seed);
    std::vector<float> logits;
    SequenceState a = SaveSession(store.get(), tokens, &logits);
    const size_t hit = (n / 64) * 64;
    SequenceState ref_st;
    const auto ref = Continue(engine_.get(), &ref_st,
                              CedWithBoundedRings(engine_.get(), tokens, hit, &ref_st), 64);
    SequenceState r;
    std::vector<float> rl;
    auto rep = store->Resume(tokens, &r, &rl);
    ASSERT_TRUE(rep.ok());
    EXPECT_FALSE(rep->hot_state_restored);
    EXPECT_EQ(rep->replay_tokens, kDefaultReplayWindows * 16);  // the default, hit >= 2W
    EXPECT_EQ(rep->suffix_tokens, n - static_cast<int64_t>(hit));
    const auto got = Continue(engine_.get(), &r, rl, 64);
    EXPECT_TRUE(SameLogits(got, ref));
    // With history longer than W the rings differ from (a)'s, so the logits do too (the
    // divergence is measured by bench/resume, not asserted).
    const auto uninterrupted = Continue(engine_.get(), &a, logits, 1);
    EXPECT_FALSE(SameLogits({got[0]}, uninterrupted));
  }
}

// SessionOptions::replay_tokens sets the replay length of a resume: R = 4W replays 64 tokens
// and equals the in-process reference with ReplayTail(64); R < W is refused at Create.
TEST_F(ResumeTest, BoundedReplayUsesReplayTokens) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.keep_hot_state = false;
  o.guard = GuardMode::kAlwaysFetch;
  o.replay_tokens = 64;
  auto store = Store(c.get(), o);
  ASSERT_NE(store, nullptr);
  const auto tokens = Prompt(200, 33);
  std::vector<float> logits;
  SaveSession(store.get(), tokens, &logits);
  SequenceState ref_st;
  const auto ref = Continue(engine_.get(), &ref_st,
                            CedWithBoundedRings(engine_.get(), tokens, 192, &ref_st, 64), 16);
  SequenceState r;
  std::vector<float> rl;
  auto rep = store->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->replay_tokens, 64);
  EXPECT_EQ(rep->suffix_tokens, 8);
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 16), ref));

  auto fp = EngineModelFingerprint(MiniConfig(), *MiniWeights(), o.unit_tokens);
  ASSERT_TRUE(fp.ok());
  o.replay_tokens = 15;
  auto low = SessionStore::Create(engine_.get(), c.get(), *fp, o);
  EXPECT_TRUE(low.status().IsInvalidArgument());
  o.replay_tokens = 0;  // the default: kDefaultReplayWindows x W
  auto def = SessionStore::Create(engine_.get(), c.get(), *fp, o);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ((*def)->options().replay_tokens, static_cast<uint64_t>(kDefaultReplayWindows * 16));
}

// (c) = (a) when the whole history fits in one window (units of 8 and 16 tokens, W = 16).
TEST_F(ResumeTest, BoundedReplayEqualsUninterruptedWithinOneWindow) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  for (uint32_t unit : {8u, 16u}) {
    SCOPED_TRACE(unit);
    SessionOptions o;
    o.unit_tokens = unit;
    o.keep_hot_state = false;
    o.guard = GuardMode::kAlwaysFetch;
    auto store = Store(c.get(), o);
    const auto tokens = Prompt(16, 40 + unit);
    std::vector<float> logits;
    SequenceState a = SaveSession(store.get(), tokens, &logits);
    const auto ref = Continue(engine_.get(), &a, logits, 64);
    SequenceState r;
    std::vector<float> rl;
    auto rep = store->Resume(tokens, &r, &rl);
    ASSERT_TRUE(rep.ok());
    EXPECT_EQ(rep->units_used, 16 / unit);
    EXPECT_EQ(rep->replay_tokens, 16);
    EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 64), ref));
  }
}

// A resume after a graceful daemon restart (units from SSD) equals one without the restart.
TEST_F(ResumeTest, ResumeAfterRestartEqualsResumeWithoutRestart) {
  StartDaemon();
  const auto tokens = Prompt(200, 51);
  SessionOptions o;
  o.use_hot_state = false;  // the hot state is DRAM only: compare replay with replay
  o.guard = GuardMode::kAlwaysFetch;
  std::vector<std::vector<float>> before;
  {
    auto c = Connect();
    ASSERT_NE(c, nullptr);
    auto store = Store(c.get(), o);
    std::vector<float> logits;
    SaveSession(store.get(), tokens, &logits);
    SequenceState r;
    std::vector<float> rl;
    auto rep = store->Resume(tokens, &r, &rl);
    ASSERT_TRUE(rep.ok());
    EXPECT_EQ(rep->units_used, 3);
    EXPECT_EQ(rep->units_by_tier[1] + rep->units_by_tier[2], 3);
    before = Continue(engine_.get(), &r, rl, 16);
  }
  ASSERT_EQ(d_->Stop(), 0);
  ASSERT_TRUE(d_->Start());
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  o.use_hot_state = true;  // even if asked, the DRAM-only hot state did not survive
  auto store = Store(c.get(), o);
  SequenceState r;
  std::vector<float> rl;
  auto rep = store->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->units_used, 3);
  EXPECT_EQ(rep->units_by_tier[2], 3);  // SSD
  EXPECT_FALSE(rep->hot_state_restored);
  EXPECT_EQ(rep->replay_tokens, kDefaultReplayWindows * 16);  // hit 192 >= the default 2W
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 16), before));
}

// Flips one payload byte of the unit whose header carries `chain_key` in the daemon's SSD
// segment files (docs/format/ssd.md: a 128-byte record header "KVSR" ... kind at byte 7, then
// the payload = the encoded unit, whose header has the key at offset 48). False if not found.
bool CorruptUnitOnSsd(const std::filesystem::path& data_dir, const Digest& chain_key) {
  for (const auto& f : std::filesystem::recursive_directory_iterator(data_dir)) {
    if (!f.is_regular_file() || f.path().extension() != ".kvs") continue;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::vector<uint8_t> b((std::istreambuf_iterator<char>(io)), std::istreambuf_iterator<char>());
    for (size_t at = 0; at + 128 + kUnitHeaderBytes + 1000 <= b.size(); at += 8) {
      if (std::memcmp(b.data() + at, "KVSR", 4) != 0 || b[at + 7] != 0) continue;
      const uint8_t* unit = b.data() + at + 128;
      if (std::memcmp(unit, "KVTU", 4) != 0 || std::memcmp(unit + 48, chain_key.data(), 32) != 0)
        continue;
      const size_t victim = at + 128 + kUnitHeaderBytes + 1000;
      const char flipped = static_cast<char>(b[victim] ^ 0x5a);
      io.clear();
      io.seekp(static_cast<std::streamoff>(victim));
      io.write(&flipped, 1);
      io.flush();
      return static_cast<bool>(io);
    }
  }
  return false;
}

// A corrupted unit on SSD gives a shorter hit plus recompute, never a wrong output.
TEST_F(ResumeTest, CorruptUnitOnSsdGivesShorterHitNeverWrongOutput) {
  StartDaemon();
  const auto tokens2 = Prompt(256, 61);  // unit 2 will be corrupted
  const auto tokens0 = Prompt(256, 62);  // unit 0 will be corrupted
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  std::vector<std::vector<float>> ref0;
  {
    auto c = Connect();
    ASSERT_NE(c, nullptr);
    auto store = Store(c.get(), o);
    std::vector<float> logits;
    SaveSession(store.get(), tokens2, &logits);
    SequenceState a = SaveSession(store.get(), tokens0, &logits);
    ref0 = Continue(engine_.get(), &a, logits, 16);  // (a): CED of all 256 tokens
  }
  ASSERT_EQ(d_->Stop(), 0);  // graceful: every unit is on SSD
  auto fp = EngineModelFingerprint(MiniConfig(), *MiniWeights(), 64);
  ASSERT_TRUE(fp.ok());
  ASSERT_TRUE(CorruptUnitOnSsd(d_->dir() / "data", SessionChainKeys(*fp, tokens2, 64)[2]));
  ASSERT_TRUE(CorruptUnitOnSsd(d_->dir() / "data", SessionChainKeys(*fp, tokens0, 64)[0]));
  ASSERT_TRUE(d_->Start());
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  auto store = Store(c.get(), o);
  {
    SequenceState r;
    std::vector<float> rl;
    auto rep = store->Resume(tokens2, &r, &rl);
    ASSERT_TRUE(rep.ok());
    EXPECT_EQ(rep->units_used, 2);  // units 0, 1; unit 2 failed verification
    EXPECT_FALSE(rep->recomputed);
    EXPECT_EQ(rep->suffix_tokens, 128);
    SequenceState ref_st;
    const auto ref = Continue(engine_.get(), &ref_st,
                              CedWithBoundedRings(engine_.get(), tokens2, 128, &ref_st), 16);
    EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 16), ref));
  }
  {
    SequenceState r;
    std::vector<float> rl;
    auto rep = store->Resume(tokens0, &r, &rl);
    ASSERT_TRUE(rep.ok());
    EXPECT_EQ(rep->units_used, 0);
    EXPECT_TRUE(rep->recomputed);
    EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 16), ref0));
  }
  EXPECT_GE(store->stats().miss_recompute, 1u);
}

// A fetch reserves the restored global KV once, for the prompt (here 8 whole units): the FP4
// byte vectors end with exactly the stored bytes. Before, they grew by AppendKvBytes' 5/4 steps as
// units arrived, copying what was there at each step (and faulting in fresh memory); after 8
// equal units that leaves about 9.8 units of capacity.
TEST_F(ResumeTest, AFetchReservesTheRestoredKvOnce) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  auto store = Store(c.get(), o);
  const auto tokens = Prompt(512, 71);
  std::vector<float> logits;
  const SequenceState saved = SaveSession(store.get(), tokens, &logits);
  auto fetched = Store(c.get(), o)->Fetch(tokens);
  ASSERT_TRUE(fetched.ok()) << fetched.status().ToString();
  ASSERT_EQ(fetched->report.units_used, 8);
  const KvMemory m = KvCacheBytes(fetched->state);
  EXPECT_EQ(m.global_kv_bytes, m.stored_bytes);
  ASSERT_EQ(fetched->state.kv.size(), saved.kv.size());
  for (size_t i = 0; i < saved.kv.size(); ++i) {
    EXPECT_EQ(fetched->state.kv[i].main_data, saved.kv[i].main_data) << i;
    EXPECT_EQ(fetched->state.kv[i].index_data, saved.kv[i].index_data) << i;
  }
}

// Another tenant's resume of the same tokens misses (and recomputes correctly); the owner hits.
TEST_F(ResumeTest, OtherTenantMisses) {
  std::ofstream(dir_ / "tokens.toml")
      << "[[tenant]]\nname = \"alice\"\nid = 1\ntoken_sha256 = [\"" << TokenSha256Hex("alice-token")
      << "\"]\n[[tenant]]\nname = \"bob\"\nid = 2\ntoken_sha256 = [\""
      << TokenSha256Hex("bob-token") << "\"]\n";
  StartDaemon("[auth]\ntokens_file = \"" + (dir_ / "tokens.toml").string() + "\"\n");
  const auto tokens = Prompt(128, 71);
  SessionOptions o;
  o.guard = GuardMode::kAlwaysFetch;
  auto alice = Connect("alice-token");
  auto bob = Connect("bob-token");
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);
  auto sa = Store(alice.get(), o);
  std::vector<float> logits;
  SequenceState a = SaveSession(sa.get(), tokens, &logits);
  const auto ref = Continue(engine_.get(), &a, logits, 8);

  auto sb = Store(bob.get(), o);
  SequenceState r;
  std::vector<float> rl;
  auto rep = sb->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->hit_units, 0);
  EXPECT_TRUE(rep->recomputed);
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 8), ref));

  auto rep2 = sa->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep2.ok());
  EXPECT_EQ(rep2->hit_units, 2);
  EXPECT_TRUE(rep2->hot_state_restored);
}

// The guard recomputes when its estimates say the fetch path is slower, and says why.
TEST_F(ResumeTest, GuardRecomputesWhenFetchIsSlower) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SessionOptions o;
  o.keep_hot_state = false;
  auto store = Store(c.get(), o);
  const auto tokens = Prompt(192, 81);
  std::vector<float> logits;
  SequenceState a = SaveSession(store.get(), tokens, &logits);
  const auto ref = Continue(engine_.get(), &a, logits, 4);
  // Pretend the SSD and DRAM tiers take a second per unit: recomputing is cheaper.
  store->cost_model()->ObserveFetch(1, 1, 1.0);
  store->cost_model()->ObserveFetch(2, 1, 1.0);
  SequenceState r;
  std::vector<float> rl;
  auto rep = store->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->hit_units, 3);
  EXPECT_TRUE(rep->recomputed);
  EXPECT_NE(rep->decision.find("guard: recompute"), std::string::npos) << rep->decision;
  EXPECT_EQ(store->stats().guard_recompute, 1u);
  EXPECT_TRUE(SameLogits(Continue(engine_.get(), &r, rl, 4), ref));
  // Measured fetch costs (fast) bring the fetch path back.
  auto fresh = Store(c.get(), o);
  auto rep2 = fresh->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep2.ok());
  EXPECT_FALSE(rep2->recomputed) << rep2->decision;
  EXPECT_EQ(fresh->stats().guard_fetch, 1u);
}

// A resume that recomputes more than the engine runs in one piece (here: nothing was saved, a
// miss) used to fail with InvalidArgument past kMaxTokensPerCall: Recompute ran one PrefillCed
// over every token, which the engine refused, although Resume takes up to kMaxSessionTokens and
// promises that a miss degrades to a CED prefill. PrefillCed now runs such a prompt in pieces
// (engine/model.h, EngineOptions::prompt_piece_tokens), and the resume's result is the CED
// prefill of every token: bit for bit what one piece computes, not a full forward of the rest.
// Pieces of 1,000 tokens keep it to a second; the real binary runs 65,600 tokens at the default
// piece in tests/resume/resume_cli_e2e.sh.
TEST_F(ResumeTest, RecomputeInEnginePiecesIsTheCedPrefill) {
  StartDaemon();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const std::filesystem::path models = std::filesystem::path(KVTIER_MINI_CONFIG).parent_path();
  auto cfg = LoadEngineConfig((models / "kvmini-trained.json").string());
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto w = LoadWeights(*cfg, (models / "kvmini-trained.safetensors").string());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  EngineOptions eo;
  eo.threads = 2;
  eo.prompt_piece_tokens = 1000;
  auto e = Engine::Create(*cfg, weights, eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  SessionOptions o;
  auto fp = EngineModelFingerprint(*cfg, *weights, o.unit_tokens);
  ASSERT_TRUE(fp.ok());
  auto store = SessionStore::Create(e->get(), c.get(), *fp, o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const auto tokens = Prompt(3500, 91);
  SequenceState r;
  std::vector<float> rl;
  auto rep = (*store)->Resume(tokens, &r, &rl);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_TRUE(rep->recomputed) << rep->decision;
  EXPECT_EQ(r.tokens.size(), tokens.size());
  // The reference: one CED prefill of every token, in one piece.
  eo.prompt_piece_tokens = static_cast<int>(kMaxTokensPerCall);
  auto whole = Engine::Create(*cfg, weights, eo);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  SequenceState ref = (*whole)->NewSequence();
  std::vector<float> ref_logits;
  ASSERT_TRUE((*whole)->PrefillCed(&ref, tokens, &ref_logits).ok());
  EXPECT_TRUE(SameLogits(Continue(e->get(), &r, rl, 4), Continue(e->get(), &ref, ref_logits, 4)));
}

// An identity for the HotState tests: fingerprint and key filled with `fill`.
HotStateIdentity TestIdentity(uint8_t fill) {
  HotStateIdentity id;
  id.model_fingerprint.fill(fill);
  id.key.fill(static_cast<uint8_t>(fill + 1));
  return id;
}

TEST(HotState, RoundTripsAndRejectsDamage) {
  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->PrefillCed(&st, Prompt(64, 90), &logits).ok());
  const HotStateIdentity id = TestIdentity(7);
  const auto blob = EncodeHotState(st, logits, id);
  SequenceState other = st;
  auto back = DecodeHotState(blob, id, &other);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, logits);
  for (size_t at : {size_t{0}, size_t{20}, size_t{50}, blob.size() / 2, blob.size() - 1}) {
    auto bad = blob;
    bad[at] ^= 0x40;
    EXPECT_TRUE(DecodeHotState(bad, id, &other).status().IsCorruption()) << at;
  }
  EXPECT_TRUE(DecodeHotState(std::span(blob).first(10), id, &other).status().IsCorruption());
  // A blob without a tail refuses expected tail tokens.
  const std::vector<int32_t> ids = {1, 2, 3};
  EXPECT_TRUE(DecodeHotState(blob, id, &other, ids).status().IsCorruption());
  // Another key or another model: refused, though every shape matches.
  HotStateIdentity other_key = id, other_model = id;
  other_key.key[31] ^= 1;
  other_model.model_fingerprint[0] ^= 1;
  EXPECT_TRUE(DecodeHotState(blob, other_key, &other).status().IsCorruption());
  EXPECT_TRUE(DecodeHotState(blob, other_model, &other).status().IsCorruption());
  // Version 2 (no identity, written before the binding), well formed: refused.
  std::vector<uint8_t> v2 = blob;
  v2[4] = 2;
  v2.resize(v2.size() - 8);                         // the checksum
  v2.erase(v2.begin() + 12, v2.begin() + 12 + 64);  // the identity
  const uint64_t sum = Xxh3_64(v2.data(), v2.size());
  for (int i = 0; i < 8; ++i) v2.push_back(static_cast<uint8_t>(sum >> (8 * i)));
  auto old = DecodeHotState(v2, id, &other);
  ASSERT_TRUE(old.status().IsCorruption());
  EXPECT_NE(old.status().message().find("version 2"), std::string::npos) << old.status().ToString();
}

// The page's hot-state index: entries round-trip in order; damage, too many entries and a tail
// past the page are refused.
TEST(HotState, IndexRoundTripsAndRejectsDamage) {
  std::vector<HotStateIndexEntry> entries;
  for (uint32_t tail : {36u, 0u, 63u}) {
    HotStateIndexEntry e;
    e.tail = tail;
    e.key.fill(static_cast<uint8_t>(tail + 1));
    entries.push_back(e);
  }
  const auto bytes = EncodeHotStateIndex(entries);
  auto back = DecodeHotStateIndex(bytes, 64);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, entries);
  EXPECT_TRUE(DecodeHotStateIndex(bytes, 63).status().IsCorruption());  // tail 63 past the page
  EXPECT_TRUE(
      DecodeHotStateIndex(std::span(bytes).first(bytes.size() - 1), 64).status().IsCorruption());
  for (size_t at : {size_t{0}, size_t{4}, size_t{6}}) {
    auto bad = bytes;
    bad[at] ^= 1;
    EXPECT_TRUE(DecodeHotStateIndex(bad, 64).status().IsCorruption()) << at;
  }
  const std::vector<HotStateIndexEntry> too_many(kHotStateIndexEntriesMax + 1);
  EXPECT_TRUE(DecodeHotStateIndex(EncodeHotStateIndex(too_many), 64).status().IsCorruption());
  const std::vector<HotStateIndexEntry> most(kHotStateIndexEntriesMax);
  EXPECT_TRUE(DecodeHotStateIndex(EncodeHotStateIndex(most), 64).ok());
}

// A state cut 41 tokens past a page (inside a ratio-2 source's compressor group): its tail
// plus rings rebuild it exactly on top of the imported page; damage, other tail ids and a
// state that does not end at the tail's start are refused with the state unchanged.
TEST(HotState, TailRoundTripsAndRejectsDamage) {
  auto e = MakeEngine();
  const auto tokens = Prompt(105, 91);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, tokens, false, &logits).ok());
  auto tail = ExportTail(st, 64);
  ASSERT_TRUE(tail.ok()) << tail.status().ToString();
  EXPECT_TRUE(ExportTail(st, 63).status().IsInvalidArgument());
  const HotStateIdentity id = TestIdentity(9);
  const auto blob = EncodeHotState(st, logits, id, *tail);
  auto layout = EngineKvLayout(MiniConfig(), 64);
  ASSERT_TRUE(layout.ok());
  const UnitPayloadLayout pl = UnitPayloadLayout::For(*layout);
  auto page = ExportUnitPayload(pl, st, 0);
  ASSERT_TRUE(page.ok());
  SequenceState r = e->NewSequence();
  ASSERT_TRUE(ImportUnitPayload(pl, *page, std::span(tokens).first(64), &r).ok());
  const std::span<const int32_t> ids = std::span(tokens).subspan(64);
  // Refusals first: each leaves r as it was (one page, no rings).
  std::vector<int32_t> wrong(ids.begin(), ids.end());
  wrong[5] ^= 1;
  EXPECT_TRUE(DecodeHotState(blob, id, &r, wrong).status().IsCorruption());
  EXPECT_TRUE(DecodeHotState(blob, id, &r, ids.first(40)).status().IsCorruption());
  EXPECT_TRUE(DecodeHotState(blob, id, &r).status().IsCorruption());  // a tail nobody expected
  EXPECT_TRUE(DecodeHotState(blob, TestIdentity(10), &r, ids).status().IsCorruption());
  for (size_t at : {size_t{0}, blob.size() / 3, blob.size() - 100, blob.size() - 1}) {
    auto bad = blob;
    bad[at] ^= 0x10;
    EXPECT_TRUE(DecodeHotState(bad, id, &r, ids).status().IsCorruption()) << at;
  }
  SequenceState empty = e->NewSequence();
  EXPECT_TRUE(ImportTail(*tail, ids, &empty).IsInvalidArgument());
  ASSERT_EQ(r.tokens.size(), 64u);
  auto back = DecodeHotState(blob, id, &r, ids);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, logits);
  ASSERT_EQ(r.tokens, st.tokens);
  // Continuing both gives the same logits bit for bit.
  const auto more = Prompt(8, 92);
  std::vector<float> la, lb;
  ASSERT_TRUE(e->Forward(&st, more, true, &la).ok());
  ASSERT_TRUE(e->Forward(&r, more, true, &lb).ok());
  EXPECT_EQ(la, lb);
  // The SWA key never equals the chain key it derives from.
  Digest k{};
  k[0] = 1;
  EXPECT_NE(SwaBlobKey(k), k);
}

}  // namespace
}  // namespace kvtier::engine
