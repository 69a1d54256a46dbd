// The crash driver's judge (crash_model.h) and value format (crash_value.h) on hand-made
// histories: what each durability mode allows after a kill, and what it never allows.
#include "tests/crash/crash_model.h"

#include <gtest/gtest.h>

#include "tests/crash/crash_value.h"

namespace kvtier::crash {
namespace {

constexpr int64_t kMs = 1000;
constexpr int64_t kKill = 1'000'000 * kMs;

KeyState V(uint64_t v) { return KeyState{true, v}; }
const KeyState kAbsent{};

Observation Got(const KeyState& s) {
  Observation o;
  o.state = s;
  return o;
}

CheckContext Ctx(Mode mode, int64_t window_ms = 0, bool durable = true) {
  CheckContext c;
  c.mode = mode;
  c.kill_us = kKill;
  c.window_us = window_ms * kMs;
  c.durable_key = durable;
  return c;
}

// A put of the next version acknowledged at kill + at_ms (negative: before the kill).
void AckedPut(KeyHistory* h, int64_t at_ms) {
  size_t op = h->Begin(V(h->NextVersion()), "put", kKill + at_ms * kMs - 50);
  h->Ack(op, kKill + at_ms * kMs);
}
void AckedDel(KeyHistory* h, int64_t at_ms) {
  size_t op = h->Begin(kAbsent, "del", kKill + at_ms * kMs - 50);
  h->Ack(op, kKill + at_ms * kMs);
}

KeyHistory Fresh() {
  KeyHistory h;
  h.Reset(kAbsent, kKill - 10'000 * kMs);
  return h;
}

TEST(CrashModelTest, SyncKeepsEveryAcknowledgedPut) {
  KeyHistory h = Fresh();
  AckedPut(&h, -500);
  AckedPut(&h, -1);
  EXPECT_EQ(Check(h, Got(V(2)), Ctx(Mode::kSync)).verdict, Verdict::kExact);
  CheckResult lost = Check(h, Got(kAbsent), Ctx(Mode::kSync));
  EXPECT_EQ(lost.verdict, Verdict::kLost);
  EXPECT_NE(lost.detail.find("v2 (put acked 1.0 ms before the kill)"), std::string::npos)
      << lost.detail;
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kSync)).verdict, Verdict::kStale);
}

TEST(CrashModelTest, SyncCountsAnAckReadAfterTheKill) {
  // The daemon sent the reply before it died: the write was durable.
  KeyHistory h = Fresh();
  AckedPut(&h, +3);
  EXPECT_EQ(Check(h, Got(kAbsent), Ctx(Mode::kSync)).verdict, Verdict::kLost);
}

TEST(CrashModelTest, SyncKeepsDeletesDeleted) {
  KeyHistory h = Fresh();
  AckedPut(&h, -900);
  AckedDel(&h, -800);
  EXPECT_EQ(Check(h, Got(kAbsent), Ctx(Mode::kSync)).verdict, Verdict::kExact);
  CheckResult r = Check(h, Got(V(1)), Ctx(Mode::kSync));
  EXPECT_EQ(r.verdict, Verdict::kResurrected);
  EXPECT_NE(r.detail.find("absent (del acked 800.0 ms before the kill)"), std::string::npos)
      << r.detail;
}

TEST(CrashModelTest, InFlightWriteMayLeaveOldOrNewButNothingElse) {
  KeyHistory h = Fresh();
  AckedPut(&h, -100);
  AckedPut(&h, -50);
  h.Begin(V(h.NextVersion()), "put", kKill - 2 * kMs);  // v3 in flight
  for (Mode m : {Mode::kSync, Mode::kBatched}) {
    EXPECT_EQ(Check(h, Got(V(2)), Ctx(m)).verdict, Verdict::kExact);
    EXPECT_EQ(Check(h, Got(V(3)), Ctx(m)).verdict, Verdict::kInFlight);
    EXPECT_EQ(Check(h, Got(V(1)), Ctx(m)).verdict, Verdict::kStale);
    EXPECT_EQ(Check(h, Got(kAbsent), Ctx(m)).verdict, Verdict::kLost);
  }
  // An in-flight delete: absent or the old value.
  KeyHistory d = Fresh();
  AckedPut(&d, -100);
  d.Begin(kAbsent, "del", kKill - kMs);
  EXPECT_EQ(Check(d, Got(kAbsent), Ctx(Mode::kSync)).verdict, Verdict::kInFlight);
  EXPECT_EQ(Check(d, Got(V(1)), Ctx(Mode::kSync)).verdict, Verdict::kExact);
}

TEST(CrashModelTest, FailedWriteMayOrMayNotHaveApplied) {
  KeyHistory h = Fresh();
  AckedPut(&h, -100);
  size_t op = h.Begin(V(h.NextVersion()), "put", kKill - 90 * kMs);
  h.Fail(op);
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kSync)).verdict, Verdict::kExact);
  EXPECT_EQ(Check(h, Got(V(2)), Ctx(Mode::kSync)).verdict, Verdict::kInFlight);
}

TEST(CrashModelTest, BatchedMayLoseOnlyTheWindow) {
  KeyHistory h = Fresh();
  AckedPut(&h, -1000);  // v1: older than the window, must survive
  AckedPut(&h, -30);    // v2, v3: inside a 100 ms window
  AckedPut(&h, -5);
  CheckContext c = Ctx(Mode::kBatched, 100);
  EXPECT_EQ(Check(h, Got(V(3)), c).verdict, Verdict::kExact);
  EXPECT_EQ(Check(h, Got(V(2)), c).verdict, Verdict::kLostAllowed);
  EXPECT_EQ(Check(h, Got(V(1)), c).verdict, Verdict::kLostAllowed);
  CheckResult lost = Check(h, Got(kAbsent), c);
  EXPECT_EQ(lost.verdict, Verdict::kLost);
  EXPECT_NE(lost.detail.find("v1 (put acked 1000.0 ms before the kill)"), std::string::npos)
      << lost.detail;
  // With a window of 10 ms, v2 must survive.
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kBatched, 10)).verdict, Verdict::kStale);
}

TEST(CrashModelTest, BatchedDeletesStayDeletedOutsideTheWindow) {
  KeyHistory h = Fresh();
  AckedPut(&h, -2000);
  AckedDel(&h, -1000);
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kBatched, 100)).verdict, Verdict::kResurrected);
  // Inside the window the delete may be lost.
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kBatched, 1500)).verdict, Verdict::kLostAllowed);
}

TEST(CrashModelTest, BatchedObservationIsAnAcknowledgement) {
  // A state read back after a restart must itself survive a later crash (here 5 s later).
  KeyHistory h;
  h.NextVersion();
  h.NextVersion();
  h.Reset(V(2), kKill - 5000 * kMs);
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kBatched, 100)).verdict, Verdict::kStale);
  EXPECT_EQ(Check(h, Got(kAbsent), Ctx(Mode::kBatched, 100)).verdict, Verdict::kLost);
  // Read back 20 ms before the kill, inside the window: no obligation left.
  h.Reset(V(2), kKill - 20 * kMs);
  EXPECT_EQ(Check(h, Got(V(1)), Ctx(Mode::kBatched, 100)).verdict, Verdict::kLostAllowed);
}

TEST(CrashModelTest, NoneAndMemoryTierKeysMayLoseAnythingButNeverInvent) {
  KeyHistory h = Fresh();
  AckedPut(&h, -5000);
  AckedPut(&h, -4000);
  AckedDel(&h, -3000);
  for (CheckContext c : {Ctx(Mode::kNone), Ctx(Mode::kSync, 0, /*durable=*/false)}) {
    EXPECT_EQ(Check(h, Got(kAbsent), c).verdict, Verdict::kExact);
    EXPECT_EQ(Check(h, Got(V(1)), c).verdict, Verdict::kLostAllowed);
    EXPECT_EQ(Check(h, Got(V(2)), c).verdict, Verdict::kLostAllowed);
    CheckResult r = Check(h, Got(V(3)), c);
    EXPECT_EQ(r.verdict, Verdict::kWrongValue);
    EXPECT_NE(r.detail.find("never written"), std::string::npos) << r.detail;
  }
}

TEST(CrashModelTest, WrongValueIsAViolationInEveryMode) {
  KeyHistory h = Fresh();
  AckedPut(&h, -100);
  Observation torn;
  torn.wrong = true;
  torn.wrong_why = "checksum mismatch (torn or corrupt)";
  for (Mode m : {Mode::kNone, Mode::kBatched, Mode::kSync}) {
    CheckResult r = Check(h, torn, Ctx(m, 100));
    EXPECT_EQ(r.verdict, Verdict::kWrongValue) << ModeName(m);
    EXPECT_TRUE(IsViolation(r.verdict));
    EXPECT_EQ(r.detail, torn.wrong_why);
  }
}

TEST(CrashModelTest, DropsOnlyPendingOpsSentAfterTheDeath) {
  KeyHistory h = Fresh();
  AckedPut(&h, -100);
  h.Begin(V(h.NextVersion()), "put", kKill + 5 * kMs);  // sent after the death: never applied
  size_t late_ack = h.Begin(V(h.NextVersion()), "put", kKill + 6 * kMs);
  h.Ack(late_ack, kKill + 7 * kMs);
  h.DropPendingSentAfter(kKill + kMs);
  ASSERT_EQ(h.ops().size(), 3u);  // observed, v1, v3 (acked: kept)
  EXPECT_EQ(h.ops()[2].result, V(3));
  EXPECT_EQ(h.max_version(), 3u);  // versions are never reused
}

TEST(CrashValueTest, RoundTripAndCorruptionIsDetected) {
  std::vector<uint8_t> v = MakeValue(3, 17, 42, 1000);
  DecodedValue d = DecodeValue(v.data(), v.size());
  ASSERT_TRUE(d.ok) << d.error;
  EXPECT_EQ(d.front, 3);
  EXPECT_EQ(d.key_id, 17u);
  EXPECT_EQ(d.version, 42u);
  for (size_t at : {size_t{0}, size_t{9}, size_t{17}, size_t{500}, v.size() - 1}) {
    std::vector<uint8_t> bad = v;
    bad[at] ^= 0x20;
    EXPECT_FALSE(DecodeValue(bad.data(), bad.size()).ok) << "flip at " << at;
  }
  EXPECT_FALSE(DecodeValue(v.data(), v.size() - 8).ok);  // torn tail
  EXPECT_FALSE(DecodeValue(v.data(), 10).ok);
  // Another version's bytes under this version's header and checksum still fail.
  std::vector<uint8_t> other = MakeValue(3, 17, 43, 1000);
  std::copy(other.begin() + kValueHeaderBytes, other.end() - 8, v.begin() + kValueHeaderBytes);
  uint64_t sum = Fnv1a64(v.data(), v.size() - 8);
  std::memcpy(v.data() + v.size() - 8, &sum, 8);
  EXPECT_FALSE(DecodeValue(v.data(), v.size()).ok);
  std::vector<uint8_t> empty_body = MakeValue(1, 1, 1, 0);
  EXPECT_TRUE(DecodeValue(empty_body.data(), empty_body.size()).ok);
}

}  // namespace
}  // namespace kvtier::crash
