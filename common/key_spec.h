// The kvtier key spec: how a prefix unit is named. Byte-level spec and test vectors:
// docs/format/key-spec.md (tests/common/key_spec_test.cc recomputes every vector there).
//
// Three layers of digests, all SHA-256 (OpenSSL EVP) over typed, length-prefixed fields:
//
//   model_fingerprint = SHA256(F(0x01,"kvtier.model"), F(0x02,version), F(0x05,layout_desc),
//                              F(0x03,weights_digest), F(0x05,tokenizer_id))
//   chain_i           = SHA256(F(0x01,"kvtier.chain"), F(0x02,version), F(0x03,fingerprint),
//                              F(0x03,chain_{i-1}), F(0x04,tokens of unit i as u32 LE))
//                       chain_{-1} (the parent of unit 0) = 32 zero bytes (kRootParent)
//   tenant_salt       = HMAC-SHA256(key = server_secret, message = tenant_id bytes)
//   storage_key_i     = SHA256(F(0x01,"kvtier.storage"), F(0x03,tenant_salt), F(0x03,chain_i))
//
// where F(type, value) = type (u8) || length of value in bytes (u32 LE) || value.
//
// The client (engine) computes chain keys; only the daemon computes tenant salts and storage
// keys, from the authenticated tenant identity, never from a request field.
//
// Compatibility modes (interop with engines' own prefix caches), reproduced bit for bit and
// checked against ../shared/vectors/sglang_page_hash.json:
//   SGLang page hash:   page_i = SHA256(page_{i-1} raw 32 bytes (absent for page 0) ||
//                                       tokens as u32 LE)
//   vLLM sha256_cbor:   block_i = SHA256(CBOR([parent bstr(32), [uint tokens], extra_keys]))
//                       parent of block 0 = none_hash = SHA256(CBOR(text PYTHONHASHSEED));
//                       extra_keys = null, or [cache_salt] on block 0 only.
//
// Only whole units / pages / blocks get a key; a shorter tail gets none.
//
// Thread safety: every function is pure and thread-safe (each thread keeps its own reusable
// OpenSSL digest context). No function retains its arguments. Functions never fail for valid
// C++ arguments: OpenSSL digest failure (out of memory) aborts, as it means the process cannot
// make progress anyway.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier {

using Digest = std::array<uint8_t, 32>;

// Version of this spec, hashed into every digest (field type 0x02).
inline constexpr uint32_t kKeySpecVersion = 1;
// The parent of unit 0 in the kvtier chain: 32 zero bytes.
inline constexpr Digest kRootParent{};
// Largest unit (in tokens) the native key functions accept: a sanity bound (1 Mi) that also
// keeps the u32 length field of the token field exact. ChainKeys gives no keys above it;
// ChainKey requires tokens.size() <= kUnitTokensMax.
inline constexpr size_t kUnitTokensMax = size_t{1} << 20;

// Field type codes of the typed, length-prefixed encoding F(type, value).
enum class KeyField : uint8_t {
  kDomainTag = 0x01,  // ASCII domain tag
  kU32 = 0x02,        // one u32, little-endian (length 4)
  kDigest = 0x03,     // 32 raw bytes
  kTokens = 0x04,     // n token ids, each u32 little-endian (length 4n)
  kText = 0x05,       // UTF-8 / opaque bytes
};

// Domain tags (ASCII, no terminator).
inline constexpr std::string_view kModelDomainTag = "kvtier.model";
inline constexpr std::string_view kChainDomainTag = "kvtier.chain";
inline constexpr std::string_view kStorageDomainTag = "kvtier.storage";

// ---- kvtier native mode -------------------------------------------------------------------

// Binds weights, tokenizer and KV layout. `layout_description` is the canonical text of the
// KV layout (KvLayout::CanonicalDescription() in common/kv_layout.h); `weights_digest` is a
// SHA-256 of the weights (e.g. over the safetensors files); `tokenizer_id` names the tokenizer.
Digest ModelFingerprint(std::string_view layout_description, const Digest& weights_digest,
                        std::string_view tokenizer_id);

// chain_i from the parent chain (kRootParent for unit 0) and unit i's token ids.
Digest ChainKey(const Digest& model_fingerprint, const Digest& parent,
                std::span<const uint32_t> tokens);

// Chain keys of every whole unit of `tokens` (tokens.size() / unit_tokens keys; a shorter tail
// gets none). unit_tokens == 0 or > kUnitTokensMax gives no keys.
std::vector<Digest> ChainKeys(const Digest& model_fingerprint, std::span<const uint32_t> tokens,
                              size_t unit_tokens);

// The preimage that ChainKey hashes (for documentation, tests and debugging).
std::vector<uint8_t> ChainPreimage(const Digest& model_fingerprint, const Digest& parent,
                                   std::span<const uint32_t> tokens);

// HMAC-SHA256(server_secret, tenant_id). The daemon requires a secret of at least 32 bytes
// (it is a key); this function accepts any length, including empty (tests only).
Digest TenantSalt(std::span<const uint8_t> server_secret, std::string_view tenant_id);

// The tenant-bound key under which the daemon indexes a unit.
Digest StorageKey(const Digest& tenant_salt, const Digest& chain);

// ---- SGLang page hash ---------------------------------------------------------------------

// One page: SHA256(parent raw bytes || tokens u32 LE). `parent` is null for the first page.
Digest SglangPageHash(const Digest* parent, std::span<const uint32_t> tokens);
// Hashes of every whole page (page_size 0 gives none).
std::vector<Digest> SglangPageHashes(std::span<const uint32_t> tokens, size_t page_size);
// SGLang's hash_str_to_int64: the first 8 digest bytes, big-endian, as a signed int64.
int64_t SglangEventInt64(const Digest& page_hash);

// ---- vLLM sha256_cbor block hash ----------------------------------------------------------

// none_hash = SHA256(CBOR(text pythonhashseed)), the parent of block 0.
Digest VllmNoneHash(std::string_view pythonhashseed);
// The CBOR bytes hashed for one block. `cache_salt` is given only for block 0 (extra_keys
// [cache_salt]); otherwise extra_keys is CBOR null.
std::vector<uint8_t> VllmBlockPreimage(const Digest& parent, std::span<const uint32_t> tokens,
                                       std::optional<std::string_view> cache_salt);
Digest VllmBlockHash(const Digest& parent, std::span<const uint32_t> tokens,
                     std::optional<std::string_view> cache_salt);
// Hashes of every whole block, chained from `none_hash`; `cache_salt` goes into block 0 only.
std::vector<Digest> VllmBlockHashes(std::span<const uint32_t> tokens, size_t block_size,
                                    const Digest& none_hash,
                                    std::optional<std::string_view> cache_salt);
// vLLM's int block hash for KV events: the last 8 digest bytes, big-endian.
uint64_t VllmEventUint64(const Digest& block_hash);

// ---- helpers ------------------------------------------------------------------------------

// Plain SHA-256 (the physical limit the benchmarks compare against).
Digest Sha256(std::span<const uint8_t> bytes);

// Lowercase hex (64 characters for a digest).
std::string ToHex(std::span<const uint8_t> bytes);
// ToHex(Sha256(token's bytes)): how a tokens file names a bearer token (token_sha256;
// `kvtierd --hash-token`).
std::string TokenSha256Hex(std::string_view token);
// Parses exactly 64 hex characters (either case). InvalidArgument otherwise.
StatusOr<Digest> DigestFromHex(std::string_view hex);
// Parses an even number of hex characters. InvalidArgument otherwise.
StatusOr<std::vector<uint8_t>> BytesFromHex(std::string_view hex);

}  // namespace kvtier
