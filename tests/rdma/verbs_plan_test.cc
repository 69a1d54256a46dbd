// The verbs transport's bookkeeping, without hardware.
#include "rdma/verbs_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>

namespace kvtier::rdma::verbs {
namespace {

TEST(VerbsPlanTest, RemoteTableTranslatesWithinBoundsOnly) {
  RemoteRegionTable t;
  ASSERT_TRUE(t.Add(1, RemoteRegion{0x10000, 0xabc, 1000}).ok());
  EXPECT_TRUE(t.Add(1, RemoteRegion{0x20000, 1, 10}).IsInvalidArgument());
  EXPECT_TRUE(t.Add(2, RemoteRegion{0x20000, 1, 0}).IsInvalidArgument());
  uint64_t addr = 0;
  uint32_t rkey = 0;
  ASSERT_TRUE(t.Translate(1, 990, 10, &addr, &rkey).ok());
  EXPECT_EQ(addr, 0x10000u + 990);
  EXPECT_EQ(rkey, 0xabcu);
  EXPECT_TRUE(t.Translate(1, 991, 10, &addr, &rkey).IsInvalidArgument());
  EXPECT_TRUE(t.Translate(1, ~0ull, 1, &addr, &rkey).IsInvalidArgument());
  EXPECT_TRUE(t.Translate(7, 0, 1, &addr, &rkey).IsNotFound());
}

TEST(VerbsPlanTest, LocalKeysByRange) {
  LocalKeyTable t;
  std::vector<uint8_t> a(100), b(100);
  ASSERT_TRUE(t.Add(1, reinterpret_cast<uintptr_t>(a.data()), a.size(), 11).ok());
  ASSERT_TRUE(t.Add(2, reinterpret_cast<uintptr_t>(b.data()), b.size(), 22).ok());
  EXPECT_TRUE(t.Add(3, reinterpret_cast<uintptr_t>(a.data() + 50), 10, 33).IsInvalidArgument());
  EXPECT_EQ(*t.Lookup(a.data() + 90, 10), 11u);
  EXPECT_EQ(*t.Lookup(b.data(), 100), 22u);
  EXPECT_TRUE(t.Lookup(a.data() + 91, 10).status().IsInvalidArgument());
  ASSERT_TRUE(t.Remove(1).ok());
  EXPECT_TRUE(t.Lookup(a.data(), 1).status().IsInvalidArgument());
  EXPECT_TRUE(t.Remove(1).IsNotFound());
}

class ChainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(remote_.Add(0, RemoteRegion{1u << 20, 0x77, 1u << 20}).ok());
    ASSERT_TRUE(local_.Add(1, reinterpret_cast<uintptr_t>(buf_.data()), buf_.size(), 0x55).ok());
  }
  RemoteRegionTable remote_;
  LocalKeyTable local_;
  std::vector<uint8_t> buf_ = std::vector<uint8_t>(1 << 16);
};

TEST_F(ChainTest, SplitsIntoChainsUnderTheWrLimitAndSignalsTheLastWr) {
  std::vector<ReadOp> ops;
  for (uint32_t i = 0; i < 10; ++i) {
    // Scattered remote rows (never adjacent) of 33 bytes into consecutive slots.
    ops.push_back(ReadOp{0, uint64_t{i} * 1000, 33, buf_.data() + i * 33});
  }
  std::vector<std::vector<PlannedRead>> chains;
  ASSERT_TRUE(PlanReadChains(ops, remote_, local_, 4, 4096, 9, &chains).ok());
  ASSERT_EQ(chains.size(), 3u);
  EXPECT_EQ(chains[0].size(), 4u);
  EXPECT_EQ(chains[2].size(), 2u);
  for (size_t c = 0; c < chains.size(); ++c) {
    for (size_t w = 0; w < chains[c].size(); ++w) {
      const PlannedRead& r = chains[c][w];
      EXPECT_EQ(r.signaled, w + 1 == chains[c].size());
      EXPECT_EQ(WrIdBatch(r.wr_id), 9u);
      EXPECT_EQ(r.wr_id & 0xffff, c);
      EXPECT_EQ(r.rkey, 0x77u);
      EXPECT_EQ(r.lkey, 0x55u);
    }
  }
  EXPECT_EQ(chains[1][0].remote_addr, (1u << 20) + 4000u);
  EXPECT_EQ(chains[1][0].local_addr, reinterpret_cast<uintptr_t>(buf_.data() + 4 * 33));
}

TEST_F(ChainTest, MergesAdjacentReadsUpToTheOpLimit) {
  std::vector<ReadOp> ops;
  for (uint32_t i = 0; i < 8; ++i) {
    ops.push_back(ReadOp{0, uint64_t{i} * 264, 264, buf_.data() + i * 264});  // adjacent rows
  }
  ops.push_back(ReadOp{0, 100000, 264, buf_.data() + 8 * 264});  // not adjacent remotely
  std::vector<std::vector<PlannedRead>> chains;
  ASSERT_TRUE(PlanReadChains(ops, remote_, local_, 16, 4 * 264, 1, &chains).ok());
  ASSERT_EQ(chains.size(), 1u);
  ASSERT_EQ(chains[0].size(), 3u);  // 4 + 4 merged rows, then the far one
  EXPECT_EQ(chains[0][0].length_bytes, 4u * 264);
  EXPECT_EQ(chains[0][1].length_bytes, 4u * 264);
  EXPECT_EQ(chains[0][1].remote_addr, (1u << 20) + 4u * 264);
  EXPECT_EQ(chains[0][2].length_bytes, 264u);
}

TEST_F(ChainTest, RejectsBadOps) {
  std::vector<std::vector<PlannedRead>> chains;
  std::vector<uint8_t> other(64);
  ReadOp outside_local{0, 0, 64, other.data()};
  EXPECT_TRUE(PlanReadChains({&outside_local, 1}, remote_, local_, 4, 4096, 1, &chains)
                  .IsInvalidArgument());
  ReadOp outside_remote{0, (1u << 20) - 10, 64, buf_.data()};
  EXPECT_TRUE(PlanReadChains({&outside_remote, 1}, remote_, local_, 4, 4096, 1, &chains)
                  .IsInvalidArgument());
  ReadOp unknown{5, 0, 64, buf_.data()};
  EXPECT_TRUE(PlanReadChains({&unknown, 1}, remote_, local_, 4, 4096, 1, &chains).IsNotFound());
  EXPECT_TRUE(PlanReadChains({}, remote_, local_, 4, 4096, 1, &chains).IsInvalidArgument());
}

TEST(VerbsPlanTest, QpStateMachineFollowsTheVerbsLifecycle) {
  QpStateMachine m;
  EXPECT_FALSE(m.CanPost());
  EXPECT_TRUE(m.Apply(QpEvent::kReady).IsInvalidArgument());  // not from disconnected
  ASSERT_TRUE(m.Apply(QpEvent::kConnect).ok());
  EXPECT_EQ(m.state(), QpState::kExchanging);
  EXPECT_TRUE(m.Apply(QpEvent::kConnect).IsInvalidArgument());
  ASSERT_TRUE(m.Apply(QpEvent::kPeerParams).ok());
  ASSERT_TRUE(m.Apply(QpEvent::kReady).ok());
  EXPECT_TRUE(m.CanPost());
  EXPECT_EQ(m.connects(), 1u);
  // A completion error: no posting until torn down and reconnected.
  ASSERT_TRUE(m.Apply(QpEvent::kFailure).ok());
  EXPECT_FALSE(m.CanPost());
  ASSERT_TRUE(m.Apply(QpEvent::kFailure).ok());  // idempotent
  EXPECT_TRUE(m.Apply(QpEvent::kReady).IsInvalidArgument());
  ASSERT_TRUE(m.Apply(QpEvent::kTornDown).ok());
  EXPECT_EQ(m.state(), QpState::kDisconnected);
  EXPECT_TRUE(m.Apply(QpEvent::kTornDown).IsInvalidArgument());
  ASSERT_TRUE(m.Apply(QpEvent::kConnect).ok());
  ASSERT_TRUE(m.Apply(QpEvent::kPeerParams).ok());
  ASSERT_TRUE(m.Apply(QpEvent::kReady).ok());
  EXPECT_EQ(m.connects(), 2u);
  ASSERT_TRUE(m.Apply(QpEvent::kClose).ok());
  EXPECT_TRUE(m.Apply(QpEvent::kConnect).IsInvalidArgument());  // closed is terminal
}

TEST(VerbsPlanTest, SideChannelCodecs) {
  QpParams p;
  p.qpn = 0x123456;
  p.psn = 0xabcdef;
  p.lid = 0x0102;
  p.port = 1;
  p.gid_index = 3;
  for (int i = 0; i < 16; ++i) p.gid[i] = static_cast<uint8_t>(0xf0 + i);
  uint8_t buf[kQpParamsBytes];
  EncodeQpParams(p, buf);
  QpParams back;
  ASSERT_TRUE(DecodeQpParams(buf, &back).ok());
  EXPECT_EQ(back.qpn, p.qpn);
  EXPECT_EQ(back.psn, p.psn);
  EXPECT_EQ(back.lid, p.lid);
  EXPECT_EQ(back.gid, p.gid);
  buf[3] = 0x01;  // qpn above 24 bits
  EXPECT_TRUE(DecodeQpParams(buf, &back).IsCorruption());
  EXPECT_TRUE(DecodeQpParams(std::span<const uint8_t>(buf, 5), &back).IsCorruption());
  RemoteRegion r{0x7f0000001000, 0x1234, 4096}, r2;
  uint8_t rb[kRemoteRegionBytes];
  EncodeRemoteRegion(r, rb);
  ASSERT_TRUE(DecodeRemoteRegion(rb, &r2).ok());
  EXPECT_EQ(r2.addr, r.addr);
  EXPECT_EQ(r2.rkey, r.rkey);
  EXPECT_EQ(r2.length_bytes, r.length_bytes);
}

TEST(VerbsPlanTest, InflightTrackerBoundsWrsAndFailsEverythingOnError) {
  InflightTracker t(8);
  std::vector<std::string> calls;
  auto cb = [&calls](std::string name) {
    return [&calls, name](const Status& s) {
      calls.push_back(name + ":" + std::string(StatusCodeName(s.code())));
    };
  };
  ASSERT_TRUE(t.Add(1, 2, 5, 5, cb("a")).ok());
  EXPECT_TRUE(t.Add(2, 1, 4, 4, cb("b")).IsRejected());  // 5 + 4 > 8
  ASSERT_TRUE(t.Add(2, 1, 3, 3, cb("b")).ok());
  EXPECT_EQ(t.wrs_in_flight(), 8u);
  // Batch 1 has two chains: the first completion does not finish it.
  EXPECT_EQ(t.OnCompletion(MakeWrId(1, 0), Status::Ok()), nullptr);
  ReadCallback done = t.OnCompletion(MakeWrId(1, 1), Status::Ok());
  ASSERT_NE(done, nullptr);
  done(Status::Ok());
  EXPECT_EQ(t.wrs_in_flight(), 3u);
  EXPECT_EQ(t.OnCompletion(MakeWrId(99, 0), Status::Ok()), nullptr);  // unknown
  ASSERT_TRUE(t.Add(3, 3, 3, 3, cb("c")).ok());
  // Batch 3's first chain fails: it finishes at once; its flushed chains are ignored.
  ReadCallback failed = t.OnCompletion(MakeWrId(3, 0), Status::IOError("wc error"));
  ASSERT_NE(failed, nullptr);
  failed(Status::IOError("x"));
  EXPECT_EQ(t.OnCompletion(MakeWrId(3, 1), Status::IOError("flush")), nullptr);
  // QP teardown: everything left fails.
  for (auto& c : t.TakeAll()) c(Status::IOError("qp error"));
  EXPECT_EQ(t.batches(), 0u);
  EXPECT_EQ(t.wrs_in_flight(), 0u);
  EXPECT_EQ(calls, (std::vector<std::string>{"a:ok", "c:io_error", "b:io_error"}));
}

TEST(VerbsPlanTest, SideChannelDecodersRejectHostileInput) {
  QpParams p;
  p.qpn = 0x10;
  p.psn = 0x20;
  uint8_t buf[kQpParamsBytes];
  EncodeQpParams(p, buf);
  QpParams back;
  ASSERT_TRUE(DecodeQpParams(buf, &back).ok());
  uint8_t zero_qpn[kQpParamsBytes];
  std::memcpy(zero_qpn, buf, sizeof(buf));
  std::memset(zero_qpn, 0, 4);
  EXPECT_TRUE(DecodeQpParams(zero_qpn, &back).IsCorruption());  // qpn 0 is never valid
  uint8_t big_psn[kQpParamsBytes];
  std::memcpy(big_psn, buf, sizeof(buf));
  big_psn[7] = 0x01;  // psn above 24 bits
  EXPECT_TRUE(DecodeQpParams(big_psn, &back).IsCorruption());
  std::vector<uint8_t> longer(buf, buf + kQpParamsBytes);
  longer.push_back(0);
  EXPECT_TRUE(DecodeQpParams(longer, &back).IsCorruption());
  EXPECT_TRUE(DecodeQpParams({}, &back).IsCorruption());
  // The encoder masks the psn to 24 bits.
  p.psn = 0xff123456;
  EncodeQpParams(p, buf);
  ASSERT_TRUE(DecodeQpParams(buf, &back).ok());
  EXPECT_EQ(back.psn, 0x123456u);

  RemoteRegion r{0x1000, 7, 0}, r2;
  uint8_t rb[kRemoteRegionBytes];
  EncodeRemoteRegion(r, rb);
  EXPECT_TRUE(DecodeRemoteRegion(rb, &r2).IsCorruption());  // an empty region
  r.length_bytes = 64;
  EncodeRemoteRegion(r, rb);
  EXPECT_TRUE(DecodeRemoteRegion(std::span<const uint8_t>(rb, 23), &r2).IsCorruption());
  ASSERT_TRUE(DecodeRemoteRegion(rb, &r2).ok());
  EXPECT_EQ(r2.rkey, 7u);
  for (size_t at = 12; at < 16; ++at) {  // the reserved u32 after the rkey
    uint8_t bad[kRemoteRegionBytes];
    std::memcpy(bad, rb, sizeof bad);
    bad[at] = 1;
    RemoteRegion untouched{1, 2, 3};
    EXPECT_TRUE(DecodeRemoteRegion(bad, &untouched).IsCorruption()) << "byte " << at;
    EXPECT_EQ(untouched.addr, 1u);  // nothing written on failure
  }
  // The sizes the wire format fixes are the codecs' sizes.
  static_assert(kQpParamsBytes == wire::kQpParamsBytes);
  static_assert(kRemoteRegionBytes == wire::kRemoteRegionBytes);
}

// What VerbsTransport does on a QP error: the first failed completion ends its batch, the
// teardown takes every other batch, and nothing completes twice (late flushes, a second
// teardown). The WR budget is whole again afterwards.
TEST(VerbsPlanTest, TeardownFailsEveryBatchExactlyOnce) {
  InflightTracker t(64);
  std::map<uint64_t, int> calls;
  std::map<uint64_t, StatusCode> codes;
  auto cb = [&](uint64_t seq) {
    return [&calls, &codes, seq](const Status& s) {
      ++calls[seq];
      codes[seq] = s.code();
    };
  };
  for (uint64_t seq = 1; seq <= 5; ++seq) ASSERT_TRUE(t.Add(seq, 2, 4, 8, cb(seq)).ok());
  EXPECT_EQ(t.ops_in_flight(), 40u);
  // Batch 2 completes fully; batch 4 fails on its second chain.
  ASSERT_EQ(t.OnCompletion(MakeWrId(2, 0), Status::Ok()), nullptr);
  t.OnCompletion(MakeWrId(2, 1), Status::Ok())(Status::Ok());
  ASSERT_EQ(t.OnCompletion(MakeWrId(4, 0), Status::Ok()), nullptr);
  t.OnCompletion(MakeWrId(4, 1),
                 Status::IOError("remote access error"))(Status::IOError("remote access error"));
  auto rest = t.TakeAll();
  EXPECT_EQ(rest.size(), 3u);  // batches 1, 3, 5
  for (auto& c : rest) c(Status::IOError("queue pair torn down"));
  // Late flush completions and a second teardown find nothing.
  for (uint64_t seq = 1; seq <= 5; ++seq) {
    EXPECT_EQ(t.OnCompletion(MakeWrId(seq, 0), Status::IOError("flush")), nullptr);
    EXPECT_EQ(t.OnCompletion(MakeWrId(seq, 1), Status::Ok()), nullptr);
  }
  EXPECT_TRUE(t.TakeAll().empty());
  for (uint64_t seq = 1; seq <= 5; ++seq) EXPECT_EQ(calls[seq], 1) << "batch " << seq;
  EXPECT_EQ(codes[2], StatusCode::kOk);
  EXPECT_EQ(codes[4], StatusCode::kIOError);
  EXPECT_EQ(codes[1], StatusCode::kIOError);
  EXPECT_EQ(t.wrs_in_flight(), 0u);
  EXPECT_EQ(t.ops_in_flight(), 0u);
  EXPECT_TRUE(t.Add(6, 16, 64, 64, cb(6)).ok());  // the full WR budget is usable again
  EXPECT_TRUE(t.Add(7, 1, 1, 1, cb(7)).IsRejected());
}

TEST(VerbsPlanTest, QpStateMachineRejectsPostingOutsideReadyToSend) {
  QpStateMachine m;
  // A teardown is only legal from a failed or half-made connection, never from RTS directly.
  ASSERT_TRUE(m.Apply(QpEvent::kConnect).ok());
  ASSERT_TRUE(m.Apply(QpEvent::kFailure).ok());  // exchange failed
  ASSERT_TRUE(m.Apply(QpEvent::kTornDown).ok());
  ASSERT_TRUE(m.Apply(QpEvent::kConnect).ok());
  ASSERT_TRUE(m.Apply(QpEvent::kPeerParams).ok());
  EXPECT_FALSE(m.CanPost());  // RTR only
  ASSERT_TRUE(m.Apply(QpEvent::kReady).ok());
  EXPECT_TRUE(m.Apply(QpEvent::kTornDown).IsInvalidArgument());
  EXPECT_TRUE(m.Apply(QpEvent::kPeerParams).IsInvalidArgument());
  EXPECT_EQ(m.state(), QpState::kReadyToSend);
  EXPECT_EQ(m.connects(), 1u);
  EXPECT_TRUE(m.Apply(QpEvent::kFailure).ok());
  EXPECT_STREQ(QpStateName(m.state()), "error");
  EXPECT_TRUE(m.Apply(QpEvent::kFailure).ok());
}

}  // namespace
}  // namespace kvtier::rdma::verbs
