// One memory registration per grant (verbs::GrantRegistrations), against a fake HCA that
// decides one-sided reads the way a real one does: by rkey and protection domain. Shows
// that revoking or expiring a grant cuts every queue pair's access through its rkey, also
// queue pairs of the same tenant that never opened the region with that grant.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "rdma/verbs_plan.h"

namespace kvtier::rdma::verbs {
namespace {

// The part of an HCA that answers an RDMA READ: memory regions by rkey, each in a
// protection domain. A queue pair reads [addr, addr + length) with an rkey iff that rkey's
// MR is live, belongs to the queue pair's PD and covers the range (remote read access).
class FakeHca {
 public:
  uint32_t Register(int pd, uint64_t addr, uint64_t length) {
    const uint32_t rkey = next_rkey_;
    next_rkey_ += 0x101;
    mrs_[rkey] = Mr{pd, addr, length};
    return rkey;
  }
  bool Deregister(uint32_t rkey) { return mrs_.erase(rkey) == 1; }
  int CreateQp(int pd) {
    qps_.push_back(pd);
    return static_cast<int>(qps_.size()) - 1;
  }
  // OK, or the remote access error the requester's completion would report.
  bool Read(int qp, uint64_t addr, uint32_t length, uint32_t rkey) const {
    auto it = mrs_.find(rkey);
    if (it == mrs_.end() || it->second.pd != qps_[qp]) return false;
    const Mr& mr = it->second;
    return addr >= mr.addr && addr - mr.addr <= mr.length && mr.length - (addr - mr.addr) >= length;
  }
  size_t mrs() const { return mrs_.size(); }

 private:
  struct Mr {
    int pd;
    uint64_t addr;
    uint64_t length;
  };
  uint32_t next_rkey_ = 0x1000;
  std::map<uint32_t, Mr> mrs_;
  std::vector<int> qps_;  // index: qp, value: its PD
};

constexpr uint64_t kTableAddr = 0x7f0000000000, kTableBytes = 1 << 20;
constexpr uint32_t kTableId = 3;

wire::GrantToken Token(uint8_t b) {
  wire::GrantToken t{};
  t.fill(b);
  return t;
}

// The row server's VERBS_REGION path (row_server_impl.h, State::RegionFor) over the fake HCA:
// one PD per tenant, a registration per grant made on first use.
class FakeRowServer {
 public:
  FakeRowServer()
      : registrations_(/*registrations_max=*/4, [this](const std::string&, const RemoteRegion& r) {
          EXPECT_TRUE(hca_.Deregister(r.rkey));
        }) {}

  int Pd(const std::string& tenant) {
    auto [it, inserted] = pds_.emplace(tenant, static_cast<int>(pds_.size()) + 1);
    return it->second;
  }
  StatusOr<RemoteRegion> VerbsRegion(const wire::GrantToken& token, const std::string& tenant,
                                     uint64_t expiry_us) {
    if (const GrantRegistrations::Entry* e = registrations_.Find(token)) return e->region;
    RemoteRegion r{kTableAddr, hca_.Register(Pd(tenant), kTableAddr, kTableBytes), kTableBytes};
    if (Status st = registrations_.Add(token, {tenant, kTableId, expiry_us, r}); !st.ok()) {
      hca_.Deregister(r.rkey);
      return st;
    }
    return r;
  }

  FakeHca hca_;
  std::map<std::string, int> pds_;
  GrantRegistrations registrations_;
};

TEST(VerbsGrantRegistrationsTest, RevokingAGrantCutsItsKeyOnEveryQueuePair) {
  FakeRowServer server;
  // Two connections of tenant a (two engines), each with its own grant on the same table,
  // and one of tenant b.
  const int qp1 = server.hca_.CreateQp(server.Pd("a"));
  const int qp2 = server.hca_.CreateQp(server.Pd("a"));
  const int qp_b = server.hca_.CreateQp(server.Pd("b"));
  auto r1 = server.VerbsRegion(Token(1), "a", /*expiry_us=*/1'000'000);
  auto r2 = server.VerbsRegion(Token(2), "a", 1'000'000);
  ASSERT_TRUE(r1.ok() && r2.ok());
  // One registration per grant: the grants do not share a key (a per-tenant registration
  // would hand both the same rkey, and revoking one grant could not cut it).
  ASSERT_NE(r1->rkey, r2->rkey);
  EXPECT_EQ(server.VerbsRegion(Token(1), "a", 1'000'000)->rkey, r1->rkey);  // reused
  EXPECT_EQ(server.registrations_.size(), 2u);

  // qp2 never opened the region with grant 1, but it is in tenant a's PD: with grant 1's
  // address and rkey (learned from a sibling engine, say) it can read. Tenant b cannot.
  EXPECT_TRUE(server.hca_.Read(qp1, r1->addr + 264, 264, r1->rkey));
  EXPECT_TRUE(server.hca_.Read(qp2, r1->addr + 264, 264, r1->rkey));
  EXPECT_FALSE(server.hca_.Read(qp_b, r1->addr + 264, 264, r1->rkey));

  // Grant 1 is revoked: its rkey is dead on every queue pair, not only on the connection
  // that opened the region with it.
  EXPECT_TRUE(server.registrations_.Revoke(Token(1)));
  EXPECT_FALSE(server.hca_.Read(qp1, r1->addr + 264, 264, r1->rkey));
  EXPECT_FALSE(server.hca_.Read(qp2, r1->addr + 264, 264, r1->rkey));
  // Grant 2 is untouched.
  EXPECT_TRUE(server.hca_.Read(qp2, r2->addr + 264, 264, r2->rkey));
  EXPECT_FALSE(server.registrations_.Revoke(Token(1)));  // once
  EXPECT_EQ(server.hca_.mrs(), 1u);
}

TEST(VerbsGrantRegistrationsTest, ExpiredGrantsLoseTheirKeysAtTheSweep) {
  FakeRowServer server;
  const int qp = server.hca_.CreateQp(server.Pd("a"));
  auto early = server.VerbsRegion(Token(1), "a", /*expiry_us=*/1000);
  auto late = server.VerbsRegion(Token(2), "a", 5000);
  ASSERT_TRUE(early.ok() && late.ok());
  EXPECT_EQ(server.registrations_.ExpireUntil(999), 0u);  // valid while now < expiry
  EXPECT_TRUE(server.hca_.Read(qp, early->addr, 264, early->rkey));
  EXPECT_EQ(server.registrations_.ExpireUntil(1000), 1u);
  EXPECT_FALSE(server.hca_.Read(qp, early->addr, 264, early->rkey));
  EXPECT_TRUE(server.hca_.Read(qp, late->addr, 264, late->rkey));
  EXPECT_EQ(server.registrations_.Find(Token(1)), nullptr);
  ASSERT_NE(server.registrations_.Find(Token(2)), nullptr);
  EXPECT_EQ(server.registrations_.ExpireUntil(1u << 30), 1u);
  EXPECT_EQ(server.hca_.mrs(), 0u);
  EXPECT_EQ(server.registrations_.size(), 0u);
}

TEST(VerbsGrantRegistrationsTest, BoundedAndOnePerGrant) {
  FakeRowServer server;  // registrations_max = 4
  for (uint8_t g = 1; g <= 4; ++g) ASSERT_TRUE(server.VerbsRegion(Token(g), "a", 1000).ok());
  // Over the bound: refused, and the MR made for it is dropped again.
  EXPECT_TRUE(server.VerbsRegion(Token(5), "a", 1000).status().IsRejected());
  EXPECT_EQ(server.hca_.mrs(), 4u);
  EXPECT_TRUE(server.registrations_.Add(Token(1), {"a", kTableId, 1000, RemoteRegion{1, 2, 3}})
                  .IsInvalidArgument());
  ASSERT_TRUE(server.registrations_.Revoke(Token(2)));
  EXPECT_TRUE(server.VerbsRegion(Token(5), "a", 1000).ok());
}

}  // namespace
}  // namespace kvtier::rdma::verbs
