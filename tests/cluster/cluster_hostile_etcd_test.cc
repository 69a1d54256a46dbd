// kvtierd in cluster mode against an "etcd" that answers every request with a hostile reply:
// fields of the wrong JSON types, keys outside the prefix asked for, a stream error object,
// a chunk size beyond any limit, a head of 20 KiB, text that is not JSON. Whatever answers at
// an etcd endpoint is not trusted: the node stays up, counts etcd errors, keeps serving what
// it holds, and its memory stays bounded.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "cluster/base64.h"
#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

// An HTTP server on a loopback port that answers each request with the next response of a
// fixed list (round robin), then closes the connection; a request whose text holds every one
// of `special_needles` gets `special_response` instead.
class HostileEtcd {
 public:
  HostileEtcd(std::vector<std::string> responses, std::vector<std::string> special_needles,
              std::string special_response)
      : responses_(std::move(responses)),
        special_needles_(std::move(special_needles)),
        special_response_(std::move(special_response)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t len = sizeof(a);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    EXPECT_EQ(::listen(listen_fd_, 64), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~HostileEtcd() {
    stop_.store(true);
    thread_.join();
    ::close(listen_fd_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  uint64_t served() const { return served_.load(); }

 private:
  void Serve() {
    while (!stop_.load()) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      const std::string request = ReadRequest(fd);
      bool special = !special_needles_.empty();
      for (const std::string& needle : special_needles_) {
        special = special && request.find(needle) != std::string::npos;
      }
      const std::string& r =
          special ? special_response_ : responses_[served_.load() % responses_.size()];
      kvtier::testing::SendAllRaw(fd, r.data(), r.size());
      served_.fetch_add(1);
      ::shutdown(fd, SHUT_RDWR);
      ::close(fd);
    }
  }
  // The request's head and its Content-Length bytes of body (each wait at most 1 s).
  static std::string ReadRequest(int fd) {
    std::string in;
    size_t want = std::string::npos;
    char buf[4096];
    while (want == std::string::npos || in.size() < want) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 1000) != 1) return in;
      ssize_t k = ::recv(fd, buf, sizeof(buf), 0);
      if (k <= 0) return in;
      in.append(buf, static_cast<size_t>(k));
      size_t head_end = in.find("\r\n\r\n");
      if (want == std::string::npos && head_end != std::string::npos) {
        size_t cl = in.find("Content-Length: ");
        size_t length = cl == std::string::npos ? 0 : std::stoul(in.substr(cl + 16));
        want = head_end + 4 + length;
      }
    }
    return in;
  }

  std::vector<std::string> responses_;
  std::vector<std::string> special_needles_;
  std::string special_response_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0};
  std::thread thread_;
};

std::string Json(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string Chunked(const std::string& line) {
  char size[32];
  std::snprintf(size, sizeof(size), "%zx\r\n", line.size() + 1);
  return "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(size) + line +
         "\n\r\n0\r\n\r\n";
}

TEST(ClusterHostileEtcdTest, ANodeStaysUpAndServesAgainstAnEtcdThatLies) {
  // A lease grant and a keepalive that look right come first, so that the node registers and
  // then meets the rest in its session, watch and tombstone loops alike.
  const std::vector<std::string> responses = {
      Json(R"({"header":{"revision":"1"},"ID":"7","TTL":"2"})"),
      Json(R"({"header":{"revision":"1"}})"),
      Json(R"({"error": 1})"),
      Json(R"({"error": "x", "code": "5", "message": ["m"]})"),
      Chunked(R"({"error": {"grpc_code": 1, "http_code": 500, "message": "stream broke"}})"),
      Json(R"({"header": {"revision": "2"}, "kvs": [{"key": "eA==", "value": "e30="}]})"),
      Chunked(R"({"result": {"header": {"revision": "3"}, "events": [{"kv": {"key": "eA=="}}]}})"),
      Json(R"({"header": [], "kvs": {}})"),
      Json(R"({"ID": {}, "TTL": [], "result": 7})"),
      Chunked(R"({"result": {"canceled": "yes", "events": [{"type": 3}]}})"),
      Json(R"({"header": {"revision": "18446744073709551615"}, "deleted": 1.5})"),
      Json("<html>502 Bad Gateway</html>"),
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\nabc",
      "HTTP/1.1 200 OK\r\nX-Pad: " + std::string(20 << 10, 'a') + "\r\n\r\n{}",
      "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
      "SSH-2.0-OpenSSH_9.2\r\n",
  };
  // The membership's range of the members prefix always gets 50 records that are not JSON:
  // 50 bad records per re-read (every 500 ms), which must not mean 50 warnings each time.
  std::string bad_records = R"({"header": {"revision": "4"}, "kvs": [)";
  for (int i = 0; i < 50; ++i) {
    // "/kvtier/members/bad<i>" and "{not json", base64.
    const std::string key = "/kvtier/members/bad" + std::to_string(i);
    bad_records += std::string(i == 0 ? "" : ",") + R"({"key": ")" + Base64Encode(key) +
                   R"(", "value": "e25vdCBqc29u", "mod_revision": "4"})";
  }
  bad_records += "]}";
  HostileEtcd etcd(responses, {"POST /v3/kv/range ", Base64Encode("/kvtier/members/")},
                   Json(bad_records));

  const auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_hostile_etcd_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "credential", std::ios::binary) << std::string(40, 'c');
  kvtier::testing::KvtierdProcess node(dir / "n0");
  node.WriteConfig(
      "[storage]\ndram_capacity_bytes = 16777216\n"
      "[cluster]\nenabled = true\netcd_endpoints = [\"" +
      etcd.endpoint() + "\"]\nnode_id = \"n0\"\npeer_listen = \"127.0.0.1:" +
      std::to_string(kvtier::testing::FreePort()) +
      "\"\nreplicas = 1\nlease_ttl_s = 2\netcd_timeout_ms = 500\n"
      "credential_file = \"" +
      (dir / "credential").string() + "\"\n");
  ASSERT_TRUE(node.Start()) << node.Log();

  // Every reply twice over, spread across the loops that talk to etcd (session, watch,
  // tombstones), in whatever order they ask.
  ASSERT_TRUE(kvtier::testing::WaitFor(
      [&] { return etcd.served() >= 2 * responses.size() || !node.Alive(); }, 60000))
      << "served " << etcd.served() << "\n"
      << node.Log();
  ASSERT_TRUE(node.Alive()) << "after " << etcd.served() << " replies\n" << node.Log();
  const std::string metrics = kvtier::testing::HttpRequest(node.http_port(), "GET", "/metrics");
  EXPECT_GE(Metric(metrics, "kvtier_cluster_etcd_errors_total"), 4.0) << metrics;
  const std::string log = node.Log();
  EXPECT_EQ(log.find("terminate called"), std::string::npos) << log;
  // The watcher's retries (every 500 ms here) are one warning per 10 s, not one per retry.
  size_t watch_warnings = 0;
  for (size_t at = 0; (at = log.find("membership watch ended", at)) != std::string::npos; ++at) {
    ++watch_warnings;
  }
  EXPECT_LE(watch_warnings, 1u) << log;
  size_t record_warnings = 0;
  for (size_t at = 0; (at = log.find("ignoring member record", at)) != std::string::npos; ++at) {
    ++record_warnings;
  }
  EXPECT_EQ(record_warnings, 1u) << log;
  EXPECT_GE(Metric(metrics, "kvtier_cluster_bad_member_records_total"), 100.0) << metrics;
  // Both fronts still answer.
  auto c = daemon::Client::Connect(daemon::ClientOptions{.socket_path = node.socket()});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(kvtier::testing::HttpRequest(node.http_port(), "GET", "/readyz").rfind("HTTP/1.1 ", 0),
            0u);
  // Resident memory stays far below what the hostile lengths asked for (a 16 EiB chunk).
  EXPECT_LT(node.RssBytes(), uint64_t{512} << 20);
  EXPECT_EQ(node.Stop(), 0) << node.Log();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::cluster
