// NVIDIA's reference vectors (../shared/vectors/fp4_e2m1.json, made with the host conversions
// of cuda_fp4.h / cuda_fp8.h): every scalar case through FloatToE2M1 / E2M1ToFloat, every block
// case through Quantize/Dequantize on every available backend. Label: vectors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "tests/cuda_required.h"
#include "tests/kernels/quant_oracle.h"
#include "tests/shared_dir.h"

namespace kvtier::kernels {
namespace {

uint32_t ParseHex32(const std::string& s) {
  return static_cast<uint32_t>(std::stoul(s, nullptr, 16));
}

std::vector<uint8_t> ParseHexBytes(const std::string& s) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoul(s.substr(i, 2), nullptr, 16)));
  }
  return out;
}

class Fp4VectorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = kvtier::testing::SharedPath("vectors/fp4_e2m1.json");
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << "cannot open " << path << " (set KVTIER_SHARED_DIR)";
    doc_ = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(doc_.is_discarded()) << "malformed JSON in " << path;
    ASSERT_TRUE(doc_.contains("cases") && doc_["cases"].is_array());
  }

  std::vector<nlohmann::json> Cases(const std::string& kind) const {
    std::vector<nlohmann::json> out;
    for (const auto& c : doc_["cases"]) {
      if (c.value("kind", "") == kind) out.push_back(c);
    }
    return out;
  }

  nlohmann::json doc_;
};

TEST_F(Fp4VectorsTest, ScalarCasesMatch) {
  const auto cases = Cases("scalar");
  ASSERT_GE(cases.size(), 300u);
  for (const auto& c : cases) {
    const uint32_t bits = ParseHex32(c.at("x_bits").get<std::string>());
    const float x = testing::FromBits(bits);
    const int code = c.at("code").get<int>();
    EXPECT_EQ(FloatToE2M1(x), code) << "x_bits=" << c.at("x_bits") << " tag=" << c.at("tag");
    const double decoded = c.at("decoded").get<double>();
    const float value = E2M1ToFloat(static_cast<uint8_t>(code));
    EXPECT_EQ(value, static_cast<float>(decoded)) << "code " << code;
    EXPECT_EQ(std::signbit(value), std::signbit(decoded)) << "code " << code;
  }
}

TEST_F(Fp4VectorsTest, BlockCasesMatchOnEveryBackend) {
  const auto cases = Cases("block");
  ASSERT_GE(cases.size(), 200u);
  std::vector<Backend> backends = {Backend::kReference, Backend::kSimd};
  if (BackendAvailable(Backend::kCuda)) {
    backends.push_back(Backend::kCuda);
  } else {
    EXPECT_FALSE(::kvtier::testing::CudaRequired()) << "KVTIER_REQUIRE_CUDA=1 but no CUDA backend";
  }
  for (Backend backend : backends) {
    SCOPED_TRACE(testing::BackendName(backend));
    for (const auto& c : cases) {
      SCOPED_TRACE(c.at("tag").get<std::string>());
      std::vector<float> x;
      for (const auto& b : c.at("x_bits"))
        x.push_back(testing::FromBits(ParseHex32(b.get<std::string>())));
      ASSERT_EQ(x.size(), 16u);
      uint8_t scale = 0;
      std::vector<uint8_t> data(8);
      ASSERT_TRUE(
          Quantize(QuantFormat::kFp4E4M3x16, x.data(), 1, 16, data.data(), &scale, backend).ok());
      EXPECT_EQ(scale, ParseHex32(c.at("scale_code").get<std::string>()));
      EXPECT_EQ(E4M3ToFloat(scale), static_cast<float>(c.at("scale").get<double>()));
      EXPECT_EQ(data, ParseHexBytes(c.at("data").get<std::string>()));
      std::vector<float> out(16);
      ASSERT_TRUE(
          Dequantize(QuantFormat::kFp4E4M3x16, data.data(), &scale, 1, 16, out.data(), backend)
              .ok());
      const auto& want = c.at("dequant");
      ASSERT_EQ(want.size(), 16u);
      for (size_t i = 0; i < 16; ++i) {
        const double w = want[i].get<double>();
        EXPECT_EQ(out[i], static_cast<float>(w)) << "element " << i;
        EXPECT_EQ(std::signbit(out[i]), std::signbit(w)) << "element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::kernels
