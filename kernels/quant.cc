// Argument checks and backend dispatch for kernels/quant.h.
#include "kernels/quant.h"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/internal/backends.h"
#include "kernels/internal/scalar.h"

namespace kvtier::kernels {
namespace {

// RoundTrip quantises through a temporary buffer of at most this many elements at a time
// (whole rows; a single row larger than this is processed alone).
constexpr size_t kRoundTripChunkElemsMax = size_t{1} << 20;
// RoundTrip's per-thread buffers are released after a call that grew them past this.
constexpr size_t kRoundTripKeepBytes = size_t{64} << 10;

bool KnownFormat(QuantFormat fmt) {
  return fmt == QuantFormat::kFp4E4M3x16 || fmt == QuantFormat::kFp4Ue8m0x32 ||
         fmt == QuantFormat::kFp8Ue8m0x32;
}

// Checks the shape and returns the number of scale blocks in *blocks.
Status CheckShape(QuantFormat fmt, size_t rows, size_t n, size_t* blocks) {
  if (!KnownFormat(fmt)) {
    return Status::InvalidArgument("unknown quant format " + std::to_string(static_cast<int>(fmt)));
  }
  const size_t block = BlockElems(fmt);
  if (n % block != 0) {
    return Status::InvalidArgument("n=" + std::to_string(n) + " is not a multiple of the block (" +
                                   std::to_string(block) + ")");
  }
  if (n != 0 && rows > kQuantElemsMax / n) {
    return Status::InvalidArgument("rows*n exceeds kQuantElemsMax");
  }
  *blocks = rows * n / block;
  return Status::Ok();
}

// kAuto -> kSimd; kSimd -> kReference on a CPU without AVX2.
Backend Resolve(Backend backend) {
  if (backend == Backend::kAuto) backend = Backend::kSimd;
  if (backend == Backend::kSimd && !internal::Avx2Supported()) backend = Backend::kReference;
  return backend;
}

Status CudaUnavailable() {
#ifdef KVTIER_WITH_CUDA
  return internal::CudaDeviceStatus();
#else
  return Status::Unavailable("kvtier was built without CUDA (KVTIER_WITH_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace

namespace internal {
// Defined here, not in quant_avx2.cc, so that no AVX2 instruction runs before the check.
bool Avx2Supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return supported;
}
}  // namespace internal

size_t BlockElems(QuantFormat fmt) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      return internal::kFp4E4M3BlockElems;
    case QuantFormat::kFp4Ue8m0x32:
    case QuantFormat::kFp8Ue8m0x32:
      return internal::kUe8m0BlockElems;
  }
  return 0;
}

size_t DataBytes(QuantFormat fmt, size_t n) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
    case QuantFormat::kFp4Ue8m0x32:
      return n / 2;
    case QuantFormat::kFp8Ue8m0x32:
      return n;
  }
  return 0;
}

size_t ScaleBytes(QuantFormat fmt, size_t n) {
  const size_t block = BlockElems(fmt);
  return block == 0 ? 0 : n / block;
}

uint8_t FloatToE2M1(float x) { return internal::ScalarFloatToE2M1(x); }
float E2M1ToFloat(uint8_t code) { return internal::ScalarE2M1ToFloat(code & 0x0fu); }
uint8_t FloatToE4M3(float x) { return internal::ScalarFloatToE4M3(x); }
float E4M3ToFloat(uint8_t code) { return internal::ScalarE4M3ToFloat(code); }
float Ue8m0ToFloat(uint8_t code) { return internal::ScalarUe8m0ToFloat(code); }

Status CudaDeviceStatus() {
#ifdef KVTIER_WITH_CUDA
  return internal::CudaDeviceStatus();
#else
  return CudaUnavailable();
#endif
}

Status Quantize(QuantFormat fmt, const float* x, size_t rows, size_t n, uint8_t* data,
                uint8_t* scales, Backend backend) {
  if (x == nullptr || data == nullptr || scales == nullptr) {
    return Status::InvalidArgument("Quantize: null buffer");
  }
  size_t blocks = 0;
  KVTIER_RETURN_IF_ERROR(CheckShape(fmt, rows, n, &blocks));
  switch (Resolve(backend)) {
    case Backend::kCuda:
#ifdef KVTIER_WITH_CUDA
      KVTIER_RETURN_IF_ERROR(internal::CudaDeviceStatus());
      return internal::CudaQuantize(fmt, x, blocks, data, scales);
#else
      return CudaUnavailable();
#endif
    case Backend::kSimd:
      internal::Avx2Quantize(fmt, x, blocks, data, scales);
      return Status::Ok();
    case Backend::kReference:
    case Backend::kAuto:
      break;
  }
  internal::RefQuantize(fmt, x, blocks, data, scales);
  return Status::Ok();
}

Status Dequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t rows,
                  size_t n, float* out, Backend backend) {
  if (data == nullptr || scales == nullptr || out == nullptr) {
    return Status::InvalidArgument("Dequantize: null buffer");
  }
  size_t blocks = 0;
  KVTIER_RETURN_IF_ERROR(CheckShape(fmt, rows, n, &blocks));
  switch (Resolve(backend)) {
    case Backend::kCuda:
#ifdef KVTIER_WITH_CUDA
      KVTIER_RETURN_IF_ERROR(internal::CudaDeviceStatus());
      return internal::CudaDequantize(fmt, data, scales, blocks, out);
#else
      return CudaUnavailable();
#endif
    case Backend::kSimd:
      internal::Avx2Dequantize(fmt, data, scales, blocks, out);
      return Status::Ok();
    case Backend::kReference:
    case Backend::kAuto:
      break;
  }
  internal::RefDequantize(fmt, data, scales, blocks, out);
  return Status::Ok();
}

Status RoundTrip(QuantFormat fmt, float* x, size_t rows, size_t n, Backend backend) {
  if (x == nullptr) return Status::InvalidArgument("RoundTrip: null buffer");
  size_t blocks = 0;
  KVTIER_RETURN_IF_ERROR(CheckShape(fmt, rows, n, &blocks));
  if (rows == 0 || n == 0) return Status::Ok();
  if (Resolve(backend) == Backend::kCuda) KVTIER_RETURN_IF_ERROR(CudaUnavailable());
  const size_t chunk_rows = std::max<size_t>(1, kRoundTripChunkElemsMax / n);
  const size_t buffer_rows = std::min(rows, chunk_rows);
  // The coded bytes go through this thread's buffers, kept call to call (the engine rounds
  // the indexer's queries of every layer on every pass) unless they grew past
  // kRoundTripKeepBytes (rounding a weight matrix at load).
  thread_local std::vector<uint8_t> data, scales;
  data.resize(buffer_rows * DataBytes(fmt, n));
  scales.resize(buffer_rows * ScaleBytes(fmt, n));
  Status st;
  for (size_t row = 0; row < rows && st.ok(); row += buffer_rows) {
    const size_t count = std::min(buffer_rows, rows - row);
    float* chunk = x + row * n;
    st = Quantize(fmt, chunk, count, n, data.data(), scales.data(), backend);
    if (st.ok()) st = Dequantize(fmt, data.data(), scales.data(), count, n, chunk, backend);
  }
  if (data.capacity() + scales.capacity() > kRoundTripKeepBytes) {
    std::vector<uint8_t>().swap(data);
    std::vector<uint8_t>().swap(scales);
  }
  return st;
}

bool BackendAvailable(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
    case Backend::kReference:
      return true;
    case Backend::kSimd:
      // kSimd always runs (it falls back to the reference), but it is only a distinct path
      // when the CPU has AVX2.
      return internal::Avx2Supported();
    case Backend::kCuda:
      return CudaUnavailable().ok();
  }
  return false;
}

}  // namespace kvtier::kernels
