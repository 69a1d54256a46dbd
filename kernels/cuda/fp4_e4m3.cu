// FP4 E2M1 with one E4M3 scale per 16 elements (kFp4E4M3x16): one thread per scale block, the
// reference's block code.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp4_e4m3.cuh"

namespace kvtier::kernels::cuda {
namespace {

__global__ void QuantizeFp4E4M3Kernel(const float* __restrict__ x, size_t blocks,
                                      uint8_t* __restrict__ data, uint8_t* __restrict__ scales) {
  for (size_t b = FirstBlock(); b < blocks; b += BlockStride()) {
    internal::QuantizeBlockFp4E4M3(x + b * 16, data + b * 8, scales + b);
  }
}

__global__ void DequantizeFp4E4M3Kernel(const uint8_t* __restrict__ data,
                                        const uint8_t* __restrict__ scales, size_t blocks,
                                        float* __restrict__ out) {
  for (size_t b = FirstBlock(); b < blocks; b += BlockStride()) {
    internal::DequantizeBlockFp4E4M3(data + b * 8, scales[b], out + b * 16);
  }
}

}  // namespace

cudaError_t LaunchQuantizeFp4E4M3(const float* x, size_t blocks, uint8_t* data, uint8_t* scales,
                                  cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  QuantizeFp4E4M3Kernel<<<GridFor(blocks), kThreadsPerBlock, 0, stream>>>(x, blocks, data, scales);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeFp4E4M3(const uint8_t* data, const uint8_t* scales, size_t blocks,
                                    float* out, cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  DequantizeFp4E4M3Kernel<<<GridFor(blocks), kThreadsPerBlock, 0, stream>>>(data, scales, blocks,
                                                                            out);
  return cudaGetLastError();
}

}  // namespace kvtier::kernels::cuda
