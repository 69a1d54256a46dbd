// Engine: the device layers (EngineOptions::layer_device, engine/device/layers.h): their
// weights bound from the engine's own, and the attention products taken from them.
#include "common/logging.h"
#include "engine/device/layers.h"
#include "engine/model_internal.h"

namespace kvtier::engine {

const char* LayerDeviceName(LayerDevice device) {
  switch (device) {
    case LayerDevice::kCpu:
      return "cpu";
    case LayerDevice::kCuda:
      return "cuda";
    case LayerDevice::kHostTwin:
      return "host-twin";
  }
  return "?";
}

bool ParseLayerDevice(std::string_view name, LayerDevice* device) {
  for (LayerDevice d : {LayerDevice::kCpu, LayerDevice::kCuda, LayerDevice::kHostTwin}) {
    if (name == LayerDeviceName(d)) {
      *device = d;
      return true;
    }
  }
  return false;
}

Status Engine::BindDevice() {
  if (options_.layer_device == LayerDevice::kCpu) {
    if (options_.device_backend)
      return Status::InvalidArgument("engine: a device_backend with layer_device cpu");
    return Status::Ok();
  }
  // The weights as the products read them (after RoundCodedWeights: the rounded floats, whose
  // products are the packed codes' bits).
  device::DeviceModelWeights w;
  w.layers.reserve(layers_.size());
  for (const LayerWeights& lw : layers_) {
    device::DeviceLayerWeights d;
    d.norm[0] = lw.attn_norm;
    d.norm[1] = lw.ffn_norm;
    for (int s = 0; s < 2; ++s) {
      d.hc_fn[s] = lw.hc_fn[s];
      d.hc_scale[s] = lw.hc_scale[s];
      d.hc_base[s] = lw.hc_base[s];
    }
    d.gate = lw.gate;
    d.gate_bias = lw.gate_bias;
    d.w1 = lw.w1;
    d.w2 = lw.w2;
    d.w3 = lw.w3;
    d.s_w1 = lw.s_w1;
    d.s_w2 = lw.s_w2;
    d.s_w3 = lw.s_w3;
    d.wq_a = lw.wq_a;
    d.q_norm = lw.q_norm;
    d.wq_b = lw.wq_b;
    d.wkv = lw.wkv;
    d.kv_norm = lw.kv_norm;
    d.i_wproj = lw.i_wproj;
    d.i_wq_b = lw.i_wq_b;
    d.c_wkv = lw.c_wkv;
    d.c_wgate = lw.c_wgate;
    d.wo_a = lw.wo_a;
    d.wo_b = lw.wo_b;
    d.sink = lw.sink;
    w.layers.push_back(std::move(d));
  }
  w.norm_w = norm_w_;
  w.head_w = head_w_;
  const device::DeviceKind kind = options_.layer_device == LayerDevice::kCuda
                                      ? device::DeviceKind::kCuda
                                      : device::DeviceKind::kHost;
  if (options_.device_backend) {
    std::unique_ptr<device::DeviceBackend> backend = options_.device_backend();
    if (backend == nullptr) return Status::InvalidArgument("engine: device_backend gave none");
    KVTIER_ASSIGN_OR_RETURN(device_, device::DeviceLayers::Create(std::move(backend), config_, w));
  } else {
    KVTIER_ASSIGN_OR_RETURN(device_, device::DeviceLayers::Create(kind, config_, w));
  }
  return Status::Ok();
}

Status Engine::AfterDevicePass(Status s) {
  if (device_ != nullptr && !device_->failure().ok()) {
    device_failure_ = device_->failure();
    KVTIER_LOG(kError) << "engine: the " << LayerDeviceName(options_.layer_device)
                       << " layers failed (" << device_failure_.ToString()
                       << "); every later pass runs on the CPU";
    device_.reset();
    if (s.ok()) s = device_failure_;  // a pass that met a failed device never gives results
  }
  return s;
}

Status Engine::DeviceAttnProject(int layer, int n, const int64_t* pos, AttnRows* a) {
  ShapeAttnRows(layer, n, a);
  a->q.clear();  // q stays on the device, where Attention rotates it
  device::DeviceLayers::AttentionRows rows;
  rows.kv = a->kv.data();
  auto or_null = [](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  rows.iq = or_null(a->iq);
  rows.wts = or_null(a->wts);
  rows.ckv = or_null(a->ckv);
  rows.cgate = or_null(a->cgate);
  KVTIER_RETURN_IF_ERROR(device_->AttentionProducts(layer, rows));
  return AttnRotate(layer, n, pos, a);
}

Status Engine::SetDeviceProfiling(bool on) {
  if (device_ == nullptr)
    return Status::InvalidArgument(
        "engine: no device layers to profile (layer_device cpu, or the device failed)");
  device_->SetProfiling(on);
  return Status::Ok();
}

StatusOr<std::vector<device::OpStat>> Engine::TakeDeviceProfile() {
  if (device_ == nullptr)
    return Status::InvalidArgument(
        "engine: no device layers to profile (layer_device cpu, or the device failed)");
  return device_->TakeProfile();
}

size_t Engine::DeviceWeightBytes() const {
  return device_ != nullptr ? device_->weight_bytes() : 0;
}

}  // namespace kvtier::engine
