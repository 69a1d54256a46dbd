// The AVX2 kernel of HcMixDots (engine/ops.h): the mHC mix products of several rows of x at
// once. Compiled with -mavx2 and without -mfma, so no product can be fused into its sum
// (the engine's -ffp-contract=off says the same); ops.cc calls it only after cpuid reported
// AVX2.
//
// Dot (ops.cc) keeps eight partial sums, acc[k] += a[i + k] * b[i + k], and adds them as
// ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)), then the tail. Here lane k
// of one 8-float accumulator is acc[k] of one (row of fn, row of x) pair, so every output is
// Dot's sum, bit for bit. A pass holds FR rows of fn by XR rows of x: FR * XR accumulators,
// XR loads of x and one of fn in the 16 ymm registers.
#include <cstdint>
#include <cstring>

#include "engine/v8_avx2.h"

namespace kvtier::engine::internal {
namespace {

template <int FR, int XR>
void Block(const float* fn, int i0, const float* x, int t0, int n, float* out, int m) {
  V8 acc[FR][XR] = {};
  int k = 0;
  // Fully unrolled, so that the accumulators live in registers (not on the stack).
  for (; k + 8 <= n; k += 8) {
    V8 xv[XR];
#pragma GCC unroll 4
    for (int t = 0; t < XR; ++t) xv[t] = LoadV8(x + static_cast<int64_t>(t0 + t) * n + k);
#pragma GCC unroll 4
    for (int f = 0; f < FR; ++f) {
      const V8 fv = LoadV8(fn + static_cast<int64_t>(i0 + f) * n + k);
#pragma GCC unroll 4
      for (int t = 0; t < XR; ++t) {
        const V8 p = fv * xv[t];
        acc[f][t] += p;
      }
    }
  }
  for (int f = 0; f < FR; ++f) {
    const float* a = fn + static_cast<int64_t>(i0 + f) * n;
    for (int t = 0; t < XR; ++t) {
      const float* b = x + static_cast<int64_t>(t0 + t) * n;
      const V8& v = acc[f][t];
      float s = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
      for (int j = k; j < n; ++j) s += a[j] * b[j];
      out[static_cast<int64_t>(t0 + t) * m + i0 + f] = s;
    }
  }
}

template <int FR>
void Rows(const float* fn, int i0, const float* x, int rows, int n, float* out, int m) {
  int t = 0;
  for (; t + 2 <= rows; t += 2) Block<FR, 2>(fn, i0, x, t, n, out, m);
  if (t < rows) Block<FR, 1>(fn, i0, x, t, n, out, m);
}

}  // namespace

// out[t * m + i] = Dot(fn + i * n, x + t * n, n): four rows of fn at a time over every row of
// x (the four rows stay in L1 while the rows of x stream past them).
void HcMixDotsAvx2(const float* fn, int m, const float* x, int rows, int n, float* out) {
  int i = 0;
  for (; i + 4 <= m; i += 4) Rows<4>(fn, i, x, rows, n, out, m);
  for (; i < m; ++i) Rows<1>(fn, i, x, rows, n, out, m);
}

}  // namespace kvtier::engine::internal
