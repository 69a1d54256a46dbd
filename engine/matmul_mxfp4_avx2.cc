// The AVX2/FMA micro-kernel of MatMulCpu over kMxfp4 panels (engine/matmul.h). Compiled with
// -mavx2 -mfma; matmul.cc calls it only after cpuid reported both.
//
// As matmul_mxfp4_avx512.cc, on two 8-lane halves of a panel: a pass computes MR rows (1-4) x
// one panel. Per input the 8-entry permute takes the shifted code's low three bits (the
// magnitude), the code's sign bit is moved to the float's sign bit and xor-ed in, then the
// product with the block's scale (exact) feeds one fused multiply-add per row and half, k in
// order: the contract's fma chain over the decoded weights, the same bits as the float kernels.
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

// Input t's weights of 8 lanes whose code words are v (t's code in bits [4t, 4t + 4)).
template <int T>
inline __m256 Decode(__m256i v, __m256 magnitudes, __m256 scale) {
  // The permute reads each lane's low three bits (the magnitude); the sign, bit 4t + 3, goes
  // to bit 31.
  const __m256 m = _mm256_permutevar8x32_ps(magnitudes, _mm256_srli_epi32(v, 4 * T));
  const __m256 sign = _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_slli_epi32(v, 28 - 4 * T), _mm256_set1_epi32(INT32_MIN)));
  return _mm256_mul_ps(_mm256_xor_ps(m, sign), scale);
}

template <int MR, int NP, int T>
inline void Step(const float* xg, int64_t ldx, const __m256i (&v)[NP][2], __m256 magnitudes,
                 const __m256 (&scale)[NP][2], __m256 (&acc)[MR][NP][2]) {
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
    const __m256 w_lo = Decode<T>(v[q][0], magnitudes, scale[q][0]);
    const __m256 w_hi = Decode<T>(v[q][1], magnitudes, scale[q][1]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xg + r * ldx + T);
      acc[r][q][0] = _mm256_fmadd_ps(xv, w_lo, acc[r][q][0]);
      acc[r][q][1] = _mm256_fmadd_ps(xv, w_hi, acc[r][q][1]);
    }
  }
}

inline __m256 Scale(const uint8_t* s) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))), 23));
}

// MR rows x NP panels (y's panel q at y + q * 16).
template <int MR, int NP>
void Kernel(const float* x, int64_t ldx, int in, const uint8_t* w, int64_t wstride, float* y,
            int64_t ldy, int valid) {
  const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
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
      const uint8_t* blk = w + q * wstride + static_cast<int64_t>(b) * kMxfp4BlockBytes;
      scale[q][0] = Scale(blk);
      scale[q][1] = Scale(blk + 8);
    }
    const float* xb = x + static_cast<int64_t>(b) * kCodedBlockInputs;
    for (int g = 0; g < kCodedBlockInputs / kMxfp4GroupInputs; ++g) {
      __m256i v[NP][2];
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        const uint8_t* gp =
            w + q * wstride + static_cast<int64_t>(b) * kMxfp4BlockBytes + kP + g * kP * 4;
        v[q][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp));
        v[q][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 32));
      }
      const float* xg = xb + g * kMxfp4GroupInputs;
      Step<MR, NP, 0>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 1>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 2>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 3>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 4>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 5>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 6>(xg, ldx, v, magnitudes, scale, acc);
      Step<MR, NP, 7>(xg, ldx, v, magnitudes, scale, acc);
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

void MatMulMxfp4Avx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
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
