// The host twin of the device backend (engine/device/backend.h): "device" memory is host
// memory and each kernel is a loop over its outputs, the same kernel code the GPU runs.
#include <cstdlib>
#include <cstring>
#include <new>

#include "engine/device/backend.h"

namespace kvtier::engine::device {
namespace {

class HostBackend final : public DeviceBackend {
 public:
  DeviceKind kind() const override { return DeviceKind::kHost; }
  StatusOr<void*> Alloc(size_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument("device: an allocation of 0 bytes");
    void* p = std::malloc(bytes);
    if (p == nullptr) return Status::Internal("device (host twin): out of memory");
    return p;
  }
  void Free(void* p) override { std::free(p); }
  Status ToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status ToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status DeviceCopy(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  Status Run(const DeviceKernel& kernel) override {
    std::visit(
        [](const auto& k) {
          for (int64_t i = 0; i < k.threads; ++i) k(i);
        },
        kernel);
    return Status::Ok();
  }
};

}  // namespace

const char* DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kHost:
      return "host";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "?";
}

std::unique_ptr<DeviceBackend> MakeHostBackend() { return std::make_unique<HostBackend>(); }

StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(DeviceKind kind) {
  if (kind == DeviceKind::kHost) return MakeHostBackend();
  return MakeCudaBackend();
}

#if !KVTIER_WITH_CUDA
StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend() {
  return Status::Unavailable("device: this build has no CUDA");
}
#endif

}  // namespace kvtier::engine::device
