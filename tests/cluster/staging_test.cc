// The cluster's bulk data path without etcd: the staging ring (records, wrap, reuse
// detection, bounds), the staging server's grants (identity, membership, expiry, nothing but
// the ring readable) over rdma::TcpTransport, and StagedFetcher against a PeerServer on
// loopback (exact bytes, absent units, a reused slot falls back to GET).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "cluster/peer_client.h"
#include "cluster/peer_server.h"
#include "cluster/staged_fetch.h"
#include "cluster/staging_ring.h"
#include "cluster/staging_server.h"
#include "common/clock.h"
#include "rdma/tcp_transport.h"

namespace kvtier::cluster {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::span<const uint8_t> RecordAt(const StagingRing& ring, const StagedUnit& u) {
  return ring.memory().subspan(u.offset_bytes, u.length_bytes);
}

TEST(StagingRing, StagedRecordVerifiesToTheExactValue) {
  auto ring = StagingRing::Create(64 << 10);
  ASSERT_TRUE(ring.ok()) << ring.status().message();
  const std::vector<uint8_t> value = Bytes(5000, 1);
  auto u = (*ring)->Stage(value);
  ASSERT_TRUE(u.ok()) << u.status().message();
  EXPECT_EQ(u->length_bytes, kStagedRecordHeaderBytes + value.size());
  auto got = StagingRing::Verify(RecordAt(**ring, *u), *u);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_TRUE(std::equal(got->begin(), got->end(), value.begin(), value.end()));
}

TEST(StagingRing, AnOverwrittenRecordIsRejected) {
  auto ring = StagingRing::Create(64 << 10);
  ASSERT_TRUE(ring.ok());
  const std::vector<uint8_t> first = Bytes(20000, 2);
  auto a = (*ring)->Stage(first);
  ASSERT_TRUE(a.ok());
  // Keep a copy of a's record as a reader holding (offset, generation) would expect it, then
  // stage until the ring comes round over offset 0.
  std::vector<StagedUnit> later;
  while ((*ring)->counters().wraps == 0) later.push_back(*(*ring)->Stage(Bytes(20000, 3)));
  EXPECT_EQ(later.back().offset_bytes, 0u);
  auto stale = StagingRing::Verify(RecordAt(**ring, *a), *a);
  EXPECT_TRUE(stale.status().IsRetry()) << stale.status().message();
  auto fresh = StagingRing::Verify(RecordAt(**ring, later.back()), later.back());
  EXPECT_TRUE(fresh.ok()) << fresh.status().message();
}

TEST(StagingRing, ATornOrForeignRecordIsRejected) {
  auto ring = StagingRing::Create(64 << 10);
  ASSERT_TRUE(ring.ok());
  const std::vector<uint8_t> value = Bytes(3000, 4);
  auto u = *(*ring)->Stage(value);
  std::vector<uint8_t> record(RecordAt(**ring, u).begin(), RecordAt(**ring, u).end());
  ASSERT_TRUE(StagingRing::Verify(record, u).ok());
  // One value byte of a newer write (a read torn across an overwrite): the checksum.
  std::vector<uint8_t> torn = record;
  torn[kStagedRecordHeaderBytes + 1234] ^= 0x40;
  EXPECT_TRUE(StagingRing::Verify(torn, u).status().IsRetry());
  // Another generation in the header (the slot was reused), the value unchanged.
  std::vector<uint8_t> reused = record;
  reused[0] ^= 1;
  EXPECT_TRUE(StagingRing::Verify(reused, u).status().IsRetry());
  // A length field that disagrees with the reply.
  std::vector<uint8_t> longer = record;
  longer[16] ^= 1;
  EXPECT_TRUE(StagingRing::Verify(longer, u).status().IsRetry());
  // A read of another length than the reply named.
  EXPECT_TRUE(StagingRing::Verify(std::span<const uint8_t>(record).first(record.size() - 1), u)
                  .status()
                  .IsInvalidArgument());
  // TEST_Clobber (the e2e reuse hook) is such a reuse.
  (*ring)->TEST_Clobber(u.offset_bytes);
  EXPECT_TRUE(StagingRing::Verify(RecordAt(**ring, u), u).status().IsRetry());
}

TEST(StagingRing, SizesAndRecordsStayInBounds) {
  EXPECT_TRUE(StagingRing::Create(0).status().IsInvalidArgument());
  EXPECT_TRUE(StagingRing::Create((64 << 10) - 4096).status().IsInvalidArgument());
  EXPECT_TRUE(StagingRing::Create((64 << 10) + 1).status().IsInvalidArgument());
  EXPECT_TRUE(StagingRing::Create(kStagingRingBytesMax + 4096).status().IsInvalidArgument());
  auto ring = StagingRing::Create(64 << 10);
  ASSERT_TRUE(ring.ok());
  // A record one byte over the ring is refused; one that fills it exactly is staged.
  EXPECT_TRUE(
      (*ring)->Stage(Bytes((64 << 10) - kStagedRecordHeaderBytes + 1, 5)).status().IsRejected());
  EXPECT_EQ((*ring)->counters().too_large, 1u);
  auto full = (*ring)->Stage(Bytes((64 << 10) - kStagedRecordHeaderBytes, 6));
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->offset_bytes, 0u);
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const size_t n = rng() % 9000;
    auto u = (*ring)->Stage(Bytes(n, static_cast<uint32_t>(i)));
    ASSERT_TRUE(u.ok());
    ASSERT_EQ(u->offset_bytes % kStagingAlignBytes, 0u);
    ASSERT_LE(u->offset_bytes + u->length_bytes, uint64_t{64 << 10});
    ASSERT_TRUE(StagingRing::Verify(RecordAt(**ring, *u), *u).ok());
  }
}

// The staging server's region read with rdma::TcpTransport, as a peer reads it.
class StagingServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = StagingServer::Start(
        StagingServerOptions{.ring_bytes = 64 << 10, .grant_ttl_ms = 10000, .clock = &clock_});
    ASSERT_TRUE(s.ok()) << s.status().message();
    server_ = std::move(*s);
    server_->SetMembers({"a", "b"});
    values_[K(1)] = Bytes(7000, 11);
  }
  static PeerKey K(uint8_t b) {
    PeerKey k{};
    k.fill(b);
    return k;
  }
  StatusOr<StagedReply> Stage(const std::string& reader, std::vector<PeerKey> keys) {
    return server_->Stage(reader, keys,
                          [this](const PeerKey& k, std::vector<uint8_t>* v, uint64_t*) {
                            auto it = values_.find(k);
                            if (it == values_.end()) return Status::NotFound("absent");
                            *v = it->second;
                            return Status::Ok();
                          });
  }
  std::unique_ptr<rdma::TcpTransport> Transport(uint16_t port) {
    auto t = rdma::TcpTransport::Create(
        rdma::TcpEndpoint{"127.0.0.1", port},
        rdma::TransportOptions{.batch_ops_max = 16, .read_bytes_max = 1 << 20});
    EXPECT_TRUE(t.ok());
    return std::move(*t);
  }
  // Opens the region as `identity` with `token` and reads `unit`'s record.
  StatusOr<std::vector<uint8_t>> Read(const std::string& identity, const StagedReply& reply,
                                      const StagedUnit& unit) {
    auto t = Transport(reply.region_port);
    KVTIER_ASSIGN_OR_RETURN(rdma::RegionInfo info,
                            t->OpenRegion({reply.region_name, identity, reply.token}));
    std::vector<uint8_t> buf(unit.length_bytes);
    KVTIER_ASSIGN_OR_RETURN(rdma::LocalBufferId id, t->RegisterLocalBuffer(buf.data(), buf.size()));
    rdma::ReadOp op{info.id, unit.offset_bytes, unit.length_bytes, buf.data()};
    Status s = rdma::ReadSync(*t, std::span<const rdma::ReadOp>(&op, 1));
    (void)t->UnregisterLocalBuffer(id);
    if (!s.ok()) return s;
    return buf;
  }
  ManualClock clock_{1'000'000};
  std::unique_ptr<StagingServer> server_;
  std::map<PeerKey, std::vector<uint8_t>> values_;
};

TEST_F(StagingServerTest, AMemberReadsTheStagedBytesWithItsNodeGrant) {
  auto reply = Stage("b", {K(1), K(2)});
  ASSERT_TRUE(reply.ok()) << reply.status().message();
  ASSERT_EQ(reply->units.size(), 2u);
  EXPECT_EQ(reply->units[1].code, StatusCode::kNotFound);
  auto record = Read(std::string(kStagingIdentityPrefix) + "b", *reply, reply->units[0]);
  ASSERT_TRUE(record.ok()) << record.status().message();
  auto value = StagingRing::Verify(*record, reply->units[0]);
  ASSERT_TRUE(value.ok());
  EXPECT_TRUE(std::equal(value->begin(), value->end(), values_[K(1)].begin(), values_[K(1)].end()));
  // The same grant is answered again while more than half its life is left.
  auto again = Stage("b", {K(1)});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->token, reply->token);
  EXPECT_EQ(server_->stats().grants_issued, 1u);
}

TEST_F(StagingServerTest, TheGrantIsTheNodesNotAnotherIdentitys) {
  auto reply = Stage("b", {K(1)});
  ASSERT_TRUE(reply.ok());
  for (const std::string& identity :
       {std::string("b"), std::string(kStagingIdentityPrefix) + "a", std::string("alice")}) {
    auto record = Read(identity, *reply, reply->units[0]);
    EXPECT_TRUE(record.status().IsPermissionDenied()) << identity;
  }
  // A node outside the membership gets no records and no grant.
  auto stranger = Stage("z", {K(1)});
  EXPECT_TRUE(stranger.status().IsPermissionDenied());
  EXPECT_EQ(server_->stats().refused, 1u);
}

TEST_F(StagingServerTest, ANodeThatLeftTheMembershipLosesItsGrant) {
  auto reply = Stage("b", {K(1)});
  ASSERT_TRUE(reply.ok());
  const std::string identity = std::string(kStagingIdentityPrefix) + "b";
  ASSERT_TRUE(Read(identity, *reply, reply->units[0]).ok());
  server_->SetMembers({"a"});
  EXPECT_TRUE(Read(identity, *reply, reply->units[0]).status().IsPermissionDenied());
  EXPECT_EQ(server_->stats().grants_revoked, 1u);
  EXPECT_TRUE(Stage("b", {K(1)}).status().IsPermissionDenied());
}

TEST_F(StagingServerTest, GrantsExpireAndAreRenewedBeforeThat) {
  auto reply = Stage("b", {K(1)});
  ASSERT_TRUE(reply.ok());
  const std::string identity = std::string(kStagingIdentityPrefix) + "b";
  clock_.AdvanceMs(6000);  // past half the TTL: a new grant; the old one still valid
  auto renewed = Stage("b", {K(1)});
  ASSERT_TRUE(renewed.ok());
  EXPECT_NE(renewed->token, reply->token);
  EXPECT_TRUE(Read(identity, *reply, reply->units[0]).ok());
  clock_.AdvanceMs(4001);  // the first grant's 10 s are over
  EXPECT_TRUE(Read(identity, *reply, reply->units[0]).status().IsPermissionDenied());
  EXPECT_TRUE(Read(identity, *renewed, renewed->units[0]).ok());
}

TEST_F(StagingServerTest, LeavingRevokesEveryUnexpiredGrantOfTheNode) {
  auto reply = Stage("b", {K(1)});
  ASSERT_TRUE(reply.ok());
  const std::string identity = std::string(kStagingIdentityPrefix) + "b";
  clock_.AdvanceMs(6000);  // a renewed grant; the first one still valid for 4 s
  auto renewed = Stage("b", {K(1)});
  ASSERT_TRUE(renewed.ok());
  ASSERT_NE(renewed->token, reply->token);
  server_->SetMembers({"a"});
  EXPECT_TRUE(Read(identity, *reply, reply->units[0]).status().IsPermissionDenied());
  EXPECT_TRUE(Read(identity, *renewed, renewed->units[0]).status().IsPermissionDenied());
  EXPECT_EQ(server_->stats().grants_revoked, 2u);
}

TEST_F(StagingServerTest, OnlyTheRingIsReadable) {
  auto reply = Stage("b", {K(1)});
  ASSERT_TRUE(reply.ok());
  auto t = Transport(reply->region_port);
  auto info =
      t->OpenRegion({reply->region_name, std::string(kStagingIdentityPrefix) + "b", reply->token});
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->size_bytes, uint64_t{64 << 10});
  std::vector<uint8_t> buf(128);
  auto id = t->RegisterLocalBuffer(buf.data(), buf.size());
  ASSERT_TRUE(id.ok());
  rdma::ReadOp past{info->id, (64 << 10) - 64, 128, buf.data()};
  EXPECT_FALSE(rdma::ReadSync(*t, std::span<const rdma::ReadOp>(&past, 1)).ok());
  // No other region: the grant names the staging region only.
  EXPECT_TRUE(
      t->OpenRegion({"engram.l1.s0", std::string(kStagingIdentityPrefix) + "b", reply->token})
          .status()
          .IsNotFound());
}

// StagedFetcher against a PeerServer whose handler stages from a map.
class StagingHandler : public PeerHandler {
 public:
  explicit StagingHandler(StagingServer* staging) : staging_(staging) {}
  std::vector<uint8_t> Lookup(std::span<const PeerKey> keys) override {
    return std::vector<uint8_t>(keys.size(), kPeerTierAbsent);
  }
  Status Get(const PeerKey& key, std::vector<uint8_t>* value) override {
    std::lock_guard lock(mu);
    auto it = map.find(key);
    if (it == map.end()) return Status::NotFound("absent");
    *value = it->second;
    return Status::Ok();
  }
  // The unit's TTL from `ttls` (0 when not listed).
  Status GetWithTtl(const PeerKey& key, std::vector<uint8_t>* value,
                    uint64_t* ttl_left_ms) override {
    {
      std::lock_guard lock(mu);
      auto it = ttls.find(key);
      *ttl_left_ms = it == ttls.end() ? 0 : it->second;
    }
    return Get(key, value);
  }
  Status Put(const PeerPut&, bool*) override { return Status::Ok(); }
  StatusOr<std::vector<uint8_t>> Delete(std::span<const PeerKey> keys) override {
    return std::vector<uint8_t>(keys.size(), 0);
  }
  Status DeleteTenant(std::string_view) override { return Status::Ok(); }
  StatusOr<StagedReply> GetStaged(const std::string& reader,
                                  std::span<const PeerKey> keys) override {
    auto reply = staging_->Stage(reader, keys,
                                 [this](const PeerKey& k, std::vector<uint8_t>* v, uint64_t* ttl) {
                                   return GetWithTtl(k, v, ttl);
                                 });
    if (reply.ok() && clobber) {
      // As if other readers' records had come round over these before the read.
      for (const StagedUnit& u : reply->units) {
        if (u.code == StatusCode::kOk) staging_->TEST_ring()->TEST_Clobber(u.offset_bytes);
      }
    }
    return reply;
  }
  std::mutex mu;
  std::map<PeerKey, std::vector<uint8_t>> map;
  std::map<PeerKey, uint64_t> ttls;  // remaining TTL per key (by mu)
  bool clobber = false;

 private:
  StagingServer* staging_;
};

class StagedFetcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto st = StagingServer::Start(StagingServerOptions{.ring_bytes = 1 << 20});
    ASSERT_TRUE(st.ok());
    staging_ = std::move(*st);
    staging_->SetMembers({"reader"});
    handler_ = std::make_unique<StagingHandler>(staging_.get());
    auto s = PeerServer::Start(PeerServerOptions{.credential = std::vector<uint8_t>(32, 7)},
                               handler_.get());
    ASSERT_TRUE(s.ok());
    server_ = std::move(*s);
    endpoint_ = "127.0.0.1:" + std::to_string(server_->port());
    client_ = std::make_unique<PeerClient>(
        PeerClientOptions{.node_id = "reader", .credential = std::vector<uint8_t>(32, 7)});
    fetcher_ =
        std::make_unique<StagedFetcher>(client_.get(), StagedFetcherOptions{.node_id = "reader"});
    for (uint8_t i = 1; i <= 20; ++i) {
      PeerKey k{};
      k.fill(i);
      keys_.push_back(k);
      // Sizes across one transport op (1 MiB) are not needed here; a spread is.
      if (i != 7) handler_->map[k] = Bytes(100 + 3000 * i, i);
    }
  }
  void ExpectExact(const PeerClient::GetResult& r) {
    ASSERT_EQ(r.statuses.size(), keys_.size());
    for (size_t i = 0; i < keys_.size(); ++i) {
      auto it = handler_->map.find(keys_[i]);
      if (it == handler_->map.end()) {
        EXPECT_TRUE(r.statuses[i].IsNotFound()) << i;
        continue;
      }
      ASSERT_TRUE(r.statuses[i].ok()) << i << " " << r.statuses[i].message();
      EXPECT_TRUE(std::ranges::equal(r.values[i], it->second)) << i;
    }
  }
  std::unique_ptr<StagingServer> staging_;
  std::unique_ptr<StagingHandler> handler_;
  std::unique_ptr<PeerServer> server_;
  std::string endpoint_;
  std::unique_ptr<PeerClient> client_;
  std::unique_ptr<StagedFetcher> fetcher_;
  std::vector<PeerKey> keys_;
};

TEST_F(StagedFetcherTest, UnitsArriveOverTheRegionExactly) {
  auto r = fetcher_->Get(endpoint_, keys_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ExpectExact(*r);
  StagedFetchStats s = fetcher_->stats();
  EXPECT_EQ(s.units, 19u);
  EXPECT_EQ(s.fallback_units, 0u);
  EXPECT_GT(staging_->stats().region.bytes_served, 0u);
}

// Each unit's remaining TTL reaches the reader with it, over the region (the GET_STAGED
// reply's TTL trailer) and over the plain GET it falls back to; a unit without one reports 0,
// an absent one nothing.
TEST_F(StagedFetcherTest, UnitsCarryTheirRemainingTtl) {
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (i % 2 == 0) handler_->ttls[keys_[i]] = 1000 + i;
  }
  for (bool clobber : {false, true}) {
    SCOPED_TRACE(clobber ? "fallen back to GET" : "over the region");
    handler_->clobber = clobber;
    auto r = fetcher_->Get(endpoint_, keys_);
    ASSERT_TRUE(r.ok()) << r.status().message();
    ExpectExact(*r);
    ASSERT_EQ(r->ttl_left_ms.size(), keys_.size());
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (!handler_->map.contains(keys_[i])) {
        EXPECT_FALSE(r->ttl_left_ms[i].has_value()) << i;
        continue;
      }
      ASSERT_TRUE(r->ttl_left_ms[i].has_value()) << i;
      EXPECT_EQ(*r->ttl_left_ms[i], i % 2 == 0 ? 1000 + i : 0) << i;
    }
  }
  EXPECT_GT(fetcher_->stats().units, 0u);
  EXPECT_GT(fetcher_->stats().fallback_units, 0u);
}

TEST_F(StagedFetcherTest, AReusedSlotFallsBackToGetAndStaysExact) {
  handler_->clobber = true;
  auto r = fetcher_->Get(endpoint_, keys_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ExpectExact(*r);
  StagedFetchStats s = fetcher_->stats();
  EXPECT_EQ(s.units, 0u);
  EXPECT_EQ(s.reused, 19u);
  EXPECT_EQ(s.fallback_units, 19u);
}

TEST_F(StagedFetcherTest, AReaderOutsideTheMembershipFallsBackToGet) {
  staging_->SetMembers({"someone-else"});
  auto r = fetcher_->Get(endpoint_, keys_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ExpectExact(*r);
  EXPECT_EQ(fetcher_->stats().refused, 1u);
  EXPECT_EQ(fetcher_->stats().units, 0u);
}

TEST_F(StagedFetcherTest, ConcurrentFetchesOverATinyRingNeverReturnAWrongValue) {
  // A 64 KiB ring and four readers of ~30 KiB units: records are overwritten between the
  // reply and the read all the time; every value must still be exact.
  auto st = StagingServer::Start(StagingServerOptions{.ring_bytes = 64 << 10});
  ASSERT_TRUE(st.ok());
  server_->Stop();
  staging_ = std::move(*st);
  staging_->SetMembers({"reader"});
  handler_ = std::make_unique<StagingHandler>(staging_.get());
  for (uint8_t i = 1; i <= 20; ++i) {
    if (i != 7) handler_->map[keys_[i - 1]] = Bytes(20000 + 500 * i, i);
  }
  auto s = PeerServer::Start(PeerServerOptions{.credential = std::vector<uint8_t>(32, 7)},
                             handler_.get());
  ASSERT_TRUE(s.ok());
  server_ = std::move(*s);
  endpoint_ = "127.0.0.1:" + std::to_string(server_->port());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 10; ++round) {
        std::vector<PeerKey> some(keys_.begin() + (t + round) % 4,
                                  keys_.begin() + (t + round) % 4 + 3);
        auto r = fetcher_->Get(endpoint_, some);
        ASSERT_TRUE(r.ok());
        for (size_t j = 0; j < some.size(); ++j) {
          auto it = handler_->map.find(some[j]);
          ASSERT_TRUE(r->statuses[j].ok());
          ASSERT_TRUE(std::ranges::equal(r->values[j], it->second));
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  StagedFetchStats f = fetcher_->stats();
  EXPECT_EQ(f.units + f.fallback_units, 4u * 10 * 3);
}

}  // namespace
}  // namespace kvtier::cluster
