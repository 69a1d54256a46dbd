#include "common/kv_layout.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "common/shipped_models.h"

namespace kvtier {
namespace {

using Json = nlohmann::json;

Json Mini() { return Json::parse(FindShippedModel("mini-v4.1")->config_json); }

StatusOr<KvLayout> Parse(const Json& j, uint32_t unit_tokens = 64) {
  return ParseKvLayout(j.dump(), KvLayoutOptions{.unit_tokens = unit_tokens});
}

TEST(KvLayout, RealFlashConfigGives890BytesPerToken) {
  const ShippedModel* m = FindShippedModel("deepseek-v4.1-flash");
  ASSERT_NE(m, nullptr);
  StatusOr<KvLayout> l = ParseKvLayout(m->config_json, KvLayoutOptions{.unit_tokens = 64});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_DOUBLE_EQ(l->bytes_per_token, 890.0);
  EXPECT_DOUBLE_EQ(l->main_bytes_per_token, 720.0);
  EXPECT_DOUBLE_EQ(l->index_bytes_per_token, 170.0);
  ASSERT_EQ(l->sources.size(), 4u);
  EXPECT_EQ(l->sources[0].main_entry_bytes, 288u);
  EXPECT_EQ(l->sources[0].index_entry_bytes, 68u);
  EXPECT_EQ(l->sources[3].layer_id, 20u);
  EXPECT_EQ(l->sources[3].compress_ratio, 1u);
  EXPECT_EQ(l->sources[0].entries_per_unit, 32u);
  EXPECT_EQ(l->bytes_per_unit, 890u * 64);
}

TEST(KvLayout, MiniConfigGives222_5BytesPerTokenAnd14240PerUnit) {
  StatusOr<KvLayout> l = Parse(Mini());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_DOUBLE_EQ(l->bytes_per_token, 222.5);
  EXPECT_EQ(l->bytes_per_unit, 14240u);
  EXPECT_EQ(l->main_bytes_per_unit, 3u * 32 * 72 + 64 * 72);
  EXPECT_EQ(l->index_bytes_per_unit, 3u * 32 * 17 + 64 * 17);
  EXPECT_EQ(l->unit_tokens, 64u);
  // Other unit sizes scale linearly.
  StatusOr<KvLayout> l16 = Parse(Mini(), 16);
  ASSERT_TRUE(l16.ok());
  EXPECT_EQ(l16->bytes_per_unit, 14240u / 4);
}

TEST(KvLayout, AcceptsKeysNestedUnderTextConfig) {
  Json nested = {{"model_type", "x"}, {"text_config", Mini()}};
  StatusOr<KvLayout> a = Parse(nested);
  StatusOr<KvLayout> b = Parse(Mini());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->CanonicalDescription(), b->CanonicalDescription());
  EXPECT_EQ(a->LayoutId(), b->LayoutId());
}

TEST(KvLayout, LayoutIdSeparatesLayouts) {
  StatusOr<KvLayout> a = Parse(Mini(), 64);
  StatusOr<KvLayout> b = Parse(Mini(), 32);
  Json other = Mini();
  other["head_dim"] = 256;
  StatusOr<KvLayout> c = Parse(other);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(a->LayoutId(), b->LayoutId());
  EXPECT_NE(a->LayoutId(), c->LayoutId());
  EXPECT_EQ(a->CanonicalDescription(),
            "kvtier.kv_layout.v1;unit_tokens=64;main=fp4_e2m1+e4m3x16:128;"
            "index=fp4_e2m1+ue8m0x32:32;sources=2/2,4/2,6/2,8/1");
}

// Each bad config must be InvalidArgument with the offending key in the message.
void ExpectBad(const Json& j, const std::string& key_in_message, uint32_t unit_tokens = 64) {
  StatusOr<KvLayout> l = Parse(j, unit_tokens);
  ASSERT_FALSE(l.ok()) << j.dump();
  EXPECT_TRUE(l.status().IsInvalidArgument()) << l.status().ToString();
  EXPECT_NE(l.status().message().find(key_in_message), std::string::npos) << l.status().ToString();
}

TEST(KvLayout, RejectsBadConfigsNamingTheKey) {
  for (const char* key : {"num_hidden_layers", "head_dim", "index_head_dim", "compress_ratios",
                          "kv_source_layer_ids"}) {
    Json j = Mini();
    j.erase(key);
    ExpectBad(j, key);
    j = Mini();
    j[key] = "sixty-four";
    ExpectBad(j, key);
  }
  Json j = Mini();
  j["head_dim"] = -128;
  ExpectBad(j, "head_dim");
  j = Mini();
  j["head_dim"] = 128.5;
  ExpectBad(j, "head_dim");
  j = Mini();
  j["head_dim"] = 120;  // not a multiple of 16
  ExpectBad(j, "head_dim");
  j = Mini();
  j["index_head_dim"] = 48;  // not a multiple of 32
  ExpectBad(j, "index_head_dim");
  j = Mini();
  j["compress_ratios"].push_back(0);  // length vs layers
  ExpectBad(j, "compress_ratios");
  j = Mini();
  j["compress_ratios"][3] = "2";
  ExpectBad(j, "compress_ratios");
  j = Mini();
  j["kv_source_layer_ids"] = {2, 4, 6, 16};  // out of range (16 layers)
  ExpectBad(j, "kv_source_layer_ids");
  j = Mini();
  j["kv_source_layer_ids"] = {2, 4, 4, 8};  // duplicate
  ExpectBad(j, "kv_source_layer_ids");
  j = Mini();
  j["kv_source_layer_ids"] = {0, 4};  // ratio 0 at layer 0
  ExpectBad(j, "kv_source_layer_ids");
  j = Mini();
  j["kv_source_layer_ids"] = Json::array();
  ExpectBad(j, "kv_source_layer_ids");
  j = Mini();
  j["text_config"] = 5;
  ExpectBad(j, "text_config");
  ExpectBad(Mini(), "unit_tokens", 63);  // odd
  ExpectBad(Mini(), "unit_tokens", 0);
  j = Mini();
  j["compress_ratios"][2] = 4;
  ExpectBad(j, "unit_tokens", 6);  // 6 not divisible by 4
  EXPECT_TRUE(ParseKvLayout("{not json", {}).status().IsInvalidArgument());
  EXPECT_TRUE(ParseKvLayout("[1,2]", {}).status().IsInvalidArgument());
  EXPECT_TRUE(ParseKvLayout("", {}).status().IsInvalidArgument());
}

TEST(KvLayout, LoadReportsMissingFileAsIOError) {
  StatusOr<KvLayout> l = LoadKvLayout("/nonexistent/kvtier/config.json", {});
  EXPECT_TRUE(l.status().IsIOError()) << l.status().ToString();
}

TEST(KvLayout, MakeKvLayoutMatchesParsing) {
  StatusOr<KvLayout> a =
      MakeKvLayout(128, 32, {0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 4, 6, 8}, 64);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->LayoutId(), Parse(Mini())->LayoutId());
  EXPECT_DOUBLE_EQ(a->bytes_per_token, 222.5);
}

}  // namespace
}  // namespace kvtier
