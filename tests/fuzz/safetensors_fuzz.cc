// libFuzzer target: the safetensors reader (engine/safetensors.h) on arbitrary bytes. A model
// file is user input (a download, a copy, a truncated write): the loader must refuse what is
// malformed with Corruption and never read outside the buffer or allocate from a length field
// it has not checked against the bytes it holds.
//
// Invariants, beyond no crash, no out-of-bounds read (ASan) and no undefined behaviour (UBSan):
//   - every decoded tensor is a known dtype whose shape times element size is its byte count;
//   - what decodes re-encodes, and the encoding decodes to the same tensors and metadata;
//   - ConvertToF32 of a decoded F16 / BF16 tensor either refuses (a non-finite element) or
//     gives an F32 tensor of the same shape.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_safetensors_fuzz
//   build/fuzz/tests/fuzz/kvtier_safetensors_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "engine/safetensors.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using namespace kvtier::engine;

void CheckTensor(const std::string& name, const Tensor& t) {
  const int width = DtypeSize(t.dtype);
  Require(width > 0);
  Require(t.NumElements() >= 0);
  Require(static_cast<uint64_t>(t.NumElements()) * static_cast<uint64_t>(width) == t.bytes.size());
  if (t.dtype != "F16" && t.dtype != "BF16") return;
  Tensor wide = t;
  if (!ConvertToF32(name, &wide).ok()) return;
  Require(wide.dtype == "F32");
  Require(wide.shape == t.shape);
  Require(wide.bytes.size() == t.bytes.size() * 2);
}

bool Same(const TensorFile& a, const TensorFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (auto ia = a.tensors.begin(), ib = b.tensors.begin(); ia != a.tensors.end(); ++ia, ++ib) {
    if (ia->first != ib->first || ia->second.dtype != ib->second.dtype ||
        ia->second.shape != ib->second.shape || ia->second.bytes != ib->second.bytes)
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto decoded = DecodeSafetensors(data, size);
  if (!decoded.ok()) return 0;
  for (const auto& [name, tensor] : decoded->tensors) CheckTensor(name, tensor);
  auto encoded = EncodeSafetensors(*decoded);
  Require(encoded.ok());
  auto again = DecodeSafetensors(encoded->data(), encoded->size());
  Require(again.ok());
  Require(Same(*decoded, *again));
  return 0;
}
