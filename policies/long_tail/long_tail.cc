#include "policies/long_tail/long_tail.h"

#include <algorithm>
#include <cmath>

#include "policies/internal/params.h"

namespace kvtier::policies {

LongTailPolicy::LongTailPolicy(const LongTailOptions& options)
    : options_(options), rng_state_(options.seed ^ 0x9e3779b97f4a7c15ull) {
  bucket_lower_ms_[0] = 0;
  for (size_t i = 1; i < kBuckets; ++i) {
    bucket_lower_ms_[i] = static_cast<uint64_t>(static_cast<double>(options_.base_ms) *
                                                std::exp2(static_cast<double>(i - 1) / 2.0));
  }
}

StatusOr<std::unique_ptr<EvictionPolicy>> LongTailPolicy::Make(const PolicyParams& params) {
  LongTailOptions o;
  o.seed = params.seed;
  internal::ParamReader r("long-tail", params);
  constexpr uint64_t kYearMs = 365ull * 24 * 3600 * 1000;
  KVTIER_RETURN_IF_ERROR(r.Uint("horizon_ms", &o.horizon_ms, 0, kYearMs));
  KVTIER_RETURN_IF_ERROR(r.Uint("sample_size", &o.sample_size, 1, 4096));
  KVTIER_RETURN_IF_ERROR(r.Uint("base_ms", &o.base_ms, 1, 3600 * 1000));
  KVTIER_RETURN_IF_ERROR(r.Double("decay", &o.decay, 0.0, 1.0));
  KVTIER_RETURN_IF_ERROR(r.Uint("relearn_every", &o.relearn_every, 1, 1ull << 30));
  KVTIER_RETURN_IF_ERROR(r.Double("ghost_factor", &o.ghost_factor, 0.0, 64.0));
  KVTIER_RETURN_IF_ERROR(r.Double("child_weight", &o.child_weight, 0.0, 1e6));
  KVTIER_RETURN_IF_ERROR(r.Bool("leaves_first", &o.leaves_first));
  KVTIER_RETURN_IF_ERROR(r.Double("orphan_factor", &o.orphan_factor, 0.0, 1.0));
  KVTIER_RETURN_IF_ERROR(r.Double("cost_exponent", &o.cost_exponent, 0.0, 8.0));
  KVTIER_RETURN_IF_ERROR(r.Uint("min_samples", &o.min_samples, 0, 1ull << 30));
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<EvictionPolicy>(new LongTailPolicy(o));
}

uint64_t LongTailPolicy::NextRandom() {  // splitmix64: deterministic, seeded
  uint64_t z = (rng_state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

size_t LongTailPolicy::Bucket(uint64_t age_us) const {
  uint64_t age_ms = age_us / 1000;
  if (age_ms < options_.base_ms) return 0;
  double ratio = static_cast<double>(age_ms) / static_cast<double>(options_.base_ms);
  size_t b = static_cast<size_t>(2.0 * std::log2(ratio)) + 1;
  return std::min(b, kBuckets - 1);
}

uint64_t LongTailPolicy::TEST_HorizonMs() const {
  if (options_.horizon_ms != 0) return options_.horizon_ms;
  return std::max<uint64_t>(1000, static_cast<uint64_t>(eviction_age_ms_ewma_));
}

double LongTailPolicy::TEST_ReuseProbability(size_t cls, uint64_t age_ms) const {
  return reuse_p_[std::min(cls, kClasses - 1)][Bucket(age_ms * 1000)];
}

uint32_t LongTailPolicy::TEST_Children(ObjectId id) const {
  auto it = objects_.find(id);
  return it == objects_.end() ? 0 : it->second.children;
}

void LongTailPolicy::CountEvent(bool reuse, size_t cls, uint64_t age_us) {
  counts_[reuse ? 1 : 0][cls][Bucket(age_us)] += 1.0;
  if (++events_since_learn_ >= options_.relearn_every) Relearn();
}

void LongTailPolicy::Relearn() {
  events_since_learn_ = 0;
  const uint64_t horizon_ms = TEST_HorizonMs();
  std::array<double, kBuckets> pooled_reuse{}, pooled_end{};
  for (size_t c = 0; c < kClasses; ++c) {
    for (size_t b = 0; b < kBuckets; ++b) {
      pooled_reuse[b] += counts_[1][c][b];
      pooled_end[b] += counts_[0][c][b] + counts_[1][c][b];
    }
  }
  for (size_t c = 0; c < kClasses; ++c) {
    double total = 0;
    for (size_t b = 0; b < kBuckets; ++b) total += counts_[0][c][b] + counts_[1][c][b];
    bool pooled = total < static_cast<double>(options_.min_samples);
    // Kaplan-Meier: hazard[b] = reuses in b / units still unreused and cached at b's start.
    std::array<double, kBuckets> hazard{};
    double at_risk = 0;
    for (size_t b = kBuckets; b-- > 0;) {
      double reuse = pooled ? pooled_reuse[b] : counts_[1][c][b];
      at_risk += pooled ? pooled_end[b] : counts_[0][c][b] + counts_[1][c][b];
      hazard[b] = at_risk > 0 ? reuse / at_risk : 0.0;
    }
    for (size_t a = 0; a < kBuckets; ++a) {
      uint64_t end_ms = bucket_lower_ms_[a] + horizon_ms;
      double survive = 1.0;
      for (size_t b = a; b < kBuckets && bucket_lower_ms_[b] < end_ms; ++b) {
        survive *= 1.0 - hazard[b];
      }
      reuse_p_[c][a] = 1.0 - survive;
    }
  }
  for (auto& kind : counts_) {
    for (auto& cls : kind) {
      for (double& v : cls) v *= options_.decay;
    }
  }
}

void LongTailPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  if (objects_.count(info.id) != 0) return OnAccess(info.id, now_us);
  Object o;
  o.last_access_us = now_us;
  o.parent = info.parent_id;
  if (auto g = ghosts_.find(info.id); g != ghosts_.end()) {
    // A re-reference after eviction: an observed (not censored) reuse gap.
    uint64_t gap = now_us > g->second.last_access_us ? now_us - g->second.last_access_us : 0;
    CountEvent(true, g->second.cls, gap);
    o.cls = static_cast<uint8_t>(std::min<size_t>(g->second.cls + 1, kClasses - 1));
    ghosts_.erase(g);
  }
  if (info.recompute_tokens > 0 && info.size_bytes > 0) {
    o.cost_per_byte =
        static_cast<double>(info.recompute_tokens) / static_cast<double>(info.size_bytes);
    cost_sum_ += o.cost_per_byte;
    ++cost_known_;
  }
  if (o.parent != kNoParent) {
    if (auto p = objects_.find(o.parent); p != objects_.end()) ++p->second.children;
  }
  o.position = static_cast<uint32_t>(members_.size());
  members_.push_back(info.id);
  objects_.emplace(info.id, o);
}

void LongTailPolicy::OnAccess(ObjectId id, uint64_t now_us) {
  auto it = objects_.find(id);
  if (it == objects_.end()) return;
  Object& o = it->second;
  uint64_t gap = now_us > o.last_access_us ? now_us - o.last_access_us : 0;
  CountEvent(true, o.cls, gap);
  o.cls = static_cast<uint8_t>(std::min<size_t>(o.cls + 1, kClasses - 1));
  o.last_access_us = now_us;
}

void LongTailPolicy::Forget(ObjectId id, Object& o) {
  ObjectId moved = members_.back();
  members_[o.position] = moved;
  objects_[moved].position = o.position;
  members_.pop_back();
  if (o.parent != kNoParent) {
    if (auto p = objects_.find(o.parent); p != objects_.end() && p->second.children > 0) {
      --p->second.children;
    }
  }
  if (o.cost_per_byte > 0) {
    cost_sum_ -= o.cost_per_byte;
    --cost_known_;
  }
  (void)id;
}

void LongTailPolicy::OnRemove(ObjectId id) {
  auto it = objects_.find(id);
  if (it == objects_.end()) return;
  Forget(id, it->second);
  objects_.erase(it);
}

double LongTailPolicy::Score(const Object& o, uint64_t now_us) const {
  uint64_t age = now_us > o.last_access_us ? now_us - o.last_access_us : 0;
  double score = reuse_p_[o.cls][Bucket(age)];
  score *= 1.0 + options_.child_weight * static_cast<double>(o.children);
  if (o.parent != kNoParent && objects_.count(o.parent) == 0) score *= options_.orphan_factor;
  if (o.cost_per_byte > 0 && cost_known_ > 0 && options_.cost_exponent > 0) {
    double mean = cost_sum_ / static_cast<double>(cost_known_);
    score *= std::pow(o.cost_per_byte / mean, options_.cost_exponent);
  }
  return score;
}

std::optional<ObjectId> LongTailPolicy::Evict(uint64_t now_us) {
  if (members_.empty()) return std::nullopt;
  const size_t n = members_.size();
  const size_t samples = std::min<size_t>(options_.sample_size, n);
  ObjectId best = 0;
  const Object* best_o = nullptr;
  double best_score = 0;
  bool best_leaf = false;
  for (size_t i = 0; i < samples; ++i) {
    size_t idx = samples == n ? i : static_cast<size_t>(NextRandom() % n);
    ObjectId id = members_[idx];
    const Object& o = objects_.find(id)->second;
    bool leaf = !options_.leaves_first || o.children == 0;
    double score = Score(o, now_us);
    bool better;
    if (best_o == nullptr) {
      better = true;
    } else if (leaf != best_leaf) {
      better = leaf;
    } else if (score != best_score) {
      better = score < best_score;
    } else {
      better = o.last_access_us < best_o->last_access_us;
    }
    if (better) {
      best = id;
      best_o = &o;
      best_score = score;
      best_leaf = leaf;
    }
  }
  auto it = objects_.find(best);
  Object o = it->second;
  uint64_t age = now_us > o.last_access_us ? now_us - o.last_access_us : 0;
  eviction_age_ms_ewma_ += 0.01 * (static_cast<double>(age / 1000) - eviction_age_ms_ewma_);
  CountEvent(false, o.cls, age);
  Forget(best, it->second);
  objects_.erase(it);
  // Remember it as a ghost, bounded to ghost_factor x cached units.
  size_t ghost_max = static_cast<size_t>(options_.ghost_factor * static_cast<double>(n));
  if (ghost_max > 0) {
    while (ghosts_.size() >= ghost_max && !ghost_order_.empty()) {
      ghosts_.erase(ghost_order_.front());
      ghost_order_.pop_front();
    }
    ghosts_[best] = Ghost{o.last_access_us, o.cls};
    ghost_order_.push_back(best);
  }
  return best;
}

}  // namespace kvtier::policies
