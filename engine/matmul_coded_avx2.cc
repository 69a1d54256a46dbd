// The AVX2/FMA micro-kernels of MatMulCpu over coded panels (engine/matmul.h: kMxfp4, kFp8).
// Compiled with -mavx2 -mfma; matmul.cc calls them only after cpuid reported both.
//
// As matmul_coded_avx512.cc (the formats' decoding is described there), on two 8-lane halves of
// a panel: a pass computes MR rows (1-4) x NP panels (1-2). AVX2 has no 16-entry permute, so the
// MXFP4 decoding looks the code's low three bits (the magnitude) up with an 8-entry one and
// moves its sign bit to the float's; the FP8 decoding ORs the sign in. Every output is the
// contract's fma chain over the decoded weights, the same bits as the float kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "engine/matmul.h"
#include "engine/matmul_passes.h"

namespace kvtier::engine::internal {
namespace {

constexpr int kP = kMatMulPanelOutputs;
static_assert(kP == 16, "a panel is two 8-float vectors");
constexpr int kMaxRows = 4;

// The 8 scale codes at s, widened to 32-bit lanes.
inline __m256i ScaleCodes(const uint8_t* s) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
}

struct Mxfp4 {
  static constexpr int kBlockBytes = kMxfp4BlockBytes;
  static constexpr int kGroupInputs = kMxfp4GroupInputs;
  static __m256 Scale(const uint8_t* s) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(ScaleCodes(s), 23));
  }
  // Input T's weights of 8 lanes whose code words are v (T's code in bits [4T, 4T + 4)).
  template <int T>
  static __m256 Decode(__m256i v, __m256 scale) {
    const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    // The permute reads each lane's low three bits; the sign, bit 4T + 3, goes to bit 31.
    const __m256 m = _mm256_permutevar8x32_ps(magnitudes, _mm256_srli_epi32(v, 4 * T));
    const __m256 sign = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(v, 28 - 4 * T), _mm256_set1_epi32(INT32_MIN)));
    return _mm256_mul_ps(_mm256_xor_ps(m, sign), scale);
  }
};

struct Fp8 {
  static constexpr int kBlockBytes = kFp8BlockBytes;
  static constexpr int kGroupInputs = kFp8GroupInputs;
  // 2^(s - 7): a float with exponent field s + 120.
  static __m256 Scale(const uint8_t* s) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(ScaleCodes(s), _mm256_set1_epi32(120)), 23));
  }
  template <int T>
  static __m256 Decode(__m256i v, __m256 scale) {
    const __m256i mag =
        _mm256_and_si256(T < 3 ? _mm256_slli_epi32(v, 20 - 8 * T) : _mm256_srli_epi32(v, 4),
                         _mm256_set1_epi32(0x07f00000));
    const __m256i sign = _mm256_and_si256(T < 3 ? _mm256_slli_epi32(v, 24 - 8 * T) : v,
                                          _mm256_set1_epi32(INT32_MIN));
    const __m256 m = _mm256_mul_ps(_mm256_castsi256_ps(mag), scale);
    return _mm256_or_ps(m, _mm256_castsi256_ps(sign));
  }
};

template <typename F, int MR, int NP, int T>
inline void Step(const float* xg, int64_t ldx, const __m256i (&v)[NP][2],
                 const __m256 (&scale)[NP][2], __m256 (&acc)[MR][NP][2]) {
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
    const __m256 w_lo = F::template Decode<T>(v[q][0], scale[q][0]);
    const __m256 w_hi = F::template Decode<T>(v[q][1], scale[q][1]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xg + r * ldx + T);
      acc[r][q][0] = _mm256_fmadd_ps(xv, w_lo, acc[r][q][0]);
      acc[r][q][1] = _mm256_fmadd_ps(xv, w_hi, acc[r][q][1]);
    }
  }
}

// MR rows x NP panels (y's panel q at y + q * 16).
template <typename F, int MR, int NP>
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
    const uint8_t* blk = w + static_cast<int64_t>(b) * F::kBlockBytes;
    __m256 scale[NP][2];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      scale[q][0] = F::Scale(blk + q * wstride);
      scale[q][1] = F::Scale(blk + q * wstride + 8);
    }
    const float* xb = x + static_cast<int64_t>(b) * kCodedBlockInputs;
    for (int g = 0; g < kCodedBlockInputs / F::kGroupInputs; ++g) {
      __m256i v[NP][2];
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        const uint8_t* gp = blk + q * wstride + kP + g * kP * 4;
        v[q][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp));
        v[q][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 32));
      }
      const float* xg = xb + g * F::kGroupInputs;
      [&]<int... T>(std::integer_sequence<int, T...>) {
        (Step<F, MR, NP, T>(xg, ldx, v, scale, acc), ...);
      }
      (std::make_integer_sequence<int, F::kGroupInputs>());
    }
  }
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      StoreAvx2(y + r * ldy + q * kP, acc[r][q][0], acc[r][q][1], valid - q * kP);
    }
  }
}

using KernelFn = void (*)(const float*, int64_t, int, const uint8_t*, int64_t, float*, int64_t,
                          int);

// Panels per pass for mr rows: 1 and 2 rows take two panels (four and eight fma chains in
// flight instead of two and four; the AVX-512 file says why), more rows one.
constexpr int MaxPanels(int mr) { return mr <= 2 ? 2 : 1; }

template <typename F>
KernelFn Pick(int mr, int np) {
  switch (mr) {
    case 1:
      return np == 1 ? Kernel<F, 1, 1> : Kernel<F, 1, 2>;
    case 2:
      return np == 1 ? Kernel<F, 2, 1> : Kernel<F, 2, 2>;
    case 3:
      return Kernel<F, 3, 1>;
    default:
      return Kernel<F, 4, 1>;
  }
}

}  // namespace

void MatMulMxfp4Avx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                          float* y) {
  RunCodedPasses<kMaxRows>(x, r0, r1, w, p0, p1, y, Pick<Mxfp4>, MaxPanels);
}

void MatMulFp8Avx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                        float* y) {
  RunCodedPasses<kMaxRows>(x, r0, r1, w, p0, p1, y, Pick<Fp8>, MaxPanels);
}

}  // namespace kvtier::engine::internal
