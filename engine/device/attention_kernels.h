// The kernels of the sparse attention on the device layers (DeviceLayers::Attention): each row's
// heads against that row's keys, the keys decoded on the device from their stored bytes.
//
// Kernels as in engine/device/kernels.h (one function per output, the same code on a GPU and on
// the host twin), computed in the order of Engine::AttnCore's loops, operation for operation:
// the products of q and a key in Dot's eight-lane order (HcMixDots), times the scale; the
// softmax with the head's sink (max from the sink, the exponentials summed in key order, each
// divided by the sum); the weighted sums of the keys in key order from +0.0 (WeightedRowSums,
// each product rounded before its add); RoPE and its inverse as ApplyRopeRotation. So the
// host twin's outputs are the CPU path's bits, and a GPU's differ only by its expf.
//
// A pass's keys: the table keys_f ([keys x dim] floats, the decoded entries) and per row t the
// list keys[key_off[t] .. key_off[t + 1]) of rows of the table, in attention order (the selected
// global entries, then the SWA window oldest first). Logits and weights of row t's head h live in
// w[(t * heads + h) * stride ..], stride at least every row's key count.
#pragma once

#include <cstdint>

#include "engine/device/kernels.h"
#include "kernels/block_decode.h"

namespace kvtier::engine::device {

// Entries of one stored format decoded from where they lie on the device (the mirrors of the
// caches and rings, or the entries uploaded with the pass): entry i is entry entry[i] of source
// source[i], whose codes start at data[source[i]] and scales at scales[source[i]]; it goes to
// out + i * blocks * F::kBlockElems. Block j of entry i for i * blocks + j < threads (blocks =
// head_dim / F::kBlockElems per entry). F: Fp4Keys (the global KV, kFp4E4M3x16) or Fp8Keys (the
// SWA window, kFp8Ue8m0x32), each decoding one block with the codec's own function.
template <typename F>
struct DecodeKeysKernel {
  static constexpr const char* kName = F::kName;
  const uint8_t* const* data;    // [sources]
  const uint8_t* const* scales;  // [sources]
  const int32_t* source;         // [entries]
  const int32_t* entry;          // [entries]
  int blocks;
  float* out;
  int64_t threads;
  KVTIER_HD void operator()(int64_t b) const {
    const int64_t i = b / blocks, j = b % blocks, e = entry[i];
    F::Decode(data[source[i]] + (e * blocks + j) * F::kBlockBytes,
              scales[source[i]][e * blocks + j], out + b * F::kBlockElems);
  }
};
struct Fp4Keys {
  static constexpr const char* kName = "DecodeFp4Keys";
  static constexpr int64_t kBlockElems = kernels::kFp4E4M3BlockElems;
  static constexpr int64_t kBlockBytes = kBlockElems / 2;
  KVTIER_HD static void Decode(const uint8_t* codes, uint8_t scale, float* out) {
    kernels::DequantizeBlockFp4E4M3(codes, scale, out);
  }
};
struct Fp8Keys {
  static constexpr const char* kName = "DecodeFp8Keys";
  static constexpr int64_t kBlockElems = kernels::kUe8m0BlockElems;
  static constexpr int64_t kBlockBytes = kBlockElems;
  KVTIER_HD static void Decode(const uint8_t* codes, uint8_t scale, float* out) {
    kernels::DequantizeBlockFp8Ue8m0(codes, scale, out);
  }
};
using DecodeFp4KeysKernel = DecodeKeysKernel<Fp4Keys>;
using DecodeFp8KeysKernel = DecodeKeysKernel<Fp8Keys>;

// Byte i of src to its run's destination: dst[r][i - begin[r]] for the run r with begin[r] <= i <
// begin[r + 1] (begin non-decreasing, begin[0] = 0), for i < threads = begin[runs]: the new
// entries of the global KV and the SWA rings' new slots into the device's copies of them
// (DeviceLayers::Attention).
struct ScatterBytesKernel {
  static constexpr const char* kName = "ScatterBytes";
  const uint8_t* src;
  const int64_t* begin;  // [runs + 1]
  uint8_t* const* dst;   // [runs]
  int runs;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    int lo = 0, hi = runs - 1;  // the last run that begins at or before i
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (begin[mid] <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    dst[lo][i - begin[lo]] = src[i];
  }
};

// RoPE (forward) on the last 2 * pairs elements of each dim-wide head of each row, in place:
// pair j of row t's head h rotated by c[t * pairs + j], s[t * pairs + j] (ApplyRopeRotation),
// for (t * heads + h) * pairs + j < threads.
struct RopeRowsKernel {
  static constexpr const char* kName = "RopeRows";
  float* x;  // [rows x heads x dim]
  int heads, dim, pairs;
  const float* c;  // [rows x pairs]
  const float* s;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t j = i % pairs, th = i / pairs, t = th / heads;
    float* p = x + th * dim + dim - 2 * pairs + 2 * j;
    const float cj = c[t * pairs + j], sj = s[t * pairs + j];
    const float a = p[0], b = p[1];
    p[0] = a * cj - b * sj;
    p[1] = a * sj + b * cj;
  }
};

// w[(t * heads + h) * stride + i] = Dot(key i of row t, q head h of row t) * scale, for the
// row's keys; threads = rows * heads * stride (threads past a row's key count write nothing).
struct AttnDotsKernel {
  static constexpr const char* kName = "AttnDots";
  const float* q;  // [rows x heads x dim]
  int heads, dim;
  const float* keys_f;     // [table rows x dim]
  const int32_t* keys;     // row lists into keys_f
  const int32_t* key_off;  // [rows + 1]
  float scale;
  int stride;
  float* w;
  int64_t threads;
  KVTIER_HD void operator()(int64_t i) const {
    const int64_t k = i % stride, th = i / stride, t = th / heads;
    const int32_t k0 = key_off[t];
    if (k >= key_off[t + 1] - k0) return;
    const float* key = keys_f + static_cast<int64_t>(keys[k0 + k]) * dim;
    w[i] = kernel_math::Dot(key, 1, q + th * dim, dim) * scale;
  }
};

// Row t's head h: its logits in w turned into attention weights in place, the softmax over the
// head's sink and the logits with the sink's own share dropped (AttnCore), for t * heads + h <
// threads.
struct AttnSoftmaxKernel {
  static constexpr const char* kName = "AttnSoftmax";
  const float* sink;  // [heads]
  int heads;
  const int32_t* key_off;
  int stride;
  float* w;
  int64_t threads;
  KVTIER_HD void operator()(int64_t th) const {
    const int64_t t = th / heads;
    const int32_t nk = key_off[t + 1] - key_off[t];
    float* lg = w + th * stride;
    const float sk = sink[th % heads];
    float mx = sk;
    for (int32_t i = 0; i < nk; ++i) mx = kernel_math::StdMax(mx, lg[i]);
    float den = expf(sk - mx);
    for (int32_t i = 0; i < nk; ++i) {
      lg[i] = expf(lg[i] - mx);
      den += lg[i];
    }
    for (int32_t i = 0; i < nk; ++i) lg[i] = lg[i] / den;
  }
};

// o[(t * heads + h) * dim + d] = the sum over row t's keys i, in order and from +0.0, of
// w[(t * heads + h) * stride + i] * key_i[d] (WeightedRowSums); then the last 2 * pairs
// elements of each head rotated back by the row's RoPE (ApplyRopeRotation, inverse), for
// (t * heads + h) * dim + d < threads. An element of a rotated pair sums both of its pair's
// columns.
struct AttnSumsKernel {
  static constexpr const char* kName = "AttnSums";
  const float* w;
  int heads, dim, pairs;
  const float* keys_f;
  const int32_t* keys;
  const int32_t* key_off;
  int stride;
  const float* c;  // [rows x pairs]
  const float* s;
  float* o;  // [rows x heads x dim]
  int64_t threads;
  KVTIER_HD float Column(int64_t th, int64_t t, int d) const {
    const int32_t k0 = key_off[t], nk = key_off[t + 1] - k0;
    const float* wt = w + th * stride;
    float acc = 0.0f;
    for (int32_t i = 0; i < nk; ++i) {
      const float p = wt[i] * keys_f[static_cast<int64_t>(keys[k0 + i]) * dim + d];
      acc += p;
    }
    return acc;
  }
  KVTIER_HD void operator()(int64_t i) const {
    const int d = static_cast<int>(i % dim);
    const int64_t th = i / dim, t = th / heads;
    const int r0 = dim - 2 * pairs;
    if (d < r0) {
      o[i] = Column(th, t, d);
      return;
    }
    // The inverse rotates by -angle: float(-sin) == -float(sin), as ApplyRopeRotation takes it.
    const int j = (d - r0) / 2;
    const float a = Column(th, t, r0 + 2 * j), b = Column(th, t, r0 + 2 * j + 1);
    const float cj = c[t * pairs + j], si = -s[t * pairs + j];
    o[i] = (d - r0) % 2 == 0 ? a * cj - b * si : a * si + b * cj;
  }
};

}  // namespace kvtier::engine::device
