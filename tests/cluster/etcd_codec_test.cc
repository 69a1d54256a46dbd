// Pieces of the etcd client that need no etcd: base64, endpoint parsing, prefix range ends,
// and the HTTP response reader against a scripted server (chunked bodies, limits).
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "cluster/base64.h"
#include "cluster/etcd_client.h"
#include "cluster/http_client.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::cluster {
namespace {

TEST(Base64Test, RoundTripsEveryLengthAndRefusesGarbage) {
  std::string bytes;
  for (int n = 0; n < 300; ++n) {
    auto back = Base64Decode(Base64Encode(bytes));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, bytes);
    bytes += static_cast<char>(n * 37);
  }
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_FALSE(Base64Decode("Zm9").ok());
  EXPECT_FALSE(Base64Decode("Zm=v").ok());
  EXPECT_FALSE(Base64Decode("Zm9v!!!!").ok());
  EXPECT_FALSE(Base64Decode("Zg==Zg==").ok());
}

TEST(EtcdCodecTest, EndpointsAndPrefixRangeEnds) {
  auto ep = ParseHttpEndpoint("http://127.0.0.1:2379/");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->host, "127.0.0.1");
  EXPECT_EQ(ep->port, 2379);
  EXPECT_TRUE(ParseHttpEndpoint("[::1]:2379").ok());
  for (const char* bad : {"127.0.0.1", "https://a:1", "a:0", "a:70000", ":1", "a:1/v3", "::1:5"}) {
    EXPECT_FALSE(ParseHttpEndpoint(bad).ok()) << bad;
  }
  EXPECT_EQ(PrefixRangeEnd("/kvtier/"), "/kvtier0");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(PrefixRangeEnd(""), std::string(1, '\0'));
}

// Serves one scripted response to the first connection on a free loopback port.
class ScriptedServer {
 public:
  explicit ScriptedServer(std::string response) : response_(std::move(response)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    ::listen(listen_fd_, 1);
    thread_ = std::thread([this] {
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      testing::RecvFor(fd, 1, 2000);  // the request (not checked)
      testing::SendAllRaw(fd, response_.data(), response_.size());
      ::shutdown(fd, SHUT_WR);
      testing::RecvFor(fd, 1, 2000);  // until the client closes
      ::close(fd);
    });
  }
  ~ScriptedServer() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    thread_.join();
    ::close(listen_fd_);
  }
  HttpEndpoint endpoint() const { return {"127.0.0.1", port_}; }

 private:
  std::string response_;
  int listen_fd_;
  uint16_t port_;
  std::thread thread_;
};

TEST(HttpClientTest, ReadsChunkedAndLengthDelimitedBodies) {
  HttpLimits limits;
  {
    ScriptedServer s(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        "5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n");
    auto r = HttpPost(s.endpoint(), "/x", "{}", limits);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "hello, world");
  }
  {
    ScriptedServer s("HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabcdef");
    auto r = HttpPost(s.endpoint(), "/x", "{}", limits);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->status, 404);
    EXPECT_EQ(r->body, "abc");
  }
}

TEST(HttpClientTest, HostileResponsesAreErrorsNotCrashes) {
  HttpLimits limits;
  limits.body_bytes_max = 10;
  limits.chunk_bytes_max = 10;
  limits.head_bytes_max = 64;
  struct Case {
    const char* response;
    StatusCode code;
  };
  const Case cases[] = {
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", StatusCode::kCorruption},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFF\r\n", StatusCode::kRejected},
      {"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789012", StatusCode::kRejected},
      {"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab", StatusCode::kIOError},
      {"HTTP/1.1 200 OK\r\nX: "
       "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n",
       StatusCode::kRejected},
      {"SMTP ready\r\n\r\n", StatusCode::kCorruption},
      {"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", StatusCode::kCorruption},
  };
  for (const auto& c : cases) {
    ScriptedServer s(c.response);
    auto r = HttpPost(s.endpoint(), "/x", "{}", limits);
    ASSERT_FALSE(r.ok()) << c.response;
    EXPECT_EQ(r.status().code(), c.code) << c.response << ": " << r.status().message();
  }
}

TEST(HttpClientTest, NothingListeningIsAnErrorWithinTheDeadline) {
  HttpLimits limits;
  limits.timeout_ms = 500;
  auto r = HttpPost({"127.0.0.1", testing::FreePort()}, "/x", "{}", limits);
  EXPECT_FALSE(r.ok());
  EtcdClient etcd(EtcdOptions{.endpoints = {"127.0.0.1:" + std::to_string(testing::FreePort())}});
  EXPECT_TRUE(etcd.Put("k", "v").IsUnavailable());
}

}  // namespace
}  // namespace kvtier::cluster
