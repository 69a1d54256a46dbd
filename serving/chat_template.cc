#include "serving/chat_template.h"

namespace kvtier::serving {

std::string RenderChat(std::span<const ChatMessage> messages) {
  std::string out;
  for (const ChatMessage& m : messages) {
    out += "<|";
    out += m.role == "developer" ? std::string_view("system") : std::string_view(m.role);
    out += "|>\n";
    out += m.content;
    out += kEndOfMessage;
  }
  out += kAssistantHeader;
  return out;
}

}  // namespace kvtier::serving
