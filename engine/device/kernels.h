// The kernels of the engine's device layers (engine/device/layers.h): the dense part of a layer
// (the mHC mixes, the norms, the attention sublayer's products, the MoE sublayer, the head) as
// one function per output element.
//
// Each kernel is a plain struct of device pointers and sizes with `threads` (how many outputs),
// `kName` (its name in a backend's profile) and `operator()(i)`, which computes output i alone:
// no shared memory, no barrier, no output written by two threads. So the same code runs on a
// GPU (engine/device/cuda_backend.cu: one CUDA thread per i) and on the host
// (engine/device/host_backend.cc: a loop over i, the "host twin"), and the host twin checks on
// any machine what the GPU computes.
//
// Every output is computed in the order of the engine's CPU path (engine/ops.h, model.cc,
// model_moe.cc), operation for operation: the mix products in Dot's eight-lane order, the norms'
// double sums of squares in element order, the Sinkhorn loops, the MatMul contract's one fused
// multiply-add chain per output (engine/matmul.h), the router's top-k order (TopKByScore), each
// product rounded before its sum elsewhere (the engine is built with -ffp-contract=off, the CUDA
// files with --fmad=false). On the host twin the results are the CPU path's bits (a test); on a
// GPU they differ only where the CUDA math library's expf / log1pf do (a few ulp), which the
// golden vectors' tolerance covers.
//
// Weights a kernel reads itself (not through MatMul) are stored output-minor ("transposed": the
// weight of input k for output o at k * outputs + o), so that on a GPU the threads of adjacent
// outputs read adjacent addresses at every step of their chains (coalesced loads); each output's
// chain still runs over k in order, so the bits are those of the row-major CPU loops.
//
// Thread safety: the structs are values; a kernel's outputs must not overlap its inputs except
// where a kernel says so.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "engine/scalar_math.h"  // KVTIER_HD, Sigmoid, Silu, Softplus, TopKKey: the CPU path's own

namespace kvtier::engine::device {

// Most streams of a residual (hc_mult) a kernel keeps in registers (EngineConfig allows 16).
inline constexpr int kDeviceHcMultMax = 16;
// Most routed experts one token takes (num_experts_per_tok) on the device path.
inline constexpr int kDeviceExpertsPerTokenMax = 16;

namespace kernel_math {

using engine::Sigmoid;
using engine::Silu;
using engine::Softplus;
using engine::TopKKey;

// std::max / std::min / std::clamp as the C++ library defines them (NaN handling included).
KVTIER_HD inline float StdMax(float a, float b) { return a < b ? b : a; }
KVTIER_HD inline float StdMin(float a, float b) { return b < a ? b : a; }
KVTIER_HD inline float StdClamp(float v, float lo, float hi) {
  return v < lo ? lo : (hi < v ? hi : v);
}

// engine::Dot of a[k * a_stride] and b[k]: eight partial sums, a fixed tree, then the tail.
KVTIER_HD inline float Dot(const float* a, int64_t a_stride, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const float p = a[(i + k) * a_stride] * b[i + k];
      acc[k] += p;
    }
  }
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (; i < n; ++i) {
    const float p = a[i * a_stride] * b[i];
    s += p;
  }
  return s;
}

// The MatMul contract (engine/matmul.h) with w[k * w_stride]: acc_0 = +0,
// acc_{k+1} = fma(x[k], w[k * w_stride], acc_k).
KVTIER_HD inline float FmaChain(const float* x, const float* w, int64_t w_stride, int n) {
  float acc = 0.0f;
  for (int k = 0; k < n; ++k) acc = fmaf(x[k], w[k * w_stride], acc);
  return acc;
}

}  // namespace kernel_math

// r[t] = float(1 / sqrt(sum_i double(x[t*n + i])^2 / n + eps)) for t < threads: RmsNorm's and
// the mixes' scale, the double sum in element order.
struct RowRsqrtKernel {
  static constexpr const char* kName = "RowRsqrt";
  const float* x;
  int n;
  double eps;
  float* r;
  int64_t threads;
  KVTIER_HD void operator()(int64_t t) const {
    const float* xt = x + t * n;
    double ss = 0;
    for (int i = 0; i < n; ++i) {
      const double v = xt[i];
      const double sq = v * v;
      ss += sq;
    }
    r[t] = static_cast<float>(1.0 / sqrt(ss / n + eps));
  }
};

// y[t*dim + d] = sum over streams i in order of pre[t*hc + i] * x[(t*hc + i)*dim + d], from
// +0.0 (Engine::PreMix's WeightedRowSums), for t*dim + d < threads.
struct PreMixKernel {
  static constexpr const char* kName = "PreMix";
  const float* x;
  const float* pre;
  int hc, dim;
  float* y;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t t = i / dim, d = i % dim;
    float acc = 0.0f;
    for (int s = 0; s < hc; ++s) {
      const float p = pre[t * hc + s] * x[(t * hc + s) * dim + d];
      acc += p;
    }
    y[i] = acc;
  }
};

// y[t*dim + d] = y[t*dim + d] * r[t] * w[d] (w null: times 1), in place: RmsNormRows after
// RowRsqrtKernel.
struct ScaleRowsKernel {
  static constexpr const char* kName = "ScaleRows";
  float* y;
  const float* r;
  const float* w;
  int dim;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t t = i / dim, d = i % dim;
    const float a = y[i] * r[t];
    y[i] = a * (w != nullptr ? w[d] : 1.0f);
  }
};

// mixes[t*m + j] = Dot(row j of fn, x + t*n, n) * r[t] for t*m + j < threads (HcMixesRows'
// scaled mix products).
struct MixDotsKernel {
  static constexpr const char* kName = "MixDots";
  const float* fn_t;  // fn output-minor: [n x m]
  int m;
  const float* x;
  int n;
  const float* r;
  float* mixes;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t t = i / m, j = i % m;
    mixes[i] = kernel_math::Dot(fn_t + j, m, x + t * n, n) * r[t];
  }
};

// pre, post and comb of row t < threads from its scaled mixes (ops.cc MixOutputs): the
// sigmoids, each comb row's softmax plus eps, then `iters` Sinkhorn normalisations (a column
// pass, then iters - 1 row and column pairs), each dividing by (sum + eps).
struct MixOutputsKernel {
  static constexpr const char* kName = "MixOutputs";
  const float* mixes;
  int hc;
  const float* scale;  // [3]
  const float* base;   // [(2 + hc) * hc]
  int iters;
  float eps;
  float* pre;
  float* post;
  float* comb;
  int64_t threads;
  KVTIER_HD void operator()(int64_t t) const {
    using kernel_math::Sigmoid;
    const int m = (2 + hc) * hc;
    const float* mx_t = mixes + t * m;
    float* pr = pre + t * hc;
    float* po = post + t * hc;
    float* c = comb + t * hc * hc;
    for (int i = 0; i < hc; ++i) {
      const float a = mx_t[i] * scale[0];
      pr[i] = Sigmoid(a + base[i]) + eps;
    }
    for (int i = 0; i < hc; ++i) {
      const float a = mx_t[hc + i] * scale[1];
      po[i] = 2.0f * Sigmoid(a + base[hc + i]);
    }
    for (int i = 0; i < hc; ++i) {
      float* row = c + i * hc;
      float mx = -INFINITY;
      for (int j = 0; j < hc; ++j) {
        const float a = mx_t[2 * hc + i * hc + j] * scale[2];
        row[j] = a + base[2 * hc + i * hc + j];
        mx = kernel_math::StdMax(mx, row[j]);
      }
      float sum = 0;
      for (int j = 0; j < hc; ++j) {
        row[j] = expf(row[j] - mx);
        sum += row[j];
      }
      for (int j = 0; j < hc; ++j) row[j] = row[j] / sum + eps;
    }
    ColumnNorm(c);
    for (int it = 1; it < iters; ++it) {
      RowNorm(c);
      ColumnNorm(c);
    }
  }
  KVTIER_HD void ColumnNorm(float* c) const {
    for (int j = 0; j < hc; ++j) {
      float s = 0;
      for (int i = 0; i < hc; ++i) s += c[i * hc + j];
      const float den = s + eps;
      for (int i = 0; i < hc; ++i) c[i * hc + j] /= den;
    }
  }
  KVTIER_HD void RowNorm(float* c) const {
    for (int i = 0; i < hc; ++i) {
      float s = 0;
      for (int j = 0; j < hc; ++j) s += c[i * hc + j];
      const float den = s + eps;
      for (int j = 0; j < hc; ++j) c[i * hc + j] /= den;
    }
  }
};

// The residual after a sublayer (Engine::MixSublayer), in place: for t*dim + d < threads and
// each stream j, x[j][d] = post[j] * f[d] + sum over streams i in order of comb[i][j] *
// x_old[i][d].
struct MixSublayerKernel {
  static constexpr const char* kName = "MixSublayer";
  float* x;
  const float* f;
  const float* post;
  const float* comb;
  int hc, dim;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t t = i / dim, d = i % dim;
    float* xt = x + t * hc * dim;
    const float* cb = comb + t * hc * hc;
    float old[kDeviceHcMultMax];
    for (int s = 0; s < hc; ++s) old[s] = xt[s * dim + d];
    for (int j = 0; j < hc; ++j) {
      float acc = post[t * hc + j] * f[i];
      for (int s = 0; s < hc; ++s) {
        const float p = cb[s * hc + j] * old[s];
        acc += p;
      }
      xt[j * dim + d] = acc;
    }
  }
};

// y[t*out + o] = FmaChain(x + t*in, w + o*in, in) for t*out + o < threads (MatMul).
struct MatMulKernel {
  static constexpr const char* kName = "MatMul";
  const float* x;
  int in;
  const float* w;  // [out x in]
  int out;
  float* y;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t t = i / out, o = i % out;
    y[i] = kernel_math::FmaChain(x + t * in, w + o * in, 1, in);
  }
};

// The router of row t < threads (Engine::Moe): scores s_e = sqrt(softplus(logit_e)); the k
// experts with the highest s_e + bias_e (ties to the lower index), in increasing index order,
// to chosen[t*k ..]; each one's weight s_e (over the k scores' sum, in that order, when `norm`)
// times `scaling`.
struct RouteKernel {
  static constexpr const char* kName = "Route";
  const float* logits;  // [rows x experts]
  const float* bias;    // [experts]
  int experts, k;       // k <= kDeviceExpertsPerTokenMax
  bool norm;
  float scaling;
  int32_t* chosen;  // [rows x k]
  float* weight;    // [rows x k]
  int64_t threads;
  KVTIER_HD float Score(int64_t t, int e) const {
    return sqrtf(kernel_math::Softplus(logits[t * experts + e]));
  }
  KVTIER_HD void operator()(int64_t t) const {
    int32_t top[kDeviceExpertsPerTokenMax];
    const int kk = k < experts ? k : experts;
    // The k largest keys (all distinct), one pass each: the largest below the last one taken.
    uint64_t below = ~uint64_t{0};
    bool first = true;
    for (int j = 0; j < kk; ++j) {
      uint64_t best = 0;
      int32_t best_e = -1;
      for (int e = 0; e < experts; ++e) {
        const uint64_t key = kernel_math::TopKKey(Score(t, e) + bias[e], e);
        if ((first || key < below) && (best_e < 0 || key > best)) {
          best = key;
          best_e = e;
        }
      }
      top[j] = best_e;
      below = best;
      first = false;
    }
    for (int a = 1; a < kk; ++a) {  // increasing index order
      const int32_t v = top[a];
      int b = a;
      for (; b > 0 && top[b - 1] > v; --b) top[b] = top[b - 1];
      top[b] = v;
    }
    float sum = 0;
    for (int j = 0; j < kk; ++j) sum += Score(t, top[j]);
    for (int j = 0; j < kk; ++j) {
      const float s = Score(t, top[j]);
      const float w = norm ? s / sum : s;
      chosen[t * k + j] = top[j];
      weight[t * k + j] = w * scaling;
    }
  }
};

// The gate and up products of a SwiGLU MLP and its activation, for row r and intermediate unit
// u (r*inter + u < threads): input row r / rows_per_input of x; the weights of expert
// expert[r] (expert null: the one matrix w1 / w3); g = silu(min(x.w1, limit)) * clamp(x.w3,
// -limit, limit), times row_weight[r] when given (SwigluActivate).
struct SwigluUpKernel {
  static constexpr const char* kName = "SwigluUp";
  const float* x;  // [inputs x dim]
  int dim, inter, rows_per_input;
  const int32_t* expert;    // [rows] or null
  const float* row_weight;  // [rows] or null
  const float* w1_t;        // per expert output-minor: [experts x dim x inter]
  const float* w3_t;
  float limit;
  float* g;  // [rows x inter]
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    using kernel_math::StdClamp;
    using kernel_math::StdMin;
    const int64_t r = i / inter, u = i % inter;
    const float* xr = x + (r / rows_per_input) * dim;
    const int64_t e = expert != nullptr ? expert[r] : 0;
    const int64_t col = e * dim * inter + u;
    const float gv = kernel_math::FmaChain(xr, w1_t + col, inter, dim);
    const float uv = kernel_math::FmaChain(xr, w3_t + col, inter, dim);
    float a = kernel_math::Silu(StdMin(gv, limit)) * StdClamp(uv, -limit, limit);
    if (row_weight != nullptr) a *= row_weight[r];
    g[i] = a;
  }
};

// y[r*out + o] = FmaChain(x + r*in, row o of matrix which[r] (which null: of the one matrix)),
// for r*out + o < threads: a product whose rows each take their own matrix. A SwiGLU MLP's down
// product (each row's expert) and the attention sublayer's grouped output projection (rows
// t*groups + g of heads' outputs, each its group's matrix).
struct PerRowMatMulKernel {
  static constexpr const char* kName = "PerRowMatMul";
  const float* x;  // [rows x in]
  int in, out;
  const int32_t* which;  // [rows] or null
  const float* w_t;      // per matrix output-minor: [matrices x in x out]
  float* y;              // [rows x out]
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t r = i / out, o = i % out;
    const int64_t m = which != nullptr ? which[r] : 0;
    y[i] = kernel_math::FmaChain(x + r * in, w_t + m * in * out + o, out, in);
  }
};

// out[t*dim + d] = (the k routed outputs of row t summed in slot order) + shared[t*dim + d]
// (shared null: + 0.0), for t*dim + d < threads (CombineExperts).
struct CombineKernel {
  static constexpr const char* kName = "Combine";
  const float* routed;  // [rows x k x dim]
  const float* shared;  // [rows x dim] or null
  int k, dim;
  float* out;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t t = i / dim, d = i % dim;
    float acc = routed[(t * k) * dim + d];
    for (int j = 1; j < k; ++j) acc += routed[(t * k + j) * dim + d];
    out[i] = acc + (shared != nullptr ? shared[i] : 0.0f);
  }
};

// dst[j*width + c] = src[index[j]*width + c] for j*width + c < threads.
struct GatherRowsKernel {
  static constexpr const char* kName = "GatherRows";
  const float* src;
  const int64_t* index;
  int width;
  float* dst;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t j = i / width, c = i % width;
    dst[i] = src[index[j] * width + c];
  }
};

}  // namespace kvtier::engine::device
