#include "engine/device/fail_stop_backend.h"

#include <string>
#include <utility>

namespace kvtier::engine::device {

FailStopBackend::FailStopBackend(std::unique_ptr<DeviceBackend> inner) : inner_(std::move(inner)) {}

Status FailStopBackend::Stopped() const {
  if (failure_.ok()) return Status::Ok();
  return Status::Unavailable("device: out of use since a call failed: " + failure_.ToString());
}

Status FailStopBackend::Note(Status s) {
  if (!s.ok() && failure_.ok()) failure_ = s;
  return s;
}

template <typename T>
StatusOr<T> FailStopBackend::Note(StatusOr<T> v) {
  if (!v.ok() && failure_.ok()) failure_ = v.status();
  return v;
}

StatusOr<void*> FailStopBackend::Alloc(size_t bytes) {
  KVTIER_RETURN_IF_ERROR(Stopped());
  return Note(inner_->Alloc(bytes));
}

Status FailStopBackend::ToDevice(void* dst, const void* src, size_t bytes) {
  KVTIER_RETURN_IF_ERROR(Stopped());
  return Note(inner_->ToDevice(dst, src, bytes));
}

Status FailStopBackend::ToHost(void* dst, const void* src, size_t bytes) {
  KVTIER_RETURN_IF_ERROR(Stopped());
  return Note(inner_->ToHost(dst, src, bytes));
}

Status FailStopBackend::DeviceCopy(void* dst, const void* src, size_t bytes) {
  KVTIER_RETURN_IF_ERROR(Stopped());
  return Note(inner_->DeviceCopy(dst, src, bytes));
}

Status FailStopBackend::Run(const DeviceKernel& kernel) {
  KVTIER_RETURN_IF_ERROR(Stopped());
  return Note(inner_->Run(kernel));
}

StatusOr<std::vector<OpStat>> FailStopBackend::TakeProfile() {
  KVTIER_RETURN_IF_ERROR(Stopped());
  return Note(inner_->TakeProfile());
}

}  // namespace kvtier::engine::device
