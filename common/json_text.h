// JSON text for output. nlohmann::json's dump() throws on a string that is not UTF-8, and the
// strings that reach a report are often not ours to vouch for: file paths, names typed on a
// command line, a model file's metadata. JsonText writes U+FFFD for each byte that is not UTF-8
// instead, so a report about a file whose name is not UTF-8 is printed, not an abort.
#pragma once

#include <string>

namespace kvtier {

// `indent` < 0: one line; otherwise pretty-printed with that many spaces per level.
template <typename Json>
std::string JsonText(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

}  // namespace kvtier
