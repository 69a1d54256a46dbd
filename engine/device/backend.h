// Where the engine's device layers run (engine/device/layers.h): device memory, copies to and
// from it, and the kernels of engine/device/kernels.h.
//
// Two implementations: the CUDA one (cuda_backend.cu; only in builds with CUDA, and usable only
// where a device is) and the host twin (host_backend.cc), which keeps "device" memory in host
// memory and runs each kernel as a loop over its outputs on the calling thread. The host twin is
// not a fast path (the CPU path is faster); it runs the GPU's kernel code where there is no GPU,
// so tests check it against the CPU path on every machine.
//
// Order: every call acts after the calls before it (one stream); a copy to the host returns
// when the data is there. Errors: a failed call returns its Status (Internal for a CUDA error or
// device memory that ran out); after an error the backend should be dropped.
// Thread safety: one thread at a time per backend.
#pragma once

#include <cstddef>
#include <memory>
#include <variant>
#include <vector>

#include "common/status.h"
#include "engine/device/attention_kernels.h"
#include "engine/device/kernels.h"
#include "engine/device/profile.h"

namespace kvtier::engine::device {

enum class DeviceKind {
  kHost,  // the host twin
  kCuda,  // the first CUDA device
};
const char* DeviceKindName(DeviceKind kind);

// One kernel launch: the kernel's struct, which carries its own thread count.
using DeviceKernel =
    std::variant<RowRsqrtKernel, PreMixKernel, ScaleRowsKernel, MixDotsKernel, MixOutputsKernel,
                 MixSublayerKernel, MatMulKernel, RouteKernel, SwigluUpKernel, PerRowMatMulKernel,
                 CombineKernel, GatherRowsKernel, DecodeFp4KeysKernel, DecodeFp8KeysKernel,
                 RopeRowsKernel, AttnDotsKernel, AttnSoftmaxKernel, AttnSumsKernel,
                 ScatterBytesKernel>;

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual DeviceKind kind() const = 0;
  // `bytes` of device memory (contents unspecified; bytes > 0), freed with Free.
  virtual StatusOr<void*> Alloc(size_t bytes) = 0;
  virtual void Free(void* p) = 0;
  virtual Status ToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual Status ToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual Status DeviceCopy(void* dst, const void* src, size_t bytes) = 0;
  // Runs the kernel over its `threads` outputs (none when threads <= 0).
  virtual Status Run(const DeviceKernel& kernel) = 0;
  // While profiling is on, every Run and copy is counted and timed (on a GPU by events recorded
  // around it on the stream: device time, launch gaps left out), at some cost to the pass.
  // TakeProfile returns the totals since the last take (waiting for the device first) and
  // starts anew; turning profiling off keeps what was counted.
  virtual void SetProfiling(bool on) = 0;
  virtual StatusOr<std::vector<OpStat>> TakeProfile() = 0;
};

// kernel's kName.
const char* KernelName(const DeviceKernel& kernel);
// kernel's `threads`.
int64_t KernelThreads(const DeviceKernel& kernel);

// The host twin (always available).
std::unique_ptr<DeviceBackend> MakeHostBackend();
// The CUDA backend: Unavailable in a build without CUDA or where no device is usable.
StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend();
// kind's backend (MakeHostBackend or MakeCudaBackend).
StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(DeviceKind kind);

}  // namespace kvtier::engine::device
