// Queue-pair path negotiation without hardware: the version-2 VERBS_CONNECT body, the local
// capabilities taken from (fake) device attributes, and NegotiatePath's agreement.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "rdma/verbs_plan.h"

namespace kvtier::rdma::verbs {
namespace {

DeviceCaps Caps(uint8_t active_mtu, uint32_t rd_atom, uint32_t init_rd_atom,
                uint8_t link_layer = kLinkLayerInfiniBand, uint16_t lid = 7) {
  DeviceCaps c;
  c.active_mtu = active_mtu;
  c.max_qp_rd_atom = rd_atom;
  c.max_qp_init_rd_atom = init_rd_atom;
  c.link_layer = link_layer;
  c.gid_table_len = 16;
  c.lid = lid;
  return c;
}

QpParams Params(const VerbsOptions& o, const DeviceCaps& caps, bool responder, uint32_t qpn) {
  QpParams p;
  Status st = LocalPathCaps(o, caps, responder, &p);
  EXPECT_TRUE(st.ok()) << st.ToString();
  p.qpn = qpn;
  p.psn = qpn * 3;
  for (int i = 0; i < 16; ++i) p.gid[i] = static_cast<uint8_t>(qpn + i);
  return p;
}

TEST(VerbsNegotiationTest, OptionsAreValidatedWithTheirRanges) {
  EXPECT_TRUE(ValidateVerbsOptions(VerbsOptions{}).ok());
  auto with = [](auto change) {
    VerbsOptions o;
    change(o);
    return ValidateVerbsOptions(o);
  };
  EXPECT_TRUE(with([](VerbsOptions& o) { o.rd_atomic_max = 0; }).IsInvalidArgument());
  EXPECT_TRUE(with([](VerbsOptions& o) { o.rd_atomic_max = 256; }).IsInvalidArgument());
  EXPECT_TRUE(with([](VerbsOptions& o) { o.rd_atomic_max = 255; }).ok());
  EXPECT_TRUE(with([](VerbsOptions& o) { o.path_mtu_max_bytes = 1500; }).IsInvalidArgument());
  EXPECT_TRUE(with([](VerbsOptions& o) { o.path_mtu_max_bytes = 8192; }).IsInvalidArgument());
  EXPECT_TRUE(with([](VerbsOptions& o) { o.path_mtu_max_bytes = 256; }).ok());
  EXPECT_TRUE(with([](VerbsOptions& o) { o.port = 0; }).IsInvalidArgument());
  EXPECT_TRUE(
      with([](VerbsOptions& o) { o.cq_depth = o.send_queue_depth - 1; }).IsInvalidArgument());
  EXPECT_EQ(MtuCode(256), 1);
  EXPECT_EQ(MtuCode(4096), 5);
  EXPECT_EQ(MtuCode(3000), 0);
  EXPECT_EQ(MtuBytes(3), 1024u);
  EXPECT_EQ(MtuBytes(6), 0u);
}

TEST(VerbsNegotiationTest, LocalCapsAreTheMinOfOptionsAndDevice) {
  VerbsOptions o;
  o.rd_atomic_max = 16;
  o.path_mtu_max_bytes = 2048;
  QpParams p;
  // The requester's depth is the device's initiator depth; the responder's its target depth.
  ASSERT_TRUE(LocalPathCaps(o, Caps(5, 4, 8), /*responder=*/false, &p).ok());
  EXPECT_EQ(p.version, 2);
  EXPECT_EQ(p.path_mtu, MtuCode(2048));  // the option caps the port's 4096
  EXPECT_EQ(p.rd_atomic, 8);
  EXPECT_EQ(p.lid, 7);
  ASSERT_TRUE(LocalPathCaps(o, Caps(3, 4, 8), /*responder=*/true, &p).ok());
  EXPECT_EQ(p.path_mtu, 3);  // the port's 1024 caps the option
  EXPECT_EQ(p.rd_atomic, 4);
  o.rd_atomic_max = 2;
  ASSERT_TRUE(LocalPathCaps(o, Caps(3, 4, 8), true, &p).ok());
  EXPECT_EQ(p.rd_atomic, 2);
  // A GID index beyond the port's table, a port without MTU, a device without read depth.
  o.gid_index = 16;
  EXPECT_TRUE(LocalPathCaps(o, Caps(3, 4, 8), true, &p).IsInvalidArgument());
  o.gid_index = 15;
  EXPECT_TRUE(LocalPathCaps(o, Caps(3, 4, 8), true, &p).ok());
  EXPECT_TRUE(LocalPathCaps(o, Caps(0, 4, 8), true, &p).IsUnavailable());
  EXPECT_TRUE(LocalPathCaps(o, Caps(3, 0, 8), true, &p).IsUnavailable());
  EXPECT_TRUE(LocalPathCaps(o, Caps(3, 4, 8), false, &p).ok());  // 0 only matters per role
}

TEST(VerbsNegotiationTest, BothEndsAgreeOnTheSmallerMtuAndDepth) {
  VerbsOptions client_opts, server_opts;
  client_opts.rd_atomic_max = 16;
  server_opts.rd_atomic_max = 16;
  // The client's port runs 4096 and can keep 16 reads out; the server's port runs 1024 and
  // accepts 4 reads per QP.
  const QpParams client = Params(client_opts, Caps(5, 16, 16), /*responder=*/false, 0x11);
  const QpParams server = Params(server_opts, Caps(3, 4, 32), /*responder=*/true, 0x22);
  auto at_client = NegotiatePath(client, server);
  auto at_server = NegotiatePath(server, client);
  ASSERT_TRUE(at_client.ok()) << at_client.status().ToString();
  ASSERT_TRUE(at_server.ok()) << at_server.status().ToString();
  EXPECT_EQ(at_client->path_mtu, 3);
  EXPECT_EQ(at_client->rd_atomic, 4);  // never more reads out than the responder accepts
  EXPECT_EQ(at_client->path_mtu, at_server->path_mtu);
  EXPECT_EQ(at_client->rd_atomic, at_server->rd_atomic);
  EXPECT_FALSE(at_client->use_grh);  // InfiniBand with LIDs on both ends
  EXPECT_EQ(at_client->use_grh, at_server->use_grh);

  // Through the wire: the decoded peer negotiates the same.
  uint8_t buf[kQpParamsBytes];
  ASSERT_EQ(EncodeQpParams(server, buf), kQpParamsBytes);
  QpParams decoded;
  ASSERT_TRUE(DecodeQpParams(buf, &decoded).ok());
  auto again = NegotiatePath(client, decoded);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->path_mtu, 3);
  EXPECT_EQ(again->rd_atomic, 4);
}

TEST(VerbsNegotiationTest, RoceRoutesByGidAndRefusesMismatches) {
  VerbsOptions o;
  const QpParams a = Params(o, Caps(4, 8, 8, kLinkLayerEthernet, /*lid=*/0), false, 0x31);
  const QpParams b = Params(o, Caps(5, 8, 8, kLinkLayerEthernet, 0), true, 0x32);
  auto path = NegotiatePath(a, b);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  EXPECT_TRUE(path->use_grh);
  EXPECT_EQ(path->path_mtu, 4);
  // A zero GID where routing needs one (e.g. an unset gid_index on either end).
  QpParams no_gid = b;
  no_gid.gid.fill(0);
  EXPECT_TRUE(NegotiatePath(a, no_gid).status().IsInvalidArgument());
  EXPECT_TRUE(NegotiatePath(no_gid, a).status().IsInvalidArgument());
  // InfiniBand against Ethernet cannot connect.
  const QpParams ib = Params(o, Caps(4, 8, 8, kLinkLayerInfiniBand, 5), true, 0x33);
  EXPECT_TRUE(NegotiatePath(a, ib).status().IsInvalidArgument());
  // IB with a LID-less end routes by GID too, and both ends see it.
  QpParams ib_nolid = Params(o, Caps(4, 8, 8, kLinkLayerInfiniBand, 0), false, 0x34);
  EXPECT_TRUE(NegotiatePath(ib_nolid, ib)->use_grh);
  EXPECT_TRUE(NegotiatePath(ib, ib_nolid)->use_grh);
  // Local params never filled in (LocalPathCaps not called) are a programming error.
  QpParams unset;
  unset.path_mtu = 0;
  EXPECT_TRUE(NegotiatePath(unset, ib).status().IsInvalidArgument());
}

TEST(VerbsNegotiationTest, VersionOnePeersKeepTheOldBehaviour) {
  VerbsOptions o;
  const QpParams local = Params(o, Caps(5, 8, 8), true, 0x41);
  QpParams old_client = Params(o, Caps(2, 1, 1), false, 0x42);
  old_client.version = 1;
  uint8_t buf[kQpParamsBytes];
  ASSERT_EQ(EncodeQpParams(old_client, buf), kQpParamsV1Bytes);
  QpParams decoded;
  ASSERT_TRUE(DecodeQpParams(std::span<const uint8_t>(buf, kQpParamsV1Bytes), &decoded).ok());
  EXPECT_EQ(decoded.version, 1);
  EXPECT_EQ(decoded.path_mtu, 0);  // said nothing
  EXPECT_EQ(decoded.qpn, 0x42u);
  // Nothing to negotiate with: the local values stand, as before version 2.
  auto path = NegotiatePath(local, decoded);
  ASSERT_TRUE(path.ok());
  EXPECT_EQ(path->path_mtu, local.path_mtu);
  EXPECT_EQ(path->rd_atomic, local.rd_atomic);
  // The server answers a version-1 body with a version-1 body.
  QpParams reply = local;
  reply.version = decoded.version;
  EXPECT_EQ(EncodeQpParams(reply, buf), kQpParamsV1Bytes);
}

TEST(VerbsNegotiationTest, VersionTwoDecoderRejectsHostileBodies) {
  VerbsOptions o;
  const QpParams p = Params(o, Caps(5, 8, 8), false, 0x51);
  uint8_t good[kQpParamsBytes];
  ASSERT_EQ(EncodeQpParams(p, good), kQpParamsBytes);
  QpParams back;
  ASSERT_TRUE(DecodeQpParams(good, &back).ok());
  EXPECT_EQ(back.path_mtu, p.path_mtu);
  EXPECT_EQ(back.rd_atomic, p.rd_atomic);
  EXPECT_EQ(back.link_layer, p.link_layer);
  auto mutated = [&](size_t at, uint8_t value) {
    std::vector<uint8_t> b(good, good + kQpParamsBytes);
    b[at] = value;
    QpParams out;
    return DecodeQpParams(b, &out);
  };
  EXPECT_TRUE(mutated(28, 3).IsCorruption());  // version byte
  EXPECT_TRUE(mutated(28, 1).IsCorruption());  // a v1 tag in a v2-sized body
  EXPECT_TRUE(mutated(29, 0).IsCorruption());  // MTU code 0
  EXPECT_TRUE(mutated(29, 6).IsCorruption());  // MTU code above 4096
  EXPECT_TRUE(mutated(30, 0).IsCorruption());  // read depth 0
  EXPECT_TRUE(mutated(31, 3).IsCorruption());  // unknown link layer
  EXPECT_TRUE(mutated(39, 1).IsCorruption());  // reserved
  EXPECT_TRUE(mutated(29, 1).ok());
  std::vector<uint8_t> odd(good, good + kQpParamsBytes);
  odd.resize(34);
  EXPECT_TRUE(DecodeQpParams(odd, &back).IsCorruption());
}

}  // namespace
}  // namespace kvtier::rdma::verbs
