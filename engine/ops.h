// Numeric building blocks of the engine (CPU reference path; MatMul may run on CUDA).
//
// Every function computes each output element with a fixed operation order that does not
// depend on batch size or thread count, so a token's results are bit-identical whether it
// is processed alone (decode), in a batch (prefill) or on any number of threads.
// Thread safety: pure functions; MatMul uses the pool passed in.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/matmul.h"
#include "engine/scalar_math.h"
#include "engine/thread_pool.h"

namespace kvtier::engine {

// Sum of a[i]*b[i] with 8 interleaved partial sums reduced in a fixed tree.
float Dot(const float* a, const float* b, int n);

// out[r] = Dot(a[r], b, n) for r < 4, bit for bit, sharing the loads of b.
void Dot4(const float* const a[4], const float* b, int n, float out[4]);

// The index std::max_element(x, x + n) returns (n > 0): the first maximum, where a NaN at
// index 0 wins and any other NaN is passed over. The largest value in eight branch-free lanes,
// then the first element equal to it (std::max_element is one serial compare-and-move chain).
int64_t ArgMax(const float* x, int64_t n);

// y[i] += a * x[i] for i < n, each element rounded as the product and then the sum (no fused
// multiply-add: this file is built without FMA), four elements per vector step; bit-identical to
// the scalar loop. x and y must not overlap.
void Axpy(float a, const float* x, int n, float* y);

// Y[t*out + o] = sum over k of X[t*in + k] * W[o*in + k] for t < rows, o < out (W is
// [out x in] row-major), summed as one fused multiply-add chain in k order (engine/matmul.h),
// so a result never depends on the call's row count, the tiling or the thread count.
// Runs the CUDA kernel (engine/cuda/matmul.cuh, bit-identical to MatMulCpu) when the build has
// CUDA, a device is present (checked once), the environment variable KVTIER_ENGINE_CUDA is "1"
// (read on every call that qualifies; off by default: the per-call copies make it slower than
// the CPU on the miniature) and rows*out*in >= kCudaMatMulMinWork; otherwise,
// and after any CUDA error (logged once, then the CUDA path stays off), runs MatMulCpu.
// `w` must be a weight matrix that stays unchanged while cached on the device
// (engine/cuda/backend.h); activations may change freely.
void MatMul(ThreadPool* pool, const float* x, int rows, int in, const float* w, int out, float* y);
// The CPU path of MatMul (always available): the AVX2/FMA kernel on W's packed copy
// (RegisterPackedWeight; packed per call when W is not registered) or the scalar fallback,
// bit-identical (engine/matmul.h).
void MatMulCpu(ThreadPool* pool, const float* x, int rows, int in, const float* w, int out,
               float* y);
// As above with W's packed copy given (`packed_w`: the packing of (w, in, out), or null: looked up
// in the registry), so a caller that holds it skips the registry's lock and lookup.
void MatMul(ThreadPool* pool, const float* x, int rows, int in, const float* w,
            const PackedMatrix* packed_w, int out, float* y);
void MatMulCpu(ThreadPool* pool, const float* x, int rows, int in, const float* w,
               const PackedMatrix* packed_w, int out, float* y);
// Several products in one call, each part's Y bit-identical to MatMul of that
// part alone (a part's `packed` may be null: looked up or packed as MatMulCpu does). Parts the
// CUDA path takes run through MatMul one by one; the rest run on the CPU together
// (MatMulManyWith, engine/matmul.h: with few rows, one parallel section for all of them).
void MatMulMany(ThreadPool* pool, const MatMulPart* parts, int n_parts);
// Smallest rows*out*in sent to the GPU: below it the copies cost more than the CPU work.
inline constexpr int64_t kCudaMatMulMinWork = int64_t{1} << 16;
// Number of MatMul calls served by the CUDA path since process start (0 without CUDA).
int64_t MatMulCudaCalls();

// y = x * rsqrt(mean(x^2) + eps) * weight (weight may be null: no weight). In place allowed.
void RmsNorm(const float* x, const float* weight, int n, double eps, float* y);
// RmsNorm of `rows` rows of n floats (row t: x + t * n to y + t * n; in place allowed), bit for
// bit what one RmsNorm per row writes: the rows' mean squares (serial double sums, a chain of
// dependent adds each) run up to eight rows side by side.
void RmsNormRows(const float* x, int rows, const float* weight, int n, double eps, float* y);
// y = (x - mean) * rsqrt(var + eps) * weight + bias.
void LayerNorm(const float* x, const float* weight, const float* bias, int n, double eps, float* y);

// RoPE frequencies for `rope_dim` rotary dims (DeepSeek precompute_freqs_cis, incl. YaRN).
struct RopeParams {
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0;
  double original_max_position = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};
std::vector<double> RopeFrequencies(int rope_dim, const RopeParams& params);
// Rotates adjacent pairs (x[2i], x[2i+1]) of x[0..2*freqs.size()) by angle pos*freq[i];
// inverse rotates by -angle.
void ApplyRope(float* x, const std::vector<double>& freqs, int64_t pos, bool inverse);
// ApplyRope split in two, for many vectors rotated at one position: RopeRotation writes
// c[i] = float(cos(pos * freqs[i])) and s[i] = float(sin(pos * freqs[i])) for i < freqs.size();
// ApplyRopeRotation(x, c, s, freqs.size(), inverse) then writes, bit for bit, what
// ApplyRope(x, freqs, pos, inverse) writes, without a cos and a sin per pair and call.
void RopeRotation(const std::vector<double>& freqs, int64_t pos, float* c, float* s);
void ApplyRopeRotation(float* x, const float* c, const float* s, int pairs, bool inverse);

// The k best of candidates[0..n) (indices into score) under "higher score first, ties to the
// lower index" (a strict total order for scores without NaN; -0.0 and +0.0 tie), written to *out
// in increasing index order; all of them when n <= k. TopKByScore keeps a k-entry heap of
// (score, index) keys packed into one integer each, so most candidates cost one compare;
// TopKByScoreReference is the std::nth_element selection it replaced. For scores without NaN
// both write the same indices (the set of the k best is unique), tests/engine.
void TopKByScore(const float* score, const int32_t* candidates, int64_t n, int k,
                 std::vector<int32_t>* out);
void TopKByScoreReference(const float* score, const int32_t* candidates, int64_t n, int k,
                          std::vector<int32_t>* out);

// Sigmoid, Silu, Softplus: engine/scalar_math.h (shared with the device kernels).

// mHC (reference §7): from 4-stream input x ([hc x dim]) and one sublayer's parameters
// (fn [(2+hc)*hc x hc*dim], scale [3], base [(2+hc)*hc]) computes
//   pre[hc]  = sigmoid(m[0:hc]*s0 + b) + eps
//   post[hc] = 2*sigmoid(m[hc:2hc]*s1 + b)
//   comb[hc x hc] = Sinkhorn(softmax_row(m[2hc:]*s2 + b) + eps), `iters` iterations: the
//   first a column normalisation, then iters-1 (row, column) pairs, each dividing by
//   (sum + eps).
// with m = (flatten(x) @ fn^T) * rsqrt(mean(x^2) + norm_eps).
void HcMixes(const float* x, int hc, int dim, const float* fn, const float* scale,
             const float* base, int iters, double hc_eps, double norm_eps, float* pre, float* post,
             float* comb);

// HcMixes of `rows` rows at once: row t reads x + t*hc*dim and writes pre + t*hc,
// post + t*hc and comb + t*hc*hc, bit for bit what `rows` HcMixes calls write. The mix
// products of a block of rows are taken four rows of fn at a time over every row of the block,
// so a block reads fn once rather than once per row (on AVX2 CPUs two rows of x per pass over
// those four rows of fn, eight lanes wide, each product summed in Dot's order), the rows' mean
// squares (serial double sums) run side by side, and so do the Sinkhorn normalisations of up to
// four rows (one vector lane per row, each lane's sums and divisions those of the one-row loop).
// HcMixes is this function with rows = 1.
void HcMixesRows(int rows, const float* x, int hc, int dim, const float* fn, const float* scale,
                 const float* base, int iters, double hc_eps, double norm_eps, float* pre,
                 float* post, float* comb);

// The mix products of HcMixesRows: out[t * m + i] = Dot(fn + i * n, x + t * n, n) for t < rows,
// i < m, bit for bit (exposed for its differential test; `avx2` is ignored where the CPU lacks
// AVX2).
void HcMixDots(const float* fn, int m, const float* x, int rows, int n, float* out, bool avx2);
// Whether this CPU runs HcMixDots' AVX2 kernel.
bool HcMixDotsAvx2Available();

// y[r * n + d] = sum over i < rows of w[r * rows + i] * x[i * n + d] for r < m, d < n, bit for
// bit what zeroing y's row r and then calling Axpy(w[r * rows + i], x + i * n, n, y + r * n) for
// i = 0, 1, ..., rows - 1 writes (the attention's weighted sum of value rows, one row of w per
// head). The AVX2 kernel keeps up to 64 elements of a row of y in registers over the whole loop
// over i instead of loading and storing y once per row of x (`avx2` is ignored where the CPU lacks
// AVX2; false runs the scalar reference). y must not overlap w or x.
void WeightedRowSums(const float* w, int m, const float* x, int rows, int n, float* y, bool avx2);

}  // namespace kvtier::engine
