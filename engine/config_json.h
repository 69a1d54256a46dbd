// Strict reading of config.json values (engine/config.cc, engine/dspark.cc): a key whose type
// is an integer takes only a JSON integer within that type's range, so that 64.5 or 2^32 + 64
// is refused instead of truncated or wrapped into a size that passes the limit checks; a
// floating-point key takes any JSON number; a bool key only true or false; a vector key an
// array of such values; a string key a string.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvtier::engine::internal {

template <typename T>
struct IsVector : std::false_type {};
template <typename U>
struct IsVector<std::vector<U>> : std::true_type {};

// Whether `v` holds a T (as above); writes it to *out only then (a vector may be left
// partly filled when an element is refused).
template <typename T>
bool ReadJsonValue(const nlohmann::json& v, T* out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return false;
    *out = v.get<bool>();
    return true;
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return false;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (!std::in_range<T>(u)) return false;
      *out = static_cast<T>(u);
    } else {
      const int64_t s = v.get<int64_t>();
      if (!std::in_range<T>(s)) return false;
      *out = static_cast<T>(s);
    }
    return true;
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return false;
    *out = v.get<T>();
    return true;
  } else if constexpr (IsVector<T>::value) {
    if (!v.is_array()) return false;
    out->clear();
    for (const nlohmann::json& e : v) {
      typename T::value_type x{};
      if (!ReadJsonValue(e, &x)) return false;
      out->push_back(std::move(x));
    }
    return true;
  } else {
    static_assert(std::is_same_v<T, std::string>, "ReadJsonValue: unsupported type");
    if (!v.is_string()) return false;
    *out = v.get<std::string>();
    return true;
  }
}

}  // namespace kvtier::engine::internal
