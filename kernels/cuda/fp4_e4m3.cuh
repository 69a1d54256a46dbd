// CUDA kernels for FP4 E2M1 with one E4M3 scale per 16 elements (kFp4E4M3x16). Device pointers in;
// launched on `stream`, asynchronous; returns the launch error (cudaSuccess when queued). Private
// to kernels/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvtier::kernels::cuda {

// x: blocks*16 floats -> data: blocks*8 bytes, scales: blocks bytes.
cudaError_t LaunchQuantizeFp4E4M3(const float* x, size_t blocks, uint8_t* data, uint8_t* scales,
                                  cudaStream_t stream);
// data + scales -> out: blocks*16 floats.
cudaError_t LaunchDequantizeFp4E4M3(const uint8_t* data, const uint8_t* scales, size_t blocks,
                                    float* out, cudaStream_t stream);

}  // namespace kvtier::kernels::cuda
