#include "common/status.h"

#include <gtest/gtest.h>

#include "common/clock.h"

namespace kvtier {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd");
  return x / 2;
}

Status Quarter(int x, int* out) {
  KVTIER_ASSIGN_OR_RETURN(int h, Half(x));
  KVTIER_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(Status, OkAndCodes) {
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok().ToString(), "ok");
  Status s = Status::Corruption("bad magic");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.IsCorruption());
  EXPECT_EQ(s.ToString(), "corruption: bad magic");
  EXPECT_EQ(s.WithContext("unit 3").ToString(), "corruption: unit 3: bad magic");
  EXPECT_EQ(StatusCodeName(StatusCode::kPermissionDenied), "permission_denied");
}

TEST(Status, StatusOrPropagates) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = Quarter(6, &out);
  EXPECT_TRUE(s.IsInvalidArgument());
  StatusOr<int> from_ok(Status::Ok());
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

TEST(Clock, ManualClockMovesOnlyWhenTold) {
  ManualClock clock(1000);
  EXPECT_EQ(clock.NowUs(), 1000u);
  clock.AdvanceMs(2);
  EXPECT_EQ(clock.NowUs(), 3000u);
  EXPECT_EQ(clock.NowMs(), 3u);
  const Clock& steady = DefaultSteadyClock();
  uint64_t a = steady.NowUs();
  EXPECT_GE(steady.NowUs(), a);
}

}  // namespace
}  // namespace kvtier
