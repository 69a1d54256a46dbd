#include "common/host_port.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier {
namespace {

TEST(HostPortTest, ParsesNamesAddressesAndBracketedIpv6) {
  struct Case {
    const char* text;
    const char* host;
    uint16_t port;
    const char* printed;
  };
  for (const Case& c :
       {Case{"127.0.0.1:7300", "127.0.0.1", 7300, "127.0.0.1:7300"},
        Case{"kvtierd-0.kvtierd:7300", "kvtierd-0.kvtierd", 7300, "kvtierd-0.kvtierd:7300"},
        Case{"[::1]:1", "::1", 1, "[::1]:1"},
        Case{"[fe80::1%eth0]:65535", "fe80::1%eth0", 65535, "[fe80::1%eth0]:65535"}}) {
    SCOPED_TRACE(c.text);
    StatusOr<HostPort> hp = ParseHostPort(c.text);
    ASSERT_TRUE(hp.ok()) << hp.status().ToString();
    EXPECT_EQ(hp->host, c.host);
    EXPECT_EQ(hp->port, c.port);
    EXPECT_EQ(hp->ToString(), c.printed);
  }
}

TEST(HostPortTest, RefusesWhatIsNotHostColonPort) {
  for (const char* text : {"", ":", "127.0.0.1", "127.0.0.1:", ":7300", "[]:7300", "[::1:7300",
                           "::1]:7300", "::1:7300", "[::1]", "127.0.0.1:0", "127.0.0.1:65536",
                           "127.0.0.1:-1", "127.0.0.1:+80", "127.0.0.1:80x", "127.0.0.1: 80",
                           "127.0.0.1:99999999999999999999", "/run/kvtierd.sock", "host/x:80"}) {
    SCOPED_TRACE(text);
    StatusOr<HostPort> hp = ParseHostPort(text);
    ASSERT_FALSE(hp.ok()) << hp->host << " " << hp->port;
    EXPECT_EQ(hp.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(hp.status().message().find(std::string("'") + text + "'"), std::string::npos)
        << hp.status().message();
  }
}

// A name is never taken for loopback by its spelling: only numeric 127/8, ::1 and "localhost".
TEST(HostPortTest, LoopbackIsNumericOrLocalhost) {
  for (const char* a : {"127.0.0.1", "127.3.0.1", "::1", "localhost"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a :
       {"127.kvtierd.example", "127.", "localhost.example", "10.0.0.1", "::", "128.0.0.1", ""}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

}  // namespace
}  // namespace kvtier
