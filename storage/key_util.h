// Small helpers over storage keys shared by the tiers.
#pragma once

#include <cstdint>
#include <cstring>

#include "policies/policy.h"
#include "storage/tier_manager.h"

namespace kvtier::storage {

// The policy object id of a key: its first 8 bytes, little-endian (policy.h).
inline policies::ObjectId ObjectIdOf(const Key& key) {
  uint64_t v = 0;
  std::memcpy(&v, key.data(), sizeof(v));
  return v;
}

// Keys are SHA-256 outputs: their first 8 bytes are already uniformly distributed.
struct KeyHash {
  size_t operator()(const Key& key) const { return static_cast<size_t>(ObjectIdOf(key)); }
};

}  // namespace kvtier::storage
