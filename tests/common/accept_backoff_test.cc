#include "common/accept_backoff.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

namespace kvtier {
namespace {

using std::chrono::milliseconds;

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(AcceptBackoffTest, WaitsDoubleUpToTheMaximumAndStartAgainAfterASuccess) {
  ManualClock clock;
  AcceptBackoff b("test front", &clock);
  EXPECT_EQ(b.Failed(EMFILE), milliseconds(5));
  EXPECT_EQ(b.Failed(EMFILE), milliseconds(10));
  EXPECT_EQ(b.Failed(ENFILE), milliseconds(20));
  EXPECT_EQ(b.Failed(ENOBUFS), milliseconds(40));
  EXPECT_EQ(b.Failed(ENOMEM), milliseconds(80));
  EXPECT_EQ(b.Failed(EMFILE), AcceptBackoff::kWaitMax);
  EXPECT_EQ(b.Failed(EMFILE), AcceptBackoff::kWaitMax);
  b.Succeeded();
  EXPECT_EQ(b.Failed(EMFILE), AcceptBackoff::kFirstWait);
  EXPECT_EQ(b.waits_total(), 8u);
}

TEST(AcceptBackoffTest, AFailureOfOneConnectionAcceptsAgainAtOnce) {
  ManualClock clock;
  AcceptBackoff b("test front", &clock);
  for (int err : {ECONNABORTED, EPROTO, EINTR, EAGAIN, EPERM, ENETUNREACH, EHOSTUNREACH}) {
    EXPECT_EQ(b.Failed(err), milliseconds(0)) << err;
  }
  EXPECT_EQ(b.waits_total(), 0u);
  // Nor does one end a run of resource failures.
  EXPECT_EQ(b.Failed(EMFILE), milliseconds(5));
  EXPECT_EQ(b.Failed(ECONNABORTED), milliseconds(0));
  EXPECT_EQ(b.Failed(EMFILE), milliseconds(10));
  // An error this class does not know waits too: retrying it at once could spin.
  EXPECT_EQ(b.Failed(EBADF), milliseconds(20));
}

// A later step of taking a connection (starting its thread) that fails for want of a resource
// pauses too, even with an errno that Failed() would take as that connection's (EAGAIN from
// pthread_create), and says which step failed.
TEST(AcceptBackoffTest, AFailedLaterStepPausesAndIsNamed) {
  ManualClock clock;
  AcceptBackoff b("test front", &clock);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(b.Pause(EAGAIN, "starting a connection thread"), milliseconds(5));
  EXPECT_EQ(b.Failed(EMFILE), milliseconds(10));
  b.Succeeded();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(Count(log,
                  "test front: starting a connection thread failed: Resource temporarily "
                  "unavailable; pausing accepts"),
            1u)
      << log;
  EXPECT_EQ(Count(log, "accepting again after 2 failures"), 1u) << log;
  EXPECT_EQ(b.waits_total(), 2u);
}

TEST(AcceptBackoffTest, LogsAtMostAWarningAndARecoveryPerInterval) {
  ManualClock clock(1'000'000'000);
  AcceptBackoff b("test front", &clock);
  ::testing::internal::CaptureStderr();
  // A run of failures: one warning, one line when it ends.
  for (int i = 0; i < 50; ++i) (void)b.Failed(EMFILE);
  b.Succeeded();
  // The table fills again at once, many times (a freed descriptor taken each time): quiet.
  for (int i = 0; i < 20; ++i) {
    clock.AdvanceUs(100'000);
    (void)b.Failed(EMFILE);
    b.Succeeded();
  }
  const std::string quiet = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(Count(quiet, "test front: accept failed: Too many open files"), 1u) << quiet;
  EXPECT_EQ(Count(quiet, "test front: accepting again after 50 failures"), 1u) << quiet;
  EXPECT_EQ(Count(quiet, "accepting again"), 1u) << quiet;

  // An interval after the last warning, the next run warns again, counting every failure
  // since that warning: the rest of its run (49), the quiet runs (20) and this one.
  ::testing::internal::CaptureStderr();
  clock.AdvanceUs(AcceptBackoff::kWarnIntervalMs * 1000);
  (void)b.Failed(ENFILE);
  b.Succeeded();
  const std::string again = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(Count(again, "accept failed: Too many open files in system"), 1u) << again;
  EXPECT_EQ(Count(again, "(70 failures since the last warning)"), 1u) << again;
  EXPECT_EQ(Count(again, "accepting again after 1 failures"), 1u) << again;
}

}  // namespace
}  // namespace kvtier
