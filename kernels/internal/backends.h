// Entry points of the individual backends behind kernels/quant.h. Private to kernels/ (and to
// tests/kernels, which drive the AVX2 conversions directly).
//
// All functions work on `blocks` whole scale blocks laid out flat: because rows are
// contiguous and n is a multiple of the block size, `rows` rows of n elements are exactly
// rows*n/BlockElems(fmt) consecutive blocks. Arguments are validated by quant.cc; these
// functions trust them (non-null pointers, known format).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "kernels/quant.h"

namespace kvtier::kernels::internal {

// ---- scalar reference (quant_ref.cc) ----
void RefQuantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data, uint8_t* scales);
void RefDequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t blocks,
                   float* out);

// ---- AVX2 (quant_avx2.cc, compiled with -mavx2; call only when Avx2Supported()) ----
// Whether this CPU and OS support AVX2 (__builtin_cpu_supports, checked once).
bool Avx2Supported();
void Avx2Quantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data, uint8_t* scales);
void Avx2Dequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t blocks,
                    float* out);
// Element-wise conversions, one code per byte (test hooks for the vector conversion code).
void Avx2FloatToE2M1(const float* x, size_t count, uint8_t* codes);
void Avx2FloatToE4M3(const float* x, size_t count, uint8_t* codes);

// ---- CUDA (kernels/cuda/backend.cu; defined only when KVTIER_WITH_CUDA) ----
#ifdef KVTIER_WITH_CUDA
// OK when a device is usable; Unavailable (with the CUDA error text) otherwise.
Status CudaDeviceStatus();
// Host buffers in, host buffers out; copies through device memory in bounded chunks.
Status CudaQuantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data, uint8_t* scales);
Status CudaDequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t blocks,
                      float* out);
#endif

}  // namespace kvtier::kernels::internal
