// Query strings of HTTP request targets ("a=1&b=x%20y"), as browsers, curl --data-urlencode -G
// and Python's urllib.parse.urlencode write them (application/x-www-form-urlencoded).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvtier {

// Decodes one name or value of a form-encoded query: '%' and two hex digits (either case) is the
// byte those digits spell, '+' is a space, every other byte stands for itself, so a value may
// decode to any bytes, NUL included. nullopt for a '%' not followed by two hex digits.
std::optional<std::string> PercentDecode(std::string_view s);

// The reverse: every byte but the unreserved ones (A-Z a-z 0-9 - . _ ~) as "%XX" (upper case),
// so any bytes make a value PercentDecode gives back.
std::string PercentEncode(std::string_view s);

}  // namespace kvtier
