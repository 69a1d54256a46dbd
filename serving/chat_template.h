// The chat template of the byte-tokenized miniature (docs/SERVING.md, "Chat template").
//
// A conversation is rendered as plain text (the byte tokenizer has no special ids for roles):
//   for each message:  "<|" role "|>\n" content "<|end|>\n"
//   then:              "<|assistant|>\n"
// ("developer" is rendered as "system"). The model's reply follows and ends with eos or a
// stop. Because an assistant message is rendered exactly as the prompt that produced it plus
// its content, the next turn's prompt starts with every token of the previous turn
// (prompt + reply bytes): a continuation shares its whole prefix with the saved session.
//
// Thread safety: pure functions.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "serving/openai_api.h"

namespace kvtier::serving {

inline constexpr std::string_view kEndOfMessage = "<|end|>\n";
inline constexpr std::string_view kAssistantHeader = "<|assistant|>\n";

std::string RenderChat(std::span<const ChatMessage> messages);

}  // namespace kvtier::serving
