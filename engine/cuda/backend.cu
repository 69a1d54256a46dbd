#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>

#include "engine/cuda/backend.h"
#include "engine/cuda/matmul.cuh"
#include "kernels/quant.h"

namespace kvtier::engine::cuda {
namespace {

Status CudaError(const char* what, cudaError_t err) {
  return Status::Internal(std::string("cuda ") + what + ": " + cudaGetErrorString(err));
}

struct Fingerprint {
  float v[kCudaWeightFingerprintSamples];
  bool operator==(const Fingerprint& o) const { return std::memcmp(v, o.v, sizeof(v)) == 0; }
};

Fingerprint FingerprintOf(const float* w, size_t n) {
  Fingerprint f{};
  for (int i = 0; i < kCudaWeightFingerprintSamples; ++i) {
    // Evenly spaced, always including the first and the last element.
    const size_t idx =
        n <= 1 ? 0 : (n - 1) * static_cast<size_t>(i) / (kCudaWeightFingerprintSamples - 1);
    f.v[i] = w[idx];
  }
  return f;
}

struct WeightKey {
  const float* ptr;
  int in, out;
  bool operator==(const WeightKey& o) const { return ptr == o.ptr && in == o.in && out == o.out; }
};
struct WeightKeyHash {
  size_t operator()(const WeightKey& k) const {
    return std::hash<const void*>()(k.ptr) ^ (static_cast<size_t>(k.in) * 1000003u) ^
           static_cast<size_t>(k.out);
  }
};

struct CachedWeight {
  float* dev = nullptr;
  size_t bytes = 0;
  Fingerprint fp{};
  std::list<WeightKey>::iterator lru;  // position in State::lru (front = most recent)
};

struct State {
  std::mutex mu;
  std::unordered_map<WeightKey, CachedWeight, WeightKeyHash> weights;
  std::list<WeightKey> lru;
  size_t weight_bytes = 0;
  float* d_x = nullptr;  // staging for activations, capacity x_bytes
  size_t x_bytes = 0;
  float* d_y = nullptr;  // staging for outputs, capacity y_bytes
  size_t y_bytes = 0;
};

State& GetState() {
  static State* s = new State();  // never destroyed: no CUDA calls during static teardown
  return *s;
}

void EvictLocked(State& s, const WeightKey& key) {
  auto it = s.weights.find(key);
  if (it == s.weights.end()) return;
  (void)cudaFree(it->second.dev);
  s.weight_bytes -= it->second.bytes;
  s.lru.erase(it->second.lru);
  s.weights.erase(it);
}

// Returns the device copy of w, uploading it (and evicting least-recently-used copies) when
// it is not cached or its fingerprint changed.
Status DeviceWeightLocked(State& s, const float* w, int in, int out, const float** dev) {
  const size_t n = static_cast<size_t>(in) * out;
  const size_t bytes = n * sizeof(float);
  if (bytes > kCudaWeightCacheBytesMax) return Status::Rejected("weight exceeds the cache");
  const WeightKey key{w, in, out};
  const Fingerprint fp = FingerprintOf(w, n);
  auto it = s.weights.find(key);
  if (it != s.weights.end()) {
    if (it->second.fp == fp) {
      s.lru.splice(s.lru.begin(), s.lru, it->second.lru);
      *dev = it->second.dev;
      return Status::Ok();
    }
    EvictLocked(s, key);
  }
  while (s.weight_bytes + bytes > kCudaWeightCacheBytesMax && !s.lru.empty()) {
    EvictLocked(s, s.lru.back());
  }
  CachedWeight c;
  c.bytes = bytes;
  c.fp = fp;
  cudaError_t err = cudaMalloc(&c.dev, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess) return CudaError("malloc", err);
  err = cudaMemcpy(c.dev, w, bytes, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    (void)cudaFree(c.dev);
    return CudaError("memcpy", err);
  }
  s.lru.push_front(key);
  c.lru = s.lru.begin();
  s.weight_bytes += bytes;
  *dev = c.dev;
  s.weights.emplace(key, c);
  return Status::Ok();
}

Status EnsureStaging(float** buf, size_t* cap, size_t bytes) {
  if (*cap >= bytes) return Status::Ok();
  if (*buf != nullptr) (void)cudaFree(*buf);
  *buf = nullptr;
  *cap = 0;
  const cudaError_t err = cudaMalloc(buf, bytes);
  if (err != cudaSuccess) {
    *buf = nullptr;
    return CudaError("malloc", err);
  }
  *cap = bytes;
  return Status::Ok();
}

}  // namespace

const char* CudaMatMulKernelName(CudaMatMulKernel k) {
  switch (k) {
    case CudaMatMulKernel::kAuto:
      return "auto";
    case CudaMatMulKernel::kTile16:
      return "tile16";
    case CudaMatMulKernel::kRegTile64:
      return "regtile64";
    case CudaMatMulKernel::kFewRows:
      return "fewrows";
  }
  return "?";
}

Status CudaMatMulDeviceStatus() { return kernels::CudaDeviceStatus(); }

Status CudaMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                  CudaMatMulKernel kernel) {
  KVTIER_RETURN_IF_ERROR(CudaMatMulDeviceStatus());
  if (rows <= 0 || out <= 0) return Status::Ok();
  if (in < 0) return Status::InvalidArgument("negative inner dimension");
  const size_t row_bytes = (static_cast<size_t>(in) + out) * sizeof(float);
  if (row_bytes > kCudaActivationBytesMax) return Status::Rejected("row exceeds staging limit");
  const int rows_per_chunk = static_cast<int>(
      std::min<size_t>(static_cast<size_t>(rows), kCudaActivationBytesMax / row_bytes));

  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  const float* d_w = nullptr;
  KVTIER_RETURN_IF_ERROR(DeviceWeightLocked(s, w, in, out, &d_w));
  const size_t x_need = static_cast<size_t>(rows_per_chunk) * in * sizeof(float);
  const size_t y_need = static_cast<size_t>(rows_per_chunk) * out * sizeof(float);
  KVTIER_RETURN_IF_ERROR(EnsureStaging(&s.d_x, &s.x_bytes, x_need == 0 ? 1 : x_need));
  KVTIER_RETURN_IF_ERROR(EnsureStaging(&s.d_y, &s.y_bytes, y_need));
  for (int t0 = 0; t0 < rows; t0 += rows_per_chunk) {
    const int n = std::min(rows_per_chunk, rows - t0);
    const size_t xb = static_cast<size_t>(n) * in * sizeof(float);
    const size_t yb = static_cast<size_t>(n) * out * sizeof(float);
    cudaError_t err =
        cudaMemcpy(s.d_x, x + static_cast<size_t>(t0) * in, xb, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return CudaError("memcpy", err);
    err = LaunchMatMul(s.d_x, n, in, d_w, out, s.d_y, 0, kernel);
    if (err != cudaSuccess) return CudaError("launch", err);
    err = cudaMemcpy(y + static_cast<size_t>(t0) * out, s.d_y, yb, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) return CudaError("memcpy", err);
  }
  return Status::Ok();
}

void CudaReleaseWeightCache() {
  if (!CudaMatMulDeviceStatus().ok()) return;
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  while (!s.lru.empty()) EvictLocked(s, s.lru.back());
}

size_t CudaWeightCacheBytes() {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.weight_bytes;
}

}  // namespace kvtier::engine::cuda
