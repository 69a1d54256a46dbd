// The per-source limit of kvtierd's TCP fronts (cache_daemon/source_limit.h): which addresses
// count as one source, the table of places per source (exact, bounded, thread-safe), and the
// [limits] keys behind it (limits.unauthenticated_connections_per_source_max,
// limits.unauthenticated_source_ipv6_prefix_bits). The daemon's use of it is tested against
// the real binary in tests/e2e/preauth_e2e_test.cc.
#include "cache_daemon/source_limit.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/config.h"

namespace kvtier::daemon {
namespace {

SourceKey Key(const std::string& address, uint32_t ipv6_prefix_bits = 64) {
  return SourceKeyOf(boost::asio::ip::make_address(address), ipv6_prefix_bits);
}

TEST(SourceKey, Ipv4IsItsWholeAddressAndAMappedIpv6PeerIsItsIpv4Address) {
  EXPECT_EQ(Key("203.0.113.7"), Key("203.0.113.7"));
  EXPECT_NE(Key("203.0.113.7"), Key("203.0.113.8"));
  EXPECT_NE(Key("127.0.0.1"), Key("127.0.0.2"));
  EXPECT_EQ(Key("::ffff:203.0.113.7"), Key("203.0.113.7"));
  EXPECT_EQ(SourceName(Key("::ffff:203.0.113.7")), "203.0.113.7");
  EXPECT_EQ(SourceName(Key("127.0.0.2")), "127.0.0.2");
  // No IPv6 source equals an IPv4 one, whatever its bits.
  EXPECT_NE(Key("::ffff:cb00:7107", 128), Key("::", 128));  // (mapped: IPv4)
  EXPECT_NE(Key("0.0.0.0"), Key("::", 64));
  EXPECT_NE(Key("0.0.0.0"), Key("::", 128));
}

TEST(SourceKey, Ipv6IsGroupedByItsPrefix) {
  // One /64: one source, however the host picks its interface identifier.
  EXPECT_EQ(Key("2001:db8:1:2::1"), Key("2001:db8:1:2:ffff:ffff:ffff:ffff"));
  EXPECT_NE(Key("2001:db8:1:2::1"), Key("2001:db8:1:3::1"));
  EXPECT_EQ(SourceName(Key("2001:db8:1:2:aaaa::1")), "2001:db8:1:2::/64");
  // 128 bits: every address its own source.
  EXPECT_NE(Key("2001:db8:1:2::1", 128), Key("2001:db8:1:2::2", 128));
  EXPECT_EQ(SourceName(Key("2001:db8:1:2::1", 128)), "2001:db8:1:2::1");
  // A prefix that ends inside a byte keeps that byte's leading bits only.
  EXPECT_EQ(Key("2001:db8:1:20::", 60), Key("2001:db8:1:2f:1::", 60));
  EXPECT_NE(Key("2001:db8:1:20::", 60), Key("2001:db8:1:30::", 60));
  EXPECT_EQ(SourceName(Key("2001:db8:1:2f:1::", 60)), "2001:db8:1:20::/60");
  // The same bits under two prefix lengths are two sources.
  EXPECT_NE(Key("2001:db8::", 48), Key("2001:db8::", 64));
  EXPECT_EQ(Key("::1", 128), Key("::1", 128));
}

TEST(SourcePlaces, EachSourceHoldsAtMostItsShareAndEntriesGoAtZero) {
  SourcePlaces places("test front", 3);
  const SourceKey a = Key("192.0.2.1"), b = Key("192.0.2.2");
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(places.Acquire(a, 0));
  EXPECT_FALSE(places.Acquire(a, 1));
  EXPECT_FALSE(places.Acquire(a, 2));  // refused again: a refusal takes nothing
  EXPECT_TRUE(places.Acquire(b, 3));
  EXPECT_EQ(places.gauges().sources, 2u);
  EXPECT_EQ(places.gauges().top_places, 3u);
  places.Release(a);
  EXPECT_EQ(places.gauges().top_places, 2u);
  EXPECT_TRUE(places.Acquire(a, 4));  // exactly one place came back
  EXPECT_FALSE(places.Acquire(a, 5));
  for (int i = 0; i < 3; ++i) places.Release(a);
  EXPECT_EQ(places.gauges().sources, 1u);  // a's entry is gone
  places.Release(b);
  places.Release(b);  // not held: ignored
  EXPECT_EQ(places.gauges().sources, 0u);
  EXPECT_EQ(places.gauges().top_places, 0u);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(places.Acquire(a, 6));
}

// Threads taking and giving back places of a few sources: no source ever holds more than its
// share, and the table is empty once every place is given back.
TEST(SourcePlaces, ConcurrentAcquireAndReleaseStayExact) {
  constexpr uint32_t kShare = 4;
  constexpr int kThreads = 8, kRounds = 2000;
  SourcePlaces places("test front", kShare);
  const SourceKey sources[] = {Key("198.51.100.1"), Key("198.51.100.2"), Key("2001:db8::1")};
  std::atomic<int> held[3] = {};
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const size_t s = static_cast<size_t>(t + r) % 3;
        if (!places.Acquire(sources[s], static_cast<uint64_t>(r))) continue;
        if (held[s].fetch_add(1) + 1 > static_cast<int>(kShare)) over.store(true);
        held[s].fetch_sub(1);
        places.Release(sources[s]);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(over.load());
  EXPECT_EQ(places.gauges().sources, 0u);
}

// A [limits] table followed by `extra` lines, finalized.
StatusOr<DaemonOptions> Limits(const std::string& extra) {
  KVTIER_ASSIGN_OR_RETURN(DaemonOptions o, ParseConfig("[limits]\n" + extra));
  o.data_dir = "/tmp/kvtier-source-limit-test";
  KVTIER_RETURN_IF_ERROR(Finalize(&o));
  return o;
}

TEST(SourceLimitConfig, DefaultIsEightOrTheFrontsCapWhenSmaller) {
  auto d = Limits("");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->unauthenticated_connections_per_source_max, 8u);
  EXPECT_EQ(d->unauthenticated_source_ipv6_prefix_bits, 64u);
  // A front cap below the default (valid before the per-source key existed) still starts.
  auto small = Limits("unauthenticated_connections_max = 4\n");
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ(small->unauthenticated_connections_per_source_max, 4u);
  auto zero = Limits("unauthenticated_connections_per_source_max = 0\n");  // 0: the default
  ASSERT_TRUE(zero.ok()) << zero.status().ToString();
  EXPECT_EQ(zero->unauthenticated_connections_per_source_max, 8u);
  auto set = Limits(
      "unauthenticated_connections_max = 100\nunauthenticated_connections_per_source_max = 100\n"
      "unauthenticated_source_ipv6_prefix_bits = 128\n");
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->unauthenticated_connections_per_source_max, 100u);
  EXPECT_EQ(set->unauthenticated_source_ipv6_prefix_bits, 128u);
  auto one = Limits(
      "unauthenticated_connections_per_source_max = 1\n"
      "unauthenticated_source_ipv6_prefix_bits = 16\n");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->unauthenticated_connections_per_source_max, 1u);
  // The HTTP front's: 16, or its front's cap when smaller.
  EXPECT_EQ(d->http_connections_per_source_max, 16u);
  auto http_small = Limits("http_connections_max = 10\n");
  ASSERT_TRUE(http_small.ok()) << http_small.status().ToString();
  EXPECT_EQ(http_small->http_connections_per_source_max, 10u);
  auto http_set = Limits("http_connections_per_source_max = 2\n");
  ASSERT_TRUE(http_set.ok()) << http_set.status().ToString();
  EXPECT_EQ(http_set->http_connections_per_source_max, 2u);
}

TEST(SourceLimitConfig, EachBadValueIsRefusedNamingTheKey) {
  struct Case {
    std::string extra, key, why;
  };
  const Case cases[] = {
      {"unauthenticated_connections_per_source_max = 65\n",
       "limits.unauthenticated_connections_per_source_max", "unauthenticated_connections_max (64)"},
      {"unauthenticated_connections_max = 4\nunauthenticated_connections_per_source_max = 5\n",
       "limits.unauthenticated_connections_per_source_max", "unauthenticated_connections_max (4)"},
      {"unauthenticated_connections_per_source_max = -1\n",
       "limits.unauthenticated_connections_per_source_max", "non-negative"},
      {"http_connections_per_source_max = 65\n", "limits.http_connections_per_source_max",
       "http_connections_max (64)"},
      {"unauthenticated_source_ipv6_prefix_bits = 15\n",
       "limits.unauthenticated_source_ipv6_prefix_bits", "16..128"},
      {"unauthenticated_source_ipv6_prefix_bits = 129\n",
       "limits.unauthenticated_source_ipv6_prefix_bits", "16..128"},
  };
  for (const Case& c : cases) {
    auto o = Limits(c.extra);
    ASSERT_FALSE(o.ok()) << c.extra;
    EXPECT_NE(o.status().message().find(c.key), std::string::npos) << o.status().ToString();
    EXPECT_NE(o.status().message().find(c.why), std::string::npos) << o.status().ToString();
  }
}

}  // namespace
}  // namespace kvtier::daemon
