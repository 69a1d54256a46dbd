// Half-precision weights: F16 and BF16 tensors are widened to F32 exactly at load (every bit
// pattern checked against an ldexp reference), and hostile weight files (non-finite values,
// wrong dtypes or shapes, truncated data, offsets past the end) fail with an error that names
// the problem, never a crash.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/session.h"
#include "engine/weights.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::TinyConfig;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Reference decodings written from the formats' definitions (not from the code under test).
double RefHalf(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0x1f) return mant ? NAN : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exp - 25);
}
double RefBf16(uint16_t b) {
  const int sign = (b >> 15) ? -1 : 1, exp = (b >> 7) & 0xff, mant = b & 0x7f;
  if (exp == 0xff) return mant ? NAN : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(mant, -133);
  return sign * std::ldexp(128 + mant, exp - 134);
}

TEST(HalfWeights, EveryF16AndBf16BitPatternWidensExactly) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    for (bool half : {true, false}) {
      const double ref = half ? RefHalf(b) : RefBf16(b);
      const float got = half ? HalfBitsToFloat(b) : Bf16BitsToFloat(b);
      if (std::isnan(ref)) {
        ASSERT_TRUE(std::isnan(got)) << (half ? "f16 " : "bf16 ") << i;
      } else {
        // Every value of both formats is a binary32 value: the cast is exact, signs included.
        ASSERT_EQ(Bits(got), Bits(static_cast<float>(ref))) << (half ? "f16 " : "bf16 ") << i;
      }
    }
  }
  // Spot values: the smallest subnormals, the largest finite values, signed zero.
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(Bits(HalfBitsToFloat(0x8000)), 0x80000000u);
  EXPECT_EQ(Bf16BitsToFloat(0x0001), std::ldexp(1.0f, -133));
  EXPECT_EQ(Bf16BitsToFloat(0x3f80), 1.0f);
}

// A weights file for TinyConfig with every F32 parameter stored as F16, BF16 or F32 in turn
// (pseudo-random finite bit patterns, subnormals included), and the F32 file it must load as.
struct MixedFile {
  TensorFile half;  // as written
  TensorFile wide;  // the expected F32 values
  std::string f16_name, bf16_name, f32_name, engram_name;
};

MixedFile MakeMixed() {
  auto base = InitWeights(TinyConfig(), 3);
  EXPECT_TRUE(base.ok());
  MixedFile m;
  m.half = base->file;
  m.wide = base->file;
  uint32_t rng = 12345, k = 0;
  for (const WeightSpec& s : WeightSpecs(TinyConfig())) {
    if (s.dtype != "F32") {
      if (m.engram_name.empty() && s.dtype == "F8_E4M3") m.engram_name = s.name;
      continue;
    }
    const int kind = static_cast<int>(k++ % 3);  // 0 F16, 1 BF16, 2 F32
    if (kind == 2) {
      if (m.f32_name.empty()) m.f32_name = s.name;
      continue;
    }
    Tensor& h = m.half.tensors.at(s.name);
    Tensor& w = m.wide.tensors.at(s.name);
    const int64_t n = h.NumElements();
    h.dtype = kind == 0 ? "F16" : "BF16";
    h.bytes.assign(static_cast<size_t>(n) * 2, 0);
    for (int64_t i = 0; i < n; ++i) {
      rng = rng * 1664525u + 1013904223u;
      uint16_t b = static_cast<uint16_t>(rng >> 16);
      if (kind == 0 && ((b >> 10) & 0x1f) == 0x1f) b &= 0xbfff;  // keep it finite
      if (kind == 1 && ((b >> 7) & 0xff) == 0xff) b &= 0xbfff;
      h.bytes[2 * i] = static_cast<uint8_t>(b);
      h.bytes[2 * i + 1] = static_cast<uint8_t>(b >> 8);
      w.f32()[i] = static_cast<float>(kind == 0 ? RefHalf(b) : RefBf16(b));
    }
    if (kind == 0 && m.f16_name.empty()) m.f16_name = s.name;
    if (kind == 1 && m.bf16_name.empty()) m.bf16_name = s.name;
  }
  return m;
}

class HalfWeightsFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtier_dtype_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const TensorFile& f) {
    const std::string path = (dir_ / name).string();
    EXPECT_TRUE(WriteSafetensors(path, f).ok());
    return path;
  }
  std::string WriteBytes(const std::string& name, const std::vector<uint8_t>& b) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return path;
  }
  // A raw safetensors file: the header text as given (padded), then `data`.
  std::string WriteRaw(const std::string& name, std::string header,
                       const std::vector<uint8_t>& data) {
    while (header.size() % 8) header.push_back(' ');
    std::vector<uint8_t> b(8);
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(header.size() >> (8 * i));
    b.insert(b.end(), header.begin(), header.end());
    b.insert(b.end(), data.begin(), data.end());
    return WriteBytes(name, b);
  }
  std::filesystem::path dir_;
};

TEST_F(HalfWeightsFile, LoadsMixedF16Bf16F32AsTheEqualF32Weights) {
  const MixedFile m = MakeMixed();
  ASSERT_FALSE(m.f16_name.empty());
  ASSERT_FALSE(m.bf16_name.empty());
  auto loaded = LoadWeights(TinyConfig(), Write("mixed.safetensors", m.half));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  for (const auto& [name, t] : m.wide.tensors) {
    const Tensor* got = loaded->Find(name);
    ASSERT_NE(got, nullptr) << name;
    EXPECT_EQ(got->dtype, t.dtype) << name;
    EXPECT_EQ(got->shape, t.shape) << name;
    ASSERT_EQ(got->bytes, t.bytes) << name;
  }
  // The same model as the F32 file with these values: same fingerprint, so units interoperate.
  ModelWeights wide;
  wide.file = m.wide;
  EXPECT_EQ(WeightsDigest(*loaded), WeightsDigest(wide));
  auto reread = LoadWeights(TinyConfig(), Write("wide.safetensors", m.wide));
  ASSERT_TRUE(reread.ok());
  EXPECT_EQ(WeightsDigest(*reread), WeightsDigest(wide));
  // The strict check still wants F32 (the loader widened before it).
  EXPECT_TRUE(CheckWeights(TinyConfig(), m.half).IsInvalidArgument());
  EXPECT_TRUE(CheckWeights(TinyConfig(), loaded->file).ok());
}

TEST_F(HalfWeightsFile, HostileTensorsFailNamingTheTensor) {
  const MixedFile m = MakeMixed();
  struct Case {
    std::string what, tensor, expect;
    std::function<void(TensorFile*)> mutate;
  };
  auto set16 = [](Tensor* t, int64_t i, uint16_t v) {
    t->bytes[2 * i] = static_cast<uint8_t>(v);
    t->bytes[2 * i + 1] = static_cast<uint8_t>(v >> 8);
  };
  const std::vector<Case> cases = {
      {"f16 infinity", m.f16_name, "infinite",
       [&](TensorFile* f) { set16(&f->tensors.at(m.f16_name), 1, 0xfc00); }},
      {"f16 nan", m.f16_name, "NaN",
       [&](TensorFile* f) { set16(&f->tensors.at(m.f16_name), 0, 0x7e01); }},
      {"bf16 nan", m.bf16_name, "NaN",
       [&](TensorFile* f) { set16(&f->tensors.at(m.bf16_name), 2, 0x7fc0); }},
      {"bf16 infinity", m.bf16_name, "infinite",
       [&](TensorFile* f) { set16(&f->tensors.at(m.bf16_name), 0, 0x7f80); }},
      {"f32 nan", m.f32_name, "NaN",
       [&](TensorFile* f) { f->tensors.at(m.f32_name).f32()[0] = NAN; }},
      // FP8 codes that mean NaN used to load: only F32 specs were checked for finiteness.
      {"e4m3 nan", m.engram_name, "NaN",
       [&](TensorFile* f) { f->tensors.at(m.engram_name).bytes[3] = 0xff; }},
      {"e4m3 positive nan", m.engram_name, "NaN",
       [&](TensorFile* f) { f->tensors.at(m.engram_name).bytes[0] = 0x7f; }},
      {"e8m0 nan scale", m.engram_name + "_scale", "NaN",
       [&](TensorFile* f) { f->tensors.at(m.engram_name + "_scale").bytes[1] = 0xff; }},
      {"wrong dtype", m.f32_name, "dtype I32, expected F32",
       [&](TensorFile* f) { f->tensors.at(m.f32_name).dtype = "I32"; }},
      {"half for an fp8 table", m.engram_name, "expected F8_E4M3",
       [&](TensorFile* f) {
         Tensor& t = f->tensors.at(m.engram_name);
         t.dtype = "F16";
         t.bytes.resize(t.bytes.size() * 2);
       }},
      {"shape mismatch", m.f16_name, "shape",
       [&](TensorFile* f) {
         Tensor& t = f->tensors.at(m.f16_name);
         t.shape = {t.NumElements()};  // same bytes, other shape
       }},
      {"missing tensor", m.bf16_name, "missing",
       [&](TensorFile* f) { f->tensors.erase(m.bf16_name); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    TensorFile f = m.half;
    c.mutate(&f);
    auto w = LoadWeights(TinyConfig(), Write("bad.safetensors", f));
    ASSERT_FALSE(w.ok());
    EXPECT_TRUE(w.status().IsInvalidArgument()) << w.status().ToString();
    EXPECT_NE(w.status().message().find(c.tensor), std::string::npos) << w.status().ToString();
    EXPECT_NE(w.status().message().find(c.expect), std::string::npos) << w.status().ToString();
  }
}

TEST_F(HalfWeightsFile, MalformedFilesAreCorruptionNeverACrash) {
  const MixedFile m = MakeMixed();
  auto good = EncodeSafetensors(m.half);
  ASSERT_TRUE(good.ok());
  // Truncated data (every cut of the last 64 bytes), and a file shorter than its header.
  for (size_t cut = 1; cut <= 64; cut += 7) {
    std::vector<uint8_t> b(good->begin(), good->end() - static_cast<std::ptrdiff_t>(cut));
    auto w = LoadWeights(TinyConfig(), WriteBytes("cut.safetensors", b));
    EXPECT_TRUE(w.status().IsCorruption()) << cut << ": " << w.status().ToString();
  }
  std::vector<uint8_t> head(good->begin(), good->begin() + 100);
  EXPECT_TRUE(
      LoadWeights(TinyConfig(), WriteBytes("head.safetensors", head)).status().IsCorruption());
  const std::vector<uint8_t> four = {0, 0x3c, 0, 0x3c};  // two F16 ones
  struct Raw {
    std::string what, header;
  };
  for (const Raw& r : std::vector<Raw>{
           {"offsets past the end", R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,400]}})"},
           {"end before begin", R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[4,0]}})"},
           {"odd f16 byte count", R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,3]}})"},
           {"shape bigger than data", R"({"x":{"dtype":"BF16","shape":[4],"data_offsets":[0,4]}})"},
           {"overflowing shape",
            R"({"x":{"dtype":"F16","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})"},
           // 2^40 * 2^24 wraps a 64-bit count to 0, which matched the 0 bytes named.
           {"wrapping shape",
            R"({"x":{"dtype":"F16","shape":[1099511627776,16777216],"data_offsets":[0,0]}})"},
           {"negative dim", R"({"x":{"dtype":"F16","shape":[-2],"data_offsets":[0,4]}})"},
           {"unknown dtype", R"({"x":{"dtype":"F12","shape":[2],"data_offsets":[0,4]}})"},
           {"offsets not numbers", R"({"x":{"dtype":"F16","shape":[2],"data_offsets":"0,4"}})"},
       }) {
    SCOPED_TRACE(r.what);
    auto w = LoadWeights(TinyConfig(), WriteRaw("raw.safetensors", r.header, four));
    EXPECT_TRUE(w.status().IsCorruption()) << w.status().ToString();
  }
  // A well-formed file of the wrong model: names the first missing tensor.
  auto w = LoadWeights(TinyConfig(),
                       WriteRaw("other.safetensors",
                                R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", four));
  EXPECT_TRUE(w.status().IsInvalidArgument());
  EXPECT_NE(w.status().message().find("missing"), std::string::npos);
}

TEST(HalfWeights, ConvertToF32RejectsOtherDtypesAndWrongSizes) {
  Tensor t;
  t.dtype = "U8";
  t.shape = {2};
  t.bytes = {1, 2};
  EXPECT_TRUE(ConvertToF32("u", &t).IsInvalidArgument());
  t.dtype = "F16";
  t.bytes = {0, 0x3c, 0};  // 3 bytes for 2 elements
  Status s = ConvertToF32("h", &t);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("h"), std::string::npos);
  t.bytes = {0, 0x3c, 0, 0xc0};  // 1.0, -2.0
  ASSERT_TRUE(ConvertToF32("h", &t).ok());
  EXPECT_EQ(t.dtype, "F32");
  ASSERT_EQ(t.bytes.size(), 8u);
  EXPECT_EQ(t.f32()[0], 1.0f);
  EXPECT_EQ(t.f32()[1], -2.0f);
  ASSERT_TRUE(ConvertToF32("h", &t).ok());  // F32 stays as is
  EXPECT_EQ(t.f32()[1], -2.0f);
}

}  // namespace
}  // namespace kvtier::engine
