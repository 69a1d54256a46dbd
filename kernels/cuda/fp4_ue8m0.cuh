// CUDA kernels for FP4 E2M1 with one UE8M0 scale per 32 elements (kFp4Ue8m0x32). Device pointers
// in; launched on `stream`, asynchronous; returns the launch error (cudaSuccess when queued).
// Private to kernels/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvtier::kernels::cuda {

// x: blocks*32 floats -> data: blocks*16 bytes, scales: blocks bytes.
cudaError_t LaunchQuantizeFp4Ue8m0(const float* x, size_t blocks, uint8_t* data, uint8_t* scales,
                                   cudaStream_t stream);
// data + scales -> out: blocks*32 floats.
cudaError_t LaunchDequantizeFp4Ue8m0(const uint8_t* data, const uint8_t* scales, size_t blocks,
                                     float* out, cudaStream_t stream);

}  // namespace kvtier::kernels::cuda
