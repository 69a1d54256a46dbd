// `kvtier-engine serve` over a kvtierd cluster: two servers, each on its own node, share one
// cache. A conversation saved through one node's server resumes through the other's, as an
// agent platform's load balancer would send its turns, and tenants stay apart across nodes.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/cluster/cluster_fixture.h"
#include "tests/serving/prompt_text.h"
#include "tests/serving/serve_process.h"

namespace kvtier::cluster {
namespace {

using nlohmann::json;
constexpr char kAlice[] = "sk-alice-0123456789";
constexpr char kBob[] = "sk-bob-0123456789";

class ClusterServeTest : public ClusterE2eTest {
 protected:
  // A server on node i's socket; nothing stays resident in it, so a hit can only come from the
  // cluster.
  std::unique_ptr<kt::ServeProcess> StartServer(int i) {
    std::ofstream(dir_ / "keys.json")
        << json{{"keys",
                 {{{"key", kAlice}, {"tenant", "alice"}, {"daemon_token", "tok-alice"}},
                  {{"key", kBob}, {"tenant", "bob"}, {"daemon_token", "tok-bob"}}}}};
    auto s = std::make_unique<kt::ServeProcess>(dir_ / ("serve" + std::to_string(i)));
    EXPECT_TRUE(
        s->Start({"--socket", nodes_[i]->socket(), "--api-keys", (dir_ / "keys.json").string(),
                  "--guard", "fetch", "--idle-sequences-max", "0"}))
        << s->Log();
    return s;
  }
  static kt::HttpReply Post(const kt::ServeProcess& s, const json& body, const char* key) {
    return kt::Http(s.port(), "POST", "/v1/chat/completions", body.dump(), key);
  }
};

TEST_F(ClusterServeTest, ASessionSavedThroughOneNodeResumesThroughAnother) {
  std::unique_ptr<kt::ServeProcess> a = StartServer(0), b = StartServer(1);
  json msgs = json::array({{{"role", "user"}, {"content", kt::PromptText(400, 3)}}});
  kt::HttpReply r1 = Post(*a, kt::GreedyChat(msgs, 24), kAlice);
  ASSERT_EQ(r1.status, 200) << r1.body << a->Log();
  const json u1 = r1.Json()["usage"];
  // Every sampled token but the last was forwarded into the sequence.
  const int64_t whole =
      u1["prompt_tokens"].get<int64_t>() + u1["completion_tokens"].get<int64_t>() - 1;
  ASSERT_GT(whole, 3 * 64);
  msgs.push_back(
      {{"role", "assistant"}, {"content", r1.Json()["choices"][0]["message"]["content"]}});
  msgs.push_back({{"role", "user"}, {"content", "and then?"}});

  // alice's turn 2, sent at once through node 1, restores all of turn 1 (its units and hot
  // state, wherever the cluster placed them): a server saves a turn before its last event.
  kt::HttpReply r2 = Post(*b, kt::GreedyChat(msgs, 8), kAlice);
  ASSERT_EQ(r2.status, 200) << r2.body << b->Log();
  EXPECT_EQ(r2.Json()["usage"]["prompt_tokens_details"]["cached_tokens"], whole) << b->Log();
  // bob's identical conversation through node 1 hits nothing of alice's.
  kt::HttpReply rb = Post(*b, kt::GreedyChat(msgs, 8), kBob);
  ASSERT_EQ(rb.status, 200) << rb.body << b->Log();
  EXPECT_EQ(rb.Json()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const std::string m = kt::Http(b->port(), "GET", "/metrics").body;
  EXPECT_EQ(kt::Metric(m, "kvtier_serve_resume_hits_total"), 1) << m;
  // (Node 0 stored nothing on node 1 itself: each unit reached node 1 through the peer
  // protocol, as a PUT forwarded to an owner or a GET fetched from one, whichever placement
  // chose.)
}

}  // namespace
}  // namespace kvtier::cluster
