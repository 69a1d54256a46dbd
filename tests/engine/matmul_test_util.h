// Shared by the MatMul tests (engine_matmul_test.cc, engine_matmul_coded_test.cc): random inputs
// with a wide dynamic range, the MatMul contract (engine/matmul.h) written out independently of
// the library, and a bit-for-bit comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kvtier::engine::testutil {

// n floats m * 2^e, m uniform in (-1, 1), e uniform in [exp_lo, exp_hi]: both signs and a wide
// range, so rounding order matters and differences show.
inline std::vector<float> RandomFloats(size_t n, std::mt19937* rng, int exp_lo = -8,
                                       int exp_hi = 8) {
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(exp_lo, exp_hi);
  std::vector<float> v(n);
  for (auto& f : v) f = std::ldexp(mant(*rng), exp(*rng));
  return v;
}

// Y = X W^T as the contract states it: one fma chain per output, k in order from +0.
inline std::vector<float> Contract(const std::vector<float>& x, int rows, int in,
                                   const std::vector<float>& w, int out) {
  std::vector<float> y(static_cast<size_t>(rows) * out);
  for (int t = 0; t < rows; ++t) {
    for (int o = 0; o < out; ++o) {
      float acc = 0.0f;
      for (int k = 0; k < in; ++k) {
        acc = std::fma(x[static_cast<size_t>(t) * in + k], w[static_cast<size_t>(o) * in + k], acc);
      }
      y[static_cast<size_t>(t) * out + o] = acc;
    }
  }
  return y;
}

inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline void ExpectSameBits(const std::vector<float>& want, const std::vector<float>& got,
                           const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(Bits(want[i]), Bits(got[i]))
        << what << " element " << i << ": want " << want[i] << " got " << got[i];
  }
}

}  // namespace kvtier::engine::testutil
