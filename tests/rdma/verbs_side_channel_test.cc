// The row server's side of the verbs side channel and the transport factory, without RDMA
// hardware: a server without a device answers kVerbsConnect / kVerbsRegion with
// Unavailable and keeps the connection; the factory falls back to TCP under kAuto and
// returns Unavailable under kVerbs.
#include <gtest/gtest.h>

#include <array>
#include <boost/asio.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "rdma/transport_factory.h"
#include "rdma/verbs_plan.h"
#include "tests/rdma/test_util.h"
#ifdef KVTIER_WITH_RDMA
#include "rdma/verbs_device.h"
#endif

namespace kvtier::rdma {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using testing::MakeTable;
using testing::TempDir;

constexpr uint64_t kRows = 1000;
constexpr uint32_t kRowDim = 256;
constexpr uint32_t kStride = EngramRowBytes(kRowDim);

bool DevicePresent() {
#ifdef KVTIER_WITH_RDMA
  return !verbs::ListDevices().empty();
#else
  return false;
#endif
}

// A blocking client speaking raw frames.
struct RawClient {
  explicit RawClient(uint16_t port) : socket(io) {
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  }
  struct Reply {
    wire::ResponseHeader header;
    std::string message;
    std::vector<uint8_t> data;
  };
  // Sends `frame` and reads one reply; false when the server closed the connection.
  bool Exchange(const std::vector<uint8_t>& frame, Reply* out) {
    boost::system::error_code ec;
    asio::write(socket, asio::buffer(frame), ec);
    if (ec) return false;
    std::array<uint8_t, wire::kHeaderBytes> h{};
    asio::read(socket, asio::buffer(h), ec);
    if (ec) return false;
    if (!wire::DecodeResponseHeader(h.data(), &out->header).ok()) return false;
    out->message.resize(out->header.message_bytes);
    out->data.resize(out->header.data_bytes);
    asio::read(socket, asio::buffer(out->message), ec);
    if (!ec && !out->data.empty()) asio::read(socket, asio::buffer(out->data), ec);
    return !ec;
  }
  asio::io_context io;
  tcp::socket socket;
};

class VerbsSideChannelTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = MakeTable(dir_, "t.engram", 0, kRows, kRowDim); }

  void Start(bool verbs_enabled) {
    RowServerOptions o;
    o.verbs_enabled = verbs_enabled;
    server_ = std::make_unique<RowServer>(o);
    ASSERT_TRUE(server_->RegisterTable("engram.t", path_).ok());
    auto token = server_->IssueGrant("engram.t", "tenant-a", 60000);
    ASSERT_TRUE(token.ok());
    creds_ = RegionCredentials{"engram.t", "tenant-a", *token};
    ASSERT_TRUE(server_->Start().ok());
  }

  std::vector<uint8_t> ConnectFrame(uint64_t id) {
    verbs::QpParams p;
    p.qpn = 0x42;
    p.psn = 0x1234;
    std::array<uint8_t, verbs::kQpParamsBytes> encoded{};
    verbs::EncodeQpParams(p, encoded.data());
    return wire::BuildVerbsConnectRequest(id, encoded);
  }

  // Checks the Unavailable replies and that the same connection still serves OPEN and READ.
  void ExpectUnavailableAndConnectionKept() {
    RawClient c(server_->port());
    RawClient::Reply r;
    ASSERT_TRUE(c.Exchange(ConnectFrame(1), &r));
    EXPECT_EQ(r.header.type, wire::FrameType::kVerbsConnect);
    EXPECT_EQ(r.header.request_id, 1u);
    EXPECT_EQ(r.header.code, StatusCode::kUnavailable);
    EXPECT_EQ(r.message, "row server has no RDMA device");
    EXPECT_TRUE(r.data.empty());
    // kOpen on the same connection works, then kVerbsRegion is Unavailable too.
    ASSERT_TRUE(
        c.Exchange(wire::BuildOpenRequest(
                       2, wire::OpenRequest{creds_.token, creds_.region_name, creds_.tenant}),
                   &r));
    ASSERT_EQ(r.header.code, StatusCode::kOk) << r.message;
    wire::OpenReply open;
    ASSERT_TRUE(wire::DecodeOpenReply(r.data, &open).ok());
    ASSERT_TRUE(c.Exchange(wire::BuildVerbsRegionRequest(3, open.region_id), &r));
    EXPECT_EQ(r.header.type, wire::FrameType::kVerbsRegion);
    EXPECT_EQ(r.header.code, StatusCode::kUnavailable);
    std::vector<wire::ReadOpWire> ops = {{open.region_id, kStride, 5 * kStride}};
    ASSERT_TRUE(c.Exchange(wire::BuildReadRequest(4, ops), &r));
    ASSERT_EQ(r.header.code, StatusCode::kOk) << r.message;
    std::vector<uint8_t> expected(kStride);
    FillSyntheticEngramRow(testing::kSeed, 5, kRowDim, expected.data());
    EXPECT_EQ(r.data, expected);
    EXPECT_EQ(server_->counters().verbs_unavailable, 2u);
    EXPECT_EQ(server_->counters().malformed_frames, 0u);
    EXPECT_EQ(server_->counters().verbs_qps_created, 0u);
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<RowServer> server_;
  RegionCredentials creds_;
};

TEST_F(VerbsSideChannelTest, DisabledVerbsAnswerUnavailableAndKeepTheConnection) {
  Start(/*verbs_enabled=*/false);
  ExpectUnavailableAndConnectionKept();
}

TEST_F(VerbsSideChannelTest, NoDeviceAnswersUnavailableAndKeepsTheConnection) {
  if (DevicePresent()) GTEST_SKIP() << "an RDMA device is present; this checks the no-device path";
  Start(/*verbs_enabled=*/true);
  ExpectUnavailableAndConnectionKept();
}

TEST_F(VerbsSideChannelTest, MalformedVerbsFramesCloseOnlyThatConnection) {
  Start(/*verbs_enabled=*/false);
  {
    RawClient c(server_->port());
    std::vector<uint8_t> frame = ConnectFrame(1);
    std::memset(frame.data() + wire::kHeaderBytes, 0, 4);  // qpn 0: a hostile body
    RawClient::Reply r;
    EXPECT_FALSE(c.Exchange(frame, &r));  // closed, no reply
  }
  {
    RawClient c(server_->port());
    std::vector<uint8_t> frame = wire::BuildVerbsRegionRequest(1, 1);
    frame[wire::kHeaderBytes + 4] = 1;  // reserved byte set
    RawClient::Reply r;
    EXPECT_FALSE(c.Exchange(frame, &r));
  }
  EXPECT_EQ(server_->counters().malformed_frames, 2u);
  // The server still serves others.
  RawClient c(server_->port());
  RawClient::Reply r;
  ASSERT_TRUE(c.Exchange(ConnectFrame(9), &r));
  EXPECT_EQ(r.header.code, StatusCode::kUnavailable);
}

TEST_F(VerbsSideChannelTest, FactoryFallsBackToTcpUnderAutoAndRefusesVerbs) {
  Start(/*verbs_enabled=*/false);  // the server never serves RDMA: deterministic anywhere
  const TcpEndpoint endpoint{"127.0.0.1", server_->port()};
  auto tcp = MakeTransport(endpoint, testing::FastOptions(), TransportKind::kTcp);
  ASSERT_TRUE(tcp.ok()) << tcp.status().ToString();
  EXPECT_STREQ((*tcp)->name(), "tcp");

  auto verbs = MakeTransport(endpoint, testing::FastOptions(), TransportKind::kVerbs);
  ASSERT_FALSE(verbs.ok());
  EXPECT_TRUE(verbs.status().IsUnavailable()) << verbs.status().ToString();

  auto automatic = MakeTransport(endpoint, testing::FastOptions(), TransportKind::kAuto);
  ASSERT_TRUE(automatic.ok()) << automatic.status().ToString();
  EXPECT_STREQ((*automatic)->name(), "tcp");
  // The fallback transport really reads rows.
  auto region = (*automatic)->OpenRegion(creds_);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::vector<uint8_t> buf(kStride);
  ASSERT_TRUE((*automatic)->RegisterLocalBuffer(buf.data(), buf.size()).ok());
  std::vector<ReadOp> ops = {{region->id, 7 * kStride, kStride, buf.data()}};
  ASSERT_TRUE(ReadSync(**automatic, ops).ok());
  std::vector<uint8_t> expected(kStride);
  FillSyntheticEngramRow(testing::kSeed, 7, kRowDim, expected.data());
  EXPECT_EQ(buf, expected);
}

TEST(TransportFactoryTest, KindNamesRoundTrip) {
  for (TransportKind k : {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kVerbs}) {
    auto parsed = ParseTransportKind(TransportKindName(k));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  EXPECT_TRUE(ParseTransportKind("rdma").status().IsInvalidArgument());
  EXPECT_TRUE(ParseTransportKind("").status().IsInvalidArgument());
#ifdef KVTIER_WITH_RDMA
  EXPECT_TRUE(VerbsBuilt());
#else
  EXPECT_FALSE(VerbsBuilt());
#endif
}

TEST(TransportFactoryTest, VerbsWithoutADeviceIsUnavailableEvenWithoutAServer) {
  if (DevicePresent()) GTEST_SKIP() << "an RDMA device is present";
  // Port 9 on loopback: nothing listens. The device check comes first.
  auto t =
      MakeTransport(TcpEndpoint{"127.0.0.1", 9}, testing::FastOptions(), TransportKind::kVerbs);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(t.status().IsUnavailable()) << t.status().ToString();
}

}  // namespace
}  // namespace kvtier::rdma
