// Checks the SGLang and vLLM compatibility modes against every case of
// ../shared/vectors/sglang_page_hash.json (made by third-party reference code, not by us).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/key_spec.h"
#include "tests/shared_dir.h"

namespace kvtier {
namespace {

using Json = nlohmann::json;

Json LoadVectors() {
  const std::string path = testing::SharedPath("vectors/sglang_page_hash.json");
  std::ifstream in(path);
  if (!in) return Json();
  return Json::parse(in, nullptr, /*allow_exceptions=*/false);
}

std::vector<uint32_t> Tokens(const Json& c) {
  std::vector<uint32_t> out;
  for (const Json& t : c.at("tokens")) out.push_back(t.get<uint32_t>());
  return out;
}

std::vector<uint8_t> Concat(const Digest* parent, std::span<const uint32_t> tokens) {
  std::vector<uint8_t> out;
  if (parent != nullptr) out.assign(parent->begin(), parent->end());
  for (uint32_t t : tokens) {
    for (int b = 0; b < 4; ++b) out.push_back(static_cast<uint8_t>(t >> (8 * b)));
  }
  return out;
}

class SharedVectors : public ::testing::Test {
 protected:
  void SetUp() override {
    vectors_ = LoadVectors();
    ASSERT_TRUE(vectors_.is_object())
        << "cannot read " << testing::SharedPath("vectors/sglang_page_hash.json");
  }
  Json vectors_;
};

TEST_F(SharedVectors, SglangPageHashEveryCase) {
  int cases = 0, pages_checked = 0;
  for (const Json& c : vectors_.at("cases")) {
    if (c.at("kind") != "sglang") continue;
    ++cases;
    const std::vector<uint32_t> tokens = Tokens(c);
    const size_t page_size = c.at("page_size").get<size_t>();
    const std::vector<Digest> got = SglangPageHashes(tokens, page_size);
    const Json& want = c.at("page_hashes");
    ASSERT_EQ(got.size(), want.size()) << "case " << cases;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(ToHex(got[i]), want[i].get<std::string>()) << "case " << cases << " page " << i;
      EXPECT_EQ(SglangEventInt64(got[i]), c.at("event_int64")[i].get<int64_t>())
          << "case " << cases << " page " << i;
      ++pages_checked;
    }
    const Json& pre = c.at("preimage_hex_first_pages");
    for (size_t i = 0; i < pre.size(); ++i) {
      const std::vector<uint8_t> mine = Concat(i == 0 ? nullptr : &got[i - 1],
                                               std::span(tokens).subspan(i * page_size, page_size));
      EXPECT_EQ(ToHex(mine), pre[i].get<std::string>()) << "case " << cases << " preimage " << i;
    }
  }
  EXPECT_GT(cases, 0);  // 24 in the shipped file; substitutes may differ
  EXPECT_GT(pages_checked, 0);
}

TEST_F(SharedVectors, VllmSha256CborEveryCase) {
  int cases = 0, blocks_checked = 0;
  for (const Json& c : vectors_.at("cases")) {
    if (c.at("kind") != "vllm_sha256_cbor") continue;
    ++cases;
    const std::vector<uint32_t> tokens = Tokens(c);
    const size_t block_size = c.at("block_size").get<size_t>();
    const Digest none = VllmNoneHash(c.at("pythonhashseed").get<std::string>());
    EXPECT_EQ(ToHex(none), c.at("none_hash").get<std::string>());
    std::optional<std::string> salt;
    if (!c.at("cache_salt").is_null()) salt = c.at("cache_salt").get<std::string>();
    const std::optional<std::string_view> salt_view =
        salt ? std::optional<std::string_view>(*salt) : std::nullopt;
    const std::vector<Digest> got = VllmBlockHashes(tokens, block_size, none, salt_view);
    const Json& want = c.at("block_hashes");
    ASSERT_EQ(got.size(), want.size()) << "case " << cases;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(ToHex(got[i]), want[i].get<std::string>()) << "case " << cases << " block " << i;
      EXPECT_EQ(VllmEventUint64(got[i]), c.at("event_uint64")[i].get<uint64_t>())
          << "case " << cases << " block " << i;
      ++blocks_checked;
    }
    const Json& pre = c.at("cbor_preimage_hex_first_blocks");
    for (size_t i = 0; i < pre.size(); ++i) {
      const std::vector<uint8_t> mine = VllmBlockPreimage(
          i == 0 ? none : got[i - 1], std::span(tokens).subspan(i * block_size, block_size),
          i == 0 ? salt_view : std::nullopt);
      EXPECT_EQ(ToHex(mine), pre[i].get<std::string>()) << "case " << cases << " preimage " << i;
    }
  }
  EXPECT_GT(cases, 0);  // 9 in the shipped file
  EXPECT_GT(blocks_checked, 0);
}

}  // namespace
}  // namespace kvtier
