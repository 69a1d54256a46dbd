// libFuzzer target: the HTTP/1.1 response parser (cluster/http_response.h) that reads every
// reply from etcd and every member's /readyz and /metrics. Whatever answers at those addresses
// can send anything.
//
// Input: two bytes choosing where to cut, then the response bytes.
// Invariants, beyond no crash, no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - the outcome (the first error or the end's Status, the status code, the body bytes) is the
//     same for the whole response at once, cut in three at the chosen places, and (for inputs of
//     at most 2 KB) byte by byte;
//   - the body is never longer than the bytes after the head, and a parsed status code is
//     200..599.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_http_response_fuzz
//   build/fuzz/tests/fuzz/kvtier_http_response_fuzz -max_total_time=60 NEW_CORPUS_DIR \
//       tests/fuzz/seeds/http_response
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cluster/http_response.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::Status;
using kvtier::StatusCode;
using kvtier::cluster::HttpResponseParser;
using kvtier::fuzz::Require;

// Small limits, so that inputs reach them.
constexpr uint64_t kHeadBytesMax = 256;
constexpr uint64_t kChunkBytesMax = 64;

struct Outcome {
  StatusCode code = StatusCode::kOk;
  int status = 0;
  std::string body;
  bool operator==(const Outcome&) const = default;
};

Outcome Feed(const std::vector<std::string_view>& pieces) {
  HttpResponseParser parser(kHeadBytesMax, kChunkBytesMax);
  Outcome out;
  for (std::string_view piece : pieces) {
    parser.Append(piece);
    Status head = parser.ParseHead();
    if (head.IsRetry()) continue;
    Status s = head.ok() ? parser.TakeBody(&out.body) : head;
    out.status = parser.status();
    if (!s.ok()) {
      out.code = s.code();
      return out;
    }
  }
  out.code = parser.Closed().code();
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::string_view response(reinterpret_cast<const char*>(data) + 2, size - 2);
  const size_t a = data[0] * response.size() / 255, b = data[1] * response.size() / 255;
  const size_t first = a < b ? a : b, second = a < b ? b : a;

  const Outcome whole = Feed({response});
  Require(whole.body.size() <= response.size());
  Require(whole.status == 0 || (whole.status >= 200 && whole.status <= 599));
  Require(whole.code != StatusCode::kOk && whole.code != StatusCode::kRetry);

  const Outcome cut = Feed(
      {response.substr(0, first), response.substr(first, second - first), response.substr(second)});
  Require(cut == whole);
  if (response.size() <= 2048) {
    std::vector<std::string_view> bytes;
    for (size_t i = 0; i < response.size(); ++i) bytes.push_back(response.substr(i, 1));
    Require(Feed(bytes) == whole);
  }
  return 0;
}
