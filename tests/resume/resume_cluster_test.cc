// The resume test across nodes (label e2e): an engine saves a session through one kvtierd of
// a cluster (etcd + three kvtierd, R = 2: tests/cluster/cluster_fixture.h) and a fresh engine
// resumes it through each of the others, bit-exactly: units and hot state are found through
// the router, fetched from their owners, and the continuation's logits equal the
// uninterrupted run's bit for bit (reference (b) of tests/resume/resume_test.cc).
#include <cstring>

#include "engine/session.h"
#include "engine/state_io.h"
#include "tests/cluster/cluster_fixture.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::Argmax;
using testutil::MakeEngine;
using testutil::MiniConfig;
using testutil::MiniWeights;
using testutil::Prompt;

class ResumeAcrossNodesTest : public cluster::ClusterE2eTest {
 protected:
  std::unique_ptr<daemon::Client> EngineClient(int node) {
    daemon::ClientOptions o;
    o.socket_path = nodes_[node]->socket();
    o.token = "tok-alice";
    o.shm_bytes = 16u << 20;
    auto c = daemon::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  std::unique_ptr<SessionStore> Store(Engine* e, daemon::Client* c) {
    SessionOptions o;
    o.guard = GuardMode::kAlwaysFetch;  // resume from the cluster even when recompute is cheap
    auto fp = EngineModelFingerprint(MiniConfig(), *MiniWeights(), o.unit_tokens);
    EXPECT_TRUE(fp.ok());
    auto s = SessionStore::Create(e, c, *fp, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
};

// Logits of `steps` greedy steps from `logits` (row 0) on.
std::vector<std::vector<float>> Continue(Engine* e, SequenceState* st, std::vector<float> logits,
                                         int steps) {
  std::vector<std::vector<float>> rows;
  for (int k = 0; k < steps; ++k) {
    rows.push_back(logits);
    if (k + 1 == steps) break;
    Status s = e->Decode(st, Argmax(logits.data(), static_cast<int>(logits.size())), &logits);
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (!s.ok()) break;
  }
  return rows;
}

bool SameLogits(const std::vector<std::vector<float>>& a,
                const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].size() != b[k].size() ||
        std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

TEST_F(ResumeAcrossNodesTest, SessionSavedThroughOneNodeResumesExactlyThroughEveryOther) {
  constexpr int kSteps = 32;
  auto engine = MakeEngine();
  const auto tokens = Prompt(128, 31);
  auto c0 = EngineClient(0);
  ASSERT_NE(c0, nullptr);
  auto saver = Store(engine.get(), c0.get());
  ASSERT_NE(saver, nullptr);
  SequenceState a = engine->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(saver->Prefill(&a, tokens, &logits).ok());
  SaveCursor cursor;
  ASSERT_TRUE(saver->Save(a, logits, &cursor).ok());
  const auto ref = Continue(engine.get(), &a, logits, kSteps);

  for (int node : {1, 2}) {
    auto c = EngineClient(node);
    ASSERT_NE(c, nullptr);
    auto fresh_engine = MakeEngine();  // another host: no state in memory
    auto store = Store(fresh_engine.get(), c.get());
    ASSERT_NE(store, nullptr);
    SequenceState r;
    std::vector<float> rl;
    auto rep = store->Resume(tokens, &r, &rl);
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_EQ(rep->units_used, 2) << "node " << node;
    EXPECT_TRUE(rep->hot_state_restored) << "node " << node;
    EXPECT_FALSE(rep->recomputed) << "node " << node;
    EXPECT_TRUE(SameLogits(Continue(fresh_engine.get(), &r, rl, kSteps), ref)) << "node " << node;
  }
  // The units were fetched from peers by at least one of the resuming nodes.
  EXPECT_GT(cluster::Metric(Metrics(1), "kvtier_cluster_remote_get_hits_total") +
                cluster::Metric(Metrics(2), "kvtier_cluster_remote_get_hits_total"),
            0);
}

}  // namespace
}  // namespace kvtier::engine
