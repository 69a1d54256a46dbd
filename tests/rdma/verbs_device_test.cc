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
  auto zone = VerbsZone::Open("", 1, 256, 128);
  ASSERT_TRUE(zone.ok()) << zone.status().ToString();
  auto region = (*zone)->RegisterRemoteReadable((*table)->rows().data(), (*table)->rows().size());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_EQ(region->length_bytes, (*table)->rows().size());
  EXPECT_EQ(region->addr, reinterpret_cast<uintptr_t>((*table)->rows().data()));
  std::vector<uint8_t> dest(4096);
  EXPECT_TRUE((*zone)->RegisterLocalWritable(dest.data(), dest.size()).ok());
  EXPECT_NE((*zone)->LocalParams().qpn, 0u);
}

TEST(VerbsDeviceTest, NoDeviceIsUnavailableNotACrash) {
  if (!ListDevices().empty()) GTEST_SKIP() << "an RDMA device is present";
  EXPECT_TRUE(VerbsZone::Open("", 1, 64, 64).status().IsUnavailable());
}

}  // namespace
}  // namespace kvtier::rdma::verbs
