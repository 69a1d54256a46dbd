// Pieces of the etcd client that need no etcd: base64, endpoint parsing, prefix range ends,
// and the HTTP response reader against a scripted server (chunked bodies, limits).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "cluster/base64.h"
#include "cluster/etcd_client.h"
#include "cluster/http_client.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/cluster/scripted_http_server.h"

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

using testing::HttpOk;
using testing::HttpOkChunkedLine;
using testing::ScriptedHttpServer;

HttpEndpoint Endpoint(const ScriptedHttpServer& s) { return *ParseHttpEndpoint(s.endpoint()); }

TEST(HttpClientTest, ReadsChunkedAndLengthDelimitedBodies) {
  HttpLimits limits;
  {
    ScriptedHttpServer s(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        "5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n");
    auto r = HttpPost(Endpoint(s), "/x", "{}", limits);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "hello, world");
  }
  {
    ScriptedHttpServer s("HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabcdef");
    auto r = HttpPost(Endpoint(s), "/x", "{}", limits);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->status, 404);
    EXPECT_EQ(r->body, "abc");
  }
}

TEST(HttpClientTest, AGetCarriesItsBearerTokenAndRefusesOneThatWouldEndTheHeader) {
  HttpLimits limits;
  ScriptedHttpServer s({"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"},
                       {"GET /v1/unit?key=ab HTTP/1.1\r\n", "\r\nAuthorization: Bearer tok-x\r\n"},
                       HttpOk("held"));
  auto r = HttpGet(Endpoint(s), "/v1/unit?key=ab", limits, "tok-x");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "held");
  r = HttpGet(Endpoint(s), "/v1/unit?key=ab", limits);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->status, 401) << "no token, no header";
  for (std::string_view bad : {"tok\r\nX-Admin: 1", "tok x", "tok\x7f", "t\xc3\xa9"}) {
    r = HttpGet(Endpoint(s), "/v1/unit?key=ab", limits, bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
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
    ScriptedHttpServer s(c.response);
    auto r = HttpPost(Endpoint(s), "/x", "{}", limits);
    ASSERT_FALSE(r.ok()) << c.response;
    EXPECT_EQ(r.status().code(), c.code) << c.response << ": " << r.status().message();
  }
}

// A reply whose fields have the wrong JSON types (a hostile or misconfigured endpoint) is an
// error Status, never an exception out of the client (which would end kvtierd).
TEST(EtcdClientTest, MistypedRepliesAreErrorsNotExceptions) {
  auto client = [](const ScriptedHttpServer& s) {
    return EtcdClient(EtcdOptions{.endpoints = {s.endpoint()}});
  };
  for (const char* body : {R"({"error": 1})", R"({"error": "x", "code": "5"})",
                           R"({"error": "x", "message": ["m"]})", R"({"error": null})"}) {
    ScriptedHttpServer s(HttpOk(body));
    Status st = client(s).Put("k", "v");
    EXPECT_TRUE(st.IsIOError()) << body << ": " << st.ToString();
  }
  // The same reply with the right types is still read as etcd meant it.
  {
    ScriptedHttpServer s(
        HttpOk(R"({"error": "lease not found", "code": 5, "message": "lease not found"})"));
    EXPECT_TRUE(client(s).Put("k", "v").IsNotFound());
  }
  // Keys outside the prefix asked for (callers strip the prefix off every key).
  {
    ScriptedHttpServer s(HttpOk(R"({"header": {"revision": "3"}, "kvs": [{"key": "eA=="}]})"));
    EXPECT_TRUE(client(s).RangePrefix("/kvtier/members/").status().IsCorruption());
  }
  {
    ScriptedHttpServer s(HttpOk(R"({"header": {"revision": "3"}, "kvs": [{"key": "eA=="}]})"));
    EXPECT_TRUE(client(s).Get("y").status().IsCorruption());
  }
  const std::pair<const char*, StatusCode> lines[] = {
      {R"({"result": {"canceled": "yes"}})", StatusCode::kCorruption},
      {R"({"result": {"events": [{"type": 3, "kv": {"key": "YQ=="}}]}})", StatusCode::kCorruption},
      {R"({"result": {"header": []}})", StatusCode::kCorruption},
      {R"({"error": {"grpc_code": 1, "message": "canceled by the server"}})", StatusCode::kIOError},
      {R"({"result": {"events": [{"kv": {"key": "eA=="}}]}})", StatusCode::kCorruption},
  };
  for (const auto& [line, code] : lines) {
    ScriptedHttpServer s(HttpOkChunkedLine(line));
    std::atomic<bool> stop{false};
    Status st = client(s).Watch(
        "/p/", 0, [](const std::vector<EtcdEvent>&, int64_t) {}, &stop);
    EXPECT_EQ(st.code(), code) << line << ": " << st.ToString();
  }
}

// A watch whose connection goes silent without closing (a dead etcd host, a NAT that dropped
// the idle flow: the socket stays open, nothing arrives) is ended after watch_silence_ms_max
// with Retry, so that the caller re-reads and watches again; the old client waited until stop.
TEST(EtcdClientTest, ASilentWatchEndsWithRetry) {
  const int listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&a), &len);
  ASSERT_EQ(::listen(listen_fd, 4), 0);
  std::atomic<bool> done{false};
  std::thread server([&] {
    const int fd = ::accept(listen_fd, nullptr, nullptr);
    if (fd < 0) return;
    char buf[4096];
    (void)::recv(fd, buf, sizeof(buf), 0);  // the watch request (its bytes do not matter)
    const std::string created = R"({"result":{"header":{"revision":"5"},"created":true}})";
    char size[32];
    std::snprintf(size, sizeof(size), "%zx\r\n", created.size() + 1);
    const std::string head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
                             std::string(size) + created + "\n\r\n";
    (void)::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
    while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ::close(fd);
  });
  EtcdOptions o{.endpoints = {"127.0.0.1:" + std::to_string(ntohs(a.sin_port))}};
  o.watch_silence_ms_max = 300;
  EtcdClient c(o);
  std::atomic<bool> stop{false};
  std::thread watchdog([&] {  // ends the old client's endless wait, so the test fails, not hangs
    for (int i = 0; i < 2000 && !done.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    stop.store(true);
  });
  int messages = 0;
  Status st = c.Watch(
      "/p/", 0, [&](const std::vector<EtcdEvent>&, int64_t) { ++messages; }, &stop, 50);
  done.store(true);
  watchdog.join();
  server.join();
  ::close(listen_fd);
  EXPECT_TRUE(st.IsRetry()) << st.ToString();
  EXPECT_EQ(messages, 1);  // the created message came through first
}

// An endpoint that answers with something other than etcd (a proxy's error page) is passed over
// for the next; when none answers as etcd does, the call is Unavailable.
TEST(EtcdClientTest, AnEndpointThatIsNotEtcdIsPassedOver) {
  const std::string not_etcd = HttpOk("<html>502 Bad Gateway</html>");
  const std::string etcd = HttpOk(R"({"header": {"revision": "7"}})");
  {
    ScriptedHttpServer proxy(not_etcd), real(etcd);
    EtcdClient c(EtcdOptions{.endpoints = {proxy.endpoint(), real.endpoint()}});
    EXPECT_TRUE(c.Put("k", "v").ok());
  }
  {
    ScriptedHttpServer proxy(not_etcd);
    EtcdClient c(EtcdOptions{.endpoints = {proxy.endpoint()}});
    Status s = c.Put("k", "v");
    EXPECT_TRUE(s.IsUnavailable()) << s.ToString();
    EXPECT_NE(s.message().find("not JSON"), std::string::npos) << s.ToString();
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
