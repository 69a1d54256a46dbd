// Eight floats in one AVX2 register, for the engine's AVX2 kernels (hc_mix_avx2.cc,
// weighted_sum_avx2.cc). Include only from a translation unit compiled with -mavx2: the type's
// argument passing and the inline function's code depend on that flag, and one definition
// compiled two ways would break the one-definition rule.
#pragma once

#include <cstring>

namespace kvtier::engine::internal {

typedef float V8 __attribute__((vector_size(32)));

// Eight floats from p, unaligned.
inline V8 LoadV8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace kvtier::engine::internal
