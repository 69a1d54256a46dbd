// The engine's CUDA MatMul kernels against their peers on the GPU, measured in one run
// (docs/performance/engine.md, "On an H200"):
//   1. the device's copy bandwidth: a device-to-device cudaMemcpy, bytes read plus written;
//   2. prefill shapes (mini-v4.1's, 256-token chunk, and 4096-wide ones of a real model's
//      size): each kernel (engine/cuda/matmul.cuh) against cuBLAS SGEMM on the same device
//      data, FP32 with cuBLAS's default math (no TF32); ratio = cuBLAS time / kernel time;
//   3. decode shapes (1 to 8 rows): each kernel's weight bytes per second against the copy
//      bandwidth of 1 (a GEMV reads its weights once); weights rotate over copies that
//      together exceed the L2 cache, except for mini-v4.1's, which the engine keeps resident.
// Every kernel's output is compared bit for bit with the contract's chain (engine/matmul.h)
// computed on the CPU, for sampled rows; a mismatch fails the run (exit 1).
//
//   kvtier_bench_cuda_matmul [--min-ms M] [--quick]
//
// cuBLAS is loaded at run time (libcublas.so.13 or libcublas.so, found through the usual
// library path), so the engine never links it and the GPU check's pack need not carry it;
// without it the cuBLAS columns read "-".
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/backend.h"
#include "engine/cuda/matmul.cuh"

namespace kvtier::engine::cuda {
namespace {

#define CHECK_CUDA(call)                                                 \
  do {                                                                   \
    const cudaError_t err_ = (call);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      std::exit(2);                                                      \
    }                                                                    \
  } while (0)

// The few cuBLAS entry points used, resolved with dlsym.
struct Cublas {
  using CreateFn = cublasStatus_t (*)(cublasHandle_t*);
  using SgemmFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                     int, const float*, const float*, int, const float*, int,
                                     const float*, float*, int);
  using SetMathModeFn = cublasStatus_t (*)(cublasHandle_t, cublasMath_t);
  cublasHandle_t handle = nullptr;
  SgemmFn sgemm = nullptr;

  bool Load() {
    void* lib = dlopen("libcublas.so.13", RTLD_NOW);
    if (lib == nullptr) lib = dlopen("libcublas.so", RTLD_NOW);
    if (lib == nullptr) return false;
    auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
    auto set_math = reinterpret_cast<SetMathModeFn>(dlsym(lib, "cublasSetMathMode"));
    sgemm = reinterpret_cast<SgemmFn>(dlsym(lib, "cublasSgemm_v2"));
    if (create == nullptr || set_math == nullptr || sgemm == nullptr) return false;
    if (create(&handle) != CUBLAS_STATUS_SUCCESS) return false;
    return set_math(handle, CUBLAS_DEFAULT_MATH) == CUBLAS_STATUS_SUCCESS;
  }

  // Y (rows x out, row-major) = X (rows x in) W^T (W: out x in, row-major): in cuBLAS's
  // column-major terms Y^T = W * X^T, i.e. op(A) = A^T with A = W stored in x out.
  bool Run(const float* x, int rows, int in, const float* w, int out, float* y) const {
    const float one = 1.0f, zero = 0.0f;
    return sgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &one, w, in, x, in, &zero, y,
                 out) == CUBLAS_STATUS_SUCCESS;
  }
};

// Inputs with a wide dynamic range and both signs, so a changed summation order shows.
std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-6, 6);
  std::vector<float> v(n);
  for (float& f : v) f = std::ldexp(mant(rng), exp(rng));
  return v;
}

// Median milliseconds per call of `launch(rep)` over enough calls to pass min_ms, timed with
// events around each call after two warm-up calls.
template <typename Fn>
double MedianMs(Fn launch, double min_ms) {
  launch(0);
  launch(1);
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms;
  float total = 0;
  for (int rep = 0; rep < 5 || (total < min_ms && rep < 2000); ++rep) {
    CHECK_CUDA(cudaEventRecord(a));
    launch(rep);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
    total += t;
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Shape {
  const char* name;
  int rows, in, out;
};

constexpr Shape kPrefillShapes[] = {
    {"mini wq_b 64->1024", 256, 64, 1024},  {"mini wkv 256->128", 256, 256, 128},
    {"mini wo_a 512->64", 256, 512, 64},    {"mini w2 128->256", 256, 128, 256},
    {"mini head 256->512", 256, 256, 512},  {"mini x16 chunks 256->512", 4096, 256, 512},
    {"4096 sq, 512 rows", 512, 4096, 4096}, {"4096 sq, 4096 rows", 4096, 4096, 4096},
};
constexpr Shape kDecodeShapes[] = {
    {"mini head 256->512", 1, 256, 512},  {"mini wq_b 64->1024", 1, 64, 1024},
    {"4096->4096", 1, 4096, 4096},        {"4096->14336", 1, 4096, 14336},
    {"8 rows 4096->4096", 8, 4096, 4096},
};

// Compares sampled rows of the device result y_dev with the contract's chain on the CPU.
bool BitExact(const std::vector<float>& x, const std::vector<float>& w, const Shape& s,
              const float* y_dev) {
  std::vector<float> y(static_cast<size_t>(s.rows) * s.out);
  CHECK_CUDA(cudaMemcpy(y.data(), y_dev, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const int samples = std::min(s.rows, 12);
  for (int i = 0; i < samples; ++i) {
    const int t = samples == 1 ? 0 : static_cast<int>(int64_t{s.rows - 1} * i / (samples - 1));
    for (int o = 0; o < s.out; ++o) {
      float acc = 0.0f;
      const float* xr = &x[static_cast<size_t>(t) * s.in];
      const float* wr = &w[static_cast<size_t>(o) * s.in];
      for (int k = 0; k < s.in; ++k) acc = std::fma(xr[k], wr[k], acc);
      const float got = y[static_cast<size_t>(t) * s.out + o];
      if (std::memcmp(&acc, &got, sizeof(float)) != 0) {
        std::fprintf(stderr, "MISMATCH %s row %d output %d: cpu %.9g gpu %.9g\n", s.name, t, o, acc,
                     got);
        return false;
      }
    }
  }
  return true;
}

// Device buffers for one shape: `copies` weight matrices (rotated between calls) and one input.
struct DeviceShape {
  std::vector<float*> w;
  float* x = nullptr;
  float* y = nullptr;
  std::vector<float> host_x, host_w;

  DeviceShape(const Shape& s, int copies) {
    host_x = Random(static_cast<size_t>(s.rows) * s.in, 1);
    host_w = Random(static_cast<size_t>(s.out) * s.in, 2);
    CHECK_CUDA(cudaMalloc(&x, host_x.size() * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&y, static_cast<size_t>(s.rows) * s.out * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(x, host_x.data(), host_x.size() * sizeof(float), cudaMemcpyHostToDevice));
    for (int c = 0; c < copies; ++c) {
      float* d = nullptr;
      CHECK_CUDA(cudaMalloc(&d, host_w.size() * sizeof(float)));
      CHECK_CUDA(
          cudaMemcpy(d, host_w.data(), host_w.size() * sizeof(float), cudaMemcpyHostToDevice));
      w.push_back(d);
    }
  }
  DeviceShape(const DeviceShape&) = delete;  // owns its device buffers
  DeviceShape& operator=(const DeviceShape&) = delete;
  ~DeviceShape() {
    for (float* d : w) (void)cudaFree(d);
    (void)cudaFree(x);
    (void)cudaFree(y);
  }
  // Poisons y so that an output a kernel never wrote cannot pass the comparison.
  void Poison(const Shape& s) const {
    CHECK_CUDA(cudaMemset(y, 0xff, static_cast<size_t>(s.rows) * s.out * sizeof(float)));
  }
};

// Median times of cuBLAS (when loaded; else -1) and of three kernels on one shape, weights
// rotating over d's copies; each kernel's output is first checked against the CPU chain.
struct Timings {
  double cublas_ms = -1;
  double kernel_ms[3] = {0, 0, 0};
};

Timings Measure(const Cublas* cublas, const DeviceShape& d, const Shape& s,
                const CudaMatMulKernel (&kernels)[3], double min_ms, bool* exact) {
  Timings t;
  if (cublas != nullptr) {
    t.cublas_ms = MedianMs(
        [&](int rep) {
          if (!cublas->Run(d.x, s.rows, s.in, d.w[rep % d.w.size()], s.out, d.y)) {
            std::fprintf(stderr, "cublasSgemm failed\n");
            std::exit(2);
          }
        },
        min_ms);
  }
  for (int i = 0; i < 3; ++i) {
    auto launch = [&](int rep) {
      CHECK_CUDA(LaunchMatMul(d.x, s.rows, s.in, d.w[rep % d.w.size()], s.out, d.y, 0, kernels[i]));
    };
    d.Poison(s);
    launch(0);
    CHECK_CUDA(cudaDeviceSynchronize());
    *exact = BitExact(d.host_x, d.host_w, s, d.y) && *exact;
    t.kernel_ms[i] = MedianMs(launch, min_ms);
  }
  return t;
}

// Upper bound on --min-ms (a minute per measurement; the GPU check passes 100).
constexpr double kMinMsMax = 60000;

int Main(int argc, char** argv) {
  double min_ms = 200;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--min-ms" && i + 1 < argc) {
      char* end = nullptr;
      min_ms = std::strtod(argv[++i], &end);
      if (end == argv[i] || *end != '\0' || !(min_ms > 0 && min_ms <= kMinMsMax)) {
        std::fprintf(stderr, "kvtier_bench_cuda_matmul: --min-ms takes a number in (0, %.0f]\n",
                     kMinMsMax);
        return 2;
      }
    } else if (a == "--quick") {
      quick = true;
    } else {
      std::fprintf(a == "--help" ? stdout : stderr,
                   "usage: kvtier_bench_cuda_matmul [--min-ms M] [--quick]\n"
                   "  --min-ms M  time each measurement for at least M ms (default 200)\n"
                   "  --quick     skip the prefill shapes above 2^30 multiply-adds\n");
      return a == "--help" ? 0 : 2;
    }
  }
  const Status dev = CudaMatMulDeviceStatus();
  if (!dev.ok()) {
    std::fprintf(stderr, "no CUDA device: %s\n", dev.ToString().c_str());
    return 3;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MiB, %.0f GiB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, static_cast<double>(prop.totalGlobalMem) / (1 << 30));

  // 1. Copy bandwidth over 1 GiB (read + written).
  const size_t copy_bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 1, copy_bytes));
  const double copy_ms = MedianMs(
      [&](int) { CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); },
      min_ms);
  const double bw = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  std::printf("copy bandwidth %.0f GB/s (1 GiB device-to-device, read + written)\n", bw / 1e9);

  Cublas cublas;
  const bool have_cublas = cublas.Load();
  if (!have_cublas) std::printf("cuBLAS not found: the peer columns read \"-\"\n");

  bool exact = true;
  const Cublas* peer = have_cublas ? &cublas : nullptr;

  // 2. Prefill.
  std::printf("\nprefill: GFLOP/s, ratio = cuBLAS SGEMM time / kernel time\n");
  std::printf("%-26s %5s %5s %5s %9s | %9s %9s %9s | %6s %6s\n", "shape", "rows", "in", "out",
              "cublas", "tile16", "regtile64", "auto", "r_t16", "r_reg");
  for (const Shape& s : kPrefillShapes) {
    if (quick && s.rows * int64_t{s.in} * s.out > (int64_t{1} << 30)) continue;
    DeviceShape d(s, 1);
    const double flop = 2.0 * s.rows * s.in * s.out;
    const Timings t =
        Measure(peer, d, s,
                {CudaMatMulKernel::kTile16, CudaMatMulKernel::kRegTile64, CudaMatMulKernel::kAuto},
                min_ms, &exact);
    const double cublas_ms = t.cublas_ms;
    const double* kernel_ms = t.kernel_ms;
    auto gflops = [&](double ms) { return ms > 0 ? flop / (ms * 1e-3) / 1e9 : 0.0; };
    char c[32] = "-", r16[16] = "-", rreg[16] = "-";
    if (cublas_ms > 0) {
      std::snprintf(c, sizeof(c), "%.0f", gflops(cublas_ms));
      std::snprintf(r16, sizeof(r16), "%.2f", cublas_ms / kernel_ms[0]);
      std::snprintf(rreg, sizeof(rreg), "%.2f", cublas_ms / kernel_ms[1]);
    }
    std::printf("%-26s %5d %5d %5d %9s | %9.0f %9.0f %9.0f | %6s %6s\n", s.name, s.rows, s.in,
                s.out, c, gflops(kernel_ms[0]), gflops(kernel_ms[1]), gflops(kernel_ms[2]), r16,
                rreg);
  }

  // 3. Decode.
  std::printf("\ndecode: weight GB/s, ratio = weight bytes/s / copy bandwidth\n");
  std::printf("%-22s %4s %5s %6s %7s | %8s %8s %8s | %6s %6s\n", "shape", "rows", "in", "out",
              "cublas", "tile16", "fewrows", "auto", "r_t16", "r_few");
  for (const Shape& s : kDecodeShapes) {
    const double wbytes = 4.0 * s.in * s.out;
    // Copies enough to exceed twice the L2, except mini-v4.1's few MiB, resident in practice.
    const bool mini = std::strncmp(s.name, "mini", 4) == 0;
    const int copies =
        mini ? 1 : std::max(1, static_cast<int>(2.0 * prop.l2CacheSize / wbytes) + 1);
    DeviceShape d(s, copies);
    const Timings t =
        Measure(peer, d, s,
                {CudaMatMulKernel::kTile16, CudaMatMulKernel::kFewRows, CudaMatMulKernel::kAuto},
                min_ms, &exact);
    const double cublas_ms = t.cublas_ms;
    const double* kernel_ms = t.kernel_ms;
    auto gbs = [&](double ms) { return wbytes / (ms * 1e-3) / 1e9; };
    char c[32] = "-";
    if (cublas_ms > 0) std::snprintf(c, sizeof(c), "%.0f", gbs(cublas_ms));
    std::printf("%-22s %4d %5d %6d %7s | %8.0f %8.0f %8.0f | %6.3f %6.3f%s\n", s.name, s.rows, s.in,
                s.out, c, gbs(kernel_ms[0]), gbs(kernel_ms[1]), gbs(kernel_ms[2]),
                gbs(kernel_ms[0]) * 1e9 / bw, gbs(kernel_ms[1]) * 1e9 / bw,
                mini ? "  (resident in L2)" : "");
  }
  std::printf("\nbit-exact against the CPU chain: %s\n", exact ? "yes" : "NO");
  return exact ? 0 : 1;
}

}  // namespace
}  // namespace kvtier::engine::cuda

int main(int argc, char** argv) { return kvtier::engine::cuda::Main(argc, argv); }
