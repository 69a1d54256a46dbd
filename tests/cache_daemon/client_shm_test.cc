// The client's shared-memory ranges against a scripted fake daemon: a range named by a request
// that timed out is not handed to another request until the daemon's reply arrives (the daemon
// may still be writing into it), and is reused after.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "cache_daemon/client.h"
#include "cache_daemon/wire.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;
using wire::Opcode;

struct Range {
  uint64_t offset = 0, capacity = 0;
};

// Answers HELLO and SHM_ATTACH; records every GET's destination range; answers the first two
// GETs only when a LOOKUP arrives (after the client gave up on them), then the LOOKUP, then
// every later GET at once.
class FakeDaemon {
 public:
  explicit FakeDaemon(std::string path) : path_(std::move(path)) {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path_.c_str());
    ::unlink(path_.c_str());
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(listen_fd_, 1), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeDaemon() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (conn_fd_ >= 0) ::shutdown(conn_fd_, SHUT_RDWR);
    thread_.join();
    if (conn_fd_ >= 0) ::close(conn_fd_);
    ::close(listen_fd_);
    ::unlink(path_.c_str());
  }
  std::vector<Range> gets() {
    std::lock_guard<std::mutex> lock(mu_);
    return gets_;
  }

 private:
  void Reply(const wire::FrameHeader& req, const std::function<void(wire::Writer*)>& fill,
             int fd = -1) {
    wire::Writer w;
    wire::EncodeStatus(Status::Ok(), &w);
    if (fill) fill(&w);
    std::vector<uint8_t> body = w.Take();
    auto frame = wire::BuildFrame(req.opcode | wire::kResponseBit, req.flags, req.request_id, body);
    msghdr msg{};
    iovec iov{frame.data(), frame.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ASSERT_EQ(::sendmsg(conn_fd_, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(frame.size()));
  }

  void GetReply(const wire::FrameHeader& req, size_t keys) {
    Reply(req, [&](wire::Writer* w) {
      w->U16(static_cast<uint16_t>(keys));
      for (size_t i = 0; i < keys; ++i) {
        w->U8(static_cast<uint8_t>(StatusCode::kNotFound));
        w->U8(0);
        w->U32(0);
      }
    });
  }

  void Serve() {
    conn_fd_ = ::accept(listen_fd_, nullptr, nullptr);
    if (conn_fd_ < 0) return;
    wire::FrameParser parser(1u << 30);
    std::vector<std::pair<wire::FrameHeader, size_t>> held;
    for (;;) {
      wire::Frame f;
      StatusOr<bool> got = parser.Next(&f);
      if (!got.ok()) return;
      if (!*got) {
        uint8_t buf[65536];
        ssize_t n = ::recv(conn_fd_, buf, sizeof(buf), 0);
        if (n <= 0) return;
        parser.Append(std::span<const uint8_t>(buf, static_cast<size_t>(n)));
        continue;
      }
      switch (static_cast<Opcode>(f.header.opcode)) {
        case Opcode::kHello:
          Reply(f.header, [](wire::Writer* w) {
            wire::HelloResponse r;
            r.max_frame_bytes = 1u << 26;
            r.max_inflight = 64;
            r.max_batch_keys = 4096;
            r.tenant_name = "default";
            wire::EncodeHelloResponse(r, w);
          });
          break;
        case Opcode::kShmAttach: {
          int memfd = ::memfd_create("fake-shm", MFD_CLOEXEC);
          ASSERT_EQ(::ftruncate(memfd, 1u << 20), 0);
          Reply(
              f.header, [](wire::Writer* w) { w->U64(1u << 20); }, memfd);
          ::close(memfd);
          break;
        }
        case Opcode::kGet: {
          auto req = wire::DecodeGet(f.body, (f.header.flags & wire::kFlagShm) != 0);
          ASSERT_TRUE(req.ok());
          size_t n = 0;
          {
            std::lock_guard<std::mutex> lock(mu_);
            gets_.push_back({req->dst_offset, req->dst_capacity});
            n = gets_.size();
          }
          if (n <= 2) {
            held.emplace_back(f.header, req->keys.size());
          } else {
            GetReply(f.header, req->keys.size());
          }
          break;
        }
        case Opcode::kLookup:
          for (auto& [h, keys] : held) GetReply(h, keys);  // late replies first, in order
          held.clear();
          Reply(f.header, [](wire::Writer* w) { wire::EncodeLookupReply({}, w); });
          break;
        default:
          return;
      }
    }
  }

  std::string path_;
  int listen_fd_ = -1, conn_fd_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::vector<Range> gets_;  // protected by mu_
};

bool Overlap(const Range& a, const Range& b) {
  return a.offset < b.offset + b.capacity && b.offset < a.offset + a.capacity;
}

TEST(ClientShmTest, TimedOutRangeIsNotReusedUntilTheReplyArrives) {
  std::string path = (std::filesystem::temp_directory_path() /
                      ("kvtier_client_shm_" + std::to_string(getpid()) + ".sock"))
                         .string();
  FakeDaemon fake(path);
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 1u << 20;
  o.timeout_ms = 200;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->shm_attached());
  std::vector<wire::Key> key(1);
  std::vector<std::vector<uint8_t>> values;
  std::vector<bool> found;
  EXPECT_FALSE((*c)->GetCopy(key, &values, &found).ok());  // times out
  EXPECT_FALSE((*c)->GetCopy(key, &values, &found).ok());  // times out
  // The fake answers both GETs, then this LOOKUP: once it returns, the reader has seen them.
  ASSERT_TRUE((*c)->Lookup(key).ok());
  ASSERT_TRUE((*c)->GetCopy(key, &values, &found).ok());
  std::vector<Range> g = fake.gets();
  ASSERT_EQ(g.size(), 3u);
  ASSERT_GT(g[0].capacity, 0u) << "the GETs must use shared memory";
  EXPECT_FALSE(Overlap(g[0], g[1]))
      << "a range of a timed-out GET was handed out again: [" << g[0].offset << ", +"
      << g[0].capacity << ") and [" << g[1].offset << ", +" << g[1].capacity << ")";
  EXPECT_EQ(g[2].offset, g[0].offset) << "the range is free again once its reply arrived";
}

}  // namespace
}  // namespace kvtier::daemon
