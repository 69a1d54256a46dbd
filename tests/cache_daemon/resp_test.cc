#include "cache_daemon/resp.h"

#include <gtest/gtest.h>

namespace kvtier::daemon::resp {
namespace {

using Argv = std::vector<std::string>;

TEST(RespParser, MultibulkAcrossArbitrarySplits) {
  std::string wire = std::string("*3\r\n$3\r\nSET\r\n$3\r\nk\r1\r\n$5\r\nv") +
                     std::string(1, '\0') + "lue\r\n*1\r\n$4\r\nPING\r\n";
  for (size_t split = 1; split < wire.size(); ++split) {
    RespParser p;
    std::vector<Argv> cmds;
    Argv a;
    p.Append(std::string_view(wire).substr(0, split));
    while (*p.Next(&a)) cmds.push_back(a);
    p.Append(std::string_view(wire).substr(split));
    while (*p.Next(&a)) cmds.push_back(a);
    ASSERT_EQ(cmds.size(), 2u) << split;
    EXPECT_EQ(cmds[0], (Argv{"SET", "k\r1", std::string("v\0lue", 5)}));
    EXPECT_EQ(cmds[1], (Argv{"PING"}));
    EXPECT_EQ(p.buffered_bytes(), 0u);
  }
}

TEST(RespParser, InlineCommands) {
  RespParser p;
  p.Append("PING\r\nset  a   b\nGET a\r\n");
  Argv a;
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, Argv{"PING"});
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, (Argv{"set", "a", "b"}));
  ASSERT_TRUE(*p.Next(&a));
  EXPECT_EQ(a, (Argv{"GET", "a"}));
  EXPECT_FALSE(*p.Next(&a));
}

TEST(RespParser, ProtocolErrors) {
  const char* bad[] = {"*x\r\n", "*1\r\nX3\r\n", "*1\r\n$-5\r\n", "*1\r\n$3\r\nabcXY"};
  for (const char* b : bad) {
    RespParser p;
    p.Append(b);
    Argv a;
    StatusOr<bool> r = p.Next(&a);
    EXPECT_FALSE(r.ok()) << b;
    EXPECT_FALSE(p.Next(&a).ok()) << "parser must stay failed";
  }
}

TEST(RespParser, EnforcesLimits) {
  RespParser p(RespLimits{.max_args = 2, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  Argv a;
  p.Append("*3\r\n");
  EXPECT_FALSE(p.Next(&a).ok());
  RespParser q(RespLimits{.max_args = 2, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  q.Append("*1\r\n$5\r\n");
  EXPECT_FALSE(q.Next(&a).ok());
  RespParser r(RespLimits{.max_args = 8, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  r.Append(std::string(40, 'a'));  // an inline line that never ends
  EXPECT_FALSE(r.Next(&a).ok());
  RespParser s(RespLimits{.max_args = 8, .max_bulk_bytes = 4, .max_inline_bytes = 16});
  s.Append(std::string(10, 'a'));  // still within the limit: incomplete, not an error
  StatusOr<bool> ok = s.Next(&a);
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(*ok);
}

TEST(RespEncode, Replies) {
  std::string out;
  AppendSimple("OK", &out);
  AppendError("ERR bad\r\nthing", &out);
  AppendInteger(-2, &out);
  AppendBulk(std::string("a\0b", 3), &out);
  AppendNull(&out);
  AppendArrayHeader(2, &out);
  EXPECT_EQ(out, std::string("+OK\r\n-ERR bad  thing\r\n:-2\r\n$3\r\na\0b\r\n$-1\r\n*2\r\n", 45));
}

}  // namespace
}  // namespace kvtier::daemon::resp
