#include <cstdint>

#include "engine/cuda/matmul.cuh"

namespace kvtier::engine::cuda {
namespace {

// Threads per CUDA block and the cap on the grid (the kernel loops grid-stride beyond it).
constexpr int kThreadsPerBlock = 256;
constexpr int64_t kGridBlocksMax = 65535;

// The CPU Dot (engine/ops.cc), statement for statement.
__device__ float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(a[i + k], b[i + k]));
  }
  float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[4]), __fadd_rn(acc[2], acc[6])),
                      __fadd_rn(__fadd_rn(acc[1], acc[5]), __fadd_rn(acc[3], acc[7])));
  for (; i < n; ++i) s = __fadd_rn(s, __fmul_rn(a[i], b[i]));
  return s;
}

// Consecutive threads take consecutive output columns o of one row t, so they read the same
// activation row and neighbouring weight rows.
__global__ void MatMulKernel(const float* __restrict__ x, int rows, int in,
                             const float* __restrict__ w, int out, float* __restrict__ y) {
  const int64_t total = static_cast<int64_t>(rows) * out;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t t = idx / out;
    const int64_t o = idx - t * out;
    y[idx] = Dot(w + o * in, x + t * in, in);
  }
}

}  // namespace

cudaError_t LaunchMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                         cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(rows) * out;
  if (total <= 0) return cudaSuccess;
  int64_t grid = (total + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (grid > kGridBlocksMax) grid = kGridBlocksMax;
  MatMulKernel<<<static_cast<unsigned>(grid), kThreadsPerBlock, 0, stream>>>(x, rows, in, w, out,
                                                                             y);
  return cudaGetLastError();
}

}  // namespace kvtier::engine::cuda
