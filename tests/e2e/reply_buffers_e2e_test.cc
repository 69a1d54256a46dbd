// End-to-end: kvtierd keeps the buffers of large native replies (limits.
// reply_buffers_kept_bytes_max, cache_daemon/reply_buffers.h), so that GETs over TCP, whose
// values travel inside the reply, stop faulting their reply's pages in again on every call.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/kvtierd_test.h"
#include "tests/process_util.h"
#include "tests/sanitizers.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;

constexpr size_t kUnitBytes = 57000;  // a unit of the real model's page (docs/format/unit.md)
constexpr size_t kBatch = 32;         // 1.8 MB of values per reply
constexpr int kWarmGets = 5;
constexpr int kMeasuredGets = 20;

class ReplyBuffersTest : public kt::KvtierdTest {
 protected:
  ReplyBuffersTest() : KvtierdTest("kvtier_reply_buffers") {}

  // Starts d_ with a DRAM tier only, kept reply buffers limited to `kept_bytes_max`, and the
  // native TCP front on a port of its own; returns a client of that front. malloc's mmap
  // threshold is fixed at 1 MiB, so that a reply buffer not kept is always a mapping of its
  // own, unmapped when freed: with glibc's sliding threshold whether its pages stay depends on
  // what else the heap holds (measured here: 0 to 9,200 faults over the same GETs).
  std::unique_ptr<Client> StartWith(uint64_t kept_bytes_max) {
    d_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 268435456\nssd_capacity_bytes = 0\n[limits]\n"
        "malloc_mmap_threshold_bytes = 1048576\nreply_buffers_kept_bytes_max = " +
        std::to_string(kept_bytes_max) + "\n");
    const uint16_t port = kt::FreePort();
    EXPECT_TRUE(d_->Start({"--native-port", std::to_string(port)})) << d_->Log();
    ClientOptions o;
    o.tcp_host = "127.0.0.1";
    o.tcp_port = port;
    for (int attempt = 0; attempt < 100; ++attempt) {  // the TCP front may follow the socket
      auto c = Client::Connect(o);
      if (c.ok()) return std::move(c).value();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << "no connection to the native TCP front";
    return nullptr;
  }

  static std::vector<wire::Key> Keys() {
    std::vector<wire::Key> keys(kBatch);
    for (size_t i = 0; i < kBatch; ++i) {
      keys[i][0] = 0x5b;
      std::memcpy(keys[i].data() + 1, &i, sizeof(i));
    }
    return keys;
  }

  // One GET of every key; every value must be there, whole.
  static void GetAll(Client* c, const std::vector<wire::Key>& keys) {
    size_t hits = 0;
    ASSERT_TRUE(c->Get(keys, [&](size_t i, const GetItem& g) {
                   ASSERT_TRUE(g.status.ok()) << i << ": " << g.status.ToString();
                   ASSERT_EQ(g.value.size(), kUnitBytes);
                   EXPECT_EQ(g.value[kUnitBytes - 1], static_cast<uint8_t>(i));
                   ++hits;
                 }).ok());
    ASSERT_EQ(hits, keys.size());
  }

  // kvtierd's minor page faults over kMeasuredGets GETs of kBatch units, after kWarmGets.
  int64_t FaultsOverGets(Client* c) {
    const std::vector<wire::Key> keys = Keys();
    std::vector<PutUnit> units;
    std::vector<std::vector<uint8_t>> values(kBatch);
    for (size_t i = 0; i < kBatch; ++i) {
      values[i].assign(kUnitBytes, 0x33);
      values[i][kUnitBytes - 1] = static_cast<uint8_t>(i);
      units.push_back({keys[i], {}, values[i]});
    }
    auto put = c->Put(units, PutOptions{});
    EXPECT_TRUE(put.ok()) << put.status().ToString();
    for (int i = 0; i < kWarmGets; ++i) GetAll(c, keys);
    const int64_t before = kt::ProcessMinorFaults(d_->pid());
    for (int i = 0; i < kMeasuredGets; ++i) GetAll(c, keys);
    return kt::ProcessMinorFaults(d_->pid()) - before;
  }

  uint64_t KeptBytesGauge() {
    const std::string m = kt::HttpRequest(d_->http_port(), "GET", "/metrics");
    const std::string series = "\nkvtier_reply_buffers_kept_bytes ";
    const size_t at = m.find(series);
    EXPECT_NE(at, std::string::npos) << m;
    return at == std::string::npos ? UINT64_MAX : std::stoull(m.substr(at + series.size()));
  }
};

// Each GET's reply is 1.8 MB, about 450 pages. Without kept buffers kvtierd faults them in
// again on every call (here each is a mapping of its own; with glibc's defaults the heap top
// where the reply was built is often trimmed: a 64K-token restore over TCP spent 20-50 ms of
// kvtierd's CPU, docs/performance/serving.md); with them the replies after the first few are
// built in pages already resident.
TEST_F(ReplyBuffersTest, TcpGetRepliesReuseKeptBuffers) {
  if (kSanitizerAllocator) GTEST_SKIP() << "the sanitizer's allocator has its own page reuse";
  constexpr uint64_t kKeptBytesMax = 64ull << 20;
  int64_t faults[2] = {};
  uint64_t kept[2] = {};
  for (const bool keep : {false, true}) {
    auto c = StartWith(keep ? kKeptBytesMax : 0);
    ASSERT_TRUE(c);
    faults[keep] = FaultsOverGets(c.get());
    kept[keep] = KeptBytesGauge();
    c.reset();
    EXPECT_EQ(d_->Stop(), 0);
  }
  const int64_t reply_pages = kBatch * kUnitBytes / 4096;
  std::printf(
      "kvtierd minor faults over %d GETs of %zu x %zu bytes (%lld pages each): %lld "
      "with no buffer kept, %lld kept (%llu bytes kept)\n",
      kMeasuredGets, kBatch, kUnitBytes, static_cast<long long>(reply_pages),
      static_cast<long long>(faults[0]), static_cast<long long>(faults[1]),
      static_cast<unsigned long long>(kept[1]));
  EXPECT_EQ(kept[0], 0u);
  EXPECT_GE(kept[1], kBatch * kUnitBytes);
  EXPECT_LE(kept[1], kKeptBytesMax);
  // Without: at least half of every reply's pages. With: fewer than a tenth of one reply's
  // pages per GET (what is left is the daemon's other work).
  EXPECT_GE(faults[0], kMeasuredGets * reply_pages / 2);
  EXPECT_LT(faults[1], kMeasuredGets * reply_pages / 10);
}

}  // namespace
}  // namespace kvtier::daemon
