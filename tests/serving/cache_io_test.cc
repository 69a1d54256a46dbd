// CacheIo's workers against a Unix listener that accepts nothing: every kvtierd call a worker
// begins is a connection in the listener's backlog whose HELLO (with the tenant's token) waits
// for an answer, so the test sees which calls are in flight at once, and ends one by closing
// its connection (the call fails at once: no backoff).
#include "serving/cache_io.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/malloc_tuning.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/engine/engine_test_util.h"
#include "tests/sanitizers.h"

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

// Runs `measure` in a child process (a fresh copy of the allocator's state, threads of its
// own), which fills n numbers and says whether it could; returns them, or nothing (with a test
// failure) when the child did not send them and exit cleanly. `measure` runs in the child: no
// gtest assertion in it.
std::vector<uint64_t> InChild(size_t n, const std::function<bool(uint64_t* out)>& measure) {
  const ssize_t bytes = static_cast<ssize_t>(n * sizeof(uint64_t));
  int fds[2];
  if (::pipe(fds) != 0) {
    ADD_FAILURE() << "pipe failed";
    return {};
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<uint64_t> got(n);
    const bool ok = measure(got.data());
    const bool sent = ::write(fds[1], got.data(), static_cast<size_t>(bytes)) == bytes;
    ::_exit(ok && sent ? 0 : 1);
  }
  ::close(fds[1]);
  std::vector<uint64_t> got(n);
  const ssize_t read = pid < 0 ? -1 : ::read(fds[0], got.data(), static_cast<size_t>(bytes));
  ::close(fds[0]);
  int status = 0;
  const bool exited =
      pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!exited || read != bytes) {
    ADD_FAILURE() << "the child process failed (fork " << pid << ", read " << read << ")";
    return {};
  }
  return got;
}

// A worker's prefault: with the server's allocator settings, a thread that ran PrefaultKv
// imports a sequence's global KV into pages already faulted in, where a thread that did not
// faults in every page. Measured in a child process (a fresh copy of the allocator's state:
// freed memory that an earlier run or test left in an arena would spare either thread its
// faults), with the two threads running at once, so that each has a malloc arena of its own.
TEST(CacheIoPrefault, AThreadsFirstKvAfterThePrefaultFaultsFewPages) {
  if (!TuneMallocForServer()) GTEST_SKIP() << "the allocator is not glibc's, tuned";
  auto e = engine::testutil::MakeEngine(1);
  constexpr uint64_t kTokens = 1 << 17;
  auto minor_faults = [] {
    rusage u{};
    ::getrusage(RUSAGE_THREAD, &u);
    return static_cast<uint64_t>(u.ru_minflt);
  };
  // The faults of taking a KV of kTokens and writing it (as an import does); its bytes.
  auto take_kv = [&](uint64_t* faults, uint64_t* bytes) {
    const uint64_t f0 = minor_faults();
    engine::SequenceState st = e->NewSequence();
    engine::ReserveKvTokens(&st, kTokens);
    *bytes = 0;
    for (engine::KvSourceCache& k : st.kv) {
      for (std::vector<uint8_t>* v :
           {&k.main_data, &k.main_scales, &k.index_data, &k.index_scales}) {
        v->assign(v->capacity(), 0x5a);
        *bytes += v->size();
      }
    }
    *faults = minor_faults() - f0;
  };
  // plain, the prefault's own, after the prefault, bytes
  const std::vector<uint64_t> got = InChild(4, [&](uint64_t* out) {
    std::barrier both(2);
    std::thread a([&] {
      uint64_t bytes = 0;
      take_kv(&out[0], &bytes);
      both.arrive_and_wait();
    });
    std::thread p([&] {
      const uint64_t f0 = minor_faults();
      PrefaultKv(*e, kTokens);
      out[1] = minor_faults() - f0;
      take_kv(&out[2], &out[3]);
      both.arrive_and_wait();
    });
    a.join();
    p.join();
    return true;
  });
  ASSERT_EQ(got.size(), 4u);
  const uint64_t plain = got[0], prefault = got[1], prefaulted = got[2], pages = got[3] / 4096;
  ASSERT_GT(pages, 500u) << got[3] << " bytes of KV";
  EXPECT_GT(plain, pages * 9 / 10) << "a thread's first KV faults in its pages";
  EXPECT_GT(prefault, pages * 9 / 10) << "the prefault touched them";
  EXPECT_LT(prefaulted, pages / 20) << "after the prefault";
}

// CacheIoOptions::prefault_tokens: each worker touches that KV as it starts (before any job),
// so a CacheIo created and stopped at once has faulted in its workers' KV pages. In a child
// process, as above (a write to memory shared with the parent faults too, so a reused arena
// cannot hide the touch).
TEST_F(CacheIoTest, WorkersPrefaultTheirKvAsTheyStart) {
#if defined(KVTIER_TEST_ASAN) || defined(KVTIER_TEST_TSAN)
  GTEST_SKIP() << "a sanitizer's allocator and shadow memory fault pages of their own";
#endif
  constexpr uint64_t kTokens = 1 << 17, kWorkers = 2;
  uint64_t bytes = 0;
  {
    engine::SequenceState st = engine_->NewSequence();
    engine::ReserveKvTokens(&st, kTokens);
    for (const engine::KvSourceCache& k : st.kv)
      bytes += k.main_data.capacity() + k.main_scales.capacity() + k.index_data.capacity() +
               k.index_scales.capacity();
  }
  const uint64_t pages = bytes / 4096;
  ASSERT_GT(pages, 500u);
  for (uint64_t prefault : {uint64_t{0}, kTokens}) {
    SCOPED_TRACE("prefault_tokens " + std::to_string(prefault));
    const std::vector<uint64_t> got = InChild(1, [&](uint64_t* faults) {
      rusage u0{}, u1{};
      ::getrusage(RUSAGE_SELF, &u0);
      CacheIoOptions o;
      o.daemon.socket_path = path_;
      o.engine = engine_.get();
      o.threads = kWorkers;
      o.prefault_tokens = prefault;
      auto io = CacheIo::Create(o, &metrics_, {});
      if (io.ok()) (*io)->Stop();  // joins the workers: their prefault is done
      ::getrusage(RUSAGE_SELF, &u1);
      *faults = static_cast<uint64_t>(u1.ru_minflt - u0.ru_minflt);
      return io.ok();
    });
    ASSERT_EQ(got.size(), 1u);
    const uint64_t faults = got[0];
    if (prefault == 0) {
      EXPECT_LT(faults, pages / 2) << "workers that touch nothing";
    } else {
      EXPECT_GT(faults, kWorkers * pages * 9 / 10) << "each worker's KV pages";
    }
  }
}

TEST_F(CacheIoTest, RefusesNoWorkersTooManyAndAnOversizedPrefault) {
  CacheIoOptions o;
  o.daemon.socket_path = path_;
  o.engine = engine_.get();
  o.threads = 0;
  EXPECT_FALSE(CacheIo::Create(o, &metrics_, {}).ok());
  o.threads = kCacheIoThreadsMax + 1;
  EXPECT_FALSE(CacheIo::Create(o, &metrics_, {}).ok());
  o.threads = 1;
  o.prefault_tokens = engine::kMaxSessionTokens + 1;
  EXPECT_FALSE(CacheIo::Create(o, &metrics_, {}).ok());
  o.prefault_tokens = 0;
  o.threads = kCacheIoThreadsMax;
  EXPECT_TRUE(CacheIo::Create(o, &metrics_, {}).ok());
}

}  // namespace
}  // namespace kvtier::serving
