// Block-scaled low-precision codecs: the public contract of kernels/.
//
// Formats (see docs/format/unit.md and the model reference, section 5):
//   kFp4E4M3x16   E2M1 codes, one E4M3 scale per 16 elements. The global-KV format:
//                 s = e4m3_rne_satfinite(max(amax, 6*2^-9) / 6); q = e2m1_rne(clamp(x/s, -6, 6)).
//   kFp4Ue8m0x32  E2M1 codes, one UE8M0 scale per 32 elements (DeepSeek's ceil rule, never
//                 clips): s = 2^ceil(log2(max(amax, 6*2^-126) / 6)).
//   kFp8Ue8m0x32  E4M3 codes, one UE8M0 scale per 32 elements (SWA rows, Engram rows):
//                 s = 2^ceil(log2(max(amax, 448*2^-126) / 448)); q = e4m3_rne(x/s).
//
// Memory layout of one quantised row of n elements (n a multiple of the block size):
//   data:   n/2 bytes for FP4 (element 2j in the low nibble of byte j, 2j+1 in the high
//           nibble) or n bytes for FP8;
//   scales: n/block bytes, one code per block, in element order.
// Rows are contiguous: row r's data starts at data + r*DataBytes(fmt, n), and its scales at
// scales + r*ScaleBytes(fmt, n).
//
// Backends: kReference is the scalar CPU reference every other path must match bit for bit
// (tests/kernels differential test). kSimd is the vectorised CPU path (AVX2 when the CPU has
// it, chosen at run time; otherwise it falls back to the reference). kCuda runs the CUDA
// kernels (kernels/*.cu) on host buffers (it copies to and from the device) and returns
// Unavailable when CUDA is not compiled in or no GPU is present. kAuto picks kSimd.
//
// Thread safety: all functions are pure; concurrent calls on disjoint buffers are safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace kvtier::kernels {

enum class QuantFormat : uint8_t {
  kFp4E4M3x16 = 1,
  kFp4Ue8m0x32 = 2,
  kFp8Ue8m0x32 = 3,
};

enum class Backend : uint8_t { kAuto, kReference, kSimd, kCuda };

// Limit on rows*n of one call (2^36 elements = 256 GiB of fp32): larger calls are
// InvalidArgument, which also keeps every byte count below SIZE_MAX.
inline constexpr size_t kQuantElemsMax = size_t{1} << 36;

// Elements per scale block: 16 or 32 (0 for a value outside QuantFormat).
size_t BlockElems(QuantFormat fmt);
// Bytes of codes / scales for one row of n elements.
size_t DataBytes(QuantFormat fmt, size_t n);
size_t ScaleBytes(QuantFormat fmt, size_t n);

// Scalar conversions (the reference semantics, NVIDIA's host rounding):
// e2m1: RNE on {0,.5,1,1.5,2,3,4,6}, saturating, NaN -> +6 (code 7), sign kept for zero.
uint8_t FloatToE2M1(float x);
float E2M1ToFloat(uint8_t code);  // code in [0,16)
// e4m3 (fn, bias 7, max 448, no inf): RNE, saturating to +-448, NaN -> 0x7f.
uint8_t FloatToE4M3(float x);
float E4M3ToFloat(uint8_t code);
// ue8m0: value 2^(code-127); 0xff is NaN.
float Ue8m0ToFloat(uint8_t code);

// Quantises `rows` rows of n floats (row-major). Returns InvalidArgument when n is not a
// multiple of the block size, a pointer is null, the format is unknown or rows*n exceeds
// kQuantElemsMax; Unavailable for kCuda without a GPU. Buffers are caller-owned and not
// retained; on error the outputs are untouched except for a kCuda device failure (Internal).
// A block's amax propagates NaN: a block that contains a NaN gets a NaN scale (E4M3 0x7f,
// UE8M0 0xff) and dequantises to all NaN. An Inf saturates the scale (0x7e = 448 or
// 0xfe = 2^127) and its element's code (+-6 or +-448).
Status Quantize(QuantFormat fmt, const float* x, size_t rows, size_t n, uint8_t* data,
                uint8_t* scales, Backend backend = Backend::kAuto);

// Inverse of Quantize: out[i] = value(code_i) * scale(block of i), exact in binary32 (the
// product of a <=4-bit significand and a power of two or an E4M3 value never rounds; it can
// overflow to Inf only with a UE8M0 scale >= 2^120, e.g. for inputs near FLT_MAX). NaN codes or
// scales give the canonical quiet NaN 0x7fc00000 on every backend.
Status Dequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t rows,
                  size_t n, float* out, Backend backend = Backend::kAuto);

// Quantise-then-dequantise in place (what the model's QAT path does to its caches).
Status RoundTrip(QuantFormat fmt, float* x, size_t rows, size_t n,
                 Backend backend = Backend::kAuto);

// Whether a backend runs as its own path in this process: kAuto and kReference always; kSimd
// when the CPU has AVX2 (otherwise kSimd still works, as the reference); kCuda when CUDA is
// compiled in and a device is present (otherwise kCuda calls return Unavailable).
bool BackendAvailable(Backend backend);

// OK when CUDA is compiled in and a device is present (checked once per process); otherwise
// Unavailable with the reason. Other modules' CUDA paths (engine/cuda) gate on this too.
Status CudaDeviceStatus();

}  // namespace kvtier::kernels
