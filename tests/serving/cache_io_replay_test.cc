// CacheIo's workers completing restores on engines of their own (CacheIoOptions::replay_engine),
// against a real kvtierd: a restore completed on a worker (the bounded replay, or the hot state
// imported) gives the state, logits and report that the scheduler's own completion of the same
// fetch gives (SessionCodec::Complete on its engine), bit for bit, and is accounted there.
// The miniature with random weights: a state computed any other way changes its bits.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "engine/session.h"
#include "serving/cache_io.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/speculative_test_util.h"

namespace kvtier::serving {
namespace {

// A restore's result, taken as the worker reports it finished.
class Restores {
 public:
  std::function<void()> Wake() {
    return [this] {
      std::lock_guard l(mu_);
      ++wakes_;
      cv_.notify_all();
    };
  }
  // Waits for `io`'s next finished restore (60 s at most).
  CacheIo::RestoreResult Next(CacheIo* io) {
    std::vector<CacheIo::RestoreResult> got;
    std::unique_lock l(mu_);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (got.empty() && std::chrono::steady_clock::now() < end) {
      l.unlock();
      got = io->TakeRestores();
      l.lock();
      if (got.empty()) cv_.wait_until(l, end, [&, seen = wakes_] { return wakes_ != seen; });
    }
    EXPECT_EQ(got.size(), 1u);
    return got.empty() ? CacheIo::RestoreResult{} : std::move(got.front());
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t wakes_ = 0;
};

class CacheIoReplayTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtier_cache_io_replay_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    daemon_ = std::make_unique<kvtier::testing::KvtierdProcess>(dir_);
    daemon_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 33554432\nssd_capacity_bytes = 268435456\n"
        "ssd_segment_bytes = 16777216\n");
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
    engine_ = engine::testutil::MakeEngine(1);
    session_.keep_hot_state = session_.use_hot_state = GetParam();
    session_.replay_tokens = 3 * 16;  // not the default 2 W: the workers' codecs must use it
    session_.guard = engine::GuardMode::kAlwaysFetch;
    auto fp = engine::EngineModelFingerprint(
        engine::testutil::MiniConfig(), *engine::testutil::MiniWeights(), session_.unit_tokens);
    ASSERT_TRUE(fp.ok()) << fp.status().ToString();
    fingerprint_ = *fp;
  }
  void TearDown() override {
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }

  // Saves `tokens`' state (its units, and its hot state when the param says so) as the
  // scheduler does after a turn.
  void Save(const std::vector<int32_t>& tokens) {
    daemon::ClientOptions co;
    co.socket_path = daemon_->socket();
    co.unit_tokens = session_.unit_tokens;
    auto client = daemon::Client::Connect(co);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    auto store = engine::SessionStore::Create(engine_.get(), client->get(), fingerprint_, session_);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    engine::SequenceState st = engine_->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(engine_->Forward(&st, tokens, false, &logits).ok());
    engine::SaveCursor cursor;
    ASSERT_TRUE((*store)->Save(st, logits, &cursor).ok());
  }

  std::unique_ptr<CacheIo> Start(bool replay_engines, Restores* restores) {
    CacheIoOptions o;
    o.daemon.socket_path = daemon_->socket();
    o.engine = engine_.get();
    o.session = session_;
    o.fingerprint = fingerprint_;
    o.threads = 2;
    if (replay_engines) {
      o.replay_engine = [this]() -> StatusOr<std::unique_ptr<engine::Engine>> {
        ++engines_made_;
        return engine::testutil::MakeEngine(1);
      };
    }
    auto io = CacheIo::Create(o, &metrics_, restores->Wake());
    EXPECT_TRUE(io.ok()) << io.status().ToString();
    return io.ok() ? std::move(io).value() : nullptr;
  }

  std::filesystem::path dir_;
  std::unique_ptr<kvtier::testing::KvtierdProcess> daemon_;
  std::unique_ptr<engine::Engine> engine_;
  engine::SessionOptions session_;
  Digest fingerprint_{};
  ServingMetrics metrics_;
  Tenant tenant_{"t", "", {}};
  int engines_made_ = 0;
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A 4-page history plus 21 tokens saved; a continuation of it (history + 9 tokens) restored
// through a CacheIo whose workers have engines (completed there) and through one whose workers
// have none (completed here, on the step engine, as the scheduler does): the same state, logits
// and report, bit for bit; with the hot state off the restore replayed session_.replay_tokens.
TEST_P(CacheIoReplayTest, AWorkerCompletesARestoreAsTheStepEngineWould) {
  const bool hot = GetParam();
  std::vector<int32_t> history;
  for (int i = 0; i < 4 * 64 + 21; ++i) history.push_back(3 + (i * 37 + 11) % 500);
  ASSERT_NO_FATAL_FAILURE(Save(history));
  std::vector<int32_t> prompt = history;
  for (int i = 0; i < 9; ++i) prompt.push_back(7 + i * 13);

  Restores on_worker_done, on_step_done;
  auto on_worker = Start(true, &on_worker_done);
  auto on_step = Start(false, &on_step_done);
  ASSERT_NE(on_worker, nullptr);
  ASSERT_NE(on_step, nullptr);
  EXPECT_EQ(engines_made_, 2) << "one engine per worker";

  on_worker->SubmitRestore(1, &tenant_, prompt, 0);
  CacheIo::RestoreResult w = on_worker_done.Next(on_worker.get());
  ASSERT_TRUE(w.asked);
  ASSERT_TRUE(w.status.ok()) << w.status.ToString();
  ASSERT_TRUE(w.completed);
  EXPECT_TRUE(w.fetched.state.tokens.empty()) << "the fetch went into the completed state";

  on_step->SubmitRestore(2, &tenant_, prompt, 0);
  CacheIo::RestoreResult s = on_step_done.Next(on_step.get());
  ASSERT_TRUE(s.asked);
  ASSERT_TRUE(s.status.ok()) << s.status.ToString();
  ASSERT_FALSE(s.completed);
  auto codec = engine::SessionCodec::Create(engine_.get(), fingerprint_, session_);
  ASSERT_TRUE(codec.ok()) << codec.status().ToString();
  engine::SequenceState state;
  std::vector<float> logits;
  auto rep = codec->Complete(prompt, std::move(s.fetched), &state, &logits);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();

  EXPECT_EQ(w.report.restored_tokens, rep->restored_tokens);
  EXPECT_EQ(w.report.hot_state_restored, rep->hot_state_restored);
  EXPECT_EQ(w.report.replay_tokens, rep->replay_tokens);
  EXPECT_EQ(w.report.units_used, rep->units_used);
  EXPECT_EQ(rep->hot_state_restored, hot);
  EXPECT_EQ(rep->replay_tokens, hot ? 0 : 3 * 16);
  EXPECT_EQ(rep->restored_tokens, static_cast<int64_t>(hot ? history.size() : 4 * 64));
  EXPECT_TRUE(engine::testing_spec::SameState(w.state, state));
  EXPECT_TRUE(SameBits(w.logits, logits)) << "last logits";
  ASSERT_FALSE(logits.empty());
}

// Restores completed on two workers' engines while the step engine runs passes of its own on
// this thread (the scheduler's steps): every one as the first, and the step engine's decoding
// as it is alone. The engines share only the immutable weights (the TSan run's concern).
TEST_P(CacheIoReplayTest, WorkersCompleteRestoresWhileTheStepEngineRuns) {
  std::vector<int32_t> history;
  for (int i = 0; i < 3 * 64 + 5; ++i) history.push_back(3 + (i * 29 + 5) % 500);
  ASSERT_NO_FATAL_FAILURE(Save(history));
  std::vector<int32_t> prompt = history;
  prompt.push_back(42);
  Restores done;
  auto io = Start(true, &done);
  ASSERT_NE(io, nullptr);
  constexpr int kRestores = 6;
  for (int i = 0; i < kRestores; ++i)
    io->SubmitRestore(static_cast<uint64_t>(i + 1), &tenant_, prompt, 0);

  // The step engine decodes (and its reference, alone, after) while the restores run.
  std::vector<int32_t> steps(40);
  for (size_t i = 0; i < steps.size(); ++i) steps[i] = 5 + static_cast<int32_t>(i * 7 % 400);
  auto decode_all = [&](std::vector<float>* logits) {
    engine::SequenceState st = engine_->NewSequence();
    for (int32_t t : steps) ASSERT_TRUE(engine_->Decode(&st, t, logits).ok());
  };
  std::vector<CacheIo::RestoreResult> results;
  std::vector<float> beside;
  for (int round = 0; results.size() < kRestores && round < 10000; ++round) {
    ASSERT_NO_FATAL_FAILURE(decode_all(&beside));
    for (auto& r : io->TakeRestores()) results.push_back(std::move(r));
  }
  ASSERT_EQ(results.size(), static_cast<size_t>(kRestores));
  std::vector<float> alone;
  ASSERT_NO_FATAL_FAILURE(decode_all(&alone));
  EXPECT_TRUE(SameBits(beside, alone));
  for (const CacheIo::RestoreResult& r : results) {
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_TRUE(r.completed);
    EXPECT_TRUE(engine::testing_spec::SameState(r.state, results[0].state)) << "restore " << r.id;
    EXPECT_TRUE(SameBits(r.logits, results[0].logits)) << "restore " << r.id;
  }
  EXPECT_EQ(results[0].report.replay_tokens, GetParam() ? 0 : 3 * 16);
}

INSTANTIATE_TEST_SUITE_P(HotStateOnOff, CacheIoReplayTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "HotState" : "Replay"; });

}  // namespace
}  // namespace kvtier::serving
