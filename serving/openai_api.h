// OpenAI-compatible request parsing and the error shape (docs/SERVING.md, "API").
//
// ParseCompletionRequest turns the JSON body of POST /v1/completions (chat = false) or
// POST /v1/chat/completions (chat = true) into a typed CompletionRequest, checking every known
// field's type and range (and first, without building anything, the body's JSON depth and
// value count: ApiLimits). Unknown fields are ignored (clients send many optional ones), except
// the few whose non-default values this server cannot honour (n != 1, logprobs, tools, ...),
// which are rejected so a client never silently gets less than it asked for.
//
// Errors come back as an ApiError whose ToJson() is OpenAI's
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
// with the HTTP status in `status` (400 invalid request, 401 bad key, 404 unknown model or
// route, 405 wrong method, 413 body too large, 429 queue full, 500/503 server).
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::serving {

struct ApiError {
  int status = 0;  // HTTP status; 0 = no error
  std::string message;
  std::string type;   // "invalid_request_error", "authentication_error", "server_error", ...
  std::string param;  // offending field; "" -> null
  std::string code;   // machine code ("context_length_exceeded", ...); "" -> null
  bool ok() const { return status == 0; }
  std::string ToJson() const;
};

ApiError InvalidRequest(std::string message, std::string param = "", std::string code = "");

struct ChatMessage {
  std::string role;  // system | developer | user | assistant | tool
  std::string content;
};

// Limits on what one request may ask for (named, documented in docs/SERVING.md).
struct ApiLimits {
  uint64_t max_tokens_max = 4096;   // largest max_tokens accepted
  uint64_t stop_sequences_max = 4;  // entries of `stop`
  uint64_t stop_bytes_max = 64;     // bytes of one stop string
  uint64_t messages_max = 1024;     // entries of `messages`
  uint64_t model_name_bytes_max = 256;
  // The body's JSON shape, checked before it is built into a tree: a tree costs up to about
  // 75 times its text (1 MiB of "[" is about 75 MB of nested arrays, one per connection
  // thread), so a deeper or larger body is refused unbuilt. A request that nests a message's
  // text parts is 4 levels deep and holds a few values per message.
  uint64_t json_depth_max = 64;      // open arrays and objects at once
  uint64_t json_values_max = 65536;  // values of every kind, containers included
};

struct CompletionRequest {
  bool chat = false;
  std::string model;
  std::vector<ChatMessage> messages;   // chat only
  std::string prompt;                  // completions only (the raw prompt text)
  std::optional<uint64_t> max_tokens;  // max_tokens or max_completion_tokens
  double temperature = 1.0;            // OpenAI's default; 0 = greedy
  double top_p = 1.0;
  std::optional<uint64_t> seed;  // int64 from JSON, kept as its two's-complement bits
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// Parses `body`. On error returns an ApiError with status 400 naming the field.
ApiError ParseCompletionRequest(std::string_view body, bool chat, const ApiLimits& limits,
                                CompletionRequest* out);

}  // namespace kvtier::serving
