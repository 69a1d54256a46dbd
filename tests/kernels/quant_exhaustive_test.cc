// Exhaustive checks over all 2^32 binary32 bit patterns (label: slow; about 4 CPU-minutes):
// the scalar e2m1/e4m3 conversions against the independent oracle, and the AVX2 conversions
// against the scalar ones.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/internal/backends.h"
#include "kernels/quant.h"
#include "tests/kernels/quant_oracle.h"

namespace kvtier::kernels {
namespace {

constexpr uint64_t kChunk = 1 << 20;

TEST(QuantExhaustive, ScalarMatchesOracleForEveryFloat) {
  for (uint64_t u = 0; u <= 0xffffffffull; ++u) {
    const float x = testing::FromBits(static_cast<uint32_t>(u));
    ASSERT_EQ(FloatToE2M1(x), testing::OracleE2M1(x)) << std::hex << "e2m1 x_bits=0x" << u;
    ASSERT_EQ(FloatToE4M3(x), testing::OracleE4M3(x)) << std::hex << "e4m3 x_bits=0x" << u;
  }
}

TEST(QuantExhaustive, Avx2MatchesScalarForEveryFloat) {
  if (!internal::Avx2Supported()) GTEST_SKIP() << "this CPU has no AVX2";
  std::vector<float> x(kChunk);
  std::vector<uint8_t> e2m1(kChunk);
  std::vector<uint8_t> e4m3(kChunk);
  for (uint64_t base = 0; base <= 0xffffffffull; base += kChunk) {
    for (uint64_t i = 0; i < kChunk; ++i) x[i] = testing::FromBits(static_cast<uint32_t>(base + i));
    internal::Avx2FloatToE2M1(x.data(), kChunk, e2m1.data());
    internal::Avx2FloatToE4M3(x.data(), kChunk, e4m3.data());
    for (uint64_t i = 0; i < kChunk; ++i) {
      ASSERT_EQ(e2m1[i], FloatToE2M1(x[i])) << std::hex << "x_bits=0x" << base + i;
      ASSERT_EQ(e4m3[i], FloatToE4M3(x[i])) << std::hex << "x_bits=0x" << base + i;
    }
  }
}

}  // namespace
}  // namespace kvtier::kernels
