// A device backend that stops at its first failure (engine/device/backend.h says a backend
// should be dropped after an error; this one drops itself).
//
// Until a call fails it passes every call to the backend it wraps. The call that fails returns
// its own error; from then on every call but Free, kind and SetProfiling returns Unavailable
// naming that first error, without reaching the wrapped backend. The reason: a failed copy or
// kernel (on a GPU, possibly one queued long before the call that reports it) leaves device
// memory in an unknown state, so a later pass could read a mirror that records bytes it never
// received; nothing on this device is trusted again. Free still passes through (the memory
// is given back either way).
//
// Thread safety: as the wrapped backend's (one thread at a time).
#pragma once

#include <memory>
#include <vector>

#include "common/status.h"
#include "engine/device/backend.h"

namespace kvtier::engine::device {

class FailStopBackend final : public DeviceBackend {
 public:
  explicit FailStopBackend(std::unique_ptr<DeviceBackend> inner);

  // Ok until a call failed; then that call's error.
  const Status& failure() const { return failure_; }

  DeviceKind kind() const override { return inner_->kind(); }
  StatusOr<void*> Alloc(size_t bytes) override;
  void Free(void* p) override { inner_->Free(p); }
  Status ToDevice(void* dst, const void* src, size_t bytes) override;
  Status ToHost(void* dst, const void* src, size_t bytes) override;
  Status DeviceCopy(void* dst, const void* src, size_t bytes) override;
  Status Run(const DeviceKernel& kernel) override;
  void SetProfiling(bool on) override { inner_->SetProfiling(on); }
  StatusOr<std::vector<OpStat>> TakeProfile() override;

 private:
  // Unavailable naming failure_ once a call failed, else Ok.
  Status Stopped() const;
  // s (or v's status), remembered as failure_ when it is the first error.
  Status Note(Status s);
  template <typename T>
  StatusOr<T> Note(StatusOr<T> v);

  std::unique_ptr<DeviceBackend> inner_;
  Status failure_;
};

}  // namespace kvtier::engine::device
