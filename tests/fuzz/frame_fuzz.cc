// libFuzzer target: the native frame parser and every request/response body decoder.
// The input is fed to FrameParser in chunks whose sizes come from the first byte; each
// complete frame's body is decoded by its opcode's decoder (both inline and SHM variants).
// Invariants: no crash, no out-of-bounds read (ASan), no frame larger than the limit.
#include <cstddef>
#include <cstdint>

#include "cache_daemon/wire.h"

using namespace kvtier::daemon::wire;

static void DecodeBody(const Frame& f) {
  bool shm = (f.header.flags & kFlagShm) != 0;
  std::span<const uint8_t> b(f.body);
  switch (static_cast<Opcode>(f.header.opcode & ~kResponseBit)) {
    case Opcode::kHello:
      (void)DecodeHello(b);
      break;
    case Opcode::kAuth:
      (void)DecodeAuth(b);
      break;
    case Opcode::kShmAttach:
      (void)DecodeShmAttach(b);
      break;
    case Opcode::kPut:
      (void)DecodePut(b, shm);
      break;
    case Opcode::kGet:
      (void)DecodeGet(b, shm);
      break;
    case Opcode::kPin:
      (void)DecodePin(b);
      break;
    case Opcode::kDelete:
      (void)DecodeDelete(b);
      break;
    default:
      (void)DecodeKeys(b);
      break;
  }
  if (f.header.opcode & kResponseBit) {
    Reader r(b);
    kvtier::Status st;
    if (DecodeStatus(&r, &st).ok()) {
      Reader r2 = r;
      (void)DecodeGetResponse(&r, shm);
      (void)DecodeLookupReply(&r2);
    }
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  size_t chunk = (data[0] % 17) + 1;
  constexpr uint64_t kLimit = 1 << 16;
  FrameParser parser(kLimit);
  for (size_t off = 1; off < size; off += chunk) {
    parser.Append(std::span<const uint8_t>(data + off, std::min(chunk, size - off)));
    for (;;) {
      Frame f;
      auto got = parser.Next(&f);
      if (!got.ok() || !*got) break;
      if (f.body.size() + kHeaderBytes > kLimit) __builtin_trap();
      DecodeBody(f);
    }
  }
  return 0;
}
