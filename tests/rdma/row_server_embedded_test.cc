// RowServer embedded on a caller's io_context run by several threads (as in kvtierd, whose
// server.io_threads default to 2): Stop() while clients close their connections and reads
// are in flight must not let two threads touch one connection (or the acceptor, or the
// verbs registration sweep) at once. Before each connection's handlers and Stop()'s closes
// ran on one strand, a client's EOF (the session closing itself) and Stop() closing every
// session could close one socket on two threads at once, and Stop() could destroy the sweep
// timer while its handler re-armed it on another thread: heap corruption, SIGSEGV. The
// io_context is destroyed before the server (kvtierd's order).
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <thread>
#include <vector>

#include "rdma/row_server.h"
#include "rdma/wire.h"
#include "tests/rdma/test_util.h"

namespace kvtier::rdma {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

constexpr uint64_t kRows = 64;
constexpr uint32_t kRowDim = 64;
constexpr uint32_t kStride = EngramRowBytes(kRowDim);

// Opens `region` on a fresh connection to `port` (a blocking client), then sends
// `pending_reads` one-row reads whose replies it never reads. False if the open failed.
bool OpenAndSendReads(tcp::socket& s, uint16_t port, const wire::OpenRequest& open,
                      uint32_t pending_reads) {
  boost::system::error_code ec;
  s.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
  if (ec) return false;
  asio::write(s, asio::buffer(wire::BuildOpenRequest(1, open)), ec);
  std::array<uint8_t, wire::kHeaderBytes> header{};
  if (!ec) asio::read(s, asio::buffer(header), ec);
  wire::ResponseHeader h;
  if (ec || !wire::DecodeResponseHeader(header.data(), &h).ok() || h.code != StatusCode::kOk) {
    return false;
  }
  std::vector<uint8_t> reply(h.message_bytes + h.data_bytes);
  asio::read(s, asio::buffer(reply), ec);
  wire::OpenReply opened;
  if (ec ||
      !wire::DecodeOpenReply(std::span<const uint8_t>(reply).subspan(h.message_bytes), &opened)
           .ok()) {
    return false;
  }
  for (uint32_t i = 0; i < pending_reads; ++i) {
    std::vector<wire::ReadOpWire> one = {{opened.region_id, kStride, (i % kRows) * kStride}};
    asio::write(s, asio::buffer(wire::BuildReadRequest(2 + i, one)), ec);
    if (ec) return false;
  }
  return true;
}

TEST(RowServerEmbeddedTest, StopWhileClientsCloseOnManyIoThreadsIsClean) {
  constexpr int kRounds = 40;
  constexpr int kIoThreads = 4;
  constexpr int kConnections = 24;
  testing::TempDir dir;
  const std::string path = testing::MakeTable(dir, "t.engram", 0, kRows, kRowDim);
  for (int round = 0; round < kRounds; ++round) {
    RowServerOptions o;
    o.verbs_grant_check_ms = 1;  // the registration sweep (RDMA builds) fires all the time
    // Every other round, reads wait on the session's timer: Stop() closes sessions whose
    // timer is armed as well as sessions mid-read or mid-write.
    o.TEST_response_delay_ms = round % 2 == 0 ? 0 : 1;
    RowServer server(o);
    ASSERT_TRUE(server.RegisterTable("engram.t", path).ok());
    auto token = server.IssueGrant("engram.t", "tenant-a", 60000);
    ASSERT_TRUE(token.ok());
    // Declared after the server, so destroyed first, as in kvtierd (whose io_context goes
    // before its EngramServing): nothing of the server may still need it then.
    asio::io_context io;
    auto work = asio::make_work_guard(io);
    ASSERT_TRUE(server.Start(io).ok());
    const uint16_t port = server.port();
    std::vector<std::thread> io_threads;
    for (int i = 0; i < kIoThreads; ++i) io_threads.emplace_back([&io] { io.run(); });

    asio::io_context client_io;
    std::vector<tcp::socket> clients;
    for (int i = 0; i < kConnections; ++i) {
      clients.emplace_back(client_io);
      ASSERT_TRUE(OpenAndSendReads(clients.back(), port, {*token, "engram.t", "tenant-a"},
                                   static_cast<uint32_t>(i % 4)))
          << "round " << round << " connection " << i;
    }
    // Half of the clients hang up while Stop() closes every connection on the I/O threads.
    std::atomic<bool> go{false};
    std::thread closer([&] {
      while (!go.load()) std::this_thread::yield();
      for (size_t i = 0; i < clients.size(); i += 2) {
        boost::system::error_code ec;
        clients[i].close(ec);
      }
    });
    go.store(true);
    server.Stop();
    closer.join();
    EXPECT_EQ(server.port(), 0u);
    // Every connection was closed by the server: the other half read EOF (after any replies
    // already written).
    for (size_t i = 1; i < clients.size(); i += 2) {
      boost::system::error_code ec;
      std::vector<uint8_t> sink(64 << 10);
      while (!ec) clients[i].read_some(asio::buffer(sink), ec);
      EXPECT_TRUE(ec == asio::error::eof || ec == asio::error::connection_reset)
          << "round " << round << " connection " << i << ": " << ec.message();
    }
    // The listener is gone too.
    tcp::socket late(client_io);
    boost::system::error_code ec;
    late.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    EXPECT_TRUE(ec) << "round " << round << ": the listener still accepts";
    work.reset();
    for (auto& t : io_threads) t.join();  // nothing is left to run: run() returns
    EXPECT_EQ(server.counters().connections_active, 0u) << "round " << round;
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace
}  // namespace kvtier::rdma
