#include "engine/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/quant.h"

namespace kvtier::engine {

namespace {

constexpr size_t kPanelAlignBytes = 64;
// Rows per AVX2 micro-kernel pass (matmul_avx2.cc); row blocks handed to threads are multiples.
constexpr int kRowsPerBlock = 6;
// Below this many multiply-adds (64 KiB of weights) a call runs on the caller alone: handing
// work to a spinning worker costs about a microsecond, a decode GEMV of this size about six.
constexpr int64_t kParallelMinWork = int64_t{1} << 14;
// Up to this many multiply-adds a call is cut into one chunk per thread: a decode-sized product
// takes a few microseconds, and each extra chunk is one more claim on a cache line the threads
// pass between them (and a shorter run for the micro-kernel). Larger calls keep the pool's
// default, so a late worker holds the caller up for a smaller piece.
constexpr int64_t kOneChunkMaxWork = int64_t{1} << 19;

}  // namespace

void PackedMatrix::Free::operator()(uint8_t* p) const {
  ::operator delete(p, std::align_val_t(kPanelAlignBytes));
}

kernels::QuantFormat CodedQuantFormat(PackedFormat format) {
  return format == PackedFormat::kFp8 ? kernels::QuantFormat::kFp8Ue8m0x32
                                      : kernels::QuantFormat::kFp4Ue8m0x32;
}

PackedMatrix::PackedMatrix(const float* w, int in, int out, PackedFormat format)
    : in_(in), out_(out), format_(PackedFormat::kF32) {
  if (format != PackedFormat::kF32 && PackCoded(w, format)) return;
  PackF32(w);
}

size_t PackedMatrix::bytes() const {
  if (format_ != PackedFormat::kF32) return static_cast<size_t>(panels() * coded_panel_bytes());
  return static_cast<size_t>(panels()) * panel_elems() * sizeof(float);
}

void PackedMatrix::PackF32(const float* w) {
  const size_t n = static_cast<size_t>(panels()) * panel_elems();
  data_.reset(static_cast<uint8_t*>(
      ::operator new(std::max<size_t>(n, 1) * sizeof(float), std::align_val_t(kPanelAlignBytes))));
  for (int p = 0; p < panels(); ++p) {
    float* dst = reinterpret_cast<float*>(data_.get()) + p * panel_elems();
    for (int j = 0; j < kMatMulPanelOutputs; ++j) {
      const int o = p * kMatMulPanelOutputs + j;
      const float* src = w + static_cast<int64_t>(o) * in_;
      for (int k = 0; k < in_; ++k)
        dst[static_cast<int64_t>(k) * kMatMulPanelOutputs + j] = o < out_ ? src[k] : 0.0f;
    }
  }
}

bool PackedMatrix::PackCoded(const float* w, PackedFormat format) {
  if (in_ <= 0 || in_ % kCodedBlockInputs != 0 || out_ <= 0) return false;
  const bool fp8 = format == PackedFormat::kFp8;
  const kernels::QuantFormat qf = CodedQuantFormat(format);
  // The kernels' scale is 2^(s - 127) (MXFP4) or 2^(s - 7) (FP8: the E4M3 code's bits placed
  // in a float's exponent and mantissa read 2^-120 of its value): both must be normal floats,
  // s in [1, 254] and [0, 134].
  const int s_min = fp8 ? 0 : 1, s_max = fp8 ? 134 : 254;
  const int code_bits = fp8 ? 8 : 4;
  const int group = fp8 ? kFp8GroupInputs : kMxfp4GroupInputs;
  const int blocks = in_ / kCodedBlockInputs;
  // Every row's codes and scales, checked to decode to w's bits with usable scales.
  const size_t row_codes = kernels::DataBytes(qf, in_);
  std::vector<uint8_t> codes(static_cast<size_t>(out_) * row_codes);
  std::vector<uint8_t> scales(static_cast<size_t>(out_) * blocks);
  std::vector<float> back(static_cast<size_t>(in_));
  for (int o = 0; o < out_; ++o) {
    const float* row = w + static_cast<int64_t>(o) * in_;
    uint8_t* c = codes.data() + static_cast<size_t>(o) * row_codes;
    uint8_t* s = scales.data() + static_cast<size_t>(o) * blocks;
    if (!kernels::Quantize(qf, row, 1, in_, c, s, kernels::Backend::kAuto).ok() ||
        !kernels::Dequantize(qf, c, s, 1, in_, back.data(), kernels::Backend::kAuto).ok() ||
        std::memcmp(back.data(), row, static_cast<size_t>(in_) * sizeof(float)) != 0) {
      return false;
    }
    for (int b = 0; b < blocks; ++b) {
      if (s[b] < s_min || s[b] > s_max) return false;  // 0xff (NaN) included
    }
    for (size_t i = 0; fp8 && i < row_codes; ++i) {
      if ((c[i] & 0x7f) == 0x7f) return false;  // E4M3 NaN: the kernels would read 480
    }
  }
  format_ = format;
  const size_t block_bytes = fp8 ? kFp8BlockBytes : kMxfp4BlockBytes;
  const size_t panel_bytes = static_cast<size_t>(blocks) * block_bytes;
  data_.reset(static_cast<uint8_t*>(::operator new(std::max<size_t>(panels() * panel_bytes, 1),
                                                   std::align_val_t(kPanelAlignBytes))));
  for (int p = 0; p < panels(); ++p) {
    for (int b = 0; b < blocks; ++b) {
      uint8_t* dst = data_.get() + p * panel_bytes + static_cast<size_t>(b) * block_bytes;
      for (int j = 0; j < kMatMulPanelOutputs; ++j) {
        const int o = p * kMatMulPanelOutputs + j;
        dst[j] = o < out_ ? scales[static_cast<size_t>(o) * blocks + b] : 127;  // pad: 2^0
        for (int g = 0; g < kCodedBlockInputs / group; ++g) {
          uint32_t word = 0;  // padding outputs: codes 0, which decode to +0
          for (int t = 0; o < out_ && t < group; ++t) {
            // Input k's code: byte k of the row (FP8), or the low (even k) or high nibble of
            // byte k / 2 (MXFP4).
            const int k = b * kCodedBlockInputs + g * group + t;
            const uint8_t* row_c = codes.data() + static_cast<size_t>(o) * row_codes;
            const uint32_t code = fp8 ? row_c[k] : (row_c[k / 2] >> (4 * (k & 1))) & 0xf;
            word |= code << (code_bits * t);
          }
          std::memcpy(dst + kMatMulPanelOutputs + (g * kMatMulPanelOutputs + j) * 4, &word, 4);
        }
      }
    }
  }
  return true;
}

const char* MatMulKernelName(MatMulKernel k) {
  switch (k) {
    case MatMulKernel::kAvx2Fma:
      return "avx2_fma";
    case MatMulKernel::kAvx512Fma:
      return "avx512_fma";
    default:
      return "scalar";
  }
}

// Defined here, not in matmul_avx2.cc, so that no AVX2 instruction runs before the check.
bool MatMulKernelAvailable(MatMulKernel k) {
  if (k == MatMulKernel::kScalar) return true;
  static const bool avx2_fma = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0;
  }();
  static const bool avx512 = avx2_fma && __builtin_cpu_supports("avx512f") != 0;
  return k == MatMulKernel::kAvx2Fma ? avx2_fma : avx512;
}

MatMulKernel ActiveMatMulKernel() {
  static const MatMulKernel k = [] {
    const char* env = std::getenv("KVTIER_ENGINE_MATMUL");
    const std::string_view v = env != nullptr ? env : "";
    if (v == "scalar") return MatMulKernel::kScalar;
    if (v != "avx2" && MatMulKernelAvailable(MatMulKernel::kAvx512Fma)) {
      return MatMulKernel::kAvx512Fma;
    }
    return MatMulKernelAvailable(MatMulKernel::kAvx2Fma) ? MatMulKernel::kAvx2Fma
                                                         : MatMulKernel::kScalar;
  }();
  return k;
}

namespace {

struct Key {
  const float* w;
  int in, out;
  PackedFormat format;
  bool operator==(const Key& o) const {
    return w == o.w && in == o.in && out == o.out && format == o.format;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.w) ^ (static_cast<size_t>(k.in) * 1000003u) ^
           static_cast<size_t>(k.out) ^ (static_cast<size_t>(k.format) << 40);
  }
};

struct Registry {
  std::mutex mu;
  std::unordered_map<Key, std::weak_ptr<const PackedMatrix>, KeyHash> map;
};

Registry& GetRegistry() {
  static Registry* r = new Registry();  // never destroyed: handles may outlive statics
  return *r;
}

// One row range x output range with the scalar kernel (the contract's loop, literally).
void ScalarBlock(const float* x, int r0, int r1, int in, const float* w, int o0, int o1, int out,
                 float* y) {
  for (int t = r0; t < r1; ++t) {
    const float* xt = x + static_cast<int64_t>(t) * in;
    for (int o = o0; o < o1; ++o) {
      const float* wo = w + static_cast<int64_t>(o) * in;
      float acc = 0.0f;
      for (int k = 0; k < in; ++k) acc = std::fma(xt[k], wo[k], acc);
      y[static_cast<int64_t>(t) * out + o] = acc;
    }
  }
}

// Rows [r0, r1) x panels [p0, p1) with a packed kernel (kAvx2Fma or kAvx512Fma). A 1-row
// pass reads each weight once and is bound by reading them, not by the multiply-adds (a decode
// GEMV streams them from memory): it stays on the AVX2 kernel, the same bits either way.
void PackedBlock(MatMulKernel k, const float* x, int r0, int r1, const PackedMatrix& w, int p0,
                 int p1, float* y) {
  // Coded weights: decoding is arithmetic, so the widest kernel for every row count.
  if (w.format() != PackedFormat::kF32) {
    const bool fp8 = w.format() == PackedFormat::kFp8;
    const auto block =
        k == MatMulKernel::kAvx512Fma
            ? (fp8 ? internal::MatMulFp8Avx512Block : internal::MatMulMxfp4Avx512Block)
            : (fp8 ? internal::MatMulFp8Avx2Block : internal::MatMulMxfp4Avx2Block);
    return block(x, r0, r1, w, p0, p1, y);
  }
  if (k == MatMulKernel::kAvx512Fma && r1 - r0 >= 2) {
    internal::MatMulAvx512Block(x, r0, r1, w, p0, p1, y);
  } else {
    internal::MatMulAvx2Block(x, r0, r1, w, p0, p1, y);
  }
}

}  // namespace

void PackedWeightSet::Add(const float* w, int in, int out, PackedFormat format) {
  if (w == nullptr || ActiveMatMulKernel() == MatMulKernel::kScalar) return;
  held_.push_back(RegisterPackedWeight(w, in, out, format));
  by_weight_[w] = held_.back().get();
}

const PackedMatrix* PackedWeightSet::Find(const float* w, int in, int out) const {
  auto it = by_weight_.find(w);
  if (it == by_weight_.end() || it->second->in() != in || it->second->out() != out) return nullptr;
  return it->second;
}

size_t PackedWeightSet::Count(PackedFormat format) const {
  return static_cast<size_t>(std::count_if(held_.begin(), held_.end(),
                                           [&](const auto& p) { return p->format() == format; }));
}

std::shared_ptr<const PackedMatrix> RegisterPackedWeight(const float* w, int in, int out,
                                                         PackedFormat format) {
  Registry& r = GetRegistry();
  const Key key{w, in, out, format};
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.map.find(key);
    if (it != r.map.end()) {
      if (auto p = it->second.lock()) return p;
    }
  }
  // Pack outside the lock (it is the expensive part); a racing registration of the same key
  // keeps whichever copy reached the map first.
  auto* raw = new PackedMatrix(w, in, out, format);
  std::shared_ptr<const PackedMatrix> p(raw, [key](const PackedMatrix* m) {
    Registry& reg = GetRegistry();
    {
      std::lock_guard<std::mutex> lock(reg.mu);
      auto it = reg.map.find(key);
      if (it != reg.map.end() && it->second.expired()) reg.map.erase(it);
    }
    delete m;
  });
  std::lock_guard<std::mutex> lock(r.mu);
  auto& slot = r.map[key];
  if (auto existing = slot.lock()) return existing;  // p is dropped after the lock is released
  slot = p;
  return p;
}

std::shared_ptr<const PackedMatrix> FindPackedWeight(const float* w, int in, int out) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.map.find(Key{w, in, out, PackedFormat::kF32});
  return it == r.map.end() ? nullptr : it->second.lock();
}

void MatMulWith(MatMulKernel k, ThreadPool* pool, const float* x, int rows, int in, const float* w,
                const PackedMatrix* packed, int out, float* y) {
  if (rows <= 0 || out <= 0) return;
  const int panels = (out + kMatMulPanelOutputs - 1) / kMatMulPanelOutputs;
  // One block: rows [r0, r1) x panels [p0, p1).
  auto block = [&](int r0, int r1, int p0, int p1) {
    if (k != MatMulKernel::kScalar) {
      PackedBlock(k, x, r0, r1, *packed, p0, p1, y);
    } else {
      ScalarBlock(x, r0, r1, in, w, p0 * kMatMulPanelOutputs,
                  std::min(out, p1 * kMatMulPanelOutputs), out, y);
    }
  };
  const int threads = pool == nullptr ? 1 : pool->threads();
  const int64_t work = static_cast<int64_t>(rows) * out * in;
  if (threads <= 1 || work < kParallelMinWork) {
    block(0, rows, 0, panels);
    return;
  }
  // Many rows: threads take row blocks (each streams every panel); few rows (decode): threads
  // take panels. Either way each output is computed whole by one call.
  const int row_blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (row_blocks >= 2 * threads) {
    pool->ParallelFor(row_blocks, [&](int64_t b, int64_t e) {
      block(static_cast<int>(b) * kRowsPerBlock,
            std::min(rows, static_cast<int>(e) * kRowsPerBlock), 0, panels);
    });
  } else {
    pool->ParallelFor(
        panels,
        [&](int64_t b, int64_t e) { block(0, rows, static_cast<int>(b), static_cast<int>(e)); },
        work <= kOneChunkMaxWork ? 1 : ThreadPool::kChunksPerThread);
  }
}

void MatMulManyWith(MatMulKernel k, ThreadPool* pool, const MatMulPart* parts, int n_parts) {
  if (n_parts <= 0) return;
  const int threads = pool == nullptr ? 1 : pool->threads();
  // Multiply-adds of the panels before part i (prefix) and in all; the most rows of a part.
  thread_local std::vector<int64_t> start_slot;  // reused call to call; read by the workers
  std::vector<int64_t>& start = start_slot;      // through this reference (engine/scratch.h)
  start.assign(static_cast<size_t>(n_parts) + 1, 0);
  int max_rows = 0;
  for (int i = 0; i < n_parts; ++i) {
    const MatMulPart& p = parts[i];
    const int64_t panels = p.out > 0 ? (p.out + kMatMulPanelOutputs - 1) / kMatMulPanelOutputs : 0;
    start[i + 1] =
        start[i] + panels * kMatMulPanelOutputs * std::max(p.in, 0) * std::max(p.rows, 0);
    max_rows = std::max(max_rows, p.rows);
  }
  const int64_t work = start[n_parts];
  const int row_blocks = (max_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (threads <= 1 || work < kParallelMinWork || row_blocks >= 2 * threads) {
    // One part at a time, as separate calls would run (small: each on the caller; many rows:
    // each split over row blocks).
    for (int i = 0; i < n_parts; ++i) {
      const MatMulPart& p = parts[i];
      MatMulWith(k, work < kParallelMinWork ? nullptr : pool, p.x, p.rows, p.in, p.w, p.packed,
                 p.out, p.y);
    }
    return;
  }
  for (int i = 0; i < n_parts; ++i) {  // no multiply-adds, but outputs (zeros) to write
    const MatMulPart& p = parts[i];
    if (start[i + 1] == start[i])
      MatMulWith(k, nullptr, p.x, p.rows, p.in, p.w, p.packed, p.out, p.y);
  }
  // Chunk c takes the panels whose first multiply-add (counted over all parts' panels in
  // order) falls in [c * work / chunks, (c + 1) * work / chunks).
  const int64_t chunks =
      static_cast<int64_t>(threads) * (work <= kOneChunkMaxWork ? 1 : ThreadPool::kChunksPerThread);
  pool->ParallelFor(
      chunks,
      [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          for (int i = 0; i < n_parts; ++i) {
            const MatMulPart& p = parts[i];
            const int64_t cost = static_cast<int64_t>(kMatMulPanelOutputs) * p.in * p.rows;
            if (cost <= 0 || p.out <= 0) continue;
            const int64_t panels = (p.out + kMatMulPanelOutputs - 1) / kMatMulPanelOutputs;
            // The first panel q with (start[i] + q * cost) * chunks >= cc * work.
            auto first_panel = [&](int64_t cc) {
              const int64_t need = cc * work - start[i] * chunks;
              if (need <= 0) return int64_t{0};
              return std::min(panels, (need + cost * chunks - 1) / (cost * chunks));
            };
            const int q0 = static_cast<int>(first_panel(c)),
                      q1 = static_cast<int>(first_panel(c + 1));
            if (q0 >= q1) continue;
            if (k != MatMulKernel::kScalar) {
              PackedBlock(k, p.x, 0, p.rows, *p.packed, q0, q1, p.y);
            } else {
              ScalarBlock(p.x, 0, p.rows, p.in, p.w, q0 * kMatMulPanelOutputs,
                          std::min(p.out, q1 * kMatMulPanelOutputs), p.out, p.y);
            }
          }
        }
      },
      ThreadPool::kChunksPerThread);
}

}  // namespace kvtier::engine
