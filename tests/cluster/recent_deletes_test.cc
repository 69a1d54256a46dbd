// cluster/recent_deletes: the fence that refuses a repair copy of a unit deleted moments ago,
// and the repair flag of a peer PUT on the wire.
#include "cluster/recent_deletes.h"

#include <gtest/gtest.h>

#include "cluster/peer_wire.h"

namespace kvtier::cluster {
namespace {

uint64_t g_now_ms = 1000;
uint64_t FakeNow() { return g_now_ms; }

PeerKey K(uint8_t b) {
  PeerKey k{};
  k.fill(b);
  return k;
}

TEST(RecentDeletes, RefusesACopyOfAKeyDeletedWithinTheWindowOnly) {
  g_now_ms = 1000;
  RecentDeletes fence(RecentDeletesOptions{.window_ms = 100, .keys_max = 16});
  fence.SetClockForTest(FakeNow);
  const PeerKey gone = K(1);
  EXPECT_FALSE(fence.RefusesRepair(gone, "alice"));
  fence.NoteKeys(std::span<const PeerKey>(&gone, 1));
  EXPECT_TRUE(fence.RefusesRepair(gone, "alice"));
  EXPECT_FALSE(fence.RefusesRepair(K(2), "alice"));  // another key
  g_now_ms += 99;
  EXPECT_TRUE(fence.RefusesRepair(gone, "alice"));
  g_now_ms += 1;  // the window is over: a unit written again may be copied
  EXPECT_FALSE(fence.RefusesRepair(gone, "alice"));
  EXPECT_EQ(fence.refused(), 2u);
}

// The GET copies' overwrite fence: only a note at or after the fetch began refuses it, and
// Noted / NotedSince do not count as refused repair copies.
TEST(RecentDeletes, NotedSinceRefusesOnlyFetchesThatBeganBeforeTheNote) {
  g_now_ms = 1000;
  RecentDeletes fence(RecentDeletesOptions{.window_ms = 100, .keys_max = 16});
  fence.SetClockForTest(FakeNow);
  const PeerKey k = K(3);
  fence.NoteKeys(std::span<const PeerKey>(&k, 1));   // noted at 1000
  EXPECT_TRUE(fence.NotedSince(k, "alice", 1000));   // began at the note: refused
  EXPECT_TRUE(fence.NotedSince(k, "alice", 990));    // began before it: refused
  EXPECT_FALSE(fence.NotedSince(k, "alice", 1001));  // began after it: read the new value
  EXPECT_FALSE(fence.NotedSince(K(4), "alice", 0));
  EXPECT_TRUE(fence.Noted(k, "alice"));
  fence.NoteTenant("bob");
  EXPECT_TRUE(fence.NotedSince(K(4), "bob", 1000));
  EXPECT_FALSE(fence.NotedSince(K(4), "bob", 1001));
  EXPECT_EQ(fence.refused(), 0u);
}

TEST(RecentDeletes, ANoteAgainRestartsTheWindow) {
  g_now_ms = 1000;
  RecentDeletes fence(RecentDeletesOptions{.window_ms = 100, .keys_max = 16});
  fence.SetClockForTest(FakeNow);
  const PeerKey k = K(1);
  fence.NoteKeys(std::span<const PeerKey>(&k, 1));
  g_now_ms += 60;
  fence.NoteKeys(std::span<const PeerKey>(&k, 1));
  g_now_ms += 60;  // 120 ms after the first note, 60 after the second
  EXPECT_TRUE(fence.RefusesRepair(k, "alice"));
}

TEST(RecentDeletes, ATenantDeleteFencesEveryKeyOfThatTenantOnly) {
  g_now_ms = 1000;
  RecentDeletes fence(RecentDeletesOptions{.window_ms = 100, .keys_max = 16});
  fence.SetClockForTest(FakeNow);
  fence.NoteTenant("bob");
  EXPECT_TRUE(fence.RefusesRepair(K(7), "bob"));
  EXPECT_FALSE(fence.RefusesRepair(K(7), "alice"));
  g_now_ms += 100;
  EXPECT_FALSE(fence.RefusesRepair(K(7), "bob"));
}

TEST(RecentDeletes, OverItsBoundItRefusesEveryCopyForAWindow) {
  g_now_ms = 1000;
  RecentDeletes fence(RecentDeletesOptions{.window_ms = 100, .keys_max = 2});
  fence.SetClockForTest(FakeNow);
  const PeerKey keys[] = {K(1), K(2), K(3)};
  fence.NoteKeys(keys);  // the third does not fit
  EXPECT_TRUE(fence.RefusesRepair(K(3), "alice"));
  EXPECT_TRUE(fence.RefusesRepair(K(9), "alice"));  // not noted, still fenced: safe
  g_now_ms += 100;
  EXPECT_FALSE(fence.RefusesRepair(K(9), "alice"));
}

TEST(PeerWire, ThePutsRepairFlagRoundTripsBesideAllowSsd) {
  for (bool repair : {false, true}) {
    for (uint8_t allow_ssd : {0, 1}) {
      PeerPut put{.allow_ssd = allow_ssd, .repair = repair, .tenant = "t", .key = K(4)};
      auto decoded = DecodePeerPut(EncodePeerPut(put));
      ASSERT_TRUE(decoded.ok()) << decoded.status().message();
      EXPECT_EQ(decoded->repair, repair);
      EXPECT_EQ(decoded->allow_ssd, allow_ssd);
    }
  }
  std::vector<uint8_t> bytes = EncodePeerPut(PeerPut{.tenant = "t"});
  bytes[2] = 4;  // an unknown flag bit
  EXPECT_FALSE(DecodePeerPut(bytes).ok());
}

}  // namespace
}  // namespace kvtier::cluster
