// Host side of Backend::kCuda: device discovery, bounded device buffers, copies and launches.
// Takes host buffers (kernels/quant.h contract) and stages them through device memory in
// chunks of at most kCudaChunkBlocksMax scale blocks, synchronously on the default stream.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/fp4_e4m3.cuh"
#include "kernels/cuda/fp4_ue8m0.cuh"
#include "kernels/cuda/fp8_ue8m0.cuh"
#include "kernels/internal/backends.h"

namespace kvtier::kernels::internal {
namespace {

// Device memory per call is bounded by this many scale blocks per chunk: at most
// 2^20 * 32 * 4 B = 128 MiB of fp32 plus 32 MiB of codes.
constexpr size_t kCudaChunkBlocksMax = size_t{1} << 20;

using QuantizeLaunch = cudaError_t (*)(const float*, size_t, uint8_t*, uint8_t*, cudaStream_t);
using DequantizeLaunch = cudaError_t (*)(const uint8_t*, const uint8_t*, size_t, float*,
                                         cudaStream_t);

struct FormatOps {
  size_t elems;       // elements per scale block
  size_t data_bytes;  // code bytes per scale block
  QuantizeLaunch quantize;
  DequantizeLaunch dequantize;
};

FormatOps OpsFor(QuantFormat fmt) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      return {16, 8, cuda::LaunchQuantizeFp4E4M3, cuda::LaunchDequantizeFp4E4M3};
    case QuantFormat::kFp4Ue8m0x32:
      return {32, 16, cuda::LaunchQuantizeFp4Ue8m0, cuda::LaunchDequantizeFp4Ue8m0};
    case QuantFormat::kFp8Ue8m0x32:
      break;
  }
  return {32, 32, cuda::LaunchQuantizeFp8Ue8m0, cuda::LaunchDequantizeFp8Ue8m0};
}

Status CudaError(const char* what, cudaError_t err) {
  return Status::Internal(std::string("cuda ") + what + ": " + cudaGetErrorString(err));
}

// Owns one cudaMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }

  Status Allocate(size_t bytes) {
    const cudaError_t err = cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes);
    if (err != cudaSuccess) return CudaError("malloc", err);
    return Status::Ok();
  }
  template <typename T>
  T* As() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t err = cudaMemcpy(dst, src, bytes, kind);
  if (err != cudaSuccess) return CudaError("memcpy", err);
  return Status::Ok();
}

}  // namespace

Status CudaDeviceStatus() {
  static const Status status = []() -> Status {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      return Status::Unavailable(std::string("no usable CUDA device: ") + cudaGetErrorString(err));
    }
    if (count <= 0) return Status::Unavailable("no CUDA device present");
    return Status::Ok();
  }();
  return status;
}

Status CudaQuantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data,
                    uint8_t* scales) {
  if (blocks == 0) return Status::Ok();
  const FormatOps ops = OpsFor(fmt);
  const size_t chunk = blocks < kCudaChunkBlocksMax ? blocks : kCudaChunkBlocksMax;
  DeviceBuffer d_x, d_data, d_scales;
  KVTIER_RETURN_IF_ERROR(d_x.Allocate(chunk * ops.elems * sizeof(float)));
  KVTIER_RETURN_IF_ERROR(d_data.Allocate(chunk * ops.data_bytes));
  KVTIER_RETURN_IF_ERROR(d_scales.Allocate(chunk));
  for (size_t b = 0; b < blocks; b += chunk) {
    const size_t count = blocks - b < chunk ? blocks - b : chunk;
    KVTIER_RETURN_IF_ERROR(Copy(d_x.As<float>(), x + b * ops.elems,
                                count * ops.elems * sizeof(float), cudaMemcpyHostToDevice));
    const cudaError_t err =
        ops.quantize(d_x.As<float>(), count, d_data.As<uint8_t>(), d_scales.As<uint8_t>(), 0);
    if (err != cudaSuccess) return CudaError("launch", err);
    KVTIER_RETURN_IF_ERROR(Copy(data + b * ops.data_bytes, d_data.As<uint8_t>(),
                                count * ops.data_bytes, cudaMemcpyDeviceToHost));
    KVTIER_RETURN_IF_ERROR(Copy(scales + b, d_scales.As<uint8_t>(), count, cudaMemcpyDeviceToHost));
  }
  return Status::Ok();
}

Status CudaDequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t blocks,
                      float* out) {
  if (blocks == 0) return Status::Ok();
  const FormatOps ops = OpsFor(fmt);
  const size_t chunk = blocks < kCudaChunkBlocksMax ? blocks : kCudaChunkBlocksMax;
  DeviceBuffer d_data, d_scales, d_out;
  KVTIER_RETURN_IF_ERROR(d_data.Allocate(chunk * ops.data_bytes));
  KVTIER_RETURN_IF_ERROR(d_scales.Allocate(chunk));
  KVTIER_RETURN_IF_ERROR(d_out.Allocate(chunk * ops.elems * sizeof(float)));
  for (size_t b = 0; b < blocks; b += chunk) {
    const size_t count = blocks - b < chunk ? blocks - b : chunk;
    KVTIER_RETURN_IF_ERROR(Copy(d_data.As<uint8_t>(), data + b * ops.data_bytes,
                                count * ops.data_bytes, cudaMemcpyHostToDevice));
    KVTIER_RETURN_IF_ERROR(Copy(d_scales.As<uint8_t>(), scales + b, count, cudaMemcpyHostToDevice));
    const cudaError_t err =
        ops.dequantize(d_data.As<uint8_t>(), d_scales.As<uint8_t>(), count, d_out.As<float>(), 0);
    if (err != cudaSuccess) return CudaError("launch", err);
    KVTIER_RETURN_IF_ERROR(Copy(out + b * ops.elems, d_out.As<float>(),
                                count * ops.elems * sizeof(float), cudaMemcpyDeviceToHost));
  }
  return Status::Ok();
}

}  // namespace kvtier::kernels::internal
