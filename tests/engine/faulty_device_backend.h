// A device backend for tests that fails on purpose: the host twin (engine/device/backend.h)
// whose k-th call returns Internal instead of acting, with a log of every call; and an engine
// whose layers run on it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/device/backend.h"
#include "engine/model.h"

namespace kvtier::engine::testutil {

// What the faulty backend saw: every call counted (Free excepted), the one numbered fail_at
// failed (numbered from 0; never for -1), and the calls that came after that failure.
struct CallLog {
  int64_t calls = 0;
  int64_t fail_at = -1;
  int64_t after_failure = 0;
  std::string kinds;  // call i's kind: a(lloc), u(pload), d(ownload), c(opy), k(ernel), p(rofile)
  bool failed() const { return fail_at >= 0 && calls > fail_at; }
};

// The host twin, whose call number log->fail_at returns Internal instead of acting.
class FaultyBackend final : public device::DeviceBackend {
 public:
  explicit FaultyBackend(std::shared_ptr<CallLog> log) : log_(std::move(log)) {}
  device::DeviceKind kind() const override { return inner_->kind(); }
  StatusOr<void*> Alloc(size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(Count('a'));
    return inner_->Alloc(bytes);
  }
  void Free(void* p) override { inner_->Free(p); }
  Status ToDevice(void* dst, const void* src, size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(Count('u'));
    return inner_->ToDevice(dst, src, bytes);
  }
  Status ToHost(void* dst, const void* src, size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(Count('d'));
    return inner_->ToHost(dst, src, bytes);
  }
  Status DeviceCopy(void* dst, const void* src, size_t bytes) override {
    KVTIER_RETURN_IF_ERROR(Count('c'));
    return inner_->DeviceCopy(dst, src, bytes);
  }
  Status Run(const device::DeviceKernel& kernel) override {
    KVTIER_RETURN_IF_ERROR(Count('k'));
    return inner_->Run(kernel);
  }
  void SetProfiling(bool on) override { inner_->SetProfiling(on); }
  StatusOr<std::vector<device::OpStat>> TakeProfile() override {
    KVTIER_RETURN_IF_ERROR(Count('p'));
    return inner_->TakeProfile();
  }

 private:
  Status Count(char kind) {
    if (log_->failed()) ++log_->after_failure;
    log_->kinds.push_back(kind);
    const int64_t n = log_->calls++;
    if (n == log_->fail_at)
      return Status::Internal("injected device failure at call " + std::to_string(n));
    return Status::Ok();
  }
  std::shared_ptr<CallLog> log_;
  std::unique_ptr<device::DeviceBackend> inner_ = device::MakeHostBackend();
};

// An engine (EngineOptions defaults otherwise) whose layers run on FaultyBackend(log).
inline StatusOr<std::unique_ptr<Engine>> FaultyEngine(const EngineConfig& c,
                                                      std::shared_ptr<const ModelWeights> w,
                                                      std::shared_ptr<CallLog> log) {
  EngineOptions o;
  o.layer_device = LayerDevice::kHostTwin;
  o.device_backend = [log] { return std::make_unique<FaultyBackend>(log); };
  return Engine::Create(c, std::move(w), o);
}

}  // namespace kvtier::engine::testutil
