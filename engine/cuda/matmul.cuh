// CUDA MatMul of the engine: Y[t*out + o] with the summation order of engine/matmul.h, the
// one every CPU kernel keeps: acc = fma(X[t*in + k], W[o*in + k], acc) for k = 0..in-1 in
// order from +0.0f, each step one __fmaf_rn (single rounding). Every kernel below changes only
// which thread computes an output and how its operands reach it, never the output's chain, so
// all are bit-identical to MatMulCpu. The file is built with --fmad=false so that no other
// arithmetic is contracted behind the explicit fmas.
// Kernels (engine/cuda/backend.h CudaMatMulKernel):
//   kTile16    16 x 16 outputs per block, one output per thread (the first kernel; the one
//              that fills the GPU best on small shapes);
//   kRegTile64 64 rows x 64 outputs per block of 256 threads, 4 x 4 outputs per thread held in
//              registers, 16-wide k slices of X and W in shared memory (prefill);
//   kFewRows   one output per thread (32 per block) for up to kFewRowsMax rows at once, each
//              thread streaming its own row of W into shared memory with asynchronous copies
//              two slices ahead (decode: a GEMV's cost is its weight bytes); needs in % 4 == 0
//              and 16-byte aligned x and w, and otherwise runs as kTile16.
// kAuto: kFewRows for one row (decode) where it fits; else kRegTile64 for 32 rows or more when
// its 64 x 64 tiles number at least 64 (enough to spread over an H200's 132 multiprocessors),
// kTile16 otherwise.
// Device pointers in; launched on `stream`, asynchronous; returns the launch error.
// Compiled only when KVTIER_WITH_CUDA is on; private to engine/.
#pragma once

#include <cuda_runtime.h>

#include "engine/cuda/backend.h"

namespace kvtier::engine::cuda {

// Rows a kFewRows pass computes together (more rows loop over further passes of W).
inline constexpr int kFewRowsMax = 8;

// x: rows*in floats, w: out*in floats (row-major), y: rows*out floats; all on the device.
cudaError_t LaunchMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                         cudaStream_t stream, CudaMatMulKernel kernel = CudaMatMulKernel::kAuto);

}  // namespace kvtier::engine::cuda
