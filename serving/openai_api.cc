#include "serving/openai_api.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/json_limits.h"

namespace kvtier::serving {
namespace {

using json = nlohmann::json;

json NullOr(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

std::string TypeName(const json& v) { return v.type_name(); }

ApiError WrongType(const std::string& field, const char* want, const json& got) {
  return InvalidRequest("'" + field + "' must be " + want + ", got " + TypeName(got), field,
                        "invalid_type");
}

// Optional number field in [lo, hi]; absent or null leaves *out alone.
ApiError Number(const json& j, const char* field, double lo, double hi, double* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_number()) return WrongType(field, "a number", *it);
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < lo || v > hi) {
    return InvalidRequest("'" + std::string(field) + "' must be in [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "]",
                          field, "invalid_value");
  }
  *out = v;
  return {};
}

ApiError Bool(const json& j, const char* field, bool* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_boolean()) return WrongType(field, "a boolean", *it);
  *out = it->get<bool>();
  return {};
}

// Text content of a message: a string, null (empty), or an array of {"type":"text","text":..}.
ApiError Content(const json& v, const std::string& param, std::string* out) {
  if (v.is_null()) return {};
  if (v.is_string()) {
    *out = v.get<std::string>();
    return {};
  }
  if (!v.is_array()) return WrongType(param, "a string or an array of text parts", v);
  for (const json& part : v) {
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
        !part.contains("text") || !part["text"].is_string()) {
      return InvalidRequest(
          "only text content parts ({\"type\":\"text\",\"text\":...}) are "
          "supported",
          param, "unsupported_content");
    }
    *out += part["text"].get<std::string>();
  }
  return {};
}

ApiError Stop(const json& j, const ApiLimits& limits, std::vector<std::string>* out) {
  auto it = j.find("stop");
  if (it == j.end() || it->is_null()) return {};
  std::vector<std::string> stops;
  if (it->is_string()) {
    stops.push_back(it->get<std::string>());
  } else if (it->is_array()) {
    for (const json& s : *it) {
      if (!s.is_string()) return WrongType("stop", "a string or an array of strings", s);
      stops.push_back(s.get<std::string>());
    }
  } else {
    return WrongType("stop", "a string or an array of strings", *it);
  }
  if (stops.size() > limits.stop_sequences_max)
    return InvalidRequest(
        "at most " + std::to_string(limits.stop_sequences_max) + " stop sequences", "stop",
        "invalid_value");
  for (const std::string& s : stops) {
    if (s.empty() || s.size() > limits.stop_bytes_max)
      return InvalidRequest(
          "a stop sequence must have 1.." + std::to_string(limits.stop_bytes_max) + " bytes",
          "stop", "invalid_value");
  }
  *out = std::move(stops);
  return {};
}

// OpenAI fields that change what the model returns and that this server does not implement:
// absent, null or their neutral value pass (a client that sends the defaults is served); any
// other value is refused as "unsupported" naming the field, so that no client silently gets
// less than it asked for. A value of the wrong type is "invalid_type", as for every field.
ApiError Unhonoured(const json& j, bool chat) {
  for (const char* field : {"presence_penalty", "frequency_penalty"}) {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_number()) return WrongType(field, "a number", *it);
    if (it->get<double>() != 0)
      return InvalidRequest(std::string(field) + " is not supported", field, "unsupported");
  }
  if (auto it = j.find("logit_bias"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType("logit_bias", "an object", *it);
    if (!it->empty())
      return InvalidRequest("logit_bias is not supported", "logit_bias", "unsupported");
  }
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType("response_format", "an object", *it);
    auto type = it->find("type");
    if (type == it->end() || !type->is_string() || *type != "text")
      return InvalidRequest("only response_format {\"type\": \"text\"} is supported",
                            "response_format", "unsupported");
  }
  // Tool calling: only its neutral settings (no tools: "none" or "auto" chooses none).
  for (const char* field : {"tool_choice", "function_call"}) {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string() || (*it != "none" && *it != "auto"))
      return InvalidRequest(
          std::string(field) + " other than \"none\" or \"auto\" is not supported", field,
          "unsupported");
  }
  if (auto it = j.find("functions"); it != j.end() && !it->is_null() && !it->empty())
    return InvalidRequest("functions are not supported", "functions", "unsupported");
  if (auto it = j.find("audio"); it != j.end() && !it->is_null())
    return InvalidRequest("audio output is not supported", "audio", "unsupported");
  if (auto it = j.find("modalities"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return WrongType("modalities", "an array", *it);
    for (const json& m : *it) {
      if (m != "text")
        return InvalidRequest("only the \"text\" modality is supported", "modalities",
                              "unsupported");
    }
  }
  if (chat) {
    if (auto it = j.find("top_logprobs"); it != j.end() && !it->is_null()) {
      if (!it->is_number_integer()) return WrongType("top_logprobs", "an integer", *it);
      if (it->get<int64_t>() != 0)
        return InvalidRequest("logprobs are not supported", "top_logprobs", "unsupported");
    }
    return {};
  }
  if (auto it = j.find("best_of"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return WrongType("best_of", "an integer", *it);
    if (it->get<int64_t>() != 1)
      return InvalidRequest("only best_of = 1 is supported", "best_of", "unsupported");
  }
  if (auto it = j.find("suffix"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return WrongType("suffix", "a string", *it);
    if (!it->get_ref<const std::string&>().empty())
      return InvalidRequest("suffix is not supported", "suffix", "unsupported");
  }
  return {};
}

}  // namespace

ApiError InvalidRequest(std::string message, std::string param, std::string code) {
  ApiError e;
  e.status = 400;
  e.message = std::move(message);
  e.type = "invalid_request_error";
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

std::string ApiError::ToJson() const {
  nlohmann::ordered_json e = {
      {"message", message}, {"type", type}, {"param", NullOr(param)}, {"code", NullOr(code)}};
  return nlohmann::ordered_json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

ApiError ParseCompletionRequest(std::string_view body, bool chat, const ApiLimits& limits,
                                CompletionRequest* out) {
  *out = CompletionRequest{};
  out->chat = chat;
  const JsonLimitBreach breach =
      JsonWithinLimits<json>(body, limits.json_depth_max, limits.json_values_max);
  if (breach == JsonLimitBreach::kDepth)
    return InvalidRequest("the body nests arrays and objects deeper than " +
                              std::to_string(limits.json_depth_max) + " levels",
                          "", "json_depth_max");
  if (breach == JsonLimitBreach::kValues)
    return InvalidRequest(
        "the body holds more than " + std::to_string(limits.json_values_max) + " JSON values", "",
        "json_values_max");
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidRequest("the body is not valid JSON", "", "invalid_json");
  if (!j.is_object()) return InvalidRequest("the body must be a JSON object", "", "invalid_json");

  auto model = j.find("model");
  if (model == j.end()) return InvalidRequest("'model' is required", "model", "missing_field");
  if (!model->is_string()) return WrongType("model", "a string", *model);
  out->model = model->get<std::string>();
  if (out->model.size() > limits.model_name_bytes_max)
    return InvalidRequest("'model' is too long", "model", "invalid_value");

  if (chat) {
    auto msgs = j.find("messages");
    if (msgs == j.end())
      return InvalidRequest("'messages' is required", "messages", "missing_field");
    if (!msgs->is_array()) return WrongType("messages", "an array", *msgs);
    if (msgs->empty() || msgs->size() > limits.messages_max)
      return InvalidRequest(
          "'messages' must have 1.." + std::to_string(limits.messages_max) + " entries", "messages",
          "invalid_value");
    for (size_t i = 0; i < msgs->size(); ++i) {
      const json& m = (*msgs)[i];
      const std::string param = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) return WrongType(param, "an object", m);
      auto role = m.find("role");
      if (role == m.end() || !role->is_string())
        return InvalidRequest(param + ".role must be a string", param + ".role", "invalid_type");
      ChatMessage cm;
      cm.role = role->get<std::string>();
      if (cm.role != "system" && cm.role != "developer" && cm.role != "user" &&
          cm.role != "assistant" && cm.role != "tool") {
        return InvalidRequest(param + ".role must be system, developer, user, assistant or tool",
                              param + ".role", "invalid_value");
      }
      auto content = m.find("content");
      if (content == m.end() && cm.role != "assistant")
        return InvalidRequest(param + ".content is required", param + ".content", "missing_field");
      if (content != m.end()) {
        ApiError e = Content(*content, param + ".content", &cm.content);
        if (!e.ok()) return e;
      }
      out->messages.push_back(std::move(cm));
    }
  } else {
    auto prompt = j.find("prompt");
    if (prompt == j.end()) return InvalidRequest("'prompt' is required", "prompt", "missing_field");
    if (prompt->is_string()) {
      out->prompt = prompt->get<std::string>();
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
      out->prompt = (*prompt)[0].get<std::string>();
    } else {
      return WrongType("prompt", "a string (or an array of one string)", *prompt);
    }
    if (out->prompt.empty())
      return InvalidRequest("'prompt' must not be empty", "prompt", "invalid_value");
  }

  for (const char* field : {"max_tokens", "max_completion_tokens"}) {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_number_integer()) return WrongType(field, "an integer", *it);
    const int64_t v = it->get<int64_t>();
    if (v < 1 || static_cast<uint64_t>(v) > limits.max_tokens_max)
      return InvalidRequest("'" + std::string(field) + "' must be in [1, " +
                                std::to_string(limits.max_tokens_max) + "]",
                            field, "invalid_value");
    out->max_tokens = static_cast<uint64_t>(v);
  }
  if (ApiError e = Number(j, "temperature", 0.0, 2.0, &out->temperature); !e.ok()) return e;
  if (ApiError e = Number(j, "top_p", 0.0, 1.0, &out->top_p); !e.ok()) return e;
  if (out->top_p <= 0.0)
    return InvalidRequest("'top_p' must be in (0, 1]", "top_p", "invalid_value");
  if (auto it = j.find("seed"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return WrongType("seed", "an integer", *it);
    out->seed =
        it->is_number_unsigned() ? it->get<uint64_t>() : static_cast<uint64_t>(it->get<int64_t>());
  }
  if (ApiError e = Stop(j, limits, &out->stop); !e.ok()) return e;
  if (ApiError e = Bool(j, "stream", &out->stream); !e.ok()) return e;
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType("stream_options", "an object", *it);
    if (ApiError e = Bool(*it, "include_usage", &out->include_usage); !e.ok()) {
      e.param = "stream_options.include_usage";
      return e;
    }
  }
  // Fields whose non-default values this server cannot honour.
  if (auto it = j.find("n"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return WrongType("n", "an integer", *it);
    if (it->get<int64_t>() != 1)
      return InvalidRequest("only n = 1 is supported", "n", "unsupported");
  }
  for (const char* field : {"logprobs", "echo"}) {
    bool v = false;
    auto it = j.find(field);
    if (it != j.end() && it->is_number_integer() && std::string(field) == "logprobs" && !chat) {
      if (it->get<int64_t>() != 0)
        return InvalidRequest("logprobs are not supported", field, "unsupported");
      continue;
    }
    if (ApiError e = Bool(j, field, &v); !e.ok()) return e;
    if (v) return InvalidRequest(std::string(field) + " is not supported", field, "unsupported");
  }
  if (auto it = j.find("tools"); it != j.end() && !it->is_null() && !it->empty())
    return InvalidRequest("tools are not supported", "tools", "unsupported");
  return Unhonoured(j, chat);
}

}  // namespace kvtier::serving
