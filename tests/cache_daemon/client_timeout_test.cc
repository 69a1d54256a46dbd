// The client's bounds on a daemon that stops answering (ClientOptions::timeout_ms): a handshake
// to a daemon that accepts nothing times out; a call that times out fails the connection when
// close_on_timeout asks for it (every later call fails at once with the reason) and keeps it
// otherwise; a send to a daemon that stopped reading times out instead of blocking. Each case
// runs on its own thread and is given 60 s: a client that blocks forever fails the test rather
// than hanging it (the fake is then shut down, which releases the client).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "cache_daemon/wire.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::daemon {
namespace {

using wire::Opcode;

std::string SocketPath(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string(name) + std::to_string(getpid()) + ".sock"))
      .string();
}

// A Unix socket that listens. `answer_hello`: accepts one connection, answers its HELLO (a
// tenant, no shared memory asked), then reads and discards everything and answers nothing
// more, or, with `read_after_hello` false, reads nothing more either. Otherwise it never
// accepts (the backlog takes the client's connection and HELLO).
class StalledDaemon {
 public:
  StalledDaemon(std::string path, bool answer_hello, bool read_after_hello = true)
      : path_(std::move(path)), read_after_hello_(read_after_hello) {
    listen_fd_ = kvtier::testing::ListenUnix(path_, 4);
    EXPECT_GE(listen_fd_, 0) << path_;
    if (answer_hello) thread_ = std::thread([this] { Serve(); });
  }
  ~StalledDaemon() { Stop(); }
  // Closes everything: a client blocked on this daemon sees its connection end.
  void Stop() {
    if (stopped_.exchange(true)) return;
    ::shutdown(listen_fd_, SHUT_RDWR);
    const int c = conn_fd_.load();
    if (c >= 0) ::shutdown(c, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    if (c >= 0) ::close(c);
    ::close(listen_fd_);
    ::unlink(path_.c_str());
  }

 private:
  void Serve() {
    const int c = ::accept(listen_fd_, nullptr, nullptr);
    if (c < 0) return;
    conn_fd_ = c;
    wire::FrameParser parser(1u << 30);
    bool hello_done = false;
    uint8_t buf[65536];
    for (;;) {
      if (hello_done && !read_after_hello_) {
        while (!stopped_) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
      if (n <= 0) return;
      if (hello_done) continue;  // swallowed
      parser.Append(std::span<const uint8_t>(buf, static_cast<size_t>(n)));
      wire::Frame f;
      StatusOr<bool> got = parser.Next(&f);
      if (!got.ok() || !*got) continue;
      ASSERT_EQ(f.header.opcode, static_cast<uint8_t>(Opcode::kHello));
      wire::Writer w;
      wire::EncodeStatus(Status::Ok(), &w);
      wire::HelloResponse r;
      r.max_frame_bytes = 1u << 26;
      r.max_inflight = 64;
      r.max_batch_keys = 4096;
      r.tenant_name = "default";
      wire::EncodeHelloResponse(r, &w);
      const std::vector<uint8_t> frame = wire::BuildFrame(
          f.header.opcode | wire::kResponseBit, f.header.flags, f.header.request_id, w.Take());
      ASSERT_EQ(::send(c, frame.data(), frame.size(), MSG_NOSIGNAL),
                static_cast<ssize_t>(frame.size()));
      hello_done = true;
    }
  }

  std::string path_;
  bool read_after_hello_;
  int listen_fd_ = -1;
  std::atomic<int> conn_fd_{-1};
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

ClientOptions Options(const std::string& path, bool close_on_timeout) {
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 0;
  o.timeout_ms = 200;
  o.close_on_timeout = close_on_timeout;
  return o;
}

// Runs `body` on its own thread; fails (and stops `daemon`, which releases the client) when it
// has not returned within 60 s.
void Bounded(StalledDaemon* daemon, const std::function<void()>& body) {
  std::packaged_task<void()> task(body);
  std::future<void> done = task.get_future();
  std::thread t(std::move(task));
  const bool returned = done.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "the client blocked on a stalled daemon past every timeout";
  if (!returned) daemon->Stop();
  t.join();
}

TEST(ClientTimeoutTest, AHandshakeWithADaemonThatAcceptsNothingTimesOut) {
  const std::string path = SocketPath("kvtier_client_to_hello_");
  StalledDaemon daemon(path, /*answer_hello=*/false);
  Bounded(&daemon, [&] {
    auto c = Client::Connect(Options(path, false));
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kIOError);
    EXPECT_NE(c.status().message().find("timed out after 200 ms"), std::string::npos)
        << c.status().ToString();
  });
}

TEST(ClientTimeoutTest, WithCloseOnTimeoutATimedOutCallFailsTheConnection) {
  const std::string path = SocketPath("kvtier_client_to_close_");
  StalledDaemon daemon(path, /*answer_hello=*/true);
  Bounded(&daemon, [&] {
    auto c = Client::Connect(Options(path, true));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE((*c)->connection_status().ok());
    std::vector<wire::Key> key(1);
    auto first = (*c)->Lookup(key);
    ASSERT_FALSE(first.ok());
    EXPECT_NE(first.status().message().find("timed out after 200 ms"), std::string::npos)
        << first.status().ToString();
    const Status why = (*c)->connection_status();
    EXPECT_FALSE(why.ok());
    EXPECT_EQ(why.message(), first.status().message());
    // Every later call fails at once, with the reason: it is never sent.
    auto second = (*c)->Lookup(key);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().message(), why.message());
  });
}

TEST(ClientTimeoutTest, WithoutCloseOnTimeoutTheConnectionStays) {
  const std::string path = SocketPath("kvtier_client_to_keep_");
  StalledDaemon daemon(path, /*answer_hello=*/true);
  Bounded(&daemon, [&] {
    auto c = Client::Connect(Options(path, false));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    std::vector<wire::Key> key(1);
    for (int i = 0; i < 2; ++i) {
      auto r = (*c)->Lookup(key);
      ASSERT_FALSE(r.ok());
      EXPECT_NE(r.status().message().find("timed out after 200 ms"), std::string::npos)
          << r.status().ToString();
      EXPECT_TRUE((*c)->connection_status().ok()) << (*c)->connection_status().ToString();
    }
  });
}

TEST(ClientTimeoutTest, ASendToADaemonThatStoppedReadingTimesOut) {
  const std::string path = SocketPath("kvtier_client_to_send_");
  StalledDaemon daemon(path, /*answer_hello=*/true, /*read_after_hello=*/false);
  Bounded(&daemon, [&] {
    auto c = Client::Connect(Options(path, true));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    // 16 MiB in one frame: far past what the socket buffers hold.
    std::vector<uint8_t> value(16u << 20, 0x5a);
    PutUnit unit;
    unit.key = wire::Key{};
    unit.value = value;
    auto r = (*c)->PutAsync(std::span<const PutUnit>(&unit, 1), PutOptions{}).get();
    const Status s = r.ok() ? (*r)[0] : r.status();
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
    EXPECT_NE(s.message().find("send: timed out"), std::string::npos) << s.ToString();
  });
}

}  // namespace
}  // namespace kvtier::daemon
