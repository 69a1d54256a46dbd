// The AVX-512 micro-kernel of MatMulCpu over kFp8 panels (engine/matmul.h). Compiled with
// -mavx512f -mavx2 -mfma; matmul.cc calls it only after cpuid reported AVX-512F, AVX2 and FMA.
//
// As matmul_mxfp4_avx512.cc (MR rows x NP panels per pass), with E4M3 codes four to a word: per
// input the code's low seven bits are shifted into a float's exponent and mantissa fields (bits
// 20-26), which reads the code's magnitude times 2^-120 exactly (E4M3's subnormals become the
// float's subnormals), so one multiply by the block's 2^(s - 7) gives the magnitude times the
// scale 2^(s - 127), exact; the sign bit is then merged in. One fused multiply-add per row
// follows, k in order: the contract's fma chain over the decoded weights, the same bits as the
// float kernels. (This needs subnormal inputs honoured: MXCSR's DAZ must be off, the default.)
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

// Input T's weights (T = 0..3) of 16 lanes whose code words are v, scaled.
template <int T>
inline __m512 Decode(__m512i v, __m512 scale) {
  const __m512i mag_field = _mm512_set1_epi32(0x07f00000), sign_bit = _mm512_set1_epi32(INT32_MIN);
  // Code bits [8T, 8T + 7) to float bits [20, 27); code bit 8T + 7 to bit 31.
  const __m512i mag = _mm512_and_si512(
      T < 3 ? _mm512_slli_epi32(v, 20 - 8 * T) : _mm512_srli_epi32(v, 4), mag_field);
  const __m512i sign = T < 3 ? _mm512_slli_epi32(v, 24 - 8 * T) : v;
  const __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(mag), scale);
  // m | (sign & sign_bit): the product is non-negative, so this sets its sign.
  return _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(_mm512_castps_si512(m), sign, sign_bit, 0xf8));
}

template <int MR, int NP, int T>
inline void Step(const float* xg, int64_t ldx, const __m512i (&v)[NP], const __m512 (&scale)[NP],
                 __m512 (&acc)[MR][NP]) {
#pragma GCC unroll 8
  for (int q = 0; q < NP; ++q) {
    const __m512 w_t = Decode<T>(v[q], scale[q]);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      acc[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + T]), w_t, acc[r][q]);
    }
  }
}

// MR rows x NP panels (y's panel q at y + q * 16).
template <int MR, int NP>
void Kernel(const float* x, int64_t ldx, int in, const uint8_t* w, int64_t wstride, float* y,
            int64_t ldy, int valid) {
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
      const uint8_t* blk = w + q * wstride + static_cast<int64_t>(b) * kFp8BlockBytes;
      const __m512i s =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      scale[q] =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(s, _mm512_set1_epi32(120)), 23));
    }
    const float* xb = x + static_cast<int64_t>(b) * kCodedBlockInputs;
    for (int g = 0; g < kCodedBlockInputs / kFp8GroupInputs; ++g) {
      __m512i v[NP];
#pragma GCC unroll 8
      for (int q = 0; q < NP; ++q) {
        v[q] = _mm512_loadu_si512(w + q * wstride + static_cast<int64_t>(b) * kFp8BlockBytes + kP +
                                  g * kP * 4);
      }
      const float* xg = xb + g * kFp8GroupInputs;
      Step<MR, NP, 0>(xg, ldx, v, scale, acc);
      Step<MR, NP, 1>(xg, ldx, v, scale, acc);
      Step<MR, NP, 2>(xg, ldx, v, scale, acc);
      Step<MR, NP, 3>(xg, ldx, v, scale, acc);
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
// half the speed of 8 (kvtier_bench_matmul, "routed experts", on the MXFP4 kernel).
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

void MatMulFp8Avx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
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
