// The CUDA device backend (engine/device/backend.h): cudaMalloc'd memory, copies on one stream,
// and the kernels of engine/device/kernels.h as grid-stride loops over their outputs; MatMul
// runs on the engine's tiled CUDA MatMul (engine/cuda/matmul.cuh: the same chain per output,
// so the same bits as MatMulKernel). Built with --fmad=false (engine/CMakeLists.txt).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

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
    for (const Pending& p : pending_) {
      (void)cudaEventDestroy(p.start);
      (void)cudaEventDestroy(p.stop);
    }
    for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
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
    return Timed(kCopyToDevice, bytes, 0, [&] {
      return Check("copy to device",
                   cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    });
  }
  Status ToHost(void* dst, const void* src, size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(Timed(kCopyToHost, bytes, 0, [&] {
      return Check("copy to host",
                   cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    }));
    return Check("synchronize", cudaStreamSynchronize(stream_));
  }
  Status DeviceCopy(void* dst, const void* src, size_t bytes) override {
    return Timed(kDeviceCopy, bytes, 0, [&] {
      return Check("device copy",
                   cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    });
  }
  void SetProfiling(bool on) override { profiling_ = on; }
  StatusOr<std::vector<OpStat>> TakeProfile() override {
    KVTIER_RETURN_IF_ERROR(Drain());
    return table_.Take();
  }
  Status Run(const DeviceKernel& kernel) override {
    return Timed(KernelName(kernel), 0, std::max<int64_t>(KernelThreads(kernel), 0),
                 [&] { return Launch(kernel); });
  }

 private:
  // An operation timed while profiling: events recorded before and after it on the stream,
  // read at the next Drain.
  struct Pending {
    const char* name;
    int64_t bytes, threads;
    cudaEvent_t start, stop;
  };
  // Operations whose events are held before they are read (then the stream is waited for).
  static constexpr size_t kPendingMax = 4096;

  StatusOr<cudaEvent_t> Event() {
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    KVTIER_RETURN_IF_ERROR(Check("event", cudaEventCreate(&e)));
    return e;
  }
  template <typename Op>
  Status Timed(const char* name, size_t bytes, int64_t threads, Op&& op) {
    if (!profiling_) return op();
    KVTIER_ASSIGN_OR_RETURN(cudaEvent_t start, Event());
    StatusOr<cudaEvent_t> stop = Event();
    if (!stop.ok()) {
      spare_.push_back(start);
      return stop.status();
    }
    auto run = [&]() -> Status {
      KVTIER_RETURN_IF_ERROR(Check("event record", cudaEventRecord(start, stream_)));
      KVTIER_RETURN_IF_ERROR(op());
      return Check("event record", cudaEventRecord(*stop, stream_));
    };
    if (Status st = run(); !st.ok()) {
      spare_.push_back(start);
      spare_.push_back(*stop);
      return st;
    }
    pending_.push_back({name, static_cast<int64_t>(bytes), threads, start, *stop});
    return pending_.size() >= kPendingMax ? Drain() : Status::Ok();
  }
  // Waits for the pending operations and adds their times to the table.
  Status Drain() {
    if (pending_.empty()) return Status::Ok();
    KVTIER_RETURN_IF_ERROR(Check("event wait", cudaEventSynchronize(pending_.back().stop)));
    for (const Pending& p : pending_) {
      float ms = 0;
      KVTIER_RETURN_IF_ERROR(Check("event time", cudaEventElapsedTime(&ms, p.start, p.stop)));
      table_.Add(p.name, p.bytes, p.threads, ms / 1e3);
      spare_.push_back(p.start);
      spare_.push_back(p.stop);
    }
    pending_.clear();
    return Status::Ok();
  }
  Status Launch(const DeviceKernel& kernel) {
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

  static Status Check(const char* what, cudaError_t err) {
    return err == cudaSuccess ? Status::Ok() : CudaError(what, err);
  }
  cudaStream_t stream_ = nullptr;
  bool profiling_ = false;
  ProfileTable table_;
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> spare_;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend() {
  KVTIER_RETURN_IF_ERROR(kernels::CudaDeviceStatus());
  auto b = std::make_unique<CudaBackend>();
  KVTIER_RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<DeviceBackend>(std::move(b));
}

}  // namespace kvtier::engine::device
