// The stored formats' block decoders as functions that also compile for a GPU, for kernels
// outside kernels/ that decode stored bytes inside their own loops (engine/device's attention
// reads the global KV's FP4 entries and the SWA ring's FP8 ones this way).
//
// They are the very functions the CPU reference, the AVX2 path's scales and kernels/cuda run
// (kernels/internal/scalar.h), so a decoded value is the same bits on every path, NaN included
// (the canonical quiet NaN).
#pragma once

#include "kernels/internal/scalar.h"

namespace kvtier::kernels {

// kFp4E4M3x16: 8 data bytes (two E2M1 codes each, the even element low) and one E4M3 scale
// byte -> 16 floats.
using internal::DequantizeBlockFp4E4M3;
// kFp8Ue8m0x32: 32 E4M3 data bytes and one UE8M0 scale byte -> 32 floats.
using internal::DequantizeBlockFp8Ue8m0;
inline constexpr int kFp4E4M3BlockElems = internal::kFp4E4M3BlockElems;
inline constexpr int kUe8m0BlockElems = internal::kUe8m0BlockElems;

}  // namespace kvtier::kernels
