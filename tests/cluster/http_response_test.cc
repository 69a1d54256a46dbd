// HttpResponseParser: framing, limits, and the same outcome however the bytes are split.
#include "cluster/http_response.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvtier::cluster {
namespace {

constexpr uint64_t kHeadBytesMax = 64;
constexpr uint64_t kChunkBytesMax = 10;

struct Outcome {
  StatusCode code = StatusCode::kOk;  // the first error, or Closed()'s NotFound / IOError
  int status = 0;
  std::string body;
  bool operator==(const Outcome&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Outcome& o) {
  return os << "{code " << static_cast<int>(o.code) << ", status " << o.status << ", body '"
            << o.body << "'}";
}

// Feeds the pieces in order, then ends the connection.
Outcome Feed(const std::vector<std::string>& pieces) {
  HttpResponseParser parser(kHeadBytesMax, kChunkBytesMax);
  Outcome out;
  auto step = [&]() -> bool {
    Status head = parser.ParseHead();
    if (head.IsRetry()) return true;
    Status s = head.ok() ? parser.TakeBody(&out.body) : head;
    out.status = parser.status();
    out.code = s.code();
    return s.ok();
  };
  for (const std::string& piece : pieces) {
    parser.Append(piece);
    if (!step()) return out;
  }
  out.code = parser.Closed().code();
  return out;
}

// The whole response at once, and split at every position and every pair of positions,
// give the same outcome.
Outcome FeedEverySplit(const std::string& response) {
  const Outcome whole = Feed({response});
  for (size_t i = 0; i <= response.size(); ++i) {
    EXPECT_EQ(Feed({response.substr(0, i), response.substr(i)}), whole)
        << "split at " << i << " of " << response;
    for (size_t j = i; j <= response.size() && response.size() <= 160; j += 3) {
      EXPECT_EQ(Feed({response.substr(0, i), response.substr(i, j - i), response.substr(j)}), whole)
          << "split at " << i << ", " << j << " of " << response;
    }
  }
  std::vector<std::string> bytes;
  for (char c : response) bytes.emplace_back(1, c);
  EXPECT_EQ(Feed(bytes), whole) << "byte by byte: " << response;
  return whole;
}

TEST(HttpResponseTest, FramesBodiesTheSameHoweverTheBytesArrive) {
  struct Case {
    std::string response;
    Outcome want;
  };
  const Case cases[] = {
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, "
       "world\r\n0\r\n\r\n",
       {StatusCode::kNotFound, 200, "hello, world"}},
      {"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabcdef",
       {StatusCode::kNotFound, 404, "abc"}},
      {"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", {StatusCode::kNotFound, 200, ""}},
      {"HTTP/1.0 200 OK\r\n\r\nuntil the end", {StatusCode::kNotFound, 200, "until the end"}},
      {"HTTP/1.1 204\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
       {StatusCode::kNotFound, 204, ""}},
      // Cut short.
      {"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab", {StatusCode::kIOError, 200, "ab"}},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc",
       {StatusCode::kIOError, 200, "abc"}},
      {"HTTP/1.1 200 OK\r\nX: y\r\n", {StatusCode::kIOError, 0, ""}},
      // Malformed.
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
       {StatusCode::kCorruption, 200, ""}},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY",
       {StatusCode::kCorruption, 200, "abc"}},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n",
       {StatusCode::kCorruption, 200, ""}},
      {"SMTP ready\r\n\r\n", {StatusCode::kCorruption, 0, ""}},
      {"HTTP/1.1 2000 OK\r\n\r\n", {StatusCode::kCorruption, 0, ""}},
      {"HTTP/1.1 099 OK\r\n\r\n", {StatusCode::kCorruption, 0, ""}},
      {"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", {StatusCode::kCorruption, 200, ""}},
      {"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", {StatusCode::kCorruption, 200, ""}},
      {"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
       {StatusCode::kCorruption, 200, ""}},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", {StatusCode::kCorruption, 200, ""}},
      {"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", {StatusCode::kCorruption, 200, ""}},
      // Over a limit.
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFF\r\n",
       {StatusCode::kRejected, 200, ""}},
      {"HTTP/1.1 200 OK\r\nX: " + std::string(60, 'a') + "\r\n\r\n",
       {StatusCode::kRejected, 0, ""}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FeedEverySplit(c.response), c.want) << c.response;
  }
}

// The limits hold at their edges whichever way the bytes are split: a head of exactly
// head_bytes_max is read (and one byte more refused) even when its blank line arrives late,
// and a chunk-size line is judged by its length, not by how much of it came at once.
TEST(HttpResponseTest, LimitsHoldAtTheirEdgesForEverySplit) {
  const std::string status = "HTTP/1.1 200 OK\r\nX: ";
  const std::string at_limit = status + std::string(kHeadBytesMax - status.size(), 'a');
  ASSERT_EQ(at_limit.size(), kHeadBytesMax);
  EXPECT_EQ(FeedEverySplit(at_limit + "\r\n\r\nbody"),
            (Outcome{StatusCode::kNotFound, 200, "body"}));
  EXPECT_EQ(FeedEverySplit(at_limit + "a\r\n\r\nbody"), (Outcome{StatusCode::kRejected, 0, ""}));

  const std::string chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
  // A size line of exactly kChunkLineBytesMax bytes (zeros, then the size) is read...
  const std::string longest =
      std::string(HttpResponseParser::kChunkLineBytesMax - 1, '0') + "3\r\nabc\r\n0\r\n\r\n";
  EXPECT_EQ(Feed({chunked + longest}), (Outcome{StatusCode::kNotFound, 200, "abc"}));
  for (size_t cut : {size_t{700}, size_t{1024}, size_t{1025}, size_t{1026}}) {
    EXPECT_EQ(Feed({chunked, longest.substr(0, cut), longest.substr(cut)}),
              (Outcome{StatusCode::kNotFound, 200, "abc"}))
        << cut;
  }
  // ... and one a byte longer is refused, whether its end came with it or not.
  const std::string over = "0" + longest;
  EXPECT_EQ(Feed({chunked + over}), (Outcome{StatusCode::kCorruption, 200, ""}));
  for (size_t cut : {size_t{1023}, size_t{1024}, size_t{1025}, size_t{1026}}) {
    EXPECT_EQ(Feed({chunked, over.substr(0, cut), over.substr(cut)}),
              (Outcome{StatusCode::kCorruption, 200, ""}))
        << cut;
  }
}

TEST(HttpResponseTest, ErrorsAreStickyAndTakeBodyNeedsTheHead) {
  HttpResponseParser parser(kHeadBytesMax, kChunkBytesMax);
  std::string body;
  EXPECT_EQ(parser.TakeBody(&body).code(), StatusCode::kInvalidArgument);
  parser.Append("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
  ASSERT_TRUE(parser.ParseHead().ok());
  EXPECT_TRUE(parser.TakeBody(&body).IsCorruption());
  parser.Append("0\r\n\r\n");
  EXPECT_TRUE(parser.TakeBody(&body).IsCorruption());
  EXPECT_TRUE(parser.ParseHead().IsCorruption());
  EXPECT_TRUE(parser.Closed().IsCorruption());
}

}  // namespace
}  // namespace kvtier::cluster
