// The AVX2/FMA micro-kernel of MatMulCpu over kFp8 panels (engine/matmul.h). Compiled with
// -mavx2 -mfma; matmul.cc calls it only after cpuid reported both.
//
// As matmul_fp8_avx512.cc (the decoding) on two 8-lane halves of a panel, with the passes of
// matmul_mxfp4_avx2.cc (MR rows x NP panels): the contract's fma chain over the decoded weights,
// the same bits as the float kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "engine/matmul.h"

namespace kvtier::engine::internal {
namespace {

constexpr int kP = kMatMulPanelOutputs;
static_assert(kP == 16, "a panel is two 8-float vectors");
constexpr int kMaxRows = 4;

// Lanes [0, valid) set (valid in [0, 8]).
__m256i LaneMask(int valid) {
  alignas(32) static const int32_t kTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                 0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kTable + 8 - valid));
}

inline void Store(float* dst, __m256 lo, __m256 hi, int valid) {
  if (valid >= kP) {
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
  } else if (valid >= 8) {
    _mm256_storeu_ps(dst, lo);
    _mm256_maskstore_ps(dst + 8, LaneMask(valid - 8), hi);
  } else {
    _mm256_maskstore_ps(dst, LaneMask(valid), lo);
  }
}

// Input T's weights (T = 0..3) of 8 lanes whose code words are v, scaled (see the AVX-512
// file: the code's low seven bits read as float bits 20-26, times 2^(s - 7), then the sign).
template <int T>
inline __m256 Decode(__m256i v, __m256 scale) {
  const __m256i mag =
      _mm256_and_si256(T < 3 ? _mm256_slli_epi32(v, 20 - 8 * T) : _mm256_srli_epi32(v, 4),
                       _mm256_set1_epi32(0x07f00000));
  const __m256i sign =
      _mm256_and_si256(T < 3 ? _mm256_slli_epi32(v, 24 - 8 * T) : v, _mm256_set1_epi32(INT32_MIN));
  const __m256 m = _mm256_mul_ps(_mm256_castsi256_ps(mag), scale);
  return _mm256_or_ps(m, _mm256_castsi256_ps(sign));
}

template <int MR, int NP, int T>
inline void Step(const float* xg, int64_t ldx, const __m256i (&v)[NP][2],
                 const __m256 (&scale)[NP][2], __m256 (&acc)[MR][NP][2]) {
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
    const __m256 w_lo = Decode<T>(v[q][0], scale[q][0]);
    const __m256 w_hi = Decode<T>(v[q][1], scale[q][1]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xg + r * ldx + T);
      acc[r][q][0] = _mm256_fmadd_ps(xv, w_lo, acc[r][q][0]);
      acc[r][q][1] = _mm256_fmadd_ps(xv, w_hi, acc[r][q][1]);
    }
  }
}

// 2^(s - 7) for 8 scale codes s in [0, 134]: a float with exponent field s + 120.
inline __m256 Scale(const uint8_t* s) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(120)), 23));
}

// MR rows x NP panels (y's panel q at y + q * 16).
template <int MR, int NP>
void Kernel(const float* x, int64_t ldx, int in, const uint8_t* w, int64_t wstride, float* y,
            int64_t ldy, int valid) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) acc[r][q][0] = acc[r][q][1] = _mm256_setzero_ps();
  }
  const int blocks = in / kCodedBlockInputs;
  for (int b = 0; b < blocks; ++b) {
    __m256 scale[NP][2];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      const uint8_t* blk = w + q * wstride + static_cast<int64_t>(b) * kFp8BlockBytes;
      scale[q][0] = Scale(blk);
      scale[q][1] = Scale(blk + 8);
    }
    const float* xb = x + static_cast<int64_t>(b) * kCodedBlockInputs;
    for (int g = 0; g < kCodedBlockInputs / kFp8GroupInputs; ++g) {
      __m256i v[NP][2];
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        const uint8_t* gp =
            w + q * wstride + static_cast<int64_t>(b) * kFp8BlockBytes + kP + g * kP * 4;
        v[q][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp));
        v[q][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 32));
      }
      const float* xg = xb + g * kFp8GroupInputs;
      Step<MR, NP, 0>(xg, ldx, v, scale, acc);
      Step<MR, NP, 1>(xg, ldx, v, scale, acc);
      Step<MR, NP, 2>(xg, ldx, v, scale, acc);
      Step<MR, NP, 3>(xg, ldx, v, scale, acc);
    }
  }
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      Store(y + r * ldy + q * kP, acc[r][q][0], acc[r][q][1], valid - q * kP);
    }
  }
}

using KernelFn = void (*)(const float*, int64_t, int, const uint8_t*, int64_t, float*, int64_t,
                          int);

// Panels per pass for mr rows: 1 and 2 rows take two panels (four and eight fma chains in
// flight instead of two and four; the AVX-512 file says why), more rows one.
constexpr int MaxPanels(int mr) { return mr <= 2 ? 2 : 1; }

KernelFn Pick(int mr, int np) {
  switch (mr) {
    case 1:
      return np == 1 ? Kernel<1, 1> : Kernel<1, 2>;
    case 2:
      return np == 1 ? Kernel<2, 1> : Kernel<2, 2>;
    case 3:
      return Kernel<3, 1>;
    default:
      return Kernel<4, 1>;
  }
}

}  // namespace

void MatMulFp8Avx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                        float* y) {
  const int in = w.in(), out = w.out();
  const int64_t wstride = w.coded_panel_bytes();
  for (int r = r0; r < r1;) {  // row groups outside, panels inside (see the AVX-512 file)
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
