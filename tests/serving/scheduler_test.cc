// The serving Scheduler in process (no kvtierd), with the trained miniature: prompts prefilled
// in chunks beside decode tokens give exactly the greedy text of the engine's own full forward
// of the whole prompt, alone or batched with other requests, and a running stream keeps
// getting a token in every step while a long prompt is being prefilled (counted in steps).
#include "serving/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/config.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "engine/weights.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/faulty_device_backend.h"
#include "tests/serving/prompt_text.h"

namespace kvtier::serving {
namespace {

using engine::ByteTokenizer;

struct Model {
  std::shared_ptr<const engine::ModelWeights> weights;
  std::unique_ptr<engine::Engine> engine;
};

// The miniature with random weights (tests/engine): far more sensitive than the trained one,
// so a prompt computed any other way than the full forward (e.g. the CED prefill) changes
// its greedy tokens.
Model LoadRandom() {
  Model m;
  m.weights = engine::testutil::MiniWeights();
  m.engine = engine::testutil::MakeEngine(1);
  return m;
}

Model LoadTrained() {
  const std::string dir = std::string(KVTIER_SOURCE_DIR) + "/deploy/models/kvmini-trained";
  auto cfg = engine::LoadEngineConfig(dir + ".json");
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto w = engine::LoadWeights(*cfg, dir + ".safetensors");
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  Model m;
  m.weights = std::make_shared<const engine::ModelWeights>(std::move(w).value());
  auto e = engine::Engine::Create(*cfg, m.weights, engine::EngineOptions{});
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  m.engine = std::move(e).value();
  return m;
}

// Printable prompt bytes as token ids.
std::vector<int32_t> Prompt(size_t n, uint32_t seed) {
  const std::string s = kvtier::testing::PromptText(n, seed);
  std::vector<int32_t> ids;
  for (unsigned char c : s) ids.push_back(ByteTokenizer::kByteBase + c);
  return ids;
}

// The reference: the engine's full forward of the whole prompt in one call, then greedy
// decoding; the text the scheduler would send (byte tokens, up to eos or max_tokens).
std::string Reference(engine::Engine* e, const std::vector<int32_t>& prompt, int max_tokens) {
  engine::SequenceState st = e->NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(e->Forward(&st, prompt, false, &logits).ok());
  engine::Sampler greedy(0, 1, 0);
  std::string text;
  for (int k = 0; k < max_tokens; ++k) {
    const int32_t t = greedy.Sample(logits);
    if (t == ByteTokenizer::kEos) break;
    if (t >= ByteTokenizer::kByteBase && t < ByteTokenizer::kByteBase + 256)
      text.push_back(static_cast<char>(t - ByteTokenizer::kByteBase));
    if (k + 1 < max_tokens) {
      EXPECT_TRUE(e->Decode(&st, t, &logits).ok());
    }
  }
  return text;
}

struct Collected {
  std::string text;
  std::vector<uint64_t> text_steps;  // the step of every text event
  uint64_t done_step = 0;
  Usage usage;
  bool done = false;
};

// Reads events until kDone or kError (or a 60 s silence).
Collected Drain(Generation* g) {
  Collected c;
  GenerationEvent ev;
  while (g->Next(&ev, 60000)) {
    if (ev.kind == GenerationEvent::Kind::kText) {
      c.text += ev.text;
      c.text_steps.push_back(ev.step);
    } else {
      c.done = ev.kind == GenerationEvent::Kind::kDone;
      c.done_step = ev.step;
      c.usage = ev.usage;
      break;
    }
  }
  return c;
}

GenerationParams Greedy(std::vector<int32_t> prompt, uint64_t max_tokens) {
  GenerationParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  p.temperature = 0;
  return p;
}

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override { model_ = LoadTrained(); }
  std::unique_ptr<Scheduler> Make(SchedulerOptions o) {
    auto s = Scheduler::Create(model_.engine.get(), *model_.weights, o, &metrics_);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  // A device call that fails mid-request (--layer-device host-twin behind a backend that fails
  // its k-th call), on schedulers with options o: the requests of that pass end with an error
  // event, the metrics say the device failed, and the next request is served on the CPU path
  // with the engine's own greedy text. Each k is a call of an undisturbed request's run: the
  // first (its prompt's prefill), a quarter, half and three quarters into it, the last.
  void ExpectADeviceFailureFailsItsPass(const SchedulerOptions& o) {
    const std::vector<int32_t> prompt = Prompt(40, 3);
    constexpr int kTokens = 12;
    const std::string want = Reference(model_.engine.get(), prompt, kTokens);
    auto device_engine = [&](std::shared_ptr<engine::testutil::CallLog> log) {
      auto e = engine::testutil::FaultyEngine(model_.engine->config(), model_.weights, log);
      EXPECT_TRUE(e.ok()) << e.status().ToString();
      return e.ok() ? std::move(e).value() : nullptr;
    };
    // The calls of an undisturbed request: its text is the CPU path's (the host twin's bits).
    auto clean_log = std::make_shared<engine::testutil::CallLog>();
    auto clean = device_engine(clean_log);
    ASSERT_NE(clean, nullptr);
    const int64_t create_calls = clean_log->calls;
    int64_t run_calls = 0;
    {
      auto s = Scheduler::Create(clean.get(), *model_.weights, o, &metrics_);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      auto g = (*s)->Submit(&tenant_, Greedy(prompt, kTokens));
      ASSERT_TRUE(g.ok());
      Collected c = Drain(g->get());
      ASSERT_TRUE(c.done);
      EXPECT_EQ(c.text, want);
      run_calls = clean_log->calls - create_calls;
      ASSERT_GT(run_calls, 100);
    }
    for (int64_t k : {create_calls, create_calls + run_calls / 4, create_calls + run_calls / 2,
                      create_calls + 3 * run_calls / 4, create_calls + run_calls - 1}) {
      SCOPED_TRACE("failing call " + std::to_string(k));
      ServingMetrics metrics;
      auto log = std::make_shared<engine::testutil::CallLog>();
      log->fail_at = k;
      auto e = device_engine(log);
      ASSERT_NE(e, nullptr);
      auto s = Scheduler::Create(e.get(), *model_.weights, o, &metrics);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      EXPECT_NE(metrics.Render().find("kvtier_serve_layer_device_failed 0\n"), std::string::npos);
      auto failed = (*s)->Submit(&tenant_, Greedy(prompt, kTokens));
      ASSERT_TRUE(failed.ok());
      Collected c = Drain(failed->get());
      EXPECT_FALSE(c.done);
      EXPECT_EQ(e->DeviceFailure().code(), StatusCode::kInternal);
      auto again = (*s)->Submit(&tenant_, Greedy(prompt, kTokens));
      ASSERT_TRUE(again.ok());
      c = Drain(again->get());
      ASSERT_TRUE(c.done);
      EXPECT_EQ(c.text, want);
      EXPECT_EQ(log->after_failure, 0);
      // The gauge is published after the step that ended the request: wait for it.
      bool published = false;
      for (int i = 0; i < 5000 && !published; ++i) {
        published =
            metrics.Render().find("kvtier_serve_layer_device_failed 1\n") != std::string::npos;
        if (!published) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_TRUE(published) << metrics.Render();
    }
  }
  Model model_;
  ServingMetrics metrics_;
  Tenant tenant_{"t", "", {}};

 public:
  const Model& model() const { return model_; }
};

// Chunked prefill (chunks of 32, steps of 48 tokens) is the full forward: each prompt's greedy
// text equals the engine's one-call forward of the whole prompt, alone and with four requests
// of different lengths packed into the same steps.
TEST_F(SchedulerTest, ChunkedPrefillEqualsWholeForwardAloneAndBatched) {
  SchedulerOptions o;
  o.step_tokens_max = 48;
  o.prefill_chunk_tokens = 32;
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  const std::vector<size_t> lengths = {5, 47, 130, 333, 90};
  constexpr int kTokens = 64;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> refs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(Prompt(lengths[i], 7 + static_cast<uint32_t>(i)));
    refs.push_back(Reference(model_.engine.get(), prompts.back(), kTokens));
  }
  // Alone: one request at a time.
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto g = s->Submit(&tenant_, Greedy(prompts[i], kTokens));
    ASSERT_TRUE(g.ok());
    Collected c = Drain(g->get());
    ASSERT_TRUE(c.done) << i;
    EXPECT_EQ(c.text, refs[i]) << i;
    EXPECT_EQ(c.usage.prompt_tokens, static_cast<int64_t>(lengths[i]));
  }
  // Batched: all submitted at once (the resident sequences of the solo runs are continued
  // only by a prompt they prefix: these are the same prompts, so they are hits; a fresh
  // scheduler is used to compute every prompt again).
  s.reset();
  o.idle_sequences_max = 0;
  s = Make(o);
  ASSERT_NE(s, nullptr);
  std::vector<std::shared_ptr<Generation>> gens;
  for (const auto& p : prompts) {
    auto g = s->Submit(&tenant_, Greedy(p, kTokens));
    ASSERT_TRUE(g.ok());
    gens.push_back(*g);
  }
  for (size_t i = 0; i < gens.size(); ++i) {
    Collected c = Drain(gens[i].get());
    ASSERT_TRUE(c.done) << i;
    EXPECT_EQ(c.text, refs[i]) << i;
    EXPECT_EQ(c.usage.cached_tokens, 0);
  }
}

// The same with the random-weight miniature, whose greedy tokens (bytes and reserved ids
// alike, compared through the text and the completion count) tell the full forward from an
// approximation of it.
TEST(SchedulerRandomWeightsTest, ChunkedPrefillEqualsWholeForwardBatched) {
  Model m = LoadRandom();
  ServingMetrics metrics;
  Tenant tenant{"t", "", {}};
  SchedulerOptions o;
  o.step_tokens_max = 40;
  o.prefill_chunk_tokens = 24;
  o.idle_sequences_max = 0;
  auto s = Scheduler::Create(m.engine.get(), *m.weights, o, &metrics);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  constexpr int kTokens = 16;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> refs;
  std::vector<std::shared_ptr<Generation>> gens;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(engine::testutil::Prompt(20 + 45 * i, 60 + static_cast<uint32_t>(i)));
    refs.push_back(Reference(m.engine.get(), prompts.back(), kTokens));
  }
  for (const auto& p : prompts) {
    auto g = (*s)->Submit(&tenant, Greedy(p, kTokens));
    ASSERT_TRUE(g.ok());
    gens.push_back(*g);
  }
  for (size_t i = 0; i < gens.size(); ++i) {
    Collected c = Drain(gens[i].get());
    ASSERT_TRUE(c.done) << i;
    EXPECT_EQ(c.text, refs[i]) << i;
  }
}

TEST_F(SchedulerTest, ADeviceFailureFailsItsPassAndLaterRequestsRunOnTheCpu) {
  SchedulerOptions o;
  o.idle_sequences_max = 0;
  ExpectADeviceFailureFailsItsPass(o);
}

// While a 1000-token prompt is prefilled in 31-token chunks, the running stream gets a token
// in every step: the long prompt's first token comes >= 30 steps after its admission, and
// the running stream sent text in most of those steps (prefill at admission would give 1).
TEST_F(SchedulerTest, RunningStreamKeepsDecodingWhileALongPromptPrefills) {
  SchedulerOptions o;
  o.step_tokens_max = 32;  // 1 decode token + a 31-token chunk per step
  o.prefill_chunk_tokens = 32;
  o.context_tokens_max = 16384;
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  auto a = s->Submit(&tenant_, Greedy(Prompt(8, 1), 8000));
  ASSERT_TRUE(a.ok());
  for (int i = 0; i < 10000 && (*a)->admitted_step() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GT((*a)->admitted_step(), 0u);
  constexpr size_t kLong = 1000;
  auto b = s->Submit(&tenant_, Greedy(Prompt(kLong, 2), 2));
  ASSERT_TRUE(b.ok());
  Collected cb = Drain(b->get());
  ASSERT_TRUE(cb.done);
  ASSERT_FALSE(cb.text_steps.empty());
  s->Stop();  // the running stream ends with a 503 error event
  Collected ca = Drain(a->get());
  const uint64_t admitted = (*b)->admitted_step(), first = cb.text_steps.front();
  const uint64_t chunks = (kLong + 30) / 31;
  EXPECT_GE(first - admitted, chunks) << "admitted " << admitted << " first " << first;
  size_t during = 0;
  for (uint64_t st : ca.text_steps) during += st >= admitted && st < first;
  EXPECT_GE(during, chunks * 3 / 4) << "the running stream's text events during the prefill";
  EXPECT_GT(ca.text_steps.back(), first) << "the running stream was still generating";
}

// kvtierd's calls run on CacheIo's thread, not the steps': while a new request's restore waits
// on a kvtierd that accepted its connection and never answers (a hung host), a running stream
// keeps getting a token in later steps, and the waiting request is served (without the cache)
// once its connection ends. With the restore on the scheduler's thread, no step ran until the
// handshake's timeout (60 s here), so the stream got nothing.
TEST_F(SchedulerTest, StepsGoOnWhileARestoreWaitsOnAStalledKvtierd) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvtier_sched_stalled_" + std::to_string(::getpid()) + ".sock"))
                               .string();
  std::filesystem::remove(path);
  SchedulerOptions o;
  o.daemon.socket_path = path;
  o.daemon.timeout_ms = 60000;  // the restore waits for the test, not for a timeout
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  // No kvtierd yet: A's restore fails at once (no socket) and A runs without the cache.
  auto a = s->Submit(&tenant_, Greedy(Prompt(8, 1), 6000));
  ASSERT_TRUE(a.ok());
  GenerationEvent ev;
  ASSERT_TRUE((*a)->Next(&ev, 60000));
  ASSERT_EQ(ev.kind, GenerationEvent::Kind::kText);
  // Now a listener that never accepts: B's connection is made (the backlog) and its HELLO
  // waits for an answer.
  const int listener = kvtier::testing::ListenUnix(path, 4);
  ASSERT_GE(listener, 0);
  auto b = s->Submit(&tenant_, Greedy(Prompt(200, 2), 4));
  ASSERT_TRUE(b.ok());
  for (int i = 0; i < 60000 && (*b)->admitted_step() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const uint64_t admitted = (*b)->admitted_step();
  ASSERT_GT(admitted, 0u);
  constexpr int kLater = 40;
  int later = 0;
  uint64_t last_step = 0;
  while (later < kLater && (*a)->Next(&ev, 20000) && ev.kind == GenerationEvent::Kind::kText) {
    if (ev.step > admitted) ++later;
    last_step = ev.step;
  }
  EXPECT_EQ(later, kLater) << "the running stream's tokens in steps after B's admission";
  GenerationEvent bev;
  EXPECT_FALSE((*b)->Next(&bev, 0)) << "B was served before its restore ended";
  ::close(listener);  // the pending connection is dropped: B's restore fails at once
  std::filesystem::remove(path);
  Collected cb = Drain(b->get());
  ASSERT_TRUE(cb.done);
  EXPECT_EQ(cb.usage.cached_tokens, 0);
  ASSERT_FALSE(cb.text_steps.empty());
  EXPECT_GT(cb.text_steps.front(), last_step) << "B's first token after the steps it waited";
  s->Stop();  // the running stream ends with a 503 error event
}

// Restores that finished together, completed in one step or not: three conversations of two
// whole pages are saved to a real kvtierd (with their hot states when `hot_state`); the step
// thread is held while their continuations are queued (so one admission takes all three) and
// then until CacheIo has finished all three restores, while a stream runs beside them. Returns
// the steps of their first tokens (empty after a failure); `metrics` are the scheduler's.
std::vector<uint64_t> FirstStepsOfRestoresFinishedTogether(SchedulerTest* t, bool hot_state,
                                                           bool replay_engines,
                                                           ServingMetrics* metrics) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_sched_hot_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto d = std::make_unique<kvtier::testing::KvtierdProcess>(dir);
  d->WriteConfig(
      "[storage]\ndram_capacity_bytes = 33554432\nssd_capacity_bytes = 268435456\n"
      "ssd_segment_bytes = 16777216\n");
  EXPECT_TRUE(d->Start()) << d->Log();
  std::mutex mu;
  std::condition_variable cv;
  int phase = 0;  // 1: the next step parks; 2: parked; 3: go on; 4: done
  std::vector<std::shared_ptr<Generation>> bs;
  auto restores_queued = [&] {
    const std::string m = metrics->Render();
    const std::string name = "kvtier_serve_kvtierd_restores_queued ";
    const size_t at = m.find("\n" + name);
    return at == std::string::npos ? -1 : std::stoll(m.substr(at + 1 + name.size()));
  };
  SchedulerOptions o;
  o.daemon.socket_path = d->socket();
  o.kvtierd_threads = 4;
  o.idle_sequences_max = 0;  // every continuation restores from kvtierd
  o.session.keep_hot_state = o.session.use_hot_state = hot_state;
  // Every hit restored: the guard's auto mode may find a 2-page restore with a replay dearer
  // than computing its 133 tokens (the timings it measured decide), which this is not about.
  o.session.guard = engine::GuardMode::kAlwaysFetch;
  if (replay_engines) {
    o.replay_engine = [t]() -> StatusOr<std::unique_ptr<engine::Engine>> {
      return engine::Engine::Create(t->model().engine->config(), t->model().weights,
                                    engine::EngineOptions{});
    };
  }
  o.step_observer = [&](const StepReport&) {
    std::unique_lock l(mu);
    if (phase == 1) {
      phase = 2;
      cv.notify_all();
      cv.wait(l, [&] { return phase == 3; });
      return;
    }
    if (phase != 3) return;
    for (const auto& g : bs)
      if (g->admitted_step() == 0) return;
    // All three admitted in this step's admission: hold the step until their restores are done.
    for (int i = 0; i < 30000 && restores_queued() != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    phase = 4;
  };
  auto made = Scheduler::Create(t->model().engine.get(), *t->model().weights, o, metrics);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  if (!made.ok()) return {};
  std::unique_ptr<Scheduler> s = std::move(made).value();
  const Tenant tenant{"t", "", {}};
  constexpr size_t kPage = 64;
  std::vector<std::vector<int32_t>> history;
  for (uint32_t i = 0; i < 3; ++i) {
    history.push_back(Prompt(2 * kPage, 70 + i));
    auto g = s->Submit(&tenant, Greedy(history.back(), 1));
    EXPECT_TRUE(g.ok());
    if (!g.ok() || !Drain(g->get()).done) return {};  // its turn is in kvtierd once it is done
  }
  auto a = s->Submit(&tenant, Greedy(Prompt(8, 1), 6000));
  EXPECT_TRUE(a.ok());
  GenerationEvent ev;
  if (!a.ok() || !(*a)->Next(&ev, 60000)) return {};
  {
    std::unique_lock l(mu);
    phase = 1;
    EXPECT_TRUE(cv.wait_for(l, std::chrono::seconds(60), [&] { return phase == 2; }));
    for (uint32_t i = 0; i < 3; ++i) {
      std::vector<int32_t> p = history[i];
      for (int32_t tok : Prompt(5, 90 + i)) p.push_back(tok);
      auto g = s->Submit(&tenant, Greedy(p, 2));
      EXPECT_TRUE(g.ok());
      if (g.ok()) bs.push_back(*g);
    }
    phase = 3;
  }
  cv.notify_all();
  std::vector<uint64_t> first;
  for (const auto& g : bs) {
    Collected c = Drain(g.get());
    EXPECT_TRUE(c.done);
    EXPECT_FALSE(c.text_steps.empty());
    EXPECT_EQ(c.usage.cached_tokens, static_cast<int64_t>(2 * kPage)) << "a whole restore";
    if (c.text_steps.empty()) return {};
    first.push_back(c.text_steps.front());
  }
  {
    std::lock_guard l(mu);
    EXPECT_EQ(phase, 4) << "the step thread never saw all three admitted";
  }
  const std::string hot =
      "kvtier_serve_hot_state_restores_total " + std::to_string(hot_state ? 3 : 0) + "\n";
  EXPECT_NE(metrics->Render().find(hot), std::string::npos) << metrics->Render();
  s->Stop();  // the running stream ends with a 503 error event
  s.reset();
  d.reset();
  std::filesystem::remove_all(dir);
  return first;
}

// Three restores' first tokens came in one step.
void ExpectOneStep(const std::vector<uint64_t>& first) {
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first[1], first[0]) << "first tokens' steps";
  EXPECT_EQ(first[2], first[0]) << "first tokens' steps";
}

// Restores from a hot state (a copy of the SWA rings, no replay) that finished together are
// all completed in one step, so their suffixes are prefilled together and their first tokens
// come in the same step. With at most one restore completed per step (the rule for replays on
// the step thread), their first tokens came in three different steps.
TEST_F(SchedulerTest, HotStateRestoresFinishedTogetherStartInOneStep) {
  ExpectOneStep(FirstStepsOfRestoresFinishedTogether(this, true, false, &metrics_));
}

// Restores without hot states replay. On the kvtierd threads' own engines (replay_engine) they
// are done when CacheIo finishes them: those finished together start in one step. Replayed on
// the step thread instead, one per step while the stream runs: three steps in a row.
TEST_F(SchedulerTest, ReplaysOnKvtierdThreadsFinishedTogetherStartInOneStep) {
  ExpectOneStep(FirstStepsOfRestoresFinishedTogether(this, false, true, &metrics_));
  ServingMetrics on_step_metrics;
  std::vector<uint64_t> on_step =
      FirstStepsOfRestoresFinishedTogether(this, false, false, &on_step_metrics);
  ASSERT_EQ(on_step.size(), 3u);
  std::sort(on_step.begin(), on_step.end());
  EXPECT_EQ(on_step[1], on_step[0] + 1) << "replays on the step thread, one per step";
  EXPECT_EQ(on_step[2], on_step[0] + 2) << "replays on the step thread, one per step";
}

// Per-tenant fairness, counted in steps: tenant A queues 12 requests, then tenant B one. With
// a step budget of 8 tokens shared by weight, B's 40-token prompt gets its weighted share of
// every step (4 tokens at weights 1:1, 2 at 3:1) until it is prefilled, so its first token
// comes within ceil(40 / share) + 2 steps of its admission, and then it decodes in every step.
// Oldest-first packing over requests would give B nothing until A's 480 prompt tokens were
// prefilled (60 steps).
class FairnessTest : public SchedulerTest, public ::testing::WithParamInterface<uint32_t> {};

TEST_P(FairnessTest, SmallTenantGetsItsWeightedShareOfEveryStep) {
  const uint32_t weight_a = GetParam();
  Tenant a{"a", "", {}, weight_a}, b{"b", "", {}, 1};
  constexpr uint64_t kBudget = 8, kPromptB = 40, kTokensB = 6;
  const uint64_t share_b = kBudget / (weight_a + 1);
  std::mutex mu;
  std::condition_variable cv;
  bool all_submitted = false;
  std::vector<StepReport> steps;
  SchedulerOptions o;
  o.step_tokens_max = kBudget;
  o.prefill_chunk_tokens = 16;
  o.idle_sequences_max = 0;
  o.active_sequences_max = 16;
  o.step_observer = [&](const StepReport& r) {
    std::unique_lock l(mu);
    steps.push_back(r);
    // Hold the first step until every request is queued, so the test does not race it.
    cv.wait(l, [&] { return all_submitted; });
  };
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  std::vector<std::shared_ptr<Generation>> gens_a;
  for (int i = 0; i < 12; ++i) {
    auto g = s->Submit(&a, Greedy(Prompt(40, 100 + static_cast<uint32_t>(i)), 16));
    ASSERT_TRUE(g.ok());
    gens_a.push_back(*g);
  }
  auto gb = s->Submit(&b, Greedy(Prompt(kPromptB, 99), kTokensB));
  ASSERT_TRUE(gb.ok());
  {
    std::lock_guard l(mu);
    all_submitted = true;
  }
  cv.notify_all();
  Collected cb = Drain(gb->get());
  ASSERT_TRUE(cb.done);
  ASSERT_FALSE(cb.text_steps.empty());
  for (auto& g : gens_a) ASSERT_TRUE(Drain(g.get()).done);
  s->Stop();
  const uint64_t admitted = (*gb)->admitted_step(), first = cb.text_steps.front();
  const uint64_t bound = (kPromptB + share_b - 1) / share_b + 2;
  EXPECT_LE(first - admitted, bound) << "admitted " << admitted << " first token " << first;
  std::lock_guard l(mu);
  uint64_t prefill_b = 0;
  for (const StepReport& r : steps) {
    uint64_t total = 0;
    for (const auto& [t, n] : r.tokens_by_tenant) total += n;
    EXPECT_LE(total, kBudget) << "step " << r.step;
    if (r.step < admitted || r.step >= first) continue;
    // B prefills: it gets exactly its weighted share (the last chunk may be shorter), A the rest.
    const uint64_t nb = r.tokens_by_tenant.count("b") ? r.tokens_by_tenant.at("b") : 0;
    const uint64_t na = r.tokens_by_tenant.count("a") ? r.tokens_by_tenant.at("a") : 0;
    EXPECT_EQ(nb, std::min(share_b, kPromptB - prefill_b)) << "step " << r.step;
    EXPECT_EQ(na, kBudget - nb) << "step " << r.step;
    prefill_b += nb;
  }
  EXPECT_EQ(prefill_b, kPromptB);
  // Then one decode token in every step until it is done.
  EXPECT_LE(cb.done_step - first, kTokensB) << "B decoded in every step";
}

INSTANTIATE_TEST_SUITE_P(Weights, FairnessTest, ::testing::Values(1u, 3u));

// --speculative in process: greedy text equals plain decoding's, alone and four at once; and
// a max_tokens limit or a stop string that ends inside an accepted run of draft tokens (several
// tokens emitted by one step) ends the response exactly where plain decoding does, with the
// same usage.
class SpeculativeSchedulerTest : public SchedulerTest {
 protected:
  void SetUp() override {
    SchedulerTest::SetUp();
    const std::string dir = std::string(KVTIER_SOURCE_DIR) + "/deploy/models/kvmini-trained";
    auto dc = engine::LoadDSparkConfig(dir + ".json", model_.engine->config());
    ASSERT_TRUE(dc.ok()) << dc.status().ToString();
    auto d = engine::DSpark::Load(model_.engine->config(), *dc, model_.weights,
                                  dir + "-dspark.safetensors");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    draft_ = std::move(d).value();
  }
  // Runs `params` alone on a fresh scheduler, speculative (fixed draft length) or not.
  Collected RunAlone(const GenerationParams& params, bool speculative) {
    SchedulerOptions o;
    o.idle_sequences_max = 0;
    if (speculative) {
      o.draft = draft_.get();
      o.draft_len = 5;
    }
    auto s = Make(o);
    EXPECT_NE(s, nullptr);
    auto g = s->Submit(&tenant_, params);
    EXPECT_TRUE(g.ok());
    return Drain(g->get());
  }
  std::unique_ptr<engine::DSpark> draft_;
};

// The same with speculative decoding (drafts of 5 verified in ForwardBatch passes on the
// device): a failing call in a verify pass fails its request, the next is plain greedy's text.
TEST_F(SpeculativeSchedulerTest, ADeviceFailureFailsItsPassAndLaterRequestsRunOnTheCpu) {
  SchedulerOptions o;
  o.idle_sequences_max = 0;
  o.draft = draft_.get();
  o.draft_len = 5;
  ExpectADeviceFailureFailsItsPass(o);
}

TEST_F(SpeculativeSchedulerTest, GreedyEqualsPlainAndLimitsInsideAcceptedRunsAreExact) {
  SchedulerOptions o;
  o.idle_sequences_max = 0;
  o.draft = draft_.get();
  o.draft_len = 5;
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  constexpr int kTokens = 48;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> refs;
  for (uint32_t i = 0; i < 4; ++i) {
    prompts.push_back(Prompt(30 + 25 * i, 40 + i));
    refs.push_back(Reference(model_.engine.get(), prompts.back(), kTokens));
  }
  std::vector<std::shared_ptr<Generation>> gens;
  for (const auto& p : prompts) {
    auto g = s->Submit(&tenant_, Greedy(p, kTokens));
    ASSERT_TRUE(g.ok());
    gens.push_back(*g);
  }
  for (size_t i = 0; i < gens.size(); ++i) {
    Collected c = Drain(gens[i].get());
    ASSERT_TRUE(c.done);
    EXPECT_EQ(c.text, refs[i]) << "batched " << i;
  }
  // Alone: find a step that emitted several tokens (an accepted run: every token here is a
  // byte and no stop string holds text back, so each token is one text event).
  bool found = false;
  for (size_t i = 0; i < prompts.size() && !found; ++i) {
    Collected c = RunAlone(Greedy(prompts[i], kTokens), true);
    ASSERT_TRUE(c.done);
    EXPECT_EQ(c.text, refs[i]) << "alone " << i;
    if (c.text_steps.size() != c.text.size()) continue;  // a reserved id or eos: not here
    for (size_t k = 1; k + 1 < c.text_steps.size() && !found; ++k) {
      if (c.text_steps[k] != c.text_steps[k - 1] || c.text_steps[k] != c.text_steps[k + 1])
        continue;
      // Tokens k-1, k, k+1 came from one round: end at token k, inside the run.
      found = true;
      GenerationParams p = Greedy(prompts[i], k + 1);
      Collected spec = RunAlone(p, true), plain = RunAlone(p, false);
      EXPECT_EQ(spec.text, c.text.substr(0, k + 1));
      EXPECT_EQ(spec.text, plain.text);
      EXPECT_EQ(spec.usage.completion_tokens, static_cast<int64_t>(k + 1));
      EXPECT_EQ(spec.usage.completion_tokens, plain.usage.completion_tokens);
      // A stop string completed by token k (its first occurrence in the text).
      std::string stop;
      for (size_t len = 1; len <= k + 1 && stop.empty(); ++len) {
        const std::string cand = c.text.substr(k + 1 - len, len);
        if (c.text.find(cand) == k + 1 - len) stop = cand;
      }
      ASSERT_FALSE(stop.empty());
      p = Greedy(prompts[i], kTokens);
      p.stop = {stop};
      spec = RunAlone(p, true);
      plain = RunAlone(p, false);
      EXPECT_EQ(spec.text, c.text.substr(0, k + 1 - stop.size())) << "stop '" << stop << "'";
      EXPECT_EQ(spec.text, plain.text);
      EXPECT_EQ(spec.usage.completion_tokens, plain.usage.completion_tokens);
      EXPECT_EQ(spec.usage.completion_tokens, static_cast<int64_t>(k + 1));
    }
  }
  EXPECT_TRUE(found) << "no step emitted three tokens: the draft accepted nothing";
}

// A counter of the metrics text (0 when absent).
uint64_t Counter(const ServingMetrics& m, const std::string& name) {
  const std::string text = m.Render();
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? 0 : std::stoull(text.substr(at + name.size() + 2));
}

// Steps that draft nothing run the speculative sequences' pending tokens as plain rows of the
// step's one pass, beside other requests' prefill chunks (prompts of different lengths, small
// chunks, so decoding and prefilling overlap): draft length 0 never drafts, the load-aware
// scheduler drafts in its first round (no estimates yet) and then as its table says. Greedy
// text equals plain decoding's either way; a max_tokens limit and a stop string end where
// plain decoding's do.
TEST_F(SpeculativeSchedulerTest, UndraftedStepsRunInThePlainPassAndEqualPlain) {
  constexpr int kTokens = 40;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> refs;
  for (uint32_t i = 0; i < 4; ++i) {
    prompts.push_back(Prompt(20 + 60 * i, 70 + i));
    refs.push_back(Reference(model_.engine.get(), prompts.back(), kTokens));
  }
  for (const std::optional<int> draft_len : {std::optional<int>(0), std::optional<int>()}) {
    const std::string mode = draft_len ? "draft_len 0" : "scheduler";
    const uint64_t undrafted0 = Counter(metrics_, "kvtier_serve_spec_rounds_undrafted_total");
    const uint64_t rounds0 = Counter(metrics_, "kvtier_serve_spec_rounds_total");
    const uint64_t drafted0 = Counter(metrics_, "kvtier_serve_spec_drafted_tokens_total");
    SchedulerOptions o;
    o.idle_sequences_max = 0;
    o.prefill_chunk_tokens = 16;
    o.step_tokens_max = 24;
    o.draft = draft_.get();
    o.draft_len = draft_len;
    auto s = Make(o);
    ASSERT_NE(s, nullptr);
    std::vector<std::shared_ptr<Generation>> gens;
    for (const auto& p : prompts) {
      auto g = s->Submit(&tenant_, Greedy(p, kTokens));
      ASSERT_TRUE(g.ok());
      gens.push_back(*g);
    }
    // A stop string: the reference's first occurrence of its bytes 10..12.
    GenerationParams stop = Greedy(prompts[1], kTokens);
    stop.stop = {refs[1].substr(10, 3)};
    auto gs = s->Submit(&tenant_, stop);
    ASSERT_TRUE(gs.ok());
    for (size_t i = 0; i < gens.size(); ++i) {
      Collected c = Drain(gens[i].get());
      ASSERT_TRUE(c.done) << mode;
      EXPECT_EQ(c.text, refs[i]) << mode << " request " << i;
      EXPECT_EQ(c.usage.completion_tokens, kTokens) << mode << " request " << i;
    }
    Collected c = Drain(gs->get());
    ASSERT_TRUE(c.done) << mode;
    EXPECT_EQ(c.text, refs[1].substr(0, refs[1].find(stop.stop[0]))) << mode;
    const uint64_t undrafted = Counter(metrics_, "kvtier_serve_spec_rounds_undrafted_total");
    const uint64_t rounds = Counter(metrics_, "kvtier_serve_spec_rounds_total");
    const uint64_t drafted = Counter(metrics_, "kvtier_serve_spec_drafted_tokens_total");
    if (draft_len) {
      EXPECT_EQ(undrafted - undrafted0, rounds - rounds0) << "draft_len 0 drafts nothing";
      EXPECT_GT(rounds - rounds0, 30u);
      EXPECT_EQ(drafted, drafted0);
    } else {
      EXPECT_GT(drafted, drafted0) << "the first round drafts";
    }
  }
}

// The load-aware scheduler times its passes with SchedulerOptions::draft_cost_clock (the
// engine's CPU time when unset), never with the wall clock: given a clock that never advances,
// it measures nothing at start or in any step, so it never has an estimate of a plain step.
// The first round drafts (no survival estimate yet; with no costs known it verifies none of
// the draft's tokens); every later round runs undrafted and timed, at concurrency 1 and 3, and
// never probes: with any clock that advances, the table
// measured at start has the plain step, and within the 47 rounds of a request it would
// either draft (drafting pays) or probe after 32 undrafted rounds (it does not): either way
// more than one draft pass. Greedy text still equals plain decoding's.
TEST_F(SpeculativeSchedulerTest, DraftSchedulerTimesPassesWithTheGivenClock) {
  constexpr int kTokens = 48;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> refs;
  for (uint32_t i = 0; i < 3; ++i) {
    prompts.push_back(Prompt(24 + 20 * i, 90 + i));
    refs.push_back(Reference(model_.engine.get(), prompts.back(), kTokens));
  }
  SchedulerOptions o;
  o.idle_sequences_max = 0;
  o.draft = draft_.get();
  o.draft_cost_clock = [] { return 0.0; };
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  for (size_t batch : {size_t{1}, size_t{3}}) {
    const uint64_t rounds0 = Counter(metrics_, "kvtier_serve_spec_rounds_total");
    const uint64_t undrafted0 = Counter(metrics_, "kvtier_serve_spec_rounds_undrafted_total");
    const uint64_t passes0 = Counter(metrics_, "kvtier_serve_spec_draft_passes_total");
    std::vector<std::shared_ptr<Generation>> gens;
    for (size_t i = 0; i < batch; ++i) {
      auto g = s->Submit(&tenant_, Greedy(prompts[i], kTokens));
      ASSERT_TRUE(g.ok());
      gens.push_back(*g);
    }
    for (size_t i = 0; i < batch; ++i) {
      Collected c = Drain(gens[i].get());
      ASSERT_TRUE(c.done);
      EXPECT_EQ(c.text, refs[i]) << "batch " << batch << " request " << i;
    }
    const uint64_t rounds = Counter(metrics_, "kvtier_serve_spec_rounds_total") - rounds0;
    EXPECT_GT(rounds, 40u) << "batch " << batch;
    // Only the very first round drafted (one sequence's pass; the survivals it gave stay), and
    // with no costs known it verified none of its tokens: every round counts as undrafted.
    EXPECT_EQ(Counter(metrics_, "kvtier_serve_spec_draft_passes_total") - passes0,
              batch == 1 ? 1u : 0u)
        << "batch " << batch;
    EXPECT_EQ(Counter(metrics_, "kvtier_serve_spec_rounds_undrafted_total") - undrafted0, rounds)
        << "batch " << batch;
  }
}

}  // namespace
}  // namespace kvtier::serving
