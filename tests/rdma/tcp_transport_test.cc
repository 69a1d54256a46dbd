// TcpTransport against a RowServer over loopback: exact bytes, limits, grants, restarts,
// malformed frames.
#include "rdma/tcp_transport.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "common/clock.h"
#include "tests/process_util.h"
#include "tests/rdma/test_util.h"
#include "tests/sanitizers.h"

namespace kvtier::rdma {
namespace {

using testing::Connect;
using testing::MakeTable;
using testing::TempDir;

constexpr uint64_t kRows = 5000;
constexpr uint32_t kRowDim = 256;  // the real model's row: 256 codes + 8 scales
constexpr uint32_t kStride = EngramRowBytes(kRowDim);

class TcpTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = MakeTable(dir_, "l1.engram", 0, kRows, kRowDim);
    auto table = MappedTable::Open(path_);
    ASSERT_TRUE(table.ok());
    local_ = *table;
    StartServer(RowServerOptions{});
  }

  // Starts a server on `port` (0: any). The first start issues the grant; later ones
  // (restarts) install the same grant, as a control plane would.
  void StartServer(RowServerOptions o, uint16_t port = 0, bool grant = true) {
    o.port = port;
    if (o.clock == nullptr) o.clock = &clock_;
    server_ = std::make_unique<RowServer>(o);
    ASSERT_TRUE(server_->RegisterTable("engram.l1", path_).ok());
    ASSERT_TRUE(server_->Start().ok());
    if (!grant) return;
    if (creds_.region_name.empty()) {
      auto token = server_->IssueGrant("engram.l1", "tenant-a", 60000);
      ASSERT_TRUE(token.ok());
      creds_ = RegionCredentials{"engram.l1", "tenant-a", *token};
    } else {
      ASSERT_TRUE(server_->AddGrant(creds_.token, "engram.l1", "tenant-a", 60000).ok());
    }
  }

  // Reads rows[i] into buf + i*kStride through `t` and checks them against the local file.
  void ExpectRowsExact(Transport& t, RegionId region, const std::vector<uint64_t>& rows) {
    std::vector<uint8_t> buf(rows.size() * kStride, 0xee);
    auto id = t.RegisterLocalBuffer(buf.data(), buf.size());
    ASSERT_TRUE(id.ok());
    std::vector<ReadOp> ops;
    for (size_t i = 0; i < rows.size(); ++i) {
      ops.push_back(ReadOp{region, rows[i] * kStride, kStride, buf.data() + i * kStride});
    }
    Status st = ReadSync(t, ops);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (size_t i = 0; i < rows.size(); ++i) {
      ASSERT_EQ(
          std::memcmp(buf.data() + i * kStride, local_->rows().data() + rows[i] * kStride, kStride),
          0)
          << "row " << rows[i];
    }
    ASSERT_TRUE(t.UnregisterLocalBuffer(*id).ok());
  }

  // Several threads submit to `t` at once: thread k submits `batches` batches of 1..ops_max
  // rows (row (k * row_seed + b * 131 + i * 7) % kRows for op i of batch b), at most `window`
  // outstanding, all threads starting together, and waits for its batches. Then each callback
  // ran exactly once, one thread's batches completed in its submission order, and every
  // destination holds exactly its row; the transport counted them all, none failed.
  struct SubmitterShape {
    size_t threads, batches, ops_max, window, row_seed;
  };
  void ExpectConcurrentSubmittersExact(Transport& t, RegionId region, const SubmitterShape& shape) {
    struct Submitter {
      std::vector<uint8_t> buf;
      std::mutex mu;
      std::condition_variable cv;
      size_t outstanding = 0;
      std::vector<size_t> completed;  // batch numbers in completion order
      std::vector<Status> failures;
    };
    std::vector<Submitter> subs(shape.threads);
    // Batch b reads ops_of(b) rows: 1 (read in place) or several (staged, scattered).
    auto ops_of = [&](size_t b) { return 1 + b % shape.ops_max; };
    auto row_of = [&](size_t k, size_t b, size_t i) {
      return (k * shape.row_seed + b * 131 + i * 7) % kRows;
    };
    for (Submitter& sub : subs) {
      sub.buf.assign(shape.batches * shape.ops_max * kStride, 0xee);
      ASSERT_TRUE(t.RegisterLocalBuffer(sub.buf.data(), sub.buf.size()).ok());
    }
    std::atomic<size_t> arrived{0};
    std::vector<std::thread> threads;
    for (size_t k = 0; k < shape.threads; ++k) {
      threads.emplace_back([&, k] {
        Submitter& sub = subs[k];
        arrived.fetch_add(1);
        while (arrived.load() < shape.threads) std::this_thread::yield();  // start together
        for (size_t b = 0; b < shape.batches; ++b) {
          std::vector<ReadOp> ops;
          for (size_t i = 0; i < ops_of(b); ++i) {
            ops.push_back(ReadOp{region, row_of(k, b, i) * kStride, kStride,
                                 sub.buf.data() + (b * shape.ops_max + i) * kStride});
          }
          {
            std::unique_lock<std::mutex> lock(sub.mu);
            sub.cv.wait(lock, [&] { return sub.outstanding < shape.window; });
            ++sub.outstanding;
          }
          Status st = t.Submit(ops, [&sub, b](const Status& result) {
            std::lock_guard<std::mutex> lock(sub.mu);
            sub.completed.push_back(b);
            if (!result.ok()) sub.failures.push_back(result);
            --sub.outstanding;
            sub.cv.notify_all();
          });
          if (!st.ok()) {
            std::lock_guard<std::mutex> lock(sub.mu);
            sub.failures.push_back(st);
            --sub.outstanding;
          }
        }
        std::unique_lock<std::mutex> lock(sub.mu);
        sub.cv.wait_for(lock, std::chrono::seconds(20), [&] { return sub.outstanding == 0; });
      });
    }
    for (std::thread& th : threads) th.join();
    for (size_t k = 0; k < shape.threads; ++k) {
      Submitter& sub = subs[k];
      std::lock_guard<std::mutex> lock(sub.mu);
      ASSERT_TRUE(sub.failures.empty())
          << "thread " << k << ": " << sub.failures.front().ToString();
      ASSERT_EQ(sub.completed.size(), shape.batches);
      for (size_t b = 0; b < shape.batches; ++b) ASSERT_EQ(sub.completed[b], b) << "thread " << k;
      for (size_t b = 0; b < shape.batches; ++b) {
        for (size_t i = 0; i < ops_of(b); ++i) {
          ASSERT_EQ(std::memcmp(sub.buf.data() + (b * shape.ops_max + i) * kStride,
                                local_->rows().data() + row_of(k, b, i) * kStride, kStride),
                    0)
              << "thread " << k << " batch " << b << " op " << i;
        }
      }
    }
    const TransportCounters c = t.counters();
    EXPECT_EQ(c.batches_submitted, shape.threads * shape.batches);
    EXPECT_EQ(c.batches_failed, 0u);
    EXPECT_EQ(c.reads_in_flight, 0u);
    EXPECT_EQ(c.disconnects, 0u);
  }

  TempDir dir_;
  std::string path_;
  std::shared_ptr<const MappedTable> local_;
  ManualClock clock_{1'000'000};
  std::unique_ptr<RowServer> server_;
  RegionCredentials creds_;
};

TEST_F(TcpTransportTest, RowsReadRemotelyEqualLocalRowsBitForBit) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_EQ(region->row_stride_bytes, kStride);
  EXPECT_EQ(region->row_dim, kRowDim);
  EXPECT_EQ(region->row_count, kRows);
  EXPECT_EQ(region->size_bytes, kRows * kStride);
  std::vector<uint64_t> rows = {0, kRows - 1, 17, 17, 4095, 2500};
  for (uint64_t r = 1; r < kRows; r += 97) rows.push_back(r);
  ExpectRowsExact(*t, region->id, rows);
  // Independently of the file: the generator's content.
  std::vector<uint8_t> expected(kStride);
  FillSyntheticEngramRow(testing::kSeed, 17, kRowDim, expected.data());
  EXPECT_EQ(std::memcmp(local_->rows().data() + 17 * kStride, expected.data(), kStride), 0);
  const TransportCounters c = t->counters();
  EXPECT_EQ(c.ops_submitted, rows.size());
  EXPECT_EQ(c.bytes_read, rows.size() * kStride);
  EXPECT_EQ(c.reads_in_flight, 0u);
  EXPECT_EQ(server_->counters().ops_served, rows.size());
}

TEST_F(TcpTransportTest, ManyPipelinedBatchesCompleteExactlyOnce) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  constexpr size_t kBatches = 64, kOps = 32;
  std::vector<uint8_t> buf(kBatches * kOps * kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0, failed = 0;
  for (size_t b = 0; b < kBatches; ++b) {
    std::vector<ReadOp> ops;
    for (size_t i = 0; i < kOps; ++i) {
      const uint64_t row = (b * 131 + i * 7919) % kRows;
      ops.push_back(
          ReadOp{region->id, row * kStride, kStride, buf.data() + (b * kOps + i) * kStride});
    }
    ASSERT_TRUE(t->Submit(ops, [&](const Status& s) {
                   std::lock_guard<std::mutex> lock(mu);
                   ++done;
                   if (!s.ok()) ++failed;
                   cv.notify_all();
                 }).ok());
  }
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return done == kBatches; }));
  EXPECT_EQ(failed, 0u);
  for (size_t b = 0; b < kBatches; ++b) {
    for (size_t i = 0; i < kOps; ++i) {
      const uint64_t row = (b * 131 + i * 7919) % kRows;
      ASSERT_EQ(std::memcmp(buf.data() + (b * kOps + i) * kStride,
                            local_->rows().data() + row * kStride, kStride),
                0);
    }
  }
}

TEST_F(TcpTransportTest, BatchAndBoundsAreChecked) {
  TransportOptions o = testing::FastOptions();
  o.batch_ops_max = 8;
  o.reads_in_flight_max = 10;
  auto t = Connect(server_->port(), o);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  std::vector<uint8_t> buf(16 * kStride);
  std::vector<uint8_t> unregistered(kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  EXPECT_TRUE(t->RegisterLocalBuffer(buf.data() + 8, 16).status().IsInvalidArgument());  // overlap
  auto op = [&](uint64_t offset, uint32_t len, uint8_t* dest) {
    return ReadOp{region->id, offset, len, dest};
  };
  auto noop = [](const Status&) {};
  std::vector<ReadOp> nine(9, op(0, kStride, buf.data()));
  EXPECT_TRUE(t->Submit(nine, noop).IsInvalidArgument());
  EXPECT_TRUE(t->Submit({}, noop).IsInvalidArgument());
  ReadOp past_end = op(kRows * kStride - 8, 16, buf.data());
  EXPECT_TRUE(t->Submit({&past_end, 1}, noop).IsInvalidArgument());
  ReadOp bad_dest = op(0, kStride, unregistered.data());
  EXPECT_TRUE(t->Submit({&bad_dest, 1}, noop).IsInvalidArgument());
  ReadOp straddle = op(0, kStride, buf.data() + buf.size() - 10);
  EXPECT_TRUE(t->Submit({&straddle, 1}, noop).IsInvalidArgument());
  ReadOp bad_region = op(0, kStride, buf.data());
  bad_region.region = 99;
  EXPECT_TRUE(t->Submit({&bad_region, 1}, noop).IsInvalidArgument());
  ReadOp zero = op(0, 0, buf.data());
  EXPECT_TRUE(t->Submit({&zero, 1}, noop).IsInvalidArgument());
  EXPECT_EQ(t->counters().batches_submitted, 0u);

  // The in-flight bound: hold replies on a slow server, then overfill.
  server_->Stop();
  RowServerOptions slow;
  slow.TEST_response_delay_ms = 300;
  StartServer(slow, 0);
  auto t2 = Connect(server_->port(), o);
  auto r2 = t2->OpenRegion(creds_);
  ASSERT_TRUE(r2.ok());
  ASSERT_TRUE(t2->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::vector<ReadOp> six, five;
  for (int i = 0; i < 6; ++i) six.push_back(ReadOp{r2->id, 0, kStride, buf.data() + i * kStride});
  for (int i = 0; i < 5; ++i)
    five.push_back(ReadOp{r2->id, 0, kStride, buf.data() + (8 + i) * kStride});
  std::atomic<int> completions{0};
  ASSERT_TRUE(t2->Submit(six, [&](const Status& s) { completions += s.ok() ? 1 : 100; }).ok());
  EXPECT_EQ(t2->counters().reads_in_flight, 6u);
  EXPECT_TRUE(t2->Submit(five, noop).IsRejected());  // 6 + 5 > 10
  std::vector<ReadOp> four(five.begin(), five.begin() + 4);
  ASSERT_TRUE(t2->Submit(four, [&](const Status& s) { completions += s.ok() ? 1 : 100; }).ok());
  for (int i = 0; i < 200 && completions.load() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(completions.load(), 2);
  EXPECT_EQ(t2->counters().reads_in_flight, 0u);
}

TEST_F(TcpTransportTest, MissingExpiredRevokedOrForeignGrantsArePermissionDenied) {
  auto t = Connect(server_->port());
  // No grant at all / a token for another tenant / for another region name.
  RegionCredentials bogus = creds_;
  bogus.token[0] ^= 0xff;
  EXPECT_TRUE(t->OpenRegion(bogus).status().IsPermissionDenied());
  RegionCredentials other_tenant = creds_;
  other_tenant.tenant = "tenant-b";
  EXPECT_TRUE(t->OpenRegion(other_tenant).status().IsPermissionDenied());
  RegionCredentials no_region = creds_;
  no_region.region_name = "engram.l6";
  EXPECT_TRUE(t->OpenRegion(no_region).status().IsNotFound());
  EXPECT_TRUE(server_->IssueGrant("engram.l6", "tenant-a", 1000).status().IsNotFound());

  // A short grant: valid now, expired after the clock moves past it.
  auto short_token = server_->IssueGrant("engram.l1", "tenant-a", 50);
  ASSERT_TRUE(short_token.ok());
  RegionCredentials short_creds{"engram.l1", "tenant-a", *short_token};
  auto region = t->OpenRegion(short_creds);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::vector<uint8_t> buf(kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  ReadOp op{region->id, 3 * kStride, kStride, buf.data()};
  ASSERT_TRUE(ReadSync(*t, {&op, 1}).ok());
  clock_.AdvanceMs(51);
  Status expired = ReadSync(*t, {&op, 1});
  EXPECT_TRUE(expired.IsPermissionDenied()) << expired.ToString();
  EXPECT_TRUE(t->OpenRegion(short_creds).status().IsPermissionDenied());

  // Revocation takes effect on the next batch; the connection itself stays usable.
  auto main_region = t->OpenRegion(creds_);
  ASSERT_TRUE(main_region.ok());
  ReadOp op2{main_region->id, 0, kStride, buf.data()};
  ASSERT_TRUE(ReadSync(*t, {&op2, 1}).ok());
  ASSERT_TRUE(server_->RevokeGrant(creds_.token).ok());
  EXPECT_TRUE(ReadSync(*t, {&op2, 1}).IsPermissionDenied());
  EXPECT_TRUE(server_->RevokeGrant(creds_.token).IsNotFound());
  EXPECT_GE(server_->counters().permission_denied, 4u);
  EXPECT_EQ(t->counters().disconnects, 0u);
}

TEST_F(TcpTransportTest, ServerRestartFailsReadsInFlightThenReconnectsExactly) {
  // Replies are held back so that reads are surely in flight when the server stops.
  server_->Stop();
  RowServerOptions slow;
  slow.TEST_response_delay_ms = 2000;
  StartServer(slow, 0);
  const uint16_t port = server_->port();
  auto t = Connect(port);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::vector<uint8_t> buf(8 * kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Status> results;
  for (int b = 0; b < 4; ++b) {
    std::vector<ReadOp> ops = {
        {region->id, uint64_t(b) * kStride, kStride, buf.data() + b * kStride}};
    ASSERT_TRUE(t->Submit(ops, [&](const Status& s) {
                   std::lock_guard<std::mutex> lock(mu);
                   results.push_back(s);
                   cv.notify_all();
                 }).ok());
  }
  EXPECT_EQ(t->counters().reads_in_flight, 4u);
  server_->Stop();  // reads in flight must fail, not hang
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return results.size() == 4; }));
    for (const Status& s : results) EXPECT_TRUE(s.IsIOError()) << s.ToString();
  }
  EXPECT_EQ(t->counters().reads_in_flight, 0u);
  EXPECT_EQ(t->counters().disconnects, 1u);

  // The server comes back on the same port (its grants re-installed): the same transport
  // reconnects on the next read, re-attaches the region and returns exact bytes.
  StartServer(RowServerOptions{}, port);
  ExpectRowsExact(*t, region->id, {9, 10, kRows - 1, 0, 9});
  EXPECT_EQ(t->counters().connects, 2u);

  // Back again without the grant: re-attaching fails and reads say PermissionDenied.
  server_->Stop();
  StartServer(RowServerOptions{}, port, /*grant=*/false);
  ReadOp op{region->id, 9 * kStride, kStride, buf.data()};
  // The first read may still go out on the dead connection (the client has not seen the
  // close yet) and fail with IOError; the next one reconnects.
  Status denied = ReadSync(*t, {&op, 1});
  if (denied.IsIOError()) denied = ReadSync(*t, {&op, 1});
  EXPECT_TRUE(denied.IsPermissionDenied()) << denied.ToString();
}

TEST_F(TcpTransportTest, ReconnectReattachesRegionsWhenServerKeepsGrants) {
  // A server that stays up but drops the connection (Reconnect()): the transport re-opens
  // its regions on the new connection and RegionIds stay valid.
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  ExpectRowsExact(*t, region->id, {1, 2, 3});
  ASSERT_TRUE(t->Reconnect().ok());
  ExpectRowsExact(*t, region->id, {4, 4999});
  EXPECT_EQ(t->counters().connects, 2u);
  EXPECT_EQ(server_->counters().connections_accepted, 2u);
}

// Several threads submit to one transport at once. Frames must leave in the order of the
// transport's pending queue (the server answers in request order): a frame overtaking
// another used to make the reply mismatch, drop the connection and fail every batch.
TEST_F(TcpTransportTest, ConcurrentSubmittersGetExactBytesInSubmissionOrder) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  constexpr SubmitterShape kShape{
      .threads = 4, .batches = 48, .ops_max = 6, .window = 6, .row_seed = 1009};
  ExpectConcurrentSubmittersExact(*t, region->id, kShape);
  EXPECT_EQ(t->counters().connects, 1u);
  EXPECT_EQ(server_->counters().batches_served, kShape.threads * kShape.batches);
}

// A reconnect is ready only when every region is re-opened: a read submitted meanwhile
// waits for it. The restarted server is slow to answer OPEN and numbers its tables
// differently (a decoy table comes first), so a read sent with the old connection's region
// id would be refused (or, worse, read another table).
TEST_F(TcpTransportTest, ReconnectServesNoReadBeforeRegionsAreReopened) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  ExpectRowsExact(*t, region->id, {1, 2});
  const uint16_t port = server_->port();
  server_->Stop();
  const std::string decoy = MakeTable(dir_, "decoy.engram", kRows, kRows, kRowDim);
  RowServerOptions o;
  o.port = port;
  o.clock = &clock_;
  o.TEST_open_delay_ms = 400;
  server_ = std::make_unique<RowServer>(o);
  ASSERT_TRUE(server_->RegisterTable("decoy", decoy).ok());
  ASSERT_TRUE(server_->RegisterTable("engram.l1", path_).ok());
  ASSERT_TRUE(server_->Start().ok());
  ASSERT_TRUE(server_->AddGrant(creds_.token, "engram.l1", "tenant-a", 60000).ok());

  Status reconnected;
  std::thread reconnect([&] { reconnected = t->Reconnect(); });
  // Wait until the new connection is up and its OPEN is being held back by the server.
  for (int i = 0; i < 2000 && server_->counters().connections_accepted == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(server_->counters().connections_accepted, 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ExpectRowsExact(*t, region->id, {7, 8, kRows - 1});
  reconnect.join();
  EXPECT_TRUE(reconnected.ok()) << reconnected.ToString();
  EXPECT_EQ(t->counters().batches_failed, 0u);
  EXPECT_EQ(server_->counters().connections_accepted, 1u);
}

// Close() while another thread is reconnecting (its re-open held back by the server): both
// return, the Submit with an error, instead of the reconnect waiting forever on a stopped
// I/O thread.
TEST_F(TcpTransportTest, CloseDuringAReconnectReturns) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::vector<uint8_t> buf(kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  const uint16_t port = server_->port();
  server_->Stop();
  RowServerOptions slow;
  slow.TEST_open_delay_ms = 300;
  StartServer(slow, port);
  auto submitted = std::async(std::launch::async, [&] {
    ReadOp op{region->id, 0, kStride, buf.data()};
    return ReadSync(*t, {&op, 1});  // reconnects first (the old connection is gone)
  });
  for (int i = 0; i < 2000 && server_->counters().connections_accepted == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  t->Close();
  ASSERT_EQ(submitted.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const Status st = submitted.get();
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(st.IsUnavailable() || st.IsIOError()) << st.ToString();
}

// A READ naming a region the connection never opened gets `retry` (the client's view of the
// connection is stale), not permission_denied, and the connection stays up.
TEST_F(TcpTransportTest, ReadOfARegionNotOpenedHereIsRetry) {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address("127.0.0.1"), server_->port()});
  std::vector<wire::ReadOpWire> one = {{1, kStride, 0}};
  for (uint64_t id = 1; id <= 2; ++id) {  // twice: the connection survives the first
    asio::write(s, asio::buffer(wire::BuildReadRequest(id, one)));
    std::array<uint8_t, wire::kHeaderBytes> header{};
    asio::read(s, asio::buffer(header));
    wire::ResponseHeader h;
    ASSERT_TRUE(wire::DecodeResponseHeader(header.data(), &h).ok());
    EXPECT_EQ(h.request_id, id);
    EXPECT_EQ(h.code, StatusCode::kRetry);
    std::string message(h.message_bytes, '\0');
    asio::read(s, asio::buffer(message));
    EXPECT_NE(message.find("not opened"), std::string::npos) << message;
  }
  EXPECT_EQ(server_->counters().permission_denied, 0u);
}

TEST_F(TcpTransportTest, SilentServerTimesOutInsteadOfHanging) {
  RowServerOptions slow;
  slow.TEST_response_delay_ms = 3000;
  server_->Stop();
  StartServer(slow, 0);
  TransportOptions o = testing::FastOptions();
  o.request_timeout_ms = 200;
  auto t = Connect(server_->port(), o);
  // The open reply is not delayed; reads are.
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  std::vector<uint8_t> buf(kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  ReadOp op{region->id, 0, kStride, buf.data()};
  const uint64_t t0 = DefaultSteadyClock().NowMs();
  Status st = ReadSync(*t, {&op, 1});
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  EXPECT_LT(DefaultSteadyClock().NowMs() - t0, 2500u);  // failed by the timeout, not the reply
}

TEST_F(TcpTransportTest, UnreachableServerIsIOError) {
  const uint16_t port = server_->port();
  server_->Stop();
  auto t = Connect(port);
  EXPECT_TRUE(t->Connect().IsIOError());
  EXPECT_TRUE(t->OpenRegion(creds_).status().IsIOError());
  t->Close();
  EXPECT_TRUE(t->Connect().IsUnavailable());
}

// Sends raw bytes to the server on a fresh socket; returns true if the server closed it.
bool ServerClosesAfter(uint16_t port, const std::vector<uint8_t>& bytes) {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  boost::system::error_code ec;
  s.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
  if (ec) return false;
  asio::write(s, asio::buffer(bytes), ec);
  if (ec) return true;
  uint8_t byte;
  // A clean close: EOF (or reset) instead of a reply.
  asio::read(s, asio::buffer(&byte, 1), ec);
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

// Waits up to `timeout_ms` for the server to close `s` (EOF or reset); reads and drops what
// the server sent before.
bool ClosedByServerWithin(boost::asio::ip::tcp::socket& s, int timeout_ms) {
  const int fd = s.native_handle();
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    uint8_t buf[4096];
    const ssize_t k = ::recv(fd, buf, sizeof(buf), 0);
    if (k == 0 || (k < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

// A full descriptor table: the row server's accept used to be retried at once after EMFILE,
// the listening socket readable while connections wait in its backlog, so its I/O thread
// spun until a descriptor was freed. Now it pauses (common/accept_backoff.h) and counts it;
// the waiting connections are accepted once descriptors are free. The server runs in this
// process, so the test lowers its own open-file limit: the client sockets are made first
// (connecting needs no new descriptor; accepting does).
TEST_F(TcpTransportTest, AFullDescriptorTablePausesAcceptsInsteadOfSpinning) {
  KVTIER_SKIP_WITHOUT_DESCRIPTORS_UNDER_UBSAN();
  StartServer(RowServerOptions{}, 0);
  constexpr int kClients = 24;
  kvtier::testing::DescriptorStarvedClients clients(server_->port(), kClients, /*accepts_room=*/4);
  ASSERT_EQ(clients.error(), "");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The server holds what it could accept and must be idle, not spinning: a spinning
  // accept loop uses a whole core; this allows a quarter of one.
  const double cpu_used = kvtier::testing::SelfCpuSecondsOver(std::chrono::seconds(2));
  const RowServerCounters full = server_->counters();
  clients.RestoreLimit();
  EXPECT_LT(cpu_used, 0.5) << "CPU seconds over 2 s with a full descriptor table";
  EXPECT_LT(full.connections_accepted, static_cast<uint64_t>(kClients));
  EXPECT_GT(full.accept_waits, 0u);

  // With descriptors again, every waiting connection is accepted, and the server serves.
  EXPECT_EQ(
      kvtier::testing::PollUntilEqual([&] { return server_->counters().connections_accepted; },
                                      uint64_t{kClients}, 10000),
      uint64_t{kClients});
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  ExpectRowsExact(*t, region->id, {0, kRows - 1});
}

// Connection slots are for clients with grants: connections that attach no region are closed
// after attach_timeout_ms (so four silent ones cannot hold four slots for ever), one that
// leaves a request body unfinished after body_timeout_ms; an attached connection may idle.
TEST_F(TcpTransportTest, SilentConnectionsAndStalledBodiesAreClosed) {
  namespace asio = boost::asio;
  RowServerOptions o;
  o.connections_max = 4;
  o.attach_timeout_ms = 300;
  o.body_timeout_ms = 300;
  StartServer(o, 0);
  const uint16_t port = server_->port();
  asio::io_context io;
  const asio::ip::tcp::endpoint at(asio::ip::make_address("127.0.0.1"), port);
  std::vector<asio::ip::tcp::socket> silent;
  for (int i = 0; i < 4; ++i) {
    silent.emplace_back(io);
    boost::system::error_code ec;
    silent.back().connect(at, ec);
    ASSERT_FALSE(ec) << ec.message();
  }
  {  // The slots are taken: a fifth connection is closed at once.
    asio::ip::tcp::socket fifth(io);
    boost::system::error_code ec;
    fifth.connect(at, ec);
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_TRUE(ClosedByServerWithin(fifth, 5000));
  }
  EXPECT_GE(server_->counters().connections_refused, 1u);
  for (auto& s : silent) EXPECT_TRUE(ClosedByServerWithin(s, 10000));
  EXPECT_EQ(server_->counters().unattached_closed, 4u);

  // A client with a grant gets a slot, and keeps it while idle past both timeouts.
  auto t = Connect(port);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  ExpectRowsExact(*t, region->id, {0, 1, kRows - 1});
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  ExpectRowsExact(*t, region->id, {2, 3});
  EXPECT_EQ(t->counters().disconnects, 0u);

  // An attached connection that announces a body and stops halfway is closed.
  asio::ip::tcp::socket raw(io);
  boost::system::error_code ec;
  raw.connect(at, ec);
  ASSERT_FALSE(ec) << ec.message();
  const std::vector<uint8_t> open =
      wire::BuildOpenRequest(1, wire::OpenRequest{creds_.token, "engram.l1", "tenant-a"});
  asio::write(raw, asio::buffer(open), ec);
  ASSERT_FALSE(ec) << ec.message();
  std::array<uint8_t, wire::kHeaderBytes> header{};
  asio::read(raw, asio::buffer(header), ec);
  ASSERT_FALSE(ec) << ec.message();
  wire::ResponseHeader reply;
  ASSERT_TRUE(wire::DecodeResponseHeader(header.data(), &reply).ok());
  ASSERT_EQ(reply.code, StatusCode::kOk);
  std::vector<uint8_t> rest(reply.message_bytes + reply.data_bytes);
  asio::read(raw, asio::buffer(rest), ec);
  ASSERT_FALSE(ec) << ec.message();
  // Two ops (their body never arrives whole, so what they name does not matter).
  const std::vector<wire::ReadOpWire> ops = {{1, kStride, 0}, {1, kStride, 0}};
  const std::vector<uint8_t> read = wire::BuildReadRequest(2, ops);
  asio::write(raw, asio::buffer(read.data(), wire::kHeaderBytes + 5), ec);
  ASSERT_FALSE(ec) << ec.message();
  EXPECT_TRUE(ClosedByServerWithin(raw, 10000));
  EXPECT_EQ(server_->counters().bodies_timed_out, 1u);
  EXPECT_EQ(server_->counters().unattached_closed, 4u);  // it had attached
  ExpectRowsExact(*t, region->id, {4});                  // the server serves on
}

TEST_F(TcpTransportTest, MalformedFramesCloseTheConnectionAndServerStaysHealthy) {
  const uint16_t port = server_->port();
  std::vector<uint8_t> garbage(64, 0xab);
  EXPECT_TRUE(ServerClosesAfter(port, garbage));
  // Right magic, absurd op count.
  std::vector<wire::ReadOpWire> one = {{1, 8, 0}};
  std::vector<uint8_t> frame = wire::BuildReadRequest(1, one);
  frame[18] = 0xff;
  EXPECT_TRUE(ServerClosesAfter(port, frame));
  // A valid header announcing an open body that is garbage.
  wire::OpenRequest open{creds_.token, "engram.l1", "tenant-a"};
  std::vector<uint8_t> bad_open = wire::BuildOpenRequest(2, open);
  bad_open[wire::kHeaderBytes] = 0xff;  // name length beyond the body
  EXPECT_TRUE(ServerClosesAfter(port, bad_open));
  // Reserved op bytes set.
  std::vector<uint8_t> reserved = wire::BuildReadRequest(3, one);
  reserved[wire::kHeaderBytes + 20] = 1;
  EXPECT_TRUE(ServerClosesAfter(port, reserved));
  EXPECT_EQ(server_->counters().malformed_frames, 4u);

  // A read of a region this connection never opened is refused without a disconnect.
  auto t = Connect(port);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  ExpectRowsExact(*t, region->id, {0, 1, 2, 4999});
  EXPECT_EQ(t->counters().disconnects, 0u);
}

}  // namespace
}  // namespace kvtier::rdma

namespace kvtier::rdma {
namespace {

// Submit() on an idle transport writes the frame on the calling thread (no hand-off to the
// I/O thread): every batch of a sequence of synchronous reads is counted as sent inline.
TEST_F(TcpTransportTest, SubmitOnAnIdleTransportWritesOnTheCallingThread) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  for (uint64_t i = 0; i < 20; ++i) ExpectRowsExact(*t, region->id, {i, kRows - 1 - i, 7 * i});
  const TransportCounters c = t->counters();
  EXPECT_EQ(c.batches_submitted, 20u);
  EXPECT_EQ(c.batches_sent_inline, 20u);
  EXPECT_EQ(c.batches_failed, 0u);
}

// Poll() reads replies and runs their callbacks on the calling thread: with the I/O thread's
// reading paused, only Poll() completes them, exactly once each, with exact bytes.
TEST_F(TcpTransportTest, PollCompletesRepliesOnTheCallingThread) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  t->TEST_PauseIoReads(true);
  constexpr size_t kBatches = 8;
  std::vector<uint8_t> buf(kBatches * 3 * kStride, 0xee);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::atomic<size_t> done{0}, foreign{0}, failed{0};
  const std::thread::id me = std::this_thread::get_id();
  auto row_of = [](size_t b, size_t i) { return (b * 613 + i * 29) % kRows; };
  for (size_t b = 0; b < kBatches; ++b) {
    // 1 op (read in place) or 3 (staged and scattered).
    std::vector<ReadOp> ops;
    for (size_t i = 0; i < (b % 2 == 0 ? 1u : 3u); ++i) {
      ops.push_back(
          ReadOp{region->id, row_of(b, i) * kStride, kStride, buf.data() + (b * 3 + i) * kStride});
    }
    ASSERT_TRUE(t->Submit(ops, [&](const Status& s) {
                   if (std::this_thread::get_id() != me) foreign.fetch_add(1);
                   if (!s.ok()) failed.fetch_add(1);
                   done.fetch_add(1);
                 }).ok());
  }
  uint64_t polled = 0;
  const uint64_t deadline_us = DefaultSteadyClock().NowUs() + 10'000'000;
  while (done.load() < kBatches && DefaultSteadyClock().NowUs() < deadline_us) polled += t->Poll();
  ASSERT_EQ(done.load(), kBatches);
  EXPECT_EQ(polled, kBatches);
  EXPECT_EQ(foreign.load(), 0u);
  EXPECT_EQ(failed.load(), 0u);
  EXPECT_EQ(t->Poll(), 0u);  // nothing left
  for (size_t b = 0; b < kBatches; ++b) {
    for (size_t i = 0; i < (b % 2 == 0 ? 1u : 3u); ++i) {
      ASSERT_EQ(std::memcmp(buf.data() + (b * 3 + i) * kStride,
                            local_->rows().data() + row_of(b, i) * kStride, kStride),
                0)
          << "batch " << b << " op " << i;
    }
  }
  // Unpaused, the I/O thread reads again (a synchronous read waits for it alone).
  t->TEST_PauseIoReads(false);
  ExpectRowsExact(*t, region->id, {1, 2, 3});
  EXPECT_EQ(t->counters().reads_in_flight, 0u);
}

// Submitters, pollers and the I/O thread at once: every batch completes exactly once, with
// exact bytes, and one submitter's callbacks run in its submission order (replies are read
// by one reader at a time and their callbacks run in completion order).
TEST_F(TcpTransportTest, PollersAndTheIoThreadCompleteEachBatchOnceInOrder) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  constexpr SubmitterShape kShape{
      .threads = 3, .batches = 40, .ops_max = 4, .window = 4, .row_seed = 887};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> polled{0};
  std::vector<std::thread> pollers;
  for (int p = 0; p < 2; ++p) {
    pollers.emplace_back([&] {
      while (!stop.load()) polled.fetch_add(t->Poll());
    });
  }
  ExpectConcurrentSubmittersExact(*t, region->id, kShape);
  stop.store(true);
  for (std::thread& th : pollers) th.join();
  EXPECT_LE(polled.load(), kShape.threads * kShape.batches);
}

// A server that closes the connection while a poller reads: the batches in flight fail with
// IOError exactly once (never hang), and the next read reconnects.
TEST_F(TcpTransportTest, PolledConnectionLossFailsBatchesOnceAndReconnects) {
  RowServerOptions slow;
  slow.TEST_response_delay_ms = 200;
  const uint16_t port = server_->port();
  server_->Stop();
  StartServer(slow, port);
  auto t = Connect(port);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  t->TEST_PauseIoReads(true);
  std::vector<uint8_t> buf(4 * kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::atomic<int> done{0}, io_errors{0};
  for (int b = 0; b < 4; ++b) {
    ReadOp op{region->id, uint64_t(b) * kStride, kStride, buf.data() + b * kStride};
    ASSERT_TRUE(t->Submit(std::span<const ReadOp>(&op, 1), [&](const Status& s) {
                   if (s.IsIOError()) io_errors.fetch_add(1);
                   done.fetch_add(1);
                 }).ok());
  }
  server_->Stop();  // closes the connection before answering
  const uint64_t deadline_us = DefaultSteadyClock().NowUs() + 10'000'000;
  while (done.load() < 4 && DefaultSteadyClock().NowUs() < deadline_us) t->Poll();
  ASSERT_EQ(done.load(), 4);
  EXPECT_EQ(io_errors.load(), 4);
  t->TEST_PauseIoReads(false);
  StartServer(RowServerOptions{}, port);
  ExpectRowsExact(*t, region->id, {5, 6});
  EXPECT_EQ(t->counters().disconnects, 1u);
}

// A busy-polling server (own thread) serves the same bytes, also after idling past its
// polling window, and stops; a window over the bound is refused.
TEST_F(TcpTransportTest, BusyPollingServerServesExactRowsAndStops) {
  const uint16_t port = server_->port();
  server_->Stop();
  RowServerOptions busy;
  busy.busy_poll_us = 2000;
  StartServer(busy, port);
  auto t = Connect(port);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  for (uint64_t i = 0; i < 10; ++i) ExpectRowsExact(*t, region->id, {i, 3 * i + 1});
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // past the window: it sleeps
  ExpectRowsExact(*t, region->id, {kRows - 1});
  EXPECT_EQ(server_->counters().batches_served, 11u);
  server_->Stop();
  RowServerOptions over;
  over.busy_poll_us = kRowServerBusyPollMaxUs + 1;
  RowServer refused(over);
  EXPECT_TRUE(refused.Start().IsInvalidArgument());
}

// Batches submitted while writes are held leave together, in one send, when released
// (nested holds: the outermost release sends), and complete with exact bytes.
TEST_F(TcpTransportTest, HeldWritesLeaveTogetherInOneSend) {
  auto t = Connect(server_->port());
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::vector<uint8_t> buf(3 * kStride, 0xee);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  const uint64_t sends_before = t->counters().sends;
  std::atomic<int> done{0}, failed{0};
  t->HoldWrites();
  t->HoldWrites();
  for (uint64_t b = 0; b < 3; ++b) {
    ReadOp op{region->id, (100 + b) * kStride, kStride, buf.data() + b * kStride};
    ASSERT_TRUE(t->Submit(std::span<const ReadOp>(&op, 1), [&](const Status& s) {
                   if (!s.ok()) failed.fetch_add(1);
                   done.fetch_add(1);
                 }).ok());
  }
  t->ReleaseWrites();  // still held once
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(server_->counters().batches_served, 0u);
  EXPECT_EQ(t->counters().sends, sends_before);
  t->ReleaseWrites();
  const uint64_t deadline_us = DefaultSteadyClock().NowUs() + 10'000'000;
  while (done.load() < 3 && DefaultSteadyClock().NowUs() < deadline_us) t->Poll();
  ASSERT_EQ(done.load(), 3);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(t->counters().sends, sends_before + 1);
  for (uint64_t b = 0; b < 3; ++b) {
    ASSERT_EQ(
        std::memcmp(buf.data() + b * kStride, local_->rows().data() + (100 + b) * kStride, kStride),
        0);
  }
  t->ReleaseWrites();  // unbalanced: ignored
  ExpectRowsExact(*t, region->id, {9});
}

}  // namespace
}  // namespace kvtier::rdma
