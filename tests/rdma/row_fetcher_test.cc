// RowFetcher over two row servers (a sharded table) on loopback TCP.
#include "rdma/row_fetcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "tests/rdma/test_util.h"

namespace kvtier::rdma {
namespace {

using testing::MakeTable;
using testing::TempDir;

constexpr uint64_t kSplit = 3000, kRows = 7000;
constexpr uint32_t kRowDim = 32;  // the miniature model's row: 32 codes + 1 scale
constexpr uint32_t kStride = EngramRowBytes(kRowDim);

class RowFetcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    paths_[0] = MakeTable(dir_, "s0.engram", 0, kSplit, kRowDim);
    paths_[1] = MakeTable(dir_, "s1.engram", kSplit, kRows - kSplit, kRowDim);
    for (int s = 0; s < 2; ++s) {
      StartShard(s, 0);
      auto token = servers_[s]->IssueGrant(Name(s), "tenant-a", 600000);
      ASSERT_TRUE(token.ok());
      tokens_[s] = *token;
    }
  }

  static std::string Name(int s) { return "engram.l1.s" + std::to_string(s); }

  // A restart (`grant`) re-installs the grant before serving, as a control plane restoring
  // its grants would: installed after Start(), a client reconnecting in between was refused
  // (PermissionDenied, not retried) about 1 run in 20.
  void StartShard(int s, uint16_t port, bool grant = false) {
    servers_[s] = std::make_unique<RowServer>(RowServerOptions{.port = port});
    ASSERT_TRUE(servers_[s]->RegisterTable(Name(s), paths_[s]).ok());
    if (grant) {
      ASSERT_TRUE(servers_[s]->AddGrant(tokens_[s], Name(s), "tenant-a", 600000).ok());
    }
    ASSERT_TRUE(servers_[s]->Start().ok());
  }

  std::string ShardToml() const {
    std::string t;
    for (int s = 0; s < 2; ++s) {
      t += "[[engram.l1.shard]]\nregion = \"" + Name(s) +
           "\"\nendpoint = \"127.0.0.1:" + std::to_string(servers_[s]->port()) +
           "\"\nrow_begin = " + std::to_string(s == 0 ? 0 : kSplit) +
           "\nrow_end = " + std::to_string(s == 0 ? kSplit : kRows) + "\n";
    }
    return t;
  }

  // `raw` (optional) receives the shards' transports (owned by the fetcher).
  std::unique_ptr<RowFetcher> MakeFetcher(RowFetcherOptions o,
                                          TransportOptions to = testing::FastOptions(),
                                          std::vector<TcpTransport*>* raw = nullptr) {
    auto map = ShardMap::FromToml(ShardToml(), "engram.l1");
    EXPECT_TRUE(map.ok()) << map.status().ToString();
    std::vector<ShardConnection> conns;
    for (int s = 0; s < 2; ++s) {
      const ShardSpec& spec = map->shards()[s];
      auto t = testing::Connect(spec.port, to);
      if (raw != nullptr) raw->push_back(t.get());
      conns.push_back(
          ShardConnection{std::move(t), RegionCredentials{Name(s), "tenant-a", tokens_[s]}});
    }
    auto f = RowFetcher::Create(std::move(*map), std::move(conns), o);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return std::move(f).value();
  }

  static void ExpectRows(const std::vector<uint64_t>& rows, const uint8_t* out) {
    std::vector<uint8_t> expected(kStride);
    for (size_t i = 0; i < rows.size(); ++i) {
      FillSyntheticEngramRow(testing::kSeed, rows[i], kRowDim, expected.data());
      ASSERT_EQ(std::memcmp(out + i * kStride, expected.data(), kStride), 0)
          << "position " << i << " row " << rows[i];
    }
  }

  TempDir dir_;
  std::string paths_[2];
  std::unique_ptr<RowServer> servers_[2];
  wire::GrantToken tokens_[2];
};

TEST_F(RowFetcherTest, ShardedFetchIsExactWithDedupAndHotCache) {
  RowFetcherOptions o;
  o.batch_ops_max = 64;  // forces several batches per shard
  auto f = MakeFetcher(o);
  ASSERT_EQ(f->row_stride_bytes(), kStride);
  ASSERT_EQ(f->row_count(), kRows);
  std::mt19937_64 rng(7);
  std::vector<uint64_t> rows;
  for (int i = 0; i < 1000; ++i) rows.push_back(rng() % kRows);
  rows.push_back(kSplit - 1);
  rows.push_back(kSplit);
  rows.push_back(kRows - 1);
  rows.push_back(rows[0]);  // a guaranteed duplicate
  std::vector<uint8_t> out(rows.size() * kStride, 0xcd);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  Status st = f->FetchRows(rows, out.data());
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectRows(rows, out.data());
  const size_t unique = std::set<uint64_t>(rows.begin(), rows.end()).size();
  RowFetchStats s = f->stats();
  EXPECT_EQ(s.rows_requested, rows.size());
  EXPECT_EQ(s.rows_deduplicated, rows.size() - unique);
  EXPECT_EQ(s.hot_cache_hits, 0u);
  EXPECT_EQ(s.rows_read, unique);
  EXPECT_EQ(s.bytes_read, unique * kStride);
  EXPECT_EQ(s.reads_in_flight, 0u);

  // The same rows again: all from the hot cache (8 MiB holds them), no reads.
  std::fill(out.begin(), out.end(), 0);
  ASSERT_TRUE(f->FetchRows(rows, out.data()).ok());
  ExpectRows(rows, out.data());
  s = f->stats();
  EXPECT_EQ(s.hot_cache_hits, unique);
  EXPECT_EQ(s.rows_read, unique);
  EXPECT_EQ(f->transport(0).counters().ops_submitted + f->transport(1).counters().ops_submitted,
            unique);
}

TEST_F(RowFetcherTest, PrefetchThenWaitCountsLateRowsOnlyWhenLate) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  auto f = MakeFetcher(o);
  std::vector<uint64_t> rows = {5, 6, 7, 5000, 6000};
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  auto fetch = f->Start(rows, out.data());
  ASSERT_TRUE(fetch.ok());
  // Let the prefetch land before waiting (lookahead): nothing is late.
  for (int i = 0; i < 500 && f->stats().rows_read < rows.size(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(f->Wait(*fetch).ok());
  EXPECT_EQ(f->stats().late_rows, 0u);
  EXPECT_EQ(f->stats().stalls, 0u);
  ExpectRows(rows, out.data());
  EXPECT_TRUE(f->Wait(*fetch).IsInvalidArgument());  // once per handle
  // Out of range and empty requests are refused up front.
  std::vector<uint64_t> bad = {kRows};
  EXPECT_TRUE(f->Start(bad, out.data()).status().IsInvalidArgument());
  EXPECT_TRUE(f->Start({}, out.data()).status().IsInvalidArgument());
}

TEST_F(RowFetcherTest, ShardRestartMidRunIsRetriedAndExact) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.retries_max = 5;
  o.retry_backoff_ms = 50;
  auto f = MakeFetcher(o);
  std::vector<uint64_t> rows;
  for (uint64_t r = 0; r < kRows; r += 13) rows.push_back(r);
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  ASSERT_TRUE(f->FetchRows(rows, out.data()).ok());
  // Shard 1 restarts (same port, grant re-installed): the next fetch's first attempt on it
  // fails or reconnects; either way the result is exact.
  const uint16_t port = servers_[1]->port();
  servers_[1]->Stop();
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    StartShard(1, port, /*grant=*/true);
  });
  std::fill(out.begin(), out.end(), 0);
  Status st = f->FetchRows(rows, out.data());
  restart.join();
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectRows(rows, out.data());
  EXPECT_GE(f->stats().retries, 1u);
  EXPECT_GE(f->transport(1).counters().connects, 2u);
}

TEST_F(RowFetcherTest, BoundedRetryThenClearError) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.retries_max = 2;
  o.retry_backoff_ms = 10;
  auto f = MakeFetcher(o);
  servers_[0]->Stop();  // gone for good
  std::vector<uint64_t> rows = {1, 2, 3, 4000};
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  Status st = f->FetchRows(rows, out.data());
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  EXPECT_NE(st.message().find("after 3 attempt"), std::string::npos) << st.ToString();
  EXPECT_EQ(f->stats().fetches_failed, 1u);
  EXPECT_EQ(f->stats().retries, 2u);
}

TEST_F(RowFetcherTest, RevokedGrantFailsWithoutRetry) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  auto f = MakeFetcher(o);
  ASSERT_TRUE(servers_[1]->RevokeGrant(tokens_[1]).ok());
  std::vector<uint64_t> rows = {1, 6500};
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  Status st = f->FetchRows(rows, out.data());
  EXPECT_TRUE(st.IsPermissionDenied()) << st.ToString();
  EXPECT_EQ(f->stats().retries, 0u);
}

TEST_F(RowFetcherTest, InFlightBoundIsFlowControlNotFailure) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.batch_ops_max = 16;
  TransportOptions to = testing::FastOptions();
  to.reads_in_flight_max = 32;  // two batches at a time per shard
  auto f = MakeFetcher(o, to);
  std::vector<uint64_t> rows;
  for (uint64_t r = 0; r < kRows; r += 3) rows.push_back(r);
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  Status st = f->FetchRows(rows, out.data());
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectRows(rows, out.data());
  EXPECT_EQ(f->stats().retries, 0u);
}

// A prefetch larger than the transports' bound on reads in flight keeps going while nobody
// waits on it: completions push the refused batches (before, they left only inside Wait(),
// so rows requested ahead of their layer arrived late).
TEST_F(RowFetcherTest, FlowControlledPrefetchCompletesWithoutWaiting) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.batch_ops_max = 16;
  TransportOptions to = testing::FastOptions();
  to.reads_in_flight_max = 32;  // two batches at a time per shard
  auto f = MakeFetcher(o, to);
  std::vector<uint64_t> rows;
  for (uint64_t r = 0; r < kRows; r += 5) rows.push_back(r);  // 1400 rows: 88 batches
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  auto fetch = f->Start(rows, out.data());
  ASSERT_TRUE(fetch.ok()) << fetch.status().ToString();
  // No Wait() yet: every row must still be read.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (f->stats().rows_read < rows.size() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(f->stats().rows_read, rows.size());
  ASSERT_TRUE(f->Wait(*fetch).ok());
  ExpectRows(rows, out.data());
  EXPECT_EQ(f->stats().late_rows, 0u);
  EXPECT_EQ(f->stats().stalls, 0u);
}

TEST_F(RowFetcherTest, CreateChecksShardsAgainstTheMap) {
  // A map that claims shard 0 holds more rows than its file.
  auto map = ShardMap::Create({{0, kSplit + 10, "127.0.0.1", servers_[0]->port(), Name(0)},
                               {kSplit + 10, kRows, "127.0.0.1", servers_[1]->port(), Name(1)}});
  ASSERT_TRUE(map.ok());
  std::vector<ShardConnection> conns;
  for (int s = 0; s < 2; ++s) {
    conns.push_back(ShardConnection{testing::Connect(servers_[s]->port()),
                                    RegionCredentials{Name(s), "tenant-a", tokens_[s]}});
  }
  EXPECT_TRUE(RowFetcher::Create(std::move(*map), std::move(conns), RowFetcherOptions{})
                  .status()
                  .IsInvalidArgument());
}

// Rows whose replies are already in the sockets are not late: Wait() reads them on its own
// thread (Transport::Poll) before it decides. The transports' I/O threads do not read here.
TEST_F(RowFetcherTest, RowsAlreadyInTheSocketsAreTakenByWaitWithoutAStall) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.wait_spin_us = 0;
  o.fetch_timeout_ms = 3000;
  std::vector<TcpTransport*> raw;
  auto f = MakeFetcher(o, testing::FastOptions(), &raw);
  for (TcpTransport* t : raw) t->TEST_PauseIoReads(true);
  std::vector<uint64_t> rows = {5, 6, 7, 5000, 6000, 5};
  std::vector<uint8_t> out(rows.size() * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  auto fetch = f->Start(rows, out.data());
  ASSERT_TRUE(fetch.ok());
  // Both replies are in the client sockets (header + rows of each shard's batch).
  const size_t reply_bytes[2] = {wire::kHeaderBytes + 3 * kStride,
                                 wire::kHeaderBytes + 2 * kStride};
  for (int i = 0; i < 5000; ++i) {
    if (raw[0]->TEST_ReadableBytes() >= reply_bytes[0] &&
        raw[1]->TEST_ReadableBytes() >= reply_bytes[1])
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_GE(raw[0]->TEST_ReadableBytes(), reply_bytes[0]);
  ASSERT_GE(raw[1]->TEST_ReadableBytes(), reply_bytes[1]);
  Status st = f->Wait(*fetch);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectRows(rows, out.data());
  EXPECT_EQ(f->stats().late_rows, 0u);
  EXPECT_EQ(f->stats().stalls, 0u);
  for (TcpTransport* t : raw) t->TEST_PauseIoReads(false);
}

// Rows still on their way: Wait() completes the replies on its own thread (spinning, then
// blocked and waking to poll), not only through the transports' I/O threads (paused here:
// otherwise the fetch would time out).
TEST_F(RowFetcherTest, LateRowsAreCompletedByTheWaiterItself) {
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.wait_spin_us = kRowFetchWaitSpinMaxUs;  // 100 ms: the replies come after 5
  o.fetch_timeout_ms = 3000;
  o.retries_max = 0;
  for (int s = 0; s < 2; ++s) {
    servers_[s]->Stop();
    servers_[s].reset();
  }
  std::vector<TcpTransport*> raw;
  // Restart both shards answering 5 ms late, on new ports.
  for (int s = 0; s < 2; ++s) {
    servers_[s] = std::make_unique<RowServer>(RowServerOptions{.TEST_response_delay_ms = 5});
    ASSERT_TRUE(servers_[s]->RegisterTable(Name(s), paths_[s]).ok());
    ASSERT_TRUE(servers_[s]->AddGrant(tokens_[s], Name(s), "tenant-a", 600000).ok());
    ASSERT_TRUE(servers_[s]->Start().ok());
  }
  auto f = MakeFetcher(o, testing::FastOptions(), &raw);
  for (TcpTransport* t : raw) t->TEST_PauseIoReads(true);
  std::vector<uint8_t> out(4 * kStride);
  ASSERT_TRUE(f->RegisterBuffer(out.data(), out.size()).ok());
  for (int round = 0; round < 3; ++round) {
    std::vector<uint64_t> rows = {uint64_t(round), 4000 + uint64_t(round), 2999, 3000};
    auto fetch = f->Start(rows, out.data());
    ASSERT_TRUE(fetch.ok());
    Status st = f->Wait(*fetch);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ExpectRows(rows, out.data());
  }
  EXPECT_GE(f->stats().stalls, 1u);  // late (unless this thread was held up over 5 ms)
  EXPECT_EQ(f->stats().fetches_failed, 0u);
  for (TcpTransport* t : raw) t->TEST_PauseIoReads(false);
  // A spin over the bound is refused.
  RowFetcherOptions bad;
  bad.wait_spin_us = kRowFetchWaitSpinMaxUs + 1;
  auto map = ShardMap::FromToml(ShardToml(), "engram.l1");
  ASSERT_TRUE(map.ok());
  std::vector<ShardConnection> conns;
  for (int s = 0; s < 2; ++s) {
    conns.push_back(ShardConnection{testing::Connect(servers_[s]->port()),
                                    RegionCredentials{Name(s), "tenant-a", tokens_[s]}});
  }
  EXPECT_TRUE(
      RowFetcher::Create(std::move(*map), std::move(conns), bad).status().IsInvalidArgument());
}

// A transport the test drives by hand: Submit keeps each callback for the test to call, refuses
// one submission when told (flow control), and blocks while its gate is closed.
class HandDrivenTransport final : public Transport {
 public:
  static constexpr uint64_t kRows = 64;
  static constexpr uint32_t kStride = 64;
  Status Connect() override { return Status::Ok(); }
  Status Reconnect() override { return Status::Ok(); }
  StatusOr<RegionInfo> OpenRegion(const RegionCredentials&) override {
    return RegionInfo{1, kRows * kStride, kStride, 32, 0, kRows};
  }
  StatusOr<LocalBufferId> RegisterLocalBuffer(uint8_t*, size_t) override { return 1; }
  Status UnregisterLocalBuffer(LocalBufferId) override { return Status::Ok(); }
  Status Submit(std::span<const ReadOp> ops, ReadCallback done) override {
    std::unique_lock<std::mutex> lock(mu);
    ++submits;
    cv.notify_all();
    if (reject_next || reject_all) {
      reject_next = false;
      return Status::Rejected("reads in flight");
    }
    cv.wait(lock, [&] { return !gate_closed; });
    callbacks.push_back(std::move(done));
    submitted.emplace_back(ops.begin(), ops.end());
    cv.notify_all();
    return Status::Ok();
  }
  // Writes row r's bytes (every byte r + 1) for each op of submission i, as a read would.
  void Land(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    for (const ReadOp& op : submitted[i]) {
      std::memset(op.dest, static_cast<int>(op.offset_bytes / kStride + 1), op.length_bytes);
    }
  }
  void Close() override {}
  TransportCounters counters() const override { return {}; }
  const char* name() const override { return "hand"; }

  std::mutex mu;
  std::condition_variable cv;
  int submits = 0;                             // guarded by mu
  bool reject_next = false;                    // guarded by mu
  bool reject_all = false;                     // guarded by mu: every submission refused
  bool gate_closed = false;                    // guarded by mu
  std::vector<ReadCallback> callbacks;         // guarded by mu
  std::vector<std::vector<ReadOp>> submitted;  // guarded by mu; one per callback
};

// A batch's callback goes on using the fetcher after it has woken the batch's Wait(): it pumps
// the backlog, here into a Submit that blocks. The fetcher's destructor must not return before
// that callback has (it did: ASan found the callback writing a freed fetcher).
TEST(RowFetcherLifetime, DestructorWaitsForACallbackThatWokeItsWait) {
  auto transport = std::make_shared<HandDrivenTransport>();
  auto map = ShardMap::Create({ShardSpec{0, HandDrivenTransport::kRows, "127.0.0.1", 1, "hand"}});
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::vector<ShardConnection> conns = {{transport, RegionCredentials{"hand", "t", {}}}};
  RowFetcherOptions o;
  o.hot_cache_bytes = 0;
  o.wait_spin_us = 0;
  auto fetcher = RowFetcher::Create(std::move(*map), std::move(conns), o);
  ASSERT_TRUE(fetcher.ok()) << fetcher.status().ToString();
  std::vector<uint8_t> out(2 * HandDrivenTransport::kStride);
  ASSERT_TRUE((*fetcher)->RegisterBuffer(out.data(), out.size()).ok());
  const uint64_t row_a = 0, row_b = 1;
  auto a = (*fetcher)->Start({&row_a, 1}, out.data());
  ASSERT_TRUE(a.ok());
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    transport->reject_next = true;  // b goes to the backlog
  }
  auto b = (*fetcher)->Start({&row_b, 1}, out.data() + HandDrivenTransport::kStride);
  ASSERT_TRUE(b.ok());
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    ASSERT_EQ(transport->callbacks.size(), 1u);
    transport->gate_closed = true;  // b's next submission (from a's callback) blocks
  }
  ReadCallback done_a;
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    done_a = transport->callbacks[0];
  }
  std::thread io([&] { done_a(Status::Ok()); });  // wakes Wait(a), then pumps b: blocks
  ASSERT_TRUE((*fetcher)->Wait(*a).ok());
  {
    std::unique_lock<std::mutex> lock(transport->mu);
    ASSERT_TRUE(transport->cv.wait_for(lock, std::chrono::seconds(10),
                                       [&] { return transport->submits == 3; }));
  }
  std::atomic<bool> destroyed{false};
  std::thread destroy([&] {
    fetcher->reset();
    destroyed.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(destroyed.load()) << "the fetcher was destroyed under a running callback";
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    transport->gate_closed = false;
    transport->cv.notify_all();
  }
  io.join();  // a's callback has returned; b's batch is in flight
  EXPECT_FALSE(destroyed.load()) << "the fetcher was destroyed with a batch's callback to come";
  ReadCallback done_b;
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    ASSERT_EQ(transport->callbacks.size(), 2u);
    done_b = transport->callbacks[1];
  }
  done_b(Status::Unavailable("closed"));
  destroy.join();
  EXPECT_TRUE(destroyed.load());
}

// A fetch whose Wait() failed (here: timed out while every submission was refused for flow
// control) is abandoned: its batch left on the backlog is never submitted. It used to be: the
// next completion pumped the backlog and submitted it into `out`, which the caller had by
// then handed to another fetch (a reused slice of a staging ring); the stray row landed
// there, and that fetch put it into the hot-row cache under its own row id, to be served for
// that row ever after.
TEST(RowFetcherLifetime, AFailedFetchSubmitsNothingAfterItsWait) {
  auto transport = std::make_shared<HandDrivenTransport>();
  auto map = ShardMap::Create({ShardSpec{0, HandDrivenTransport::kRows, "127.0.0.1", 1, "hand"}});
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::vector<ShardConnection> conns = {{transport, RegionCredentials{"hand", "t", {}}}};
  RowFetcherOptions o;
  o.wait_spin_us = 0;
  o.fetch_timeout_ms = 50;
  auto fetcher = RowFetcher::Create(std::move(*map), std::move(conns), o);
  ASSERT_TRUE(fetcher.ok()) << fetcher.status().ToString();
  constexpr uint32_t kStride = HandDrivenTransport::kStride;
  std::vector<uint8_t> slice(kStride), other(kStride);
  ASSERT_TRUE((*fetcher)->RegisterBuffer(slice.data(), slice.size()).ok());
  ASSERT_TRUE((*fetcher)->RegisterBuffer(other.data(), other.size()).ok());
  const uint64_t row_a = 5, row_b = 7;
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    transport->reject_all = true;
  }
  auto a = (*fetcher)->Start({&row_a, 1}, slice.data());
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE((*fetcher)->Wait(*a).IsIOError());  // timed out, its batch never taken
  // The handle is still held (as RemoteEngramRowSource holds its fetches until it returns);
  // the slice goes to another fetch.
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    transport->reject_all = false;
  }
  auto b = (*fetcher)->Start({&row_b, 1}, slice.data());
  ASSERT_TRUE(b.ok());
  ReadCallback done_b;
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    ASSERT_EQ(transport->callbacks.size(), 1u);
    done_b = transport->callbacks[0];
  }
  transport->Land(0);
  done_b(Status::Ok());  // pumps the backlog
  size_t submitted = 0;
  {
    std::lock_guard<std::mutex> lock(transport->mu);
    submitted = transport->callbacks.size();
  }
  EXPECT_EQ(submitted, 1u) << "the abandoned fetch's batch was submitted after its Wait()";
  // What the stray read does next: it lands in the slice, then b completes.
  for (size_t i = 1; i < submitted; ++i) {
    ReadCallback done;
    {
      std::lock_guard<std::mutex> lock(transport->mu);
      done = transport->callbacks[i];
    }
    transport->Land(i);
    done(Status::Ok());
  }
  ASSERT_TRUE((*fetcher)->Wait(*b).ok());
  EXPECT_EQ(slice, std::vector<uint8_t>(kStride, row_b + 1)) << "row 7's slice holds row 5";
  // Row 7 again: a hot-cache hit, with row 7's bytes.
  auto c = (*fetcher)->Start({&row_b, 1}, other.data());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*fetcher)->Wait(*c).ok());
  EXPECT_EQ((*fetcher)->stats().hot_cache_hits, 1u);
  EXPECT_EQ(other, std::vector<uint8_t>(kStride, row_b + 1)) << "the hot cache serves row 5";
}

}  // namespace
}  // namespace kvtier::rdma
