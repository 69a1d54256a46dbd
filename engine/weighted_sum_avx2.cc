// The AVX2 kernel of WeightedRowSums (engine/ops.h): the attention's weighted sums of value rows.
// Compiled with -mavx2 and without -mfma, so each product is rounded before its sum (the
// engine's -ffp-contract=off says the same); ops.cc calls it only after cpuid reported AVX2.
//
// The scalar reference zeroes y's row and runs Axpy(w[i], x row i, n, y row) for i = 0, 1, ...:
// element d is ((0 + w0 x0[d]) + w1 x1[d]) + ..., each product and sum rounded. Here lane j of
// accumulator c holds element d + 8c + j of one row of y across the whole loop over i, so each
// element sees the same products added in the same order, bit for bit; the accumulators stay
// in registers instead of y being loaded and stored once per row of x.
#include <cstdint>
#include <cstring>

#include "engine/v8_avx2.h"

namespace kvtier::engine::internal {
namespace {

// Elements [d, d + 8C) of y's row: C accumulators (C <= 12 keeps them in the 16 registers).
template <int C>
void Chunk(const float* w, const float* x, int rows, int n, int d, float* y) {
  V8 acc[C] = {};
  for (int i = 0; i < rows; ++i) {
    const float wi = w[i];
    const V8 wv = {wi, wi, wi, wi, wi, wi, wi, wi};
    const float* xi = x + static_cast<int64_t>(i) * n + d;
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      const V8 p = wv * LoadV8(xi + 8 * c);
      acc[c] += p;
    }
  }
#pragma GCC unroll 12
  for (int c = 0; c < C; ++c) std::memcpy(y + d + 8 * c, &acc[c], sizeof acc[c]);
}

}  // namespace

// y[r * n + d] = sum over i < rows of w[r * rows + i] * x[i * n + d], in i order from 0.
void WeightedRowSumsAvx2(const float* w, int m, const float* x, int rows, int n, float* y) {
  for (int r = 0; r < m; ++r) {
    const float* wr = w + static_cast<int64_t>(r) * rows;
    float* yr = y + static_cast<int64_t>(r) * n;
    int d = 0;
    for (; d + 64 <= n; d += 64) Chunk<8>(wr, x, rows, n, d, yr);
    for (; d + 8 <= n; d += 8) Chunk<1>(wr, x, rows, n, d, yr);
    for (; d < n; ++d) {
      float acc = 0.0f;
      for (int i = 0; i < rows; ++i) acc += wr[i] * x[static_cast<int64_t>(i) * n + d];
      yr[d] = acc;
    }
  }
}

}  // namespace kvtier::engine::internal
