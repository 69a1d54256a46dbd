// MatMul over coded weights (engine/matmul.h, PackedFormat::kMxfp4 and kFp8), each test once per
// format: the layout against the quantiser's codes, both kernels against the contract's fma
// chain over the decoded W bit for bit (every row count of their passes, partial panels,
// sub-ranges, the thread pool), the fallback to kF32 wherever the code would not be exact, and
// the registry keeping the formats apart. ctest also runs this binary with
// KVTIER_ENGINE_MATMUL=avx2 and =scalar.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/matmul.h"
#include "engine/thread_pool.h"
#include "kernels/quant.h"
#include "matmul_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::Bits;
using testutil::Contract;
using testutil::ExpectSameBits;
using testutil::RandomFloats;

struct Format {
  PackedFormat packed;
  kernels::QuantFormat quant;
  int block_bytes, group_inputs, code_bits;
};
constexpr Format kMxfp4{PackedFormat::kMxfp4, kernels::QuantFormat::kFp4Ue8m0x32, kMxfp4BlockBytes,
                        kMxfp4GroupInputs, 4};
constexpr Format kFp8{PackedFormat::kFp8, kernels::QuantFormat::kFp8Ue8m0x32, kFp8BlockBytes,
                      kFp8GroupInputs, 8};

class MatMulCoded : public ::testing::TestWithParam<Format> {};

// A W [out x in] of the format's values: random rows rounded by the quantiser, with every code,
// signed zeros, E4M3 subnormals, and blocks whose scales span 2^-110 .. 2^110 (MXFP4) or
// 2^-110 .. 2^7 (FP8: the kernels' range).
std::vector<float> CodedMatrix(const Format& f, int out, int in, std::mt19937* rng) {
  std::vector<float> w = RandomFloats(static_cast<size_t>(out) * in, rng);
  std::uniform_int_distribution<int> block_exp(-110, f.code_bits == 8 ? -2 : 110);
  for (size_t b = 0; b + 32 <= w.size(); b += 32) {
    const int e = (b / 32) % 5 == 0 ? block_exp(*rng) : 0;  // some blocks far from 1
    for (size_t i = b; i < b + 32; ++i) w[i] = std::ldexp(w[i], e);
  }
  if (!w.empty()) w[0] = -0.0f;
  EXPECT_TRUE(kernels::RoundTrip(f.quant, w.data(), out, in, kernels::Backend::kReference).ok());
  return w;
}

TEST_P(MatMulCoded, PanelsHoldTheQuantisersCodesAndScales) {
  std::mt19937 rng(1);
  const int in = 96, out = 21;  // two panels, the second partial
  const auto w = CodedMatrix(GetParam(), out, in, &rng);
  const PackedMatrix pm(w.data(), in, out, GetParam().packed);
  ASSERT_EQ(pm.format(), GetParam().packed);
  const Format& f = GetParam();
  EXPECT_EQ(pm.bytes(), static_cast<size_t>(2 * 3 * f.block_bytes));
  EXPECT_EQ(f.block_bytes, 16 + (32 / f.group_inputs) * 64);
  const size_t row_bytes = static_cast<size_t>(in) * f.code_bits / 8;
  std::vector<uint8_t> codes(static_cast<size_t>(out) * row_bytes),
      scales(static_cast<size_t>(out) * 3);
  ASSERT_TRUE(kernels::Quantize(f.quant, w.data(), out, in, codes.data(), scales.data(),
                                kernels::Backend::kReference)
                  .ok());
  const uint32_t mask = (1u << f.code_bits) - 1;
  for (int o = 0; o < 32; ++o) {
    const int p = o / 16, j = o % 16;
    for (int b = 0; b < 3; ++b) {
      const uint8_t* blk = pm.coded_panel(p) + b * f.block_bytes;
      EXPECT_EQ(blk[j], o < out ? scales[o * 3 + b] : 127) << "scale of output " << o;
      for (int k = b * 32; k < b * 32 + 32; ++k) {
        // The quantiser's code of input k (FP8: byte k of the row; MXFP4: byte k / 2, the low
        // nibble for even k), and where the panel keeps it: group (k % 32) / group_inputs,
        // word j, code k % group_inputs from the low bits.
        uint32_t want = 0;
        if (o < out) {
          const uint8_t* row = codes.data() + static_cast<size_t>(o) * row_bytes;
          want = f.code_bits == 8 ? row[k] : (row[k / 2] >> (4 * (k % 2))) & 0xf;
        }
        uint32_t word;
        std::memcpy(&word, blk + 16 + ((k % 32) / f.group_inputs * 16 + j) * 4, 4);
        EXPECT_EQ((word >> (f.code_bits * (k % f.group_inputs))) & mask, want)
            << "output " << o << " input " << k;
      }
    }
  }
}

TEST_P(MatMulCoded, EveryKernelComputesTheContractOverTheDecodedWeights) {
  std::mt19937 rng(4);
  ThreadPool pool(2);
  for (int in : {32, 64, 96, 256}) {
    for (int out : {1, 5, 16, 17, 33, 100, 128, 300}) {
      for (int rows : {1, 2, 3, 4, 5, 8, 9, 13, 21}) {
        const auto x = RandomFloats(static_cast<size_t>(rows) * in, &rng);
        const auto w = CodedMatrix(GetParam(), out, in, &rng);
        const auto want = Contract(x, rows, in, w, out);
        const PackedMatrix pm(w.data(), in, out, GetParam().packed);
        ASSERT_EQ(pm.format(), GetParam().packed);
        const std::string shape =
            std::to_string(rows) + "x" + std::to_string(in) + "->" + std::to_string(out);
        for (MatMulKernel k : {MatMulKernel::kAvx2Fma, MatMulKernel::kAvx512Fma}) {
          if (!MatMulKernelAvailable(k)) continue;
          for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
            std::vector<float> y(want.size(), -1.0f);
            MatMulWith(k, p, x.data(), rows, in, w.data(), &pm, out, y.data());
            ExpectSameBits(want, y, std::string(MatMulKernelName(k)) + " " + shape);
          }
          // As one part among others (the decode path's MatMulManyWith), and an f32 part beside.
          const PackedMatrix pf(w.data(), in, out);
          std::vector<float> y1(want.size(), -1.0f), y2(want.size(), -1.0f);
          const MatMulPart parts[2] = {{x.data(), rows, in, w.data(), &pm, out, y1.data()},
                                       {x.data(), rows, in, w.data(), &pf, out, y2.data()}};
          MatMulManyWith(k, &pool, parts, 2);
          ExpectSameBits(want, y1, std::string("many mxfp4 ") + MatMulKernelName(k) + " " + shape);
          ExpectSameBits(want, y2, std::string("many f32 ") + MatMulKernelName(k) + " " + shape);
        }
      }
    }
  }
}

// The blocks themselves on row and panel ranges that do not start at 0: outputs outside the
// block stay untouched.
TEST_P(MatMulCoded, BlocksWriteExactlyTheirRowsAndPanels) {
  std::mt19937 rng(9);
  const int rows = 19, in = 64, out = 45;
  const auto x = RandomFloats(static_cast<size_t>(rows) * in, &rng);
  const auto w = CodedMatrix(GetParam(), out, in, &rng);
  const auto want = Contract(x, rows, in, w, out);
  const PackedMatrix pm(w.data(), in, out, GetParam().packed);
  ASSERT_EQ(pm.format(), GetParam().packed);
  using BlockFn = void (*)(const float*, int, int, const PackedMatrix&, int, int, float*);
  const bool fp8 = GetParam().packed == PackedFormat::kFp8;
  const struct {
    MatMulKernel kernel;
    BlockFn fn;
  } blocks[] = {
      {MatMulKernel::kAvx2Fma, fp8 ? internal::MatMulFp8Avx2Block : internal::MatMulMxfp4Avx2Block},
      {MatMulKernel::kAvx512Fma,
       fp8 ? internal::MatMulFp8Avx512Block : internal::MatMulMxfp4Avx512Block}};
  for (const auto& b : blocks) {
    if (!MatMulKernelAvailable(b.kernel)) continue;
    for (int r0 : {0, 3}) {
      for (int r1 = r0 + 1; r1 <= rows; ++r1) {
        for (int p0 = 0; p0 < pm.panels(); ++p0) {
          const int p1 = std::min(pm.panels(), p0 + 2);
          std::vector<float> y(want.size(), -1.0f);
          b.fn(x.data(), r0, r1, pm, p0, p1, y.data());
          for (int t = 0; t < rows; ++t) {
            for (int o = 0; o < out; ++o) {
              const size_t i = static_cast<size_t>(t) * out + o;
              const bool inside = t >= r0 && t < r1 && o >= p0 * 16 && o < p1 * 16;
              ASSERT_EQ(Bits(y[i]), Bits(inside ? want[i] : -1.0f))
                  << MatMulKernelName(b.kernel) << " rows [" << r0 << ", " << r1 << ") panels ["
                  << p0 << ", " << p1 << "): row " << t << " output " << o;
            }
          }
        }
      }
    }
  }
}

TEST_P(MatMulCoded, AWeightThatIsNotExactlyMxfp4IsPackedAsFloats) {
  std::mt19937 rng(12);
  const int rows = 3, out = 20;
  struct Case {
    std::string what;
    int in;
    std::vector<float> w;
  };
  std::vector<Case> cases;
  cases.push_back(
      {"in not a multiple of 32", 48, RandomFloats(static_cast<size_t>(out) * 48, &rng)});
  cases.push_back({"plain floats", 64, RandomFloats(static_cast<size_t>(out) * 64, &rng)});
  auto one_off = CodedMatrix(GetParam(), out, 64, &rng);
  one_off[77] = std::nextafter(one_off[77], 1e30f);  // one weight between two MXFP4 values
  cases.push_back({"one weight off the grid", 64, one_off});
  auto nan = CodedMatrix(GetParam(), out, 64, &rng);
  nan[5] = std::numeric_limits<float>::quiet_NaN();  // a NaN scale (0xff)
  cases.push_back({"a NaN", 64, nan});
  if (GetParam().packed == PackedFormat::kFp8) {
    // Exact in FP8 with a scale of 2^10 (code 137), above the kernels' range (2^(s - 7) would
    // not be a normal float times 2^120).
    auto large = CodedMatrix(GetParam(), out, 64, &rng);
    for (int i = 0; i < 32; ++i) large[64 + i] = static_cast<float>(i % 7) * 65536.0f;
    cases.push_back({"a block with scale 2^10", 64, large});
  }
  for (const Case& c : cases) {
    const PackedMatrix pm(c.w.data(), c.in, out, GetParam().packed);
    EXPECT_EQ(pm.format(), PackedFormat::kF32) << c.what;
    if (std::isnan(c.w[5])) continue;  // NaN products: nothing to compare bit for bit
    const auto x = RandomFloats(static_cast<size_t>(rows) * c.in, &rng);
    const auto want = Contract(x, rows, c.in, c.w, out);
    for (MatMulKernel k : {MatMulKernel::kAvx2Fma, MatMulKernel::kAvx512Fma}) {
      if (!MatMulKernelAvailable(k)) continue;
      std::vector<float> y(want.size(), -1.0f);
      MatMulWith(k, nullptr, x.data(), rows, c.in, c.w.data(), &pm, out, y.data());
      ExpectSameBits(want, y, c.what + " " + MatMulKernelName(k));
    }
  }
}

TEST_P(MatMulCoded, TheRegistryKeepsTheFormatsApart) {
  if (ActiveMatMulKernel() == MatMulKernel::kScalar)
    GTEST_SKIP() << "the scalar kernel packs nothing";
  std::mt19937 rng(3);
  const int in = 64, out = 32;
  const auto w = CodedMatrix(GetParam(), out, in, &rng);
  auto coded = RegisterPackedWeight(w.data(), in, out, GetParam().packed);
  auto f32 = RegisterPackedWeight(w.data(), in, out);
  EXPECT_NE(coded.get(), f32.get());
  EXPECT_EQ(coded->format(), GetParam().packed);
  EXPECT_EQ(f32->format(), PackedFormat::kF32);
  EXPECT_EQ(FindPackedWeight(w.data(), in, out).get(), f32.get());  // MatMul's own lookup: f32
  EXPECT_EQ(RegisterPackedWeight(w.data(), in, out, GetParam().packed).get(), coded.get());
  // 4.25 or 8.25 bits a weight against 32.
  EXPECT_LT(coded->bytes() * (GetParam().code_bits == 4 ? 7 : 3), f32->bytes());
  PackedWeightSet set;
  set.Add(w.data(), in, out, GetParam().packed);
  ASSERT_NE(set.Find(w.data(), in, out), nullptr);
  EXPECT_EQ(set.Find(w.data(), in, out)->format(), GetParam().packed);
}

INSTANTIATE_TEST_SUITE_P(Formats, MatMulCoded, ::testing::Values(kMxfp4, kFp8),
                         [](const ::testing::TestParamInfo<Format>& i) {
                           return i.param.packed == PackedFormat::kFp8 ? "Fp8" : "Mxfp4";
                         });

}  // namespace
}  // namespace kvtier::engine
