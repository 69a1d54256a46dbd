#include "policies/prefix_layer/prefix_layer.h"

#include <algorithm>
#include <string>

namespace kvtier::policies {

const char* StructureName(Structure s) { return s == Structure::kPrefix ? "prefix" : "plain"; }

StatusOr<Structure> ParseStructure(std::string_view name) {
  if (name == "plain") return Structure::kPlain;
  if (name == "prefix") return Structure::kPrefix;
  return Status::InvalidArgument("structure must be plain or prefix, got '" + std::string(name) +
                                 "'");
}

std::unique_ptr<EvictionPolicy> WithStructure(std::unique_ptr<EvictionPolicy> inner,
                                              Structure structure, PrefixLayer** layer) {
  if (layer != nullptr) *layer = nullptr;
  if (structure == Structure::kPlain) return inner;
  auto wrapped = std::make_unique<PrefixLayer>(std::move(inner));
  if (layer != nullptr) *layer = wrapped.get();
  return wrapped;
}

PrefixLayer::PrefixLayer(std::unique_ptr<EvictionPolicy> inner) : inner_(std::move(inner)) {}

void PrefixLayer::Flush() {
  // Arrival order is prefix order: the deepest hit reaches the inner policy first.
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    inner_->OnAccess(it->first, it->second);
  }
  pending_.clear();
}

void PrefixLayer::Hold(ObjectId id) {
  if (held_.size() < kHeldUnitsMax) held_.insert(id);
}

void PrefixLayer::BeginRequest(uint64_t request_key, uint64_t now_us, size_t units_hint) {
  Flush();
  inner_->OnRequest(now_us);
  units_hint_ = units_hint;
  if (request_key == request_) return;
  // Park the running request's held units; a resumed request gets its own back.
  if (!held_.empty()) {
    recent_.emplace_front(request_, std::vector<ObjectId>(held_.begin(), held_.end()));
    if (recent_.size() > kHeldRequestsMax) recent_.pop_back();
  }
  held_.clear();
  request_ = request_key;
  auto it = std::find_if(recent_.begin(), recent_.end(),
                         [&](const auto& r) { return r.first == request_key; });
  if (it != recent_.end()) {
    held_.insert(it->second.begin(), it->second.end());
    recent_.erase(it);
  }
}

void PrefixLayer::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  Flush();
  Forget(info.id);  // an owner re-inserting without OnRemove: the new parent counts
  info_[info.id] = info;
  if (info.parent_id != kNoParent && info.parent_id != info.id) {
    children_.emplace(info.parent_id, info.id);
  }
  Hold(info.id);
  inner_->OnInsert(info, now_us);
}

void PrefixLayer::OnAccess(ObjectId id, uint64_t now_us) {
  if (pending_.size() >= kPendingHitsMax) Flush();
  pending_.emplace_back(id, now_us);
  Hold(id);
}

void PrefixLayer::OnRemove(ObjectId id) {
  Flush();
  Forget(id);
  inner_->OnRemove(id);
}

void PrefixLayer::OnMiss(ObjectId id, uint64_t now_us) {
  Flush();
  Hold(id);
  inner_->OnMiss(id, now_us);
}

void PrefixLayer::OnCapacity(uint64_t capacity_objects) {
  Flush();
  inner_->OnCapacity(capacity_objects);
}

void PrefixLayer::Forget(ObjectId id) {
  auto it = info_.find(id);
  if (it == info_.end()) return;
  if (it->second.parent_id != kNoParent) children_.erase({it->second.parent_id, id});
  info_.erase(it);
}

void PrefixLayer::GiveBack(ObjectId id, uint64_t now_us) {
  auto it = info_.find(id);
  if (it != info_.end()) inner_->OnGiveBack(it->second, now_us);
}

std::optional<ObjectId> PrefixLayer::Evict(uint64_t now_us) {
  Flush();
  // Held victims are set aside (out of the inner policy, so it cannot choose one twice) until a
  // victim to evict is found, then given back, in the order chosen. Bounded: at most `rounds`.
  const size_t rounds = std::max(held_.size(), std::min(units_hint_, kHeldUnitsMax));
  std::vector<ObjectId> set_aside;
  std::optional<ObjectId> victim;
  while (true) {
    victim = inner_->Evict(now_us);
    if (!victim || !info_.count(*victim)) break;  // none; or not inserted through the layer
    if (!held_.count(*victim) || set_aside.size() >= rounds) break;
    set_aside.push_back(*victim);
  }
  if (!victim && !set_aside.empty()) {
    // Every tracked unit is held: the first one chosen goes all the same.
    victim = set_aside.front();
    set_aside.erase(set_aside.begin());
  }
  held_given_back_ += set_aside.size();
  for (ObjectId id : set_aside) GiveBack(id, now_us);
  if (!victim || !info_.count(*victim)) return victim;
  // Leaf first: walk down the tracked children. Only a walk back to the victim can cycle
  // (every unit has one parent), and every step visits a different tracked unit.
  ObjectId leaf = *victim;
  for (size_t steps = 0; steps < info_.size(); ++steps) {
    auto c = children_.lower_bound({leaf, 0});
    if (c == children_.end() || c->first != leaf || c->second == *victim) break;
    leaf = c->second;
  }
  if (leaf == *victim) {
    Forget(*victim);
    return victim;
  }
  ++leaf_swaps_;
  GiveBack(*victim, now_us);
  inner_->OnRemove(leaf);
  Forget(leaf);
  return leaf;
}

}  // namespace kvtier::policies
