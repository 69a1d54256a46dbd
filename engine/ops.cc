#include "engine/ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numbers>

#include "common/logging.h"
#include "engine/config.h"
#include "engine/matmul.h"
#if KVTIER_WITH_CUDA
#include "engine/cuda/backend.h"
#endif

namespace kvtier::engine {

float Dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

int64_t ArgMax(const float* x, int64_t n) {
  // std::max_element keeps x[0] while nothing compares above it: a NaN there is never left.
  if (n <= 1 || x[0] != x[0]) return 0;
  // The largest value, NaNs passed over (a compare with a NaN is false), in eight lanes with
  // no branch; then the first element equal to it, which is std::max_element's (it moves only
  // to a strictly greater value; -0 and +0 compare equal, so the first zero of either sign).
  float best[8] = {x[0], x[0], x[0], x[0], x[0], x[0], x[0], x[0]};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) best[k] = x[i + k] > best[k] ? x[i + k] : best[k];
  }
  for (; i < n; ++i) best[0] = x[i] > best[0] ? x[i] : best[0];
  float m = best[0];
  for (int k = 1; k < 8; ++k) m = best[k] > m ? best[k] : m;
  for (i = 0; i < n; ++i) {
    if (x[i] == m) return i;
  }
  return 0;  // not reached: m is one of x's non-NaN values
}

void Dot4(const float* const a[4], const float* b, int n, float out[4]) {
  // Four Dots sharing the loads of b; lane k of vector half h is Dot's acc[4h + k] for one of
  // the four a's, so each result is summed exactly as Dot sums it.
  typedef float V4 __attribute__((vector_size(16)));
  V4 lo[4] = {}, hi[4] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    V4 b0, b1;
    std::memcpy(&b0, b + i, sizeof b0);
    std::memcpy(&b1, b + i + 4, sizeof b1);
    for (int r = 0; r < 4; ++r) {
      V4 a0, a1;
      std::memcpy(&a0, a[r] + i, sizeof a0);
      std::memcpy(&a1, a[r] + i + 4, sizeof a1);
      const V4 p0 = a0 * b0, p1 = a1 * b1;
      lo[r] += p0;
      hi[r] += p1;
    }
  }
  for (int r = 0; r < 4; ++r) {
    float s = ((lo[r][0] + hi[r][0]) + (lo[r][2] + hi[r][2])) +
              ((lo[r][1] + hi[r][1]) + (lo[r][3] + hi[r][3]));
    for (int j = i; j < n; ++j) s += a[r][j] * b[j];
    out[r] = s;
  }
}

void Axpy(float a, const float* x, int n, float* y) {
  // GCC/Clang vector extension: SSE on x86-64, NEON on arm64; elementwise, so the rounding of
  // each element is that of the scalar `y[i] += a * x[i]`.
  typedef float V4 __attribute__((vector_size(16)));
  const V4 av = {a, a, a, a};
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    V4 xv, yv;
    std::memcpy(&xv, x + i, sizeof xv);
    std::memcpy(&yv, y + i, sizeof yv);
    const V4 prod = av * xv;
    yv += prod;
    std::memcpy(y + i, &yv, sizeof yv);
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

void MatMulCpu(ThreadPool* pool, const float* x, int rows, int in, const float* w, int out,
               float* y) {
  MatMulCpu(pool, x, rows, in, w, nullptr, out, y);
}

void MatMulCpu(ThreadPool* pool, const float* x, int rows, int in, const float* w,
               const PackedMatrix* packed_w, int out, float* y) {
  const MatMulKernel k = ActiveMatMulKernel();
  if (k == MatMulKernel::kScalar) {
    MatMulWith(k, pool, x, rows, in, w, nullptr, out, y);
    return;
  }
  if (packed_w != nullptr) {
    MatMulWith(k, pool, x, rows, in, w, packed_w, out, y);
    return;
  }
  if (auto packed = FindPackedWeight(w, in, out)) {
    MatMulWith(k, pool, x, rows, in, w, packed.get(), out, y);
    return;
  }
  const PackedMatrix packed(w, in, out);  // not registered: packed for this call only
  MatMulWith(k, pool, x, rows, in, w, &packed, out, y);
}

namespace {
std::atomic<int64_t> g_cuda_calls{0};
#if KVTIER_WITH_CUDA
std::atomic<bool> g_cuda_failed{false};  // set after the first CUDA error: CPU from then on

// True when the CUDA path may be tried for this call.
bool CudaEligible(int64_t work) {
  if (work < kCudaMatMulMinWork || g_cuda_failed.load(std::memory_order_relaxed)) return false;
  static const bool device_ok = cuda::CudaMatMulDeviceStatus().ok();
  if (!device_ok) return false;
  // Opt-in: with activations copied over the bus on every call, the CUDA MatMul made the
  // miniature 0.38-0.95x as fast as the CPU on an H200 (docs/performance/engine.md).
  const char* env = std::getenv("KVTIER_ENGINE_CUDA");
  return env != nullptr && std::strcmp(env, "1") == 0;
}
#endif
}  // namespace

int64_t MatMulCudaCalls() { return g_cuda_calls.load(std::memory_order_relaxed); }

void MatMul(ThreadPool* pool, const float* x, int rows, int in, const float* w, int out, float* y) {
  MatMul(pool, x, rows, in, w, nullptr, out, y);
}

void MatMul(ThreadPool* pool, const float* x, int rows, int in, const float* w,
            const PackedMatrix* packed_w, int out, float* y) {
#if KVTIER_WITH_CUDA
  if (CudaEligible(static_cast<int64_t>(rows) * out * in)) {
    const Status st = cuda::CudaMatMul(x, rows, in, w, out, y);
    if (st.ok()) {
      g_cuda_calls.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    // Rejected: this call does not fit the device limits; the CPU takes it, CUDA stays on.
    if (st.code() != StatusCode::kRejected && !g_cuda_failed.exchange(true)) {
      KVTIER_LOG(kWarn) << "engine CUDA MatMul failed, using the CPU from now on: "
                        << st.ToString();
    }
  }
#endif
  MatMulCpu(pool, x, rows, in, w, packed_w, out, y);
}

void MatMulMany(ThreadPool* pool, const MatMulPart* parts, int n_parts) {
  if (pool == nullptr || pool->threads() <= 1) {  // nothing to share: the plain calls
    for (int i = 0; i < n_parts; ++i) {
      const MatMulPart& p = parts[i];
      MatMul(pool, p.x, p.rows, p.in, p.w, p.packed, p.out, p.y);
    }
    return;
  }
  const MatMulKernel k = ActiveMatMulKernel();
  thread_local std::vector<MatMulPart> cpu_slot;  // reused call to call (a decode step's)
  std::vector<MatMulPart>& cpu = cpu_slot;
  cpu.clear();
  std::vector<std::shared_ptr<const PackedMatrix>> found;  // registered copies, held for the call
  std::vector<std::unique_ptr<PackedMatrix>> own;          // unregistered W: packed for this call
  for (int i = 0; i < n_parts; ++i) {
    MatMulPart p = parts[i];
#if KVTIER_WITH_CUDA
    if (CudaEligible(static_cast<int64_t>(p.rows) * p.out * p.in)) {
      MatMul(pool, p.x, p.rows, p.in, p.w, p.packed, p.out, p.y);
      continue;
    }
#endif
    if (k == MatMulKernel::kScalar) {
      p.packed = nullptr;
    } else if (p.packed == nullptr) {
      if (auto f = FindPackedWeight(p.w, p.in, p.out)) {
        p.packed = f.get();
        found.push_back(std::move(f));
      } else {
        own.push_back(std::make_unique<PackedMatrix>(p.w, p.in, p.out));
        p.packed = own.back().get();
      }
    }
    cpu.push_back(p);
  }
  MatMulManyWith(k, pool, cpu.data(), static_cast<int>(cpu.size()));
}

void RmsNorm(const float* x, const float* weight, int n, double eps, float* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) y[i] = x[i] * r * (weight ? weight[i] : 1.0f);
}

namespace {

// ss[u] = sum over i of double(x_u[i])^2 for the R rows x_u = x + u * n, each a serial sum in
// element order (what a one-row loop adds), the R chains side by side.
template <int R>
void SumSquaresSideBySide(const float* x, int n, double* ss) {
  double acc[R] = {};
  for (int i = 0; i < n; ++i) {
#pragma GCC unroll 8
    for (int u = 0; u < R; ++u) {
      const double v = x[static_cast<int64_t>(u) * n + i];
      acc[u] += v * v;
    }
  }
  for (int u = 0; u < R; ++u) ss[u] = acc[u];
}

// The sums of squares of `rows` rows, up to eight side by side.
void SumSquaresRows(const float* x, int rows, int n, double* ss) {
  for (int t = 0; t < rows; t += 8) {
    const float* xt = x + static_cast<int64_t>(t) * n;
    switch (std::min(8, rows - t)) {
      case 8:
        SumSquaresSideBySide<8>(xt, n, ss + t);
        break;
      case 7:
        SumSquaresSideBySide<7>(xt, n, ss + t);
        break;
      case 6:
        SumSquaresSideBySide<6>(xt, n, ss + t);
        break;
      case 5:
        SumSquaresSideBySide<5>(xt, n, ss + t);
        break;
      case 4:
        SumSquaresSideBySide<4>(xt, n, ss + t);
        break;
      case 3:
        SumSquaresSideBySide<3>(xt, n, ss + t);
        break;
      case 2:
        SumSquaresSideBySide<2>(xt, n, ss + t);
        break;
      default:
        SumSquaresSideBySide<1>(xt, n, ss + t);
        break;
    }
  }
}

}  // namespace

void RmsNormRows(const float* x, int rows, const float* weight, int n, double eps, float* y) {
  for (int t0 = 0; t0 < rows; t0 += 8) {
    const int rb = std::min(8, rows - t0);
    double ss[8];
    SumSquaresRows(x + static_cast<int64_t>(t0) * n, rb, n, ss);
    for (int u = 0; u < rb; ++u) {
      const float r = static_cast<float>(1.0 / std::sqrt(ss[u] / n + eps));
      const float* xu = x + static_cast<int64_t>(t0 + u) * n;
      float* yu = y + static_cast<int64_t>(t0 + u) * n;
      for (int i = 0; i < n; ++i) yu[i] = xu[i] * r * (weight ? weight[i] : 1.0f);
    }
  }
}

void LayerNorm(const float* x, const float* weight, const float* bias, int n, double eps,
               float* y) {
  double mean = 0;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= n;
  double var = 0;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= n;
  const double r = 1.0 / std::sqrt(var + eps);
  for (int i = 0; i < n; ++i) {
    y[i] = static_cast<float>((x[i] - mean) * r) * weight[i] + bias[i];
  }
}

std::vector<double> RopeFrequencies(int rope_dim, const RopeParams& p) {
  const int half = rope_dim / 2;
  std::vector<double> f(half);
  for (int i = 0; i < half; ++i) f[i] = 1.0 / std::pow(p.theta, (2.0 * i) / rope_dim);
  if (p.yarn && p.original_max_position > 0) {
    auto corr_dim = [&](double rot) {
      return rope_dim * std::log(p.original_max_position / (rot * 2 * std::numbers::pi)) /
             (2 * std::log(p.theta));
    };
    double low = std::max(std::floor(corr_dim(p.beta_fast)), 0.0);
    double high = std::min(std::ceil(corr_dim(p.beta_slow)), static_cast<double>(rope_dim - 1));
    if (low == high) high += 0.001;
    for (int i = 0; i < half; ++i) {
      double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      double smooth = 1 - ramp;
      f[i] = f[i] / p.factor * (1 - smooth) + f[i] * smooth;
    }
  }
  return f;
}

namespace {

// Pair i's rotation at pos: cos and sin of pos * freq in double, each rounded to float once.
inline void PairRotation(double freq, int64_t pos, float* c, float* s) {
  const double angle = static_cast<double>(pos) * freq;
  *c = static_cast<float>(std::cos(angle));
  *s = static_cast<float>(std::sin(angle));
}

}  // namespace

void ApplyRope(float* x, const std::vector<double>& freqs, int64_t pos, bool inverse) {
  for (size_t i = 0; i < freqs.size(); ++i) {
    float c, s;
    PairRotation(freqs[i], pos, &c, &s);
    ApplyRopeRotation(x + 2 * i, &c, &s, 1, inverse);
  }
}

void RopeRotation(const std::vector<double>& freqs, int64_t pos, float* c, float* s) {
  for (size_t i = 0; i < freqs.size(); ++i) PairRotation(freqs[i], pos, c + i, s + i);
}

void ApplyRopeRotation(float* x, const float* c, const float* s, int pairs, bool inverse) {
  for (int i = 0; i < pairs; ++i) {
    // The inverse rotates by -angle: float(-sin) == -float(sin), rounding to nearest being
    // symmetric.
    const float si = inverse ? -s[i] : s[i];
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c[i] - b * si;
    x[2 * i + 1] = a * si + b * c[i];
  }
}

void TopKByScore(const float* score, const int32_t* candidates, int64_t n, int k,
                 std::vector<int32_t>* out) {
  out->clear();
  if (n <= k) {
    out->assign(candidates, candidates + n);
    std::sort(out->begin(), out->end());
    return;
  }
  if (k <= 0) return;
  // A min-heap of the best k keys so far: its top is the worst of them.
  uint64_t stack_heap[64];
  std::vector<uint64_t> big;
  uint64_t* heap = stack_heap;
  if (k > 64) {
    big.resize(static_cast<size_t>(k));
    heap = big.data();
  }
  const auto greater = std::greater<uint64_t>();
  for (int i = 0; i < k; ++i) heap[i] = TopKKey(score[candidates[i]], candidates[i]);
  std::make_heap(heap, heap + k, greater);
  for (int64_t i = k; i < n; ++i) {
    const uint64_t key = TopKKey(score[candidates[i]], candidates[i]);
    if (key <= heap[0]) continue;
    std::pop_heap(heap, heap + k, greater);
    heap[k - 1] = key;
    std::push_heap(heap, heap + k, greater);
  }
  out->resize(static_cast<size_t>(k));
  for (int i = 0; i < k; ++i)
    (*out)[i] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(heap[i]));
  std::sort(out->begin(), out->end());
}

void TopKByScoreReference(const float* score, const int32_t* candidates, int64_t n, int k,
                          std::vector<int32_t>* out) {
  out->assign(candidates, candidates + n);
  auto better = [&](int32_t a, int32_t b) {
    if (score[a] != score[b]) return score[a] > score[b];
    return a < b;
  };
  if (n > k) {
    // `better` is a strict total order (ties broken by index), so the k best are one set
    // whichever selection algorithm finds them.
    std::nth_element(out->begin(), out->begin() + k, out->end(), better);
    out->resize(static_cast<size_t>(k));
  }
  std::sort(out->begin(), out->end());
}

namespace internal {
// engine/hc_mix_avx2.cc (only called when the CPU has AVX2).
void HcMixDotsAvx2(const float* fn, int m, const float* x, int rows, int n, float* out);
// engine/weighted_sum_avx2.cc (only called when the CPU has AVX2).
void WeightedRowSumsAvx2(const float* w, int m, const float* x, int rows, int n, float* y);
}  // namespace internal

bool HcMixDotsAvx2Available() {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return avx2;
}

void HcMixDots(const float* fn, int m, const float* x, int rows, int n, float* out, bool avx2) {
  if (avx2 && HcMixDotsAvx2Available()) {
    internal::HcMixDotsAvx2(fn, m, x, rows, n, out);
    return;
  }
  // Four rows of fn at a time (Dot4, Dot's sums) over every row of x.
  int i4 = 0;
  for (; i4 + 4 <= m; i4 += 4) {
    const float* f4[4];
    for (int q = 0; q < 4; ++q) f4[q] = fn + static_cast<int64_t>(i4 + q) * n;
    for (int t = 0; t < rows; ++t) {
      float d[4];
      Dot4(f4, x + static_cast<int64_t>(t) * n, n, d);
      for (int q = 0; q < 4; ++q) out[static_cast<int64_t>(t) * m + i4 + q] = d[q];
    }
  }
  for (int i = i4; i < m; ++i) {
    for (int t = 0; t < rows; ++t) {
      out[static_cast<int64_t>(t) * m + i] =
          Dot(fn + static_cast<int64_t>(i) * n, x + static_cast<int64_t>(t) * n, n);
    }
  }
}

void WeightedRowSums(const float* w, int m, const float* x, int rows, int n, float* y, bool avx2) {
  if (avx2 && HcMixDotsAvx2Available()) {
    internal::WeightedRowSumsAvx2(w, m, x, rows, n, y);
    return;
  }
  // The scalar reference: a zeroed row, then one Axpy per row of x, in order.
  for (int r = 0; r < m; ++r) {
    float* yr = y + static_cast<int64_t>(r) * n;
    for (int d = 0; d < n; ++d) yr[d] = 0.0f;
    for (int i = 0; i < rows; ++i)
      Axpy(w[static_cast<int64_t>(r) * rows + i], x + static_cast<int64_t>(i) * n, n, yr);
  }
}

namespace {

// Rows per block of HcMixesRows: the block's mixes stay on the stack (hc <= kHcMultMax).
constexpr int kMixRowsPerBlock = 16;
constexpr int kMaxMixes = (2 + kHcMultMax) * kHcMultMax;

// rsqrt(mean(x_t^2) + norm_eps) of `rows` rows of n floats, up to eight rows' serial double
// sums side by side (each sum in element order, as a one-row loop adds).
void MixScales(const float* x, int rows, int n, double norm_eps, float* r) {
  for (int t0 = 0; t0 < rows; t0 += 8) {
    const int rb = std::min(8, rows - t0);
    double ss[8];
    SumSquaresRows(x + static_cast<int64_t>(t0) * n, rb, n, ss);
    for (int u = 0; u < rb; ++u)
      r[t0 + u] = static_cast<float>(1.0 / std::sqrt(ss[u] / n + norm_eps));
  }
}

// pre, post and comb of one row from its scaled mixes (HcMixes after the products).
void MixOutputs(const float* mixes, int hc, const float* scale, const float* base, int iters,
                double hc_eps, float* pre, float* post, float* comb) {
  const float e = static_cast<float>(hc_eps);
  for (int i = 0; i < hc; ++i) pre[i] = Sigmoid(mixes[i] * scale[0] + base[i]) + e;
  for (int i = 0; i < hc; ++i) post[i] = 2.0f * Sigmoid(mixes[hc + i] * scale[1] + base[hc + i]);
  for (int i = 0; i < hc; ++i) {
    float* row = comb + i * hc;
    float mx = -INFINITY;
    for (int j = 0; j < hc; ++j) {
      row[j] = mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      mx = std::max(mx, row[j]);
    }
    float sum = 0;
    for (int j = 0; j < hc; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    for (int j = 0; j < hc; ++j) row[j] = row[j] / sum + e;
  }
  // Sinkhorn normalisations, four columns per vector step: element (i, j) is divided by
  // (s + e) with s the same in-order sum as the scalar loops', so the bits are theirs.
  typedef float V4 __attribute__((vector_size(16)));
  const int hc4 = hc / 4 * 4;
  auto col_norm = [&] {
    for (int j = 0; j < hc4; j += 4) {
      V4 s = {0, 0, 0, 0};
      for (int i = 0; i < hc; ++i) {
        V4 c;
        std::memcpy(&c, comb + i * hc + j, sizeof c);
        s += c;
      }
      const V4 den = s + e;
      for (int i = 0; i < hc; ++i) {
        V4 c;
        std::memcpy(&c, comb + i * hc + j, sizeof c);
        c /= den;
        std::memcpy(comb + i * hc + j, &c, sizeof c);
      }
    }
    for (int j = hc4; j < hc; ++j) {
      float s = 0;
      for (int i = 0; i < hc; ++i) s += comb[i * hc + j];
      for (int i = 0; i < hc; ++i) comb[i * hc + j] /= (s + e);
    }
  };
  auto row_norm = [&] {
    for (int i = 0; i < hc; ++i) {
      float s = 0;
      for (int j = 0; j < hc; ++j) s += comb[i * hc + j];
      const float den = s + e;
      const V4 dv = {den, den, den, den};
      int j = 0;
      for (; j < hc4; j += 4) {
        V4 c;
        std::memcpy(&c, comb + i * hc + j, sizeof c);
        c /= dv;
        std::memcpy(comb + i * hc + j, &c, sizeof c);
      }
      for (; j < hc; ++j) comb[i * hc + j] /= den;
    }
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
}

// MixOutputs of `rows` (2..4) rows at once: mixes + t * m are row t's scaled mixes. pre, post
// and each comb row's softmax are computed row by row as MixOutputs computes them; the Sinkhorn
// normalisations, a serial chain of divisions per row, run on four rows side by side, lane t of
// each vector being element (i, j) of row t's comb: every lane adds and divides what the
// one-row loops add and divide, in the same order, so the bits are theirs, and the four rows'
// chains overlap instead of waiting on one another.
void MixOutputsLanes(const float* mixes, int m, int rows, int hc, const float* scale,
                     const float* base, int iters, double hc_eps, float* pre, float* post,
                     float* comb) {
  typedef float V4 __attribute__((vector_size(16)));
  constexpr int kLanes = 4;
  const float e = static_cast<float>(hc_eps);
  V4 c[kHcMultMax * kHcMultMax];  // lanes past `rows` repeat row 0 (finite, never written out)
  for (int l = 0; l < kLanes; ++l) {
    const int t = l < rows ? l : 0;
    const float* mx_t = mixes + static_cast<int64_t>(t) * m;
    if (l == t) {
      for (int i = 0; i < hc; ++i) pre[t * hc + i] = Sigmoid(mx_t[i] * scale[0] + base[i]) + e;
      for (int i = 0; i < hc; ++i)
        post[t * hc + i] = 2.0f * Sigmoid(mx_t[hc + i] * scale[1] + base[hc + i]);
    }
    for (int i = 0; i < hc; ++i) {
      float row[kHcMultMax];
      float mx = -INFINITY;
      for (int j = 0; j < hc; ++j) {
        row[j] = mx_t[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
        mx = std::max(mx, row[j]);
      }
      float sum = 0;
      for (int j = 0; j < hc; ++j) {
        row[j] = std::exp(row[j] - mx);
        sum += row[j];
      }
      for (int j = 0; j < hc; ++j) c[i * hc + j][l] = row[j] / sum + e;
    }
  }
  const V4 ev = {e, e, e, e};
  auto col_norm = [&] {
    for (int j = 0; j < hc; ++j) {
      V4 s = {0, 0, 0, 0};
      for (int i = 0; i < hc; ++i) s += c[i * hc + j];
      const V4 den = s + ev;
      for (int i = 0; i < hc; ++i) c[i * hc + j] /= den;
    }
  };
  auto row_norm = [&] {
    for (int i = 0; i < hc; ++i) {
      V4 s = {0, 0, 0, 0};
      for (int j = 0; j < hc; ++j) s += c[i * hc + j];
      const V4 den = s + ev;
      for (int j = 0; j < hc; ++j) c[i * hc + j] /= den;
    }
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
  for (int t = 0; t < rows; ++t) {
    for (int k = 0; k < hc * hc; ++k) comb[static_cast<int64_t>(t) * hc * hc + k] = c[k][t];
  }
}

}  // namespace

void HcMixesRows(int rows, const float* x, int hc, int dim, const float* fn, const float* scale,
                 const float* base, int iters, double hc_eps, double norm_eps, float* pre,
                 float* post, float* comb) {
  const int n = hc * dim, m = (2 + hc) * hc;
  float r[kMixRowsPerBlock];
  float mixes[kMixRowsPerBlock * kMaxMixes];
  for (int t0 = 0; t0 < rows; t0 += kMixRowsPerBlock) {
    const int rb = std::min(kMixRowsPerBlock, rows - t0);
    const float* xb = x + static_cast<int64_t>(t0) * n;
    MixScales(xb, rb, n, norm_eps, r);
    HcMixDots(fn, m, xb, rb, n, mixes, /*avx2=*/true);
    for (int t = 0; t < rb; ++t) {
      float* mt = mixes + static_cast<int64_t>(t) * m;
      for (int i = 0; i < m; ++i) mt[i] *= r[t];
    }
    // Four rows at a time side by side; a single row (decode) alone.
    for (int t = 0; t < rb;) {
      const int64_t row = t0 + t;
      const int lanes = std::min(4, rb - t);
      if (lanes >= 2) {
        MixOutputsLanes(mixes + static_cast<int64_t>(t) * m, m, lanes, hc, scale, base, iters,
                        hc_eps, pre + row * hc, post + row * hc, comb + row * hc * hc);
      } else {
        MixOutputs(mixes + static_cast<int64_t>(t) * m, hc, scale, base, iters, hc_eps,
                   pre + row * hc, post + row * hc, comb + row * hc * hc);
      }
      t += lanes;
    }
  }
}

void HcMixes(const float* x, int hc, int dim, const float* fn, const float* scale,
             const float* base, int iters, double hc_eps, double norm_eps, float* pre, float* post,
             float* comb) {
  HcMixesRows(1, x, hc, dim, fn, scale, base, iters, hc_eps, norm_eps, pre, post, comb);
}

}  // namespace kvtier::engine
