// serving unit tests: request parsing and validation, the chat template, usage and cost, the
// API keys file, and /metrics text (promtool-clean when promtool is installed).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "serving/api_keys.h"
#include "serving/chat_template.h"
#include "serving/fair_share.h"
#include "serving/metrics.h"
#include "serving/openai_api.h"
#include "serving/usage.h"

namespace kvtier::serving {
namespace {

using nlohmann::json;

ApiError Parse(const std::string& body, bool chat, CompletionRequest* r = nullptr) {
  CompletionRequest tmp;
  return ParseCompletionRequest(body, chat, ApiLimits{}, r ? r : &tmp);
}

TEST(OpenAiApi, ParsesEveryKnownField) {
  CompletionRequest r;
  ApiError e = Parse(R"({"model":"m","messages":[{"role":"system","content":"s"},
      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
      {"role":"assistant","content":null}],
      "max_completion_tokens":7,"temperature":0.5,"top_p":0.9,"seed":-1,"stop":["x","yz"],
      "stream":true,"stream_options":{"include_usage":true},"n":1,"user":"ignored"})",
                     true, &r);
  ASSERT_TRUE(e.ok()) << e.ToJson();
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.max_tokens, 7u);
  EXPECT_EQ(r.temperature, 0.5);
  EXPECT_EQ(r.top_p, 0.9);
  EXPECT_EQ(r.seed, UINT64_MAX);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  ASSERT_TRUE(Parse(R"({"model":"m","prompt":["p"],"stop":"s"})", false, &r).ok());
  EXPECT_EQ(r.prompt, "p");
  EXPECT_EQ(r.stop, std::vector<std::string>{"s"});
  EXPECT_EQ(r.temperature, 1.0);  // OpenAI's default
}

TEST(OpenAiApi, RejectsWrongTypesAndRangesNamingTheField) {
  struct Case {
    std::string body;
    bool chat;
    std::string param, code;
  };
  const Case cases[] = {
      {"{", false, "", "invalid_json"},
      {"3", false, "", "invalid_json"},
      {R"({"prompt":"p"})", false, "model", "missing_field"},
      {R"({"model":1,"prompt":"p"})", false, "model", "invalid_type"},
      {R"({"model":"m"})", false, "prompt", "missing_field"},
      {R"({"model":"m","prompt":""})", false, "prompt", "invalid_value"},
      {R"({"model":"m","prompt":[1,2]})", false, "prompt", "invalid_type"},
      {R"({"model":"m","prompt":"p","max_tokens":0})", false, "max_tokens", "invalid_value"},
      {R"({"model":"m","prompt":"p","max_tokens":1.5})", false, "max_tokens", "invalid_type"},
      {R"({"model":"m","prompt":"p","max_tokens":99999999})", false, "max_tokens", "invalid_value"},
      {R"({"model":"m","prompt":"p","temperature":3})", false, "temperature", "invalid_value"},
      {R"({"model":"m","prompt":"p","temperature":"0"})", false, "temperature", "invalid_type"},
      {R"({"model":"m","prompt":"p","top_p":0})", false, "top_p", "invalid_value"},
      {R"({"model":"m","prompt":"p","seed":"1"})", false, "seed", "invalid_type"},
      {R"({"model":"m","prompt":"p","stop":["a","b","c","d","e"]})", false, "stop",
       "invalid_value"},
      {R"({"model":"m","prompt":"p","stop":[""]})", false, "stop", "invalid_value"},
      {R"({"model":"m","prompt":"p","stream":"yes"})", false, "stream", "invalid_type"},
      {R"({"model":"m","prompt":"p","stream_options":{"include_usage":1}})", false,
       "stream_options.include_usage", "invalid_type"},
      {R"({"model":"m","prompt":"p","n":2})", false, "n", "unsupported"},
      {R"({"model":"m","prompt":"p","logprobs":3})", false, "logprobs", "unsupported"},
      {R"({"model":"m","messages":[]})", true, "messages", "invalid_value"},
      {R"({"model":"m","messages":{}})", true, "messages", "invalid_type"},
      {R"({"model":"m","messages":[{"role":"wizard","content":"x"}]})", true, "messages[0].role",
       "invalid_value"},
      {R"({"model":"m","messages":[{"role":"user"}]})", true, "messages[0].content",
       "missing_field"},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})", true,
       "messages[0].content", "unsupported_content"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{}]})", true, "tools",
       "unsupported"},
      // Fields this server does not support, each of which would change the output: refused
      // with "unsupported", never ignored (SERVING.md lists them).
      {R"({"model":"m","prompt":"p","presence_penalty":0.5})", false, "presence_penalty",
       "unsupported"},
      {R"({"model":"m","prompt":"p","frequency_penalty":-1})", false, "frequency_penalty",
       "unsupported"},
      {R"({"model":"m","prompt":"p","frequency_penalty":"0"})", false, "frequency_penalty",
       "invalid_type"},
      {R"({"model":"m","prompt":"p","logit_bias":{"65":100}})", false, "logit_bias", "unsupported"},
      {R"({"model":"m","prompt":"p","logit_bias":[1]})", false, "logit_bias", "invalid_type"},
      {R"({"model":"m","prompt":"p","best_of":3})", false, "best_of", "unsupported"},
      {R"({"model":"m","prompt":"p","suffix":"end"})", false, "suffix", "unsupported"},
      {R"({"model":"m","prompt":"p","suffix":7})", false, "suffix", "invalid_type"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})", true,
       "top_logprobs", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true})", true,
       "logprobs", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],
          "response_format":{"type":"json_object"}})",
       true, "response_format", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"response_format":"text"})", true,
       "response_format", "invalid_type"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":"required"})", true,
       "tool_choice", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],
          "tool_choice":{"type":"function","function":{"name":"f"}}})",
       true, "tool_choice", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"functions":[{"name":"f"}]})",
       true, "functions", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"function_call":{"name":"f"}})",
       true, "function_call", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"modalities":["text","audio"]})",
       true, "modalities", "unsupported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"audio":{"voice":"x"}})", true,
       "audio", "unsupported"},
  };
  for (const Case& c : cases) {
    ApiError e = Parse(c.body, c.chat);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_EQ(e.code, c.code) << c.body;
    json j = json::parse(e.ToJson());
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_EQ(j["error"]["param"].is_null(), c.param.empty());
  }
}

// A body's JSON shape is bounded before it is built into a tree (each value of the tree costs
// tens of bytes; 1 MiB of "[" is about 75 MB of nested arrays): json_depth_max open containers
// at once and json_values_max values of every kind, wherever they are (an unknown field's too).
// At each limit the request parses; one more level or value is refused, naming the limit.
TEST(OpenAiApi, RefusesBodiesDeeperOrLargerThanItsJsonLimits) {
  ApiLimits limits;
  limits.json_depth_max = 8;
  limits.json_values_max = 40;
  auto parse = [&](const std::string& body) {
    CompletionRequest r;
    return ParseCompletionRequest(body, true, limits, &r);
  };
  // The top object, "messages" and one message are 3 levels; "x"'s arrays sit `levels` deep under
  // the top object.
  auto nested = [](int levels) {
    return R"({"model":"m","messages":[{"role":"user","content":"hi"}],"x":)" +
           std::string(levels, '[') + std::string(levels, ']') + "}";
  };
  EXPECT_TRUE(parse(nested(7)).ok()) << parse(nested(7)).ToJson();
  ApiError e = parse(nested(8));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "json_depth_max") << e.ToJson();
  // An unclosed body deeper than the limit is refused for its depth before it is found invalid.
  EXPECT_EQ(parse(R"({"model":"m","x":)" + std::string(100000, '[')).code, "json_depth_max");
  // 6 values (the object, "model", "messages", a message, its two strings), "x" and its items.
  auto wide = [](int items) {
    std::string b = R"({"model":"m","messages":[{"role":"user","content":"hi"}],"x":[)";
    for (int i = 0; i < items; ++i) b += i ? ",1" : "1";
    return b + "]}";
  };
  EXPECT_TRUE(parse(wide(33)).ok()) << parse(wide(33)).ToJson();
  e = parse(wide(34));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "json_values_max") << e.ToJson();
  // Invalid JSON within the limits is still reported as such.
  EXPECT_EQ(parse(R"({"model":"m",)").code, "invalid_json");
  // The defaults hold a request of 1024 messages with text parts.
  std::string big = R"({"model":"m","messages":[)";
  for (int i = 0; i < 1024; ++i)
    big += std::string(i ? "," : "") +
           R"({"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]})";
  EXPECT_TRUE(Parse(big + "]}", true).ok());
}

// The neutral values of the fields the server does not implement are what clients send by
// default (or explicitly): they are served.
TEST(OpenAiApi, AcceptsTheNeutralValuesOfFieldsItDoesNotImplement) {
  EXPECT_TRUE(Parse(R"({"model":"m","prompt":"p","presence_penalty":0,"frequency_penalty":0.0,
      "logit_bias":{},"best_of":1,"suffix":"","response_format":{"type":"text"},
      "modalities":["text"],"audio":null,"functions":[],"function_call":"none"})",
                    false)
                  .ok());
  EXPECT_TRUE(Parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "presence_penalty":null,"logit_bias":null,"top_logprobs":0,"logprobs":false,
      "tool_choice":"auto","tools":[],"parallel_tool_calls":true,"suffix":"ignored in chat"})",
                    true)
                  .ok());
}

TEST(ChatTemplate, AnAssistantTurnExtendsThePromptThatProducedIt) {
  std::vector<ChatMessage> m = {{"developer", "be brief"}, {"user", "hi"}};
  const std::string p1 = RenderChat(m);
  EXPECT_EQ(p1, "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n");
  m.push_back({"assistant", "hello"});
  m.push_back({"user", "more"});
  const std::string p2 = RenderChat(m);
  EXPECT_EQ(p2.rfind(p1 + "hello", 0), 0u);
}

TEST(Usage, FieldsAddUpAndCostUsesThreePrices) {
  Usage u{.prompt_tokens = 1000, .completion_tokens = 10, .cached_tokens = 768};
  auto j = UsageJson(u);
  EXPECT_EQ(j["prompt_tokens_details"]["cached_tokens"], 768);
  EXPECT_EQ(j["prompt_cache_hit_tokens"], 768);
  EXPECT_EQ(j["prompt_cache_miss_tokens"], 232);
  EXPECT_EQ(j["total_tokens"], 1010);
  Prices p{.input_per_mtok = 1, .cached_input_per_mtok = 0.02, .output_per_mtok = 2};
  EXPECT_DOUBLE_EQ(Cost(u, p), (232 * 1.0 + 768 * 0.02 + 10 * 2.0) / 1e6);
  EXPECT_EQ(Cost(u, Prices{}), 0);
}

TEST(ApiKeys, MapsKeysToTenantsAndRejectsBadFiles) {
  auto k = ApiKeys::Parse(R"({"keys":[
      {"key":"k1","tenant":"a","daemon_token":"ta","prices":{"input_per_mtok":1}},
      {"key":"k2","tenant":"a","daemon_token":"ta","prices":{"input_per_mtok":1}},
      {"key":"k3","tenant":"b"}]})");
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_TRUE(k->auth_enabled());
  ASSERT_NE(k->Find("Bearer k1"), nullptr);
  EXPECT_EQ(k->Find("Bearer k1"), k->Find("Bearer k2"));
  EXPECT_EQ(k->Find("Bearer k1")->daemon_token, "ta");
  EXPECT_EQ(k->Find("Bearer k3")->name, "b");
  EXPECT_EQ(k->Find("Bearer k4"), nullptr);
  EXPECT_EQ(k->Find("k1"), nullptr);
  EXPECT_EQ(k->Find(""), nullptr);
  for (const char* bad : {"", "{}", R"({"keys":[]})", R"({"keys":[{"key":"k"}]})",
                          R"({"keys":[{"key":"k","tenant":"a"},{"key":"k","tenant":"b"}]})",
                          R"({"keys":[{"key":"k","tenant":"a","prices":{"input_per_mtok":-1}}]})",
                          R"({"keys":[{"key":"k","tenant":"a","daemon_token":"x"},
                                      {"key":"j","tenant":"a","daemon_token":"y"}]})"}) {
    EXPECT_FALSE(ApiKeys::Parse(bad).ok()) << bad;
  }
  ApiKeys open = ApiKeys::Open("tok");
  EXPECT_EQ(open.Find("")->weight, 1u);
  EXPECT_FALSE(open.auth_enabled());
  ASSERT_NE(open.Find(""), nullptr);
  EXPECT_EQ(open.Find("Bearer whatever")->daemon_token, "tok");
}

TEST(ApiKeys, TenantWeights) {
  auto k = ApiKeys::Parse(R"({"keys":[{"key":"k1","tenant":"a","weight":3},
      {"key":"k2","tenant":"a","weight":3},{"key":"k3","tenant":"b"}]})");
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->Find("Bearer k2")->weight, 3u);
  EXPECT_EQ(k->Find("Bearer k3")->weight, 1u);  // the default
  for (const char* bad : {R"({"keys":[{"key":"k","tenant":"a","weight":0}]})",
                          R"({"keys":[{"key":"k","tenant":"a","weight":1001}]})",
                          R"({"keys":[{"key":"k","tenant":"a","weight":1.5}]})",
                          R"({"keys":[{"key":"k","tenant":"a","weight":"2"}]})",
                          R"({"keys":[{"key":"k","tenant":"a","weight":2},
                                      {"key":"j","tenant":"a","weight":3}]})"}) {
    EXPECT_FALSE(ApiKeys::Parse(bad).ok()) << bad;
  }
}

// FairShares: max-min fair by weight, work-conserving, and exact on average when a step's
// shares are fractional.
TEST(FairShares, SplitsByWeightAndCarriesRounding) {
  std::vector<double> credit;
  using V = std::vector<uint64_t>;
  const std::vector<uint32_t> w31 = {3, 1}, w11 = {1, 1};
  EXPECT_EQ(FairShares(V{100, 100}, w31, 8, &credit), (V{6, 2}));
  EXPECT_EQ(FairShares(V{100, 100}, w11, 8, &credit), (V{4, 4}));
  // A tenant wanting less than its share gets it all; the other takes the rest.
  EXPECT_EQ(FairShares(V{100, 1}, w11, 8, &credit), (V{7, 1}));
  EXPECT_EQ(FairShares(V{3, 100}, w31, 8, &credit), (V{3, 5}));
  // Every demand met: nothing more is given.
  EXPECT_EQ(FairShares(V{2, 3}, w11, 8, &credit), (V{2, 3}));
  EXPECT_EQ(FairShares(V{0, 5}, w11, 8, &credit), (V{0, 5}));
  EXPECT_EQ(FairShares(V{5, 5}, w11, 0, &credit), (V{0, 0}));
  // Fractional shares: weights 3:1 over a budget of 2 (and three tenants over 1) average out.
  credit.clear();
  uint64_t a = 0, b = 0;
  for (int step = 0; step < 100; ++step) {
    const V g = FairShares(V{100, 100}, w31, 2, &credit);
    ASSERT_EQ(g[0] + g[1], 2u);
    a += g[0];
    b += g[1];
  }
  EXPECT_EQ(a, 150u);
  EXPECT_EQ(b, 50u);
  credit.clear();
  V total(3, 0);
  for (int step = 0; step < 99; ++step) {
    const V g = FairShares(V{9, 9, 9}, std::vector<uint32_t>{1, 1, 1}, 1, &credit);
    for (size_t i = 0; i < 3; ++i) total[i] += g[i];
  }
  EXPECT_EQ(total, (V{33, 33, 33}));
}

TEST(Metrics, RenderIsPromtoolClean) {
  ServingMetrics m;
  m.HttpRequest(200);
  m.HttpRejected("body_bytes_max");
  m.RequestDone("al\"ice", Usage{100, 5, 64}, 0.5, "stop");
  m.Ttft(0.02);
  m.Tpot(0.003);
  m.Step(4, 4, 0);
  m.TenantStepTokens("al\"ice", 4);
  m.Resume(true, false);
  m.SwapOut();
  m.Gauges(1, 2, 3, 400);
  const std::string text = m.Render();
  EXPECT_NE(text.find("kvtier_serve_prompt_cache_hit_tokens_total{tenant=\"al\\\"ice\"} 64"),
            std::string::npos);
  EXPECT_NE(text.find("kvtier_serve_ttft_seconds_bucket{le=\"0.025\"} 1"), std::string::npos);
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) GTEST_SKIP() << "no promtool";
  const auto path = std::filesystem::temp_directory_path() /
                    ("kvtier_serve_metrics_" + std::to_string(getpid()) + ".txt");
  std::ofstream(path) << text;
  const std::string cmd = "promtool check metrics < " + path.string() + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof(buf), p)) out += buf;
  const int rc = pclose(p);
  std::filesystem::remove(path);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "") << out;
}

}  // namespace
}  // namespace kvtier::serving
