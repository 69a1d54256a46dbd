// Tenants and authentication for kvtierd.
//
// A tenant is an authenticated identity with a byte quota and an in-flight request limit.
// The tokens file (TOML, path in [auth] tokens_file) stores only SHA-256 digests of tokens:
//
//   [[tenant]]
//   name = "alice"                 # tenant id: the HMAC message of its salt (DESIGN §3)
//   id = 1                         # numeric id for storage accounting, 1..2^63, unique
//   token_sha256 = ["<64 hex>"]    # one or more tokens (kvtierd --hash-token TOKEN)
//   quota_bytes = 0                # 0: unlimited
//   inflight_max = 256             # concurrent requests across all its connections
//   admin = false                  # may POLICY SET / DRAIN / read global STATS
//
// With no tokens file, authentication is off and every connection is the built-in tenant
// "default" (id 0, admin); the daemon then binds only loopback/Unix sockets.
//
// The tenant salt = HMAC-SHA256(server_secret, name) is derived here, at load time, from the
// server secret; it is never taken from a request and never logged.
//
// Thread safety: a TenantRegistry is immutable after Load; Tenant::inflight is atomic.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/key_spec.h"
#include "common/status.h"

namespace kvtier::daemon {

struct Tenant {
  std::string name;
  uint64_t id = 0;
  uint64_t quota_bytes = 0;
  uint32_t inflight_max = 256;
  bool admin = false;
  Digest salt{};
  std::vector<Digest> token_sha256;
  // Requests of this tenant currently executing (all connections).
  mutable std::atomic<uint32_t> inflight{0};
};

// Holds one in-flight slot of a tenant; releases it on destruction.
class InflightSlot {
 public:
  InflightSlot() = default;
  explicit InflightSlot(const Tenant* t) : tenant_(t) {}
  InflightSlot(InflightSlot&& o) noexcept : tenant_(o.tenant_) { o.tenant_ = nullptr; }
  InflightSlot& operator=(InflightSlot&& o) noexcept;
  InflightSlot(const InflightSlot&) = delete;
  InflightSlot& operator=(const InflightSlot&) = delete;
  ~InflightSlot();

 private:
  const Tenant* tenant_ = nullptr;
};

// Takes a slot, or Rejected when the tenant already has inflight_max requests running.
StatusOr<InflightSlot> AcquireInflight(const Tenant& tenant);

class TenantRegistry {
 public:
  // Authentication off: one tenant "default" (id 0, admin) with the given in-flight limit.
  static std::unique_ptr<TenantRegistry> Open(std::span<const uint8_t> server_secret,
                                              uint32_t default_inflight_max);
  // Parses a tokens file's text. InvalidArgument (with the reason) for bad TOML, missing or
  // duplicate names/ids, malformed digests, or a digest listed twice (naming both tenants: a
  // token must identify exactly one tenant).
  static StatusOr<std::unique_ptr<TenantRegistry>> Parse(std::string_view toml_text,
                                                         std::span<const uint8_t> server_secret);
  static StatusOr<std::unique_ptr<TenantRegistry>> LoadFile(const std::string& path,
                                                            std::span<const uint8_t> secret);

  bool auth_enabled() const { return auth_enabled_; }
  // The tenant every unauthenticated connection belongs to when auth is off; nullptr when on.
  const Tenant* default_tenant() const { return auth_enabled_ ? nullptr : tenants_[0].get(); }
  // PermissionDenied for an unknown token. Compares the token's SHA-256 with every digest
  // (CRYPTO_memcmp) and selects the match without a branch: the time does not depend on
  // whether or where the token matches.
  StatusOr<const Tenant*> Authenticate(std::string_view token) const;
  // The tenant with this id, or nullptr. One hash lookup (callers run it per tenant of a
  // stats reply and per record of a log replay, with up to 65,536 tenants).
  const Tenant* FindById(uint64_t id) const;
  // The tenant with this name (names are unique: LoadTenants refuses duplicates), or nullptr.
  const Tenant* FindByName(std::string_view name) const;
  const std::vector<std::unique_ptr<Tenant>>& tenants() const { return tenants_; }

 private:
  bool auth_enabled_ = false;
  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::unordered_map<uint64_t, const Tenant*> by_id_;          // every tenant of tenants_, by id
  std::map<std::string, const Tenant*, std::less<>> by_name_;  // and by name
};

// Reads the server secret from path, or creates it (32 random bytes, mode 0600, file and
// directory fsynced) when absent. InvalidArgument when an existing file is shorter than 32
// bytes. kvtierd calls it through OpenServerSecret (server_secret.h), which refuses to create
// a secret for a data directory that already holds data.
StatusOr<std::vector<uint8_t>> LoadOrCreateServerSecret(const std::string& path);

}  // namespace kvtier::daemon
