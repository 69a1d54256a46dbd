// CUDA MatMul of the engine: Y[t*out + o] with the summation order of engine/matmul.h, the
// one every CPU kernel keeps: acc = fma(X[t*in + k], W[o*in + k], acc) for k = 0..in-1 in
// order from +0.0f, each step one __fmaf_rn (single rounding). Tiled 16 x 16 outputs per block
// through shared memory; the tiling changes which thread computes an output, never its chain,
// so the results are bit-identical to MatMulCpu. The file is built with --fmad=false so that
// no other arithmetic is contracted behind the explicit fmas.
// Device pointers in; launched on `stream`, asynchronous; returns the launch error.
// Compiled only when KVTIER_WITH_CUDA is on; private to engine/.
#pragma once

#include <cuda_runtime.h>

namespace kvtier::engine::cuda {

// x: rows*in floats, w: out*in floats (row-major), y: rows*out floats; all on the device.
cudaError_t LaunchMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                         cudaStream_t stream);

}  // namespace kvtier::engine::cuda
