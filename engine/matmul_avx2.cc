// The AVX2/FMA micro-kernels of MatMulCpu (engine/matmul.h). This is the only engine file
// compiled with -mavx2 -mfma; matmul.cc calls it only after cpuid reported both.
//
// A pass computes MR rows x NP panels (16 outputs each) over the whole inner dimension: per k
// it loads the NP panels' 16 weights, broadcasts X[r][k] for each row and issues one fused
// multiply-add per accumulator vector, k in order, so every output is the contract's fma chain.
// MR * NP <= 6 keeps the 2*MR*NP accumulators plus operands in the 16 ymm registers.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "engine/matmul.h"
#include "engine/matmul_passes.h"

namespace kvtier::engine::internal {
namespace {

constexpr int kP = kMatMulPanelOutputs;
// Passes of 2-4 rows prefetch each panel this many k-steps (cache lines) ahead. Such a pass
// keeps only 1-3 panel streams in flight, and on weights that come from DRAM (a routed expert
// in a batched decode: a few rows each) it streamed 25-45 % slower than the 6 streams of a
// 1-row pass; with the prefetch, 2 and 3 rows 16-20 % faster (docs/performance/serving.md,
// "batching on mini-v4.1"). The 1-row and 5-6-row passes are left as they were. A prefetch reads
// nothing into a register, so the results are the same bits.
constexpr int kPrefetchSteps = 32;
static_assert(kP == 16, "a panel is two 8-float vectors");

// x: MR rows of `in` floats, ldx apart; w: NP panels, wstride floats apart; y: MR rows, ldy
// apart; valid: outputs of y's row that exist from this pass's first output on.
template <int MR, int NP>
void Kernel(const float* x, int64_t ldx, int in, const float* w, int64_t wstride, float* y,
            int64_t ldy, int valid) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 6
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  }
  for (int k = 0; k < in; ++k) {
    const float* wk = w + static_cast<int64_t>(k) * kP;
    __m256 wv[NP][2];
#pragma GCC unroll 6
    for (int p = 0; p < NP; ++p) {
      if constexpr (MR >= 2 && MR <= 4) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + p * wstride + kPrefetchSteps * kP),
                     _MM_HINT_T0);
      }
      wv[p][0] = _mm256_load_ps(wk + p * wstride);
      wv[p][1] = _mm256_load_ps(wk + p * wstride + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 6
      for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(b, wv[p][0], acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(b, wv[p][1], acc[r][p][1]);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 6
    for (int p = 0; p < NP; ++p) {
      StoreAvx2(y + r * ldy + p * kP, acc[r][p][0], acc[r][p][1], valid - p * kP);
    }
  }
}

using KernelFn = void (*)(const float*, int64_t, int, const float*, int64_t, float*, int64_t, int);

// Most panels per pass for `mr` rows (accumulators within the register file).
constexpr int MaxPanels(int mr) { return mr == 1 ? 6 : mr == 2 ? 3 : mr == 3 ? 2 : 1; }

KernelFn Pick(int mr, int np) {
  switch (mr) {
    case 1: {
      static constexpr KernelFn k[6] = {Kernel<1, 1>, Kernel<1, 2>, Kernel<1, 3>,
                                        Kernel<1, 4>, Kernel<1, 5>, Kernel<1, 6>};
      return k[np - 1];
    }
    case 2: {
      static constexpr KernelFn k[3] = {Kernel<2, 1>, Kernel<2, 2>, Kernel<2, 3>};
      return k[np - 1];
    }
    case 3:
      return np == 1 ? Kernel<3, 1> : Kernel<3, 2>;
    case 4:
      return Kernel<4, 1>;
    case 5:
      return Kernel<5, 1>;
    default:
      return Kernel<6, 1>;
  }
}

}  // namespace

void MatMulAvx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                     float* y) {
  RunPasses<6>(x, r0, r1, w, p0, p1, y, Pick, MaxPanels);
}

}  // namespace kvtier::engine::internal
