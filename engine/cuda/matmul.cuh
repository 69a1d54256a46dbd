// CUDA MatMul of the engine: Y[t*out + o] = Dot(W + o*in, X + t*in), one thread per output
// element, with exactly the arithmetic of the CPU Dot (engine/ops.cc): 8 interleaved partial
// sums over i in steps of 8, the reduction tree ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)), then the
// tail added in order. Built with --fmad=false, so every product and sum is rounded exactly as
// on the CPU (-ffp-contract=off) and the results are bit-identical.
// Device pointers in; launched on `stream`, asynchronous; returns the launch error.
// Compiled only when KVTIER_WITH_CUDA is on; private to engine/.
#pragma once

#include <cuda_runtime.h>

namespace kvtier::engine::cuda {

// x: rows*in floats, w: out*in floats (row-major), y: rows*out floats; all on the device.
cudaError_t LaunchMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                         cudaStream_t stream);

}  // namespace kvtier::engine::cuda
