// What the packed matmul kernel files (matmul_avx2.cc, matmul_avx512.cc and the coded-panel ones,
// matmul_coded_avx2.cc, matmul_coded_avx512.cc) share:
//   RunPasses       how an f32 kernel file walks a block of rows [r0, r1) x panels [p0, p1) in
//                   passes of its micro-kernel: panels in groups of about kPanelGroupBytes (a
//                   multiple of 6 panels, so a group ends with a full pass), and inside a group
//                   row blocks of at most kMaxRows rows, each passing over every panel of the
//                   group before the next one starts, so the group's weights stay in L2 while all
//                   row blocks use them;
//   RunCodedPasses  how a coded-panel file walks one: row groups of at most kMaxRows outside,
//                   panels inside in passes of up to max_panels(rows), so a group's rows of X
//                   stay in L1 while it passes over the panels (a coded matrix of the miniature
//                   is a few tens of KiB);
//   StoreAvx2       the masked store of a 16-output panel row held in two 8-float vectors
//                   (files compiled with AVX2 only).
//
// Only for inclusion by those files. Everything here has internal linkage: each file compiles
// it with its own instruction set, and the linker must never let one file's copy stand in for
// the other's (the AVX-512 one would then run on a CPU without AVX-512).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "engine/matmul.h"

namespace kvtier::engine::internal {
namespace {

// Weight bytes a row block passes over before the next one starts (half of a 1 MiB L2).
constexpr int64_t kPanelGroupBytes = 256 << 10;

// kernel_for(mr, np): the micro-kernel of mr rows x np panels, with the signature
// (x, ldx, in, w, wstride, y, ldy, valid); max_panels(mr): the most panels a pass of mr rows
// takes (each a divisor of 6).
template <int kMaxRows, typename KernelFor, typename MaxPanelsFn>
void RunPasses(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1, float* y,
               KernelFor kernel_for, MaxPanelsFn max_panels) {
  constexpr int kP = kMatMulPanelOutputs;
  const int in = w.in(), out = w.out();
  const int64_t wstride = static_cast<int64_t>(in) * kP;
  const int64_t panel_bytes = std::max<int64_t>(1, wstride * static_cast<int64_t>(sizeof(float)));
  const int group = std::max<int>(6, static_cast<int>(kPanelGroupBytes / panel_bytes) / 6 * 6);
  for (int g0 = p0; g0 < p1; g0 += group) {
    const int g1 = std::min(p1, g0 + group);
    for (int r = r0; r < r1;) {
      const int mr = std::min(kMaxRows, r1 - r);
      const int np_max = max_panels(mr);
      for (int p = g0; p < g1;) {
        const int np = std::min(np_max, g1 - p);
        kernel_for(mr, np)(x + static_cast<int64_t>(r) * in, in, in, w.panel(p), wstride,
                           y + static_cast<int64_t>(r) * out + static_cast<int64_t>(p) * kP, out,
                           out - p * kP);
        p += np;
      }
      r += mr;
    }
  }
}

// kernel_for(mr, np): the coded micro-kernel of mr rows x np panels, with the signature
// (x, ldx, in, panel bytes, panel stride in bytes, y, ldy, valid); max_panels(mr): the most
// panels a pass of mr rows takes.
template <int kMaxRows, typename KernelFor, typename MaxPanelsFn>
void RunCodedPasses(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1, float* y,
                    KernelFor kernel_for, MaxPanelsFn max_panels) {
  constexpr int kP = kMatMulPanelOutputs;
  const int in = w.in(), out = w.out();
  const int64_t wstride = w.coded_panel_bytes();
  for (int r = r0; r < r1;) {
    const int mr = std::min(kMaxRows, r1 - r);
    for (int p = p0; p < p1;) {
      const int np = std::min(max_panels(mr), p1 - p);
      kernel_for(mr, np)(x + static_cast<int64_t>(r) * in, in, in, w.coded_panel(p), wstride,
                         y + static_cast<int64_t>(r) * out + static_cast<int64_t>(p) * kP, out,
                         out - p * kP);
      p += np;
    }
    r += mr;
  }
}

#ifdef __AVX2__
// Lanes [0, valid) set (valid in [0, 8]).
inline __m256i LaneMaskAvx2(int valid) {
  alignas(32) static const int32_t kTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                 0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kTable + 8 - valid));
}

// Stores the first min(valid, 16) of the 16 outputs lo:hi.
inline void StoreAvx2(float* dst, __m256 lo, __m256 hi, int valid) {
  if (valid >= kMatMulPanelOutputs) {
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
  } else if (valid >= 8) {
    _mm256_storeu_ps(dst, lo);
    _mm256_maskstore_ps(dst + 8, LaneMaskAvx2(valid - 8), hi);
  } else {
    _mm256_maskstore_ps(dst, LaneMaskAvx2(valid), lo);
  }
}
#endif

}  // namespace
}  // namespace kvtier::engine::internal
