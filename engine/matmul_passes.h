// How a packed matmul kernel file (matmul_avx2.cc, matmul_avx512.cc) walks a block of rows
// [r0, r1) x panels [p0, p1) in passes of its micro-kernel: panels in groups of about
// kPanelGroupBytes (a multiple of 6 panels, so a group ends with a full pass), and inside a
// group row blocks of at most kMaxRows rows, each passing over every panel of the group before
// the next one starts, so the group's weights stay in L2 while all row blocks use them.
//
// Only for inclusion by those files. Everything here has internal linkage: each file compiles
// it with its own instruction set, and the linker must never let one file's copy stand in for
// the other's (the AVX-512 one would then run on a CPU without AVX-512).
#pragma once

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

}  // namespace
}  // namespace kvtier::engine::internal
