// `kvtier stats` / `kvtier policy` output from kvtierd's replies, and from replies of any other
// shape (what answers at the socket is not trusted): an error, or 0 / "?" for a field that is
// absent or of another type, never an exception.
#include "cli/daemon_reply.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier::cli {
namespace {

TEST(DaemonReplyTest, PrintsWhatKvtierdSends) {
  auto stats = FormatStats(
      R"({"tiers":{"hbm":{"used_bytes":0,"capacity_bytes":0,"objects":0,"hits":0,"evictions":0},)"
      R"("dram":{"used_bytes":4096,"capacity_bytes":1048576,"objects":2,"hits":7,"evictions":1},)"
      R"("ssd":{"used_bytes":0,"capacity_bytes":0,"objects":0,"hits":0,"evictions":0}},)"
      R"("misses":{"never_stored":3,"evicted":1,"expired":0,"checksum_failure":0},)"
      R"("policy":{"eviction":"lru","admission":"admit_all"},"tenant_bytes":{"alice":4096}})");
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_NE(stats->find("dram            4096        1048576          2            7          1"),
            std::string::npos)
      << *stats;
  EXPECT_NE(stats->find("misses: never_stored=3 evicted=1 expired=0 checksum=0"),
            std::string::npos);
  EXPECT_NE(stats->find("policy: eviction=lru admission=admit_all"), std::string::npos);
  EXPECT_NE(stats->find("tenant alice: 4096 bytes"), std::string::npos);

  auto policy =
      FormatPolicy(R"({"eviction":"s3fifo","admission":"second_hit","params":{"a":"1"}})");
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ(*policy, "eviction=s3fifo admission=second_hit params={\"a\":\"1\"}\n");
}

TEST(DaemonReplyTest, RepliesOfAnotherShapeAreErrorsOrPrintedAsUnknown) {
  for (const char* reply : {"", "not json", "[]", "null", "7", "\"x\""}) {
    EXPECT_TRUE(FormatStats(reply).status().IsCorruption()) << reply;
    EXPECT_TRUE(FormatPolicy(reply).status().IsCorruption()) << reply;
  }
  for (const char* reply :
       {R"({})", R"({"tiers":[]})", R"({"tiers":{"dram":null}})", R"({"tiers":{"dram":7}})",
        R"({"tiers":{"dram":{"hits":"many","objects":-1}}})", R"({"misses":"none"})",
        R"({"policy":{"eviction":5}})", R"({"tenant_bytes":[1]})",
        R"({"tenant_bytes":{"bob":"lots"}})"}) {
    auto stats = FormatStats(reply);
    ASSERT_TRUE(stats.ok()) << reply;
    EXPECT_NE(stats->find("dram               0              0          0            0          0"),
              std::string::npos)
        << reply << "\n"
        << *stats;
  }
  EXPECT_NE(FormatStats(R"({"tenant_bytes":{"bob":"lots"}})")->find("tenant bob: 0 bytes"),
            std::string::npos);
  for (const char* reply : {R"({})", R"({"eviction":[],"admission":{}})", R"({"params":7})"}) {
    auto policy = FormatPolicy(reply);
    ASSERT_TRUE(policy.ok()) << reply;
    EXPECT_EQ(policy->rfind("eviction=? admission=? params=", 0), 0u) << *policy;
  }
}

}  // namespace
}  // namespace kvtier::cli
