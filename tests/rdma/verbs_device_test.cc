// Runs against a real RDMA device where one is present; skipped (with a message) otherwise.
#include "rdma/verbs_device.h"

#include <gtest/gtest.h>

#include "rdma/engram_table.h"
#include "tests/rdma/test_util.h"

namespace kvtier::rdma::verbs {
namespace {

TEST(VerbsDeviceTest, RegistersOnlyTheTableRegionAndBringsQpToInit) {
  if (ListDevices().empty()) {
    GTEST_SKIP() << "no RDMA device (ibv_get_device_list is empty); verbs hardware test skipped";
  }
  testing::TempDir dir;
  auto table = MappedTable::Open(testing::MakeTable(dir, "t.engram", 0, 1000, 256));
  ASSERT_TRUE(table.ok());
  VerbsOptions o;
  o.cq_depth = 256;
  o.send_queue_depth = 128;
  auto zone = VerbsZone::Open(o);
  ASSERT_TRUE(zone.ok()) << zone.status().ToString();
  auto region = (*zone)->RegisterRemoteReadable((*table)->rows().data(), (*table)->rows().size());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_EQ(region->length_bytes, (*table)->rows().size());
  EXPECT_EQ(region->addr, reinterpret_cast<uintptr_t>((*table)->rows().data()));
  std::vector<uint8_t> dest(4096);
  EXPECT_TRUE((*zone)->RegisterLocalWritable(dest.data(), dest.size()).ok());
  EXPECT_TRUE(
      (*zone)->RegisterLocalWritable(dest.data(), dest.size()).status().IsInvalidArgument());
  EXPECT_TRUE((*zone)->Deregister(dest.data()).ok());
  EXPECT_TRUE((*zone)->Deregister(dest.data()).IsNotFound());
  auto qp = (*zone)->CreateQp(128, QpRole::kReader);
  ASSERT_TRUE(qp.ok()) << qp.status().ToString();
  EXPECT_NE((*qp)->LocalParams().qpn, 0u);
  EXPECT_LE((*qp)->LocalParams().psn, 0xffffffu);
}

TEST(VerbsDeviceTest, TwoQpsOfOneZoneConnectToEachOther) {
  if (ListDevices().empty()) {
    GTEST_SKIP() << "no RDMA device (ibv_get_device_list is empty); verbs hardware test skipped";
  }
  auto zone = VerbsZone::Open(VerbsOptions{});
  ASSERT_TRUE(zone.ok()) << zone.status().ToString();
  auto a = (*zone)->CreateQp(16, QpRole::kReader);
  auto b = (*zone)->CreateQp(16, QpRole::kResponder);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->ConnectTo((*b)->LocalParams()).ok());
  ASSERT_TRUE((*b)->ConnectTo((*a)->LocalParams()).ok());
  EXPECT_TRUE((*a)->ForceError().ok());
}

TEST(VerbsDeviceTest, NoDeviceIsUnavailableNotACrash) {
  if (!ListDevices().empty()) GTEST_SKIP() << "an RDMA device is present";
  EXPECT_TRUE(VerbsZone::Open(VerbsOptions{}).status().IsUnavailable());
  EXPECT_EQ(std::string(WcStatusName(0)), "success");  // ibv_wc_status_str, no device needed
}

}  // namespace
}  // namespace kvtier::rdma::verbs
