// CacheIo's workers against a Unix listener that accepts nothing: every kvtierd call a worker
// begins is a connection in the listener's backlog whose HELLO (with the tenant's token) waits
// for an answer, so the test sees which calls are in flight at once, and ends one by closing
// its connection (the call fails at once: no backoff).
#include "serving/cache_io.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/cache_daemon/net_util.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::serving {
namespace {

using Clock = std::chrono::steady_clock;

// A connection accepted from the listener, with the bytes its client sent (its HELLO).
struct Accepted {
  int fd = -1;
  std::string sent;
};

class CacheIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             ("kvtier_cache_io_" + std::to_string(::getpid()) + ".sock"))
                .string();
    listener_ = kvtier::testing::ListenUnix(path_, 64);
    ASSERT_GE(listener_, 0);
    engine_ = engine::testutil::MakeEngine(1);
  }
  void TearDown() override {
    // Every call still waiting fails at once, and the saves left fail to connect.
    for (Accepted& a : accepted_) ::close(a.fd);
    accepted_.clear();
    if (listener_ >= 0) ::close(listener_);
    if (io_ != nullptr) io_->Stop();
    std::filesystem::remove(path_);
  }

  void Start(uint64_t threads) {
    CacheIoOptions o;
    o.daemon.socket_path = path_;
    o.daemon.timeout_ms = 60000;  // calls wait for the test, never for a timeout
    o.engine = engine_.get();
    o.threads = threads;
    auto io = CacheIo::Create(o, &metrics_, {});
    ASSERT_TRUE(io.ok()) << io.status().ToString();
    io_ = std::move(io).value();
  }

  // Accepts connections until `n` are held or `wait_ms` passes; each one's HELLO is read (the
  // token tells whose call it is). Returns how many are held.
  size_t AcceptUpTo(size_t n, int wait_ms) {
    const Clock::time_point end = Clock::now() + std::chrono::milliseconds(wait_ms);
    while (accepted_.size() < n && Clock::now() < end) {
      pollfd p{listener_, POLLIN, 0};
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
      if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 0))) <= 0) continue;
      const int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) continue;
      Accepted a{fd, {}};
      char buf[512];
      // The HELLO is sent as the connection is made; wait for its token's bytes.
      for (int i = 0; i < 200 && a.sent.find("tok-") == std::string::npos; ++i) {
        pollfd q{fd, POLLIN, 0};
        if (::poll(&q, 1, 50) <= 0) continue;
        const ssize_t got = ::recv(fd, buf, sizeof(buf), 0);
        if (got <= 0) break;
        a.sent.append(buf, static_cast<size_t>(got));
      }
      accepted_.push_back(std::move(a));
    }
    return accepted_.size();
  }

  // The held connections whose HELLO carries `token`.
  size_t Holding(const std::string& token) const {
    size_t n = 0;
    for (const Accepted& a : accepted_) n += a.sent.find(token) != std::string::npos;
    return n;
  }

  // Closes the held connection of `token` (there must be one): its call fails at once.
  void Release(const std::string& token) {
    for (auto it = accepted_.begin(); it != accepted_.end(); ++it) {
      if (it->sent.find(token) == std::string::npos) continue;
      ::close(it->fd);
      accepted_.erase(it);
      return;
    }
    ADD_FAILURE() << "no connection of " << token;
  }

  static engine::PreparedSave Save(int64_t first_unit) {
    engine::PreparedSave s;
    s.first_unit = first_unit;
    s.units.push_back(std::vector<uint8_t>(64, 1));
    return s;
  }

  // Jobs hold their tenant until CacheIo stops (TearDown).
  const Tenant a_{"a", "tok-a", {}, 1}, x_{"x", "tok-x", {}, 1}, y_{"y", "tok-y", {}, 1};
  std::string path_;
  int listener_ = -1;
  std::unique_ptr<engine::Engine> engine_;
  ServingMetrics metrics_;
  std::unique_ptr<CacheIo> io_;
  std::vector<Accepted> accepted_;
};

// Four restores of four requests with four workers are four kvtierd calls in flight at once,
// none waiting behind another; a fifth waits for a free worker. With one worker (as CacheIo
// was) the second restore's call would begin only after the first's ended.
TEST_F(CacheIoTest, RestoresOfDifferentRequestsAreInFlightAtOnce) {
  Start(4);
  const Tenant& t = a_;
  for (uint64_t id = 1; id <= 5; ++id)
    io_->SubmitRestore(id, &t, engine::testutil::Prompt(200, static_cast<uint32_t>(id)), 0);
  EXPECT_EQ(AcceptUpTo(4, 30000), 4u) << "calls in flight at once";
  EXPECT_EQ(AcceptUpTo(5, 300), 4u) << "a fifth call while four workers are busy";
  Release("tok-a");  // one restore ends (without the cache): the fifth begins
  EXPECT_EQ(AcceptUpTo(4, 30000), 4u);
  size_t done = 0;
  for (int i = 0; i < 3000 && done == 0; ++i) {
    for (const CacheIo::RestoreResult& r : io_->TakeRestores()) {
      EXPECT_FALSE(r.asked) << "a restore whose connection closed is served without the cache";
      ++done;
    }
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(done, 1u);
}

// One sequence's saves run one at a time, in order, while another sequence's save runs beside
// them: with three workers, x's first save and y's save are in flight and x's second is not; it
// begins once x's first has ended (here, failed: its failure is reported by then, so the
// scheduler sets x's cursor back before x's next units are put).
TEST_F(CacheIoTest, OneSequencesSavesRunInOrderBesideOthers) {
  Start(3);
  const Tenant &x = x_, &y = y_;
  io_->SubmitSave(1, &x, Save(0), nullptr, std::nullopt);
  io_->SubmitSave(1, &x, Save(1), nullptr, std::nullopt);
  io_->SubmitSave(2, &y, Save(0), nullptr, std::nullopt);
  ASSERT_EQ(AcceptUpTo(2, 30000), 2u);
  EXPECT_EQ(AcceptUpTo(3, 300), 2u) << "x's second save began beside its first";
  EXPECT_EQ(Holding("tok-x"), 1u);
  EXPECT_EQ(Holding("tok-y"), 1u);
  EXPECT_TRUE(io_->TakeSaveFailures().empty());
  Release("tok-x");  // x's first save fails at once; its second begins
  ASSERT_EQ(AcceptUpTo(2, 30000), 2u);
  EXPECT_EQ(Holding("tok-x"), 1u) << "x's second save";
  std::vector<CacheIo::SaveFailure> failed = io_->TakeSaveFailures();
  ASSERT_EQ(failed.size(), 1u) << "x's first save's failure, reported before its second began";
  EXPECT_EQ(failed[0].seq_id, 1u);
  EXPECT_EQ(failed[0].units_saved, 0);
}

TEST_F(CacheIoTest, RefusesNoWorkersAndTooMany) {
  CacheIoOptions o;
  o.daemon.socket_path = path_;
  o.engine = engine_.get();
  o.threads = 0;
  EXPECT_FALSE(CacheIo::Create(o, &metrics_, {}).ok());
  o.threads = kCacheIoThreadsMax + 1;
  EXPECT_FALSE(CacheIo::Create(o, &metrics_, {}).ok());
  o.threads = kCacheIoThreadsMax;
  EXPECT_TRUE(CacheIo::Create(o, &metrics_, {}).ok());
}

}  // namespace
}  // namespace kvtier::serving
