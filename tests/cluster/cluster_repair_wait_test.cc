// The repair scan's wait after work that only waits (docs/CLUSTER.md, "Repair"): a copy an
// owner refused because it deleted the unit moments ago, and a hand-over waiting for another
// holder's copy, are looked at again within RepairOptions::waiting_retry_max_ms of the wait's
// end, not after a back-off doubled up to the full-scan interval. The cluster judge found the
// doubled back-off: a move reported for over a minute after refusals during a join, while
// the refusal window itself is 10 s.
//
// In process (tests/cluster/node_fixture.h): node y's store, router and peer client with a
// real etcd, its repair scan, and two in-memory peers; the scan's first retry is at 50 ms and
// a wait of 3.3 s is where a doubled back-off (50 ms, 100 ms, ... 3.2 s) would be asleep for
// three seconds more.
#include <chrono>
#include <thread>

#include "cache_daemon/cluster_repair.h"
#include "common/clock.h"
#include "tests/cluster/node_fixture.h"

namespace kvtier::cluster {
namespace {

constexpr uint64_t kWaitMs = 3300;
// How late after the wait's end the work may be done: the back-off cap (200 ms) plus room
// for a loaded machine; a doubled back-off is about 3,000 ms late.
constexpr uint64_t kLateMaxMs = 1500;

class RepairWaitTest : public NodeFixture {
 protected:
  daemon::RepairOptions Options() const {
    daemon::RepairOptions o;
    o.retry_ms = 50;
    o.interval_s = 300;
    o.waiting_retry_max_ms = 200;
    return o;
  }
  void PutIntoY(const PeerKey& key, const std::vector<uint8_t>& value) {
    storage::PutOptions po;
    po.tenant = tenant_->id;
    ASSERT_TRUE(store_->Put(key, value, po).ok());
  }
};

// y owns the key with peer p; p refuses y's repair copy for 3.3 s (it deleted the unit
// moments ago), then takes it.
TEST_F(RepairWaitTest, ACopyRefusedForARecentDeleteIsTakenSoonAfterTheRefusalEnds) {
  const auto [chain, key, p] = OwnedByYAndOnePeer();
  ASSERT_NE(p, nullptr);
  PutIntoY(key, Bytes(5));
  const uint64_t refusal_ends_ms = DefaultSteadyClock().NowMs() + kWaitMs;
  p->RefuseRepairUntil(refusal_ends_ms);
  daemon::ClusterRepair repair(store_.get(), tenants_.get(), router_.get(), client_.get(),
                               Options());
  repair.Start();
  ASSERT_TRUE(kt::WaitFor([&] { return !p->Held(key).empty(); }, 20000)) << "never copied";
  const uint64_t copied_ms = DefaultSteadyClock().NowMs();
  repair.Stop();
  EXPECT_EQ(p->Held(key), Bytes(5));
  EXPECT_GE(p->repair_puts(), 2u) << "the first copy was not refused";
  EXPECT_GE(repair.stats().copy_failures_total, 1u);
  EXPECT_LE(copied_ms - refusal_ends_ms, kLateMaxMs)
      << "the copy was taken " << copied_ms - refusal_ends_ms << " ms after the refusal ended";
}

// y holds a unit it no longer owns; owner a holds it too (so a sends: y only waits), owner b
// lacks it until a's copy lands 3.3 s later. y hands over (drops its unit) soon after.
TEST_F(RepairWaitTest, AHandOverWaitingForAnotherHoldersCopyEndsSoonAfterIt) {
  std::vector<HookPeer*> owners;
  const Key chain = ChainOwnedByY(false, 0, &owners);
  ASSERT_EQ(owners.size(), 2u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  PutIntoY(key, Bytes(6));
  owners[0]->Set(key, Bytes(6));
  const uint64_t lookups_before = owners[1]->lookups();
  daemon::ClusterRepair repair(store_.get(), tenants_.get(), router_.get(), client_.get(),
                               Options());
  repair.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(kWaitMs));
  owners[1]->Set(key, Bytes(6));  // the other holder's copy lands
  const uint64_t landed_ms = DefaultSteadyClock().NowMs();
  ASSERT_TRUE(kt::WaitFor([&] { return HeldByY(chain).empty(); }, 20000)) << "never handed over";
  const uint64_t dropped_ms = DefaultSteadyClock().NowMs();
  repair.Stop();
  EXPECT_GT(owners[1]->lookups(), lookups_before) << "y never asked the owner that lacked it";
  EXPECT_EQ(owners[1]->repair_puts(), 0u) << "y sent a copy another holder was to send";
  EXPECT_EQ(repair.stats().moves_in_progress, 0u);
  EXPECT_EQ(repair.stats().dropped_total, 1u);
  EXPECT_LE(dropped_ms - landed_ms, kLateMaxMs)
      << "handed over " << dropped_ms - landed_ms << " ms after the copy landed";
}

// y holds a unit it does not own; a delete removes it between the scan's first pass (which
// counts the moves) and its second (which makes them). The scan leaves nothing to do, so the
// next is a full interval away: the moves gauge must say 0 now, not the first pass's 1 (the
// cluster judge waited a minute on such a gauge, seed 606).
TEST_F(RepairWaitTest, AUnitDeletedBetweenTheTwoPassesIsNoLongerReportedAsAMove) {
  std::vector<HookPeer*> owners;
  const Key chain = ChainOwnedByY(false, 0, &owners);
  ASSERT_EQ(owners.size(), 2u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  PutIntoY(key, Bytes(7));
  HookedStore hooked(store_.get());
  hooked.BeforeFreshListing(2, [&] { ASSERT_TRUE(store_->Delete(key).ok()); });
  daemon::ClusterRepair repair(&hooked, tenants_.get(), router_.get(), client_.get(), Options());
  repair.Start();
  ASSERT_TRUE(kt::WaitFor([&] { return repair.stats().scans_total >= 1; }, 20000));
  const daemon::RepairStats stats = repair.stats();
  repair.Stop();
  EXPECT_TRUE(HeldByY(chain).empty());
  EXPECT_EQ(owners[0]->repair_puts() + owners[1]->repair_puts(), 0u);
  EXPECT_EQ(stats.moves_in_progress, 0u) << "a move reported for a unit no longer held";
  EXPECT_EQ(stats.scans_total, 1u) << "the scan left work";
}

}  // namespace
}  // namespace kvtier::cluster
