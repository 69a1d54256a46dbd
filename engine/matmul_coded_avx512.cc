// The AVX-512 micro-kernels of MatMulCpu over coded panels (engine/matmul.h: kMxfp4, kFp8).
// Compiled with -mavx512f -mavx2 -mfma; matmul.cc calls them only after cpuid reported
// AVX-512F, AVX2 and FMA.
//
// A pass computes MR rows (1-8) x NP panels (16 outputs each, one zmm per row and panel). Per
// block of 32 inputs it turns the panel's 16 scale codes into 16 power-of-two floats; per group
// of inputs it loads one 16-lane vector of code words, and per input decodes that input's code
// in every lane, exactly, and issues one fused multiply-add per row, k in order: every output is
// the contract's fma chain over the decoded weights, the same bits as the float kernels. The
// formats differ only in the decoding (a policy struct each):
//   Mxfp4  scale 2^(s - 127) (the exponent field alone, s in [1, 254]); the input's nibble
//          shifted down and looked up in the 16-entry E2M1 table with one permute (which reads
//          only the low four bits), times the scale (a <= 3-bit significand times a power of
//          two: exact).
//   Fp8    the code's low seven bits shifted into a float's exponent and mantissa fields (bits
//          20-26) read its magnitude times 2^-120 exactly (E4M3 subnormals become float
//          subnormals, so MXCSR's DAZ must be off, the default), times the scale 2^(s - 7)
//          (a float with exponent field s + 120, s in [0, 134]), then the sign bit merged in.
//
// GCC 12's AVX-512 headers start widening, shift and permute intrinsics from a self-initialised
// "undefined" vector, which -Wmaybe-uninitialized reports once inlined (GCC bug 105593); the
// instructions overwrite every lane. (Clang has no such warning and would reject its name.)
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "engine/matmul.h"
#include "engine/matmul_passes.h"

namespace kvtier::engine::internal {
namespace {

constexpr int kP = kMatMulPanelOutputs;
static_assert(kP == 16, "a panel is one 16-float vector");
constexpr int kMaxRows = 8;

inline __m512i ScaleCodes(const uint8_t* blk) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
}

struct Mxfp4 {
  static constexpr int kBlockBytes = kMxfp4BlockBytes;
  static constexpr int kGroupInputs = kMxfp4GroupInputs;
  static __m512 Scale(const uint8_t* blk) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(ScaleCodes(blk), 23));
  }
  // Input T's weights of 16 lanes whose code words are v.
  template <int T>
  static __m512 Decode(__m512i v, __m512 scale) {
    // E2M1 codes 0-15: sign in bit 3 (code 8 is -0, as kernels::E2M1ToFloat decodes it).
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                        -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * T), table), scale);
  }
};

struct Fp8 {
  static constexpr int kBlockBytes = kFp8BlockBytes;
  static constexpr int kGroupInputs = kFp8GroupInputs;
  static __m512 Scale(const uint8_t* blk) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(ScaleCodes(blk), _mm512_set1_epi32(120)), 23));
  }
  template <int T>
  static __m512 Decode(__m512i v, __m512 scale) {
    const __m512i mag_field = _mm512_set1_epi32(0x07f00000);
    const __m512i sign_bit = _mm512_set1_epi32(INT32_MIN);
    // Code bits [8T, 8T + 7) to float bits [20, 27); code bit 8T + 7 to bit 31.
    const __m512i mag = _mm512_and_si512(
        T < 3 ? _mm512_slli_epi32(v, 20 - 8 * T) : _mm512_srli_epi32(v, 4), mag_field);
    const __m512i sign = T < 3 ? _mm512_slli_epi32(v, 24 - 8 * T) : v;
    const __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(mag), scale);
    // m | (sign & sign_bit): the product is non-negative, so this sets its sign.
    return _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(_mm512_castps_si512(m), sign, sign_bit, 0xf8));
  }
};

template <typename F, int MR, int NP, int T>
inline void Step(const float* xg, int64_t ldx, const __m512i (&v)[NP], const __m512 (&scale)[NP],
                 __m512 (&acc)[MR][NP]) {
#pragma GCC unroll 8
  for (int q = 0; q < NP; ++q) {
    const __m512 w_t = F::template Decode<T>(v[q], scale[q]);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      acc[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + T]), w_t, acc[r][q]);
    }
  }
}

// MR rows x NP panels (y's panel q at y + q * 16).
template <typename F, int MR, int NP>
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
    const uint8_t* blk = w + static_cast<int64_t>(b) * F::kBlockBytes;
    __m512 scale[NP];
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q) scale[q] = F::Scale(blk + q * wstride);
    const float* xb = x + static_cast<int64_t>(b) * kCodedBlockInputs;
    for (int g = 0; g < kCodedBlockInputs / F::kGroupInputs; ++g) {
      __m512i v[NP];
#pragma GCC unroll 8
      for (int q = 0; q < NP; ++q) v[q] = _mm512_loadu_si512(blk + q * wstride + kP + g * kP * 4);
      const float* xg = xb + g * F::kGroupInputs;
      [&]<int... T>(std::integer_sequence<int, T...>) {
        (Step<F, MR, NP, T>(xg, ldx, v, scale, acc), ...);
      }
      (std::make_integer_sequence<int, F::kGroupInputs>());
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
// half the speed of 8 (kvtier_bench_matmul, "routed experts", MXFP4).
constexpr int MaxPanels(int mr) { return mr == 1 ? 8 : mr == 2 ? 4 : mr <= 4 ? 2 : 1; }

template <typename F, int MR, int... Q>
constexpr std::array<KernelFn, sizeof...(Q)> Row(std::integer_sequence<int, Q...>) {
  return {Kernel<F, MR, Q + 1>...};
}

template <typename F>
KernelFn Pick(int mr, int np) {
  static constexpr auto k1 = Row<F, 1>(std::make_integer_sequence<int, MaxPanels(1)>());
  static constexpr auto k2 = Row<F, 2>(std::make_integer_sequence<int, MaxPanels(2)>());
  static constexpr auto k3 = Row<F, 3>(std::make_integer_sequence<int, MaxPanels(3)>());
  static constexpr auto k4 = Row<F, 4>(std::make_integer_sequence<int, MaxPanels(4)>());
  static constexpr KernelFn k5_8[4] = {Kernel<F, 5, 1>, Kernel<F, 6, 1>, Kernel<F, 7, 1>,
                                       Kernel<F, 8, 1>};
  switch (mr) {
    case 1:
      return k1[np - 1];
    case 2:
      return k2[np - 1];
    case 3:
      return k3[np - 1];
    case 4:
      return k4[np - 1];
    default:
      return k5_8[mr - 5];
  }
}

}  // namespace

void MatMulMxfp4Avx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                            float* y) {
  RunCodedPasses<kMaxRows>(x, r0, r1, w, p0, p1, y, Pick<Mxfp4>, MaxPanels);
}

void MatMulFp8Avx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                          float* y) {
  RunCodedPasses<kMaxRows>(x, r0, r1, w, p0, p1, y, Pick<Fp8>, MaxPanels);
}

}  // namespace kvtier::engine::internal

#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
