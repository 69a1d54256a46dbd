// The AVX2 path of kernels/quant.h. This translation unit alone is compiled with -mavx2 (no
// -mfma: contraction could change results); quant.cc calls into it only after
// Avx2Supported(). Keep it free of std:: templates and inline functions with external
// linkage, whose AVX2-compiled copies the linker could pick for non-AVX2 callers.
//
// Bit-exact with the reference (kernels/internal/scalar.h) by construction:
//  - the per-block scale is computed by the same scalar functions (one per 16 or 32 elements);
//  - x/s is a true IEEE division (_mm256_div_ps), never a reciprocal multiplication;
//  - e2m1 is a sum of 7 threshold comparisons that encode the round-to-nearest-even ties;
//  - e4m3 rounds normals with the integer RNE of the reference and subnormals by adding 2^14
//    (whose ulp is 2^-9, so the IEEE add performs the RNE to a multiple of 2^-9);
//  - NaN and Inf take explicit masks; decoded NaNs are canonicalised as in the reference.
//  - block tails (an odd FP4 E4M3 block) go through the scalar block functions.
#include <immintrin.h>

#include "kernels/internal/backends.h"
#include "kernels/internal/scalar.h"

namespace kvtier::kernels::internal {
namespace {

__m256 Abs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

__m256 Unordered(__m256 v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }

// max |v_i| over `count` vectors; NaN if any lane is NaN (as BlockAmax).
float Amax(const __m256* v, int count) {
  __m256 m = Abs(v[0]);
  __m256 nan = Unordered(v[0]);
  for (int i = 1; i < count; ++i) {
    m = _mm256_max_ps(m, Abs(v[i]));
    nan = _mm256_or_ps(nan, Unordered(v[i]));
  }
  if (_mm256_movemask_ps(nan) != 0) return BitsFloat(kCanonicalNanBits);
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_shuffle_ps(r, r, 1));
  return _mm_cvtss_f32(r);
}

// Adds 1 to the lanes of `count` where `mask` is set (a true comparison is all ones = -1).
__m256i CountIf(__m256i count, __m256 mask) {
  return _mm256_sub_epi32(count, _mm256_castps_si256(mask));
}

// e2m1 codes (one per int32 lane) of 8 floats; identical to ScalarFloatToE2M1 (saturating, so
// the reference's clamp to +-6 changes nothing).
__m256i E2M1Codes(__m256 y) {
  const __m256 a = Abs(y);
  __m256i c = _mm256_setzero_si256();
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_GT_OQ));
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(0.75f), _CMP_GE_OQ));
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(1.25f), _CMP_GT_OQ));
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(1.75f), _CMP_GE_OQ));
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(2.5f), _CMP_GT_OQ));
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(3.5f), _CMP_GE_OQ));
  c = CountIf(c, _mm256_cmp_ps(a, _mm256_set1_ps(5.0f), _CMP_GT_OQ));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(y), 31), 3);
  c = _mm256_or_si256(c, sign);
  return _mm256_blendv_epi8(c, _mm256_set1_epi32(7), _mm256_castps_si256(Unordered(y)));
}

// e4m3 codes (one per int32 lane) of 8 floats; identical to ScalarFloatToE4M3.
__m256i E4M3Codes(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), 7);
  // normal range: integer RNE dropping 20 mantissa bits, rebias, saturate at 0x7e
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i normal = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7ffff)), odd);
  normal = _mm256_sub_epi32(_mm256_srli_epi32(normal, 20), _mm256_set1_epi32(120 << 3));
  normal = _mm256_min_epu32(normal, _mm256_set1_epi32(0x7e));
  // subnormal range: |x| + 2^14 rounds |x| to a multiple of 2^-9; the count is the code
  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(sum), _mm256_set1_epi32(0x46800000));
  const __m256i is_normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x3c7fffff));
  __m256i c = _mm256_or_si256(_mm256_blendv_epi8(sub, normal, is_normal), sign);
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(c, _mm256_set1_epi32(0x7f), nan);
}

// 32 codes (< 256, one per int32 lane, in element order across c0..c3) -> 32 bytes in order.
__m256i PackBytes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 e2m1 codes, one per byte -> 16 bytes, element 2j in the low nibble of byte j.
__m128i PackNibbles(__m256i bytes) {
  __m256i t = _mm256_or_si256(bytes, _mm256_srli_epi16(bytes, 4));
  t = _mm256_and_si256(t, _mm256_set1_epi16(0x00ff));
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0x08);
  return _mm256_castsi256_si128(p);
}

void Load4(const float* x, __m256* v) {
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
}

// 32 floats -> 16 bytes of e2m1 codes: v[0..1] scaled by s0, v[2..3] by s1.
__m128i Fp4Codes32(const __m256* v, float s0, float s1) {
  const __m256 d0 = _mm256_set1_ps(s0);
  const __m256 d1 = _mm256_set1_ps(s1);
  return PackNibbles(
      PackBytes(E2M1Codes(_mm256_div_ps(v[0], d0)), E2M1Codes(_mm256_div_ps(v[1], d0)),
                E2M1Codes(_mm256_div_ps(v[2], d1)), E2M1Codes(_mm256_div_ps(v[3], d1))));
}

void QuantizeFp4E4M3(const float* x, size_t blocks, uint8_t* data, uint8_t* scales) {
  size_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two 16-element blocks per iteration
    __m256 v[4];
    Load4(x + b * 16, v);
    const BlockScale s0 = ScaleFp4E4M3(Amax(v, 2));
    const BlockScale s1 = ScaleFp4E4M3(Amax(v + 2, 2));
    scales[b] = s0.code;
    scales[b + 1] = s1.code;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + b * 8), Fp4Codes32(v, s0.value, s1.value));
  }
  if (b < blocks) QuantizeBlockFp4E4M3(x + b * 16, data + b * 8, scales + b);
}

void QuantizeFp4Ue8m0(const float* x, size_t blocks, uint8_t* data, uint8_t* scales) {
  for (size_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    Load4(x + b * 32, v);
    const BlockScale s = ScaleFp4Ue8m0(Amax(v, 4));
    scales[b] = s.code;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + b * 16), Fp4Codes32(v, s.value, s.value));
  }
}

void QuantizeFp8Ue8m0(const float* x, size_t blocks, uint8_t* data, uint8_t* scales) {
  for (size_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    Load4(x + b * 32, v);
    const BlockScale s = ScaleFp8Ue8m0(Amax(v, 4));
    scales[b] = s.code;
    const __m256 d = _mm256_set1_ps(s.value);
    const __m256i codes =
        PackBytes(E4M3Codes(_mm256_div_ps(v[0], d)), E4M3Codes(_mm256_div_ps(v[1], d)),
                  E4M3Codes(_mm256_div_ps(v[2], d)), E4M3Codes(_mm256_div_ps(v[3], d)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(data + b * 32), codes);
  }
}

// r with every NaN lane (and every lane of `force_nan`) replaced by the canonical NaN.
__m256 Canonical(__m256 r, __m256 force_nan) {
  const __m256 bad = _mm256_or_ps(force_nan, Unordered(r));
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(kCanonicalNanBits)), bad);
}

// 8 bytes of e2m1 pairs -> 16 floats value(code) * s.
void DecodeFp4x16(const uint8_t* src, float s, float* out) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m128i codes = _mm_unpacklo_epi8(lo, hi);  // 16 codes in element order
  const __m256 grid = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 scale = _mm256_set1_ps(s);
  const __m256 no_nan = _mm256_setzero_ps();
  for (int half = 0; half < 2; ++half) {
    const __m256i c = _mm256_cvtepu8_epi32(half == 0 ? codes : _mm_srli_si128(codes, 8));
    const __m256 mag = _mm256_permutevar8x32_ps(grid, c);  // uses the low 3 bits of c
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
    const __m256 value = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
    _mm256_storeu_ps(out + 8 * half, Canonical(_mm256_mul_ps(value, scale), no_nan));
  }
}

// 8 e4m3 bytes -> 8 floats value(code) * s.
__m256 DecodeFp8x8(const uint8_t* src, __m256 scale) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_slli_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(120 << 3)), 20);
  const __m256 subnormals = _mm256_setr_ps(0.0f, 1.0f / 512, 2.0f / 512, 3.0f / 512, 4.0f / 512,
                                           5.0f / 512, 6.0f / 512, 7.0f / 512);
  const __m256i sub = _mm256_castps_si256(_mm256_permutevar8x32_ps(subnormals, mag));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  __m256i bits = _mm256_blendv_epi8(normal, sub, is_sub);
  bits = _mm256_or_si256(bits, _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24));
  const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
  return Canonical(_mm256_mul_ps(_mm256_castsi256_ps(bits), scale), _mm256_castsi256_ps(nan));
}

}  // namespace

void Avx2Quantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data, uint8_t* scales) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      QuantizeFp4E4M3(x, blocks, data, scales);
      return;
    case QuantFormat::kFp4Ue8m0x32:
      QuantizeFp4Ue8m0(x, blocks, data, scales);
      return;
    case QuantFormat::kFp8Ue8m0x32:
      QuantizeFp8Ue8m0(x, blocks, data, scales);
      return;
  }
}

void Avx2Dequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t blocks,
                    float* out) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      for (size_t b = 0; b < blocks; ++b) {
        DecodeFp4x16(data + b * 8, ScalarE4M3ToFloat(scales[b]), out + b * 16);
      }
      return;
    case QuantFormat::kFp4Ue8m0x32:
      for (size_t b = 0; b < blocks; ++b) {
        const float s = ScalarUe8m0ToFloat(scales[b]);
        DecodeFp4x16(data + b * 16, s, out + b * 32);
        DecodeFp4x16(data + b * 16 + 8, s, out + b * 32 + 16);
      }
      return;
    case QuantFormat::kFp8Ue8m0x32:
      for (size_t b = 0; b < blocks; ++b) {
        const __m256 s = _mm256_set1_ps(ScalarUe8m0ToFloat(scales[b]));
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(out + b * 32 + 8 * i, DecodeFp8x8(data + b * 32 + 8 * i, s));
        }
      }
      return;
  }
}

void Avx2FloatToE2M1(const float* x, size_t count, uint8_t* codes) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), E2M1Codes(_mm256_loadu_ps(x + i)));
    for (int j = 0; j < 8; ++j) codes[i + j] = static_cast<uint8_t>(lanes[j]);
  }
  for (; i < count; ++i) codes[i] = ScalarFloatToE2M1(x[i]);
}

void Avx2FloatToE4M3(const float* x, size_t count, uint8_t* codes) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), E4M3Codes(_mm256_loadu_ps(x + i)));
    for (int j = 0; j < 8; ++j) codes[i + j] = static_cast<uint8_t>(lanes[j]);
  }
  for (; i < count; ++i) codes[i] = ScalarFloatToE4M3(x[i]);
}

}  // namespace kvtier::kernels::internal
