// Self-describing values for the kvtierd crash driver: every value names the front and key it
// was written for and its version, and carries a checksum, so that a value read back after a
// crash can be classified on its own (exactly one version of this key, a torn or corrupt value,
// or another key's value) without trusting anything the daemon says.
//
// Layout (little-endian):
//   0  u32 magic 'KVCV'     4  u8 front     5  u8[3] zero     8  u32 key id
//   12 u32 body length      16 u64 version  24 body (deterministic bytes from front, key,
//   version)                24 + body: u64 FNV-1a 64 of every byte before it
// Thread safety: free functions, no state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvtier::crash {

inline constexpr uint32_t kValueMagic = 0x5643564B;  // "KVCV"
inline constexpr size_t kValueHeaderBytes = 24;
inline constexpr size_t kValueOverheadBytes = kValueHeaderBytes + 8;

inline uint64_t Fnv1a64(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

inline uint64_t SplitMix64(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The value of version `version` (>= 1) of key `key_id` of front `front`, body_bytes long
// after the header.
inline std::vector<uint8_t> MakeValue(uint8_t front, uint32_t key_id, uint64_t version,
                                      uint32_t body_bytes) {
  std::vector<uint8_t> v(kValueOverheadBytes + body_bytes);
  uint8_t* p = v.data();
  std::memcpy(p, &kValueMagic, 4);
  p[4] = front;
  std::memcpy(p + 8, &key_id, 4);
  std::memcpy(p + 12, &body_bytes, 4);
  std::memcpy(p + 16, &version, 8);
  uint64_t s = (uint64_t{front} << 56) ^ (uint64_t{key_id} << 32) ^ version;
  for (uint32_t i = 0; i < body_bytes; i += 8) {
    uint64_t r = SplitMix64(&s);
    std::memcpy(p + kValueHeaderBytes + i, &r, std::min<uint32_t>(8, body_bytes - i));
  }
  uint64_t sum = Fnv1a64(p, kValueHeaderBytes + body_bytes);
  std::memcpy(p + kValueHeaderBytes + body_bytes, &sum, 8);
  return v;
}

struct DecodedValue {
  bool ok = false;
  uint8_t front = 0;
  uint32_t key_id = 0;
  uint64_t version = 0;
  std::string error;  // why not ok: "short", "bad magic", "length mismatch", "torn", ...
};

// Checks v completely (header, checksum, and every body byte against the regenerated body).
inline DecodedValue DecodeValue(const uint8_t* p, size_t n) {
  DecodedValue d;
  if (n < kValueOverheadBytes) {
    d.error = "short value (" + std::to_string(n) + " bytes)";
    return d;
  }
  uint32_t magic = 0, body = 0;
  std::memcpy(&magic, p, 4);
  if (magic != kValueMagic) {
    d.error = "bad magic";
    return d;
  }
  d.front = p[4];
  std::memcpy(&d.key_id, p + 8, 4);
  std::memcpy(&body, p + 12, 4);
  std::memcpy(&d.version, p + 16, 8);
  if (uint64_t{body} + kValueOverheadBytes != n) {
    d.error = "length mismatch (header says " + std::to_string(body) + " body bytes, value has " +
              std::to_string(n) + " bytes)";
    return d;
  }
  uint64_t sum = 0;
  std::memcpy(&sum, p + kValueHeaderBytes + body, 8);
  if (sum != Fnv1a64(p, kValueHeaderBytes + body)) {
    d.error = "checksum mismatch (torn or corrupt)";
    return d;
  }
  if (d.version == 0) {
    d.error = "version 0";
    return d;
  }
  std::vector<uint8_t> want = MakeValue(d.front, d.key_id, d.version, body);
  if (std::memcmp(want.data(), p, n) != 0) {
    d.error = "body differs from the version's bytes";
    return d;
  }
  d.ok = true;
  return d;
}

}  // namespace kvtier::crash
