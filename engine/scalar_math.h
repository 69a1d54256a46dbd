// Scalar functions shared by the engine's CPU path (engine/ops.h) and its device kernels
// (engine/device/kernels.h), written once so that both compute the same bits: plain C++ that
// nvcc compiles for the device too (KVTIER_HD). Results depend only on the C library's (or
// CUDA's) expf and log1pf.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVTIER_HD __host__ __device__
#else
#define KVTIER_HD
#endif

namespace kvtier::engine {

KVTIER_HD inline float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
KVTIER_HD inline float Silu(float x) { return x * Sigmoid(x); }
KVTIER_HD inline float Softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// An integer that orders (score, index) pairs as TopKByScore (ops.h) orders them: larger is
// better. The score's bits made monotone (+0.0 and -0.0 both map to +0.0's) above, the index
// inverted below.
KVTIER_HD inline uint64_t TopKKey(float score, int32_t index) {
  const float z = score + 0.0f;  // -0.0 + 0.0 == +0.0
  uint32_t b;
  memcpy(&b, &z, sizeof b);
  const uint32_t ord = (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
  return (static_cast<uint64_t>(ord) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}

}  // namespace kvtier::engine
