// A small safetensors reader/writer (the format of HF weights):
//   8 bytes  little-endian u64 N = header length
//   N bytes  JSON header {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
//            optional "__metadata__": {string: string}}; padded with spaces to 8-byte alignment
//   data     raw little-endian tensor bytes; offsets are relative to the start of this region.
//
// Supported dtypes: F32, F16, BF16, I32, U32, I64, U64, F64, U8, I8, F8_E4M3, F8_E8M0 (the
// engine's FP8 Engram rows and scales). Reading checks: header length limit, JSON validity,
// known dtypes, shape x element size equal to the byte range, ranges inside the file and not
// overlapping. Any violation is Corruption. F16/BF16 tensors are kept as read; ConvertToF32
// widens them (the weight loader does, engine/weights.h).
//
// Thread safety: TensorFile is a plain value; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvtier::engine {

// Upper bound on the JSON header (the format's own reference limit is 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;
// Default upper bound on the tensor bytes ReadSafetensors reads (4 GiB, a miniature's weights;
// the weight loader passes the bound its config needs instead, engine/weights.h).
inline constexpr uint64_t kSafetensorsReadBytesMax = uint64_t{4} << 30;

struct Tensor {
  std::string dtype;           // "F32", "U8", ...
  std::vector<int64_t> shape;  // empty: a scalar
  std::vector<uint8_t> bytes;  // raw little-endian data

  int64_t NumElements() const;
  // The data as floats; only for F32 (asserted by the caller through dtype).
  const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
};

// Bytes per element of a supported dtype, or 0 when unknown.
int DtypeSize(const std::string& dtype);

// Exact widening of an IEEE binary16 / bfloat16 bit pattern to binary32 (every value of both
// formats, subnormals included, is a binary32 value; infinities and NaNs map to themselves).
float HalfBitsToFloat(uint16_t bits);
float Bf16BitsToFloat(uint16_t bits);

// Replaces an F16 or BF16 tensor by the exactly widened F32 tensor (same shape); F32 is left
// as is. InvalidArgument naming `name` when the dtype is another one, the byte count does not
// match the shape, or an element is an infinity or a NaN (the first one's index is named).
Status ConvertToF32(const std::string& name, Tensor* tensor);

struct TensorFile {
  std::map<std::string, Tensor> tensors;  // sorted by name: the written order is deterministic
  std::map<std::string, std::string> metadata;
};

// Serialises to the safetensors byte format (deterministic for equal input).
StatusOr<std::vector<uint8_t>> EncodeSafetensors(const TensorFile& file);
StatusOr<TensorFile> DecodeSafetensors(const uint8_t* data, size_t size);

Status WriteSafetensors(const std::string& path, const TensorFile& file);

struct SafetensorsReadOptions {
  // Upper bound on the tensor bytes read (summed over the tensors read).
  uint64_t max_data_bytes = kSafetensorsReadBytesMax;
  // When not empty, only the tensors of these names are read; the others are checked in the
  // header (dtype, shape, range) and left out of the result.
  std::set<std::string> only;
};

// Reads the file at `path`, which must be a regular file, without reading more than the
// header (at most kMaxSafetensorsHeaderBytes) and the tensors asked for. Checks as
// DecodeSafetensors does. IOError when it cannot be opened or read or is not a regular file (a
// directory, /dev/zero, a pipe); Corruption for a malformed file; InvalidArgument, before any
// tensor is allocated, when the tensors to read take more than options.max_data_bytes.
StatusOr<TensorFile> ReadSafetensors(const std::string& path,
                                     const SafetensorsReadOptions& options = {});

}  // namespace kvtier::engine
