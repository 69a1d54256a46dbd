// Unit tests of kernels/quant.h: scalar conversions against an independent oracle, sizes,
// invalid arguments, the scale rules at their edges, NaN/Inf handling, and test 2 of the model
// reference (the E2M1 grid survives an FP8 E4M3 round trip with a power-of-two scale).
#include "kernels/quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tests/kernels/quant_oracle.h"

namespace kvtier::kernels {
namespace {

using testing::Bits;
using testing::FromBits;

constexpr QuantFormat kFormats[] = {QuantFormat::kFp4E4M3x16, QuantFormat::kFp4Ue8m0x32,
                                    QuantFormat::kFp8Ue8m0x32};
constexpr Backend kCpuBackends[] = {Backend::kReference, Backend::kSimd, Backend::kAuto};
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(QuantSizes, BlockDataAndScaleBytes) {
  EXPECT_EQ(BlockElems(QuantFormat::kFp4E4M3x16), 16u);
  EXPECT_EQ(BlockElems(QuantFormat::kFp4Ue8m0x32), 32u);
  EXPECT_EQ(BlockElems(QuantFormat::kFp8Ue8m0x32), 32u);
  // The model reference, section 5: a 512-wide main entry is 256 + 32 = 288 bytes; a 128-wide
  // indexer key in MXFP4 is 64 + 4 = 68 bytes.
  EXPECT_EQ(DataBytes(QuantFormat::kFp4E4M3x16, 512) + ScaleBytes(QuantFormat::kFp4E4M3x16, 512),
            288u);
  EXPECT_EQ(DataBytes(QuantFormat::kFp4Ue8m0x32, 128) + ScaleBytes(QuantFormat::kFp4Ue8m0x32, 128),
            68u);
  EXPECT_EQ(DataBytes(QuantFormat::kFp8Ue8m0x32, 64), 64u);
  EXPECT_EQ(ScaleBytes(QuantFormat::kFp8Ue8m0x32, 64), 2u);
  EXPECT_EQ(BlockElems(static_cast<QuantFormat>(9)), 0u);
}

TEST(QuantScalar, E2M1MatchesOracleOnSweep) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += 8191) {
    const float x = FromBits(static_cast<uint32_t>(u));
    ASSERT_EQ(FloatToE2M1(x), testing::OracleE2M1(x)) << std::hex << "x_bits=0x" << u;
  }
  for (float t : {0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f}) {
    for (int d = -2; d <= 2; ++d) {
      for (float s : {1.0f, -1.0f}) {
        const float x = s * FromBits(Bits(t) + d);
        ASSERT_EQ(FloatToE2M1(x), testing::OracleE2M1(x)) << x;
      }
    }
  }
}

TEST(QuantScalar, E2M1TiesSaturationNanAndSignedZero) {
  EXPECT_EQ(FloatToE2M1(0.25f), 0);  // tie -> even (0)
  EXPECT_EQ(FloatToE2M1(0.75f), 2);  // tie -> 1.0
  EXPECT_EQ(FloatToE2M1(1.25f), 2);  // tie -> 1.0
  EXPECT_EQ(FloatToE2M1(1.75f), 4);  // tie -> 2.0
  EXPECT_EQ(FloatToE2M1(2.5f), 4);   // tie -> 2.0
  EXPECT_EQ(FloatToE2M1(3.5f), 6);   // tie -> 4.0
  EXPECT_EQ(FloatToE2M1(5.0f), 6);   // tie -> 4.0
  EXPECT_EQ(FloatToE2M1(5.0001f), 7);
  EXPECT_EQ(FloatToE2M1(1e30f), 7);
  EXPECT_EQ(FloatToE2M1(-kInf), 15);
  EXPECT_EQ(FloatToE2M1(kNan), 7);
  EXPECT_EQ(FloatToE2M1(-kNan), 7);
  EXPECT_EQ(FloatToE2M1(-0.0f), 8);
  EXPECT_EQ(FloatToE2M1(-0.1f), 8);
  for (int c = 0; c < 16; ++c) {
    const float v = E2M1ToFloat(static_cast<uint8_t>(c));
    EXPECT_EQ(v, static_cast<float>(testing::E2M1Value(static_cast<uint8_t>(c))));
    EXPECT_EQ(std::signbit(v), c >= 8) << c;
    EXPECT_EQ(FloatToE2M1(v), c) << "the grid is a fixed point";
  }
}

TEST(QuantScalar, E4M3MatchesOracleOnSweep) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += 8191) {
    const float x = FromBits(static_cast<uint32_t>(u));
    ASSERT_EQ(FloatToE4M3(x), testing::OracleE4M3(x)) << std::hex << "x_bits=0x" << u;
  }
  // around every representable value and every midpoint, both signs
  for (int c = 0; c < 0x7f; ++c) {
    const float v = static_cast<float>(testing::E4M3Value(static_cast<uint8_t>(c)));
    const float next = static_cast<float>(testing::E4M3Value(static_cast<uint8_t>(c + 1)));
    for (float anchor : {v, (v + next) / 2}) {
      for (int d = -2; d <= 2; ++d) {
        for (float s : {1.0f, -1.0f}) {
          const float x = s * FromBits(Bits(anchor) + d);
          ASSERT_EQ(FloatToE4M3(x), testing::OracleE4M3(x)) << x;
        }
      }
    }
  }
}

TEST(QuantScalar, E4M3EdgesAndDecode) {
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7e);  // tie between 448 and (NaN slot) 480 -> even 448
  EXPECT_EQ(FloatToE4M3(1e9f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-kInf), 0xfe);
  EXPECT_EQ(FloatToE4M3(kNan), 0x7f);
  EXPECT_EQ(FloatToE4M3(-kNan), 0x7f);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -9)), 0x01);   // min subnormal
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -10)), 0x00);  // tie -> 0
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  for (int c = 0; c < 256; ++c) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_EQ(Bits(v), 0x7fc00000u) << c;
      continue;
    }
    EXPECT_EQ(v, static_cast<float>(testing::E4M3Value(static_cast<uint8_t>(c)))) << c;
    EXPECT_EQ(std::signbit(v), c >= 0x80) << c;
    EXPECT_EQ(FloatToE4M3(v), c) << "every code is a fixed point";
  }
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(Ue8m0ToFloat(static_cast<uint8_t>(c)), std::ldexp(1.0f, c - 127)) << c;
  }
  EXPECT_TRUE(std::isnan(Ue8m0ToFloat(0xff)));
}

TEST(QuantArgs, InvalidArgumentsAreRejected) {
  std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> data(64);
  std::vector<uint8_t> scales(4);
  std::vector<float> out(64);
  for (QuantFormat fmt : kFormats) {
    for (Backend b : {Backend::kReference, Backend::kSimd, Backend::kCuda, Backend::kAuto}) {
      const size_t bad_n = BlockElems(fmt) + 2;
      EXPECT_TRUE(
          Quantize(fmt, x.data(), 1, bad_n, data.data(), scales.data(), b).IsInvalidArgument());
      EXPECT_TRUE(Quantize(fmt, nullptr, 1, 32, data.data(), scales.data(), b).IsInvalidArgument());
      EXPECT_TRUE(Quantize(fmt, x.data(), 1, 32, nullptr, scales.data(), b).IsInvalidArgument());
      EXPECT_TRUE(Quantize(fmt, x.data(), 1, 32, data.data(), nullptr, b).IsInvalidArgument());
      EXPECT_TRUE(
          Dequantize(fmt, data.data(), scales.data(), 1, bad_n, out.data(), b).IsInvalidArgument());
      EXPECT_TRUE(
          Dequantize(fmt, nullptr, scales.data(), 1, 32, out.data(), b).IsInvalidArgument());
      EXPECT_TRUE(Dequantize(fmt, data.data(), nullptr, 1, 32, out.data(), b).IsInvalidArgument());
      EXPECT_TRUE(
          Dequantize(fmt, data.data(), scales.data(), 1, 32, nullptr, b).IsInvalidArgument());
      EXPECT_TRUE(RoundTrip(fmt, x.data(), 1, bad_n, b).IsInvalidArgument());
      EXPECT_TRUE(RoundTrip(fmt, nullptr, 1, 32, b).IsInvalidArgument());
      // rows*n above the limit is rejected before any buffer is touched
      EXPECT_TRUE(
          Quantize(fmt, x.data(), kQuantElemsMax / 32 + 1, 32, data.data(), scales.data(), b)
              .IsInvalidArgument());
      EXPECT_TRUE(
          Quantize(fmt, x.data(), SIZE_MAX, 64, data.data(), scales.data(), b).IsInvalidArgument());
    }
  }
  EXPECT_TRUE(Quantize(static_cast<QuantFormat>(0), x.data(), 1, 32, data.data(), scales.data())
                  .IsInvalidArgument());
  EXPECT_EQ(data, std::vector<uint8_t>(64)) << "outputs untouched on error";
}

TEST(QuantArgs, CudaIsUnavailableWithoutDevice) {
  if (BackendAvailable(Backend::kCuda)) GTEST_SKIP() << "a CUDA device is present";
  std::vector<float> x(32, 1.0f);
  std::vector<uint8_t> data(32);
  std::vector<uint8_t> scales(1);
  const Status st = Quantize(QuantFormat::kFp8Ue8m0x32, x.data(), 1, 32, data.data(), scales.data(),
                             Backend::kCuda);
  EXPECT_TRUE(st.IsUnavailable()) << st.ToString();
  EXPECT_TRUE(Dequantize(QuantFormat::kFp8Ue8m0x32, data.data(), scales.data(), 1, 32, x.data(),
                         Backend::kCuda)
                  .IsUnavailable());
  EXPECT_TRUE(
      RoundTrip(QuantFormat::kFp8Ue8m0x32, x.data(), 1, 32, Backend::kCuda).IsUnavailable());
  EXPECT_EQ(x, std::vector<float>(32, 1.0f));
}

TEST(QuantArgs, EmptyShapesAreNoOps) {
  float x = 1.0f;
  uint8_t d = 0x5a;
  uint8_t s = 0x5a;
  for (QuantFormat fmt : kFormats) {
    EXPECT_TRUE(Quantize(fmt, &x, 0, 32, &d, &s).ok());
    EXPECT_TRUE(Quantize(fmt, &x, 3, 0, &d, &s).ok());
    EXPECT_TRUE(Dequantize(fmt, &d, &s, 0, 32, &x).ok());
    EXPECT_TRUE(RoundTrip(fmt, &x, 0, 32).ok());
  }
  EXPECT_EQ(d, 0x5a);
  EXPECT_EQ(x, 1.0f);
}

// Quantises one block with backend b and returns {scale code, codes/bytes, dequantised}.
struct OneBlock {
  uint8_t scale = 0;
  std::vector<uint8_t> data;
  std::vector<float> out;
};

OneBlock Block(QuantFormat fmt, const std::vector<float>& x, Backend b) {
  OneBlock r;
  r.data.resize(DataBytes(fmt, x.size()));
  r.out.resize(x.size());
  EXPECT_TRUE(Quantize(fmt, x.data(), 1, x.size(), r.data.data(), &r.scale, b).ok());
  EXPECT_TRUE(Dequantize(fmt, r.data.data(), &r.scale, 1, x.size(), r.out.data(), b).ok());
  return r;
}

TEST(QuantRules, ScaleFloorsForZeroBlocks) {
  for (Backend b : kCpuBackends) {
    const OneBlock e4m3 = Block(QuantFormat::kFp4E4M3x16, std::vector<float>(16, -0.0f), b);
    EXPECT_EQ(e4m3.scale, 0x01);  // 6*2^-9 / 6 = 2^-9, the smallest e4m3 subnormal
    EXPECT_EQ(e4m3.data, std::vector<uint8_t>(8, 0x88));  // signed zeros kept
    const OneBlock fp4 = Block(QuantFormat::kFp4Ue8m0x32, std::vector<float>(32, 0.0f), b);
    EXPECT_EQ(fp4.scale, 1);  // 2^-126
    const OneBlock fp8 = Block(QuantFormat::kFp8Ue8m0x32, std::vector<float>(32, 0.0f), b);
    EXPECT_EQ(fp8.scale, 1);
    EXPECT_EQ(fp8.out, std::vector<float>(32, 0.0f));
  }
}

TEST(QuantRules, Ue8m0CeilNeverClips) {
  for (Backend b : kCpuBackends) {
    // amax = 6.5 -> 6.5/6 > 1 -> s = 2 (ceil), so 6.5/2 = 3.25 -> 3 and nothing clips at 6
    std::vector<float> x(32, 0.0f);
    x[3] = 6.5f;
    x[4] = -6.5f;
    const OneBlock r = Block(QuantFormat::kFp4Ue8m0x32, x, b);
    EXPECT_EQ(r.scale, 128);
    EXPECT_EQ(r.out[3], 6.0f);
    EXPECT_EQ(r.out[4], -6.0f);
    // amax = 6 exactly -> s = 1
    x[3] = 6.0f;
    x[4] = 0.0f;
    EXPECT_EQ(Block(QuantFormat::kFp4Ue8m0x32, x, b).scale, 127);
    // FP8: amax 449 -> 449/448 > 1 -> s = 2; 449/2 = 224.5 -> 224
    std::vector<float> y(32, 1.0f);
    y[0] = 449.0f;
    const OneBlock f = Block(QuantFormat::kFp8Ue8m0x32, y, b);
    EXPECT_EQ(f.scale, 128);
    EXPECT_EQ(f.out[0], 448.0f);
    EXPECT_EQ(f.out[1], 1.0f);
  }
}

TEST(QuantRules, E4M3ScaleTieClampsAtSix) {
  // amax/6 = 1.0625 is a tie between e4m3 1.0 and 1.125 -> 1.0, so 6.375/1 clamps to 6.
  for (Backend b : kCpuBackends) {
    std::vector<float> x(16, 0.5f);
    x[7] = 6.375f;
    const OneBlock r = Block(QuantFormat::kFp4E4M3x16, x, b);
    EXPECT_EQ(r.scale, 0x38);  // 1.0
    EXPECT_EQ(r.out[7], 6.0f);
    EXPECT_EQ(r.out[0], 0.5f);
  }
}

TEST(QuantRules, NanPoisonsItsBlockOnlyAndInfSaturates) {
  for (Backend b : kCpuBackends) {
    for (QuantFormat fmt : kFormats) {
      const size_t block = BlockElems(fmt);
      std::vector<float> x(2 * block, 1.0f);
      x[1] = kNan;
      x[block + 2] = -kInf;
      std::vector<uint8_t> data(DataBytes(fmt, x.size()));
      std::vector<uint8_t> scales(2);
      std::vector<float> out(x.size());
      ASSERT_TRUE(Quantize(fmt, x.data(), 1, x.size(), data.data(), scales.data(), b).ok());
      ASSERT_TRUE(Dequantize(fmt, data.data(), scales.data(), 1, x.size(), out.data(), b).ok());
      const bool e4m3_scale = fmt == QuantFormat::kFp4E4M3x16;
      EXPECT_EQ(scales[0], e4m3_scale ? 0x7f : 0xff);
      EXPECT_EQ(scales[1], e4m3_scale ? 0x7e : 0xfe);
      for (size_t i = 0; i < block; ++i) EXPECT_EQ(Bits(out[i]), 0x7fc00000u) << i;
      // the Inf block: Inf saturates to the largest code, the finite values keep their sign
      EXPECT_TRUE(out[block + 2] < 0 && std::isfinite(out[block + 2]) == e4m3_scale);
      EXPECT_FALSE(std::isnan(out[block + 3]));
    }
  }
}

// Test 2 of the model reference (section 5): the E2M1 grid survives an FP8 E4M3 round trip
// with a power-of-two scale, without loss.
TEST(QuantRules, E2M1GridSurvivesFp8RoundTripWithPow2Scale) {
  for (int k = -8; k <= 6; ++k) {  // every k that keeps 0.5*2^k..6*2^k inside e4m3's range
    for (int c = 0; c < 16; ++c) {
      const float v = std::ldexp(E2M1ToFloat(static_cast<uint8_t>(c)), k);
      EXPECT_EQ(Bits(E4M3ToFloat(FloatToE4M3(v))), Bits(v)) << "c=" << c << " k=" << k;
    }
  }
  // Through the block API: FP4-dequantised data (grid * 2^j) re-quantised as FP8 with its
  // UE8M0 power-of-two scale comes back bit for bit, for every CPU backend.
  for (Backend b : kCpuBackends) {
    for (int j = -100; j <= 100; j += 7) {
      std::vector<float> x(64);
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = std::ldexp(E2M1ToFloat(static_cast<uint8_t>(i % 16)), j);
      }
      std::vector<float> fp4 = x;
      ASSERT_TRUE(RoundTrip(QuantFormat::kFp4E4M3x16, fp4.data(), 4, 16, b).ok());
      std::vector<float> fp8 = x;
      ASSERT_TRUE(RoundTrip(QuantFormat::kFp8Ue8m0x32, fp8.data(), 2, 32, b).ok());
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(Bits(fp8[i]), Bits(x[i])) << "fp8 j=" << j << " i=" << i;
        if (j >= -9 && j <= 8) {  // the E4M3 scale 2^j is exact: FP4 is lossless too
          ASSERT_EQ(Bits(fp4[i]), Bits(x[i])) << "fp4 j=" << j << " i=" << i;
        }
      }
    }
  }
}

TEST(QuantRules, RoundTripErrorIsBoundedByTheScale) {
  // FP4 E4M3x16 on finite data: an element inside the grid's range is off by at most one
  // scale step (the widest gap, 4..6, is 2s); one beyond 6s (scale rounded down, or saturated
  // at 448) is clamped to 6s.
  const size_t blocks = 256;
  const std::vector<float> x0 = testing::MakeInput(16 * blocks, 99);
  std::vector<float> x;
  for (float v : x0) x.push_back(std::isfinite(v) ? v : 0.0f);
  std::vector<uint8_t> data(8 * blocks);
  std::vector<uint8_t> scales(blocks);
  ASSERT_TRUE(
      Quantize(QuantFormat::kFp4E4M3x16, x.data(), blocks, 16, data.data(), scales.data()).ok());
  std::vector<float> q = x;
  ASSERT_TRUE(RoundTrip(QuantFormat::kFp4E4M3x16, q.data(), blocks, 16).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    const double s = E4M3ToFloat(scales[i / 16]);
    const double ax = std::fabs(static_cast<double>(x[i]));
    const double bound = std::max(s, ax - 6 * s) * (1 + 1e-6);  // + rounding of x/s
    ASSERT_LE(std::fabs(static_cast<double>(x[i]) - q[i]), bound) << "x=" << x[i] << " s=" << s;
    ASSERT_EQ(std::signbit(q[i]), std::signbit(x[i])) << "x=" << x[i];
  }
}

}  // namespace
}  // namespace kvtier::kernels
