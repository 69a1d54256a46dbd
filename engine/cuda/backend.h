// Host side of the engine's CUDA MatMul (engine/cuda/matmul.cuh). Plain C++ header; the
// definitions exist only when the build has CUDA (macro KVTIER_WITH_CUDA), so callers guard
// their calls with `#if KVTIER_WITH_CUDA`. engine/ops.cc MatMul decides when to use it.
//
// Weights are immutable after load: the device copy of a weight matrix is cached per host
// pointer (and shape), bounded by kCudaWeightCacheBytesMax with least-recently-used eviction.
// A hit is re-validated against kCudaWeightFingerprintSamples sampled elements, so a buffer
// freed and reused for different weights is re-uploaded; a reused buffer that differs only
// in unsampled elements is NOT detected: callers that free weights should call
// CudaReleaseWeightCache(). Activations and outputs are copied per call through device
// buffers of at most kCudaActivationBytesMax (larger calls are split by rows).
// Thread safety: all functions may be called concurrently; device work is serialised by one
// internal mutex, synchronously on the default stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace kvtier::engine::cuda {

// Upper bound on device memory held by cached weight copies (4 GiB).
inline constexpr size_t kCudaWeightCacheBytesMax = size_t{4} << 30;
// Upper bound on the per-call activation + output staging buffers (64 MiB).
inline constexpr size_t kCudaActivationBytesMax = size_t{64} << 20;
// Elements compared on every cache hit to detect a host buffer reused for other data.
inline constexpr int kCudaWeightFingerprintSamples = 64;

// The CUDA MatMul kernels (engine/cuda/matmul.cuh): all give the same bits; kAuto picks by shape.
enum class CudaMatMulKernel { kAuto, kTile16, kRegTile64, kFewRows };
const char* CudaMatMulKernelName(CudaMatMulKernel k);

// Ok when a CUDA device is usable; Unavailable otherwise. Checked once, then cached.
Status CudaMatMulDeviceStatus();

// Y = X W^T in the order of engine/matmul.h, bit-identical to engine::MatMulCpu. Host pointers.
// Returns Rejected (nothing written) when one weight matrix, or one row's activations, exceed
// the limits above; Unavailable without a device; Internal on a CUDA error. On any error y is
// unspecified and the caller must compute it on the CPU. `kernel` chooses the kernel (tests and
// benchmarks compare them; the engine takes kAuto).
Status CudaMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                  CudaMatMulKernel kernel = CudaMatMulKernel::kAuto);

// Frees every cached device weight copy (e.g. before the host weights are freed).
void CudaReleaseWeightCache();

// Device weight bytes currently cached (for tests and stats).
size_t CudaWeightCacheBytes();

}  // namespace kvtier::engine::cuda
