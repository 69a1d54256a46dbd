#include "common/url_query.h"

#include "common/hex.h"

namespace kvtier {

std::optional<std::string> PercentDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out.push_back(' ');
    } else if (s[i] != '%') {
      out.push_back(s[i]);
    } else {
      if (i + 2 >= s.size()) return std::nullopt;
      const int a = HexDigitValue(s[i + 1]), b = HexDigitValue(s[i + 2]);
      if (a < 0 || b < 0) return std::nullopt;
      out.push_back(static_cast<char>(a * 16 + b));
      i += 2;
    }
  }
  return out;
}

std::string PercentEncode(std::string_view s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if ((b >= 'A' && b <= 'Z') || (b >= 'a' && b <= 'z') || (b >= '0' && b <= '9') || b == '-' ||
        b == '.' || b == '_' || b == '~') {
      out.push_back(c);
    } else {
      out.push_back('%');
      out.push_back(kHex[b >> 4]);
      out.push_back(kHex[b & 15]);
    }
  }
  return out;
}

}  // namespace kvtier
