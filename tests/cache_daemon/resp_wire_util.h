// Test helpers: RESP2 requests as a client writes them (arrays of bulk strings).
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

namespace kvtier::testing {

// One command as a RESP array of bulk strings: Cmd({"SET", "k", "v"}).
inline std::string Cmd(std::initializer_list<std::string_view> args) {
  std::string s = "*" + std::to_string(args.size()) + "\r\n";
  for (std::string_view a : args) {
    s += "$" + std::to_string(a.size()) + "\r\n";
    s += a;
    s += "\r\n";
  }
  return s;
}

// A bulk-string reply (or argument) as it appears on the wire.
inline std::string Bulk(std::string_view v) {
  return "$" + std::to_string(v.size()) + "\r\n" + std::string(v) + "\r\n";
}

}  // namespace kvtier::testing
