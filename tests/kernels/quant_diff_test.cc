// Differential test (ggml test-backend-ops style): every available backend against the
// scalar reference, over every valid row length up to kMaxN and 1-3 rows, on adversarial data,
// bit-exact on codes, scales and dequantised floats. The reference itself is checked against
// an independent model (quant_oracle.h) and NVIDIA's vectors (quant_vectors_test.cc).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/internal/backends.h"
#include "kernels/quant.h"
#include "tests/cuda_required.h"
#include "tests/kernels/quant_oracle.h"

namespace kvtier::kernels {
namespace {

using testing::BackendName;
using testing::FirstMismatch;
using testing::FormatName;
using testing::MakeInput;
using testing::RandomBytes;

constexpr size_t kMaxN = 4096;
constexpr QuantFormat kFormats[] = {QuantFormat::kFp4E4M3x16, QuantFormat::kFp4Ue8m0x32,
                                    QuantFormat::kFp8Ue8m0x32};

struct Quantized {
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
};

Quantized Quant(QuantFormat fmt, const std::vector<float>& x, size_t rows, size_t n,
                Backend backend) {
  Quantized q{std::vector<uint8_t>(rows * DataBytes(fmt, n), 0xAA),
              std::vector<uint8_t>(rows * ScaleBytes(fmt, n), 0xAA)};
  const Status st = Quantize(fmt, x.data(), rows, n, q.data.data(), q.scales.data(), backend);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return q;
}

std::vector<float> Dequant(QuantFormat fmt, const Quantized& q, size_t rows, size_t n,
                           Backend backend) {
  std::vector<float> out(rows * n, -1.0f);
  const Status st = Dequantize(fmt, q.data.data(), q.scales.data(), rows, n, out.data(), backend);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// Every valid n up to kMaxN, with 1..3 rows.
template <typename Fn>
void ForEachShape(QuantFormat fmt, Fn fn) {
  const size_t block = BlockElems(fmt);
  for (size_t n = block; n <= kMaxN; n += block) {
    const size_t rows = 1 + (n / block) % 3;
    fn(rows, n);
    if (::testing::Test::HasFailure()) return;  // one failing shape is enough to report
  }
}

class QuantDiffTest : public ::testing::TestWithParam<std::tuple<Backend, QuantFormat>> {
 protected:
  void SetUp() override {
    backend_ = std::get<0>(GetParam());
    fmt_ = std::get<1>(GetParam());
    if (backend_ == Backend::kSimd && !BackendAvailable(Backend::kSimd)) {
      GTEST_SKIP() << "this CPU has no AVX2: kSimd runs the reference itself";
    }
    if (backend_ == Backend::kCuda && !BackendAvailable(Backend::kCuda)) {
      float x[32] = {};
      uint8_t d[32];
      uint8_t s[2];
      const Status st = Quantize(fmt_, x, 1, 32, d, s, Backend::kCuda);
      if (::kvtier::testing::CudaRequired())
        GTEST_FAIL() << "KVTIER_REQUIRE_CUDA=1 but " << st.ToString();
      GTEST_SKIP() << "CUDA backend unavailable: " << st.ToString();
    }
  }

  Backend backend_ = Backend::kReference;
  QuantFormat fmt_ = QuantFormat::kFp4E4M3x16;
};

TEST_P(QuantDiffTest, QuantizeAndDequantizeMatchReferenceBitExact) {
  ForEachShape(fmt_, [&](size_t rows, size_t n) {
    const std::vector<float> x = MakeInput(rows * n, n * 7919 + rows);
    const Quantized ref = Quant(fmt_, x, rows, n, Backend::kReference);
    const Quantized got = Quant(fmt_, x, rows, n, backend_);
    ASSERT_EQ(FirstMismatch(ref.scales, got.scales), -1) << "scales, rows=" << rows << " n=" << n;
    ASSERT_EQ(FirstMismatch(ref.data, got.data), -1) << "codes, rows=" << rows << " n=" << n;
    const std::vector<float> ref_out = Dequant(fmt_, ref, rows, n, Backend::kReference);
    const std::vector<float> got_out = Dequant(fmt_, ref, rows, n, backend_);
    const long bad = FirstMismatch(ref_out, got_out);
    ASSERT_EQ(bad, -1) << "dequant, rows=" << rows << " n=" << n << " ref=" << ref_out[bad]
                       << " got=" << got_out[bad];
  });
}

TEST_P(QuantDiffTest, DequantizeArbitraryBytesMatchesReference) {
  ForEachShape(fmt_, [&](size_t rows, size_t n) {
    Quantized q{RandomBytes(rows * DataBytes(fmt_, n), n),
                RandomBytes(rows * ScaleBytes(fmt_, n), n + 1)};
    const std::vector<float> ref_out = Dequant(fmt_, q, rows, n, Backend::kReference);
    const std::vector<float> got_out = Dequant(fmt_, q, rows, n, backend_);
    const long bad = FirstMismatch(ref_out, got_out);
    ASSERT_EQ(bad, -1) << "rows=" << rows << " n=" << n << " ref=" << ref_out[bad]
                       << " got=" << got_out[bad];
  });
}

TEST_P(QuantDiffTest, RoundTripMatchesReference) {
  const size_t rows = 5;
  const size_t n = 1024;
  std::vector<float> ref = MakeInput(rows * n, 42);
  std::vector<float> got = ref;
  ASSERT_TRUE(RoundTrip(fmt_, ref.data(), rows, n, Backend::kReference).ok());
  ASSERT_TRUE(RoundTrip(fmt_, got.data(), rows, n, backend_).ok());
  EXPECT_EQ(FirstMismatch(ref, got), -1);
}

TEST_P(QuantDiffTest, UnalignedBuffersMatchReference) {
  const size_t rows = 3;
  const size_t n = 96;
  const size_t data_bytes = rows * DataBytes(fmt_, n);
  const size_t scale_bytes = rows * ScaleBytes(fmt_, n);
  const std::vector<float> x = MakeInput(rows * n + 1, 77);
  // outputs at odd byte offsets, input one float past an aligned start
  std::vector<uint8_t> ref_data(data_bytes + 1), got_data(data_bytes + 1);
  std::vector<uint8_t> ref_scales(scale_bytes + 3), got_scales(scale_bytes + 3);
  ASSERT_TRUE(Quantize(fmt_, x.data() + 1, rows, n, ref_data.data() + 1, ref_scales.data() + 3,
                       Backend::kReference)
                  .ok());
  ASSERT_TRUE(
      Quantize(fmt_, x.data() + 1, rows, n, got_data.data() + 1, got_scales.data() + 3, backend_)
          .ok());
  EXPECT_EQ(FirstMismatch(ref_data, got_data), -1);
  EXPECT_EQ(FirstMismatch(ref_scales, got_scales), -1);
  std::vector<float> ref_out(rows * n + 1), got_out(rows * n + 1);
  ASSERT_TRUE(Dequantize(fmt_, ref_data.data() + 1, ref_scales.data() + 3, rows, n,
                         ref_out.data() + 1, Backend::kReference)
                  .ok());
  ASSERT_TRUE(Dequantize(fmt_, ref_data.data() + 1, ref_scales.data() + 3, rows, n,
                         got_out.data() + 1, backend_)
                  .ok());
  EXPECT_EQ(FirstMismatch(ref_out, got_out), -1);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, QuantDiffTest,
                         ::testing::Combine(::testing::Values(Backend::kSimd, Backend::kCuda,
                                                              Backend::kAuto),
                                            ::testing::ValuesIn(kFormats)),
                         [](const ::testing::TestParamInfo<QuantDiffTest::ParamType>& info) {
                           return BackendName(std::get<0>(info.param)) + "_" +
                                  FormatName(std::get<1>(info.param));
                         });

// The reference against an independent model of the rules in kernels/quant.h.
TEST(QuantReference, MatchesIndependentModel) {
  for (QuantFormat fmt : kFormats) {
    SCOPED_TRACE(FormatName(fmt));
    const size_t block = BlockElems(fmt);
    const size_t blocks = 1 << 14;
    const std::vector<float> x = MakeInput(blocks * block, 1234 + static_cast<int>(fmt));
    std::vector<uint8_t> want_data(blocks * DataBytes(fmt, block));
    std::vector<uint8_t> want_scales(blocks);
    testing::OracleQuantize(fmt, x.data(), blocks, want_data.data(), want_scales.data());
    const Quantized got = Quant(fmt, x, blocks, block, Backend::kReference);
    const long bad_scale = FirstMismatch(want_scales, got.scales);
    ASSERT_EQ(bad_scale, -1) << "block " << bad_scale << " want " << int(want_scales[bad_scale])
                             << " got " << int(got.scales[bad_scale]);
    const long bad = FirstMismatch(want_data, got.data);
    ASSERT_EQ(bad, -1) << "byte " << bad << " want " << int(want_data[bad]) << " got "
                       << int(got.data[bad]);
  }
}

// The AVX2 element conversions against the scalar ones on a sweep of all bit patterns
// (every 4099th, plus the neighbourhood of every e4m3 value and e2m1 tie).
TEST(QuantAvx2, ConversionsMatchScalarOnSweep) {
  if (!internal::Avx2Supported()) GTEST_SKIP() << "this CPU has no AVX2";
  std::vector<float> x;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) x.push_back(testing::FromBits(uint32_t(u)));
  for (int c = 0; c < 0x7f; ++c) {
    const float v = static_cast<float>(testing::E4M3Value(static_cast<uint8_t>(c)));
    const float next = static_cast<float>(testing::E4M3Value(static_cast<uint8_t>(c + 1)));
    for (float anchor : {v, (v + next) / 2}) {
      for (int d = -3; d <= 3; ++d) {
        const float y = testing::FromBits(testing::Bits(anchor) + d);
        x.push_back(y);
        x.push_back(-y);
      }
    }
  }
  for (float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f}) {
    for (int d = -3; d <= 3; ++d) x.push_back(testing::FromBits(testing::Bits(t) + d));
  }
  std::vector<uint8_t> simd(x.size());
  internal::Avx2FloatToE2M1(x.data(), x.size(), simd.data());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(simd[i], FloatToE2M1(x[i])) << "e2m1 x_bits=0x" << std::hex << testing::Bits(x[i]);
  }
  internal::Avx2FloatToE4M3(x.data(), x.size(), simd.data());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(simd[i], FloatToE4M3(x[i])) << "e4m3 x_bits=0x" << std::hex << testing::Bits(x[i]);
  }
}

}  // namespace
}  // namespace kvtier::kernels
