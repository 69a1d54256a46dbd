// End-to-end, the real kvtierd under durability "sync": the keys of one multi-key RESP command
// (MSET, DEL / UNLINK of several keys) share one durable commit, and the reply waits for it;
// DELs pipelined on one connection share commits too, and their replies keep request order
// among pending SETs (docs/RESP.md "Durable SETs and DELs under sync"). Commits are counted by the
// daemon's own kvtier_ssd_commits_total on /metrics, never timed. After an acknowledged MSET or
// DEL and kill -9, a restart serves exactly what was acknowledged.
//
// The timed group commit is off (group_commit_ms: one hour), so every commit is a request's,
// and a put or delete that no commit covered stays in the process (the SSD tier's write
// buffer, its pending index operations): kill -9 loses it, so an acknowledgement sent before
// the commit shows.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/crash/resp_client.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/kvtierd_test.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;
using crash::RespClient;
using crash::RespReply;

constexpr int kTimeoutMs = 20000;

// About 1 KB, different for every key and round.
std::string Value(int key, int round) {
  return "v" + std::to_string(key) + ":" + std::to_string(round) + ":" + std::string(1000, 'x');
}

class RespMultiKeySyncTest : public kt::KvtierdTest {
 protected:
  RespMultiKeySyncTest() : KvtierdTest("kvtier_resp_multikey") {}
  void SetUp() override {
    KvtierdTest::SetUp();
    d_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 8388608\nssd_capacity_bytes = 134217728\n"
        "ssd_segment_bytes = 4194304\ndurability = \"sync\"\ngroup_commit_ms = 3600000\n");
    ASSERT_TRUE(d_->Start()) << d_->Log();
  }

  std::unique_ptr<RespClient> Connect() {
    auto c = RespClient::Connect(d_->resp_port(), kTimeoutMs);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  static RespReply Call(RespClient* c, const std::vector<std::string>& args) {
    auto r = c->Call(std::vector<std::string_view>(args.begin(), args.end()));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : RespReply{RespReply::Type::kError, "no reply"};
  }

  uint64_t Commits() {
    const std::string page = kt::HttpRequest(d_->http_port(), "GET", "/metrics");
    const std::string name = "\nkvtier_ssd_commits_total ";
    const size_t at = page.find(name);
    return at == std::string::npos ? ~0ull : std::stoull(page.substr(at + name.size()));
  }
  // The commit count once it reached at_least (the SSD tier counts a commit after it released
  // its waiters, so the reply can come first), read again a moment later: a further commit
  // the command caused would show.
  uint64_t SettledCommits(uint64_t at_least) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (Commits() < at_least && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return Commits();
  }
  // A SET and its commit counted: what a test counts from.
  uint64_t Warm(RespClient* c) {
    const uint64_t before = Commits();
    EXPECT_EQ(Call(c, {"SET", "warm", "x"}).str, "OK");
    return SettledCommits(before + 1);
  }

  // Sends cmds as one pipeline and returns the replies (empty on an error, reported).
  static std::vector<RespReply> Pipeline(RespClient* c,
                                         const std::vector<std::vector<std::string>>& cmds) {
    auto r = c->Pipeline(cmds);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : std::vector<RespReply>{};
  }

  void Kill9AndRestart() {
    d_->Stop(SIGKILL);
    ASSERT_TRUE(d_->Start()) << d_->Log();
  }

  // After a restart: of keys [0, n), the even ones (deleted) are absent and the odd ones hold
  // their values of `round`; DBSIZE counts the odd ones.
  void ExpectEvenKeysDeleted(int n, int round) {
    auto c = Connect();
    ASSERT_TRUE(c);
    const RespReply got = Call(c.get(), Keys("MGET", 0, n));
    ASSERT_EQ(got.elems.size(), size_t(n));
    int back = 0, lost = 0;
    for (int k = 0; k < n; ++k) {
      if (k % 2 == 0) {
        back += got.elems[k].type != RespReply::Type::kNil;
      } else {
        lost += got.elems[k].str != Value(k, round);
      }
    }
    EXPECT_EQ(back, 0) << "deleted keys came back after kill -9";
    EXPECT_EQ(lost, 0) << "keys not deleted lost their values";
    EXPECT_EQ(Call(c.get(), {"DBSIZE"}).integer, n / 2);
  }

  // MSET of keys [first, first + n) with their values of `round`.
  static std::vector<std::string> Mset(int first, int n, int round) {
    std::vector<std::string> args = {"MSET"};
    for (int k = first; k < first + n; ++k) {
      args.push_back("key:" + std::to_string(k));
      args.push_back(Value(k, round));
    }
    return args;
  }
  static std::vector<std::string> Keys(const char* cmd, int first, int n, int step = 1) {
    std::vector<std::string> args = {cmd};
    for (int k = first; k < first + n; k += step) args.push_back("key:" + std::to_string(k));
    return args;
  }
};

// One MSET of 200 keys is one commit (it used to be 200: one per key).
TEST_F(RespMultiKeySyncTest, MsetOfManyKeysIsOneCommit) {
  constexpr int kKeys = 200;
  auto c = Connect();
  ASSERT_TRUE(c);
  for (int round = 0; round < 3; ++round) {
    const uint64_t commits0 = Warm(c.get());
    ASSERT_EQ(Call(c.get(), Mset(0, kKeys, round)).str, "OK");
    EXPECT_EQ(SettledCommits(commits0 + 1) - commits0, 1u) << "round " << round;
  }
}

// One DEL (and one UNLINK) of 100 keys, two of them absent, is one commit (it used to be one
// per key) and counts the keys that existed.
TEST_F(RespMultiKeySyncTest, DelOfManyKeysIsOneCommit) {
  auto c = Connect();
  ASSERT_TRUE(c);
  ASSERT_EQ(Call(c.get(), Mset(0, 196, 0)).str, "OK");
  for (const char* cmd : {"DEL", "UNLINK"}) {
    const int first = cmd[0] == 'D' ? 0 : 100;
    const uint64_t commits0 = Warm(c.get());
    const RespReply r = Call(c.get(), Keys(cmd, first, 100));
    ASSERT_EQ(r.type, RespReply::Type::kInteger) << cmd << ": " << r.str;
    EXPECT_EQ(r.integer, first == 0 ? 100 : 96) << cmd;
    EXPECT_EQ(SettledCommits(commits0 + 1) - commits0, 1u) << cmd;
  }
}

// Acknowledged MSETs of 300 keys (one of them too long to ride in its unit: it goes through
// the name log's sync), each round overwriting the last, survive kill -9: after each restart
// every key holds its last acknowledged value.
TEST_F(RespMultiKeySyncTest, AcknowledgedMsetSurvivesKill9) {
  constexpr int kKeys = 300;
  const std::string long_key(5000, 'L');
  for (int round = 0; round < 3; ++round) {
    {
      auto c = Connect();
      ASSERT_TRUE(c);
      std::vector<std::string> mset = Mset(0, kKeys, round);
      mset.insert(mset.end(), {long_key, Value(-1, round)});
      ASSERT_EQ(Call(c.get(), mset).str, "OK") << round;
    }
    Kill9AndRestart();
    auto c = Connect();
    ASSERT_TRUE(c);
    const RespReply got = Call(c.get(), Keys("MGET", 0, kKeys));
    ASSERT_EQ(got.elems.size(), size_t{kKeys}) << round;
    int wrong = 0;
    for (int k = 0; k < kKeys; ++k) {
      if (got.elems[k].type != RespReply::Type::kBulk || got.elems[k].str != Value(k, round)) {
        ++wrong;
      }
    }
    EXPECT_EQ(wrong, 0) << "round " << round << ": keys without their acknowledged value";
    EXPECT_EQ(Call(c.get(), {"GET", long_key}).str, Value(-1, round)) << round;
  }
}

// An acknowledged DEL of 100 of 200 keys (every other one) survives kill -9: the deleted keys
// stay gone, the others keep their values, and DBSIZE counts the survivors.
TEST_F(RespMultiKeySyncTest, AcknowledgedDelOfManyKeysSurvivesKill9) {
  constexpr int kKeys = 200;
  {
    auto c = Connect();
    ASSERT_TRUE(c);
    ASSERT_EQ(Call(c.get(), Mset(0, kKeys, 7)).str, "OK");
    const RespReply r = Call(c.get(), Keys("DEL", 0, kKeys, 2));
    ASSERT_EQ(r.type, RespReply::Type::kInteger) << r.str;
    ASSERT_EQ(r.integer, kKeys / 2);
  }
  Kill9AndRestart();
  ExpectEvenKeysDeleted(kKeys, 7);
}

// 64 one-key DELs pipelined in one write share commits: each removal is made when its DEL
// runs, and the DELs run on without waiting for each other's commit (it used to be one commit
// per DEL: 64). Each reply still counts its own key, an absent key's DEL among them too.
TEST_F(RespMultiKeySyncTest, PipelinedDelsShareCommits) {
  constexpr int kKeys = 64;
  auto c = Connect();
  ASSERT_TRUE(c);
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(Call(c.get(), Mset(0, kKeys, round)).str, "OK");
    const uint64_t commits0 = Warm(c.get());
    std::vector<std::vector<std::string>> dels;
    for (int k = 0; k < kKeys; ++k) {
      dels.push_back({k % 2 == 0 ? "DEL" : "UNLINK", "key:" + std::to_string(k)});
      if (k == kKeys / 2) dels.push_back({"DEL", "absent"});
    }
    const std::vector<RespReply> r = Pipeline(c.get(), dels);
    ASSERT_EQ(r.size(), dels.size());
    for (size_t i = 0; i < r.size(); ++i) {
      ASSERT_EQ(r[i].type, RespReply::Type::kInteger) << i << ": " << r[i].str;
      EXPECT_EQ(r[i].integer, dels[i][1] == "absent" ? 0 : 1) << i;
    }
    // A DEL whose commit is its own makes 64; a few commits can cover all of them (the first
    // DEL's commit may start before the others are read).
    const uint64_t commits = SettledCommits(commits0 + 1) - commits0;
    EXPECT_GE(commits, 1u) << "round " << round;
    EXPECT_LE(commits, uint64_t{kKeys / 8}) << "round " << round;
  }
}

// DELs pipelined among pending SETs see the SETs before them and their replies keep request
// order: a SET's key deleted right after it, deleted again (0), set again and read back, a
// key too long to ride in its unit (its SET goes through the put thread, so the DEL behind it
// waits until it is put), an MSET then an UNLINK of its keys.
TEST_F(RespMultiKeySyncTest, PipelinedDelsKeepOrderAmongPendingSets) {
  const std::string long_key(5000, 'L');
  auto c = Connect();
  ASSERT_TRUE(c);
  for (int round = 0; round < 3; ++round) {
    const std::vector<std::vector<std::string>> cmds = {
        {"SET", "a", Value(1, round)},   // +OK
        {"DEL", "a"},                    // :1
        {"DEL", "a"},                    // :0
        {"SET", "a", Value(2, round)},   // +OK
        {"SET", long_key, "l"},          // +OK (the put thread)
        {"DEL", long_key, "a", "b"},     // :2
        {"GET", "a"},                    // nil
        {"MSET", "a", "x", "b", "y"},    // +OK
        {"UNLINK", "b", "a", "c"},       // :2
        {"EXISTS", "a", "b", long_key},  // :0
    };
    const std::vector<RespReply> r = Pipeline(c.get(), cmds);
    ASSERT_EQ(r.size(), cmds.size());
    using T = RespReply::Type;
    const std::vector<std::pair<T, int64_t>> want = {
        {T::kSimple, 0},  {T::kInteger, 1}, {T::kInteger, 0}, {T::kSimple, 0},  {T::kSimple, 0},
        {T::kInteger, 2}, {T::kNil, 0},     {T::kSimple, 0},  {T::kInteger, 2}, {T::kInteger, 0}};
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_EQ(r[i].type, want[i].first)
          << "round " << round << ", reply " << i << ": " << r[i].str;
      if (want[i].first == T::kInteger) {
        EXPECT_EQ(r[i].integer, want[i].second) << i;
      } else if (want[i].first == T::kSimple) {
        EXPECT_EQ(r[i].str, "OK") << i;
      }
    }
  }
}

// Acknowledged DELs pipelined one key each (every other key of 200) survive kill -9: each
// reply was sent only once its removal was durable.
TEST_F(RespMultiKeySyncTest, AcknowledgedPipelinedDelsSurviveKill9) {
  constexpr int kKeys = 200;
  {
    auto c = Connect();
    ASSERT_TRUE(c);
    ASSERT_EQ(Call(c.get(), Mset(0, kKeys, 5)).str, "OK");
    std::vector<std::vector<std::string>> dels;
    for (int k = 0; k < kKeys; k += 2) dels.push_back({"DEL", "key:" + std::to_string(k)});
    const std::vector<RespReply> r = Pipeline(c.get(), dels);
    ASSERT_EQ(r.size(), dels.size());
    for (const RespReply& one : r) ASSERT_EQ(one.integer, 1) << one.str;
  }
  Kill9AndRestart();
  ExpectEvenKeysDeleted(kKeys, 5);
}

}  // namespace
}  // namespace kvtier::daemon
