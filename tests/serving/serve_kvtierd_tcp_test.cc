// `kvtier-engine serve --kvtierd HOST:PORT`: the server reaches kvtierd over its native TCP
// front, in the clear on loopback or over TLS with the certificate verified, instead of the Unix
// socket. Real binaries: kvtierd with auth and the native port, and the server.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/key_spec.h"
#include "tests/cache_daemon/tls_test_util.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/serving/prompt_text.h"
#include "tests/serving/serve_process.h"

namespace kvtier::testing {
namespace {

using nlohmann::json;
constexpr char kAlice[] = "sk-alice-0123456789";

class ServeKvtierdTcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtier_serve_tcp_" + std::to_string(getpid()) + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "keys.json") << json{
        {"keys", {{{"key", kAlice}, {"tenant", "alice"}, {"daemon_token", "alice-token"}}}}};
  }
  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "---- serve log ----\n%s\n---- kvtierd log ----\n%s\n",
                   s_ ? s_->Log().c_str() : "", d_ ? d_->Log().c_str() : "");
    }
    s_.reset();
    d_.reset();
    std::filesystem::remove_all(dir_);
  }

  // kvtierd with auth (tenant alice) and its native TCP front on a free loopback port, with TLS
  // on that front when `tls`; returns once the port accepts.
  void StartKvtierd(bool tls) {
    native_port_ = FreePort();
    std::ofstream(dir_ / "tokens.toml")
        << "[[tenant]]\nname = \"alice\"\nid = 1\n"
        << "token_sha256 = [\"" << TokenSha256Hex("alice-token") << "\"]\n";
    std::string config =
        "[storage]\ndram_capacity_bytes = 33554432\nssd_capacity_bytes = 268435456\n"
        "ssd_segment_bytes = 16777216\n[auth]\ntokens_file = \"" +
        (dir_ / "tokens.toml").string() + "\"\n";
    if (tls) {
      ASSERT_TRUE(MakeTestPki(dir_ / "pki", &pki_));
      config += "[tls]\ncert_file = \"" + pki_.cert_file + "\"\nkey_file = \"" + pki_.key_file +
                "\"\nnative = true\nhandshake_timeout_ms = 2000\n";
    }
    d_ = std::make_unique<KvtierdProcess>(dir_ / "d");
    d_->WriteConfig(config);
    ASSERT_TRUE(d_->Start({"--native-port", std::to_string(native_port_)})) << d_->Log();
    int fd = -1;
    for (int i = 0; i < 200 && fd < 0; ++i) {
      fd = ConnectTcp(native_port_);
      if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_GE(fd, 0) << "kvtierd's native port does not accept";
    ::close(fd);
  }
  std::string Address() const { return "127.0.0.1:" + std::to_string(native_port_); }

  void StartServer(std::vector<std::string> extra) {
    std::vector<std::string> args = {"--api-keys", (dir_ / "keys.json").string(), "--guard",
                                     "fetch",      "--idle-sequences-max",        "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    s_ = std::make_unique<ServeProcess>(dir_ / "s");
    ASSERT_TRUE(s_->Start(args)) << s_->Log();
  }

  // Two turns of one conversation (nothing stays resident in the server, so turn 2 can only
  // hit through kvtierd); the second turn's cached_tokens, or -1 on a failed request.
  int64_t SecondTurnCachedTokens(int64_t* whole) {
    json msgs = json::array({{{"role", "user"}, {"content", PromptText(150, 1)}}});
    HttpReply r1 =
        Http(s_->port(), "POST", "/v1/chat/completions", GreedyChat(msgs, 24).dump(), kAlice);
    EXPECT_EQ(r1.status, 200) << r1.body;
    if (r1.status != 200) return -1;
    const json u1 = r1.Json()["usage"];
    EXPECT_EQ(u1["prompt_tokens_details"]["cached_tokens"], 0);
    const std::string reply = r1.Json()["choices"][0]["message"]["content"];
    // Every sampled token but the last was forwarded into the sequence.
    *whole = u1["prompt_tokens"].get<int64_t>() + u1["completion_tokens"].get<int64_t>() - 1;
    msgs.push_back({{"role", "assistant"}, {"content", reply}});
    msgs.push_back({{"role", "user"}, {"content", "and then?"}});
    HttpReply r2 =
        Http(s_->port(), "POST", "/v1/chat/completions", GreedyChat(msgs, 16).dump(), kAlice);
    EXPECT_EQ(r2.status, 200) << r2.body;
    if (r2.status != 200) return -1;
    return r2.Json()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  }

  std::filesystem::path dir_;
  uint16_t native_port_ = 0;
  TestPki pki_;
  std::unique_ptr<KvtierdProcess> d_;
  std::unique_ptr<ServeProcess> s_;
};

TEST_F(ServeKvtierdTcpTest, OverLoopbackTcpTheSecondTurnHitsTheFirst) {
  ASSERT_NO_FATAL_FAILURE(StartKvtierd(/*tls=*/false));
  ASSERT_NO_FATAL_FAILURE(StartServer({"--kvtierd", Address()}));
  int64_t whole = 0;
  EXPECT_EQ(SecondTurnCachedTokens(&whole), whole);
  EXPECT_GT(whole, 64);
  EXPECT_NE(s_->Log().find("cache tcp://" + Address()), std::string::npos) << s_->Log();
}

TEST_F(ServeKvtierdTcpTest, OverTlsTheSecondTurnHitsTheFirst) {
  ASSERT_NO_FATAL_FAILURE(StartKvtierd(/*tls=*/true));
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--kvtierd", Address(), "--kvtierd-tls", "--kvtierd-ca", pki_.ca_file}));
  int64_t whole = 0;
  EXPECT_EQ(SecondTurnCachedTokens(&whole), whole);
  EXPECT_GT(whole, 64);
}

// A kvtierd whose certificate the server cannot verify (another CA; a name the certificate does
// not carry) or that speaks TLS to a server without --kvtierd-tls is never used: every turn is
// computed and billed as a miss, and the log says why.
TEST_F(ServeKvtierdTcpTest, AKvtierdThatFailsVerificationIsNotUsed) {
  ASSERT_NO_FATAL_FAILURE(StartKvtierd(/*tls=*/true));
  const std::vector<std::vector<std::string>> cases = {
      {"--kvtierd", Address(), "--kvtierd-tls", "--kvtierd-ca", pki_.other_ca_file},
      {"--kvtierd", Address(), "--kvtierd-tls", "--kvtierd-ca", pki_.ca_file,
       "--kvtierd-server-name", "kvtierd.example"},
      {"--kvtierd", Address()}};
  for (const auto& flags : cases) {
    SCOPED_TRACE(json(flags).dump());
    ASSERT_NO_FATAL_FAILURE(StartServer(flags));
    int64_t whole = 0;
    EXPECT_EQ(SecondTurnCachedTokens(&whole), 0);
    EXPECT_NE(s_->Log().find("kvtierd unreachable, serving without cache"), std::string::npos)
        << s_->Log();
    const std::string m = Http(s_->port(), "GET", "/metrics").body;
    EXPECT_EQ(Metric(m, "kvtier_serve_prompt_cache_hit_tokens_total{tenant=\"alice\"}"), 0) << m;
    EXPECT_EQ(s_->Stop(), 0) << s_->Log();
  }
}

// Flags that cannot work are refused at start (exit 2) with the reason.
TEST_F(ServeKvtierdTcpTest, BadKvtierdFlagsAreRefusedAtStart) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--kvtierd 10.1.2.3:7300", "not a loopback address: give --kvtierd-tls"},
      {"--kvtierd kvtierd.example:7300", "not a loopback address: give --kvtierd-tls"},
      {"--kvtierd 127.kvtierd.example:7300", "not a loopback address: give --kvtierd-tls"},
      {"--socket /run/x.sock --kvtierd 127.0.0.1:7300", "give --socket or --kvtierd, not both"},
      {"--kvtierd-tls", "need --kvtierd"},
      {"--socket /run/x.sock --kvtierd-ca /etc/ca.pem", "need --kvtierd"},
      {"--kvtierd 127.0.0.1:7300 --kvtierd-ca /etc/ca.pem", "need --kvtierd-tls"},
      {"--kvtierd 127.0.0.1", "want host:port"},
      {"--kvtierd 127.0.0.1:0", "port must be 1..65535"},
      {"--kvtierd 127.0.0.1:70000", "port must be 1..65535"},
      {"--kvtierd ::1:7300", "write an IPv6 host as [addr]"},
      {"--kvtierd :7300", "no host"}};
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    std::string out;
    const int rc = RunShell(
        "timeout 30 " + std::string(KVTIER_ENGINE_PATH) + " serve --port 0 " + flags, &out);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find(message), std::string::npos) << out;
    EXPECT_EQ(out.find("listening"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace kvtier::testing
