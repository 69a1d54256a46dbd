// The engine's CUDA MatMul (engine/cuda/) against the CPU reference: bit-exact per element over
// many shapes, identical logits for a whole prompt with KVTIER_ENGINE_CUDA=0 and =1, and the
// CUDA path off unless KVTIER_ENGINE_CUDA=1.
// Every test skips (GTEST_SKIP) when the build has no CUDA or no device is present, and fails
// instead when KVTIER_REQUIRE_CUDA=1 (tests/cuda_required.h; the GPU check sets it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "engine/ops.h"
#include "engine_test_util.h"
#include "tests/cuda_required.h"
#if KVTIER_WITH_CUDA
#include "engine/cuda/backend.h"
#endif

namespace kvtier::engine {
namespace {

// Skips the calling test unless the CUDA MatMul can run here (fails it under
// KVTIER_REQUIRE_CUDA=1).
#define SKIP_WITHOUT_CUDA_DEVICE()                                                             \
  do {                                                                                         \
    const Status dev = kCudaBuilt                                                              \
                           ? DeviceStatus()                                                    \
                           : Status::Unavailable("built without CUDA (KVTIER_WITH_CUDA off)"); \
    if (!dev.ok() && ::kvtier::testing::CudaRequired())                                        \
      GTEST_FAIL() << "KVTIER_REQUIRE_CUDA=1 but " << dev.ToString();                          \
    if (!dev.ok()) GTEST_SKIP() << "no CUDA device: " << dev.ToString();                       \
  } while (0)

#if KVTIER_WITH_CUDA
constexpr bool kCudaBuilt = true;
Status DeviceStatus() { return cuda::CudaMatMulDeviceStatus(); }
#else
constexpr bool kCudaBuilt = false;
Status DeviceStatus() { return Status::Unavailable("not built"); }
#endif

[[maybe_unused]] std::vector<float> RandomFloats(size_t n, std::mt19937* rng) {
  // A wide dynamic range and both signs, so rounding order matters and differences show.
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-8, 8);
  std::vector<float> v(n);
  for (auto& f : v) f = std::ldexp(mant(*rng), exp(*rng));
  return v;
}

TEST(EngineCuda, MatMulBitIdenticalToCpuOverShapes) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if KVTIER_WITH_CUDA
  std::mt19937 rng(12345);
  struct Shape {
    int rows, in, out;
  };
  // Tails (in % 8 != 0), in < 8, single rows/columns, shapes above the dispatch threshold, and
  // rows and outputs on either side of every kernel's tile edges (8, 16, 64).
  std::vector<Shape> shapes = {{1, 1, 1},
                               {1, 7, 3},
                               {3, 8, 5},
                               {2, 9, 17},
                               {5, 15, 33},
                               {1, 64, 64},
                               {4, 100, 257},
                               {7, 129, 31},
                               {1, 1023, 65},
                               {16, 256, 513},
                               {33, 77, 300},
                               {2, 2049, 128},
                               {8, 31, 64},
                               {9, 33, 65},
                               {64, 16, 64},
                               {65, 17, 63},
                               {127, 40, 129},
                               {130, 300, 70},
                               {200, 257, 130},
                               // kFewRows's (in % 4 == 0, rows <= 8): slices of 112, tails.
                               {1, 4, 1},
                               {5, 112, 33},
                               {8, 116, 31},
                               {1, 224, 64},
                               {3, 452, 97},
                               {1, 4096, 40},
                               {6, 1000, 65}};
  for (int i = 0; i < 20; ++i) {
    shapes.push_back({1 + static_cast<int>(rng() % 150), 1 + static_cast<int>(rng() % 600),
                      1 + static_cast<int>(rng() % 300)});
  }
  const cuda::CudaMatMulKernel kernels[] = {
      cuda::CudaMatMulKernel::kAuto, cuda::CudaMatMulKernel::kTile16,
      cuda::CudaMatMulKernel::kRegTile64, cuda::CudaMatMulKernel::kFewRows};
  for (const Shape& s : shapes) {
    const auto x = RandomFloats(static_cast<size_t>(s.rows) * s.in, &rng);
    const auto w = RandomFloats(static_cast<size_t>(s.out) * s.in, &rng);
    std::vector<float> cpu(static_cast<size_t>(s.rows) * s.out, -1.0f);
    MatMulCpu(nullptr, x.data(), s.rows, s.in, w.data(), s.out, cpu.data());
    for (const cuda::CudaMatMulKernel kernel : kernels) {
      std::vector<float> gpu(cpu.size(), -2.0f);
      const Status st =
          cuda::CudaMatMul(x.data(), s.rows, s.in, w.data(), s.out, gpu.data(), kernel);
      ASSERT_TRUE(st.ok()) << st.ToString();
      for (size_t k = 0; k < cpu.size(); ++k) {
        uint32_t a, b;
        std::memcpy(&a, &cpu[k], 4);
        std::memcpy(&b, &gpu[k], 4);
        ASSERT_EQ(a, b) << cuda::CudaMatMulKernelName(kernel) << " shape " << s.rows << "x" << s.in
                        << "->" << s.out << " element " << k << ": cpu " << cpu[k] << " gpu "
                        << gpu[k];
      }
    }
  }
  // Same host buffer, new contents, same shape: the weight cache must notice and re-upload.
  const int rows = 3, in = 40, out = 50;
  const auto x = RandomFloats(rows * in, &rng);
  auto w = RandomFloats(out * in, &rng);
  std::vector<float> gpu(rows * out), cpu(rows * out);
  ASSERT_TRUE(cuda::CudaMatMul(x.data(), rows, in, w.data(), out, gpu.data()).ok());
  for (auto& f : w) f = -f * 0.5f;
  ASSERT_TRUE(cuda::CudaMatMul(x.data(), rows, in, w.data(), out, gpu.data()).ok());
  MatMulCpu(nullptr, x.data(), rows, in, w.data(), out, cpu.data());
  EXPECT_TRUE(testutil::BitEqual(cpu.data(), gpu.data(), cpu.size()));
  EXPECT_GT(cuda::CudaWeightCacheBytes(), 0u);
  cuda::CudaReleaseWeightCache();
  EXPECT_EQ(cuda::CudaWeightCacheBytes(), 0u);
#endif
}

// Runs a short prompt through a fresh engine with KVTIER_ENGINE_CUDA set to `env`.
std::vector<float> PromptLogits(const char* env) {
  setenv("KVTIER_ENGINE_CUDA", env, 1);
  auto e = testutil::MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  const Status s = e->Forward(&st, testutil::Prompt(21), true, &logits);
  EXPECT_TRUE(s.ok()) << s.ToString();
  // One decode step as well: rows == 1 takes different MatMul shapes than the prefill.
  std::vector<float> step;
  const Status d =
      e->Decode(&st, testutil::Argmax(logits.data() + logits.size() - 512, 512), &step);
  EXPECT_TRUE(d.ok()) << d.ToString();
  logits.insert(logits.end(), step.begin(), step.end());
  return logits;
}

// The CUDA MatMul is opt-in (slower than the CPU on the miniature): without KVTIER_ENGINE_CUDA
// set to "1" a whole prompt runs without one call of it.
TEST(EngineCuda, OffUnlessAskedFor) {
  SKIP_WITHOUT_CUDA_DEVICE();
  unsetenv("KVTIER_ENGINE_CUDA");
  auto e = testutil::MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  const int64_t calls_before = MatMulCudaCalls();
  ASSERT_TRUE(e->Forward(&st, testutil::Prompt(21), true, &logits).ok());
  EXPECT_EQ(MatMulCudaCalls(), calls_before);
}

TEST(EngineCuda, PromptLogitsIdenticalWithAndWithoutCuda) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<float> cpu = PromptLogits("0");
  const int64_t calls_before = MatMulCudaCalls();
  const std::vector<float> gpu = PromptLogits("1");
  unsetenv("KVTIER_ENGINE_CUDA");
  // The CUDA run must really have used the GPU, or the comparison proves nothing.
  EXPECT_GT(MatMulCudaCalls(), calls_before);
  ASSERT_EQ(cpu.size(), gpu.size());
  ASSERT_FALSE(cpu.empty());
  EXPECT_TRUE(testutil::BitEqual(cpu.data(), gpu.data(), cpu.size()));
}

}  // namespace
}  // namespace kvtier::engine
