// ByteTokenizer: the miniature's byte-level tokenizer.
//
// Ids: 0 = bos, 1 = eos, 2 = pad (engram_pad_token_id), 3..258 = the bytes 0x00..0xFF,
// vocab_size-1 = noise (dspark_noise_token_id); the ids in between are reserved and never
// produced by Encode. The Engram tokenizer compression is the identity on these ids.
// Thread safety: immutable; safe to share.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::engine {

class ByteTokenizer {
 public:
  static constexpr int32_t kBos = 0;
  static constexpr int32_t kEos = 1;
  static constexpr int32_t kPad = 2;
  static constexpr int32_t kByteBase = 3;

  // InvalidArgument when vocab_size < 260 or the reserved ids collide with the byte range.
  static StatusOr<ByteTokenizer> Create(int vocab_size, int pad_id, int noise_id);

  std::vector<int32_t> Encode(std::string_view text) const;
  // Encode(text).size() without building the ids: one token per byte.
  static size_t TokenCount(std::string_view text) { return text.size(); }
  // Bytes for byte ids; "<|bos|>", "<|eos|>", "<|pad|>", "<|noise|>", "<|id:N|>" otherwise.
  std::string Decode(const std::vector<int32_t>& ids) const;
  int vocab_size() const { return vocab_size_; }
  int32_t noise_id() const { return noise_id_; }

 private:
  int vocab_size_ = 0;
  int32_t noise_id_ = -1;
};

}  // namespace kvtier::engine
