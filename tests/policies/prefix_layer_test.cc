// The prefix layer's three rules, one test each, plus its bounds on hostile parent links.
#include "policies/prefix_layer/prefix_layer.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "policies/lru/lru.h"

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
