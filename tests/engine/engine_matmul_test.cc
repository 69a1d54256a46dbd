// The engine's CPU MatMul (engine/matmul.h): every kernel against the contract's fma chain,
// bit for bit, over shapes with every kind of tail; a row's result independent of the rows
// around it and of the thread count; the packed-weight registry. ctest also runs this binary
// with KVTIER_ENGINE_MATMUL=scalar (kvtier_engine_matmul_scalar), where MatMulCpu must take
// the fallback.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string_view>
#include <vector>

#include "engine/matmul.h"
#include "engine/ops.h"
#include "matmul_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::Bits;
using testutil::Contract;
using testutil::ExpectSameBits;
using testutil::RandomFloats;

constexpr MatMulKernel kKernels[] = {MatMulKernel::kScalar, MatMulKernel::kAvx2Fma,
                                     MatMulKernel::kAvx512Fma};

struct Shape {
  int rows, in, out;
};

std::vector<Shape> Shapes(std::mt19937* rng) {
  // Row counts around the 6-row pass, outputs around the 16-wide panel and the 6-panel pass,
  // in = 1, and the engine's own shapes.
  std::vector<Shape> s = {
      {1, 1, 1},     {1, 7, 3},     {2, 9, 17},    {3, 8, 31},     {4, 15, 33},    {5, 16, 47},
      {6, 17, 96},   {7, 33, 97},   {12, 64, 15},  {13, 5, 113},   {1, 256, 1024}, {1, 64, 100},
      {2, 256, 200}, {3, 128, 257}, {19, 256, 64}, {64, 1024, 24}, {33, 512, 64},  {256, 256, 128}};
  for (int i = 0; i < 24; ++i) {
    s.push_back({1 + static_cast<int>((*rng)() % 40), 1 + static_cast<int>((*rng)() % 300),
                 1 + static_cast<int>((*rng)() % 200)});
  }
  return s;
}

std::string Name(const Shape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.in) + "->" + std::to_string(s.out);
}

TEST(MatMul, EveryKernelComputesTheContractBitForBit) {
  std::mt19937 rng(2024);
  for (const Shape& s : Shapes(&rng)) {
    const auto x = RandomFloats(static_cast<size_t>(s.rows) * s.in, &rng);
    const auto w = RandomFloats(static_cast<size_t>(s.out) * s.in, &rng);
    const auto want = Contract(x, s.rows, s.in, w, s.out);
    const PackedMatrix packed(w.data(), s.in, s.out);
    for (MatMulKernel k : kKernels) {
      if (!MatMulKernelAvailable(k)) continue;
      std::vector<float> y(want.size(), -1.0f);
      MatMulWith(k, nullptr, x.data(), s.rows, s.in, w.data(), &packed, s.out, y.data());
      ExpectSameBits(want, y, std::string(MatMulKernelName(k)) + " " + Name(s));
    }
    std::vector<float> y(want.size(), -1.0f);  // the public entry, whatever kernel it takes
    MatMulCpu(nullptr, x.data(), s.rows, s.in, w.data(), s.out, y.data());
    ExpectSameBits(want, y, "MatMulCpu " + Name(s));
  }
}

// The AVX-512 block itself (MatMulWith sends it only passes of 2+ rows): every row count from 1
// through two full 8-row passes and a tail, every panel count of a pass (1-6) and a partial last
// panel, on row and panel ranges that do not start at 0, against the contract bit for bit.
// Outputs outside the block must stay untouched.
TEST(MatMul, Avx512BlockComputesTheContractOnEveryPassShape) {
  if (!MatMulKernelAvailable(MatMulKernel::kAvx512Fma)) GTEST_SKIP() << "no AVX-512F";
  std::mt19937 rng(512);
  for (int in : {1, 3, 40, 257}) {
    for (int out : {5, 16, 47, 96, 113, 200}) {
      const int rows = 21;
      const auto x = RandomFloats(static_cast<size_t>(rows) * in, &rng);
      const auto w = RandomFloats(static_cast<size_t>(out) * in, &rng);
      const auto want = Contract(x, rows, in, w, out);
      const PackedMatrix packed(w.data(), in, out);
      for (int r0 : {0, 2}) {
        for (int r1 = r0 + 1; r1 <= rows; ++r1) {
          for (int p0 : {0, 1}) {
            if (p0 >= packed.panels()) continue;
            const int p1 = packed.panels();
            std::vector<float> y(want.size(), -1.0f);
            internal::MatMulAvx512Block(x.data(), r0, r1, packed, p0, p1, y.data());
            for (int t = 0; t < rows; ++t) {
              for (int o = 0; o < out; ++o) {
                const size_t i = static_cast<size_t>(t) * out + o;
                const bool inside = t >= r0 && t < r1 && o >= p0 * kMatMulPanelOutputs;
                uint32_t a, b;
                const float expect = inside ? want[i] : -1.0f;
                std::memcpy(&a, &expect, 4);
                std::memcpy(&b, &y[i], 4);
                ASSERT_EQ(a, b) << "in " << in << " out " << out << " rows [" << r0 << ", " << r1
                                << ") panels from " << p0 << ": row " << t << " output " << o;
              }
            }
          }
        }
      }
    }
  }
}

TEST(MatMul, ARowsResultDoesNotDependOnTheOtherRowsOrTheThreads) {
  std::mt19937 rng(7);
  const int rows = 37, in = 256, out = 300;  // above the parallel threshold, both splits
  const auto x = RandomFloats(static_cast<size_t>(rows) * in, &rng);
  const auto w = RandomFloats(static_cast<size_t>(out) * in, &rng);
  const PackedMatrix packed(w.data(), in, out);
  for (MatMulKernel k : kKernels) {
    if (!MatMulKernelAvailable(k)) continue;
    std::vector<float> alone(static_cast<size_t>(rows) * out);
    for (int t = 0; t < rows; ++t) {
      MatMulWith(k, nullptr, x.data() + static_cast<size_t>(t) * in, 1, in, w.data(), &packed, out,
                 alone.data() + static_cast<size_t>(t) * out);
    }
    for (int threads : {1, 2, 3, 8}) {
      ThreadPool pool(threads);
      for (int n : {1, 2, 5, 6, 7, 12, 13, 36, 37}) {  // a prefix of the rows as one call
        std::vector<float> y(static_cast<size_t>(n) * out, -1.0f);
        MatMulWith(k, &pool, x.data(), n, in, w.data(), &packed, out, y.data());
        ExpectSameBits(std::vector<float>(alone.begin(), alone.begin() + y.size()), y,
                       std::string(MatMulKernelName(k)) + " threads " + std::to_string(threads) +
                           " rows " + std::to_string(n));
      }
    }
  }
}

// MatMulManyWith: each part bit-identical to the contract for its own shape, whatever the
// parts beside it, the kernel and the thread count (panels of all parts split over the threads
// in one section when the rows are few; each part alone otherwise). Outputs start as NaN, so a
// panel no chunk computed shows.
TEST(MatMul, ManyPartsInOneCallEachComputeTheirOwnProduct) {
  std::mt19937 rng(11);
  struct Part {
    int rows, in, out;
  };
  const std::vector<std::vector<Part>> calls = {
      {{1, 256, 64}, {1, 256, 128}, {1, 256, 4}},                    // wq_a, wkv, index weights
      {{1, 64, 1024}, {1, 64, 128}},                                 // wq_b, the index query
      {{1, 512, 64}, {1, 512, 64}},                                  // wo_a's two groups
      {{1, 256, 128}, {1, 256, 128}, {2, 256, 128}, {2, 256, 128}},  // gate/up, 1 and 2 rows
      {{1, 7, 3}},                                                   // small: on the caller
      {{3, 33, 97}, {1, 300, 17}, {2, 1, 200}, {1, 0, 5}, {1, 9, 0}},
      {{40, 256, 128}, {40, 64, 33}},    // many rows: row blocks
      {{1, 512, 1280}, {1, 128, 700}}};  // past one chunk per thread
  for (size_t ci = 0; ci < calls.size(); ++ci) {
    const std::vector<Part>& call = calls[ci];
    std::vector<std::vector<float>> x, w, want;
    std::vector<std::unique_ptr<PackedMatrix>> packed;
    for (const Part& p : call) {
      x.push_back(RandomFloats(static_cast<size_t>(p.rows) * p.in, &rng));
      w.push_back(RandomFloats(static_cast<size_t>(p.out) * p.in, &rng));
      want.push_back(Contract(x.back(), p.rows, p.in, w.back(), p.out));
      packed.push_back(std::make_unique<PackedMatrix>(w.back().data(), p.in, p.out));
    }
    for (MatMulKernel k : kKernels) {
      if (!MatMulKernelAvailable(k)) continue;
      for (int threads : {1, 2, 3, 8}) {
        ThreadPool pool(threads);
        std::vector<std::vector<float>> y;
        std::vector<MatMulPart> parts;
        for (size_t i = 0; i < call.size(); ++i) {
          y.emplace_back(want[i].size(), std::nanf(""));
          parts.push_back({x[i].data(), call[i].rows, call[i].in, w[i].data(),
                           k == MatMulKernel::kScalar ? nullptr : packed[i].get(), call[i].out,
                           y[i].data()});
        }
        MatMulManyWith(k, &pool, parts.data(), static_cast<int>(parts.size()));
        for (size_t i = 0; i < call.size(); ++i) {
          ExpectSameBits(want[i], y[i],
                         std::string(MatMulKernelName(k)) + " call " + std::to_string(ci) +
                             " part " + std::to_string(i) + " threads " + std::to_string(threads));
        }
      }
    }
    // The public entry (ops.h), W not registered: packed per call.
    ThreadPool pool(2);
    std::vector<std::vector<float>> y;
    std::vector<MatMulPart> parts;
    for (size_t i = 0; i < call.size(); ++i) {
      y.emplace_back(want[i].size(), std::nanf(""));
      parts.push_back(
          {x[i].data(), call[i].rows, call[i].in, w[i].data(), nullptr, call[i].out, y[i].data()});
    }
    MatMulMany(&pool, parts.data(), static_cast<int>(parts.size()));
    for (size_t i = 0; i < call.size(); ++i) {
      ExpectSameBits(want[i], y[i],
                     "MatMulMany call " + std::to_string(ci) + " part " + std::to_string(i));
    }
  }
}

TEST(MatMul, RegisteredWeightsAreSharedAndDroppedWithTheirLastHandle) {
  std::mt19937 rng(11);
  const int rows = 5, in = 40, out = 50;
  const auto x = RandomFloats(rows * in, &rng);
  const auto w = RandomFloats(out * in, &rng);
  EXPECT_EQ(FindPackedWeight(w.data(), in, out), nullptr);
  auto a = RegisterPackedWeight(w.data(), in, out);
  auto b = RegisterPackedWeight(w.data(), in, out);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(FindPackedWeight(w.data(), in, out).get(), a.get());
  EXPECT_EQ(FindPackedWeight(w.data(), in, out - 1), nullptr);  // the shape is part of the key
  EXPECT_EQ(a->panels(), 4);
  EXPECT_EQ(a->bytes(), 4u * in * kMatMulPanelOutputs * sizeof(float));
  std::vector<float> registered(rows * out), unregistered(rows * out);
  MatMulCpu(nullptr, x.data(), rows, in, w.data(), out, registered.data());
  a.reset();
  EXPECT_NE(FindPackedWeight(w.data(), in, out), nullptr);
  b.reset();
  EXPECT_EQ(FindPackedWeight(w.data(), in, out), nullptr);
  MatMulCpu(nullptr, x.data(), rows, in, w.data(), out, unregistered.data());
  ExpectSameBits(registered, unregistered, "registered vs per-call packing");
  ExpectSameBits(Contract(x, rows, in, w, out), registered, "contract");
}

// A PackedWeightSet finds what it added under the same shape only, holds it registered while it
// lives, and adds nothing while the scalar kernel (which reads W as it is) is active.
TEST(MatMul, PackedWeightSetFindsItsCopiesByWeightAndShape) {
  std::mt19937 rng(12);
  const int in = 24, out = 9;
  const auto w = RandomFloats(out * in, &rng);
  {
    PackedWeightSet set;
    set.Add(w.data(), in, out);
    set.Add(nullptr, in, out);
    if (ActiveMatMulKernel() == MatMulKernel::kScalar) {
      EXPECT_EQ(set.Find(w.data(), in, out), nullptr);
      EXPECT_EQ(FindPackedWeight(w.data(), in, out), nullptr);
      return;
    }
    const PackedMatrix* p = set.Find(w.data(), in, out);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p, FindPackedWeight(w.data(), in, out).get());
    EXPECT_EQ(set.Find(w.data(), in, out - 1), nullptr);  // the shape is part of the key
    EXPECT_EQ(set.Find(w.data(), in - 1, out), nullptr);
    EXPECT_EQ(set.Find(w.data() + 1, in, out), nullptr);
  }
  EXPECT_EQ(FindPackedWeight(w.data(), in, out), nullptr);  // released with the set
}

TEST(MatMul, PackingLaysOutPanelsWithZeroPadding) {
  const int in = 3, out = 17;
  std::vector<float> w(out * in);
  for (int i = 0; i < out * in; ++i) w[i] = static_cast<float>(i + 1);
  const PackedMatrix p(w.data(), in, out);
  ASSERT_EQ(p.panels(), 2);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p.panel(0)) % 64, 0u);
  for (int k = 0; k < in; ++k) {
    for (int j = 0; j < kMatMulPanelOutputs; ++j) {
      EXPECT_EQ(p.panel(0)[k * kMatMulPanelOutputs + j], w[j * in + k]);
      EXPECT_EQ(p.panel(1)[k * kMatMulPanelOutputs + j], j == 0 ? w[16 * in + k] : 0.0f);
    }
  }
}

TEST(MatMul, TheEnvironmentChoosesTheKernel) {
  const char* env = std::getenv("KVTIER_ENGINE_MATMUL");
  if (env != nullptr && std::string_view(env) == "scalar") {
    EXPECT_EQ(ActiveMatMulKernel(), MatMulKernel::kScalar);
  } else if (MatMulKernelAvailable(MatMulKernel::kAvx512Fma) &&
             !(env != nullptr && std::string_view(env) == "avx2")) {
    EXPECT_EQ(ActiveMatMulKernel(), MatMulKernel::kAvx512Fma);
  } else {
    EXPECT_EQ(ActiveMatMulKernel(), MatMulKernelAvailable(MatMulKernel::kAvx2Fma)
                                        ? MatMulKernel::kAvx2Fma
                                        : MatMulKernel::kScalar);
  }
}

}  // namespace
}  // namespace kvtier::engine
