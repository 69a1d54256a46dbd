// The scalar CPU reference: one block at a time through kernels/internal/scalar.h, the same
// code the CUDA kernels run. Every other path is tested against this one bit for bit.
#include "kernels/internal/backends.h"
#include "kernels/internal/scalar.h"

namespace kvtier::kernels::internal {

void RefQuantize(QuantFormat fmt, const float* x, size_t blocks, uint8_t* data, uint8_t* scales) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      for (size_t b = 0; b < blocks; ++b) {
        QuantizeBlockFp4E4M3(x + b * 16, data + b * 8, scales + b);
      }
      return;
    case QuantFormat::kFp4Ue8m0x32:
      for (size_t b = 0; b < blocks; ++b) {
        QuantizeBlockFp4Ue8m0(x + b * 32, data + b * 16, scales + b);
      }
      return;
    case QuantFormat::kFp8Ue8m0x32:
      for (size_t b = 0; b < blocks; ++b) {
        QuantizeBlockFp8Ue8m0(x + b * 32, data + b * 32, scales + b);
      }
      return;
  }
}

void RefDequantize(QuantFormat fmt, const uint8_t* data, const uint8_t* scales, size_t blocks,
                   float* out) {
  switch (fmt) {
    case QuantFormat::kFp4E4M3x16:
      for (size_t b = 0; b < blocks; ++b) {
        DequantizeBlockFp4E4M3(data + b * 8, scales[b], out + b * 16);
      }
      return;
    case QuantFormat::kFp4Ue8m0x32:
      for (size_t b = 0; b < blocks; ++b) {
        DequantizeBlockFp4Ue8m0(data + b * 16, scales[b], out + b * 32);
      }
      return;
    case QuantFormat::kFp8Ue8m0x32:
      for (size_t b = 0; b < blocks; ++b) {
        DequantizeBlockFp8Ue8m0(data + b * 32, scales[b], out + b * 32);
      }
      return;
  }
}

}  // namespace kvtier::kernels::internal
