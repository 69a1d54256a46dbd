// The dense part of every layer on a device, with the pass's activations kept there.
//
// A pass of n rows (any Engine pass with EngineOptions::layer_device: a step of Forward,
// PrefillCed, ExtendCed or ReplayTail over one sequence's layers, or ForwardBatch over several
// sequences) uploads the rows' embedded residual once; then, layer by layer, the device computes
// the mHC mixes, the pre-mix and norm of both sublayers, the whole MoE sublayer (router, routed and
// shared experts, combine) and the residual updates, and finally the head. The host keeps what
// needs the sequences' caches: the attention sublayer gets its normed input (n x hidden floats) and
// returns its output (the same size), and an Engram layer reads and writes the residual. So a
// layer moves 2 x n x hidden floats over the bus instead of every matrix product's inputs and
// outputs (engine/cuda/backend.h's per-call path).
//
// Every output is the CPU path's (engine/device/kernels.h): bit for bit on the host twin, within
// the CUDA math library's expf / log1pf differences on a GPU.
//
// Memory: the layers' dense weights as float copies on the device (weight_bytes()), and
// activations for the largest pass so far (at most kMaxTokensPerCall rows).
// Thread safety: one pass at a time (the engine's passes are not reentrant either).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/device/backend.h"

namespace kvtier::engine::device {

// The host copies of one layer's dense weights (pointers into the engine's weights, which
// must outlive Create; after it they are not read again).
struct DeviceLayerWeights {
  const float* norm[2] = {};      // attn_norm, ffn_norm: [hidden]
  const float* hc_fn[2] = {};     // [(2 + hc) * hc x hc * hidden]
  const float* hc_scale[2] = {};  // [3]
  const float* hc_base[2] = {};   // [(2 + hc) * hc]
  const float* gate = nullptr;    // [experts x hidden]
  const float* gate_bias = nullptr;
  std::vector<const float*> w1, w3;  // per routed expert: [inter x hidden]
  std::vector<const float*> w2;      // per routed expert: [hidden x inter]
  const float *s_w1 = nullptr, *s_w3 = nullptr, *s_w2 = nullptr;  // shared experts, or null
};
struct DeviceModelWeights {
  std::vector<DeviceLayerWeights> layers;
  const float* norm_w = nullptr;  // [hidden]
  const float* head_w = nullptr;  // [vocab x hidden]
};

class DeviceLayers {
 public:
  // Copies the weights to a new backend of `kind`. Unavailable without that device;
  // InvalidArgument for a config the kernels do not take (num_experts_per_tok over
  // kDeviceExpertsPerTokenMax) or weights missing.
  static StatusOr<std::unique_ptr<DeviceLayers>> Create(DeviceKind kind, const EngineConfig& config,
                                                        const DeviceModelWeights& weights);
  ~DeviceLayers();
  DeviceLayers(const DeviceLayers&) = delete;
  DeviceLayers& operator=(const DeviceLayers&) = delete;

  DeviceKind kind() const { return backend_->kind(); }
  // Device bytes held by weight copies.
  size_t weight_bytes() const { return weight_bytes_; }

  // Starts a pass of n rows (1 <= n <= kMaxTokensPerCall): x [n x hc x hidden], pre [n x hc].
  Status Begin(int n, const float* x, const float* pre);
  // The pass's residual to / from the host ([n x hc x hidden]); its pre-mix weights of the next
  // sublayer to the host ([n x hc]).
  Status Residual(float* x);
  Status SetResidual(const float* x);
  Status Pre(float* pre);
  // The attention sublayer of `layer`: its normed input to xn ([n x hidden]), its mixes kept;
  // AttentionOutput then takes the sublayer's output f ([n x hidden]) into the residual.
  Status AttentionInput(int layer, float* xn);
  Status AttentionOutput(const float* f);
  // The MoE sublayer of `layer`, wholly on the device.
  Status Ffn(int layer);
  // The head's logits ([rows.size() x vocab], or [n x vocab] for empty rows) of the listed rows
  // of the pass (each < n).
  Status Head(std::span<const int64_t> rows, float* logits);

 private:
  struct Layer;
  DeviceLayers(const EngineConfig& config, std::unique_ptr<DeviceBackend> backend);
  // Device memory of `floats` floats (or bytes) held until destruction.
  StatusOr<float*> Hold(size_t floats);
  StatusOr<float*> Upload(const float* host, size_t floats);
  // Each of the `count` row-major [out x in] matrices at mats[i] (host), output-minor ([in x out],
  // kernels.h) and side by side: matrix i at i * out * in.
  StatusOr<float*> UploadOutputMinor(const float* const* mats, size_t count, size_t out, size_t in);
  Status Run(const DeviceKernel& k) { return backend_->Run(k); }
  // Grows the activation buffers to n rows.
  Status EnsureRows(int n);
  // Mixes of sublayer s into next_pre_, post_, comb_, and the pre-mixed, normed input into xn_.
  Status MixesAndInput(const Layer& l, int s);
  // The residual update after a sublayer whose output is in f_; pre_ <- next_pre_.
  Status MixSublayer();

  EngineConfig config_;
  std::unique_ptr<DeviceBackend> backend_;
  std::vector<void*> held_;  // weight copies and activations, freed at destruction
  std::vector<Layer> layers_;
  const float* norm_w_ = nullptr;
  const float* head_w_ = nullptr;
  size_t weight_bytes_ = 0;
  int n_ = 0;                       // rows of the current pass
  int capacity_ = 0;                // rows the activation buffers hold
  std::vector<void*> activations_;  // the buffers below (freed when they grow)
  float *x_ = nullptr, *pre_ = nullptr, *next_pre_ = nullptr, *post_ = nullptr, *comb_ = nullptr;
  float *xn_ = nullptr, *f_ = nullptr, *r_ = nullptr, *mixes_ = nullptr;
  float *logits_ = nullptr, *weight_ = nullptr, *routed_ = nullptr, *g_ = nullptr;
  float *shared_ = nullptr, *sg_ = nullptr, *head_x_ = nullptr, *head_pre_ = nullptr;
  int32_t* chosen_ = nullptr;
  int64_t* head_rows_ = nullptr;
};

}  // namespace kvtier::engine::device
