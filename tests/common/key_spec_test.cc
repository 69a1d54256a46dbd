#include "common/key_spec.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/cbor.h"
#include "common/kv_layout.h"
#include "common/shipped_models.h"

namespace kvtier {
namespace {

std::vector<uint32_t> Iota(size_t n, uint32_t start = 0) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

Digest Filled(uint8_t b) {
  Digest d;
  d.fill(b);
  return d;
}

// Reads the ```vectors block of docs/format/key-spec.md as name -> hex.
std::map<std::string, std::string> DocVectors() {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/docs/format/key-spec.md");
  EXPECT_TRUE(in.good()) << "docs/format/key-spec.md not found";
  std::map<std::string, std::string> out;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    if (line == "```vectors") {
      inside = true;
    } else if (inside && line == "```") {
      break;
    } else if (inside) {
      const size_t eq = line.find(" = ");
      if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 3);
    }
  }
  return out;
}

TEST(KeySpecDoc, EveryPublishedVectorIsRecomputed) {
  const std::map<std::string, std::string> doc = DocVectors();
  StatusOr<KvLayout> mini = ParseKvLayout(FindShippedModel("mini-v4.1")->config_json, {});
  ASSERT_TRUE(mini.ok()) << mini.status().ToString();
  const Digest fp =
      ModelFingerprint(mini->CanonicalDescription(), Filled(0x11), "kvtier-mini-tokenizer-v1");
  const std::vector<uint32_t> small = {1, 2, 3, 4};
  const std::vector<uint32_t> tokens = Iota(130);
  const std::vector<Digest> chain = ChainKeys(fp, tokens, 64);
  ASSERT_EQ(chain.size(), 2u);
  std::vector<uint8_t> secret(32);
  std::iota(secret.begin(), secret.end(), uint8_t{0});
  const Digest salt_a = TenantSalt(secret, "tenant-a");
  const Digest salt_b = TenantSalt(secret, "tenant-b");

  const std::map<std::string, std::string> computed = {
      {"fingerprint", ToHex(fp)},
      {"small_preimage", ToHex(ChainPreimage(fp, kRootParent, small))},
      {"small_chain", ToHex(ChainKey(fp, kRootParent, small))},
      {"chain0", ToHex(chain[0])},
      {"chain1", ToHex(chain[1])},
      {"salt_a", ToHex(salt_a)},
      {"salt_b", ToHex(salt_b)},
      {"storage_a0", ToHex(StorageKey(salt_a, chain[0]))},
      {"storage_b0", ToHex(StorageKey(salt_b, chain[0]))},
  };
  EXPECT_EQ(doc.size(), computed.size()) << "the doc and the test list different vectors";
  for (const auto& [name, hex] : computed) {
    auto it = doc.find(name);
    ASSERT_NE(it, doc.end()) << "vector '" << name << "' missing from key-spec.md";
    EXPECT_EQ(it->second, hex) << name;
  }
  // The preimage hashes to the key: ChainKey is SHA-256 of exactly ChainPreimage.
  EXPECT_EQ(Sha256(ChainPreimage(fp, kRootParent, small)), ChainKey(fp, kRootParent, small));
}

TEST(KeySpec, ChainPreimageLayoutMatchesTheSpecTable) {
  const Digest fp = Filled(0xab);
  const Digest parent = Filled(0xcd);
  const std::vector<uint32_t> tokens = Iota(64, 0x01020304);
  const std::vector<uint8_t> pre = ChainPreimage(fp, parent, tokens);
  ASSERT_EQ(pre.size(), 361u);
  EXPECT_EQ(ToHex(std::span(pre).first(17)), "010c0000006b76746965722e636861696e");
  EXPECT_EQ(ToHex(std::span(pre).subspan(17, 9)), "020400000001000000");
  EXPECT_EQ(ToHex(std::span(pre).subspan(26, 5)), "0320000000");
  EXPECT_EQ(std::vector<uint8_t>(pre.begin() + 31, pre.begin() + 63),
            std::vector<uint8_t>(fp.begin(), fp.end()));
  EXPECT_EQ(std::vector<uint8_t>(pre.begin() + 68, pre.begin() + 100),
            std::vector<uint8_t>(parent.begin(), parent.end()));
  EXPECT_EQ(ToHex(std::span(pre).subspan(100, 5)), "0400010000");
  EXPECT_EQ(ToHex(std::span(pre).subspan(105, 8)), "0403020105030201");  // LE u32 tokens
}

TEST(KeySpec, ChainKeysCoverWholeUnitsOnlyAndChain) {
  const Digest fp = Filled(7);
  const std::vector<uint32_t> tokens = Iota(64 * 3 + 63);
  const std::vector<Digest> keys = ChainKeys(fp, tokens, 64);
  ASSERT_EQ(keys.size(), 3u);
  EXPECT_EQ(keys[0], ChainKey(fp, kRootParent, std::span(tokens).first(64)));
  EXPECT_EQ(keys[1], ChainKey(fp, keys[0], std::span(tokens).subspan(64, 64)));
  EXPECT_EQ(keys[2], ChainKey(fp, keys[1], std::span(tokens).subspan(128, 64)));
  EXPECT_TRUE(ChainKeys(fp, std::span(tokens).first(63), 64).empty());
  EXPECT_TRUE(ChainKeys(fp, tokens, 0).empty());
  // A prefix of the sequence gets a prefix of the keys.
  const std::vector<Digest> prefix = ChainKeys(fp, std::span(tokens).first(128), 64);
  ASSERT_EQ(prefix.size(), 2u);
  EXPECT_EQ(prefix[0], keys[0]);
  EXPECT_EQ(prefix[1], keys[1]);
}

TEST(KeySpec, EveryInputChangesTheKey) {
  const std::vector<uint32_t> tokens = Iota(64);
  const Digest base = ChainKey(Filled(1), kRootParent, tokens);
  EXPECT_NE(base, ChainKey(Filled(2), kRootParent, tokens));  // other model
  EXPECT_NE(base, ChainKey(Filled(1), Filled(9), tokens));    // other prefix
  std::vector<uint32_t> changed = tokens;
  changed[63] ^= 1u << 31;
  EXPECT_NE(base, ChainKey(Filled(1), kRootParent, changed));  // one token bit
  // The same bytes split at another unit size give other keys (length is hashed).
  const std::vector<uint32_t> both = Iota(128);
  EXPECT_NE(ChainKeys(Filled(1), both, 128)[0], ChainKeys(Filled(1), both, 64)[1]);

  const Digest w = Filled(3);
  const Digest fp = ModelFingerprint("layout", w, "tok");
  EXPECT_NE(fp, ModelFingerprint("layout2", w, "tok"));
  EXPECT_NE(fp, ModelFingerprint("layout", Filled(4), "tok"));
  EXPECT_NE(fp, ModelFingerprint("layout", w, "tok2"));
  // Length prefixes keep field boundaries: moving a byte between fields changes the digest.
  EXPECT_NE(ModelFingerprint("ab", w, "c"), ModelFingerprint("a", w, "bc"));
}

TEST(KeySpec, TenantsNeverShareStorageKeys) {
  const std::vector<uint8_t> secret(32, 0x5a);
  const std::vector<uint8_t> other_secret(32, 0xa5);
  const Digest chain = ChainKey(Filled(1), kRootParent, Iota(64));
  const Digest a = StorageKey(TenantSalt(secret, "alice"), chain);
  EXPECT_EQ(a, StorageKey(TenantSalt(secret, "alice"), chain));  // same tenant hits
  EXPECT_NE(a, StorageKey(TenantSalt(secret, "bob"), chain));    // another tenant misses
  EXPECT_NE(a, StorageKey(TenantSalt(other_secret, "alice"), chain));
  EXPECT_NE(a, chain);
  // RFC 4231 test case 2: HMAC-SHA256(key "Jefe", "what do ya want for nothing?").
  const std::string jefe = "Jefe";
  EXPECT_EQ(ToHex(TenantSalt(std::span(reinterpret_cast<const uint8_t*>(jefe.data()), 4),
                             "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(KeySpec, ThreadsComputeTheSameKeys) {
  const std::vector<uint32_t> tokens = Iota(64 * 32);
  const std::vector<Digest> expected = ChainKeys(Filled(5), tokens, 64);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep) {
        if (ChainKeys(Filled(5), tokens, 64) != expected) ++mismatches[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(KeySpec, Sha256MatchesFips180Example) {
  const std::string abc = "abc";
  EXPECT_EQ(ToHex(Sha256(std::span(reinterpret_cast<const uint8_t*>(abc.data()), 3))),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Hex, RoundTripAndRejects) {
  const Digest d = ChainKey(Filled(1), kRootParent, Iota(4));
  StatusOr<Digest> back = DigestFromHex(ToHex(d));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, d);
  std::string upper = ToHex(d);
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  EXPECT_EQ(*DigestFromHex(upper), d);
  EXPECT_TRUE(DigestFromHex("abc").status().IsInvalidArgument());
  EXPECT_TRUE(DigestFromHex(std::string(63, '0') + "g").status().IsInvalidArgument());
  EXPECT_TRUE(BytesFromHex("0").status().IsInvalidArgument());
  EXPECT_TRUE(BytesFromHex("zz").status().IsInvalidArgument());
  EXPECT_EQ(*BytesFromHex(""), std::vector<uint8_t>{});
}

TEST(Cbor, ShortestFormHeadsForEveryWidth) {
  auto enc = [](auto&& fn) {
    std::vector<uint8_t> out;
    CborWriter w(&out);
    fn(w);
    return ToHex(out);
  };
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(0); }), "00");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(23); }), "17");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(24); }), "1818");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(255); }), "18ff");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(256); }), "190100");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(65535); }), "19ffff");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(65536); }), "1a00010000");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(0xffffffffu); }), "1affffffff");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(0x100000000ull); }), "1b0000000100000000");
  EXPECT_EQ(enc([](CborWriter& w) { w.Uint(~0ull); }), "1bffffffffffffffff");
  EXPECT_EQ(enc([](CborWriter& w) { w.Text("0"); }), "6130");
  EXPECT_EQ(enc([](CborWriter& w) { w.Text(""); }), "60");
  EXPECT_EQ(enc([](CborWriter& w) { w.Null(); }), "f6");
  EXPECT_EQ(enc([](CborWriter& w) { w.Array(0); }), "80");
  EXPECT_EQ(enc([](CborWriter& w) { w.Array(24); }), "9818");
  const std::vector<uint8_t> b32(32, 0xee);
  EXPECT_EQ(enc([&](CborWriter& w) { w.Bytes(b32); }).substr(0, 4), "5820");
  // RFC 8949 Appendix A: [1, [2, 3], [4, 5]] = 0x8301820203820405.
  EXPECT_EQ(enc([](CborWriter& w) {
              w.Array(3);
              w.Uint(1);
              w.Array(2);
              w.Uint(2);
              w.Uint(3);
              w.Array(2);
              w.Uint(4);
              w.Uint(5);
            }),
            "8301820203820405");
}

TEST(CompatModes, SglangAndVllmDefinitions) {
  const std::vector<uint32_t> tokens = Iota(40);
  const std::vector<Digest> pages = SglangPageHashes(tokens, 16);
  ASSERT_EQ(pages.size(), 2u);
  std::vector<uint8_t> pre;
  for (uint32_t t : std::span(tokens).first(16)) {
    for (int b = 0; b < 4; ++b) pre.push_back(static_cast<uint8_t>(t >> (8 * b)));
  }
  EXPECT_EQ(pages[0], Sha256(pre));
  EXPECT_TRUE(SglangPageHashes(tokens, 0).empty());
  Digest d{};
  d[0] = 0x80;
  EXPECT_EQ(SglangEventInt64(d), INT64_MIN);
  Digest e{};
  e[31] = 0x01;
  e[24] = 0x02;
  EXPECT_EQ(VllmEventUint64(e), 0x0200000000000001ull);
  const Digest none = VllmNoneHash("0");
  const std::vector<Digest> blocks = VllmBlockHashes(tokens, 16, none, std::nullopt);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[1], VllmBlockHash(blocks[0], std::span(tokens).subspan(16, 16), std::nullopt));
  const std::vector<Digest> salted = VllmBlockHashes(tokens, 16, none, "s");
  EXPECT_NE(salted[0], blocks[0]);
  // The salt goes into block 0 only; block 1 differs only through its parent.
  EXPECT_EQ(salted[1], VllmBlockHash(salted[0], std::span(tokens).subspan(16, 16), std::nullopt));
}

}  // namespace
}  // namespace kvtier
