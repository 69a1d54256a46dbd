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
#include "tests/e2e/raw_native.h"
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
    port_ = kt::FreePort();
    d_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 268435456\nssd_capacity_bytes = 0\n[limits]\n"
        "malloc_mmap_threshold_bytes = 1048576\nreply_buffers_kept_bytes_max = " +
        std::to_string(kept_bytes_max) + "\n");
    EXPECT_TRUE(d_->Start({"--native-port", std::to_string(port_)})) << d_->Log();
    ClientOptions o;
    o.tcp_host = "127.0.0.1";
    o.tcp_port = port_;
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

  // PUTs the kBatch units of Keys().
  static void PutAll(Client* c, const std::vector<wire::Key>& keys) {
    std::vector<PutUnit> units;
    std::vector<std::vector<uint8_t>> values(kBatch);
    for (size_t i = 0; i < kBatch; ++i) {
      values[i].assign(kUnitBytes, 0x33);
      values[i][kUnitBytes - 1] = static_cast<uint8_t>(i);
      units.push_back({keys[i], {}, values[i]});
    }
    auto put = c->Put(units, PutOptions{});
    EXPECT_TRUE(put.ok()) << put.status().ToString();
  }

  // kvtierd's minor page faults over kMeasuredGets GETs of kBatch units, after kWarmGets.
  int64_t FaultsOverGets(Client* c) {
    const std::vector<wire::Key> keys = Keys();
    PutAll(c, keys);
    for (int i = 0; i < kWarmGets; ++i) GetAll(c, keys);
    const int64_t before = kt::ProcessMinorFaults(d_->pid());
    for (int i = 0; i < kMeasuredGets; ++i) GetAll(c, keys);
    return kt::ProcessMinorFaults(d_->pid()) - before;
  }

  uint16_t port_ = 0;  // the native TCP front of the daemon StartWith started

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

// A client that reads nothing must not hold kept buffers behind small replies: a connection
// counts a queued reply by its size, so a tiny GET reply built in a kept 1.8 MB buffer and left
// queued (its socket full) would hold the whole buffer uncounted, one more per cycle of "a
// reading client's large GET gives a buffer back, the stalled client's tiny GET takes it"
// (ReplyBuffers::Fit copies such a reply out). 20 cycles: without Fit kvtierd's resident memory
// grew by one buffer per cycle; with it, it stays flat.
TEST_F(ReplyBuffersTest, AStalledClientsSmallRepliesHoldNoKeptBuffers) {
  if (kSanitizerAllocator) GTEST_SKIP() << "the sanitizer's allocator has its own page reuse";
  constexpr int kCycles = 20;
  auto reader = StartWith(64ull << 20);
  ASSERT_TRUE(reader);
  const std::vector<wire::Key> keys = Keys();
  PutAll(reader.get(), keys);
  GetAll(reader.get(), keys);
  // The stalled client: a small receive buffer, and large replies it never reads until its
  // socket is full and its replies queue in kvtierd.
  kt::RawNative stalled(kt::ConnectTcp(port_, 4096));
  ASSERT_TRUE(stalled.ok());
  uint64_t id = 1;
  wire::GetRequest big;
  big.keys = keys;
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(stalled.SendFrame(wire::Opcode::kGet, id++, wire::EncodeGet(big, false)));
  }
  wire::GetRequest tiny;
  tiny.keys = {keys[0]};
  tiny.keys[0][31] ^= 0xff;  // a key never stored: the smallest reply there is
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  GetAll(reader.get(), keys);
  const uint64_t rss_before = d_->RssBytes();
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    GetAll(reader.get(), keys);  // its buffer is given back when written
    for (int wait = 0; wait < 100 && KeptBytesGauge() == 0; ++wait) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(stalled.SendFrame(wire::Opcode::kGet, id++, wire::EncodeGet(tiny, false)));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // executed, queued
  }
  const uint64_t rss_after = d_->RssBytes();
  std::printf("kvtierd RSS %llu MiB before %d cycles, %llu MiB after\n",
              static_cast<unsigned long long>(rss_before >> 20), kCycles,
              static_cast<unsigned long long>(rss_after >> 20));
  // One 1.8 MB buffer per cycle would be 35 MB; allow a quarter of it for everything else.
  EXPECT_LT(rss_after, rss_before + kCycles * kBatch * kUnitBytes / 4);
  EXPECT_TRUE(d_->Alive());
  stalled.Close();
  reader.reset();
  EXPECT_EQ(d_->Stop(), 0);
}

}  // namespace
}  // namespace kvtier::daemon
