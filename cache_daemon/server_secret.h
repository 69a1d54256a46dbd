// The server secret, checked against a fingerprint recorded in the data directory.
//
// Every stored unit is found through its tenant's salt, HMAC-SHA256(server_secret, tenant
// name) (DESIGN §3, tenants.h): under another secret no stored unit can be found again, so a
// lost or swapped secret silently orphans the whole store. OpenServerSecret makes that loud:
//
//   - the data directory records the secret's fingerprint in
//     <data_dir>/server_secret.fingerprint: 64 hex characters and a newline, of
//     SHA-256(HMAC-SHA256(secret, "kvtier-secret-fingerprint")) (hashed once more so that it
//     can never equal a tenant salt, even of a tenant with that name). Written once, mode
//     0600, through a temporary file, fsync and rename, and the directory fsynced;
//   - a secret whose fingerprint differs from the recorded one is refused (PermissionDenied);
//   - a missing secret file is created (32 random bytes, mode 0600, fsynced) only when the
//     data directory holds nothing yet: no fingerprint and an empty or absent store
//     directory. Otherwise NotFound: restore the secret (or move the data away).
//   - a data directory from before fingerprints (a secret, no fingerprint) gets one recorded
//     on its first start.
//
// Not thread-safe; call once at start, before the store opens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/key_spec.h"
#include "common/status.h"

namespace kvtier::daemon {

struct ServerSecretPaths {
  std::string secret_file;  // [auth] server_secret_file
  std::string data_dir;     // where the fingerprint lives
  std::string store_dir;    // the store's directory: "holds data" when not empty
};

// File name of the fingerprint inside the data directory.
inline constexpr const char* kSecretFingerprintFile = "server_secret.fingerprint";

// The secret's bytes. Errors: PermissionDenied (fingerprint mismatch), NotFound (secret
// missing while the data directory holds data), Corruption (unreadable fingerprint file),
// InvalidArgument (secret shorter than 32 bytes), IOError.
StatusOr<std::vector<uint8_t>> OpenServerSecret(const ServerSecretPaths& paths);

// SHA-256(HMAC-SHA256(secret, "kvtier-secret-fingerprint")).
Digest SecretFingerprint(std::span<const uint8_t> secret);

}  // namespace kvtier::daemon
