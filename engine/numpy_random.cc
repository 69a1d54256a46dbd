#include "engine/numpy_random.h"

namespace kvtier::engine::numpy {

namespace {

constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr int kXShift = 16;
constexpr int kPoolSize = 4;

uint32_t HashMix(uint32_t value, uint32_t* hash_const) {
  value ^= *hash_const;
  *hash_const *= kMultA;
  value *= *hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t Mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

// _coerce_to_uint32_array for a non-negative int: little-endian 32-bit words; 0 -> [0].
std::vector<uint32_t> CoerceEntropy(uint64_t entropy) {
  std::vector<uint32_t> words;
  do {
    words.push_back(static_cast<uint32_t>(entropy));
    entropy >>= 32;
  } while (entropy != 0);
  return words;
}

std::vector<uint32_t> MixEntropy(const std::vector<uint32_t>& entropy) {
  std::vector<uint32_t> mixer(kPoolSize);
  uint32_t hash_const = kInitA;
  for (int i = 0; i < kPoolSize; ++i) {
    mixer[i] = HashMix(i < static_cast<int>(entropy.size()) ? entropy[i] : 0, &hash_const);
  }
  for (int src = 0; src < kPoolSize; ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) mixer[dst] = Mix(mixer[dst], HashMix(mixer[src], &hash_const));
    }
  }
  for (size_t src = kPoolSize; src < entropy.size(); ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst) {
      mixer[dst] = Mix(mixer[dst], HashMix(entropy[src], &hash_const));
    }
  }
  return mixer;
}

constexpr Uint128 kPcgMult =
    (static_cast<Uint128>(2549297995355413924ULL) << 64) | 4865540595714422341ULL;

}  // namespace

std::vector<uint64_t> SeedSequenceGenerateState64(uint64_t entropy, int n_words) {
  std::vector<uint32_t> pool = MixEntropy(CoerceEntropy(entropy));
  uint32_t hash_const = kInitB;
  std::vector<uint32_t> words(static_cast<size_t>(n_words) * 2);
  for (size_t i = 0; i < words.size(); ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    v ^= v >> kXShift;
    words[i] = v;
  }
  std::vector<uint64_t> out(n_words);
  for (int i = 0; i < n_words; ++i) {
    out[i] = static_cast<uint64_t>(words[2 * i]) | (static_cast<uint64_t>(words[2 * i + 1]) << 32);
  }
  return out;
}

Pcg64::Pcg64(uint64_t seed) {
  std::vector<uint64_t> v = SeedSequenceGenerateState64(seed, 4);
  Uint128 initstate = (static_cast<Uint128>(v[0]) << 64) | v[1];
  Uint128 initseq = (static_cast<Uint128>(v[2]) << 64) | v[3];
  // pcg_setseq_128_srandom_r
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMult + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMult + inc_;
}

uint64_t Pcg64::Next64() {
  state_ = state_ * kPcgMult + inc_;
  uint64_t hi = static_cast<uint64_t>(state_ >> 64);
  uint64_t lo = static_cast<uint64_t>(state_);
  uint64_t x = hi ^ lo;
  unsigned rot = static_cast<unsigned>(hi >> 58);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t Pcg64::Next32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  uint64_t next = Next64();
  has_uint32_ = true;
  uinteger_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xffffffffULL);
}

StatusOr<std::vector<int64_t>> Integers(Pcg64* rng, int64_t low, int64_t high, int size) {
  if (high <= low) return Status::InvalidArgument("integers: high <= low");
  if (size < 0) return Status::InvalidArgument("integers: negative size");
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low) - 1;
  std::vector<int64_t> out(size);
  for (int i = 0; i < size; ++i) {
    uint64_t v = 0;
    if (range == 0) {
      v = 0;
    } else if (range == 0xFFFFFFFFULL) {
      v = rng->Next32();
    } else if (range < 0xFFFFFFFFULL) {
      // buffered_bounded_lemire_uint32
      const uint32_t rng_excl = static_cast<uint32_t>(range) + 1;
      uint64_t m = static_cast<uint64_t>(rng->Next32()) * rng_excl;
      uint32_t leftover = static_cast<uint32_t>(m);
      if (leftover < rng_excl) {
        const uint32_t threshold = static_cast<uint32_t>((0xFFFFFFFFULL - range) % rng_excl);
        while (leftover < threshold) {
          m = static_cast<uint64_t>(rng->Next32()) * rng_excl;
          leftover = static_cast<uint32_t>(m);
        }
      }
      v = m >> 32;
    } else if (range == 0xFFFFFFFFFFFFFFFFULL) {
      v = rng->Next64();
    } else {
      // bounded_lemire_uint64
      const uint64_t rng_excl = range + 1;
      Uint128 m = static_cast<Uint128>(rng->Next64()) * rng_excl;
      uint64_t leftover = static_cast<uint64_t>(m);
      if (leftover < rng_excl) {
        const uint64_t threshold = (0xFFFFFFFFFFFFFFFFULL - range) % rng_excl;
        while (leftover < threshold) {
          m = static_cast<Uint128>(rng->Next64()) * rng_excl;
          leftover = static_cast<uint64_t>(m);
        }
      }
      v = static_cast<uint64_t>(m >> 64);
    }
    out[i] = static_cast<int64_t>(static_cast<uint64_t>(low) + v);
  }
  return out;
}

}  // namespace kvtier::engine::numpy
