#include "engine/tokenizer.h"

namespace kvtier::engine {

StatusOr<ByteTokenizer> ByteTokenizer::Create(int vocab_size, int pad_id, int noise_id) {
  if (vocab_size < kByteBase + 256 + 1)
    return Status::InvalidArgument("tokenizer: vocab_size must be >= 260");
  if (pad_id != kPad) return Status::InvalidArgument("tokenizer: pad id must be 2");
  if (noise_id >= 0 && noise_id < kByteBase + 256)
    return Status::InvalidArgument("tokenizer: noise id collides with the byte ids");
  ByteTokenizer t;
  t.vocab_size_ = vocab_size;
  t.noise_id_ = noise_id;
  return t;
}

std::vector<int32_t> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(kByteBase + c);
  return ids;
}

std::string ByteTokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= kByteBase && id < kByteBase + 256) {
      out.push_back(static_cast<char>(id - kByteBase));
    } else if (id == kBos) {
      out += "<|bos|>";
    } else if (id == kEos) {
      out += "<|eos|>";
    } else if (id == kPad) {
      out += "<|pad|>";
    } else if (id == noise_id_) {
      out += "<|noise|>";
    } else {
      out += "<|id:" + std::to_string(id) + "|>";
    }
  }
  return out;
}

}  // namespace kvtier::engine
