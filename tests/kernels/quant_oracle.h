// Test-side oracles for the kernels: an independent model of the codecs (nearest value by
// search over the decoded code tables, computed in double) and a generator of adversarial
// inputs (denormals, huge values, Inf/NaN, exact ties for every format).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"

namespace kvtier::kernels::testing {

inline uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

// Value of an e4m3 code (fn: bias 7, no Inf), written from the format definition.
inline double E4M3Value(uint8_t code) {
  const int mag = code & 0x7f;
  const int e = mag >> 3;
  const int m = mag & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

inline double E2M1Value(uint8_t code) {
  static const double kGrid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8) ? -kGrid[code & 7] : kGrid[code & 7];
}

// Nearest code among `count` non-negative increasing values; ties go to the even code;
// values above the last saturate to it.
inline uint8_t NearestCode(double a, const double* values, int count) {
  int lo = 0;
  int hi = count - 1;
  if (a >= values[hi]) return static_cast<uint8_t>(hi);  // saturate
  while (hi - lo > 1) {                                  // invariant: values[lo] <= a < values[hi]
    const int mid = (lo + hi) / 2;
    if (values[mid] <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const double dlo = a - values[lo];
  const double dhi = values[hi] - a;
  if (dlo < dhi) return static_cast<uint8_t>(lo);
  if (dhi < dlo) return static_cast<uint8_t>(hi);
  return static_cast<uint8_t>((lo % 2 == 0) ? lo : hi);
}

// The finite non-negative values of each format, by code (e4m3: 0x00..0x7e).
inline const double* E2M1Table() {
  static const double kTable[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return kTable;
}
inline const double* E4M3Table() {
  static const std::vector<double> table = [] {
    std::vector<double> t(0x7f);
    for (int c = 0; c < 0x7f; ++c) t[c] = E4M3Value(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

// NVIDIA host semantics, from the definitions: RNE, satfinite, NaN -> 7 / 0x7f, signed zero.
inline uint8_t OracleE2M1(float x) {
  if (std::isnan(x)) return 7;
  const uint8_t c = NearestCode(std::fabs(static_cast<double>(x)), E2M1Table(), 8);
  return static_cast<uint8_t>(c | (std::signbit(x) ? 8 : 0));
}

inline uint8_t OracleE4M3(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t c = NearestCode(std::fabs(static_cast<double>(x)), E4M3Table(), 0x7f);
  return static_cast<uint8_t>(c | (std::signbit(x) ? 0x80 : 0));
}

// ue8m0 code of 2^ceil(log2 r), r > 0 finite, via frexp; Inf/huge -> 0xfe, NaN -> 0xff.
inline uint8_t OracleUe8m0Ceil(float r) {
  if (std::isnan(r)) return 0xff;
  if (std::isinf(r)) return 0xfe;
  int e = 0;
  const double f = std::frexp(static_cast<double>(r), &e);  // r = f * 2^e, f in [0.5, 1)
  const int ceil_log2 = (f == 0.5) ? e - 1 : e;
  return static_cast<uint8_t>(std::clamp(ceil_log2 + 127, 0, 0xfe));
}

inline float OracleAmax(const float* x, int count) {
  float amax = 0.0f;
  for (int i = 0; i < count; ++i) {
    if (std::isnan(x[i])) return std::numeric_limits<float>::quiet_NaN();
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

// An independent model of Quantize for `blocks` flat blocks (the rules of kernels/quant.h).
inline void OracleQuantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data,
                           uint8_t* scales) {
  const int elems = static_cast<int>(BlockElems(fmt));
  for (size_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * elems;
    float amax = OracleAmax(xb, elems);
    float s = 0.0f;
    if (fmt == QuantFormat::kFp4E4M3x16) {
      if (!std::isnan(amax)) amax = std::max(amax, std::ldexp(6.0f, -9));
      scales[b] = OracleE4M3(amax / 6.0f);
      s = static_cast<float>(E4M3Value(scales[b]));
    } else {
      const float unit = fmt == QuantFormat::kFp8Ue8m0x32 ? 448.0f : 6.0f;
      if (!std::isnan(amax)) amax = std::max(amax, unit * std::ldexp(1.0f, -126));
      scales[b] = OracleUe8m0Ceil(amax / unit);
      s = std::ldexp(1.0f, scales[b] - 127);
    }
    if (std::isnan(amax)) s = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < elems; ++i) {
      const float y = xb[i] / s;
      if (fmt == QuantFormat::kFp8Ue8m0x32) {
        data[b * elems + i] = OracleE4M3(y);
      } else {
        const float c = std::isnan(y) ? y : std::clamp(y, -6.0f, 6.0f);
        const uint8_t code = OracleE2M1(c);
        uint8_t& byte = data[b * elems / 2 + i / 2];
        byte = (i % 2 == 0) ? code : static_cast<uint8_t>(byte | (code << 4));
      }
    }
  }
}

// Adversarial input: each group of 16 floats draws one scenario.
inline std::vector<float> MakeInput(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uni = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  auto sign = [&]() { return (rng() & 1) ? -1.0f : 1.0f; };
  static const float kE2M1Ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  static const float kGrid[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::vector<float> x(count);
  for (size_t g = 0; g < count; g += 16) {
    const size_t end = std::min(count, g + 16);
    const int scenario = pick(9);
    const int k = pick(40) - 20;
    const double base = uni(-140, 125);
    for (size_t i = g; i < end; ++i) {
      float v = 0.0f;
      switch (scenario) {
        case 0:  // log-uniform magnitudes over a block-local range (reaches subnormals)
          v = sign() * static_cast<float>(std::exp2(base + uni(-10, 0)));
          break;
        case 1:  // wide random magnitudes 1e-4 .. 1e3
          v = sign() * static_cast<float>(std::exp2(uni(-13.3, 10)));
          break;
        case 2:  // exact e2m1 grid * 2^k: lossless for FP4
          v = sign() * std::ldexp(kGrid[pick(8)], k);
          break;
        case 3:  // e2m1 ties at scale 2^k, anchored by 6*2^k so that s = 2^k
          v = (i == g) ? std::ldexp(6.0f, k) : sign() * std::ldexp(kE2M1Ties[pick(7)], k);
          break;
        case 4: {  // e4m3 ties at scale 2^k, anchored by 448*2^k
          const int c = pick(0x7e);
          const double mid =
              (E4M3Value(static_cast<uint8_t>(c)) + E4M3Value(static_cast<uint8_t>(c + 1))) / 2;
          v = (i == g) ? std::ldexp(448.0f, k) : sign() * static_cast<float>(std::ldexp(mid, k));
          break;
        }
        case 5: {  // special values
          static const uint32_t kSpecial[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu,
                                              0x00400000u, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u,
                                              0xff800000u, 0x3c800000u, 0x43e00000u, 0x43e80000u,
                                              0x43e80001u, 0x3a800000u, 0x3a000000u, 0x3a000001u};
          const int r = pick(24);
          if (r < 16) {
            v = FromBits(kSpecial[r]);
          } else if (r < 22) {
            v = FromBits(static_cast<uint32_t>(rng() & 0x807fffffu));  // subnormals
          } else {
            v = sign() * static_cast<float>(uni(-1e30, 1e30));
          }
          break;
        }
        case 6:  // signed zeros and values under every amax floor
          v = (rng() & 1) ? sign() * 0.0f
                          : sign() * std::ldexp(static_cast<float>(uni(1, 2)), -140);
          break;
        case 7:  // one NaN in an otherwise ordinary group (rare: 1 in 9 groups, 1 element)
          v = (i == g + 5) ? std::numeric_limits<float>::quiet_NaN()
                           : sign() * static_cast<float>(uni(0, 10));
          break;
        default:  // any bit pattern
          v = FromBits(static_cast<uint32_t>(rng()));
          break;
      }
      x[i] = v;
    }
  }
  return x;
}

// Random bytes, for decoding arbitrary codes and scales (NaN codes included).
inline std::vector<uint8_t> RandomBytes(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(count);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Index of the first differing element (bit pattern), or -1.
template <typename T>
long FirstMismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<long>(i);
  }
  return -1;
}

inline std::string FormatName(QuantFormat fmt) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      return "Fp4E4M3x16";
    case QuantFormat::kFp4Ue8m0x32:
      return "Fp4Ue8m0x32";
    case QuantFormat::kFp8Ue8m0x32:
      return "Fp8Ue8m0x32";
  }
  return "unknown";
}

inline std::string BackendName(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "Auto";
    case Backend::kReference:
      return "Reference";
    case Backend::kSimd:
      return "Simd";
    case Backend::kCuda:
      return "Cuda";
  }
  return "unknown";
}

}  // namespace kvtier::kernels::testing
