// Engine: the device layers of ForwardBatch (EngineOptions::layer_device,
// engine/device/layers.h): their weights bound from the engine's own.
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
  if (options_.layer_device == LayerDevice::kCpu) return Status::Ok();
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
    w.layers.push_back(std::move(d));
  }
  w.norm_w = norm_w_;
  w.head_w = head_w_;
  const device::DeviceKind kind = options_.layer_device == LayerDevice::kCuda
                                      ? device::DeviceKind::kCuda
                                      : device::DeviceKind::kHost;
  KVTIER_ASSIGN_OR_RETURN(device_, device::DeviceLayers::Create(kind, config_, w));
  return Status::Ok();
}

size_t Engine::DeviceWeightBytes() const {
  return device_ != nullptr ? device_->weight_bytes() : 0;
}

}  // namespace kvtier::engine
