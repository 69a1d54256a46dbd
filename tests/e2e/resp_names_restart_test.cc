// End-to-end: the RESP key names survive a restart of the real kvtierd (docs/RESP.md "Names
// across restarts"). Two tenants SET and DEL keys; kvtierd is restarted gracefully (SIGTERM)
// and killed (SIGKILL, durability sync); after each start SCAN and KEYS list exactly the keys
// that survived, per tenant, deleted keys stay deleted, and FLUSHDB's effect persists.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "common/key_spec.h"
#include "tests/crash/resp_client.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/kvtierd_test.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;
using crash::RespClient;
using crash::RespReply;

constexpr int kTimeoutMs = 20000;

// 4 KiB values: the 256 KiB DRAM tier holds only the last few dozen.
std::string Value(const std::string& k) { return "value-of-" + k + std::string(4000, '.'); }

class RespNamesRestartTest : public kt::KvtierdTest {
 protected:
  RespNamesRestartTest() : KvtierdTest("kvtier_resp_names") {}
  void SetUp() override {
    KvtierdTest::SetUp();
    std::ofstream(dir_ / "tokens.toml") << "[[tenant]]\nname = \"a\"\nid = 1\ntoken_sha256 = [\""
                                        << TokenSha256Hex("token-a") << "\"]\n"
                                        << "[[tenant]]\nname = \"b\"\nid = 2\ntoken_sha256 = [\""
                                        << TokenSha256Hex("token-b") << "\"]\n";
    Configure("sync");
    ASSERT_TRUE(d_->Start()) << d_->Log();
  }
  void Configure(const std::string& durability) {
    // A DRAM tier of 256 KiB: most values are demoted to SSD before the restart.
    d_->WriteConfig("[auth]\ntokens_file = \"" + (dir_ / "tokens.toml").string() +
                    "\"\n[storage]\ndram_capacity_bytes = 262144\n"
                    "ssd_capacity_bytes = 134217728\nssd_segment_bytes = 4194304\n"
                    "durability = \"" +
                    durability + "\"\n");
  }

  std::unique_ptr<RespClient> Connect(const std::string& token) {
    auto c = RespClient::Connect(d_->resp_port(), kTimeoutMs);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return nullptr;
    auto auth = (*c)->Call({"AUTH", token});
    EXPECT_TRUE(auth.ok() && auth->type == RespReply::Type::kSimple) << auth->str;
    return std::move(*c);
  }

  static void Ok(RespClient* c, const std::vector<std::string_view>& args) {
    auto r = c->Call(args);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_NE(r->type, RespReply::Type::kError) << args[0] << ": " << r->str;
  }

  // Every key SCAN lists for the connection's tenant (COUNT 7: many steps).
  static std::set<std::string> Scan(RespClient* c) {
    std::set<std::string> names;
    std::string cursor = "0";
    int steps = 0;
    do {
      auto r = c->Call({"SCAN", cursor, "COUNT", "7"});
      EXPECT_TRUE(r.ok() && r->type == RespReply::Type::kArray && r->elems.size() == 2);
      if (!r.ok() || r->elems.size() != 2) return names;
      cursor = r->elems[0].str;
      for (const RespReply& e : r->elems[1].elems) {
        EXPECT_TRUE(names.insert(e.str).second) << "listed twice: " << e.str;
      }
    } while (cursor != "0" && ++steps < 10000);
    return names;
  }
  static std::set<std::string> Keys(RespClient* c) {
    std::set<std::string> names;
    auto r = c->Call({"KEYS", "*"});
    EXPECT_TRUE(r.ok() && r->type == RespReply::Type::kArray);
    if (r.ok()) {
      for (const RespReply& e : r->elems) names.insert(e.str);
    }
    return names;
  }
  static int64_t DbSize(RespClient* c) {
    auto r = c->Call({"DBSIZE"});
    return r.ok() && r->type == RespReply::Type::kInteger ? r->integer : -1;
  }

  // Checks SCAN, KEYS and DBSIZE of both tenants and GET of every expected key.
  void ExpectListed(const std::set<std::string>& a, const std::set<std::string>& b,
                    const std::string& when) {
    SCOPED_TRACE(when);
    auto ca = Connect("token-a");
    auto cb = Connect("token-b");
    ASSERT_TRUE(ca && cb);
    EXPECT_EQ(Scan(ca.get()), a);
    EXPECT_EQ(Keys(ca.get()), a);
    EXPECT_EQ(DbSize(ca.get()), static_cast<int64_t>(a.size()));
    EXPECT_EQ(Scan(cb.get()), b);
    EXPECT_EQ(Keys(cb.get()), b);
    for (const std::string& k : a) {
      auto r = ca->Call({"GET", k});
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(r->str, Value(k));
    }
  }

  static void Set(RespClient* c, const std::string& k, std::set<std::string>* expect) {
    std::string v = Value(k);
    Ok(c, {"SET", k, v});
    expect->insert(k);
  }
};

TEST_F(RespNamesRestartTest, ScanListsExactlyTheSurvivingKeysAfterRestartAndKill) {
  std::set<std::string> a, b;
  {
    auto ca = Connect("token-a");
    auto cb = Connect("token-b");
    ASSERT_TRUE(ca && cb);
    for (int i = 0; i < 60; ++i) Set(ca.get(), "a:" + std::to_string(i), &a);
    for (int i = 0; i < 20; ++i) Set(cb.get(), "b:" + std::to_string(i), &b);
    // One name in both tenants: each tenant lists its own.
    Set(ca.get(), "shared", &a);
    Set(cb.get(), "shared", &b);
    for (int i = 0; i < 10; ++i) {
      Ok(ca.get(), {"DEL", "a:" + std::to_string(i)});
      a.erase("a:" + std::to_string(i));
    }
    Ok(ca.get(), {"UNLINK", "a:10"});
    a.erase("a:10");
  }
  ExpectListed(a, b, "before any restart");

  ASSERT_EQ(d_->Stop(SIGTERM), 0) << d_->Log();
  ASSERT_TRUE(d_->Start()) << d_->Log();
  ExpectListed(a, b, "after a graceful restart");

  {
    auto ca = Connect("token-a");
    auto cb = Connect("token-b");
    ASSERT_TRUE(ca && cb);
    for (int i = 11; i < 20; ++i) {
      Ok(ca.get(), {"DEL", "a:" + std::to_string(i)});
      a.erase("a:" + std::to_string(i));
    }
    for (int i = 60; i < 70; ++i) Set(ca.get(), "a:" + std::to_string(i), &a);
    Ok(cb.get(), {"FLUSHDB"});
    b.clear();
    Set(cb.get(), "b:after-flush", &b);
  }
  // Under durability sync every acknowledged SET and DEL survives SIGKILL.
  d_->Stop(SIGKILL);
  ASSERT_TRUE(d_->Start()) << d_->Log();
  ExpectListed(a, b, "after kill -9");

  // The names of keys deleted while the daemon ran stay gone after yet another restart.
  ASSERT_EQ(d_->Stop(SIGTERM), 0) << d_->Log();
  ASSERT_TRUE(d_->Start()) << d_->Log();
  ExpectListed(a, b, "after a second graceful restart");
}

// Under batched the names are synced on the group-commit clock: after SIGKILL (the page cache
// survives) SCAN lists exactly the keys GET still finds.
TEST_F(RespNamesRestartTest, BatchedKillListsExactlyWhatGetFinds) {
  ASSERT_EQ(d_->Stop(SIGTERM), 0) << d_->Log();
  Configure("batched");
  ASSERT_TRUE(d_->Start()) << d_->Log();
  std::set<std::string> a;
  {
    auto ca = Connect("token-a");
    ASSERT_TRUE(ca);
    for (int i = 0; i < 80; ++i) Set(ca.get(), "k" + std::to_string(i), &a);
    for (int i = 0; i < 80; i += 3) Ok(ca.get(), {"DEL", "k" + std::to_string(i)});
  }
  // Past the 10 ms group-commit window, the deletes are durable (batched's promise).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  d_->Stop(SIGKILL);
  ASSERT_TRUE(d_->Start()) << d_->Log();
  auto ca = Connect("token-a");
  ASSERT_TRUE(ca);
  std::set<std::string> found;
  for (const std::string& k : a) {
    auto r = ca->Call({"GET", k});
    ASSERT_TRUE(r.ok());
    if (r->type == RespReply::Type::kBulk) found.insert(k);
  }
  EXPECT_FALSE(found.empty());
  for (int i = 0; i < 80; i += 3) EXPECT_FALSE(found.count("k" + std::to_string(i))) << i;
  EXPECT_EQ(Scan(ca.get()), found);
  EXPECT_EQ(Keys(ca.get()), found);
}

// Under sync a SET's name rides in its unit (one sync makes both durable) and the name log is
// no longer synced per SET, nor even written per SET (the names wait in kvtierd's memory for
// the next checkpoint, at most a second: docs/format/resp-names.md): after kill -9, with the
// log cut back to what kvtierd synced at start (the most a power loss can take from it), SCAN
// and KEYS still list every acknowledged SET, its name read back from the unit's record.
TEST_F(RespNamesRestartTest, SyncSetsAreListedAfterKillWhenTheNameLogLostItsTail) {
  std::filesystem::path log;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir_)) {
    if (e.path().filename() == "resp-names.log") log = e.path();
  }
  ASSERT_FALSE(log.empty());
  const uint64_t synced_at_start = std::filesystem::file_size(log);
  std::set<std::string> a, b;
  {
    auto ca = Connect("token-a");
    auto cb = Connect("token-b");
    ASSERT_TRUE(ca && cb);
    for (int i = 0; i < 40; ++i) Set(ca.get(), "carried:" + std::to_string(i), &a);
    Set(cb.get(), "carried:b", &b);
  }
  d_->Stop(SIGKILL);
  std::filesystem::resize_file(log, synced_at_start);
  ASSERT_TRUE(d_->Start()) << d_->Log();
  ExpectListed(a, b, "after kill -9 and the loss of the name log's tail");
}

}  // namespace
}  // namespace kvtier::daemon
