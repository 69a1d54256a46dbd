#include "policies/gdsf/gdsf.h"

#include "policies/internal/params.h"

namespace kvtier::policies {

StatusOr<std::unique_ptr<EvictionPolicy>> GdsfPolicy::Make(const PolicyParams& params) {
  GdsfOptions o;
  internal::ParamReader r("gdsf", params);
  KVTIER_RETURN_IF_ERROR(r.Double("default_cost", &o.default_cost, 1e-9, 1e12));
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<EvictionPolicy>(new GdsfPolicy(o));
}

void GdsfPolicy::Place(Entry& e, ObjectId id) {
  e.key = Key{inflation_ + static_cast<double>(e.count) * e.cost_per_byte, ++sequence_, id};
  order_.insert(e.key);
}

void GdsfPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  evicted_.Clear();
  if (entries_.count(info.id) != 0) return OnAccess(info.id, now_us);
  Insert(info, 1);
}

void GdsfPolicy::OnGiveBack(const ObjectInfo& info, uint64_t /*now_us*/) {
  if (entries_.count(info.id) != 0) return;
  Insert(info, evicted_.Take(info.id).value_or(1));
}

void GdsfPolicy::Insert(const ObjectInfo& info, uint64_t count) {
  Entry e;
  e.count = count;
  double cost = info.recompute_tokens > 0 ? info.recompute_tokens : options_.default_cost;
  double size = info.size_bytes > 0 ? static_cast<double>(info.size_bytes) : 1.0;
  e.cost_per_byte = cost / size;
  auto [it, inserted] = entries_.emplace(info.id, e);
  Place(it->second, info.id);
}

void GdsfPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  evicted_.Clear();
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  order_.erase(it->second.key);
  ++it->second.count;
  Place(it->second, id);
}

void GdsfPolicy::OnRemove(ObjectId id) {
  evicted_.Clear();
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  order_.erase(it->second.key);
  entries_.erase(it);
}

std::optional<ObjectId> GdsfPolicy::Evict(uint64_t /*now_us*/) {
  if (order_.empty()) return std::nullopt;
  auto [h, seq, victim] = *order_.begin();
  order_.erase(order_.begin());
  auto it = entries_.find(victim);
  evicted_.Add(victim, it->second.count);
  entries_.erase(it);
  inflation_ = h;
  return victim;
}

}  // namespace kvtier::policies
