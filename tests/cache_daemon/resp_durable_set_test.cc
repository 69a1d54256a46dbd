// RESP SETs under durability "sync", completed asynchronously (cache_daemon/resp_durable_sets.h)
// in an in-process daemon over a real TierManager whose SSD tier sits on a FaultInjectionEnv:
// with the SSD fdatasync held, SETs pipelined on one connection and SETs of several connections
// all get queued behind the held commit and then share one or two commits (counted by the
// store's commit counter, not by time); replies keep request order, and a command after a SET
// sees that SET's effect; a failed commit answers the SET with an error and leaves no value.
// The same for MSET (its keys one group: one commit, one reply), a DEL of several keys, and
// DELs pipelined behind a held commit.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "cache_daemon/daemon.h"
#include "cache_daemon/service.h"
#include "common/temp_dir.h"
#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/tier_manager.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/cache_daemon/resp_wire_util.h"
#include "tests/storage/wal_sync_faults.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;

using kvtier::testing::Bulk;
using kvtier::testing::Cmd;

// n bytes, different for every seed (the pattern alone repeats every 2 seeds: the seed is
// written first, so that finding a value proves which SET stored it).
std::string Value(size_t n, int seed) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>('a' + (i * 7 + seed * 13) % 26);
  const std::string tag = std::to_string(seed) + ":";
  v.replace(0, std::min(n, tag.size()), tag, 0, std::min(n, tag.size()));
  return v;
}

// A command of any number of arguments.
std::string CmdOf(const std::vector<std::string>& args) {
  std::string s = "*" + std::to_string(args.size()) + "\r\n";
  for (const std::string& a : args) s += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
  return s;
}

// Polls until done holds, at most 10 s (the test then fails instead of hanging).
template <typename F>
bool Eventually(F done) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class RespDurableSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    o_.data_dir = dir_.path();
    o_.socket_path = dir_.path() + "/s.sock";
    o_.native_port = kt::FreePort();
    o_.resp_port = kt::FreePort();
    o_.http_port = kt::FreePort();
    o_.io_threads = 2;
    o_.storage.dram_capacity_bytes = 16ull << 20;
    o_.storage.slab_page_bytes = 256 << 10;
    o_.storage.ssd_capacity_bytes = 64ull << 20;
    o_.storage.ssd_segment_bytes = 4ull << 20;
    o_.storage.ssd_write_buffer_bytes = 256 << 10;
    o_.storage.durability = storage::Durability::kSync;
    o_.storage.group_commit_ms = 3'600'000;  // no timed commit: every commit is a SET's
    ASSERT_TRUE(Finalize(&o_).ok());
    std::filesystem::create_directories(o_.storage.data_dir);
    storage::TierManagerOptions so = o_.storage;
    so.ssd_env = &fault_;
    so.ssd_index_env = index_env_.get();
    auto tm = storage::TierManager::Open(so);
    ASSERT_TRUE(tm.ok()) << tm.status().ToString();
    store_ = tm->get();
    auto tenants = TenantRegistry::Open(secret_, kInflightMax);
    tenant_ = tenants->default_tenant();
    auto d = Daemon::Start(o_, std::move(tm).value(), std::move(tenants), nullptr);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    daemon_ = std::move(d).value();
  }
  void TearDown() override {
    fault_.PauseSyncs(false);
    for (int fd : fds_) ::close(fd);
    if (daemon_) {
      daemon_->Shutdown();
      EXPECT_TRUE(daemon_->Wait().ok());
    }
  }
  int Connect() {
    int fd = kt::ConnectTcp(o_.resp_port);
    EXPECT_GE(fd, 0);
    fds_.push_back(fd);
    return fd;
  }
  static std::string Roundtrip(int fd, const std::string& cmds, size_t want_bytes) {
    EXPECT_TRUE(kt::SendAllRaw(fd, cmds.data(), cmds.size()));
    return kt::RecvFor(fd, want_bytes, 10000);
  }
  uint64_t Metric(const std::string& name) {
    std::string page = kt::HttpRequest(o_.http_port, "GET", "/metrics");
    size_t at = page.find("\n" + name + " ");
    if (at == std::string::npos) return ~0ull;
    return std::stoull(page.substr(at + name.size() + 2));
  }
  uint64_t commits() { return store_->GetStats().ssd_commits; }
  // Why SETs are not all pending: the gauge, the held syncs, refusals by the in-flight limit.
  std::string PendingState() {
    return "pending " + std::to_string(Metric("kvtier_resp_durable_sets_pending")) +
           ", syncs held " + std::to_string(fault_.syncs_waiting()) + ", in-flight refusals " +
           std::to_string(Metric("kvtier_tenant_inflight_rejections_total"));
  }
  // The warm-up SET's commit is counted: the SSD tier releases a commit's waiters (the reply
  // goes out) before it counts the commit, so a count read right after the reply can still
  // miss it, and the test would then charge it to the SETs under test.
  bool WarmCommitCounted(uint64_t before) {
    return Eventually([&] { return commits() > before; });
  }
  // Whether the store holds `value` under RESP key `name` (read from the store, not over
  // RESP: a GET would wait behind the connection's pending SETs).
  bool Stored(std::string_view name, std::string_view value) {
    std::vector<uint8_t> raw;
    if (!store_->Get(keys_.BindResp(*tenants_->default_tenant(), name), &raw).ok()) return false;
    uint64_t expire_at = 0;
    size_t at = 0;
    return DecodeRespEnvelope(raw, &expire_at, &at) &&
           std::string_view(reinterpret_cast<const char*>(raw.data()) + at, raw.size() - at) ==
               value;
  }

  // The default tenant's in-flight limit: the 64 pipelined SETs below use all of it.
  static constexpr uint32_t kInflightMax = 64;
  TempDir dir_;
  std::unique_ptr<storage::DeviceEnv> base_ = storage::NewMemEnv();
  storage::FaultInjectionEnv fault_{base_.get(), {}};
  // The SSD index's file system: its write-ahead log's syncs fail on demand.
  std::shared_ptr<kvtier::testing::WalSyncFaults> index_faults_ =
      std::make_shared<kvtier::testing::WalSyncFaults>();
  std::unique_ptr<rocksdb::Env> index_env_ = rocksdb::NewCompositeEnv(index_faults_);
  std::vector<uint8_t> secret_ = std::vector<uint8_t>(32, 7);
  DaemonOptions o_;
  storage::TierManager* store_ = nullptr;  // owned by daemon_
  const Tenant* tenant_ = nullptr;         // the daemon's default tenant (owned by daemon_)
  std::unique_ptr<Daemon> daemon_;
  std::vector<int> fds_;
  // The daemon's tenants (the same secret: the same default tenant) and key binding.
  std::unique_ptr<TenantRegistry> tenants_ = TenantRegistry::Open(secret_, 64);
  DaemonMetrics metrics_;
  Service keys_{nullptr, tenants_.get(), &metrics_, nullptr, PolicySettings{}};
};

// 64 SETs pipelined on one connection while the first commit's fdatasync is held: all of them
// are taken and put (none waits for another's commit), and once released they share one more
// commit (two in all: the held one and one for the SETs put behind it). A GET pipelined after them
// reads the last value.
TEST_F(RespDurableSetTest, PipelinedSetsOfOneConnectionShareCommits) {
  constexpr int kSets = kInflightMax;
  int fd = Connect();
  const uint64_t before_warm = commits();
  ASSERT_EQ(Roundtrip(fd, Cmd({"SET", "warm", "x"}), 5), "+OK\r\n");
  ASSERT_TRUE(WarmCommitCounted(before_warm));
  uint64_t commits0 = commits(), batches0 = Metric("kvtier_resp_durable_set_batches_total");
  fault_.PauseSyncs(true);
  std::string cmds, want;
  for (int i = 0; i < kSets; ++i) {
    cmds += Cmd({"SET", "k" + std::to_string(i % 8), Value(1000, i)});
    want += "+OK\r\n";
  }
  cmds += Cmd({"GET", "k7"});
  want += Bulk(Value(1000, kSets - 1));
  ASSERT_TRUE(kt::SendAllRaw(fd, cmds.data(), cmds.size()));
  bool queued = Eventually([&] {
    if (fault_.syncs_waiting() != 1 || Metric("kvtier_resp_durable_sets_pending") != kSets) {
      return false;
    }
    for (int k = 0; k < 8; ++k) {  // every SET put (puts run in order: the last ones hold)
      if (!Stored("k" + std::to_string(k), Value(1000, kSets - 8 + k))) return false;
    }
    return true;
  });
  const std::string state = queued ? "" : PendingState();
  fault_.PauseSyncs(false);
  ASSERT_TRUE(queued) << "pipelined SETs waited for each other's commit (" << state << ")";
  EXPECT_EQ(kt::RecvFor(fd, want.size(), 10000), want);
  uint64_t n = commits() - commits0;
  EXPECT_GE(n, 1u);
  // One commit per SET would be 64. (A third one was counted when the wait above took a
  // value equal to the last SET's, written by an earlier SET, for the last SET's: it was then
  // put after the second commit began. Value() now differs for every SET.)
  EXPECT_LE(n, 2u) << "pipelined sync SETs did not share commits";
  EXPECT_GE(Metric("kvtier_resp_durable_set_batches_total") - batches0, 1u);
  EXPECT_EQ(Metric("kvtier_resp_durable_sets_pending"), 0u);
}

// A SET's in-flight slot is free once its reply reached the client. The commit thread writes
// a lone SET's "+OK" itself (the way back without a hand-off); the connection's bookkeeping
// runs later, so a slot freed there could still be taken after the client had the reply, and
// a client that then pipelines the tenant's whole limit (as the test above does after its
// warm-up SET) would be refused one request.
TEST_F(RespDurableSetTest, ASetsInflightSlotIsFreeWhenItsReplyArrives) {
  int fd = Connect();
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(Roundtrip(fd, Cmd({"SET", "k", std::to_string(i)}), 5), "+OK\r\n");
    ASSERT_EQ(tenant_->inflight.load(), 0u) << "SET " << i << "'s slot outlived its reply";
  }
  // The way under test: replies written by the commit thread (counted by the bookkeeping).
  EXPECT_TRUE(
      Eventually([&] { return Metric("kvtier_resp_durable_set_direct_replies_total") > 0; }));
}

// SETs of 8 connections while a commit is held: each connection's PING before its SETs is
// answered at once (replies before a pending SET are not held back), all 16 SETs are queued,
// and once released they share one more commit.
TEST_F(RespDurableSetTest, SetsOfManyConnectionsShareCommits) {
  constexpr int kConns = 8;
  std::vector<int> fds;
  for (int i = 0; i < kConns; ++i) fds.push_back(Connect());
  const uint64_t before_warm = commits();
  ASSERT_EQ(Roundtrip(fds[0], Cmd({"SET", "warm", "x"}), 5), "+OK\r\n");
  ASSERT_TRUE(WarmCommitCounted(before_warm));
  uint64_t commits0 = commits();
  fault_.PauseSyncs(true);
  for (int i = 0; i < kConns; ++i) {
    std::string c = Cmd({"PING"}) + Cmd({"SET", "a" + std::to_string(i), Value(900, i)}) +
                    Cmd({"SET", "b" + std::to_string(i), Value(50000, i)});
    ASSERT_TRUE(kt::SendAllRaw(fds[i], c.data(), c.size()));
    EXPECT_EQ(kt::RecvFor(fds[i], 7, 10000), "+PONG\r\n") << i;
  }
  bool queued = Eventually([&] {
    if (fault_.syncs_waiting() != 1 || Metric("kvtier_resp_durable_sets_pending") != 2 * kConns) {
      return false;
    }
    for (int i = 0; i < kConns; ++i) {  // every SET put
      if (!Stored("a" + std::to_string(i), Value(900, i)) ||
          !Stored("b" + std::to_string(i), Value(50000, i))) {
        return false;
      }
    }
    return true;
  });
  fault_.PauseSyncs(false);
  ASSERT_TRUE(queued) << "SETs of other connections waited for a commit they could share";
  for (int i = 0; i < kConns; ++i) EXPECT_EQ(kt::RecvFor(fds[i], 10, 10000), "+OK\r\n+OK\r\n");
  uint64_t n = commits() - commits0;
  EXPECT_LE(n, 2u) << "concurrent sync SETs did not share commits";
  for (int i = 0; i < kConns; ++i) {
    const std::string want = Bulk(Value(50000, i));
    EXPECT_EQ(Roundtrip(fds[i], Cmd({"GET", "b" + std::to_string(i)}), want.size()), want);
  }
}

// A pipeline mixing SETs with other commands, on several connections at once, repeated: the
// replies are byte-exact and in request order, and every command after a SET sees it (GET
// reads it, DEL deletes it, EXEC runs after it); an MSET's reply and effect likewise.
TEST_F(RespDurableSetTest, RepliesKeepRequestOrder) {
  constexpr int kConns = 4, kRounds = 20;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kConns);
  for (int c = 0; c < kConns; ++c) {
    int fd = Connect();
    threads.emplace_back([&, c, fd] {
      const std::string p = "c" + std::to_string(c) + ":";
      for (int r = 0; r < kRounds && failures[c].empty(); ++r) {
        const std::string big = Value(20000, r + c), v1 = std::to_string(r), v2 = Value(10, r);
        std::string cmds = Cmd({"SET", p + "a", v1}) + Cmd({"GET", p + "a"}) +
                           Cmd({"SET", p + "a", v2}) + Cmd({"SET", p + "b", big}) +
                           Cmd({"GET", p + "a"}) + Cmd({"GET", p + "b"}) + Cmd({"DEL", p + "a"}) +
                           Cmd({"GET", p + "a"}) + Cmd({"SET", p + "c", "x", "PX", "60000"}) +
                           Cmd({"MULTI"}) + Cmd({"SET", p + "c", v1}) + Cmd({"GET", p + "c"}) +
                           Cmd({"EXEC"}) + Cmd({"SET", p + "d", "x", "BAD"}) +
                           Cmd({"SET", p + "e", v1}) + Cmd({"PING"}) + Cmd({"SET", p + "e", v2}) +
                           Cmd({"MSET", p + "f", v1, p + "g", big}) + Cmd({"GET", p + "g"}) +
                           Cmd({"DEL", p + "f", p + "g", p + "a"}) + Cmd({"QUIT"});
        std::string want = "+OK\r\n" + Bulk(v1) + "+OK\r\n+OK\r\n" + Bulk(v2) + Bulk(big) +
                           ":1\r\n$-1\r\n+OK\r\n+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n" +
                           Bulk(v1) + "-ERR syntax error\r\n+OK\r\n+PONG\r\n+OK\r\n+OK\r\n" +
                           Bulk(big) + ":2\r\n+OK\r\n";
        int conn = r == 0 ? fd : kt::ConnectTcp(o_.resp_port);
        std::string got;
        if (kt::SendAllRaw(conn, cmds.data(), cmds.size())) got = kt::RecvFor(conn, 1 << 20, 10000);
        ::close(conn);
        if (got != want) failures[c] = "round " + std::to_string(r) + ": got " + got;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int c = 0; c < kConns; ++c) EXPECT_EQ(failures[c], "") << c;
  fds_.clear();  // closed by QUIT
  int fd = Connect();
  const std::string want = Bulk(Value(10, kRounds - 1));
  EXPECT_EQ(Roundtrip(fd, Cmd({"GET", "c3:e"}), want.size()), want);
}

// A SET whose commit fails is answered with an error, the value is not served, and the
// connection goes on (a later SET of the key succeeds).
TEST_F(RespDurableSetTest, FailedCommitAnswersTheSetWithAnErrorAndKeepsNoValue) {
  int fd = Connect();
  ASSERT_EQ(Roundtrip(fd, Cmd({"SET", "k", "old"}), 5), "+OK\r\n");
  fault_.FailNextSyncs(1);
  // QUIT: the reply ends where the connection does.
  std::string got =
      Roundtrip(fd, Cmd({"SET", "k", "new"}) + Cmd({"GET", "k"}) + Cmd({"QUIT"}), 1 << 16);
  ASSERT_GE(got.size(), 15u) << got;
  EXPECT_EQ(got.substr(0, 5), "-ERR ") << got;
  EXPECT_EQ(got.substr(got.size() - 10), "$-1\r\n+OK\r\n") << got;
  fd = Connect();
  EXPECT_EQ(Roundtrip(fd, Cmd({"SET", "k", "again"}) + Cmd({"GET", "k"}), 5 + 11),
            "+OK\r\n" + Bulk("again"));
}

// A DEL whose commit fails (a DEL writes the index only: its write-ahead log's sync fails) is
// answered with an error, never a count: the removal stands in memory (docs/format/ssd.md,
// "Failed commits": retried by the next commit), so the key reads as absent, and the
// connection and the daemon go on (a later DEL counts nothing, a SET succeeds). Both paths:
// the DEL completed by the commit queue, and the one inside EXEC (run on the strand).
TEST_F(RespDurableSetTest, FailedCommitAnswersTheDelWithAnError) {
  ASSERT_TRUE(Eventually([&] { return store_->GetStats().ssd_index_loaded; }));
  int fd = Connect();
  ASSERT_EQ(Roundtrip(fd, Cmd({"MSET", "k", "v", "m", "w"}), 5), "+OK\r\n");
  index_faults_->FailNextWalSyncs(1);
  std::string got = Roundtrip(
      fd, Cmd({"DEL", "k"}) + Cmd({"GET", "k"}) + Cmd({"DEL", "k"}) + Cmd({"QUIT"}), 1 << 16);
  ASSERT_GE(got.size(), 15u) << got;
  EXPECT_EQ(got.substr(0, 5), "-ERR ") << got;
  EXPECT_EQ(got.substr(got.find("\r\n") + 2), "$-1\r\n:0\r\n+OK\r\n") << got;
  EXPECT_EQ(index_faults_->failed(), 1);

  fd = Connect();
  index_faults_->FailNextWalSyncs(1);
  got = Roundtrip(
      fd, Cmd({"MULTI"}) + Cmd({"DEL", "m"}) + Cmd({"EXEC"}) + Cmd({"GET", "m"}) + Cmd({"QUIT"}),
      1 << 16);
  const std::string queued = "+OK\r\n+QUEUED\r\n*1\r\n";
  ASSERT_EQ(got.substr(0, queued.size()), queued) << got;
  EXPECT_EQ(got.substr(queued.size(), 5), "-ERR ") << got;
  EXPECT_EQ(got.substr(got.size() - 10), "$-1\r\n+OK\r\n") << got;
  EXPECT_EQ(index_faults_->failed(), 2);
  fd = Connect();
  EXPECT_EQ(Roundtrip(fd, Cmd({"SET", "k", "again"}) + Cmd({"GET", "k"}), 5 + 11),
            "+OK\r\n" + Bulk("again"));
  EXPECT_EQ(store_->GetStats().ssd_index_reopens, 2u);
}

// 8 MSETs of 16 keys each pipelined on one connection while the first commit's fdatasync is
// held: every MSET is taken and put without waiting for a commit (all 128 keys pending and
// stored), and once released they share one more commit (two in all). One commit per key
// would be 128; one per MSET, 8 (an MSET used to run on the connection's strand, a commit
// per key, so the second MSET waited behind the held sync). A GET after them reads the last
// MSET's value and the replies keep request order.
TEST_F(RespDurableSetTest, PipelinedMsetsShareCommits) {
  constexpr int kMsets = 8, kKeys = 16;
  int fd = Connect();
  const uint64_t before_warm = commits();
  ASSERT_EQ(Roundtrip(fd, Cmd({"SET", "warm", "x"}), 5), "+OK\r\n");
  ASSERT_TRUE(WarmCommitCounted(before_warm));
  const uint64_t commits0 = commits();
  fault_.PauseSyncs(true);
  std::string cmds, want;
  for (int m = 0; m < kMsets; ++m) {
    std::vector<std::string> args = {"MSET"};
    for (int k = 0; k < kKeys; ++k) {
      args.push_back("m" + std::to_string(k));
      args.push_back(Value(500, m * kKeys + k));
    }
    cmds += CmdOf(args);
    want += "+OK\r\n";
  }
  cmds += Cmd({"GET", "m3"});
  want += Bulk(Value(500, (kMsets - 1) * kKeys + 3));
  ASSERT_TRUE(kt::SendAllRaw(fd, cmds.data(), cmds.size()));
  bool queued = Eventually([&] {
    if (fault_.syncs_waiting() != 1 ||
        Metric("kvtier_resp_durable_sets_pending") != uint64_t{kMsets * kKeys}) {
      return false;
    }
    for (int k = 0; k < kKeys; ++k) {  // the last MSET put (puts run in order)
      if (!Stored("m" + std::to_string(k), Value(500, (kMsets - 1) * kKeys + k))) return false;
    }
    return true;
  });
  const std::string state = queued ? "" : PendingState();
  fault_.PauseSyncs(false);
  ASSERT_TRUE(queued) << "pipelined MSETs waited for each other's commit (" << state << ")";
  EXPECT_EQ(kt::RecvFor(fd, want.size(), 10000), want);
  const uint64_t n = commits() - commits0;
  EXPECT_GE(n, 1u);
  EXPECT_LE(n, 2u) << "the keys of pipelined sync MSETs did not share commits";
  EXPECT_EQ(Metric("kvtier_resp_durable_sets_pending"), 0u);
}

// An MSET whose commit fails is answered with one error, and none of its keys keeps a value:
// every put the failed commit covered is removed, as a lone SET's failed overwrite is (the
// store's IOError contract). (An MSET used to stop at its first key's failed commit and
// leave the old values of the keys after it.) The connection goes on.
TEST_F(RespDurableSetTest, FailedCommitFailsTheWholeMsetAndKeepsNoValue) {
  constexpr int kKeys = 8;
  int fd = Connect();
  std::vector<std::string> set = {"MSET"}, put = {"MSET"}, get = {"MGET"};
  std::string nils = "*" + std::to_string(kKeys) + "\r\n", olds = nils;
  for (int k = 0; k < kKeys; ++k) {
    const std::string key = "f" + std::to_string(k);
    set.insert(set.end(), {key, "old" + std::to_string(k)});
    put.insert(put.end(), {key, "new" + std::to_string(k)});
    get.push_back(key);
    nils += "$-1\r\n";
    olds += Bulk("old" + std::to_string(k));
  }
  ASSERT_EQ(Roundtrip(fd, CmdOf(set) + CmdOf(get), 5 + olds.size()), "+OK\r\n" + olds);
  fault_.FailNextSyncs(1);
  // QUIT: the reply ends where the connection does.
  std::string got = Roundtrip(fd, CmdOf(put) + CmdOf(get) + Cmd({"QUIT"}), 1 << 16);
  ASSERT_GE(got.size(), 5u + nils.size() + 5u) << got;
  EXPECT_EQ(got.substr(0, 5), "-ERR ") << got;
  // One error reply, then the MGET's nulls and QUIT's +OK.
  EXPECT_EQ(got.substr(got.find("\r\n") + 2), nils + "+OK\r\n") << got;
  fd = Connect();
  EXPECT_EQ(Roundtrip(fd, CmdOf(put) + Cmd({"GET", "f7"}), 5 + Bulk("new7").size()),
            "+OK\r\n" + Bulk("new7"));
}

// A DEL of several keys is one commit (each key's removal used to commit by itself), counts
// the keys that existed, and the keys are gone.
TEST_F(RespDurableSetTest, DelOfSeveralKeysIsOneCommit) {
  constexpr int kKeys = 32;
  int fd = Connect();
  std::vector<std::string> set = {"MSET"}, del = {"DEL"};
  for (int k = 0; k < kKeys; ++k) {
    set.insert(set.end(), {"d" + std::to_string(k), Value(300, k)});
    del.push_back("d" + std::to_string(k));
  }
  del.push_back("never-set");
  const uint64_t before_set = commits();
  ASSERT_EQ(Roundtrip(fd, CmdOf(set), 5), "+OK\r\n");
  ASSERT_TRUE(WarmCommitCounted(before_set));
  const uint64_t commits0 = commits();
  const std::string want = ":" + std::to_string(kKeys) + "\r\n";
  ASSERT_EQ(Roundtrip(fd, CmdOf(del), want.size()), want);
  ASSERT_TRUE(Eventually([&] { return commits() > commits0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a second commit would show
  EXPECT_EQ(commits() - commits0, 1u) << "the deletes of one DEL did not share a commit";
  for (int k = 0; k < kKeys; ++k) EXPECT_FALSE(Stored("d" + std::to_string(k), Value(300, k)));
}

// 32 one-key DELs pipelined behind a SET whose commit's fdatasync is held: every DEL runs
// (its key removed) without waiting for a commit, all of them pending with the SET, and once
// released they share one more commit (two in all; one per DEL would be 33). Their counts come
// back in request order, an absent key's among them, and a GET after them finds nothing.
TEST_F(RespDurableSetTest, PipelinedDelsBehindAHeldCommitShareTheNextOne) {
  constexpr int kKeys = 32;
  int fd = Connect();
  std::vector<std::string> set = {"MSET"};
  for (int k = 0; k < kKeys; ++k) set.insert(set.end(), {"p" + std::to_string(k), Value(300, k)});
  const uint64_t before_set = commits();
  ASSERT_EQ(Roundtrip(fd, CmdOf(set), 5), "+OK\r\n");
  ASSERT_TRUE(WarmCommitCounted(before_set));
  const uint64_t commits0 = commits();
  fault_.PauseSyncs(true);
  std::string cmds = Cmd({"SET", "held", "x"}), want = "+OK\r\n";
  for (int k = 0; k < kKeys; ++k) {
    cmds += Cmd({"DEL", "p" + std::to_string(k)});
    want += ":1\r\n";
    if (k == kKeys / 2) {
      cmds += Cmd({"DEL", "never-set"});
      want += ":0\r\n";
    }
  }
  cmds += Cmd({"GET", "p0"});
  want += "$-1\r\n";
  ASSERT_TRUE(kt::SendAllRaw(fd, cmds.data(), cmds.size()));
  bool queued = Eventually([&] {
    if (fault_.syncs_waiting() != 1 ||
        Metric("kvtier_resp_durable_sets_pending") != uint64_t{kKeys + 1}) {
      return false;
    }
    for (int k = 0; k < kKeys; ++k) {
      if (Stored("p" + std::to_string(k), Value(300, k))) return false;
    }
    return true;
  });
  const std::string state = queued ? "" : PendingState();
  fault_.PauseSyncs(false);
  ASSERT_TRUE(queued) << "pipelined DELs waited for each other's commit (" << state << ")";
  EXPECT_EQ(kt::RecvFor(fd, want.size(), 10000), want);
  const uint64_t n = commits() - commits0;
  EXPECT_GE(n, 1u);
  EXPECT_LE(n, 2u) << "pipelined sync DELs did not share commits";
  EXPECT_EQ(Metric("kvtier_resp_durable_sets_pending"), 0u);
}

// A lone pending SET's "+OK" is written by the commit that completes it (no hand-off back to
// the connection's strand): counted per SET. Sequential SETs on one connection all take it.
TEST_F(RespDurableSetTest, LoneSetRepliesAreWrittenByTheirCommit) {
  constexpr int kSets = 20;
  int fd = Connect();
  const uint64_t direct0 = Metric("kvtier_resp_durable_set_direct_replies_total");
  for (int i = 0; i < kSets; ++i) {
    ASSERT_EQ(Roundtrip(fd, Cmd({"SET", "lone" + std::to_string(i), Value(100, i)}), 5), "+OK\r\n")
        << i;
  }
  // Counted by the connection after the reply went out: the last one may still be on its way.
  EXPECT_TRUE(Eventually([&] {
    return Metric("kvtier_resp_durable_set_direct_replies_total") - direct0 == uint64_t{kSets};
  })) << Metric("kvtier_resp_durable_set_direct_replies_total") - direct0;
  const std::string want = Bulk(Value(100, kSets - 1));
  EXPECT_EQ(Roundtrip(fd, Cmd({"GET", "lone" + std::to_string(kSets - 1)}), want.size()), want);
}

// A SET pipelined behind GET replies that the client does not read yet (the socket is full,
// an asynchronous write holds the rest) is committed meanwhile: its "+OK" must not overtake
// those replies (it is written by its commit only when nothing before it is unwritten).
TEST_F(RespDurableSetTest, SetReplyNeverOvertakesUnwrittenReplies) {
  // 6.4 MB of GET replies: under the connection's 8 MiB reply budget (so the SETs after them
  // are parsed and committed), over what the server's send buffer (at most 4 MiB here) and
  // the client's small receive buffer hold.
  constexpr int kGets = 32;
  const std::string big = Value(200'000, 3);
  int fd = Connect();
  int rcvbuf = 16 << 10;
  ASSERT_EQ(::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf)), 0);
  ASSERT_EQ(Roundtrip(fd, Cmd({"SET", "big", big}), 5), "+OK\r\n");
  std::string cmds, want;
  for (int i = 0; i < kGets; ++i) {
    cmds += Cmd({"GET", "big"});
    want += Bulk(big);
  }
  for (int i = 0; i < 4; ++i) {
    cmds += Cmd({"SET", "after" + std::to_string(i), "v"}) + Cmd({"GET", "big"});
    want += "+OK\r\n" + Bulk(big);
  }
  const uint64_t commits0 = commits();
  ASSERT_TRUE(kt::SendAllRaw(fd, cmds.data(), cmds.size()));
  // The SETs' commit completes while the GET replies wait in the full socket.
  ASSERT_TRUE(Eventually([&] { return commits() > commits0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(kt::RecvFor(fd, want.size(), 10000) == want) << "replies out of order";
}

// SETs of a key whose name is too long to ride in its unit, pipelined on one connection: they
// go through the put thread (its batch waits for the name log's sync; the connection's later
// SETs follow them there rather than being put on the connection's thread) and are put in
// request order: the last value wins.
TEST_F(RespDurableSetTest, SetsBehindALongNameStayInOrder) {
  const std::string name(kRespCarriedNameBytesMax + 100, 'n');
  for (int round = 0; round < 5; ++round) {
    int fd = Connect();
    const std::string key = name + std::to_string(round);
    std::string cmds, want;
    for (int i = 0; i < 6; ++i) {
      cmds += Cmd({"SET", key, Value(64, i)});
      want += "+OK\r\n";
    }
    cmds += Cmd({"GET", key});
    want += Bulk(Value(64, 5));
    ASSERT_EQ(Roundtrip(fd, cmds, want.size()), want) << round;
    EXPECT_TRUE(Stored(key, Value(64, 5))) << round;
  }
}

// An MSET naming a key too long to ride in its unit goes through the put thread as one group
// (its batch waits for the name log's sync); the connection's SETs after it follow it there
// instead of being put at once, so everything is put in request order: a SET of the MSET's
// short key right after it wins (put ahead of the MSET, it would be overwritten by it).
TEST_F(RespDurableSetTest, MsetsBehindALongNameStayInOrder) {
  const std::string name(kRespCarriedNameBytesMax + 100, 'n');
  for (int round = 0; round < 5; ++round) {
    int fd = Connect();
    const std::string key = name + std::to_string(round), other = "o" + std::to_string(round);
    const std::string cmds = CmdOf({"MSET", other, Value(64, 10), key, Value(64, 0)}) +
                             CmdOf({"SET", other, Value(64, 11)}) + CmdOf({"GET", other}) +
                             CmdOf({"MSET", key, Value(64, 1), other, Value(64, 12)}) +
                             CmdOf({"SET", other, Value(64, 13)}) + CmdOf({"GET", other}) +
                             CmdOf({"GET", key});
    const std::string want = "+OK\r\n+OK\r\n" + Bulk(Value(64, 11)) + "+OK\r\n+OK\r\n" +
                             Bulk(Value(64, 13)) + Bulk(Value(64, 1));
    ASSERT_EQ(Roundtrip(fd, cmds, want.size()), want) << round;
    EXPECT_TRUE(Stored(key, Value(64, 1))) << round;
  }
}

}  // namespace
}  // namespace kvtier::daemon
