// The prefix layer's three rules, one test each, plus its bounds on hostile parent links.
#include "policies/prefix_layer/prefix_layer.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "policies/arc/arc.h"
#include "policies/gdsf/gdsf.h"
#include "policies/lfu/lfu.h"
#include "policies/long_tail/long_tail.h"
#include "policies/lru/lru.h"
#include "policies/s3fifo/s3fifo.h"

namespace kvtier::policies {
namespace {

// LRU that logs the calls reaching it.
class LoggingLru final : public EvictionPolicy {
 public:
  explicit LoggingLru(std::vector<std::string>* log) : log_(log) {}
  std::string_view Name() const override { return "logging-lru"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override {
    log_->push_back("insert " + std::to_string(info.id));
    lru_.OnInsert(info, now_us);
  }
  void OnAccess(ObjectId id, uint64_t now_us) override {
    log_->push_back("access " + std::to_string(id));
    lru_.OnAccess(id, now_us);
  }
  void OnRemove(ObjectId id) override {
    log_->push_back("remove " + std::to_string(id));
    lru_.OnRemove(id);
  }
  void OnMiss(ObjectId id, uint64_t) override { log_->push_back("miss " + std::to_string(id)); }
  void OnRequest(uint64_t) override { log_->push_back("request"); }
  std::optional<ObjectId> Evict(uint64_t now_us) override { return lru_.Evict(now_us); }
  size_t Size() const override { return lru_.Size(); }
  bool Contains(ObjectId id) const override { return lru_.Contains(id); }

 private:
  std::vector<std::string>* log_;
  LruPolicy lru_;
};

ObjectInfo Unit(ObjectId id, ObjectId parent = kNoParent) {
  return ObjectInfo{.id = id, .size_bytes = 1, .parent_id = parent};
}

// Rule 3: LRU's victim is the chain's root (least recently used); the layer evicts the chain
// from its leaf up, and the root stays cached until last.
TEST(PrefixLayer, LeafIsEvictedBeforeItsParent) {
  std::vector<std::string> log;
  PrefixLayer layer(std::make_unique<LoggingLru>(&log));
  layer.BeginRequest(1, 0);
  layer.OnInsert(Unit(1), 0);
  layer.OnInsert(Unit(2, 1), 0);
  layer.OnInsert(Unit(3, 2), 0);
  layer.OnInsert(Unit(4, 2), 0);                          // a second branch under 2
  layer.BeginRequest(2, 1);                               // nothing held any more
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(3));  // 1 chosen; 1 -> 2 -> 3 (smaller id)
  EXPECT_TRUE(layer.Contains(1));
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(4));
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(2));
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(1));
  EXPECT_EQ(layer.Evict(1), std::nullopt);
  EXPECT_EQ(layer.leaf_swaps(), 3u);
}

// Rule 2: the running request's units are given back; a request resumed after another one
// holds its units again; a new request holds nothing of the others'.
TEST(PrefixLayer, RunningRequestsUnitsAreNotVictims) {
  std::vector<std::string> log;
  PrefixLayer layer(std::make_unique<LoggingLru>(&log));
  layer.BeginRequest(10, 0);
  layer.OnInsert(Unit(1), 0);
  layer.OnInsert(Unit(2), 0);
  layer.BeginRequest(20, 1);
  layer.OnInsert(Unit(9), 1);
  layer.BeginRequest(10, 2);  // request 10 resumes: 1 and 2 are held again
  EXPECT_EQ(layer.Evict(2), std::optional<ObjectId>(9));
  EXPECT_EQ(layer.held_given_back(), 2u);
  EXPECT_TRUE(layer.Contains(1));
  EXPECT_TRUE(layer.Contains(2));
  layer.BeginRequest(30, 3);  // a new request: LRU order again (1 was given back first)
  EXPECT_EQ(layer.Evict(3), std::optional<ObjectId>(1));
  // With every unit held, the victim goes all the same after one round of give-backs.
  layer.BeginRequest(40, 4);
  layer.OnAccess(2, 4);
  EXPECT_EQ(layer.Evict(4), std::optional<ObjectId>(2));
}

// Rule 1: hits reported in prefix order reach the inner policy deepest first, before the
// request's next call of another kind; so the root is the most recently used.
TEST(PrefixLayer, HitsReachThePolicyDeepestFirst) {
  std::vector<std::string> log;
  PrefixLayer layer(std::make_unique<LoggingLru>(&log));
  layer.BeginRequest(1, 0);
  for (ObjectId id = 1; id <= 3; ++id) layer.OnInsert(Unit(id, id - 1), 0);
  layer.OnInsert(Unit(7), 0);
  layer.BeginRequest(2, 1);
  log.clear();
  layer.OnAccess(1, 1);
  layer.OnAccess(2, 1);
  layer.OnAccess(3, 1);
  EXPECT_TRUE(log.empty());  // held back
  layer.OnMiss(4, 1);
  EXPECT_EQ(log, (std::vector<std::string>{"access 3", "access 2", "access 1", "miss 4"}));
  // A new request also delivers the previous one's hits first.
  log.clear();
  layer.OnAccess(7, 1);
  layer.OnAccess(1, 1);
  layer.BeginRequest(3, 2);
  EXPECT_EQ(log, (std::vector<std::string>{"access 1", "access 7", "request"}));
}

// A victim the layer keeps (rule 2 or 3) goes back to the inner policy as it was: what its
// eviction recorded (a ghost) is forgotten, and a ghost-hit hint that OnMiss gave for the unit
// about to be inserted stays that unit's. Before, the layer gave a victim back as OnRemove +
// OnInsert: long-tail's OnRemove ignores an id it no longer caches, so the ghost its eviction
// left made the re-insert a ghost hit (the hit class climbed at every give-back, and the model
// counted a reuse that never happened); ARC's and S3-FIFO's re-insert took the hint, so the
// kept victim moved to T2 / main and the real ghost hit went to T1 / small.
constexpr uint64_t kSecUs = 1000 * 1000;

// Rule 3 on long-tail: the oldest leaf-class unit (1) has a child; the child goes, and 1 stays
// in its class however often that happens.
TEST(PrefixLayerGiveBack, LongTailLeafSwapKeepsTheVictimsClass) {
  auto owned = std::make_unique<LongTailPolicy>();
  LongTailPolicy* lt = owned.get();
  PrefixLayer layer(std::move(owned));
  layer.BeginRequest(1, 0);
  layer.OnInsert(Unit(1), 0);
  for (ObjectId id = 2; id <= 4; ++id) {  // one request per unit: 1 <- 2 <- 3 <- 4
    layer.BeginRequest(id, id * kSecUs);
    layer.OnInsert(Unit(id, id - 1), id * kSecUs);
  }
  layer.BeginRequest(10, 100 * kSecUs);
  ASSERT_EQ(lt->TEST_ClassOf(1), LongTailPolicy::kLeaf);
  EXPECT_EQ(layer.Evict(100 * kSecUs), std::optional<ObjectId>(4));
  EXPECT_EQ(layer.Evict(100 * kSecUs), std::optional<ObjectId>(3));
  EXPECT_EQ(layer.Evict(100 * kSecUs), std::optional<ObjectId>(2));
  EXPECT_EQ(layer.leaf_swaps(), 3u);
  EXPECT_EQ(lt->TEST_ClassOf(1), LongTailPolicy::kLeaf);  // was kHit3 after three give-backs
  EXPECT_EQ(layer.Evict(100 * kSecUs), std::optional<ObjectId>(1));
  // 1 was evicted once (now): its re-reference is one ghost hit, the first.
  layer.BeginRequest(11, 101 * kSecUs);
  layer.OnMiss(1, 101 * kSecUs);
  layer.OnInsert(Unit(1), 101 * kSecUs);
  EXPECT_EQ(lt->TEST_ClassOf(1), LongTailPolicy::kHit1);
}

// Rule 2 on long-tail: a resumed request holds its units; the one long-tail values least (2,
// request A's leaf) is set aside, the next victim (5) goes, and 2 keeps its class. (Given back
// at its own entry time, long-tail would choose 2 again at once: the layer sets held victims
// aside until it has found one to evict.)
TEST(PrefixLayerGiveBack, LongTailHeldUnitKeepsItsClass) {
  auto owned = std::make_unique<LongTailPolicy>();
  LongTailPolicy* lt = owned.get();
  PrefixLayer layer(std::move(owned));
  layer.BeginRequest(1, 0);  // request A: 1 <- 2
  layer.OnInsert(Unit(1), 0);
  layer.OnInsert(Unit(2, 1), 0);
  layer.BeginRequest(2, kSecUs);  // request B: 5
  layer.OnInsert(Unit(5), kSecUs);
  layer.BeginRequest(1, 100 * kSecUs);  // A resumes: 1 and 2 are held
  ASSERT_EQ(lt->TEST_ClassOf(2), LongTailPolicy::kLeaf);
  ASSERT_EQ(lt->TEST_ClassOf(5), LongTailPolicy::kLeaf);
  EXPECT_EQ(layer.Evict(100 * kSecUs), std::optional<ObjectId>(5));
  EXPECT_EQ(layer.held_given_back(), 1u);
  EXPECT_EQ(lt->TEST_ClassOf(2), LongTailPolicy::kLeaf);  // was kHit1
  EXPECT_EQ(lt->TEST_ClassOf(1), LongTailPolicy::kFresh);
}

// ARC: 10 is a ghost in B1 and misses; REPLACE takes T2's 11, which has a cached child (12):
// 12 goes, 11 stays in T2, and 10 (the ghost hit) enters T2.
TEST(PrefixLayerGiveBack, ArcGhostHitGoesToTheInsertedUnit) {
  auto owned = std::make_unique<ArcPolicy>();
  ArcPolicy* arc = owned.get();
  PrefixLayer layer(std::move(owned));
  layer.OnCapacity(2);
  layer.BeginRequest(1, 0);
  layer.OnInsert(Unit(10), 0);
  layer.OnInsert(Unit(11), 0);
  layer.BeginRequest(2, 1);
  layer.OnAccess(11, 1);  // 11 to T2
  layer.OnMiss(12, 1);
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(10));  // T1's LRU to B1
  layer.OnInsert(Unit(12, 11), 1);
  ASSERT_TRUE(arc->TEST_InGhost(10));
  layer.BeginRequest(3, 2);
  layer.OnMiss(10, 2);                                     // ghost hit in B1
  EXPECT_EQ(layer.Evict(2), std::optional<ObjectId>(12));  // 11 chosen; its child goes
  layer.OnInsert(Unit(10), 2);
  EXPECT_EQ(layer.leaf_swaps(), 1u);
  EXPECT_TRUE(arc->TEST_InT2(10));  // was T1
  EXPECT_TRUE(arc->TEST_InT2(11));
  EXPECT_FALSE(arc->TEST_InGhost(11));
}

// S3-FIFO: 1 is in the ghost and misses; small's oldest (5) has a cached child (6): 6 goes, 5
// stays in small, and 1 (the ghost hit) enters main.
TEST(PrefixLayerGiveBack, S3FifoGhostHitGoesToTheInsertedUnit) {
  auto owned = std::make_unique<S3FifoPolicy>();
  S3FifoPolicy* s3 = owned.get();
  PrefixLayer layer(std::move(owned));
  layer.OnCapacity(10);  // small 1, main 9, ghost 9
  layer.BeginRequest(1, 0);
  layer.OnInsert(Unit(1), 0);
  layer.BeginRequest(2, 1);
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(1));  // never hit: to the ghost
  layer.OnInsert(Unit(5), 1);
  layer.OnInsert(Unit(6, 5), 1);
  ASSERT_TRUE(s3->TEST_InGhost(1));
  layer.BeginRequest(3, 2);
  layer.OnMiss(1, 2);                                     // ghost hit
  EXPECT_EQ(layer.Evict(2), std::optional<ObjectId>(6));  // 5 chosen; its child goes
  layer.OnInsert(Unit(1), 2);
  EXPECT_EQ(layer.leaf_swaps(), 1u);
  EXPECT_TRUE(s3->TEST_InMain(1));  // was small
  EXPECT_TRUE(s3->Contains(5));
  EXPECT_FALSE(s3->TEST_InMain(5));  // was main
  EXPECT_FALSE(s3->TEST_InGhost(5));
}

// LFU and GDSF: a victim given back keeps its count (before, it came back with a count of 1).
// 1 (two references) is the victim, with a child (2, three references) that goes instead; then
// 5, referenced once, goes before 1.
TEST(PrefixLayerGiveBack, FrequencyPoliciesKeepTheVictimsCount) {
  for (const char* name : {"lfu", "gdsf"}) {
    std::unique_ptr<EvictionPolicy> inner;
    if (std::string(name) == "lfu") {
      inner = std::make_unique<LfuPolicy>();
    } else {
      inner = std::make_unique<GdsfPolicy>();
    }
    PrefixLayer layer(std::move(inner));
    layer.BeginRequest(1, 0);
    layer.OnInsert(Unit(1), 0);
    layer.OnInsert(Unit(2, 1), 0);
    layer.BeginRequest(2, 1);
    layer.OnAccess(1, 1);
    layer.OnAccess(2, 1);
    layer.BeginRequest(3, 2);
    layer.OnAccess(2, 2);
    layer.BeginRequest(4, 3);
    EXPECT_EQ(layer.Evict(3), std::optional<ObjectId>(2)) << name;  // 1 chosen; its child goes
    layer.OnInsert(Unit(5), 3);
    layer.BeginRequest(5, 4);
    EXPECT_EQ(layer.Evict(4), std::optional<ObjectId>(5)) << name;  // was 1
    EXPECT_TRUE(layer.Contains(1)) << name;
  }
}

// Hostile parent links (a cycle through the victim, a unit its own parent) end the walk.
TEST(PrefixLayer, ParentCyclesDoNotLoop) {
  std::vector<std::string> log;
  PrefixLayer layer(std::make_unique<LoggingLru>(&log));
  layer.BeginRequest(1, 0);
  layer.OnInsert(Unit(1, 2), 0);
  layer.OnInsert(Unit(2, 1), 0);
  layer.OnInsert(Unit(3, 3), 0);
  layer.BeginRequest(2, 1);
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(2));  // 1 chosen, its child 2 goes
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(3));
  EXPECT_EQ(layer.Evict(1), std::optional<ObjectId>(1));
  EXPECT_EQ(layer.Size(), 0u);
}

TEST(PrefixLayer, StructureNames) {
  EXPECT_EQ(ParseStructure("plain").value(), Structure::kPlain);
  EXPECT_EQ(ParseStructure("prefix").value(), Structure::kPrefix);
  EXPECT_FALSE(ParseStructure("Prefix").ok());
  EXPECT_FALSE(ParseStructure("").ok());
  PrefixLayer* layer = nullptr;
  auto plain = WithStructure(std::make_unique<LruPolicy>(), Structure::kPlain, &layer);
  EXPECT_EQ(layer, nullptr);
  auto wrapped = WithStructure(std::make_unique<LruPolicy>(), Structure::kPrefix, &layer);
  EXPECT_EQ(layer, wrapped.get());
  EXPECT_EQ(wrapped->Name(), "lru");
}

}  // namespace
}  // namespace kvtier::policies
