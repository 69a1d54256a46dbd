// CUDA kernels for FP8 E4M3 with one UE8M0 scale per 32 elements (kFp8Ue8m0x32). Device pointers
// in; launched on `stream`, asynchronous; returns the launch error (cudaSuccess when queued).
// Private to kernels/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvtier::kernels::cuda {

// x: blocks*32 floats -> data: blocks*32 bytes, scales: blocks bytes.
cudaError_t LaunchQuantizeFp8Ue8m0(const float* x, size_t blocks, uint8_t* data, uint8_t* scales,
                                   cudaStream_t stream);
// data + scales -> out: blocks*32 floats.
cudaError_t LaunchDequantizeFp8Ue8m0(const uint8_t* data, const uint8_t* scales, size_t blocks,
                                     float* out, cudaStream_t stream);

}  // namespace kvtier::kernels::cuda
