// End-to-end: redis-py (Debian's python3-redis, the client LMCache's Redis connector is built
// on) against the real kvtierd: the connector's pipelined data + metadata keys, MGET,
// existence checks and SCAN listing, SET NX/XX/EX/PX/KEEPTTL/GET, MULTI/EXEC/DISCARD, HELLO 3,
// two tenants, and hostile input (a million commands after MULTI, KEYS over many keys,
// absurd SCAN COUNT, malformed options). The checks live in resp_redis_py.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/key_spec.h"
#include "tests/e2e/kvtierd_process.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;

TEST(RespClientsE2e, RedisPyAsAKvCacheConnector) {
  if (kt::RunShell("/usr/bin/python3 -c 'import redis'") != 0) {
    GTEST_SKIP() << "python3-redis missing (deploy/install-deps.sh installs it)";
  }
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("kvtier_resp_py_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  kt::KvtierdProcess d(dir);
  std::ofstream(dir / "tokens.toml") << "[[tenant]]\nname = \"a\"\nid = 1\ntoken_sha256 = [\""
                                     << TokenSha256Hex("token-a") << "\"]\n"
                                     << "[[tenant]]\nname = \"b\"\nid = 2\ntoken_sha256 = [\""
                                     << TokenSha256Hex("token-b") << "\"]\n";
  // The script's limits: keep in step with the constants at the top of resp_redis_py.py.
  d.WriteConfig(
      "[storage]\ndram_capacity_bytes = 67108864\nssd_capacity_bytes = 268435456\n"
      "ssd_segment_bytes = 16777216\ndurability = \"batched\"\n"
      "[limits]\nresp_multi_commands_max = 1000\nresp_multi_bytes_max = 4194304\n"
      "resp_keys_reply_bytes_max = 65536\nresp_scan_count_max = 1000\n"
      "[auth]\ntokens_file = \"" +
      (dir / "tokens.toml").string() + "\"\n");
  ASSERT_TRUE(d.Start()) << d.Log();
  std::string out;
  int rc =
      kt::RunShell("/usr/bin/python3 " KVTIER_SOURCE_DIR "/tests/e2e/resp_redis_py.py --port " +
                       std::to_string(d.resp_port()) + " --http-port " +
                       std::to_string(d.http_port()) + " --token-a token-a --token-b token-b",
                   &out);
  EXPECT_EQ(rc, 0) << out << "\n---- kvtierd log ----\n" << d.Log();
  std::printf("%s", out.c_str());
  EXPECT_EQ(d.Stop(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::daemon
