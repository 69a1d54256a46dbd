// Helpers shared by the storage tests: keys, self-checking values, temp directories.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/temp_dir.h"
#include "storage/tier_manager.h"

namespace kvtier::storage::testing {

inline uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline Key MakeKey(uint64_t i, uint64_t salt = 0) {
  Key k{};
  for (int w = 0; w < 4; ++w) {
    uint64_t v = SplitMix(i * 4 + static_cast<uint64_t>(w) + salt * 0x1000003);
    std::memcpy(k.data() + w * 8, &v, 8);
  }
  return k;
}

// A value that encodes its key and version: [key 32][version 8][size 8][filler...], the filler
// derived from (key, version). compressible=true gives a repetitive filler.
inline std::vector<uint8_t> MakeValue(const Key& key, uint64_t version, size_t size,
                                      bool compressible = false) {
  std::vector<uint8_t> v(std::max<size_t>(size, 48));
  std::memcpy(v.data(), key.data(), 32);
  std::memcpy(v.data() + 32, &version, 8);
  uint64_t n = v.size();
  std::memcpy(v.data() + 40, &n, 8);
  uint64_t seed = SplitMix(version ^ key[0] ^ (uint64_t{key[1]} << 8));
  for (size_t i = 48; i < v.size(); ++i) {
    v[i] = compressible ? static_cast<uint8_t>((i / 64) & 0x7)
                        : static_cast<uint8_t>(seed >> ((i % 8) * 8));
    if (!compressible && i % 8 == 7) seed = SplitMix(seed);
  }
  return v;
}

// True when the bytes are exactly a MakeValue(key, version, size, either filler); sets *version.
inline bool CheckValue(const Key& key, const std::vector<uint8_t>& v, uint64_t* version) {
  if (v.size() < 48 || std::memcmp(v.data(), key.data(), 32) != 0) return false;
  uint64_t ver = 0, n = 0;
  std::memcpy(&ver, v.data() + 32, 8);
  std::memcpy(&n, v.data() + 40, 8);
  if (n != v.size()) return false;
  if (MakeValue(key, ver, v.size(), false) != v && MakeValue(key, ver, v.size(), true) != v) {
    return false;
  }
  if (version != nullptr) *version = ver;
  return true;
}

using ::kvtier::TempDir;  // common/temp_dir.h

}  // namespace kvtier::storage::testing
