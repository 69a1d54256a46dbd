// The device layers' kernels (engine/device/kernels.h, attention_kernels.h) one by one against the
// CPU functions they copy, bit for bit, over shapes the model tests do not reach: rows of any
// length (Dot's tail), any number of streams, one to many rows, inputs of wide dynamic range with
// zeros of both signs. Each kernel runs as the host twin runs it: a loop over its outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/device/attention_kernels.h"
#include "engine/device/kernels.h"
#include "engine/ops.h"
#include "kernels/quant.h"

namespace kvtier::engine {
namespace {

template <typename K>
void RunAll(const K& k) {
  for (int64_t i = 0; i < k.threads; ++i) k(i);
}

std::vector<float> Random(size_t n, std::mt19937* rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::uniform_int_distribution<int> e(-6, 6);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = std::ldexp(u(*rng), e(*rng));
    if (i % 37 == 5) v[i] = 0.0f;
    if (i % 41 == 7) v[i] = -0.0f;
  }
  return v;
}

// The `count` row-major [out x in] matrices of w, each output-minor ([in x out]), side by side.
std::vector<float> OutputMinor(const std::vector<float>& w, int count, int out, int in) {
  std::vector<float> t(w.size());
  for (int i = 0; i < count; ++i) {
    const size_t base = static_cast<size_t>(i) * out * in;
    for (int o = 0; o < out; ++o) {
      for (int k = 0; k < in; ++k)
        t[base + static_cast<size_t>(k) * out + o] = w[base + o * in + k];
    }
  }
  return t;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// MixDots + MixOutputs (after RowRsqrt over the streams) against HcMixesRows.
TEST(DeviceKernels, MixesAreHcMixesRows) {
  std::mt19937 rng(7);
  for (int hc : {1, 2, 3, 4, 5}) {
    for (int dim : {3, 8, 13, 64}) {
      for (int rows : {1, 3, 5, 17}) {
        const int n = hc * dim, m = (2 + hc) * hc, iters = 1 + rows % 5;
        const std::vector<float> x = Random(static_cast<size_t>(rows) * n, &rng);
        const std::vector<float> fn = Random(static_cast<size_t>(m) * n, &rng);
        const std::vector<float> scale = Random(3, &rng, 0.5f, 2.0f);
        const std::vector<float> base = Random(m, &rng);
        const double hc_eps = 1e-6, norm_eps = 1e-20;
        std::vector<float> pre(rows * hc), post(rows * hc), comb(rows * hc * hc);
        HcMixesRows(rows, x.data(), hc, dim, fn.data(), scale.data(), base.data(), iters, hc_eps,
                    norm_eps, pre.data(), post.data(), comb.data());
        std::vector<float> r(rows), mixes(static_cast<size_t>(rows) * m);
        std::vector<float> dpre(pre.size()), dpost(post.size()), dcomb(comb.size());
        RunAll(device::RowRsqrtKernel{x.data(), n, norm_eps, r.data(), rows});
        const std::vector<float> fn_t = OutputMinor(fn, 1, m, n);
        RunAll(device::MixDotsKernel{fn_t.data(), m, x.data(), n, r.data(), mixes.data(),
                                     static_cast<int64_t>(rows) * m});
        RunAll(device::MixOutputsKernel{mixes.data(), hc, scale.data(), base.data(), iters,
                                        static_cast<float>(hc_eps), dpre.data(), dpost.data(),
                                        dcomb.data(), rows});
        const std::string at = "hc " + std::to_string(hc) + " dim " + std::to_string(dim) +
                               " rows " + std::to_string(rows);
        EXPECT_TRUE(SameBits(pre, dpre)) << at;
        EXPECT_TRUE(SameBits(post, dpost)) << at;
        EXPECT_TRUE(SameBits(comb, dcomb)) << at;
      }
    }
  }
}

// PreMix + RowRsqrt + ScaleRows against WeightedRowSums and RmsNormRows (Engine::PreMix), with
// a weight and without.
TEST(DeviceKernels, PreMixAndNormAreWeightedRowSumsAndRmsNormRows) {
  std::mt19937 rng(11);
  for (int hc : {1, 3, 4}) {
    for (int dim : {5, 32, 70}) {
      for (int rows : {1, 2, 9}) {
        for (bool weighted : {false, true}) {
          const std::vector<float> x = Random(static_cast<size_t>(rows) * hc * dim, &rng);
          const std::vector<float> pre = Random(static_cast<size_t>(rows) * hc, &rng);
          const std::vector<float> w = Random(dim, &rng);
          const float* wp = weighted ? w.data() : nullptr;
          const double eps = 1e-6;
          std::vector<float> want(static_cast<size_t>(rows) * dim);
          for (int t = 0; t < rows; ++t) {
            WeightedRowSums(pre.data() + t * hc, 1, x.data() + static_cast<size_t>(t) * hc * dim,
                            hc, dim, want.data() + static_cast<size_t>(t) * dim, true);
          }
          RmsNormRows(want.data(), rows, wp, dim, eps, want.data());
          std::vector<float> got(want.size()), r(rows);
          const int64_t outs = static_cast<int64_t>(rows) * dim;
          RunAll(device::PreMixKernel{x.data(), pre.data(), hc, dim, got.data(), outs});
          RunAll(device::RowRsqrtKernel{got.data(), dim, eps, r.data(), rows});
          RunAll(device::ScaleRowsKernel{got.data(), r.data(), wp, dim, outs});
          EXPECT_TRUE(SameBits(want, got))
              << "hc " << hc << " dim " << dim << " rows " << rows << " weighted " << weighted;
        }
      }
    }
  }
}

// MatMulKernel against MatMulCpu (every CPU kernel gives the same bits; engine/matmul.h).
TEST(DeviceKernels, MatMulIsMatMulCpu) {
  std::mt19937 rng(13);
  for (int in : {1, 7, 32, 65}) {
    for (int out : {1, 5, 16, 33}) {
      for (int rows : {1, 6, 11}) {
        const std::vector<float> x = Random(static_cast<size_t>(rows) * in, &rng);
        const std::vector<float> w = Random(static_cast<size_t>(out) * in, &rng);
        std::vector<float> want(static_cast<size_t>(rows) * out), got(want.size());
        MatMulCpu(nullptr, x.data(), rows, in, w.data(), out, want.data());
        RunAll(device::MatMulKernel{x.data(), in, w.data(), out, got.data(),
                                    static_cast<int64_t>(rows) * out});
        EXPECT_TRUE(SameBits(want, got)) << in << " x " << out << ", " << rows << " rows";
      }
    }
  }
}

// SwigluUp / PerRowMatMul with an expert per row: each row's products are MatMulCpu's with that
// expert's matrices, and the activation clamps as SwigluActivate does (the limit reached both
// ways), times the row's weight.
TEST(DeviceKernels, SwigluPicksEachRowsExpert) {
  std::mt19937 rng(17);
  const int dim = 24, inter = 10, experts = 3, rows = 7, per_input = 2;
  const float limit = 0.75f;
  const std::vector<float> x =
      Random(static_cast<size_t>(rows / per_input + 1) * dim, &rng, -8.0f, 8.0f);
  const std::vector<float> w1 = Random(static_cast<size_t>(experts) * inter * dim, &rng);
  const std::vector<float> w3 = Random(w1.size(), &rng);
  const std::vector<float> w2 = Random(static_cast<size_t>(experts) * dim * inter, &rng);
  const std::vector<int32_t> expert = {2, 0, 1, 1, 0, 2, 2};
  const std::vector<float> rw = Random(rows, &rng);
  std::vector<float> g(static_cast<size_t>(rows) * inter), y(static_cast<size_t>(rows) * dim);
  const std::vector<float> w1_t = OutputMinor(w1, experts, inter, dim),
                           w3_t = OutputMinor(w3, experts, inter, dim),
                           w2_t = OutputMinor(w2, experts, dim, inter);
  RunAll(device::SwigluUpKernel{x.data(), dim, inter, per_input, expert.data(), rw.data(),
                                w1_t.data(), w3_t.data(), limit, g.data(),
                                static_cast<int64_t>(rows) * inter});
  RunAll(device::PerRowMatMulKernel{g.data(), inter, dim, expert.data(), w2_t.data(), y.data(),
                                    static_cast<int64_t>(rows) * dim});
  int clamped_high = 0, clamped_low = 0;
  for (int r = 0; r < rows; ++r) {
    const int64_t e = expert[r];
    const float* xr = x.data() + static_cast<size_t>(r / per_input) * dim;
    std::vector<float> gv(inter), uv(inter), want_y(dim);
    MatMulCpu(nullptr, xr, 1, dim, w1.data() + e * inter * dim, inter, gv.data());
    MatMulCpu(nullptr, xr, 1, dim, w3.data() + e * inter * dim, inter, uv.data());
    std::vector<float> want_g(inter);
    for (int u = 0; u < inter; ++u) {
      clamped_high += uv[u] > limit;
      clamped_low += uv[u] < -limit;
      want_g[u] = Silu(std::min(gv[u], limit)) * std::clamp(uv[u], -limit, limit) * rw[r];
    }
    MatMulCpu(nullptr, want_g.data(), 1, inter, w2.data() + e * dim * inter, dim, want_y.data());
    EXPECT_TRUE(std::memcmp(want_g.data(), g.data() + static_cast<size_t>(r) * inter,
                            inter * sizeof(float)) == 0)
        << "row " << r;
    EXPECT_TRUE(std::memcmp(want_y.data(), y.data() + static_cast<size_t>(r) * dim,
                            dim * sizeof(float)) == 0)
        << "row " << r;
  }
  EXPECT_GT(clamped_high, 0);
  EXPECT_GT(clamped_low, 0);
}

// RouteKernel's choice against TopKByScore's for every k, with scores that
// tie (the lower index wins) at the boundary of the chosen set for several k, scores a bit
// apart, and a score that underflows to zero.
TEST(DeviceKernels, RouteKeepsTopKByScoresOrder) {
  const int E = 9;
  const std::vector<float> logits = {1.0f,   1.0f,  -3.0f,  2.0f, 2.0f, std::nextafter(2.0f, 3.0f),
                                     -30.0f, 25.0f, -200.0f};
  const std::vector<float> bias(E, 0.0f);
  std::vector<float> s(E), biased(E);
  for (int e = 0; e < E; ++e) {
    s[e] = std::sqrt(Softplus(logits[e]));
    biased[e] = s[e] + bias[e];
  }
  ASSERT_EQ(biased[8], 0.0f);  // softplus underflows
  std::vector<int32_t> all(E), top;
  for (int e = 0; e < E; ++e) all[e] = e;
  for (int K = 1; K <= E; ++K) {
    std::vector<int32_t> chosen(K);
    std::vector<float> weight(K);
    const device::RouteKernel k{logits.data(), bias.data(),   E, K, true, 1.5f,
                                chosen.data(), weight.data(), 1};
    k(0);
    TopKByScore(biased.data(), all.data(), E, K, &top);
    EXPECT_EQ(chosen, top) << "k = " << K;
    float sum = 0;
    for (int j = 0; j < K; ++j) sum += s[top[j]];
    for (int j = 0; j < K; ++j) EXPECT_EQ(weight[j], s[top[j]] / sum * 1.5f) << K << " " << j;
  }
}

// The attention kernels (keys decoded from their stored bytes wherever each lies, q rotated, dots,
// softmax with the sinks, weighted sums rotated back) against AttnCore's CPU arithmetic:
// Dequantize, RopeRotation and ApplyRopeRotation, HcMixDots, the softmax loop, WeightedRowSums.
// Rows of 1 to many keys, keys shared between rows and in any order, head widths with and without
// Dot's tail.
TEST(DeviceKernels, AttentionIsAttnCoresArithmetic) {
  std::mt19937 rng(11);
  for (int dim : {32, 64, 96}) {
    for (int heads : {1, 3}) {
      for (int rows : {1, 4}) {
        const int pairs = dim / 8, main = 5, swa = 3, table = main + swa;
        // The table: main FP4 entries, then swa FP8 ones, as stored bytes and as floats.
        // Magnitudes as the model's normed rows have them, so that the softmax spreads its weight
        // over several keys (and the sums' order shows in their bits).
        auto moderate = [&](size_t count) {
          std::uniform_real_distribution<float> u(-1.5f, 1.5f);
          std::vector<float> v(count);
          for (float& x : v) x = u(rng);
          return v;
        };
        const std::vector<float> raw = moderate(static_cast<size_t>(table) * dim);
        std::vector<uint8_t> md(main * dim / 2), ms(main * dim / 16), sd(swa * dim),
            ss(swa * dim / 32);
        using kernels::QuantFormat;
        ASSERT_TRUE(
            kernels::Quantize(QuantFormat::kFp4E4M3x16, raw.data(), main, dim, md.data(), ms.data())
                .ok());
        ASSERT_TRUE(kernels::Quantize(QuantFormat::kFp8Ue8m0x32, raw.data() + main * dim, swa, dim,
                                      sd.data(), ss.data())
                        .ok());
        std::vector<float> want_keys(static_cast<size_t>(table) * dim);
        ASSERT_TRUE(kernels::Dequantize(QuantFormat::kFp4E4M3x16, md.data(), ms.data(), main, dim,
                                        want_keys.data())
                        .ok());
        // The SWA entries read by source and index too: two sources (the first entry, and the
        // rest), in rotated order (as a ring's window wraps).
        std::vector<float> swa_f(static_cast<size_t>(swa) * dim);
        ASSERT_TRUE(kernels::Dequantize(QuantFormat::kFp8Ue8m0x32, sd.data(), ss.data(), swa, dim,
                                        swa_f.data())
                        .ok());
        std::vector<int32_t> swa_source(swa), swa_entry(swa);
        for (int i = 0; i < swa; ++i) {
          const int stored = (i + 1) % swa;
          swa_source[i] = stored < 1 ? 0 : 1;
          swa_entry[i] = stored < 1 ? stored : stored - 1;
          std::copy_n(swa_f.begin() + stored * dim, dim, want_keys.begin() + (main + i) * dim);
        }
        const uint8_t* swa_data[2] = {sd.data(), sd.data() + dim};
        const uint8_t* swa_scales[2] = {ss.data(), ss.data() + dim / 32};
        // The global entries read by source and index: two sources (the codes' first two
        // entries, and the rest), the entries in reverse order of storage.
        const uint8_t* data[2] = {md.data(), md.data() + 2 * dim / 2};
        const uint8_t* scales[2] = {ms.data(), ms.data() + 2 * dim / 16};
        std::vector<int32_t> source(main), entry(main);
        for (int i = 0; i < main; ++i) {
          const int stored = main - 1 - i;
          source[i] = stored < 2 ? 0 : 1;
          entry[i] = stored < 2 ? stored : stored - 2;
        }
        std::vector<float> keys_f(want_keys.size());
        RunAll(device::DecodeFp4KeysKernel{data, scales, source.data(), entry.data(), dim / 16,
                                           keys_f.data(), main * dim / 16});
        for (int i = 0; i < main / 2; ++i) {  // want_keys in the same order
          std::swap_ranges(want_keys.begin() + i * dim, want_keys.begin() + (i + 1) * dim,
                           want_keys.begin() + (main - 1 - i) * dim);
        }
        RunAll(device::DecodeFp8KeysKernel{swa_data, swa_scales, swa_source.data(),
                                           swa_entry.data(), dim / 32, keys_f.data() + main * dim,
                                           swa * dim / 32});
        ASSERT_TRUE(SameBits(keys_f, want_keys)) << dim;
        // Row t's list: a few of the table's rows, some shared with other rows.
        std::vector<int32_t> keys, key_off = {0};
        for (int t = 0; t < rows; ++t) {
          const int nk = 1 + (t * 3 + dim) % table;
          for (int i = 0; i < nk; ++i) keys.push_back((t + 5 * i) % table);
          key_off.push_back(static_cast<int32_t>(keys.size()));
        }
        int stride = 0;
        for (int t = 0; t < rows; ++t) stride = std::max(stride, key_off[t + 1] - key_off[t]);
        std::vector<double> freqs(pairs);
        for (int j = 0; j < pairs; ++j) freqs[j] = std::pow(10000.0, -2.0 * j / (2 * pairs));
        std::vector<float> c(static_cast<size_t>(rows) * pairs), s(c.size());
        for (int t = 0; t < rows; ++t)
          RopeRotation(freqs, 17 + 9 * t, &c[t * pairs], &s[t * pairs]);
        const std::vector<float> q0 = moderate(static_cast<size_t>(rows) * heads * dim);
        const std::vector<float> sink = Random(heads, &rng);
        const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
        // The kernels.
        std::vector<float> q = q0, w(static_cast<size_t>(rows) * heads * stride),
                           o(static_cast<size_t>(rows) * heads * dim);
        RunAll(device::RopeRowsKernel{q.data(), heads, dim, pairs, c.data(), s.data(),
                                      static_cast<int64_t>(rows) * heads * pairs});
        RunAll(device::AttnDotsKernel{q.data(), heads, dim, keys_f.data(), keys.data(),
                                      key_off.data(), scale, stride, w.data(),
                                      static_cast<int64_t>(rows) * heads * stride});
        RunAll(device::AttnSoftmaxKernel{sink.data(), heads, key_off.data(), stride, w.data(),
                                         static_cast<int64_t>(rows) * heads});
        RunAll(device::AttnSumsKernel{w.data(), heads, dim, pairs, keys_f.data(), keys.data(),
                                      key_off.data(), stride, c.data(), s.data(), o.data(),
                                      static_cast<int64_t>(rows) * heads * dim});
        // AttnCore's arithmetic.
        std::vector<float> want(o.size());
        for (int t = 0; t < rows; ++t) {
          std::vector<float> qt(q0.begin() + static_cast<int64_t>(t) * heads * dim,
                                q0.begin() + static_cast<int64_t>(t + 1) * heads * dim);
          for (int h = 0; h < heads; ++h)
            ApplyRopeRotation(&qt[h * dim + dim - 2 * pairs], &c[t * pairs], &s[t * pairs], pairs,
                              false);
          const int nk = key_off[t + 1] - key_off[t];
          std::vector<float> gathered(static_cast<size_t>(nk) * dim);
          for (int i = 0; i < nk; ++i)
            std::memcpy(&gathered[i * dim], &want_keys[keys[key_off[t] + i] * dim], dim * 4);
          std::vector<float> dots(static_cast<size_t>(nk) * heads), lg(dots.size());
          HcMixDots(qt.data(), heads, gathered.data(), nk, dim, dots.data(), true);
          for (int h = 0; h < heads; ++h) {
            float* l = &lg[h * nk];
            float mx = sink[h];
            for (int i = 0; i < nk; ++i) {
              l[i] = dots[i * heads + h] * scale;
              mx = std::max(mx, l[i]);
            }
            float den = std::exp(sink[h] - mx);
            for (int i = 0; i < nk; ++i) {
              l[i] = std::exp(l[i] - mx);
              den += l[i];
            }
            for (int i = 0; i < nk; ++i) l[i] = l[i] / den;
          }
          float* ot = &want[static_cast<size_t>(t) * heads * dim];
          WeightedRowSums(lg.data(), heads, gathered.data(), nk, dim, ot, true);
          for (int h = 0; h < heads; ++h)
            ApplyRopeRotation(ot + h * dim + dim - 2 * pairs, &c[t * pairs], &s[t * pairs], pairs,
                              true);
        }
        EXPECT_TRUE(SameBits(o, want)) << "dim " << dim << " heads " << heads << " rows " << rows;
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::engine
