// Bit-exact ports of the parts of numpy's random module that the Engram reference uses:
// `np.random.default_rng(seed).integers(low, high, size, dtype=np.int64)`.
//
//   SeedSequence  numpy/random/bit_generator.pyx: entropy -> uint32 pool of 4 words by the
//                 hashmix/mix scheme; generate_state(n, uint64) pairs uint32 words little-end.
//   Pcg64         numpy/random/src/pcg64: 128-bit LCG (multiplier 0x2360ED051FC65DA4_
//                 4385DF649FCCF645) with the XSL-RR output; seeded from generate_state(4):
//                 state seed = (w0 << 64) | w1, increment seq = (w2 << 64) | w3.
//   Integers      numpy/random/_bounded_integers: rng = high - low - 1 (exclusive high);
//                 rng > 0xFFFFFFFF uses Lemire's method on 64-bit draws, rng < 0xFFFFFFFF
//                 Lemire on buffered 32-bit draws (the low half of a 64-bit draw first).
//
// Only non-negative integer seeds below 2^63 are supported (all the reference needs). The
// 64-bit Lemire path is checked against numpy output (vectors/engram_hash.json); the 32-bit
// path is ported from the same source but has no numpy vectors here.
// Thread safety: Pcg64 objects are not shared; functions are pure.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace kvtier::engine::numpy {

__extension__ typedef unsigned __int128 Uint128;  // GCC/Clang extension

// SeedSequence(entropy).generate_state(n_words, uint64).
std::vector<uint64_t> SeedSequenceGenerateState64(uint64_t entropy, int n_words);

class Pcg64 {
 public:
  // default_rng(seed): PCG64 seeded through SeedSequence(seed).
  explicit Pcg64(uint64_t seed);
  uint64_t Next64();
  uint32_t Next32();  // numpy's buffered 32-bit draw

 private:
  Uint128 state_ = 0;
  Uint128 inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

// Generator.integers(low, high, size, dtype=np.int64) with endpoint=False.
// InvalidArgument when high <= low.
StatusOr<std::vector<int64_t>> Integers(Pcg64* rng, int64_t low, int64_t high, int size);

}  // namespace kvtier::engine::numpy
