#include "policies/second_hit/second_hit.h"

#include "policies/internal/params.h"

namespace kvtier::policies {

StatusOr<std::unique_ptr<AdmissionPolicy>> SecondHitPolicy::Make(const PolicyParams& params) {
  SecondHitOptions o;
  internal::ParamReader r("second-hit", params);
  KVTIER_RETURN_IF_ERROR(r.Uint("hits_required", &o.hits_required, 1, 1000));
  KVTIER_RETURN_IF_ERROR(
      r.Uint("max_tracked", &o.max_tracked, 1, SecondHitOptions::kMaxTrackedMax));
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<AdmissionPolicy>(new SecondHitPolicy(o));
}

void SecondHitPolicy::OnLookup(ObjectId id, uint64_t /*now_us*/) {
  auto it = counts_.find(id);
  if (it != counts_.end()) {
    ++it->second;
    return;
  }
  while (counts_.size() >= options_.max_tracked && !order_.empty()) {
    counts_.erase(order_.front());
    order_.pop_front();
  }
  counts_.emplace(id, 1);
  order_.push_back(id);
}

bool SecondHitPolicy::Admit(const ObjectInfo& info, uint64_t /*now_us*/) {
  auto it = counts_.find(info.id);
  return it != counts_.end() && it->second >= options_.hits_required;
}

void SecondHitPolicy::CarryOver(const AdmissionPolicy& previous, uint64_t /*now_us*/) {
  const auto* p = dynamic_cast<const SecondHitPolicy*>(&previous);
  if (p == nullptr) return;
  counts_.clear();
  order_.clear();
  const size_t skip = p->order_.size() > options_.max_tracked
                          ? p->order_.size() - static_cast<size_t>(options_.max_tracked)
                          : 0;
  for (size_t i = skip; i < p->order_.size(); ++i) {
    const ObjectId id = p->order_[i];
    counts_.emplace(id, p->counts_.at(id));
    order_.push_back(id);
  }
}

}  // namespace kvtier::policies
