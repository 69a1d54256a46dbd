// The AVX2 kernel of HcMixDots (engine/ops.h): the mHC mix products of several rows of x at
// once, also the attention's and the indexer's query-key dot products. Compiled with -mavx2 and
// without -mfma, so no product can be fused into its sum (the engine's -ffp-contract=off says
// the same); ops.cc calls it only after cpuid reported AVX2.
//
// Dot (ops.cc) keeps eight partial sums, acc[k] += a[i + k] * b[i + k], and adds them as
// ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)), then the tail. Here lane k
// of one 8-float accumulator is acc[k] of one (row of fn, row of x) pair, so every output is
// Dot's sum, bit for bit. A pass holds FR rows of fn by XR rows of x: FR * XR accumulators,
// XR loads of x and one of fn in the 16 ymm registers. When a pass holds eight (or four)
// accumulators, their final sums run side by side: the halves of two accumulators added in one
// vector add (acc0 + acc4, acc1 + acc5, ...), then the two levels of the tree with shuffles, so
// each lane adds the same two numbers Dot's tree adds (a sum's two operands may swap places:
// IEEE addition is commutative). With short rows (the indexer's 32 floats) the sums cost more
// than the products, one at a time.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "engine/v8_avx2.h"

namespace kvtier::engine::internal {
namespace {

// Dot's tree of one accumulator.
inline float TreeSum(const V8& v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// [lo(a) + hi(a) | lo(b) + hi(b)]: per accumulator the four sums acc_k + acc_(k+4).
inline __m256 HalfSums(const V8& a, const V8& b) {
  const __m256 va = reinterpret_cast<const __m256&>(a), vb = reinterpret_cast<const __m256&>(b);
  const __m256 lo = _mm256_permute2f128_ps(va, vb, 0x20);  // [lo a | lo b]
  const __m256 hi = _mm256_permute2f128_ps(va, vb, 0x31);  // [hi a | hi b]
  return _mm256_add_ps(lo, hi);
}

// From [u(a) | u(b)] and [u(c) | u(d)] (u: HalfSums' four sums u0..u3 of an accumulator):
// per 128-bit lane [u0 + u2, u1 + u3] of each of its two accumulators.
inline __m256 PairSums(__m256 p, __m256 q) {
  const __m256 even = _mm256_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0));  // p0 p1 q0 q1
  const __m256 odd = _mm256_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2));   // p2 p3 q2 q3
  return _mm256_add_ps(even, odd);
}

// s[r] = TreeSum(a[r]) for r < 8, bit for bit.
inline void TreeSums8(const V8* a, float s[8]) {
  const __m256 p01 = HalfSums(a[0], a[1]), p23 = HalfSums(a[2], a[3]);
  const __m256 p45 = HalfSums(a[4], a[5]), p67 = HalfSums(a[6], a[7]);
  // v: per lane [(u0+u2), (u1+u3)] of accumulators (0, 2) low / (1, 3) high; w the same of 4..7.
  const __m256 v = PairSums(p01, p23), w = PairSums(p45, p67);
  const __m256 first = _mm256_shuffle_ps(v, w, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 second = _mm256_shuffle_ps(v, w, _MM_SHUFFLE(3, 1, 3, 1));
  // Low lane: accumulators 0, 2, 4, 6; high lane: 1, 3, 5, 7.
  float t[8];
  _mm256_storeu_ps(t, _mm256_add_ps(first, second));
  for (int r = 0; r < 4; ++r) {
    s[2 * r] = t[r];
    s[2 * r + 1] = t[4 + r];
  }
}

// s[r] = TreeSum(a[r]) for r < 4, bit for bit.
inline void TreeSums4(const V8* a, float s[4]) {
  const __m256 v = PairSums(HalfSums(a[0], a[1]), HalfSums(a[2], a[3]));
  const __m256 first = _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 second = _mm256_shuffle_ps(v, v, _MM_SHUFFLE(3, 1, 3, 1));
  float t[8];  // low lane: accumulators 0, 2 (twice); high lane: 1, 3
  _mm256_storeu_ps(t, _mm256_add_ps(first, second));
  s[0] = t[0];
  s[1] = t[4];
  s[2] = t[1];
  s[3] = t[5];
}

template <int FR, int XR>
void Block(const float* fn, int i0, const float* x, int t0, int n, float* out, int m) {
  V8 acc[FR * XR] = {};  // acc[f * XR + t]
  int k = 0;
  // Fully unrolled, so that the accumulators live in registers (not on the stack).
  for (; k + 8 <= n; k += 8) {
    V8 xv[XR];
#pragma GCC unroll 8
    for (int t = 0; t < XR; ++t) xv[t] = LoadV8(x + static_cast<int64_t>(t0 + t) * n + k);
#pragma GCC unroll 4
    for (int f = 0; f < FR; ++f) {
      const V8 fv = LoadV8(fn + static_cast<int64_t>(i0 + f) * n + k);
#pragma GCC unroll 8
      for (int t = 0; t < XR; ++t) {
        const V8 p = fv * xv[t];
        acc[f * XR + t] += p;
      }
    }
  }
  float s[FR * XR];
  if constexpr (FR * XR == 8) {
    TreeSums8(acc, s);
  } else if constexpr (FR * XR == 4) {
    TreeSums4(acc, s);
  } else {
    for (int r = 0; r < FR * XR; ++r) s[r] = TreeSum(acc[r]);
  }
  for (int f = 0; f < FR; ++f) {
    const float* a = fn + static_cast<int64_t>(i0 + f) * n;
    for (int t = 0; t < XR; ++t) {
      const float* b = x + static_cast<int64_t>(t0 + t) * n;
      float v = s[f * XR + t];
      for (int j = k; j < n; ++j) v += a[j] * b[j];
      out[static_cast<int64_t>(t0 + t) * m + i0 + f] = v;
    }
  }
}

// Rows of fn [i0, i0 + FR) against every row of x: XR rows of x per pass, then the leftover
// rows in passes of four, two and one.
template <int FR, int XR>
void Rows(const float* fn, int i0, const float* x, int rows, int n, float* out, int m) {
  int t = 0;
  for (; t + XR <= rows; t += XR) Block<FR, XR>(fn, i0, x, t, n, out, m);
  if constexpr (XR > 4) {
    if (t + 4 <= rows) {
      Block<FR, 4>(fn, i0, x, t, n, out, m);
      t += 4;
    }
  }
  if constexpr (XR > 2) {
    if (t + 2 <= rows) {
      Block<FR, 2>(fn, i0, x, t, n, out, m);
      t += 2;
    }
  }
  if (t < rows) Block<FR, 1>(fn, i0, x, t, n, out, m);
}

}  // namespace

// out[t * m + i] = Dot(fn + i * n, x + t * n, n): four rows of fn at a time over every row of
// x (the four rows stay in L1 while the rows of x stream past them); a tail of two or one rows
// of fn takes four rows of x per pass, so that every full pass holds eight or four accumulators.
void HcMixDotsAvx2(const float* fn, int m, const float* x, int rows, int n, float* out) {
  int i = 0;
  for (; i + 4 <= m; i += 4) Rows<4, 2>(fn, i, x, rows, n, out, m);
  if (i + 2 <= m) {
    Rows<2, 4>(fn, i, x, rows, n, out, m);
    i += 2;
  }
  if (i < m) Rows<1, 4>(fn, i, x, rows, n, out, m);
}

}  // namespace kvtier::engine::internal
