// API keys: which tenant a request belongs to (docs/SERVING.md, "API keys").
//
// The keys file is JSON (at most kApiKeysFileBytesMax bytes):
//   {"keys": [{"key": "sk-...", "tenant": "alice", "daemon_token": "alice-token",
//              "prices": {"input_per_mtok": 0.28, "cached_input_per_mtok": 0.028,
//                         "output_per_mtok": 0.42}, "weight": 2}, ...]}
// `key` is what clients send as "Authorization: Bearer <key>"; `daemon_token` is the tenant's
// kvtierd token, so the daemon keeps each tenant's units apart (one customer's cache never
// serves another's). Several keys may name the same tenant (they must then agree on its
// token, prices and weight). `prices` is optional; `weight` (1..kTenantWeightMax, default 1)
// is the tenant's share of admission and of each step's tokens (fair_share.h).
//
// Thread safety: an ApiKeys is immutable after loading; Find may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "serving/scheduler.h"

namespace kvtier::serving {

inline constexpr uint64_t kApiKeysFileBytesMax = 1 << 20;
inline constexpr size_t kApiKeyBytesMax = 256;

class ApiKeys {
 public:
  // No keys: every request is tenant "default" with `daemon_token` (auth off).
  static ApiKeys Open(const std::string& daemon_token);
  // InvalidArgument (naming the entry) for a malformed file; IOError when unreadable.
  static StatusOr<ApiKeys> Load(const std::string& path);
  static StatusOr<ApiKeys> Parse(std::string_view json);

  bool auth_enabled() const { return !keys_.empty(); }
  // The tenant of an "Authorization" header value ("Bearer <key>"); nullptr for a missing or
  // unknown key when auth is on. With auth off, the default tenant whatever the header says.
  const Tenant* Find(std::string_view authorization) const;

 private:
  std::map<std::string, std::shared_ptr<Tenant>> tenants_;  // by name
  std::map<std::string, const Tenant*, std::less<>> keys_;  // by key
  std::shared_ptr<Tenant> open_;
};

}  // namespace kvtier::serving
