// The host twin of the device backend (engine/device/backend.h): "device" memory is host
// memory and each kernel is a loop over its outputs, the same kernel code the GPU runs.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "engine/device/backend.h"

namespace kvtier::engine::device {
namespace {

class HostBackend final : public DeviceBackend {
 public:
  void SetProfiling(bool on) override { profiling_ = on; }
  StatusOr<std::vector<OpStat>> TakeProfile() override { return table_.Take(); }
  DeviceKind kind() const override { return DeviceKind::kHost; }
  StatusOr<void*> Alloc(size_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument("device: an allocation of 0 bytes");
    void* p = std::malloc(bytes);
    if (p == nullptr) return Status::Internal("device (host twin): out of memory");
    return p;
  }
  void Free(void* p) override { std::free(p); }
  Status ToDevice(void* dst, const void* src, size_t bytes) override {
    Timed(kCopyToDevice, bytes, 0, [&] { std::memcpy(dst, src, bytes); });
    return Status::Ok();
  }
  Status ToHost(void* dst, const void* src, size_t bytes) override {
    Timed(kCopyToHost, bytes, 0, [&] { std::memcpy(dst, src, bytes); });
    return Status::Ok();
  }
  Status DeviceCopy(void* dst, const void* src, size_t bytes) override {
    Timed(kDeviceCopy, bytes, 0, [&] { std::memmove(dst, src, bytes); });
    return Status::Ok();
  }
  Status Run(const DeviceKernel& kernel) override {
    Timed(KernelName(kernel), 0, std::max<int64_t>(KernelThreads(kernel), 0), [&] {
      std::visit(
          [](const auto& k) {
            for (int64_t i = 0; i < k.threads; ++i) k(i);
          },
          kernel);
    });
    return Status::Ok();
  }

 private:
  template <typename Op>
  void Timed(const char* name, size_t bytes, int64_t threads, Op&& op) {
    if (!profiling_) {
      op();
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    op();
    const std::chrono::duration<double> s = std::chrono::steady_clock::now() - t0;
    table_.Add(name, static_cast<int64_t>(bytes), threads, s.count());
  }

  bool profiling_ = false;
  ProfileTable table_;
};

}  // namespace

void ProfileTable::Add(const char* name, int64_t bytes, int64_t threads, double seconds) {
  OpStat* s = nullptr;
  for (OpStat& o : stats_) {
    if (o.name == name) s = &o;
  }
  if (s == nullptr) {
    stats_.push_back(OpStat{name});
    s = &stats_.back();
  }
  ++s->calls;
  s->bytes += bytes;
  s->threads += threads;
  s->seconds += seconds;
}

std::vector<OpStat> ProfileTable::Take() {
  std::vector<OpStat> out;
  out.swap(stats_);
  return out;
}

const char* KernelName(const DeviceKernel& kernel) {
  return std::visit([](const auto& k) { return std::decay_t<decltype(k)>::kName; }, kernel);
}

int64_t KernelThreads(const DeviceKernel& kernel) {
  return std::visit([](const auto& k) { return k.threads; }, kernel);
}

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
