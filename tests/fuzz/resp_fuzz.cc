// libFuzzer target: the RESP request parser, fed in chunks (sizes from the first byte), with
// small limits so limit paths are reached. Invariants: no crash, no out-of-bounds read, no
// command beyond the argument and bulk limits, and a failed parser stays failed.
#include <cstddef>
#include <cstdint>

#include "cache_daemon/resp.h"

using namespace kvtier::daemon::resp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  size_t chunk = (data[0] % 23) + 1;
  RespLimits limits{.max_args = 16, .max_bulk_bytes = 512, .max_inline_bytes = 256};
  RespParser parser(limits);
  std::vector<std::string> argv;
  bool failed = false;
  for (size_t off = 1; off < size; off += chunk) {
    parser.Append(std::span<const uint8_t>(data + off, std::min(chunk, size - off)));
    for (;;) {
      auto got = parser.Next(&argv);
      if (!got.ok()) {
        failed = true;
        break;
      }
      if (failed) __builtin_trap();  // a failed parser must never yield a command again
      if (!*got) break;
      if (argv.size() > limits.max_args) __builtin_trap();
      for (const std::string& a : argv) {
        if (a.size() > limits.max_bulk_bytes + limits.max_inline_bytes) __builtin_trap();
      }
    }
  }
  std::string out;
  AppendError(std::string_view(reinterpret_cast<const char*>(data), size), &out);
  return 0;
}
