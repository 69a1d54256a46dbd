// The engine's MatMul against its peers, measured in one run (docs/performance/engine.md):
//   1. prefill: the engine's matmul on its own prefill shapes (mini-v4.1, 256-token chunk)
//      against OpenBLAS sgemm on the same shapes and thread count; ratio = sgemm time / engine
//      time (1.0: as fast as OpenBLAS);
//   2. decode: GEMV (one row) over weights far larger than the caches against a streaming read
//      of the same bytes; ratio = GEMV weight bytes/s / streaming read bytes/s;
//   3. routed experts: the products of mini-v4.1's 768 routed-expert matrices (16 layers x 16
//      experts x w1, w3, w2; 96 MiB in f32) with 1, 2 and 3 rows each (a decode's and a batched
//      pass's rows per expert), packed as f32 and as MXFP4 (expert_format "mxfp4", the same
//      values: the same bits out), each against a streaming read of its own packed bytes;
//      ratio = f32 time / MXFP4 time;
//   4. dense projections: mini-v4.1's FP8 projections (weight_format "fp8": attention, shared
//      expert, Engram; 24 MiB in f32) with 1 and 16 rows, packed as f32 and as FP8, the same way.
//
//   kvtier_bench_matmul [--threads N] [--min-ms M] [--gemv-mib S]
//
// The engine side is MatMulCpu on weights registered (packed) as the Engine does at bind time.
#include <cblas.h>
#include <emmintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/matmul.h"
#include "engine/ops.h"
#include "engine/thread_pool.h"
#include "kernels/quant.h"

extern "C" void openblas_set_num_threads(int num_threads);
extern "C" char* openblas_get_corename(void);

namespace kvtier::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Seconds per call of fn: repeats until min_ms has passed (after one warm-up call), best of 3.
double TimePerCall(const std::function<void()>& fn, double min_ms) {
  fn();
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    int64_t calls = 0;
    const auto t0 = Clock::now();
    double elapsed = 0;
    do {
      fn();
      ++calls;
      elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    } while (elapsed * 1e3 < min_ms / 3);
    best = std::min(best, elapsed / static_cast<double>(calls));
  }
  return best;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

struct Shape {
  const char* name;
  int rows, in, out;
  int per_layer;  // calls of this shape per layer and 256-token chunk (weighting the total)
};

// mini-v4.1 (deploy/models/mini-v4.1.json) over a 256-token prefill chunk: D = 256, 8 heads of
// 128, q_lora 64, o_lora 64 in 2 groups, 16 experts of 128 (2 per token: 32 rows each on
// average), vocabulary 512.
constexpr Shape kPrefillShapes[] = {
    {"wq_a 256->64", 256, 256, 64, 1},        {"wq_b 64->1024", 256, 64, 1024, 1},
    {"wkv 256->128", 256, 256, 128, 1},       {"wo_a 512->64", 256, 512, 64, 2},
    {"wo_b 128->256", 256, 128, 256, 1},      {"shared w1 256->128", 256, 256, 128, 2},
    {"shared w2 128->256", 256, 128, 256, 1}, {"expert w1 256->128", 32, 256, 128, 32},
    {"expert w2 128->256", 32, 128, 256, 16}, {"head 256->512", 256, 256, 512, 0},
};

void Prefill(int threads, double min_ms) {
  ThreadPool pool(threads);
  openblas_set_num_threads(threads);
  std::printf("prefill shapes, %d thread(s); engine kernel %s, OpenBLAS core %s\n", threads,
              MatMulKernelName(ActiveMatMulKernel()), openblas_get_corename());
  std::printf("%-22s %10s %10s %8s %10s\n", "shape (rows x in->out)", "engine GF", "sgemm GF",
              "ratio", "max |diff|");
  double engine_total = 0, blas_total = 0;
  for (const Shape& s : kPrefillShapes) {
    const auto x = Random(static_cast<size_t>(s.rows) * s.in, 1);
    const auto w = Random(static_cast<size_t>(s.out) * s.in, 2);
    std::vector<float> y1(static_cast<size_t>(s.rows) * s.out), y2(y1.size());
    auto packed = RegisterPackedWeight(w.data(), s.in, s.out);
    const double te = TimePerCall(
        [&] { MatMulCpu(&pool, x.data(), s.rows, s.in, w.data(), s.out, y1.data()); }, min_ms);
    const double tb = TimePerCall(
        [&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.rows, s.out, s.in, 1.0f, x.data(),
                      s.in, w.data(), s.in, 0.0f, y2.data(), s.out);
        },
        min_ms);
    float diff = 0;
    for (size_t i = 0; i < y1.size(); ++i) diff = std::max(diff, std::fabs(y1[i] - y2[i]));
    const double flop = 2.0 * s.rows * s.in * s.out;
    const int weight = std::max(1, s.per_layer);
    engine_total += te * weight;
    blas_total += tb * weight;
    std::printf("%-22s %10.1f %10.1f %8.2f %10.2g\n", s.name, flop / te * 1e-9, flop / tb * 1e-9,
                tb / te, diff);
  }
  std::printf(
      "prefill total (weighted by calls per layer): engine / sgemm time ratio %.2f "
      "(sgemm time / engine time)\n\n",
      blas_total / engine_total);
}

// Reads every buffer of `bufs` (bytes each) once; thread i of `threads` takes buffers i,
// i + threads, ... Returns a checksum (so the reads are not optimised away).
uint64_t StreamRead(const std::vector<const float*>& bufs, size_t bytes, int threads) {
  std::vector<uint64_t> sums(threads, 0);
  auto part = [&](int i) {
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t m = i; m < bufs.size(); m += threads) {
      const __m128i* p = reinterpret_cast<const __m128i*>(bufs[m]);
      const size_t n = bytes / 16;  // 16-byte vectors
      size_t k = 0;
      for (; k + 4 <= n; k += 4) {
        a0 = _mm_add_epi64(a0, _mm_load_si128(p + k));
        a1 = _mm_add_epi64(a1, _mm_load_si128(p + k + 1));
        a2 = _mm_add_epi64(a2, _mm_load_si128(p + k + 2));
        a3 = _mm_add_epi64(a3, _mm_load_si128(p + k + 3));
      }
      for (; k < n; ++k) a0 = _mm_add_epi64(a0, _mm_load_si128(p + k));
    }
    const __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    uint64_t v[2];
    std::memcpy(v, &s, 16);
    sums[i] = v[0] + v[1];
  };
  std::vector<std::thread> ts;
  for (int i = 1; i < threads; ++i) ts.emplace_back(part, i);
  part(0);
  for (auto& t : ts) t.join();
  uint64_t s = 0;
  for (uint64_t v : sums) s += v;
  return s;
}

void Decode(int threads, double min_ms, size_t total_mib) {
  // head-sized matrices (256 -> 512, 512 KiB each) cycled through, far beyond the caches.
  const int in = 256, out = 512;
  const size_t matrix_floats = static_cast<size_t>(in) * out;
  const size_t matrix_bytes = matrix_floats * sizeof(float);
  const size_t count = std::max<size_t>(1, (total_mib << 20) / matrix_bytes);
  ThreadPool pool(threads);
  std::vector<std::unique_ptr<PackedMatrix>> packed;
  std::vector<const float*> bufs;
  {
    const auto w = Random(matrix_floats, 3);
    for (size_t i = 0; i < count; ++i) {
      packed.push_back(std::make_unique<PackedMatrix>(w.data(), in, out));
      bufs.push_back(packed.back()->panel(0));
    }
  }
  const auto x = Random(in, 4);
  std::vector<float> y(out);
  size_t next = 0;
  const MatMulKernel k = ActiveMatMulKernel();
  // One decode GEMV per matrix, in a rotating order. The packed copies are what the AVX2
  // kernel streams; the scalar kernel reads the same bytes (as if row-major).
  auto gemv_all = [&] {
    for (size_t i = 0; i < count; ++i) {
      const PackedMatrix& p = *packed[(next + i) % count];
      MatMulWith(k, &pool, x.data(), 1, in, p.panel(0), &p, out, y.data());
    }
    next += 7;
  };
  const double bytes = static_cast<double>(count) * matrix_bytes;
  const double tg = TimePerCall(gemv_all, min_ms);
  uint64_t sink = 0;
  const double ts = TimePerCall([&] { sink += StreamRead(bufs, matrix_bytes, threads); }, min_ms);
  std::printf("decode GEMV, %d thread(s): %zu matrices %dx%d (%.0f MiB of weights)\n", threads,
              count, out, in, bytes / (1 << 20));
  std::printf("  GEMV             %8.2f GB/s of weights\n", bytes / tg * 1e-9);
  std::printf("  streaming read   %8.2f GB/s (the same buffers, %d thread(s))\n", bytes / ts * 1e-9,
              threads);
  std::printf("decode GEMV / memory bandwidth ratio %.2f (checksum %llu)\n\n", ts / tg,
              static_cast<unsigned long long>(sink & 0xff));
}

// Products of `shapes` ({in, out} per matrix, cycled through as a model's pass would) packed as
// f32 and as `format` (the same values: rounded first), with each of `row_counts` rows, each
// against a streaming read of its own packed bytes.
void CodedProducts(const char* title, const std::vector<std::pair<int, int>>& shapes,
                   PackedFormat format, const std::vector<int>& row_counts, int threads,
                   double min_ms) {
  ThreadPool pool(threads);
  struct Matrix {
    std::unique_ptr<PackedMatrix> f32, coded;
  };
  std::vector<Matrix> m;
  size_t f32_bytes = 0, coded_bytes = 0;
  const kernels::QuantFormat qf = format == PackedFormat::kFp8 ? kernels::QuantFormat::kFp8Ue8m0x32
                                                               : kernels::QuantFormat::kFp4Ue8m0x32;
  int max_in = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto [in, out] = shapes[i];
    max_in = std::max(max_in, in);
    auto w = Random(static_cast<size_t>(in) * out, 100 + static_cast<uint32_t>(i));
    if (!kernels::RoundTrip(qf, w.data(), out, in).ok()) {
      std::fprintf(stderr, "RoundTrip failed\n");
      std::exit(1);
    }
    Matrix mm{std::make_unique<PackedMatrix>(w.data(), in, out),
              std::make_unique<PackedMatrix>(w.data(), in, out, format)};
    if (mm.coded->format() != format) {
      std::fprintf(stderr, "a matrix did not pack in its format\n");
      std::exit(1);
    }
    f32_bytes += mm.f32->bytes();
    coded_bytes += mm.coded->bytes();
    m.push_back(std::move(mm));
  }
  const MatMulKernel k = ActiveMatMulKernel();
  const char* name = format == PackedFormat::kFp8 ? "FP8" : "MXFP4";
  std::printf("%s, %d thread(s), kernel %s: %zu matrices, f32 %.1f MiB, %s %.1f MiB\n", title,
              threads, MatMulKernelName(k), m.size(), f32_bytes / 1048576.0, name,
              coded_bytes / 1048576.0);
  std::printf("%-5s %12s %10s %11s %16s %16s\n", "rows", "f32 us", "coded us", "f32/coded",
              "f32 / its read", "coded / its read");
  uint64_t sink = 0;
  // Each matrix's packed bytes read whole (sizes differ): StreamRead per matrix, its one-buffer
  // lists made before the timing.
  std::vector<std::vector<const float*>> f32_one, coded_one;
  for (const Matrix& mm : m) {
    f32_one.push_back({mm.f32->panel(0)});
    coded_one.push_back({reinterpret_cast<const float*>(mm.coded->coded_panel(0))});
  }
  auto read_all = [&](bool coded) {
    for (size_t i = 0; i < m.size(); ++i) {
      const PackedMatrix& p = coded ? *m[i].coded : *m[i].f32;
      sink += StreamRead(coded ? coded_one[i] : f32_one[i], p.bytes() / 16 * 16, 1);
    }
  };
  const double t_read_f32 = TimePerCall([&] { read_all(false); }, min_ms);
  const double t_read_coded = TimePerCall([&] { read_all(true); }, min_ms);
  for (int rows : row_counts) {
    const auto x = Random(static_cast<size_t>(rows) * max_in, 7);
    size_t max_out = 0;
    for (const auto& [in, out] : shapes) max_out = std::max<size_t>(max_out, out);
    std::vector<float> y(static_cast<size_t>(rows) * max_out), yc(y.size());
    auto run = [&](bool coded, std::vector<float>* o) {
      for (const Matrix& mm : m) {
        const PackedMatrix& p = coded ? *mm.coded : *mm.f32;
        MatMulWith(k, &pool, x.data(), rows, p.in(), nullptr, &p, p.out(), o->data());
      }
    };
    const double tf = TimePerCall([&] { run(false, &y); }, min_ms);
    const double tc = TimePerCall([&] { run(true, &yc); }, min_ms);
    if (std::memcmp(y.data(), yc.data(), y.size() * sizeof(float)) != 0) {
      std::fprintf(stderr, "%s and f32 products differ\n", name);
      std::exit(1);
    }
    std::printf("%-5d %12.0f %10.0f %11.2f %16.2f %16.2f\n", rows, tf * 1e6, tc * 1e6, tf / tc,
                t_read_f32 / tf, t_read_coded / tc);
  }
  std::printf(
      "(\"/ its read\": a streaming read of that format's packed bytes / the products; "
      "checksum %llu)\n\n",
      static_cast<unsigned long long>(sink & 0xff));
}

// mini-v4.1's routed experts: 16 layers x 16 experts x w1, w3 (256 -> 128), w2 (128 -> 256).
void Experts(int threads, double min_ms) {
  std::vector<std::pair<int, int>> shapes;
  for (int i = 0; i < 16 * 16; ++i)
    shapes.insert(shapes.end(), {{256, 128}, {256, 128}, {128, 256}});
  CodedProducts("routed experts (expert_format mxfp4)", shapes, PackedFormat::kMxfp4, {1, 2, 3},
                threads, min_ms);
}

// mini-v4.1's FP8 projections per layer (weight_format fp8): wq_a 256 -> 64, wq_b 64 -> 1024,
// wkv 256 -> 128, wo_b 128 -> 256, the shared expert (256 -> 128 twice, 128 -> 256), and on
// two of the 16 layers the Engram projection 384 -> 1280.
void Projections(int threads, double min_ms) {
  std::vector<std::pair<int, int>> shapes;
  for (int l = 0; l < 16; ++l) {
    shapes.insert(
        shapes.end(),
        {{256, 64}, {64, 1024}, {256, 128}, {128, 256}, {256, 128}, {256, 128}, {128, 256}});
    if (l == 1 || l == 6) shapes.push_back({384, 1280});
  }
  CodedProducts("dense projections (weight_format fp8)", shapes, PackedFormat::kFp8, {1, 16},
                threads, min_ms);
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) {
  int threads = 1;
  double min_ms = 300;
  size_t gemv_mib = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--threads") {
      threads = std::atoi(argv[i + 1]);
    } else if (a == "--min-ms") {
      min_ms = std::atof(argv[i + 1]);
    } else if (a == "--gemv-mib") {
      gemv_mib = static_cast<size_t>(std::atoll(argv[i + 1]));
    } else {
      std::fprintf(stderr, "usage: %s [--threads N] [--min-ms M] [--gemv-mib S]\n", argv[0]);
      return 2;
    }
  }
  if (threads < 1 || threads > 64 || min_ms <= 0 || min_ms > 60000 || gemv_mib < 1 ||
      gemv_mib > 4096) {
    std::fprintf(stderr, "threads in [1,64], min-ms in (0,60000], gemv-mib in [1,4096]\n");
    return 2;
  }
  kvtier::engine::Prefill(threads, min_ms);
  kvtier::engine::Decode(threads, min_ms, gemv_mib);
  kvtier::engine::Experts(threads, min_ms);
  kvtier::engine::Projections(threads, min_ms);
  return 0;
}
