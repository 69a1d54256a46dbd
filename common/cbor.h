// A minimal CBOR (RFC 8949) encoder: exactly what vLLM's sha256_cbor block hash needs.
//
// Produces canonical (shortest-form) heads, as Python's cbor2.dumps(obj, canonical=True) does:
// unsigned integers of every width (major type 0), byte strings (2), text strings (3),
// definite-length arrays (4) and null (simple value 22, byte 0xf6). Nothing else: no maps,
// negative integers, floats, tags or indefinite lengths.
//
// Thread safety: a CborWriter is a value; do not share one between threads without locking.
// The writer appends to a caller-owned vector and keeps a pointer to it, so `out` must outlive
// the writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace kvtier {

class CborWriter {
 public:
  explicit CborWriter(std::vector<uint8_t>* out) : out_(out) {}

  void Uint(uint64_t value) { Head(0, value); }
  void Bytes(std::span<const uint8_t> bytes) {
    Head(2, bytes.size());
    out_->insert(out_->end(), bytes.begin(), bytes.end());
  }
  void Text(std::string_view text) {
    Head(3, text.size());
    out_->insert(out_->end(), text.begin(), text.end());
  }
  // Starts an array of `count` items; the caller then writes exactly `count` items.
  void Array(uint64_t count) { Head(4, count); }
  void Null() { out_->push_back(0xf6); }

  // Writes the head of major type `major` with argument `arg` (shortest form, RFC 8949
  // §4.2.1) to `p`, which must have room for 9 bytes. Returns the bytes written (1..9). For
  // callers that encode into a fixed buffer on a hot path (vLLM block hashing).
  static size_t PutHead(uint8_t* p, uint8_t major, uint64_t arg) {
    const uint8_t mt = static_cast<uint8_t>(major << 5);
    if (arg < 24) {
      p[0] = static_cast<uint8_t>(mt | arg);
      return 1;
    }
    int bytes = 8;
    uint8_t info = 27;
    if (arg <= 0xff) {
      bytes = 1;
      info = 24;
    } else if (arg <= 0xffff) {
      bytes = 2;
      info = 25;
    } else if (arg <= 0xffffffffULL) {
      bytes = 4;
      info = 26;
    }
    p[0] = static_cast<uint8_t>(mt | info);
    for (int i = 0; i < bytes; ++i) p[1 + i] = static_cast<uint8_t>(arg >> (8 * (bytes - 1 - i)));
    return 1 + static_cast<size_t>(bytes);
  }
  static constexpr size_t kHeadBytesMax = 9;

 private:
  void Head(uint8_t major, uint64_t arg) {
    uint8_t buf[kHeadBytesMax];
    const size_t n = PutHead(buf, major, arg);
    out_->insert(out_->end(), buf, buf + n);
  }

  std::vector<uint8_t>* out_;  // not owned
};

}  // namespace kvtier
