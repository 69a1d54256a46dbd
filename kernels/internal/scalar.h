// The scalar arithmetic of every codec, shared by the CPU reference, the AVX2 path (for its
// per-block scales) and the CUDA kernels, so that all paths run literally the same code.
//
// Private to kernels/: not a public contract. Everything here has internal linkage
// (`static inline`): the AVX2 translation unit is compiled with -mavx2, and an inline function
// with external linkage could be merged by the linker into a copy that uses AVX2 instructions
// on a CPU without them.
//
// Semantics (NVIDIA's host conversions in cuda_fp4.hpp / cuda_fp8.hpp, CUDA 13):
//   e2m1: round to nearest even on {0,.5,1,1.5,2,3,4,6}; |x| > 6 and +-Inf saturate to +-6;
//         NaN of either sign gives +6 (code 7); the sign of zero is kept (-0 -> code 8).
//   e4m3: (fn: bias 7, max 448, no Inf; 0x7f/0xff are NaN) round to nearest even, saturating
//         to +-448 (0x7e/0xfe); NaN of either sign gives 0x7f.
//   ue8m0: 2^(code-127); 0xff is NaN.
// Block rules (see kernels/quant.h): a block's amax propagates NaN (a NaN anywhere makes the
// scale NaN, so every element of the block decodes to NaN); Inf saturates the scale to the
// largest finite code. Dequantised NaN is always the canonical quiet NaN 0x7fc00000, so that
// CPU and GPU outputs (GPUs produce 0x7fffffff from arithmetic) are equal bit for bit.
//
// Floating-point assumptions: IEEE binary32 with round-to-nearest-even and without
// flush-to-zero for the x/s division and the value*s product (the default on x86-64 and in
// CUDA without -ftz/-use_fast_math). Contraction into FMA is disabled for these sources, but
// no expression here has an a*b+c shape anyway.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVTIER_KERNEL_FN static __host__ __device__ __forceinline__
#else
#define KVTIER_KERNEL_FN static inline
#endif

namespace kvtier::kernels::internal {

// Elements per block of each format.
constexpr int kFp4E4M3BlockElems = 16;
constexpr int kUe8m0BlockElems = 32;

// Canonical quiet NaN produced by every dequantisation path.
constexpr uint32_t kCanonicalNanBits = 0x7fc00000u;

// Lower bounds on a block's amax (quant.h): 6*2^-9, 6*2^-126 and 448*2^-126.
constexpr float kFp4E4M3AmaxFloor = 6.0f / 512.0f;
constexpr float kFp4Ue8m0AmaxFloor = 6.0f * 1.1754943508222875e-38f;  // 6 * 2^-126
constexpr float kFp8Ue8m0AmaxFloor = 448.0f * 1.1754943508222875e-38f;

KVTIER_KERNEL_FN uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVTIER_KERNEL_FN float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

KVTIER_KERNEL_FN float CanonicalNan(float v) { return v != v ? BitsFloat(kCanonicalNanBits) : v; }

// ---- scalar conversions ---------------------------------------------------------------------

// The ties go to the even code: .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; .25->0.
KVTIER_KERNEL_FN uint8_t ScalarFloatToE2M1(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 7;  // NaN -> +6
  const float a = BitsFloat(abs_bits);
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                   (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(code | ((u >> 31) << 3));
}

KVTIER_KERNEL_FN float ScalarE2M1ToFloat(uint8_t code) {
  const uint32_t mag = code & 7u;
  const uint32_t exp = mag >> 1;
  const uint32_t man = mag & 1u;
  uint32_t bits = 0;
  if (exp != 0) {
    bits = ((exp - 1u + 127u) << 23) | (man << 22);
  } else if (man != 0) {
    bits = 0x3f000000u;  // 0.5
  }
  return BitsFloat(bits | ((code & 8u) << 28));
}

KVTIER_KERNEL_FN uint8_t ScalarFloatToE4M3(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;  // NaN (either sign) -> 0x7f
  uint32_t res;
  if (a >= 0x3c800000u) {  // |x| >= 2^-6: e4m3 normal range (or saturation)
    // Round to nearest even, dropping 20 of the 23 mantissa bits, then rebias 127 -> 7.
    res = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    if (res > 0x7eu) res = 0x7eu;  // (448, 464] round to 448; above that, and Inf, saturate
  } else {
    // Subnormal range: round |x| to a multiple of 2^-9 (code = count; 8 is 2^-6, a normal).
    const uint32_t exp = a >> 23;
    if (exp < 110u) {  // |x| < 2^-16, far below half of 2^-9 (also fp32 subnormals)
      res = 0;
    } else {
      const uint32_t man = (a & 0x7fffffu) | 0x800000u;  // |x| = man * 2^(exp-150)
      const uint32_t shift = 141u - exp;                 // in [21, 31]
      const uint32_t half = 1u << (shift - 1u);
      const uint32_t rem = man & ((1u << shift) - 1u);
      res = man >> shift;
      if (rem > half || (rem == half && (res & 1u) != 0)) ++res;
    }
  }
  return static_cast<uint8_t>(res | ((u >> 31) << 7));
}

KVTIER_KERNEL_FN float ScalarE4M3ToFloat(uint8_t code) {
  const uint32_t mag = code & 0x7fu;
  if (mag == 0x7fu) return BitsFloat(kCanonicalNanBits);
  const uint32_t sign = (static_cast<uint32_t>(code) & 0x80u) << 24;
  if (mag < 8u) {  // subnormal: mag * 2^-9 (exact)
    return BitsFloat(FloatBits(static_cast<float>(mag) * (1.0f / 512.0f)) | sign);
  }
  return BitsFloat(((mag + (120u << 3)) << 20) | sign);
}

KVTIER_KERNEL_FN float ScalarUe8m0ToFloat(uint8_t code) {
  if (code == 0xffu) return BitsFloat(kCanonicalNanBits);
  if (code == 0u) return BitsFloat(0x00400000u);  // 2^-127, an fp32 subnormal
  return BitsFloat(static_cast<uint32_t>(code) << 23);
}

// ue8m0 code of 2^ceil(log2(r)) for r > 0, exact (no log2 call): NaN -> 0xff; results above
// 2^127 (only r = +Inf or r > 2^127) saturate to 0xfe.
KVTIER_KERNEL_FN uint8_t Ue8m0CeilLog2(float r) {
  const uint32_t a = FloatBits(r) & 0x7fffffffu;
  if (a > 0x7f800000u) return 0xff;
  const uint32_t exp = a >> 23;
  const uint32_t man = a & 0x7fffffu;
  if (exp == 0) return man > 0x400000u ? 1 : 0;  // subnormal r (not reached by the rules)
  const uint32_t code = exp + (man != 0 ? 1u : 0u);
  return static_cast<uint8_t>(code > 0xfeu ? 0xfeu : code);
}

// ---- block rules ------------------------------------------------------------------------------

struct BlockScale {
  uint8_t code;
  float value;
};

// max |x_i|, NaN-propagating (any NaN makes the result NaN).
KVTIER_KERNEL_FN float BlockAmax(const float* x, int elems) {
  float amax = 0.0f;
  for (int i = 0; i < elems; ++i) {
    const float a = BitsFloat(FloatBits(x[i]) & 0x7fffffffu);
    if (a > amax || a != a) amax = a;
    if (amax != amax) break;
  }
  return amax;
}

// max(amax, floor) that keeps a NaN amax.
KVTIER_KERNEL_FN float AmaxWithFloor(float amax, float floor) {
  return amax < floor ? floor : amax;
}

// s = e4m3_rne_satfinite(max(amax, 6*2^-9) / 6).
KVTIER_KERNEL_FN BlockScale ScaleFp4E4M3(float amax) {
  const uint8_t code = ScalarFloatToE4M3(AmaxWithFloor(amax, kFp4E4M3AmaxFloor) / 6.0f);
  return BlockScale{code, ScalarE4M3ToFloat(code)};
}

// s = 2^ceil(log2(max(amax, 6*2^-126) / 6)).
KVTIER_KERNEL_FN BlockScale ScaleFp4Ue8m0(float amax) {
  const uint8_t code = Ue8m0CeilLog2(AmaxWithFloor(amax, kFp4Ue8m0AmaxFloor) / 6.0f);
  return BlockScale{code, ScalarUe8m0ToFloat(code)};
}

// s = 2^ceil(log2(max(amax, 448*2^-126) / 448)).
KVTIER_KERNEL_FN BlockScale ScaleFp8Ue8m0(float amax) {
  const uint8_t code = Ue8m0CeilLog2(AmaxWithFloor(amax, kFp8Ue8m0AmaxFloor) / 448.0f);
  return BlockScale{code, ScalarUe8m0ToFloat(code)};
}

// clamp(v, -6, 6) that keeps NaN (which e2m1 then maps to +6).
KVTIER_KERNEL_FN float ClampFp4(float v) { return v < -6.0f ? -6.0f : (v > 6.0f ? 6.0f : v); }

KVTIER_KERNEL_FN uint8_t QuantizeE2M1(float x, float scale) {
  return ScalarFloatToE2M1(ClampFp4(x / scale));
}

KVTIER_KERNEL_FN uint8_t QuantizeE4M3(float x, float scale) { return ScalarFloatToE4M3(x / scale); }

// ---- one block --------------------------------------------------------------------------------

// FP4 codes of `elems` floats, two per byte (even element in the low nibble).
KVTIER_KERNEL_FN void PackFp4(const float* x, int elems, float scale, uint8_t* data) {
  for (int j = 0; j < elems; j += 2) {
    const uint32_t lo = QuantizeE2M1(x[j], scale);
    const uint32_t hi = QuantizeE2M1(x[j + 1], scale);
    data[j / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

KVTIER_KERNEL_FN void UnpackFp4(const uint8_t* data, int elems, float scale, float* out) {
  for (int j = 0; j < elems; j += 2) {
    out[j] = CanonicalNan(ScalarE2M1ToFloat(data[j / 2] & 0x0fu) * scale);
    out[j + 1] = CanonicalNan(ScalarE2M1ToFloat(data[j / 2] >> 4) * scale);
  }
}

KVTIER_KERNEL_FN void QuantizeBlockFp4E4M3(const float* x, uint8_t* data, uint8_t* scale) {
  const BlockScale s = ScaleFp4E4M3(BlockAmax(x, kFp4E4M3BlockElems));
  *scale = s.code;
  PackFp4(x, kFp4E4M3BlockElems, s.value, data);
}

KVTIER_KERNEL_FN void QuantizeBlockFp4Ue8m0(const float* x, uint8_t* data, uint8_t* scale) {
  const BlockScale s = ScaleFp4Ue8m0(BlockAmax(x, kUe8m0BlockElems));
  *scale = s.code;
  PackFp4(x, kUe8m0BlockElems, s.value, data);
}

KVTIER_KERNEL_FN void QuantizeBlockFp8Ue8m0(const float* x, uint8_t* data, uint8_t* scale) {
  const BlockScale s = ScaleFp8Ue8m0(BlockAmax(x, kUe8m0BlockElems));
  *scale = s.code;
  for (int i = 0; i < kUe8m0BlockElems; ++i) data[i] = QuantizeE4M3(x[i], s.value);
}

KVTIER_KERNEL_FN void DequantizeBlockFp4E4M3(const uint8_t* data, uint8_t scale, float* out) {
  UnpackFp4(data, kFp4E4M3BlockElems, ScalarE4M3ToFloat(scale), out);
}

KVTIER_KERNEL_FN void DequantizeBlockFp4Ue8m0(const uint8_t* data, uint8_t scale, float* out) {
  UnpackFp4(data, kUe8m0BlockElems, ScalarUe8m0ToFloat(scale), out);
}

KVTIER_KERNEL_FN void DequantizeBlockFp8Ue8m0(const uint8_t* data, uint8_t scale, float* out) {
  const float s = ScalarUe8m0ToFloat(scale);
  for (int i = 0; i < kUe8m0BlockElems; ++i) out[i] = CanonicalNan(ScalarE4M3ToFloat(data[i]) * s);
}

}  // namespace kvtier::kernels::internal
