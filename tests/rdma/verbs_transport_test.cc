// VerbsTransport against a RowServer on 127.0.0.1 over a real RDMA device (a loopback RC
// connection through the HCA, or rdma_rxe soft-RoCE). Every test skips itself with a clear
// reason where ibv_get_device_list is empty; it has never run on this project's build
// machine, which has no device.
#include "rdma/verbs_transport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/clock.h"
#include "rdma/transport_factory.h"
#include "rdma/verbs_device.h"
#include "tests/rdma/test_util.h"

namespace kvtier::rdma {
namespace {

using testing::MakeTable;
using testing::TempDir;

constexpr uint64_t kRows = 5000;
constexpr uint32_t kRowDim = 256;
constexpr uint32_t kStride = EngramRowBytes(kRowDim);

class VerbsTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (verbs::ListDevices().empty()) {
      GTEST_SKIP() << "no RDMA device (ibv_get_device_list is empty): the VerbsTransport "
                      "hardware test is skipped (it needs an HCA or rdma_rxe)";
    }
    path_ = MakeTable(dir_, "l1.engram", 0, kRows, kRowDim);
    auto table = MappedTable::Open(path_);
    ASSERT_TRUE(table.ok());
    local_ = *table;
    RowServerOptions o;
    o.clock = &clock_;
    o.verbs_grant_check_ms = 20;
    server_ = std::make_unique<RowServer>(o);
    ASSERT_TRUE(server_->RegisterTable("engram.l1", path_).ok());
    ASSERT_TRUE(server_->Start().ok());
    auto token = server_->IssueGrant("engram.l1", "tenant-a", 60000);
    ASSERT_TRUE(token.ok());
    creds_ = RegionCredentials{"engram.l1", "tenant-a", *token};
  }

  std::unique_ptr<VerbsTransport> Make() {
    auto t = VerbsTransport::Create(TcpEndpoint{"127.0.0.1", server_->port()},
                                    testing::FastOptions(), verbs::VerbsOptions{});
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  }

  // Reads `rows` into a fresh buffer and compares with the local file.
  Status ReadRows(Transport& t, RegionId region, const std::vector<uint64_t>& rows, bool* equal) {
    std::vector<uint8_t> buf(rows.size() * kStride, 0xee);
    auto id = t.RegisterLocalBuffer(buf.data(), buf.size());
    if (!id.ok()) return id.status();
    std::vector<ReadOp> ops;
    for (size_t i = 0; i < rows.size(); ++i) {
      ops.push_back(ReadOp{region, rows[i] * kStride, kStride, buf.data() + i * kStride});
    }
    Status st = ReadSync(t, ops);
    *equal = true;
    for (size_t i = 0; st.ok() && i < rows.size(); ++i) {
      *equal = *equal && std::memcmp(buf.data() + i * kStride,
                                     local_->rows().data() + rows[i] * kStride, kStride) == 0;
    }
    EXPECT_TRUE(t.UnregisterLocalBuffer(*id).ok());
    return st;
  }

  TempDir dir_;
  std::string path_;
  std::shared_ptr<const MappedTable> local_;
  ManualClock clock_{1'000'000};
  std::unique_ptr<RowServer> server_;
  RegionCredentials creds_;
};

TEST_F(VerbsTransportTest, RowsReadOverRdmaEqualTheTableBitForBit) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_EQ(region->size_bytes, kRows * kStride);
  EXPECT_EQ(t->qp_state(), verbs::QpState::kReadyToSend);
  std::vector<uint64_t> rows = {0, kRows - 1, 17, 17, 18, 19, 4095, 2500};
  for (uint64_t r = 1; r < kRows; r += 7) rows.push_back(r);  // > one chain of WRs
  bool equal = false;
  Status st = ReadRows(*t, region->id, rows, &equal);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(equal);
  const TransportCounters c = t->counters();
  EXPECT_EQ(c.ops_submitted, rows.size());
  EXPECT_EQ(c.bytes_read, rows.size() * kStride);
  EXPECT_EQ(c.reads_in_flight, 0u);
  EXPECT_EQ(server_->counters().verbs_qps_created, 1u);
  EXPECT_EQ(server_->counters().ops_served, 0u);  // one-sided: the server CPU served nothing
  EXPECT_STREQ(t->name(), "verbs");
}

TEST_F(VerbsTransportTest, FactoryPicksVerbsWhenTheServerServesRdma) {
  auto t = MakeTransport(TcpEndpoint{"127.0.0.1", server_->port()}, testing::FastOptions(),
                         TransportKind::kAuto);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_STREQ((*t)->name(), "verbs");
}

TEST_F(VerbsTransportTest, RevokedGrantCutsOneSidedAccess) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  bool equal = false;
  ASSERT_TRUE(ReadRows(*t, region->id, {1, 2, 3}, &equal).ok());
  ASSERT_TRUE(server_->RevokeGrant(creds_.token).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (server_->counters().verbs_qps_cut == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(server_->counters().verbs_qps_cut, 1u);
  // Reads fail from now on (IOError while the client notices the cut QP), and once it
  // has reconnected, with PermissionDenied: the re-open is refused.
  Status st;
  for (int i = 0; i < 100; ++i) {
    st = ReadRows(*t, region->id, {4}, &equal);
    ASSERT_FALSE(st.ok()) << "a read succeeded after the grant was revoked";
    if (st.IsPermissionDenied()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(st.IsPermissionDenied()) << st.ToString();
}

TEST_F(VerbsTransportTest, ExpiredGrantCutsOneSidedAccess) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  clock_.AdvanceUs(61ull * 1000 * 1000);  // past the 60 s grant
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (server_->counters().verbs_qps_cut == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(server_->counters().verbs_qps_cut, 1u);
}

TEST_F(VerbsTransportTest, ForcedQpErrorFailsInFlightReadsAndReconnects) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  std::vector<uint8_t> buf(64 * kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  ASSERT_TRUE(t->TEST_ForceQpError().ok());
  // WRs posted to a QP in the error state are flushed: the batch fails with IOError naming
  // the work-completion status.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Status> results;
  for (int b = 0; b < 4; ++b) {
    std::vector<ReadOp> ops;
    for (int i = 0; i < 16; ++i) {
      ops.push_back(ReadOp{region->id, uint64_t(b * 16 + i) * kStride, kStride,
                           buf.data() + (b * 16 + i) * kStride});
    }
    Status st = t->Submit(ops, [&](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      results.push_back(s);
      cv.notify_all();
    });
    if (!st.ok()) {  // the teardown already happened: no callback for this batch
      EXPECT_TRUE(st.IsIOError() || st.IsRejected()) << st.ToString();
      std::lock_guard<std::mutex> lock(mu);
      results.push_back(Status::IOError("RDMA READ failed: rejected up front"));
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return results.size() == 4; }));
  }
  ASSERT_EQ(results.size(), 4u);  // exactly once each
  for (const Status& s : results) {
    EXPECT_TRUE(s.IsIOError()) << s.ToString();
    EXPECT_NE(s.message().find("RDMA READ failed"), std::string::npos) << s.ToString();
  }
  // The next read reconnects (a new QP; the RegionId is unchanged) and is exact.
  bool equal = false;
  Status st = ReadRows(*t, region->id, {10, 20, 30}, &equal);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(equal);
  EXPECT_EQ(t->counters().connects, 2u);
  EXPECT_GE(t->counters().disconnects, 1u);
  EXPECT_EQ(server_->counters().verbs_qps_created, 2u);
}

TEST_F(VerbsTransportTest, CloseFailsInFlightWithUnavailableExactlyOnce) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  auto region = t->OpenRegion(creds_);
  ASSERT_TRUE(region.ok());
  std::vector<uint8_t> buf(256 * kStride);
  ASSERT_TRUE(t->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::atomic<int> calls{0}, bad{0};
  std::vector<ReadOp> ops;
  for (int i = 0; i < 256; ++i) {
    ops.push_back(
        ReadOp{region->id, uint64_t(i) * 13 * kStride, kStride, buf.data() + i * kStride});
  }
  ASSERT_TRUE(t->Submit(ops, [&](const Status& s) {
                 ++calls;
                 if (!s.ok() && !s.IsUnavailable()) ++bad;
               }).ok());
  t->Close();
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(bad.load(), 0);
  EXPECT_TRUE(t->Submit(ops, [](const Status&) {}).IsUnavailable());
}

TEST_F(VerbsTransportTest, OneTenantPerTransport) {
  auto t = Make();
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->OpenRegion(creds_).ok());
  auto other = server_->IssueGrant("engram.l1", "tenant-b", 60000);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(t->OpenRegion(RegionCredentials{"engram.l1", "tenant-b", *other})
                  .status()
                  .IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::rdma
