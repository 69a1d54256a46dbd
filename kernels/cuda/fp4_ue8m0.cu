// FP4 E2M1 with one UE8M0 scale per 32 elements (kFp4Ue8m0x32): one thread per scale block, the
// reference's block code.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp4_ue8m0.cuh"

namespace kvtier::kernels::cuda {
namespace {

__global__ void QuantizeFp4Ue8m0Kernel(const float* __restrict__ x, size_t blocks,
                                       uint8_t* __restrict__ data, uint8_t* __restrict__ scales) {
  for (size_t b = FirstBlock(); b < blocks; b += BlockStride()) {
    internal::QuantizeBlockFp4Ue8m0(x + b * 32, data + b * 16, scales + b);
  }
}

__global__ void DequantizeFp4Ue8m0Kernel(const uint8_t* __restrict__ data,
                                         const uint8_t* __restrict__ scales, size_t blocks,
                                         float* __restrict__ out) {
  for (size_t b = FirstBlock(); b < blocks; b += BlockStride()) {
    internal::DequantizeBlockFp4Ue8m0(data + b * 16, scales[b], out + b * 32);
  }
}

}  // namespace

cudaError_t LaunchQuantizeFp4Ue8m0(const float* x, size_t blocks, uint8_t* data, uint8_t* scales,
                                   cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  QuantizeFp4Ue8m0Kernel<<<GridFor(blocks), kThreadsPerBlock, 0, stream>>>(x, blocks, data, scales);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeFp4Ue8m0(const uint8_t* data, const uint8_t* scales, size_t blocks,
                                     float* out, cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  DequantizeFp4Ue8m0Kernel<<<GridFor(blocks), kThreadsPerBlock, 0, stream>>>(data, scales, blocks,
                                                                             out);
  return cudaGetLastError();
}

}  // namespace kvtier::kernels::cuda
