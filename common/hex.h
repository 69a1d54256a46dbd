// One hex digit's value, for the parsers of hex text (chain keys, percent escapes).
#pragma once

namespace kvtier {

// 0..15 for '0'-'9', 'a'-'f' and 'A'-'F'; -1 for any other byte.
constexpr int HexDigitValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace kvtier
