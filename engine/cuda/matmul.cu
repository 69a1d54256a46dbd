#include <cuda_pipeline.h>

#include <cstdint>

#include "engine/cuda/matmul.cuh"

namespace kvtier::engine::cuda {
namespace {

// Cap on grid.y; the kernels loop over row tiles beyond it.
constexpr int64_t kGridRowTilesMax = 65535;

// --- kTile16 -------------------------------------------------------------------------------
constexpr int kTile = 16;

// Thread (ty, tx) owns output (row tile*16 + ty, column tile*16 + tx) and runs the contract's
// chain for k in order: the k loop only walks the slice's real elements, so no padding term
// ever enters a result.
__global__ void MatMulTile16Kernel(const float* __restrict__ x, int rows, int in,
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

// --- kRegTile64 ----------------------------------------------------------------------------
constexpr int kBlockRows = 64;     // rows of X per block
constexpr int kBlockOutputs = 64;  // outputs (rows of W) per block
constexpr int kSliceK = 16;        // k per shared-memory slice
constexpr int kRegThreads = 256;   // 16 x 16 threads, each 4 rows x 4 outputs
constexpr int kPerThread = 4;

// Thread (ty, tx) owns rows r0 + 4*ty + i and outputs o0 + 4*tx + j (i, j < 4). Slices are
// stored k-major ([k][row], [k][output]; rows padded by 4 floats, which keeps 16-byte alignment
// and spreads the transposing stores over the banks), so one k step reads one float4 of X and
// one of W for 16 fmas. Each of the 16 accumulators runs its own chain in k order; a slice's k
// loop stops at the matrix's last real k, so zero padding never enters a chain.
__global__ void __launch_bounds__(kRegThreads)
    MatMulRegTileKernel(const float* __restrict__ x, int rows, int in, const float* __restrict__ w,
                        int out, float* __restrict__ y) {
  __shared__ __align__(16) float xs[kSliceK][kBlockRows + 4];
  __shared__ __align__(16) float ws[kSliceK][kBlockOutputs + 4];
  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kBlockOutputs;
  for (int64_t tile = blockIdx.y; tile * kBlockRows < rows; tile += gridDim.y) {
    const int64_t r0 = tile * kBlockRows;
    float acc[kPerThread][kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) acc[i][j] = 0.0f;
    }
    for (int k0 = 0; k0 < in; k0 += kSliceK) {
      // 64 x 16 elements of each operand, 4 per thread: element e is (row e / 16, k e % 16),
      // so a warp reads two rows' 16 consecutive floats.
#pragma unroll
      for (int l = 0; l < (kBlockRows * kSliceK) / kRegThreads; ++l) {
        const int e = tid + l * kRegThreads;
        const int rr = e / kSliceK, kk = e % kSliceK;
        const int64_t k = k0 + kk;
        const int64_t t = r0 + rr, o = o0 + rr;
        xs[kk][rr] = (t < rows && k < in) ? x[t * in + k] : 0.0f;
        ws[kk][rr] = (o < out && k < in) ? w[o * in + k] : 0.0f;
      }
      __syncthreads();
      const int kn = min(kSliceK, in - k0);
      for (int kk = 0; kk < kn; ++kk) {
        const float4 av = *reinterpret_cast<const float4*>(&xs[kk][4 * ty]);
        const float4 bv = *reinterpret_cast<const float4*>(&ws[kk][4 * tx]);
        const float a[kPerThread] = {av.x, av.y, av.z, av.w};
        const float b[kPerThread] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
          for (int j = 0; j < kPerThread; ++j) acc[i][j] = __fmaf_rn(a[i], b[j], acc[i][j]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t t = r0 + 4 * ty + i;
      if (t >= rows) continue;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int64_t o = o0 + 4 * tx + j;
        if (o < out) y[t * out + o] = acc[i][j];
      }
    }
  }
}

// --- kFewRows ------------------------------------------------------------------------------
constexpr int kFewOutputs = 32;  // outputs per block = threads per block (one warp)
constexpr int kStreamK = 112;    // floats of its own W row a thread copies per stage
constexpr int kStages = 3;       // slices in flight per thread: this one and two ahead
constexpr int kRowPad = 4;       // keeps 16-byte alignment; a row stride of 116 floats puts
                                 // 8 lanes' float4 reads in 8 distinct bank quads

// Thread tid owns output o0 + tid for rows r0 .. r0 + kFewRowsMax - 1 and streams its own row
// of W into shared memory with asynchronous 16-byte copies (cp.async), two slices ahead of the
// one it computes, so that each SM keeps tens of KiB of weight reads in flight (a GEMV reads
// each weight once: the work is the weight bytes). Only the thread that copies a slice reads
// it, so no block barrier is needed. Needs in % 4 == 0 and 16-byte aligned x and w
// (LaunchMatMul checks). Chains as in the other kernels, k in order.
__global__ void __launch_bounds__(kFewOutputs)
    MatMulFewRowsKernel(const float* __restrict__ x, int rows, int in, const float* __restrict__ w,
                        int out, float* __restrict__ y) {
  __shared__ __align__(16) float ws[kStages][kFewOutputs][kStreamK + kRowPad];
  const int tid = threadIdx.x;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kFewOutputs + tid;
  const bool live = o < out;
  const float* wrow = w + (live ? o : 0) * static_cast<int64_t>(in);
  const int slices = (in + kStreamK - 1) / kStreamK;
  // Issues slice `s` of this thread's row (nothing past the last) and commits the group; an
  // empty group keeps every thread's group count in step for __pipeline_wait_prior.
  auto issue = [&](int s) {
    if (live && s < slices) {
      const int k0 = s * kStreamK;
      const int n = min(kStreamK, in - k0);
      float* dst = ws[s % kStages][tid];
      for (int c = 0; c < n; c += 4) __pipeline_memcpy_async(dst + c, wrow + k0 + c, 16);
    }
    __pipeline_commit();
  };
  for (int64_t group = blockIdx.y; group * kFewRowsMax < rows; group += gridDim.y) {
    const int64_t r0 = group * kFewRowsMax;
    const int nr = static_cast<int>(min(static_cast<int64_t>(kFewRowsMax), rows - r0));
    float acc[kFewRowsMax];
#pragma unroll
    for (int r = 0; r < kFewRowsMax; ++r) acc[r] = 0.0f;
    issue(0);
    issue(1);
    for (int s = 0; s < slices; ++s) {
      issue(s + 2);
      __pipeline_wait_prior(kStages - 1);  // slice s has landed
      const float* wsl = ws[s % kStages][tid];
      const int k0 = s * kStreamK;
      const int n = min(kStreamK, in - k0);
      for (int c = 0; live && c < n; c += 4) {
        const float4 b = *reinterpret_cast<const float4*>(wsl + c);
#pragma unroll
        for (int r = 0; r < kFewRowsMax; ++r) {
          if (r >= nr) break;
          const float4 a = __ldg(reinterpret_cast<const float4*>(x + (r0 + r) * in + k0 + c));
          acc[r] = __fmaf_rn(a.x, b.x, acc[r]);
          acc[r] = __fmaf_rn(a.y, b.y, acc[r]);
          acc[r] = __fmaf_rn(a.z, b.z, acc[r]);
          acc[r] = __fmaf_rn(a.w, b.w, acc[r]);
        }
      }
    }
    __pipeline_wait_prior(0);  // the empty tail groups, before the next group reuses ws
    if (live) {
#pragma unroll
      for (int r = 0; r < kFewRowsMax; ++r) {
        if (r < nr) y[(r0 + r) * out + o] = acc[r];
      }
    }
  }
}

// kFewRows's preconditions: whole float4s per row, 16-byte aligned rows.
bool FewRowsFits(const float* x, int in, const float* w) {
  return in % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

// Rows up to which kAuto takes kFewRows: on an H200 it read a 4096 x 4096 matrix's weights at
// 1.2x kTile16's rate for one row, and at a quarter of it for 8 rows (each thread's chains then
// wait on 8 rows of X per step; docs/performance/engine.md).
constexpr int kFewRowsAutoRows = 1;

// Blocks of 64 x 64 below which kAuto takes kTile16: the small prefill shapes of mini-v4.1
// fill too few of the GPU's multiprocessors with 64 x 64 tiles (on an H200, 132 SMs: tile16
// was faster at 4 to 32 such blocks, regtile64 from 64; docs/performance/engine.md).
constexpr int64_t kRegTileMinBlocks = 64;
// Rows below which kAuto takes kTile16 whatever the block count: a 64-row tile of 8 rows read
// a 4096 x 4096 matrix at 148 GB/s against tile16's 266 on the H200.
constexpr int kRegTileMinRows = 32;

unsigned GridRows(int64_t rows, int64_t per_block) {
  const int64_t tiles = (rows + per_block - 1) / per_block;
  return static_cast<unsigned>(tiles < kGridRowTilesMax ? tiles : kGridRowTilesMax);
}

unsigned GridCols(int64_t out, int64_t per_block) {
  return static_cast<unsigned>((out + per_block - 1) / per_block);
}

}  // namespace

cudaError_t LaunchMatMul(const float* x, int rows, int in, const float* w, int out, float* y,
                         cudaStream_t stream, CudaMatMulKernel kernel) {
  if (rows <= 0 || out <= 0) return cudaSuccess;
  if (kernel == CudaMatMulKernel::kAuto) {
    const int64_t blocks64 = ((static_cast<int64_t>(rows) + kBlockRows - 1) / kBlockRows) *
                             ((static_cast<int64_t>(out) + kBlockOutputs - 1) / kBlockOutputs);
    if (rows <= kFewRowsAutoRows) {
      kernel = CudaMatMulKernel::kFewRows;
    } else if (rows >= kRegTileMinRows && blocks64 >= kRegTileMinBlocks) {
      kernel = CudaMatMulKernel::kRegTile64;
    } else {
      kernel = CudaMatMulKernel::kTile16;
    }
  }
  // kFewRows where it cannot run (unaligned rows) runs as kTile16, requested or chosen.
  if (kernel == CudaMatMulKernel::kFewRows && !FewRowsFits(x, in, w)) {
    kernel = CudaMatMulKernel::kTile16;
  }
  switch (kernel) {
    case CudaMatMulKernel::kTile16: {
      const dim3 grid(GridCols(out, kTile), GridRows(rows, kTile));
      MatMulTile16Kernel<<<grid, dim3(kTile, kTile), 0, stream>>>(x, rows, in, w, out, y);
      break;
    }
    case CudaMatMulKernel::kRegTile64: {
      const dim3 grid(GridCols(out, kBlockOutputs), GridRows(rows, kBlockRows));
      MatMulRegTileKernel<<<grid, kRegThreads, 0, stream>>>(x, rows, in, w, out, y);
      break;
    }
    case CudaMatMulKernel::kFewRows:
    case CudaMatMulKernel::kAuto: {
      const dim3 grid(GridCols(out, kFewOutputs), GridRows(rows, kFewRowsMax));
      MatMulFewRowsKernel<<<grid, kFewOutputs, 0, stream>>>(x, rows, in, w, out, y);
      break;
    }
  }
  return cudaGetLastError();
}

}  // namespace kvtier::engine::cuda
