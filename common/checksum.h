// Checksums for stored bytes: xxh3-64 (XXH3_64bits from xxHash 0.8).
//
// xxh3-64 is the checksum of every kvtier unit (docs/format/unit.md) and SSD record. It is a
// non-cryptographic hash: it detects corruption (flipped bits, torn writes, misdirected reads),
// never tampering. Keys are SHA-256 (common/key_spec.h).
//
// Thread safety: the free functions are pure. A Checksum64 object is not thread-safe; use one
// per thread. Seed: always 0 (XXH3_64bits, not XXH3_64bits_withSeed), so values are stable
// across processes and machines and can be persisted.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvtier {

// xxh3-64 of `bytes` (seed 0).
inline uint64_t Xxh3_64(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

inline uint64_t Xxh3_64(const void* data, size_t size_bytes) {
  return XXH3_64bits(data, size_bytes);
}

// Streaming xxh3-64: Update() over pieces gives the same value as Xxh3_64() over their
// concatenation.
class Checksum64 {
 public:
  Checksum64() : state_(XXH3_createState()) { Reset(); }
  ~Checksum64() { XXH3_freeState(state_); }
  Checksum64(const Checksum64&) = delete;
  Checksum64& operator=(const Checksum64&) = delete;

  void Reset() { (void)XXH3_64bits_reset(state_); }
  void Update(std::span<const uint8_t> bytes) {
    (void)XXH3_64bits_update(state_, bytes.data(), bytes.size());
  }
  uint64_t Digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;  // owned
};

}  // namespace kvtier
