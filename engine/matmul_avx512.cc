// The AVX-512 micro-kernels of MatMulCpu (engine/matmul.h). This is the only engine file
// compiled with -mavx512f; matmul.cc calls it only after cpuid reported AVX-512F, AVX2 and FMA.
//
// A panel's 16 outputs at one k are one 64-byte line (PackedMatrix), so a 512-bit register holds
// them. A pass computes MR rows x NP panels over the whole inner dimension: per k it loads the NP
// panels' 16 weights, broadcasts X[r][k] for each row and issues one fused multiply-add per
// accumulator, k in order, so every output is the contract's fma chain and the bits are those of
// the AVX2 kernel and the scalar loop. What differs is only how many outputs one instruction
// computes: twice the AVX2 kernel's, which matters where a pass is bound by the multiply-adds
// rather than by reading the weights (several rows over weights in cache: a batched decode's
// dense products, prefill), not for a 1-row decode GEMV, which reads its weights from DRAM.
// MR * NP + NP + 1 <= 32 keeps accumulators and operands in the 32 zmm registers.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "engine/matmul.h"
#include "engine/matmul_passes.h"

namespace kvtier::engine::internal {
namespace {

constexpr int kP = kMatMulPanelOutputs;
static_assert(kP == 16, "a panel is one 16-float vector");
// As matmul_avx2.cc: the prefetch distance (k-steps, one cache line each) of passes of 2-4
// rows.
constexpr int kPrefetchSteps = 32;
// Rows per pass at most.
constexpr int kMaxRows = 8;

// x: MR rows of `in` floats, ldx apart; w: NP panels, wstride floats apart; y: MR rows, ldy
// apart; valid: outputs of y's row that exist from this pass's first output on.
template <int MR, int NP>
void Kernel(const float* x, int64_t ldx, int in, const float* w, int64_t wstride, float* y,
            int64_t ldy, int valid) {
  static_assert(MR * NP + NP + 1 <= 32, "registers");
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  for (int k = 0; k < in; ++k) {
    const float* wk = w + static_cast<int64_t>(k) * kP;
    __m512 wv[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      if constexpr (MR >= 2 && MR <= 4) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + p * wstride + kPrefetchSteps * kP),
                     _MM_HINT_T0);
      }
      wv[p] = _mm512_load_ps(wk + p * wstride);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(b, wv[p], acc[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int v = valid - p * kP;
    if (v <= 0) break;
    const __mmask16 m =
        v >= kP ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << v) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + p * kP, m, acc[r][p]);
  }
}

using KernelFn = void (*)(const float*, int64_t, int, const float*, int64_t, float*, int64_t, int);

// Most panels per pass for `mr` rows; every value divides 6, so a group of a multiple of 6
// panels ends with a full pass.
constexpr int MaxPanels(int mr) { return mr <= 4 ? 6 : 3; }

template <int MR>
KernelFn PickPanels(int np) {
  if constexpr (MaxPanels(MR) == 6) {
    static constexpr KernelFn k[6] = {Kernel<MR, 1>, Kernel<MR, 2>, Kernel<MR, 3>,
                                      Kernel<MR, 4>, Kernel<MR, 5>, Kernel<MR, 6>};
    return k[np - 1];
  } else {
    static constexpr KernelFn k[3] = {Kernel<MR, 1>, Kernel<MR, 2>, Kernel<MR, 3>};
    return k[np - 1];
  }
}

KernelFn Pick(int mr, int np) {
  switch (mr) {
    case 1:
      return PickPanels<1>(np);
    case 2:
      return PickPanels<2>(np);
    case 3:
      return PickPanels<3>(np);
    case 4:
      return PickPanels<4>(np);
    case 5:
      return PickPanels<5>(np);
    case 6:
      return PickPanels<6>(np);
    case 7:
      return PickPanels<7>(np);
    default:
      return PickPanels<8>(np);
  }
}

}  // namespace

void MatMulAvx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                       float* y) {
  RunPasses<kMaxRows>(x, r0, r1, w, p0, p1, y, Pick, MaxPanels);
}

}  // namespace kvtier::engine::internal
