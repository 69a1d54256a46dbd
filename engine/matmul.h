// The engine's CPU matrix multiply: packed weights and the kernels behind MatMulCpu (ops.h).
//
// Summation order (the contract every path keeps, CPU kernels and the CUDA kernel alike):
//   Y[t*out + o] = acc_in, with acc_0 = +0.0f and acc_{k+1} = fma(X[t*in + k], W[o*in + k], acc_k)
// for k = 0, 1, ..., in-1 in order, each fma rounded once (IEEE fused multiply-add). Nothing
// else enters an output, so a result depends only on its own row of X and row of W: never on
// how many rows a call has, how outputs are tiled, the vector width or the thread count.
//
// Kernels: kScalar (std::fma over the row-major W; the fallback, any CPU), kAvx2Fma
// (engine/matmul_avx2.cc: a register-tiled micro-kernel over a PackedMatrix, up to 6 rows x 16
// outputs or 1 row x 96 outputs per pass) and kAvx512Fma (engine/matmul_avx512.cc: the same
// over 512-bit registers, up to 8 rows x 48 or 4 rows x 96 outputs per pass, for passes of two
// or more rows; 1-row passes, which stream their weights from memory, take the AVX2 kernel).
// All produce the same bits (tests/engine engine_matmul_test.cc). The kernel is chosen once per
// process from cpuid and the environment variable KVTIER_ENGINE_MATMUL: "scalar" takes kScalar,
// "avx2" at most kAvx2Fma; otherwise the widest the CPU has (kAvx512Fma needs AVX-512F, AVX2
// and FMA; kAvx2Fma AVX2 and FMA).
//
// Block-scaled weights: a W whose rows are MXFP4 values (E2M1 codes times one UE8M0 scale per
// 32 inputs, e.g. kernels::RoundTrip(kFp4Ue8m0x32); the routed experts of a model with
// expert_format "mxfp4") or FP8 values (E4M3 codes times one UE8M0 scale per 32 inputs,
// kernels::RoundTrip(kFp8Ue8m0x32); the dense projections of a model with weight_format "fp8")
// may be packed as its codes and scales, 4.25 or 8.25 bits per weight instead of 32
// (PackedFormat::kMxfp4, kFp8). Their kernels (engine/matmul_coded_avx2.cc,
// matmul_coded_avx512.cc) decode each weight exactly
// (a code's value times a power of two) and feed it to the same fma chain, so the result is the
// same bits as the float W's; only the bytes read differ.
//
// Packed weights: MatMulCpu looks W up in a process-wide registry of packed copies
// (RegisterPackedWeight, done by the Engine at bind time); an unregistered W is packed into a
// per-call buffer (correct, slower). A registered W must not change while registered.
// Thread safety: every function may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "engine/thread_pool.h"
#include "kernels/quant.h"

namespace kvtier::engine {

// Outputs per panel of a PackedMatrix (two 8-float AVX2 vectors).
inline constexpr int kMatMulPanelOutputs = 16;

// Inputs per scale block of the block-scaled formats, and the layout of one block of a coded
// panel: 16 scale codes (one per output), then groups of inputs, each 16 little-endian 32-bit
// words, word j holding output j's codes of the group's inputs in order from the low bits
// (kMxfp4: 8 inputs of 4 bits per word, 4 groups; kFp8: 4 inputs of 8 bits, 8 groups). A vector
// load of a group gives each output lane its next codes: one shift per input picks each out.
inline constexpr int kCodedBlockInputs = 32;
inline constexpr int kMxfp4GroupInputs = 8;
inline constexpr int kFp8GroupInputs = 4;
inline constexpr int kMxfp4BlockBytes =
    kMatMulPanelOutputs + (kCodedBlockInputs / kMxfp4GroupInputs) * kMatMulPanelOutputs * 4;
inline constexpr int kFp8BlockBytes =
    kMatMulPanelOutputs + (kCodedBlockInputs / kFp8GroupInputs) * kMatMulPanelOutputs * 4;

// How a PackedMatrix holds W.
enum class PackedFormat : uint8_t {
  kF32,    // the floats
  kMxfp4,  // E2M1 codes and UE8M0 scales (see the file comment); in % 32 == 0
  kFp8,    // E4M3 codes and UE8M0 scales; in % 32 == 0
};
// The quantiser format (kernels/quant.h) whose codes a coded PackedFormat holds: kFp4Ue8m0x32
// for kMxfp4, kFp8Ue8m0x32 for kFp8 (kF32: not called).
kernels::QuantFormat CodedQuantFormat(PackedFormat format);

// W ([out x in], row-major) in panels of kMatMulPanelOutputs outputs. kF32: panel p holds, for
// k = 0..in-1, the 16 weights W[p*16 + j][k] (j = 0..15) contiguously. kMxfp4 / kFp8: panel p
// holds in / 32 blocks of kMxfp4BlockBytes / kFp8BlockBytes (layout above), block b covering
// inputs [32b, 32b + 32). Outputs past `out` in the last panel are zero. Each panel starts
// 64-byte aligned (kF32) or 16-byte aligned (coded).
class PackedMatrix {
 public:
  // Copies w. in >= 0, out >= 0. Asked for kMxfp4 (kFp8), it packs w so only when that is exact:
  // in % 32 == 0, every row block of 32 is a block of E2M1 (E4M3) values times a scale
  // 2^(s - 127) with s in [1, 254] ([0, 134]: the kernels' scale, 2^(s - 7), must be a normal
  // float), and decoding gives back w's bits; otherwise it holds kF32 (format() says which; the
  // product is the same bits either way).
  PackedMatrix(const float* w, int in, int out, PackedFormat format = PackedFormat::kF32);
  int in() const { return in_; }
  int out() const { return out_; }
  PackedFormat format() const { return format_; }
  int panels() const { return (out_ + kMatMulPanelOutputs - 1) / kMatMulPanelOutputs; }
  // kF32 only.
  const float* panel(int p) const {
    return reinterpret_cast<const float*>(data_.get()) + static_cast<int64_t>(p) * panel_elems();
  }
  // kMxfp4 and kFp8 only.
  const uint8_t* coded_panel(int p) const {
    return data_.get() + static_cast<int64_t>(p) * coded_panel_bytes();
  }
  int64_t coded_panel_bytes() const {
    return static_cast<int64_t>(in_ / kCodedBlockInputs) *
           (format_ == PackedFormat::kFp8 ? kFp8BlockBytes : kMxfp4BlockBytes);
  }
  size_t bytes() const;

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  int64_t panel_elems() const { return static_cast<int64_t>(in_) * kMatMulPanelOutputs; }
  // Fills data_ with w's kMxfp4 or kFp8 panels (format_ set); false (data_ untouched) when that
  // would not be exact.
  bool PackCoded(const float* w, PackedFormat format);
  void PackF32(const float* w);

  int in_, out_;
  PackedFormat format_;
  std::unique_ptr<uint8_t, Free> data_;
};

enum class MatMulKernel { kScalar, kAvx2Fma, kAvx512Fma };
const char* MatMulKernelName(MatMulKernel k);
// True when this CPU can run `k` (kScalar always).
bool MatMulKernelAvailable(MatMulKernel k);
// The kernel MatMulCpu uses (see file comment; decided on the first call).
MatMulKernel ActiveMatMulKernel();

// Packs w ([out x in]) in `format` and registers the copy under (w, in, out, format) until
// the last returned handle is dropped; registering a key again returns the existing copy.
// MatMulCpu with the same (w, in, out) and no copy of its own then uses the kF32 one.
std::shared_ptr<const PackedMatrix> RegisterPackedWeight(const float* w, int in, int out,
                                                         PackedFormat format = PackedFormat::kF32);
// The registered kF32 copy of (w, in, out), or null.
std::shared_ptr<const PackedMatrix> FindPackedWeight(const float* w, int in, int out);

// The packed copies of one model's weight matrices, found without the registry's lock: filled
// once at load, then only read (any number of threads). Add does nothing while the scalar
// kernel is active (it reads W as it is) or for a null w.
class PackedWeightSet {
 public:
  // format: as RegisterPackedWeight's (kMxfp4 / kFp8 for a W of MXFP4 / FP8 values).
  void Add(const float* w, int in, int out, PackedFormat format = PackedFormat::kF32);
  // The copy added for (w, in, out), or null (MatMul then packs or looks up itself).
  const PackedMatrix* Find(const float* w, int in, int out) const;
  // How many of the added copies hold `format` (a coded request may hold kF32: see
  // PackedMatrix).
  size_t Count(PackedFormat format) const;

 private:
  std::vector<std::shared_ptr<const PackedMatrix>> held_;  // registered while this set lives
  std::unordered_map<const float*, const PackedMatrix*> by_weight_;  // into held_
};

// Y = X W^T with kernel `k` (must be available). `packed` may be null for kScalar; otherwise
// it is the packing of w. Splits the work over `pool` (may be null) when it is large enough.
void MatMulWith(MatMulKernel k, ThreadPool* pool, const float* x, int rows, int in, const float* w,
                const PackedMatrix* packed, int out, float* y);

// One product of a MatMulManyWith call: Y = X W^T for X [rows x in].
struct MatMulPart {
  const float* x = nullptr;
  int rows = 0;
  int in = 0;
  const float* w = nullptr;
  const PackedMatrix* packed = nullptr;  // as MatMulWith's
  int out = 0;
  float* y = nullptr;
};
// Every part's product, each bit-identical to its own MatMulWith (an output is still one fma
// chain computed by one call). With few rows (decode) and enough work in all, the panels of
// all parts are split over `pool` in one parallel section, cut by multiply-adds, so products
// that share an input or are otherwise independent cost one hand-off instead of one each;
// otherwise each part runs as MatMulWith would. No part may write what another part reads.
void MatMulManyWith(MatMulKernel k, ThreadPool* pool, const MatMulPart* parts, int n_parts);

namespace internal {
// engine/matmul_avx2.cc (only called when the CPU has AVX2 and FMA): rows [r0, r1) of X times
// panels [p0, p1) of `w`, written to Y (ldy = w.out()).
void MatMulAvx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                     float* y);
// engine/matmul_avx512.cc (only called when the CPU has AVX-512F, AVX2 and FMA): the same
// arguments and results, bit for bit, over 512-bit registers.
void MatMulAvx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                       float* y);
// engine/matmul_coded_avx2.cc and matmul_coded_avx512.cc (the same CPU checks as above): the
// same arguments for a kMxfp4 (kFp8) `w`, and the same bits as the kernels above on its float W.
void MatMulMxfp4Avx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                          float* y);
void MatMulMxfp4Avx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                            float* y);
void MatMulFp8Avx2Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                        float* y);
void MatMulFp8Avx512Block(const float* x, int r0, int r1, const PackedMatrix& w, int p0, int p1,
                          float* y);
}  // namespace internal

}  // namespace kvtier::engine
