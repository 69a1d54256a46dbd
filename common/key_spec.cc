#include "common/key_spec.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/cbor.h"
#include "common/hex.h"

namespace kvtier {
namespace {

// SHA-256 is fetched once per process; each thread reuses one digest context, so hashing a
// unit costs no allocation and no algorithm lookup.
const EVP_MD* Sha256Md() {
  static const EVP_MD* md = [] {
    EVP_MD* fetched = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    if (fetched == nullptr) {
      std::fprintf(stderr, "kvtier: OpenSSL has no SHA256\n");
      std::abort();
    }
    return fetched;  // lives for the process
  }();
  return md;
}

class Hasher {
 public:
  Hasher() : ctx_(EVP_MD_CTX_new()) {
    if (ctx_ == nullptr) Die("EVP_MD_CTX_new");
  }
  ~Hasher() { EVP_MD_CTX_free(ctx_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  void Init() {
    if (EVP_DigestInit_ex2(ctx_, Sha256Md(), nullptr) != 1) Die("EVP_DigestInit_ex2");
  }
  void Update(const void* data, size_t size) {
    if (size != 0 && EVP_DigestUpdate(ctx_, data, size) != 1) Die("EVP_DigestUpdate");
  }
  void Update(std::span<const uint8_t> bytes) { Update(bytes.data(), bytes.size()); }
  // Token ids as u32 little-endian. On little-endian hosts the array already has that layout.
  void UpdateTokens(std::span<const uint32_t> tokens) {
    if constexpr (std::endian::native == std::endian::little) {
      Update(tokens.data(), tokens.size_bytes());
    } else {
      uint8_t chunk[1024];
      size_t i = 0;
      while (i < tokens.size()) {
        size_t n = 0;
        for (; n < sizeof(chunk) / 4 && i < tokens.size(); ++i, ++n) {
          for (int b = 0; b < 4; ++b) chunk[4 * n + b] = static_cast<uint8_t>(tokens[i] >> (8 * b));
        }
        Update(chunk, 4 * n);
      }
    }
  }
  Digest Final() {
    Digest out;
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx_, out.data(), &len) != 1 || len != out.size()) {
      Die("EVP_DigestFinal_ex");
    }
    return out;
  }

 private:
  [[noreturn]] static void Die(const char* what) {
    std::fprintf(stderr, "kvtier: OpenSSL %s failed\n", what);
    std::abort();
  }
  EVP_MD_CTX* ctx_;  // owned
};

Hasher& ThreadHasher() {
  thread_local Hasher hasher;
  return hasher;
}

// Appends F(type, value) to a fixed buffer: type u8, length u32 LE, value.
class FieldWriter {
 public:
  explicit FieldWriter(uint8_t* buf) : buf_(buf) {}
  void Head(KeyField type, size_t value_bytes) {
    buf_[pos_++] = static_cast<uint8_t>(type);
    const uint32_t len = static_cast<uint32_t>(value_bytes);
    for (int b = 0; b < 4; ++b) buf_[pos_++] = static_cast<uint8_t>(len >> (8 * b));
  }
  void Field(KeyField type, const void* value, size_t value_bytes) {
    Head(type, value_bytes);
    std::memcpy(buf_ + pos_, value, value_bytes);
    pos_ += value_bytes;
  }
  void Tag(std::string_view tag) { Field(KeyField::kDomainTag, tag.data(), tag.size()); }
  void U32(uint32_t v) {
    const uint8_t le[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8),
                           static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 24)};
    Field(KeyField::kU32, le, 4);
  }
  void Dig(const Digest& d) { Field(KeyField::kDigest, d.data(), d.size()); }
  size_t size() const { return pos_; }
  const uint8_t* data() const { return buf_; }

 private:
  uint8_t* buf_;
  size_t pos_ = 0;
};

// Bytes of the chain preimage before the token values: 5 field heads + tag + u32 + 2 digests.
constexpr size_t kChainHeadBytes = 5 * 5 + kChainDomainTag.size() + 4 + 32 + 32;

// Units up to this many tokens are hashed from one contiguous per-thread buffer; longer token
// spans are streamed (the buffer never grows beyond ~16 KiB).
constexpr size_t kContiguousTokensMax = 4096;

size_t WriteChainHead(uint8_t* buf, const Digest& fingerprint, const Digest& parent,
                      size_t token_count) {
  FieldWriter w(buf);
  w.Tag(kChainDomainTag);
  w.U32(kKeySpecVersion);
  w.Dig(fingerprint);
  w.Dig(parent);
  w.Head(KeyField::kTokens, token_count * 4);
  return w.size();
}

void AppendTextField(Hasher& h, std::string_view text) {
  uint8_t head[5];
  FieldWriter w(head);
  w.Head(KeyField::kText, text.size());
  h.Update(head, sizeof(head));
  h.Update(text.data(), text.size());
}

// Encodes CBOR([parent bstr(32), [uint tokens], extra_keys]) into `out`, which must have
// room for VllmPreimageBytesMax(); returns the bytes written.
size_t VllmPreimageBytesMax(size_t tokens, std::optional<std::string_view> cache_salt) {
  constexpr size_t kHead = CborWriter::kHeadBytesMax;
  return 1 + kHead + 32 + kHead + tokens * 5 + 1 + kHead + (cache_salt ? cache_salt->size() : 0);
}

// CBOR unsigned integer head for a u32, without data-dependent branches (token ids are random
// enough that branchy code mispredicts on every other token). Always stores 5 bytes at `p`;
// returns the 1, 2, 3 or 5 that belong to the item.
inline size_t PutCborU32(uint8_t* p, uint32_t v) {
  static constexpr uint8_t kLen[4] = {1, 2, 3, 5};
  static constexpr uint8_t kInfo[4] = {0, 24, 25, 26};
  const int cls = (v >= 24) + (v > 0xff) + (v > 0xffff);
  const int value_bytes = kLen[cls] - 1;  // 0, 1, 2 or 4
  p[0] = static_cast<uint8_t>(cls == 0 ? v : kInfo[cls]);
  // The value's low `value_bytes` bytes, big-endian, at p[1..]; zeros after them.
  const uint32_t shifted = static_cast<uint32_t>(uint64_t{v} << (8 * (4 - value_bytes)));
  for (int i = 0; i < 4; ++i) p[1 + i] = static_cast<uint8_t>(shifted >> (24 - 8 * i));
  return kLen[cls];
}

size_t EncodeVllmPreimage(uint8_t* out, const Digest& parent, std::span<const uint32_t> tokens,
                          std::optional<std::string_view> cache_salt) {
  uint8_t* p = out;
  p += CborWriter::PutHead(p, 4, 3);
  p += CborWriter::PutHead(p, 2, parent.size());
  std::memcpy(p, parent.data(), parent.size());
  p += parent.size();
  p += CborWriter::PutHead(p, 4, tokens.size());
  for (uint32_t t : tokens) p += PutCborU32(p, t);
  if (cache_salt.has_value()) {
    p += CborWriter::PutHead(p, 4, 1);
    p += CborWriter::PutHead(p, 3, cache_salt->size());
    if (!cache_salt->empty()) std::memcpy(p, cache_salt->data(), cache_salt->size());
    p += cache_salt->size();
  } else {
    *p++ = 0xf6;  // null
  }
  return static_cast<size_t>(p - out);
}

// Per-thread scratch for preimages (grows to the largest unit seen; never shrinks).
std::vector<uint8_t>& Scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf;
}

}  // namespace

Digest ModelFingerprint(std::string_view layout_description, const Digest& weights_digest,
                        std::string_view tokenizer_id) {
  Hasher& h = ThreadHasher();
  h.Init();
  uint8_t head[5 + kModelDomainTag.size() + 9];
  FieldWriter w(head);
  w.Tag(kModelDomainTag);
  w.U32(kKeySpecVersion);
  h.Update(head, w.size());
  AppendTextField(h, layout_description);
  uint8_t dig[37];
  FieldWriter wd(dig);
  wd.Dig(weights_digest);
  h.Update(dig, wd.size());
  AppendTextField(h, tokenizer_id);
  return h.Final();
}

Digest ChainKey(const Digest& model_fingerprint, const Digest& parent,
                std::span<const uint32_t> tokens) {
  Hasher& h = ThreadHasher();
  h.Init();
  if (std::endian::native == std::endian::little && tokens.size() <= kContiguousTokensMax) {
    // One contiguous preimage, one update: cheaper than feeding head and tokens separately.
    std::vector<uint8_t>& buf = Scratch(kChainHeadBytes + tokens.size_bytes());
    const size_t n = WriteChainHead(buf.data(), model_fingerprint, parent, tokens.size());
    if (!tokens.empty()) std::memcpy(buf.data() + n, tokens.data(), tokens.size_bytes());
    h.Update(buf.data(), n + tokens.size_bytes());
  } else {
    uint8_t head[kChainHeadBytes];
    const size_t n = WriteChainHead(head, model_fingerprint, parent, tokens.size());
    h.Update(head, n);
    h.UpdateTokens(tokens);
  }
  return h.Final();
}

std::vector<Digest> ChainKeys(const Digest& model_fingerprint, std::span<const uint32_t> tokens,
                              size_t unit_tokens) {
  std::vector<Digest> keys;
  if (unit_tokens == 0 || unit_tokens > kUnitTokensMax) return keys;
  const size_t units = tokens.size() / unit_tokens;
  keys.reserve(units);
  Digest parent = kRootParent;
  for (size_t i = 0; i < units; ++i) {
    parent = ChainKey(model_fingerprint, parent, tokens.subspan(i * unit_tokens, unit_tokens));
    keys.push_back(parent);
  }
  return keys;
}

std::vector<uint8_t> ChainPreimage(const Digest& model_fingerprint, const Digest& parent,
                                   std::span<const uint32_t> tokens) {
  std::vector<uint8_t> out(kChainHeadBytes + 4 * tokens.size());
  const size_t n = WriteChainHead(out.data(), model_fingerprint, parent, tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int b = 0; b < 4; ++b) out[n + 4 * i + b] = static_cast<uint8_t>(tokens[i] >> (8 * b));
  }
  return out;
}

Digest TenantSalt(std::span<const uint8_t> server_secret, std::string_view tenant_id) {
  Digest out;
  unsigned int len = 0;
  static const uint8_t kEmpty[1] = {0};
  const uint8_t* key = server_secret.empty() ? kEmpty : server_secret.data();
  if (HMAC(Sha256Md(), key, static_cast<int>(server_secret.size()),
           reinterpret_cast<const unsigned char*>(tenant_id.data()), tenant_id.size(), out.data(),
           &len) == nullptr ||
      len != out.size()) {
    std::fprintf(stderr, "kvtier: OpenSSL HMAC failed\n");
    std::abort();
  }
  return out;
}

Digest StorageKey(const Digest& tenant_salt, const Digest& chain) {
  uint8_t buf[5 + kStorageDomainTag.size() + 2 * 37];
  FieldWriter w(buf);
  w.Tag(kStorageDomainTag);
  w.Dig(tenant_salt);
  w.Dig(chain);
  Hasher& h = ThreadHasher();
  h.Init();
  h.Update(buf, w.size());
  return h.Final();
}

Digest SglangPageHash(const Digest* parent, std::span<const uint32_t> tokens) {
  Hasher& h = ThreadHasher();
  h.Init();
  if (parent != nullptr) h.Update(parent->data(), parent->size());
  h.UpdateTokens(tokens);
  return h.Final();
}

std::vector<Digest> SglangPageHashes(std::span<const uint32_t> tokens, size_t page_size) {
  std::vector<Digest> out;
  if (page_size == 0) return out;
  const size_t pages = tokens.size() / page_size;
  out.reserve(pages);
  for (size_t i = 0; i < pages; ++i) {
    out.push_back(
        SglangPageHash(i == 0 ? nullptr : &out.back(), tokens.subspan(i * page_size, page_size)));
  }
  return out;
}

int64_t SglangEventInt64(const Digest& page_hash) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | page_hash[i];
  return static_cast<int64_t>(v);  // two's complement reinterpretation (C++20)
}

Digest VllmNoneHash(std::string_view pythonhashseed) {
  std::vector<uint8_t> cbor;
  CborWriter(&cbor).Text(pythonhashseed);
  return Sha256(cbor);
}

std::vector<uint8_t> VllmBlockPreimage(const Digest& parent, std::span<const uint32_t> tokens,
                                       std::optional<std::string_view> cache_salt) {
  std::vector<uint8_t> out(VllmPreimageBytesMax(tokens.size(), cache_salt));
  out.resize(EncodeVllmPreimage(out.data(), parent, tokens, cache_salt));
  return out;
}

Digest VllmBlockHash(const Digest& parent, std::span<const uint32_t> tokens,
                     std::optional<std::string_view> cache_salt) {
  std::vector<uint8_t>& buf = Scratch(VllmPreimageBytesMax(tokens.size(), cache_salt));
  const size_t n = EncodeVllmPreimage(buf.data(), parent, tokens, cache_salt);
  Hasher& h = ThreadHasher();
  h.Init();
  h.Update(buf.data(), n);
  return h.Final();
}

std::vector<Digest> VllmBlockHashes(std::span<const uint32_t> tokens, size_t block_size,
                                    const Digest& none_hash,
                                    std::optional<std::string_view> cache_salt) {
  std::vector<Digest> out;
  if (block_size == 0) return out;
  const size_t blocks = tokens.size() / block_size;
  out.reserve(blocks);
  for (size_t i = 0; i < blocks; ++i) {
    out.push_back(VllmBlockHash(i == 0 ? none_hash : out.back(),
                                tokens.subspan(i * block_size, block_size),
                                i == 0 ? cache_salt : std::nullopt));
  }
  return out;
}

uint64_t VllmEventUint64(const Digest& block_hash) {
  uint64_t v = 0;
  for (size_t i = block_hash.size() - 8; i < block_hash.size(); ++i) v = (v << 8) | block_hash[i];
  return v;
}

Digest Sha256(std::span<const uint8_t> bytes) {
  Hasher& h = ThreadHasher();
  h.Init();
  h.Update(bytes);
  return h.Final();
}

std::string TokenSha256Hex(std::string_view token) {
  return ToHex(Sha256(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(token.data()), token.size())));
}

std::string ToHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * bytes.size(), '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return out;
}

StatusOr<std::vector<uint8_t>> BytesFromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return Status::InvalidArgument("hex: odd number of characters");
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = HexDigitValue(hex[2 * i]);
    const int lo = HexDigitValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Status::InvalidArgument("hex: not a hex digit");
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

StatusOr<Digest> DigestFromHex(std::string_view hex) {
  if (hex.size() != 64) return Status::InvalidArgument("digest hex: expected 64 characters");
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, BytesFromHex(hex));
  Digest d;
  std::memcpy(d.data(), bytes.data(), d.size());
  return d;
}

}  // namespace kvtier
