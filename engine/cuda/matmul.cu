#include <cstdint>

#include "engine/cuda/matmul.cuh"

namespace kvtier::engine::cuda {
namespace {

// Outputs per block side: a block computes kTile rows x kTile outputs, staging kTile-wide
// slices of X and W in shared memory.
constexpr int kTile = 16;
// Cap on grid.y; the kernel loops over row tiles beyond it.
constexpr int64_t kGridRowTilesMax = 65535;

// Thread (ty, tx) owns output (row tile*16 + ty, column tile*16 + tx) and runs the contract's
// chain acc = fma(X[t][k], W[o][k], acc) for k in order (engine/matmul.h): the k loop only
// walks the slice's real elements, so no padding term ever enters a result.
__global__ void MatMulKernel(const float* __restrict__ x, int rows, int in,
                             const float* __restrict__ w, int out, float* __restrict__ y) {
  __shared__ float xs[kTile][kTile + 1];  // [row][k]
  __shared__ float ws[kTile][kTile + 1];  // [output][k]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  const int64_t w_row = static_cast<int64_t>(blockIdx.x) * kTile + ty;
  for (int64_t tile = blockIdx.y; tile * kTile < rows; tile += gridDim.y) {
    const int64_t t = tile * kTile + ty;
    float acc = 0.0f;
    for (int k0 = 0; k0 < in; k0 += kTile) {
      const int k = k0 + tx;
      xs[ty][tx] = (t < rows && k < in) ? x[t * in + k] : 0.0f;
      ws[ty][tx] = (w_row < out && k < in) ? w[w_row * in + k] : 0.0f;
      __syncthreads();
      const int kn = min(kTile, in - k0);
      for (int kk = 0; kk < kn; ++kk) acc = __fmaf_rn(xs[ty][kk], ws[tx][kk], acc);
      __syncthreads();
    }
    if (t < rows && o < out) y[t * out + o] = acc;
  }
}

}  // namespace

cudaError_t LaunchMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                         cudaStream_t stream) {
  if (rows <= 0 || out <= 0) return cudaSuccess;
  const int64_t col_tiles = (static_cast<int64_t>(out) + kTile - 1) / kTile;
  int64_t row_tiles = (static_cast<int64_t>(rows) + kTile - 1) / kTile;
  if (row_tiles > kGridRowTilesMax) row_tiles = kGridRowTilesMax;
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles));
  const dim3 block(kTile, kTile);
  MatMulKernel<<<grid, block, 0, stream>>>(x, rows, in, w, out, y);
  return cudaGetLastError();
}

}  // namespace kvtier::engine::cuda
