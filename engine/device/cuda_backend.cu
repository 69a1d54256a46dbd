// The CUDA device backend (engine/device/backend.h): cudaMalloc'd memory, copies on one stream,
// and the kernels of engine/device/kernels.h as grid-stride loops over their outputs; MatMul
// runs on the engine's tiled CUDA MatMul (engine/cuda/matmul.cuh: the same chain per output,
// so the same bits as MatMulKernel). Built with --fmad=false (engine/CMakeLists.txt).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "engine/cuda/matmul.cuh"
#include "engine/device/backend.h"
#include "kernels/quant.h"

namespace kvtier::engine::device {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kBlocksMax = 65535;

template <typename K>
__global__ void GridKernel(K k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < k.threads;
       i += stride) {
    k(i);
  }
}

Status CudaError(const char* what, cudaError_t err) {
  return Status::Internal(std::string("device (cuda) ") + what + ": " + cudaGetErrorString(err));
}

class CudaBackend final : public DeviceBackend {
 public:
  ~CudaBackend() override {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  Status Init() {
    const cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    return err == cudaSuccess ? Status::Ok() : CudaError("stream", err);
  }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  StatusOr<void*> Alloc(size_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument("device: an allocation of 0 bytes");
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) return CudaError("malloc", err);
    return p;
  }
  void Free(void* p) override {
    if (p != nullptr) (void)cudaFree(p);
  }
  Status ToDevice(void* dst, const void* src, size_t bytes) override {
    return Check("copy to device",
                 cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  Status ToHost(void* dst, const void* src, size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(
        Check("copy to host", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_)));
    return Check("synchronize", cudaStreamSynchronize(stream_));
  }
  Status DeviceCopy(void* dst, const void* src, size_t bytes) override {
    return Check("device copy",
                 cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  Status Run(const DeviceKernel& kernel) override {
    if (const auto* mm = std::get_if<MatMulKernel>(&kernel)) {
      if (mm->threads <= 0) return Status::Ok();
      const int rows = static_cast<int>(mm->threads / mm->out);
      return Check("matmul",
                   cuda::LaunchMatMul(mm->x, rows, mm->in, mm->w, mm->out, mm->y, stream_));
    }
    return std::visit(
        [this](const auto& k) -> Status {
          if (k.threads <= 0) return Status::Ok();
          const int64_t blocks =
              std::min(kBlocksMax, (k.threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
          GridKernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream_>>>(k);
          return Check("kernel launch", cudaGetLastError());
        },
        kernel);
  }

 private:
  static Status Check(const char* what, cudaError_t err) {
    return err == cudaSuccess ? Status::Ok() : CudaError(what, err);
  }
  cudaStream_t stream_ = nullptr;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend() {
  KVTIER_RETURN_IF_ERROR(kernels::CudaDeviceStatus());
  auto b = std::make_unique<CudaBackend>();
  KVTIER_RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<DeviceBackend>(std::move(b));
}

}  // namespace kvtier::engine::device
