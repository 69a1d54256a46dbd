// libFuzzer target: the OpenAI request parser (serving/openai_api.h) and the chat template,
// with small limits so that limit paths are reached. The first byte picks chat or completions.
// Invariants: no crash or undefined behaviour; an accepted request is within every limit and
// range docs/SERVING.md promises, and its rendered chat ends with the assistant header; a
// refused one is a 400 with a message and a type, whose ToJson() is valid JSON in OpenAI's
// error shape.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "serving/chat_template.h"
#include "serving/openai_api.h"
#include "tests/fuzz/fuzz_require.h"

using namespace kvtier::serving;

namespace {

using kvtier::fuzz::Require;

bool EndsWith(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  ApiLimits limits;
  limits.max_tokens_max = 64;
  limits.stop_sequences_max = 2;
  limits.stop_bytes_max = 4;
  limits.messages_max = 3;
  limits.model_name_bytes_max = 8;
  CompletionRequest r;
  const ApiError e = ParseCompletionRequest(body, chat, limits, &r);
  if (!e.ok()) {
    Require(e.status == 400 && !e.message.empty() && !e.type.empty());
    const nlohmann::json j = nlohmann::json::parse(e.ToJson(), nullptr, false);
    Require(!j.is_discarded() && j.is_object() && j.size() == 1 && j.contains("error"));
    const nlohmann::json& err = j["error"];
    Require(err.is_object() && err.contains("message") && err["message"].is_string() &&
            err.contains("type") && err["type"].is_string() && err.contains("param") &&
            (err["param"].is_null() || err["param"].is_string()) && err.contains("code") &&
            (err["code"].is_null() || err["code"].is_string()));
    return 0;
  }
  Require(r.chat == chat);
  Require(r.model.size() <= limits.model_name_bytes_max);
  if (chat) {
    Require(!r.messages.empty() && r.messages.size() <= limits.messages_max && r.prompt.empty());
    for (const ChatMessage& m : r.messages) {
      Require(m.role == "system" || m.role == "developer" || m.role == "user" ||
              m.role == "assistant" || m.role == "tool");
    }
    Require(EndsWith(RenderChat(r.messages), kAssistantHeader));
  } else {
    Require(r.messages.empty() && !r.prompt.empty());
  }
  if (r.max_tokens) Require(*r.max_tokens >= 1 && *r.max_tokens <= limits.max_tokens_max);
  Require(r.temperature >= 0.0 && r.temperature <= 2.0);
  Require(r.top_p > 0.0 && r.top_p <= 1.0);
  Require(r.stop.size() <= limits.stop_sequences_max);
  for (const std::string& s : r.stop) Require(!s.empty() && s.size() <= limits.stop_bytes_max);
  return 0;
}
