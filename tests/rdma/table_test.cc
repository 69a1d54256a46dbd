#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "rdma/engram_table.h"
#include "rdma/hot_row_cache.h"
#include "rdma/shard_map.h"
#include "tests/rdma/test_util.h"

namespace kvtier::rdma {
namespace {

using testing::MakeTable;
using testing::TempDir;

TEST(EngramTableTest, GeneratedFileMapsBackWithHeaderAndRows) {
  TempDir dir;
  const std::string path = MakeTable(dir, "t.engram", 1000, 77, 64, 3);
  auto table = MappedTable::Open(path);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  const EngramTableHeader& h = (*table)->header();
  EXPECT_EQ(h.row_dim, 64u);
  EXPECT_EQ(h.row_begin, 1000u);
  EXPECT_EQ(h.row_count, 77u);
  EXPECT_EQ(h.row_stride_bytes, 64u + 2u + 3u);
  ASSERT_EQ((*table)->rows().size(), 77u * h.row_stride_bytes);
  std::vector<uint8_t> expected(h.row_stride_bytes, 0);
  for (uint64_t r = 0; r < 77; ++r) {
    FillSyntheticEngramRow(testing::kSeed, 1000 + r, 64, expected.data());
    ASSERT_EQ(std::memcmp((*table)->rows().data() + r * h.row_stride_bytes, expected.data(),
                          h.row_stride_bytes),
              0)
        << "row " << r;
  }
  // Codes are never e4m3fn NaN; scales are finite ue8m0.
  for (uint32_t i = 0; i < 64; ++i) EXPECT_NE(expected[i] & 0x7f, 0x7f);
  EXPECT_GE(expected[64], 120);
  EXPECT_LE(expected[64], 134);
}

TEST(EngramTableTest, RejectsMissingTruncatedAndForeignFiles) {
  TempDir dir;
  EXPECT_TRUE(MappedTable::Open(dir.File("absent")).status().IsNotFound());
  const std::string path = MakeTable(dir, "t.engram", 0, 10);
  std::filesystem::resize_file(path, kEngramTableHeaderBytes + 5);
  EXPECT_TRUE(MappedTable::Open(path).status().IsCorruption());
  FILE* f = std::fopen(dir.File("junk").c_str(), "wb");
  std::string junk(200, 'x');
  std::fwrite(junk.data(), 1, junk.size(), f);
  std::fclose(f);
  EXPECT_TRUE(MappedTable::Open(dir.File("junk")).status().IsCorruption());
}

// The header's bytes 44..63 are zero in version 1 and its rows end inside the uint64 row
// numbers (both accepted before; the row transport's fuzzer found the first).
TEST(EngramTableTest, HeaderRefusesReservedBytesAndRowsPastTheLastRowNumber) {
  EngramTableHeader h;
  h.row_dim = 32;
  h.row_begin = 7;
  h.row_count = 16;
  h.row_stride_bytes = EngramRowBytes(32);
  uint8_t bytes[kEngramTableHeaderBytes];
  EncodeEngramTableHeader(h, bytes);
  EngramTableHeader out;
  ASSERT_TRUE(DecodeEngramTableHeader(bytes, &out).ok());
  EXPECT_EQ(out.row_begin, 7u);
  for (size_t i = 44; i < kEngramTableHeaderBytes; ++i) {
    bytes[i] = 1;
    EXPECT_TRUE(DecodeEngramTableHeader(bytes, &out).IsCorruption()) << "byte " << i;
    bytes[i] = 0;
  }
  h.row_begin = UINT64_MAX - 15;
  EncodeEngramTableHeader(h, bytes);
  EXPECT_TRUE(DecodeEngramTableHeader(bytes, &out).IsInvalidArgument());
  h.row_begin = UINT64_MAX - 16;
  EncodeEngramTableHeader(h, bytes);
  EXPECT_TRUE(DecodeEngramTableHeader(bytes, &out).ok());
}

TEST(ShardMapTest, LooksUpRowsAndValidatesCoverage) {
  auto map = ShardMap::Create({{100, 250, "127.0.0.1", 2, "b"}, {0, 100, "127.0.0.1", 1, "a"}});
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_EQ(map->row_count(), 250u);
  EXPECT_EQ(*map->ShardOf(0), 0u);
  EXPECT_EQ(*map->ShardOf(99), 0u);
  EXPECT_EQ(*map->ShardOf(100), 1u);
  EXPECT_EQ(*map->ShardOf(249), 1u);
  EXPECT_TRUE(map->ShardOf(250).status().IsNotFound());
  // A gap, an overlap, a range not starting at 0.
  EXPECT_FALSE(ShardMap::Create({{0, 10, "h", 1, "a"}, {11, 20, "h", 1, "b"}}).ok());
  EXPECT_FALSE(ShardMap::Create({{0, 10, "h", 1, "a"}, {9, 20, "h", 1, "b"}}).ok());
  EXPECT_FALSE(ShardMap::Create({{5, 10, "h", 1, "a"}}).ok());
  EXPECT_FALSE(ShardMap::Create({}).ok());
}

TEST(ShardMapTest, ParsesToml) {
  const char* text = R"(
[[engram.l1.shard]]
region = "engram.l1.s1"
endpoint = "[::1]:7302"
row_begin = 4096
row_end = 9000

[[engram.l1.shard]]
region = "engram.l1.s0"
endpoint = "127.0.0.1:7301"
row_begin = 0
row_end = 4096
)";
  auto map = ShardMap::FromToml(text, "engram.l1");
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  ASSERT_EQ(map->shards().size(), 2u);
  EXPECT_EQ(map->shards()[0].region_name, "engram.l1.s0");
  EXPECT_EQ(map->shards()[0].port, 7301);
  EXPECT_EQ(map->shards()[1].host, "::1");
  EXPECT_EQ(map->row_count(), 9000u);
  EXPECT_TRUE(ShardMap::FromToml("not = [toml", "engram.l1").status().IsInvalidArgument());
  EXPECT_TRUE(ShardMap::FromToml(text, "engram.l6").status().IsInvalidArgument());
  EXPECT_TRUE(ShardMap::FromToml("[[x.shard]]\nregion = \"a\"\nendpoint = \"h:0\"\n"
                                 "row_begin = 0\nrow_end = 5\n",
                                 "x")
                  .status()
                  .IsInvalidArgument());
}

// Row bounds given as floats beyond int64_t's range are refused, checked before any cast (see
// common/toml_integer.h); a whole float in range is taken as toml++ takes it.
TEST(ShardMapTest, RowBoundsRefuseFloatsOutOfRange) {
  auto shard = [](const std::string& end) {
    return "[[x.shard]]\nregion = \"a\"\nendpoint = \"h:1\"\nrow_begin = 0\nrow_end = " + end +
           "\n";
  };
  auto whole = ShardMap::FromToml(shard("5.0"), "x");
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->row_count(), 5u);
  for (const char* v : {"1e92", "-1e92", "inf", "nan", "4.5"}) {
    EXPECT_TRUE(ShardMap::FromToml(shard(v), "x").status().IsInvalidArgument()) << v;
  }
}

TEST(HotRowCacheTest, LruBoundedByBytes) {
  HotRowCache cache(3 * 8, 8);  // three rows of 8 bytes
  uint8_t row[8], out[8];
  for (uint64_t r = 0; r < 3; ++r) {
    std::memset(row, static_cast<int>(r + 1), sizeof(row));
    cache.Insert(r, row);
  }
  EXPECT_EQ(cache.bytes(), 24u);
  ASSERT_TRUE(cache.Lookup(0, out));  // 0 becomes most recent; 1 is now the LRU
  EXPECT_EQ(out[7], 1);
  std::memset(row, 9, sizeof(row));
  cache.Insert(3, row);
  EXPECT_EQ(cache.size(), 3u);
  std::memset(out, 0, sizeof(out));
  EXPECT_FALSE(cache.Lookup(1, out));
  EXPECT_EQ(out[0], 0);  // untouched on a miss
  EXPECT_TRUE(cache.Lookup(0, out));
  EXPECT_TRUE(cache.Lookup(2, out));
  ASSERT_TRUE(cache.Lookup(3, out));
  EXPECT_EQ(out[0], 9);
  HotRowCache off(0, 8);
  off.Insert(1, row);
  EXPECT_FALSE(off.Lookup(1, out));
}

}  // namespace
}  // namespace kvtier::rdma
