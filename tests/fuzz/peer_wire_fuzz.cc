// libFuzzer target: the cluster peer protocol's body codecs (cluster/peer_wire.h) on arbitrary
// bytes. A node decodes what another node sent: a PUT body on the peer front, a GET_STAGED
// or CLOCK reply on the caller's side, key lists and texts in both.
//
// The first input byte picks the decoder (and, for a PUT, whether its header carries
// kPeerFlagExpiresAt; for GET_STAGED, the key count the caller asked for; texts and key lists
// share their input with the CLOCK reply), the rest is its input. Invariants, beyond no crash, no
// out-of-bounds read (ASan) and no undefined behaviour (UBSan): whatever decodes is canonical
// (encoding the decoded value gives back the input bytes) and within the protocol's limits.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_peer_wire_fuzz
//   build/fuzz/tests/fuzz/kvtier_peer_wire_fuzz -max_total_time=60 <corpus dir> \
//       tests/fuzz/seeds/peer_wire
// (seeds: a client PUT, and a repair copy with an expiry behind its first byte 3)
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "cluster/peer_wire.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using namespace kvtier;
using daemon::wire::Reader;
using daemon::wire::Writer;

bool Equal(std::span<const uint8_t> a, const std::vector<uint8_t>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// flags: the request header's (kPeerFlagExpiresAt or not). An expiry decodes only on a repair
// copy with a TTL, and the TTL its receiver keeps is never longer than the one sent, and 0
// exactly once the expiry has passed.
void Put(std::span<const uint8_t> in, uint16_t flags) {
  auto put = cluster::DecodePeerPut(in, flags);
  if (!put.ok()) return;
  Require(put->kind <= 2 && put->highest_tier <= 2 && put->allow_ssd <= 1);
  Require(put->tenant.size() <= cluster::kPeerTextBytesMax);
  Require(cluster::PeerPutFlags(*put) == flags);
  Require(Equal(in, cluster::EncodePeerPut(*put)));
  if (put->expires_at_unix_ms == 0) return;
  Require(put->repair && put->ttl_ms != 0);
  const uint64_t e = put->expires_at_unix_ms;
  for (uint64_t now : {uint64_t{0}, e - 1, e, e + 1, UINT64_MAX}) {
    const uint64_t kept = cluster::PeerPutTtlMs(*put, now);
    Require(kept <= put->ttl_ms);
    Require((kept == 0) == (now >= e));
    Require(kept == 0 || now + kept <= e);
  }
}

void Staged(std::span<const uint8_t> in, size_t keys) {
  auto reply = cluster::DecodeStagedReply(in, keys);
  if (!reply.ok()) return;
  Require(reply->units.size() == keys);
  for (const cluster::StagedUnit& u : reply->units) {
    Require(u.code != StatusCode::kOk || u.length_bytes >= cluster::kStagedRecordHeaderBytes);
  }
  Writer w;
  cluster::EncodeStagedReply(*reply, &w);
  Require(Equal(in, w.Take()));
}

// Texts and key lists, read one after another as a request body would be, until one fails.
void TextsAndKeys(std::span<const uint8_t> in) {
  Reader r(in);
  Writer w;
  size_t consumed = 0;
  for (int i = 0;; ++i) {
    if (i % 2 == 0) {
      std::string text;
      if (!cluster::GetText(&r, &text)) break;
      Require(text.size() <= cluster::kPeerTextBytesMax);
      cluster::PutText(text, &w);
    } else {
      std::vector<cluster::PeerKey> keys;
      if (!cluster::GetKeys(&r, &keys)) break;
      Require(keys.size() <= daemon::wire::kMaxBatchKeys);
      cluster::PutKeys(keys, &w);
    }
    consumed = in.size() - r.remaining();
  }
  Require(Equal(in.first(consumed), w.Take()));
}

// A CLOCK reply: decodes only as exactly one u64, which encodes back to the input.
void ClockReply(std::span<const uint8_t> in) {
  auto unix_us = cluster::DecodeClockReply(in);
  if (!unix_us.ok()) return;
  Writer w;
  w.U64(*unix_us);
  Require(Equal(in, w.Take()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const uint8_t> in(data + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      Put(in, data[0] / 3 % 2 != 0 ? cluster::kPeerFlagExpiresAt : uint16_t{0});
      break;
    case 1:
      Staged(in, data[0] / 3 % 8);
      break;
    default:
      TextsAndKeys(in);
      ClockReply(in);
      break;
  }
  return 0;
}
