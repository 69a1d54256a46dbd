// Shared launch helpers of the CUDA kernels. Each kernel is one thread per scale block
// running the reference's block functions (kernels/internal/scalar.h): simple, bit-exact with
// the CPU reference by construction, and bounded by memory bandwidth for these small blocks.
// Compiled only when KVTIER_WITH_CUDA is on; private to kernels/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/internal/scalar.h"

namespace kvtier::kernels::cuda {

// Threads per CUDA block and the cap on the grid (the kernels loop grid-stride beyond it).
constexpr int kThreadsPerBlock = 256;
constexpr size_t kGridBlocksMax = 65535;

inline unsigned GridFor(size_t scale_blocks) {
  size_t grid = (scale_blocks + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (grid == 0) grid = 1;
  if (grid > kGridBlocksMax) grid = kGridBlocksMax;
  return static_cast<unsigned>(grid);
}

// Index of this thread's first scale block and the grid-stride step.
__device__ __forceinline__ size_t FirstBlock() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t BlockStride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

}  // namespace kvtier::kernels::cuda
