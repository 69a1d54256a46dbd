// RespKeyIndex: the names of the RESP keys each tenant has written, so SCAN, KEYS and DBSIZE
// can list them. The store holds only storage keys (digests of tenant salt and name), from
// which no name can be recovered.
//
// Entries are ordered by storage key, which is a fixed function of (tenant, name), so the
// order of the keys present never changes while keys come and go. A SCAN cursor is a position
// in that order: CursorOf(k) = (the first 8 bytes of k, big-endian) / 2 + 1, in 1..2^63, so 0
// stays "start" / "done". Scan() returns every entry whose position lies in [cursor, next),
// where next is the position of the first entry not returned (entries sharing a position are
// never split across calls). Hence a full iteration returns every key present from its start
// to its end at least once (exactly once unless it was deleted and written again), whatever
// is added or removed in between; keys added or removed during it may or may not appear.
//
// The index is memory only, bounded and best-effort:
//  - at most keys_per_tenant_max entries per tenant and name_bytes_max bytes over all
//    tenants (each entry costs its name plus kEntryOverheadBytes); a key beyond either is
//    stored but not indexed, and counted in unindexed();
//  - it is empty after a restart: keys that survive on SSD are readable but not listed until
//    written again;
//  - entries of keys the store evicted or expired stay until a caller Remove()s them (the
//    Service checks each listed key against the store and removes the gone ones).
//
// Thread safety: every method may be called concurrently (one mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "storage/tier_manager.h"

namespace kvtier::daemon {

class RespKeyIndex {
 public:
  // Bytes charged per entry besides its name: the storage key, the map node and the string.
  static constexpr uint64_t kEntryOverheadBytes = 128;

  struct Entry {
    storage::Key key;
    std::string name;
  };

  RespKeyIndex(size_t keys_per_tenant_max, uint64_t name_bytes_max)
      : keys_per_tenant_max_(keys_per_tenant_max), name_bytes_max_(name_bytes_max) {}

  // Records that tenant's key k is named `name` (no-op when already indexed).
  void Add(uint64_t tenant, const storage::Key& k, std::string_view name);
  void Remove(uint64_t tenant, const storage::Key& k);
  void RemoveTenant(uint64_t tenant);

  // Copies into *out (cleared) the entries at positions [cursor, next) in order: at least
  // `count` entries unless the tenant's keys run out first (a few more when entries share
  // the last position), and returns next, or 0 when no entry is left.
  uint64_t Scan(uint64_t tenant, uint64_t cursor, size_t count, std::vector<Entry>* out) const;
  static uint64_t CursorOf(const storage::Key& k);

  size_t size(uint64_t tenant) const;
  uint64_t bytes() const;      // charged bytes of all entries
  uint64_t unindexed() const;  // Add() calls that hit a limit

 private:
  const size_t keys_per_tenant_max_;
  const uint64_t name_bytes_max_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::map<storage::Key, std::string>> keys_;  // guarded by mu_
  uint64_t bytes_ = 0;                                            // guarded by mu_
  uint64_t unindexed_ = 0;                                        // guarded by mu_
};

}  // namespace kvtier::daemon
