#include "policies/internal/params.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kvtier::policies::internal {

const std::string* ParamReader::Lookup(std::string_view key) {
  known_.emplace(key);
  if (params_.keys_read != nullptr) params_.keys_read->emplace_back(key);
  const std::string* found = nullptr;
  for (const auto& [k, v] : params_.values) {
    if (k == key) found = &v;  // the last occurrence wins
  }
  return found;
}

Status ParamReader::Uint(std::string_view key, uint64_t* out, uint64_t min, uint64_t max) {
  const std::string* v = Lookup(key);
  if (v == nullptr) return Status::Ok();
  uint64_t parsed = 0;
  auto [ptr, ec] = std::from_chars(v->data(), v->data() + v->size(), parsed);
  if (ec != std::errc() || ptr != v->data() + v->size() || v->empty()) {
    return Status::InvalidArgument(policy_ + ": " + std::string(key) +
                                   " wants an unsigned integer, got '" + *v + "'");
  }
  if (parsed < min || parsed > max) {
    return Status::InvalidArgument(policy_ + ": " + std::string(key) + "=" + *v +
                                   " is out of range [" + std::to_string(min) + ", " +
                                   std::to_string(max) + "]");
  }
  *out = parsed;
  return Status::Ok();
}

Status ParamReader::Double(std::string_view key, double* out, double min, double max) {
  const std::string* v = Lookup(key);
  if (v == nullptr) return Status::Ok();
  char* end = nullptr;
  double parsed = std::strtod(v->c_str(), &end);
  if (v->empty() || end != v->c_str() + v->size() || !std::isfinite(parsed)) {
    return Status::InvalidArgument(policy_ + ": " + std::string(key) + " wants a number, got '" +
                                   *v + "'");
  }
  if (parsed < min || parsed > max) {
    return Status::InvalidArgument(policy_ + ": " + std::string(key) + "=" + *v +
                                   " is out of range");
  }
  *out = parsed;
  return Status::Ok();
}

Status ParamReader::Bool(std::string_view key, bool* out) {
  const std::string* v = Lookup(key);
  if (v == nullptr) return Status::Ok();
  if (*v == "1" || *v == "true") {
    *out = true;
  } else if (*v == "0" || *v == "false") {
    *out = false;
  } else {
    return Status::InvalidArgument(policy_ + ": " + std::string(key) + " wants 0/1/true/false");
  }
  return Status::Ok();
}

Status ParamReader::Finish() const {
  for (const auto& [k, v] : params_.values) {
    if (known_.find(k) == known_.end()) {
      return Status::InvalidArgument(policy_ + " has no parameter '" + k + "'");
    }
  }
  return Status::Ok();
}

}  // namespace kvtier::policies::internal
