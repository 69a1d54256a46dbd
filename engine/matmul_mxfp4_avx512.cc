// The AVX-512 micro-kernel of MatMulCpu over kMxfp4 panels (engine/matmul.h). Compiled with
// -mavx512f -mavx2 -mfma; matmul.cc calls it only after cpuid reported AVX-512F, AVX2 and FMA.
//
// A pass computes MR rows (1-8) x NP panels (16 outputs each, one zmm per row and panel). Per block
// of 32 inputs it turns the panel's 16 scale codes into 16 floats 2^(s - 127) (s in [1, 254]: the
// exponent field alone); per group of 8 inputs it loads one 16-lane vector of code words, and
// per input shifts that input's nibble down, looks it up in the 16-entry E2M1 table with one
// permute (which reads only the low four bits), multiplies by the scales (exact: a <= 3-bit
// significand times a power of two) and issues one fused multiply-add per row, k in order:
// every output is the contract's fma chain over the decoded weights, the same bits as the float
// kernels.
// GCC 12's AVX-512 headers start widening, shift and permute intrinsics from a self-initialised
// "undefined" vector, which -Wmaybe-uninitialized reports once inlined (GCC bug 105593); the
// instructions overwrite every lane.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "engine/matmul.h"

namespace kvtier::engine::internal {
namespace {

constexpr int kP = kMatMulPanelOutputs;
static_assert(kP == 16, "a panel is one 16-float vector");
constexpr int kMaxRows = 8;

// MR rows x NP panels (y's panel q at y + q * 16).
template <int MR, int NP>
void Kernel(const float* x, int64_t ldx, int in, const uint8_t* w, int64_t wstride, float* y,
            int64_t ldy, int valid) {
  // E2M1 codes 0-15: sign in bit 3 (code 8 is -0, as kernels::E2M1ToFloat decodes it).
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                      -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  const int blocks = in / kCodedBlockInputs;
  for (int b = 0; b < blocks; ++b) {
    __m512 scale[NP];
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q) {
      const uint8_t* blk = w + q * wstride + static_cast<int64_t>(b) * kMxfp4BlockBytes;
      scale[q] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))), 23));
    }
    const float* xb = x + static_cast<int64_t>(b) * kCodedBlockInputs;
    for (int g = 0; g < kCodedBlockInputs / kMxfp4GroupInputs; ++g) {
      __m512i v[NP];
#pragma GCC unroll 8
      for (int q = 0; q < NP; ++q) {
        v[q] = _mm512_loadu_si512(w + q * wstride + static_cast<int64_t>(b) * kMxfp4BlockBytes +
                                  kP + g * kP * 4);
      }
      const float* xg = xb + g * kMxfp4GroupInputs;
#pragma GCC unroll 8
      for (int t = 0; t < kMxfp4GroupInputs; ++t) {
#pragma GCC unroll 8
        for (int q = 0; q < NP; ++q) {
          // The permute reads each lane's low four bits: input t's code after the shift.
          const __m512 w_t =
              _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v[q], 4 * t), table), scale[q]);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            acc[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + t]), w_t, acc[r][q]);
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < NP; ++q) {
    const int left = valid - q * kP;
    const __mmask16 mask =
        left >= kP ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + q * kP, mask, acc[r][q]);
  }
}

using KernelFn = void (*)(const float*, int64_t, int, const uint8_t*, int64_t, float*, int64_t,
                          int);

// Panels per pass for mr rows: about 8 accumulators, so that the fma chains (one per output,
// each waiting on its previous step) keep the FMA units busy; a 1-row pass of 1 panel ran at
// half the speed of 8 (kvtier_bench_matmul, "routed experts").
constexpr int MaxPanels(int mr) { return mr == 1 ? 8 : mr == 2 ? 4 : mr <= 4 ? 2 : 1; }

template <int MR, int... Q>
constexpr std::array<KernelFn, sizeof...(Q)> Row(std::integer_sequence<int, Q...>) {
  return {Kernel<MR, Q + 1>...};
}

KernelFn Pick(int mr, int np) {
  static constexpr auto k1 = Row<1>(std::make_integer_sequence<int, MaxPanels(1)>());
  static constexpr auto k2 = Row<2>(std::make_integer_sequence<int, MaxPanels(2)>());
  static constexpr auto k3 = Row<3>(std::make_integer_sequence<int, MaxPanels(3)>());
  static constexpr auto k4 = Row<4>(std::make_integer_sequence<int, MaxPanels(4)>());
  switch (mr) {
    case 1:
      return k1[np - 1];
    case 2:
      return k2[np - 1];
    case 3:
      return k3[np - 1];
    case 4:
      return k4[np - 1];
    case 5:
      return Kernel<5, 1>;
    case 6:
      return Kernel<6, 1>;
    case 7:
      return Kernel<7, 1>;
    default:
      return Kernel<8, 1>;
  }
}

}  // namespace

void MatMulMxfp4Avx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                            float* y) {
  const int in = w.in(), out = w.out();
  const int64_t wstride = w.coded_panel_bytes();
  // Row groups outside, panels inside: a group's rows of X stay in L1 while it passes over the
  // panels (an expert's whole MXFP4 matrix is a few tens of KiB).
  for (int r = r0; r < r1;) {
    const int mr = std::min(kMaxRows, r1 - r);
    for (int p = p0; p < p1;) {
      const int np = std::min(MaxPanels(mr), p1 - p);
      Pick(mr, np)(x + static_cast<int64_t>(r) * in, in, in, w.coded_panel(p), wstride,
                   y + static_cast<int64_t>(r) * out + static_cast<int64_t>(p) * kP, out,
                   out - p * kP);
      p += np;
    }
    r += mr;
  }
}

}  // namespace kvtier::engine::internal

#pragma GCC diagnostic pop
