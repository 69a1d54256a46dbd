#include "cli/daemon_reply.h"

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>

namespace kvtier::cli {
namespace {

using json = nlohmann::json;

// The value at path in j, or nullptr when some step is missing or not an object.
const json* At(const json& j, std::initializer_list<const char*> path) {
  const json* at = &j;
  for (const char* key : path) {
    if (!at->is_object()) return nullptr;
    auto it = at->find(key);
    if (it == at->end()) return nullptr;
    at = &*it;
  }
  return at;
}

unsigned long long Count(const json& j, std::initializer_list<const char*> path) {
  const json* v = At(j, path);
  return v != nullptr && v->is_number_unsigned() ? v->get<unsigned long long>() : 0;
}

std::string Name(const json& j, std::initializer_list<const char*> path) {
  const json* v = At(j, path);
  return v != nullptr && v->is_string() ? v->get<std::string>() : "?";
}

StatusOr<json> Object(std::string_view reply, const char* what) {
  json j = json::parse(reply, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption(std::string(what) + " reply is not a JSON object");
  }
  return j;
}

std::string Line(const char* format, auto... args) {
  char buf[512];
  int n = std::snprintf(buf, sizeof(buf), format, args...);
  return std::string(buf, n < 0 ? 0 : std::min<size_t>(static_cast<size_t>(n), sizeof(buf) - 1));
}

}  // namespace

StatusOr<std::string> FormatStats(std::string_view reply) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(reply, "stats"));
  std::string out = Line("%-5s %14s %14s %10s %12s %10s\n", "tier", "used_bytes", "capacity",
                         "objects", "hits", "evictions");
  for (const char* t : {"hbm", "dram", "ssd"}) {
    out +=
        Line("%-5s %14llu %14llu %10llu %12llu %10llu\n", t, Count(j, {"tiers", t, "used_bytes"}),
             Count(j, {"tiers", t, "capacity_bytes"}), Count(j, {"tiers", t, "objects"}),
             Count(j, {"tiers", t, "hits"}), Count(j, {"tiers", t, "evictions"}));
  }
  out += Line("misses: never_stored=%llu evicted=%llu expired=%llu checksum=%llu\n",
              Count(j, {"misses", "never_stored"}), Count(j, {"misses", "evicted"}),
              Count(j, {"misses", "expired"}), Count(j, {"misses", "checksum_failure"}));
  out += "policy: eviction=" + Name(j, {"policy", "eviction"}) +
         " admission=" + Name(j, {"policy", "admission"}) + "\n";
  if (const json* tenants = At(j, {"tenant_bytes"}); tenants != nullptr && tenants->is_object()) {
    for (const auto& [name, bytes] : tenants->items()) {
      out += "tenant " + name + ": " +
             std::to_string(bytes.is_number_unsigned() ? bytes.get<unsigned long long>() : 0) +
             " bytes\n";
    }
  }
  return out;
}

StatusOr<std::string> FormatPolicy(std::string_view reply) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(reply, "policy"));
  const json* params = At(j, {"params"});
  // The reply was parsed, so its strings are valid UTF-8 and dump() cannot throw.
  return "eviction=" + Name(j, {"eviction"}) + " admission=" + Name(j, {"admission"}) +
         " params=" + (params != nullptr ? params->dump() : std::string("null")) + "\n";
}

}  // namespace kvtier::cli
