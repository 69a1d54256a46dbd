// ModelWeights: every parameter of the miniature model, by name, with its shape and dtype.
//
// WeightSpecs(config) is the one list of parameters (names follow the reference layout:
// "layers.<l>.attn.wq_a.weight", ...). InitWeights makes deterministic weights from a seed;
// each tensor has its own stream (seed, name), so the result does not depend on the order in
// which tensors are made. LoadWeights checks a safetensors file against the specs (every
// tensor present, same dtype and shape; extra tensors are ignored and not read). An F32 parameter
// may be stored as F16 or BF16: it is widened to F32 exactly at load (so the weights, and
// WeightsDigest, equal those of the F32 file with the same values); a non-finite element in
// any float parameter is an error naming the tensor, FP8 codes included (an F8_E4M3 code
// S.1111.111 or an F8_E8M0 scale 0xff is NaN).
//
// Initial scales (no trained weights can be downloaded here) keep activations in range and
// make gates behave like a trained network's: linear layers U(+-sqrt(3/fan_in)) (unit output
// variance on normalised input), output projections at half that, norms at 1, mHC scales
// 0.5/0.5/0.25 and comb bias +1 on the diagonal (near-identity but mixing, and Sinkhorn's 20
// iterations converge to 1e-5), router selection bias U(+-0.1), attention
// sinks U(+-0.5), Engram rows U(+-1) stored as FP8 e4m3 + ue8m0/32.
//
// Thread safety: immutable after construction; tensors may be read concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/safetensors.h"

namespace kvtier::engine {

enum class InitKind : uint8_t {
  kLinear,  // U(+-gain*sqrt(3/fan_in)), fan_in = shape.back()
  kOnes,
  kZeros,
  kUniform,     // U(+-gain)
  kHcBase,      // mHC bias: zeros, comb diagonal = gain
  kHcScale,     // mHC scales {gain, gain, gain/2} for pre, post, comb
  kEngramData,  // FP8 e4m3 codes of U(+-1) rows (made together with kEngramScale)
  kEngramScale,
};

struct WeightSpec {
  std::string name;
  std::string dtype;  // "F32", "F8_E4M3", "F8_E8M0"
  std::vector<int64_t> shape;
  InitKind init = InitKind::kLinear;
  float gain = 1.0f;
};

std::vector<WeightSpec> WeightSpecs(const EngineConfig& config);

// Rows of each Engram table (sum of that layer's primes). InvalidArgument on bad params.
StatusOr<std::vector<int64_t>> EngramTableRows(const EngineConfig& config);

struct ModelWeights {
  TensorFile file;
  // Returns the tensor or nullptr when absent.
  const Tensor* Find(const std::string& name) const;
  const float* F32(const std::string& name) const;  // nullptr when absent or not F32
};

// Upper bound on the bytes InitWeights makes (4 GiB: a miniature's deterministic weights, not a
// full model's). The per-field limits of EngineConfig::Validate still allow configs of
// terabytes; without this bound such a config ran the machine out of memory.
inline constexpr uint64_t kInitWeightsBytesMax = uint64_t{4} << 30;

// Bytes the parameters of `config` take as stored (F32: 4 per element, FP8 codes and scales:
// 1), WeightSpecs' sum; UINT64_MAX when that sum does not fit.
uint64_t WeightBytes(const EngineConfig& config);

// InvalidArgument for a config whose Engram tables cannot be sized or whose WeightBytes exceed
// kInitWeightsBytesMax (the message names both), before anything is allocated.
StatusOr<ModelWeights> InitWeights(const EngineConfig& config, uint64_t seed);
// Reads only the header and the spec'd tensors (at most WeightBytes(config) bytes of them), so
// what it allocates is bounded by the config, not by the file. IOError when unreadable or not
// a regular file; Corruption for a malformed file; InvalidArgument (naming the tensor) for a
// missing tensor, a wrong dtype or shape, or an infinity/NaN.
StatusOr<ModelWeights> LoadWeights(const EngineConfig& config, const std::string& path);
// Checks file against the specs exactly (dtype included: F32 specs need F32 tensors).
Status CheckWeights(const EngineConfig& config, const TensorFile& file);

}  // namespace kvtier::engine
