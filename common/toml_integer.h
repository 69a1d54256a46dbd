// The integer value of a TOML node, for every config reader that takes an integer.
//
// toml++'s node::value<int64_t>() converts a float node by casting it to int64_t before it
// checks the range: a float beyond int64_t's range (1e92) is undefined behaviour there (found by
// kvtier_daemon_config_fuzz under UBSan). TomlInteger checks first.
#pragma once

#include <toml++/toml.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace kvtier {

// An integer node's value; a float node's value when it is a whole number within int64_t's
// range (as toml++'s own conversion accepts `3.0`); nullopt for anything else.
inline std::optional<int64_t> TomlInteger(const toml::node& n) {
  if (std::optional<int64_t> i = n.value_exact<int64_t>()) return i;
  std::optional<double> d = n.value_exact<double>();
  // [-2^63, 2^63): both bounds exact in a double.
  if (!d || !std::isfinite(*d) || *d < -0x1p63 || *d >= 0x1p63 || std::trunc(*d) != *d) {
    return std::nullopt;
  }
  return static_cast<int64_t>(*d);
}
// The same for a table lookup's view (nullopt when the key is absent).
template <typename V>
std::optional<int64_t> TomlInteger(const toml::node_view<V>& v) {
  return v.node() != nullptr ? TomlInteger(*v.node()) : std::nullopt;
}

}  // namespace kvtier
