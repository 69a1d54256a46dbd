#include "policies/long_tail/long_tail.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "policies/internal/params.h"

namespace kvtier::policies {

using internal::kNil;

namespace {
// Log-spaced buckets cover 2^20 base_ms (~12 days at base 1 s), past the 72 h tail.
constexpr uint64_t kOctaves = 20;
// Prior value per class (relative), used until a class has min_entries: an LRU per class in
// which reused units are worth more and request-final units less.
constexpr std::array<double, LongTailPolicy::kClasses> kPrior = {1.0, 1.0, 2.0, 3.0, 4.0, 0.1};
// Sampled-ghost hash (splitmix64 finaliser): spatial sampling independent of id order.
uint64_t Hash(ObjectId id) {
  uint64_t z = id + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
constexpr double kTwo64 = 18446744073709551616.0;
constexpr double kAdmitWeightMin = 1.0 / 64, kAdmitWeightMax = 64.0;
}  // namespace

LongTailPolicy::LongTailPolicy(const LongTailOptions& options) : options_(options) {
  options_.buckets_per_octave = std::max<uint64_t>(1, options_.buckets_per_octave);
  options_.base_ms = std::max<uint64_t>(1, options_.base_ms);
  buckets_ = std::min<size_t>(kMaxBuckets, options_.buckets_per_octave * kOctaves);
  const double base_s = static_cast<double>(options_.base_ms) / 1000.0;
  bucket_lo_s_.resize(buckets_ + 1);
  for (size_t b = 0; b <= buckets_; ++b) {
    bucket_lo_s_[b] =
        base_s *
        (std::exp2(static_cast<double>(b) / static_cast<double>(options_.buckets_per_octave)) -
         1.0);
  }
  for (size_t c = 0; c < kClasses; ++c) {
    reuses_[c].assign(buckets_, 0.0);
    value_[c].assign(buckets_, 0.0);
    censored_[c].assign(buckets_, 0.0);
    resumed_[c].assign(buckets_, 0.0);
  }
  const double rate = std::clamp(options_.ghost_sample_rate, 1.0 / 65536, 1.0);
  sample_threshold_ = rate >= 1.0 ? UINT64_MAX : static_cast<uint64_t>(rate * kTwo64);
  Relearn();
  epoch_ = 0;
}

StatusOr<std::unique_ptr<EvictionPolicy>> LongTailPolicy::Make(const PolicyParams& params) {
  LongTailOptions o;
  internal::ParamReader r("long-tail", params);
  KVTIER_RETURN_IF_ERROR(r.Uint("base_ms", &o.base_ms, 1, 3600 * 1000));
  KVTIER_RETURN_IF_ERROR(r.Uint("buckets_per_octave", &o.buckets_per_octave, 1, 8));
  KVTIER_RETURN_IF_ERROR(r.Double("decay", &o.decay, 0.0, 1.0));
  KVTIER_RETURN_IF_ERROR(r.Uint("relearn_every", &o.relearn_every, 0, 1ull << 30));
  KVTIER_RETURN_IF_ERROR(r.Double("ghost_factor", &o.ghost_factor, 0.0, 64.0));
  KVTIER_RETURN_IF_ERROR(r.Uint("min_entries", &o.min_entries, 0, 1ull << 30));
  KVTIER_RETURN_IF_ERROR(r.Bool("split_extension", &o.split_extension));
  KVTIER_RETURN_IF_ERROR(r.Bool("leaf_class", &o.leaf_class));
  KVTIER_RETURN_IF_ERROR(r.Bool("young_end", &o.young_end));
  KVTIER_RETURN_IF_ERROR(r.Double("cost_exponent", &o.cost_exponent, 0.0, 8.0));
  KVTIER_RETURN_IF_ERROR(r.Double("ghost_sample_rate", &o.ghost_sample_rate, 1.0 / 65536, 1.0));
  KVTIER_RETURN_IF_ERROR(r.Uint("sampled_ghosts_max", &o.sampled_ghosts_max, 0, 1ull << 22));
  KVTIER_RETURN_IF_ERROR(r.Bool("censoring", &o.censoring));
  KVTIER_RETURN_IF_ERROR(r.Double("admit_step", &o.admit_step, 0.0, 1.0));
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<EvictionPolicy>(new LongTailPolicy(o));
}

size_t LongTailPolicy::Bucket(uint64_t age_us) const {
  const double x = static_cast<double>(age_us) / (1000.0 * static_cast<double>(options_.base_ms));
  const double b = static_cast<double>(options_.buckets_per_octave) * std::log2(1.0 + x);
  return std::min(static_cast<size_t>(b), buckets_ - 1);
}

uint8_t LongTailPolicy::HitClass(uint8_t hits) const {
  return hits >= 3 ? kHit3 : hits == 2 ? kHit2 : kHit1;
}

double LongTailPolicy::TEST_Value(size_t cls, uint64_t age_ms) const {
  return value_[std::min(cls, kClasses - 1)][Bucket(age_ms * 1000)];
}

double LongTailPolicy::TEST_SampleRate() const {
  return sample_threshold_ == UINT64_MAX ? 1.0 : static_cast<double>(sample_threshold_) / kTwo64;
}

size_t LongTailPolicy::TEST_ClassOf(ObjectId id) const {
  uint32_t s = slab_.Find(id);
  return s == kNil ? kClasses : slab_[s].data.cls;
}

void LongTailPolicy::OnCapacity(uint64_t capacity_objects) { capacity_ = capacity_objects; }

// Inserts `slot` into class `cls` in entry-time order; among equal entry times, before the
// others (so the most recently inserted, i.e. deepest, unit of a burst is nearest the old end).
void LongTailPolicy::Link(uint32_t slot, uint8_t cls, uint64_t entry_us, const uint32_t* at) {
  ClassList& l = lists_[cls];
  auto& n = slab_[slot];
  n.data.cls = cls;
  n.data.entry_us = entry_us;
  n.data.epoch = epoch_;
  n.list = cls;
  ++l.size;
  auto insert_before = [&](uint32_t at) {  // at == kNil: append
    n.next = at;
    n.prev = at == kNil ? l.last : slab_[at].prev;
    if (n.prev != kNil) {
      slab_[n.prev].next = slot;
    } else {
      l.first = slot;
    }
    if (at != kNil) {
      slab_[at].prev = slot;
    } else {
      l.last = slot;
    }
  };
  if (at != nullptr) {
    insert_before(*at);
    if (n.next == kNil) {
      if (n.prev == kNil || slab_[n.prev].data.entry_us != entry_us) l.young_first = slot;
    } else if (n.next == l.young_first && slab_[n.next].data.entry_us == entry_us) {
      l.young_first = slot;
    }
  } else if (l.last == kNil || entry_us > slab_[l.last].data.entry_us) {
    insert_before(kNil);
    l.young_first = slot;
  } else if (entry_us == slab_[l.last].data.entry_us) {
    insert_before(l.young_first);
    l.young_first = slot;
  } else {
    // Older than the youngest burst (a unit moved to the leaf class late): walk back to the
    // first unit of its burst, or past every younger unit. Bounded by the class size.
    uint32_t at = l.last;
    while (slab_[at].prev != kNil && slab_[slab_[at].prev].data.entry_us >= entry_us) {
      at = slab_[at].prev;
    }
    insert_before(at);
  }
}

void LongTailPolicy::Unlink(uint32_t slot) {
  auto& n = slab_[slot];
  ClassList& l = lists_[n.data.cls];
  if (slot == l.young_first) {
    if (n.next != kNil) {
      l.young_first = n.next;
    } else {
      // The youngest burst is now empty: the previous burst becomes the youngest.
      uint32_t y = n.prev;
      while (y != kNil && slab_[y].prev != kNil &&
             slab_[slab_[y].prev].data.entry_us == slab_[y].data.entry_us) {
        y = slab_[y].prev;
      }
      l.young_first = y;
    }
  }
  if (n.prev != kNil) {
    slab_[n.prev].next = n.next;
  } else {
    l.first = n.next;
  }
  if (n.next != kNil) {
    slab_[n.next].prev = n.prev;
  } else {
    l.last = n.prev;
  }
  n.prev = n.next = kNil;
  --l.size;
}

// A request's units arrive in prefix order, so a unit whose parent is not the unit touched
// just before starts a new request; the previous request's last unit, if it was never hit,
// moves to the leaf class (its own reuse is rare: it is usually the partial last block).
void LongTailPolicy::OnRequest(uint64_t now_us) {
  EndEvictions();
  if (options_.leaf_class) {
    // The request's leaves: touched units that are no touched unit's parent. Bounded by the
    // request's size (quadratic only in the number of leaves, one for a prefix chain).
    std::sort(request_units_.begin(), request_units_.end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
    for (const auto& [id, parent] : request_units_) {
      (void)parent;
      auto it = std::lower_bound(
          request_units_.begin(), request_units_.end(), id,
          [](const std::pair<ObjectId, ObjectId>& u, ObjectId key) { return u.second < key; });
      if (it != request_units_.end() && it->second == id) continue;  // a parent: not a leaf
      MoveToLeafClass(id);
    }
  }
  request_units_.clear();
  explicit_requests_ = true;
  request_nonroot_hit_ = false;
  request_us_ = now_us;
}

void LongTailPolicy::MoveToLeafClass(ObjectId id) {
  uint32_t s = slab_.Find(id);
  if (s == kNil) return;
  Payload& p = slab_[s].data;
  if (p.hits == 0 && (p.cls == kFresh || p.cls == kExtension)) {
    entries_[p.cls] = std::max(0.0, entries_[p.cls] - 1.0);
    const uint64_t entry = p.entry_us;
    Unlink(s);
    Link(s, kLeaf, entry);
    entries_[kLeaf] += 1.0;
  }
}

void LongTailPolicy::NoteRequestBoundary(ObjectId parent_of_current, ObjectId current) {
  if (explicit_requests_) {
    request_units_.emplace_back(current, parent_of_current);
    return;
  }
  if (options_.leaf_class && last_touched_ != kNoParent && parent_of_current != last_touched_) {
    MoveToLeafClass(last_touched_);
  }
  last_touched_ = current;
}

void LongTailPolicy::CountReuse(uint8_t cls, uint64_t age_us, double weight) {
  reuses_[cls][Bucket(age_us)] += weight;
}

double LongTailPolicy::Decayed(uint32_t since_epoch) const {
  if (!options_.censoring || options_.decay >= 1.0) return 1.0;
  return std::pow(options_.decay, static_cast<double>(epoch_ - std::min(epoch_, since_epoch)));
}

void LongTailPolicy::Censor(uint8_t cls, uint64_t age_us, double weight) {
  if (options_.censoring) censored_[cls][Bucket(age_us)] += weight;
}

bool LongTailPolicy::Sampled(ObjectId id) const {
  return options_.sampled_ghosts_max > 0 && Hash(id) < sample_threshold_;
}

// Fixed-size SHARDS: the entry with the largest hash leaves and the threshold drops to its
// hash, so no id at or above it is sampled again. Its observation is censored now.
void LongTailPolicy::DropLargestSample(uint64_t now_us, Evicted* undo) {
  const uint64_t threshold_before = sample_threshold_;
  while (!sampled_heap_.empty()) {
    std::pop_heap(sampled_heap_.begin(), sampled_heap_.end());
    const auto [hash, id] = sampled_heap_.back();
    sampled_heap_.pop_back();
    sample_threshold_ = std::min(sample_threshold_, hash);
    auto it = sampled_.find(id);
    if (it == sampled_.end() || Hash(id) != hash) continue;  // stale: re-referenced since
    const uint64_t age = now_us - std::min(now_us, it->second.entry_us);
    const double weight = it->second.weight * Decayed(it->second.epoch);
    Censor(it->second.cls, age, weight);
    if (undo != nullptr) {
      undo->drop = Evicted::SampleDrop{
          .valid = true,
          .id = id,
          .ghost = it->second,
          .censored_weight = options_.censoring ? weight : 0.0,
          .bucket = Bucket(age),
          .threshold_before = threshold_before,
          .threshold_after = sample_threshold_,
      };
    }
    sampled_.erase(it);
    return;
  }
}

void LongTailPolicy::CountEvent() {
  const uint64_t every = options_.relearn_every != 0 ? options_.relearn_every
                                                     : std::max<uint64_t>(2048, capacity_ / 2);
  if (++events_since_learn_ >= every) Relearn();
}

// value[a] = max over b >= a of P(reuse in buckets a..b | alive at a) / (time from a to the
// end of b): the best hit density a unit of this age can still achieve.
void LongTailPolicy::Relearn() {
  events_since_learn_ = 0;
  std::vector<double> cum(buckets_ + 1);
  // Kaplan-Meier: what is still under observation now (cached units, sampled ghosts) is
  // censored at its current age, with the weight its entry count has decayed to.
  std::array<std::vector<double>, kClasses> open;
  if (options_.censoring) {
    for (size_t c = 0; c < kClasses; ++c) open[c].assign(buckets_, 0.0);
    const uint64_t now = last_now_us_;
    for (const ClassList& l : lists_) {
      for (uint32_t s = l.first; s != kNil; s = slab_[s].next) {
        const Payload& p = slab_[s].data;
        open[p.cls][Bucket(now - std::min(now, p.entry_us))] += Decayed(p.epoch);
      }
    }
    for (const auto& [id, g] : sampled_) {
      (void)id;
      open[g.cls][Bucket(now - std::min(now, g.entry_us))] += g.weight * Decayed(g.epoch);
    }
  }
  std::vector<double> surv(buckets_ + 1);
  for (size_t c = 0; c < kClasses; ++c) {
    std::vector<double>& v = value_[c];
    if (entries_[c] < static_cast<double>(options_.min_entries)) {
      for (size_t a = 0; a < buckets_; ++a) v[a] = kPrior[c] / (1.0 + bucket_lo_s_[a]);
    } else if (options_.censoring) {
      // S(b) = product over earlier buckets of (1 - reuses / at risk); at risk = entries plus
      // resumed observations, less those that ended (reused or censored) in earlier buckets.
      double at_risk = entries_[c];
      surv[0] = 1.0;
      for (size_t b = 0; b < buckets_; ++b) {
        at_risk += resumed_[c][b];
        const double h = at_risk > 1e-9 ? std::min(1.0, reuses_[c][b] / at_risk) : 0.0;
        surv[b + 1] = surv[b] * (1.0 - h);
        at_risk = std::max(0.0, at_risk - reuses_[c][b] - censored_[c][b] - open[c][b]);
      }
      for (size_t a = 0; a < buckets_; ++a) {
        double best = 0;
        if (surv[a] > 1e-12) {
          for (size_t b = a; b < buckets_; ++b) {
            const double span_s = bucket_lo_s_[b + 1] - bucket_lo_s_[a];
            best = std::max(best, (1.0 - surv[b + 1] / surv[a]) / span_s);
          }
        }
        v[a] = best;
      }
    } else {
      cum[0] = 0;
      for (size_t a = 0; a < buckets_; ++a) cum[a + 1] = cum[a] + reuses_[c][a];
      for (size_t a = 0; a < buckets_; ++a) {
        const double alive = entries_[c] - cum[a];
        double best = 0;
        if (alive > 1e-9) {
          for (size_t b = a; b < buckets_; ++b) {
            const double span_s = bucket_lo_s_[b + 1] - bucket_lo_s_[a];
            best = std::max(best, (cum[b + 1] - cum[a]) / (alive * span_s));
          }
        }
        v[a] = best;
      }
    }
    for (double& x : reuses_[c]) x *= options_.decay;
    for (double& x : censored_[c]) x *= options_.decay;
    for (double& x : resumed_[c]) x *= options_.decay;
    entries_[c] *= options_.decay;
  }
  ++epoch_;
}

void LongTailPolicy::Remember(ObjectId id, const Payload& p, uint64_t now_us, Evicted* undo) {
  const uint64_t age = now_us - std::min(now_us, p.entry_us);
  undo->bucket = Bucket(age);
  if (options_.censoring) undo->censored_weight = Decayed(p.epoch);
  Censor(p.cls, age, Decayed(p.epoch));  // its observation as a cached unit ends unreused
  if (Sampled(id)) {
    // It goes on being observed as a sampled ghost, standing for 1/rate evicted units.
    const double w = sample_threshold_ == UINT64_MAX
                         ? 1.0
                         : kTwo64 / static_cast<double>(std::max<uint64_t>(sample_threshold_, 1));
    sampled_[id] = SampledGhost{p.entry_us, w, p.hits, p.cls, epoch_};
    resumed_[p.cls][Bucket(age)] += w;
    undo->sampled_weight = w;
    sampled_heap_.emplace_back(Hash(id), id);
    std::push_heap(sampled_heap_.begin(), sampled_heap_.end());
    while (sampled_.size() > options_.sampled_ghosts_max) DropLargestSample(now_us, undo);
    if (sampled_heap_.size() > 2 * options_.sampled_ghosts_max + 16) {
      // Stale heap entries (ids re-referenced since): rebuild from the table. Bounded.
      sampled_heap_.clear();
      for (const auto& [gid, g] : sampled_) {
        (void)g;
        sampled_heap_.emplace_back(Hash(gid), gid);
      }
      std::make_heap(sampled_heap_.begin(), sampled_heap_.end());
    }
  }
  const double cap = static_cast<double>(std::max<uint64_t>(capacity_, slab_.Live() + 1));
  const size_t limit = static_cast<size_t>(options_.ghost_factor * cap);
  if (limit == 0) return;
  ghosts_[id] = Ghost{p.entry_us, p.hits, p.cls};
  ghost_order_.push_back(id);
  undo->ghost = true;
  // Bounded by `limit`; a stale order entry (the ghost was re-referenced) erases nothing live
  // because the ghost was already erased then, unless re-evicted, which only refreshes it late.
  while (ghost_order_.size() > limit) {
    const ObjectId front = ghost_order_.front();
    if (auto g = ghosts_.find(front); g != ghosts_.end()) {
      undo->trimmed = Evicted::Trimmed{true, front, true, g->second};
      ghosts_.erase(g);
    } else {
      undo->trimmed = Evicted::Trimmed{true, front, false, {}};
    }
    ghost_order_.pop_front();
  }
}

double LongTailPolicy::CostFactor(const Payload& p) const {
  if (options_.cost_exponent == 0 || p.cost_per_byte <= 0 || cost_known_ == 0) return 1.0;
  const double mean = cost_sum_ / static_cast<double>(cost_known_);
  return mean > 0 ? std::pow(p.cost_per_byte / mean, options_.cost_exponent) : 1.0;
}

void LongTailPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  EndEvictions();
  Insert(info, now_us);
}

void LongTailPolicy::Insert(const ObjectInfo& info, uint64_t now_us) {
  if (Contains(info.id)) {
    OnAccess(info.id, now_us);
    return;
  }
  if (explicit_requests_) now_us = request_us_;
  NoteRequestBoundary(info.parent_id, info.id);
  last_now_us_ = std::max(last_now_us_, now_us);
  uint8_t hits = 0;
  bool ghost_hit = false, evicted_never_hit = false;
  if (auto g = sampled_.find(info.id); g != sampled_.end()) {
    CountReuse(g->second.cls, now_us - std::min(now_us, g->second.entry_us),
               g->second.weight * Decayed(g->second.epoch));
    hits = static_cast<uint8_t>(std::min<int>(g->second.hits + 1, 255));
    ghost_hit = true;
    evicted_never_hit = g->second.hits == 0;
    sampled_.erase(g);
  }
  if (auto g = ghosts_.find(info.id); g != ghosts_.end()) {
    // The exact ghosts carry hit counts; they feed the model only without sampled ghosts
    // (else an id in both would count twice, and unsampled ones would bias it).
    if (options_.sampled_ghosts_max == 0) {
      CountReuse(g->second.cls, now_us - std::min(now_us, g->second.entry_us), 1.0);
    }
    if (!ghost_hit) {
      hits = static_cast<uint8_t>(std::min<int>(g->second.hits + 1, 255));
      evicted_never_hit = g->second.hits == 0;
    }
    ghost_hit = true;
    ghosts_.erase(g);
  }
  if (ghost_hit) {
    if (options_.admit_step > 0) {
      const double f = 1.0 + options_.admit_step;
      admit_weight_ = std::clamp(evicted_never_hit ? admit_weight_ * f : admit_weight_ / f,
                                 kAdmitWeightMin, kAdmitWeightMax);
    }
    CountEvent();
  }
  uint8_t cls = kFresh;
  if (hits > 0) {
    cls = HitClass(hits);
  } else if (options_.split_extension && explicit_requests_ && request_nonroot_hit_) {
    cls = kExtension;
  } else if (options_.split_extension && info.parent_id != kNoParent) {
    // Also with explicit requests: a request resumed after another one's calls (interleaved
    // sessions) has lost request_nonroot_hit_, but its parent still says it was hit now.
    uint32_t ps = slab_.Find(info.parent_id);
    if (ps != kNil) {
      const Payload& pp = slab_[ps].data;
      // The parent was hit (or appended) in this same request, below a non-root prefix.
      if (pp.entry_us == now_us &&
          (pp.cls == kExtension || (pp.hits > 0 && pp.parent != kNoParent))) {
        cls = kExtension;
      }
    }
  }
  uint32_t s = slab_.Alloc(info.id);
  Payload& p = slab_[s].data;
  p.parent = info.parent_id;
  p.hits = hits;
  if (info.recompute_tokens > 0 && info.size_bytes > 0) {
    p.cost_per_byte =
        static_cast<double>(info.recompute_tokens) / static_cast<double>(info.size_bytes);
    cost_sum_ += p.cost_per_byte;
    ++cost_known_;
  }
  Link(s, cls, now_us);
  entries_[cls] += 1.0;
  capacity_ = std::max<uint64_t>(capacity_, slab_.Live());
}

void LongTailPolicy::OnAccess(ObjectId id, uint64_t now_us) {
  EndEvictions();
  uint32_t s = slab_.Find(id);
  if (s == kNil) return;
  if (explicit_requests_) now_us = request_us_;
  NoteRequestBoundary(slab_[s].data.parent, id);
  Payload& p = slab_[s].data;
  last_now_us_ = std::max(last_now_us_, now_us);
  if (p.parent != kNoParent) request_nonroot_hit_ = true;
  CountReuse(p.cls, now_us - std::min(now_us, p.entry_us), Decayed(p.epoch));
  p.hits = static_cast<uint8_t>(std::min<int>(p.hits + 1, 255));
  const uint8_t cls = HitClass(p.hits);
  Unlink(s);
  Link(s, cls, now_us);
  entries_[cls] += 1.0;
  CountEvent();
}

void LongTailPolicy::OnRemove(ObjectId id) {
  EndEvictions();
  uint32_t s = slab_.Find(id);
  if (s == kNil) return;
  const Payload& p = slab_[s].data;
  Censor(p.cls, last_now_us_ - std::min(last_now_us_, p.entry_us), Decayed(p.epoch));
  Unlink(s);
  slab_.Free(s);
}

std::optional<ObjectId> LongTailPolicy::Evict(uint64_t now_us) {
  uint32_t best = kNil;
  double best_value = 0;
  auto consider = [&](uint32_t s) {
    if (s == kNil) return;
    const Payload& p = slab_[s].data;
    double v = value_[p.cls][Bucket(now_us - std::min(now_us, p.entry_us))] * CostFactor(p);
    if (p.cls == kFresh || p.cls == kExtension) v *= admit_weight_;
    if (best == kNil || v < best_value ||
        (v == best_value && p.entry_us < slab_[best].data.entry_us)) {
      best = s;
      best_value = v;
    }
  };
  for (const ClassList& l : lists_) {
    if (l.size == 0) continue;
    consider(l.first);
    if (options_.young_end) consider(l.young_first);
  }
  if (best == kNil) return std::nullopt;
  const ObjectId id = slab_[best].id;
  const Payload p = slab_[best].data;
  // A victim is the first unit of its burst (the oldest or the youngest burst of its class);
  // the unit before it was, when any, the previous victim of these Evict calls from the same
  // burst, after which OnGiveBack puts it back.
  Evicted undo{.p = p, .epoch = epoch_};
  if (const RunVictim& last = run_last_[p.cls]; last.valid && last.entry_us == p.entry_us) {
    undo.prev = last.id;
    undo.has_prev = true;
  }
  run_last_[p.cls] = RunVictim{true, id, p.entry_us};
  undo.run_index = run_evictions_++;
  last_now_us_ = std::max(last_now_us_, now_us);
  Unlink(best);
  slab_.Free(best);
  Remember(id, p, now_us, &undo);
  CountEvent();
  evicted_.Add(id, undo);
  return id;
}

void LongTailPolicy::OnGiveBack(const ObjectInfo& info, uint64_t now_us) {
  if (Contains(info.id)) return;
  const std::optional<Evicted> e = evicted_.Take(info.id);
  if (!e) {
    // No record (not a victim of the last Evict calls): a new unit, but not a ghost hit.
    ghosts_.erase(info.id);
    sampled_.erase(info.id);
    Insert(info, now_us);
    return;
  }
  const ObjectId id = info.id;
  const uint8_t cls = e->p.cls;
  // Counts added at the eviction have decayed by every relearn since.
  const double decayed = std::pow(options_.decay, static_cast<double>(epoch_ - e->epoch));
  auto take_back = [&](double& count, double weight) {
    count = std::max(0.0, count - weight * decayed);
  };
  if (e->censored_weight > 0) take_back(censored_[cls][e->bucket], e->censored_weight);
  if (e->sampled_weight > 0) {
    // Its sampled ghost: still in the table, or dropped by the bound at once (then censored).
    if (auto it = sampled_.find(id); it != sampled_.end()) {
      take_back(resumed_[cls][e->bucket], e->sampled_weight);
      sampled_.erase(it);  // its heap entry is now stale, as after a re-reference
    } else if (e->drop.valid && e->drop.id == id) {
      take_back(resumed_[cls][e->bucket], e->sampled_weight);
    }
  }
  if (const Evicted::SampleDrop& d = e->drop; d.valid) {
    // The full table let go of its largest-hash sample for this one. Taken back exactly when
    // no later eviction dropped another since; else the lower rate stays (SHARDS's rate only
    // falls), and so does the dropped sample (the bound holds).
    take_back(censored_[d.ghost.cls][d.bucket], d.censored_weight);
    if (sample_threshold_ == d.threshold_after) {
      sample_threshold_ = d.threshold_before;
      if (d.id != id && sampled_.size() < options_.sampled_ghosts_max) {
        sampled_.emplace(d.id, d.ghost);
        sampled_heap_.emplace_back(Hash(d.id), d.id);
        std::push_heap(sampled_heap_.begin(), sampled_heap_.end());
      }
    }
  }
  if (e->ghost) {
    ghosts_.erase(id);
    // Its order entry is among the last ones pushed (one per eviction since); bounded search.
    auto it = ghost_order_.end();
    for (size_t steps = 0; it != ghost_order_.begin() && steps < decltype(evicted_)::kMax;
         ++steps) {
      if (*--it == id) {
        ghost_order_.erase(it);
        break;
      }
    }
    // The oldest ghost the bound let go of for it comes back (the table keeps its size).
    // Front entries taken back by other give-backs of these evictions keep their order (an
    // earlier eviction trimmed an older entry).
    if (const Evicted::Trimmed& t = e->trimmed; t.valid) {
      auto pos =
          std::lower_bound(run_trims_restored_.begin(), run_trims_restored_.end(), e->run_index);
      const size_t at = std::min<size_t>(pos - run_trims_restored_.begin(), ghost_order_.size());
      run_trims_restored_.insert(pos, e->run_index);
      ghost_order_.insert(ghost_order_.begin() + static_cast<std::ptrdiff_t>(at), t.id);
      if (t.had_ghost) ghosts_.emplace(t.id, t.ghost);
    }
  }
  if (epoch_ == e->epoch && events_since_learn_ > 0) --events_since_learn_;
  // Back right after the unit that was before it in its burst when that one is cached (given
  // back already), else first in its burst, where it was taken from.
  uint32_t after = e->has_prev ? slab_.Find(e->prev) : kNil;
  if (after != kNil &&
      (slab_[after].data.cls != cls || slab_[after].data.entry_us != e->p.entry_us)) {
    after = kNil;
  }
  const uint32_t s = slab_.Alloc(id);
  slab_[s].data = e->p;
  uint32_t at = after != kNil ? slab_[after].next : kNil;  // goes before it (kNil: last)
  Link(s, cls, e->p.entry_us, after != kNil ? &at : nullptr);
  slab_[s].data.epoch = e->p.epoch;  // Link stamps the current epoch
}

void LongTailPolicy::EndEvictions() {
  evicted_.Clear();
  run_last_ = {};
  run_evictions_ = 0;
  run_trims_restored_.clear();
}

std::string LongTailPolicy::TEST_StateDigest() const {
  std::string out;
  auto add = [&](const char* fmt, auto... args) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), fmt, args...);
    out += buf;
  };
  for (size_t c = 0; c < kClasses; ++c) {
    const ClassList& l = lists_[c];
    add("class %zu size %llu young %llu:", c, static_cast<unsigned long long>(l.size),
        static_cast<unsigned long long>(l.young_first == kNil ? 0 : slab_[l.young_first].id));
    for (uint32_t s = l.first; s != kNil; s = slab_[s].next) {
      const Payload& p = slab_[s].data;
      add(" %llu@%llu/h%u/p%llu/e%u", static_cast<unsigned long long>(slab_[s].id),
          static_cast<unsigned long long>(p.entry_us), p.hits,
          static_cast<unsigned long long>(p.parent), p.epoch);
    }
    out += "\n";
    for (const auto* counts : {&reuses_[c], &censored_[c], &resumed_[c]}) {
      for (double x : *counts) add(" %.9g", x);
      out += "\n";
    }
    add("entries %.9g\n", entries_[c]);
  }
  std::map<ObjectId, Ghost> ghosts(ghosts_.begin(), ghosts_.end());
  for (const auto& [id, g] : ghosts) {
    add("ghost %llu %llu %u %u\n", static_cast<unsigned long long>(id),
        static_cast<unsigned long long>(g.entry_us), g.hits, g.cls);
  }
  out += "order";
  for (ObjectId id : ghost_order_) add(" %llu", static_cast<unsigned long long>(id));
  out += "\n";
  std::map<ObjectId, SampledGhost> sampled(sampled_.begin(), sampled_.end());
  for (const auto& [id, g] : sampled) {
    add("sampled %llu %llu %.9g %u %u %u\n", static_cast<unsigned long long>(id),
        static_cast<unsigned long long>(g.entry_us), g.weight, g.hits, g.cls, g.epoch);
  }
  add("threshold %llu events %llu epoch %u admit %.9g capacity %llu\n",
      static_cast<unsigned long long>(sample_threshold_),
      static_cast<unsigned long long>(events_since_learn_), epoch_, admit_weight_,
      static_cast<unsigned long long>(capacity_));
  return out;
}

}  // namespace kvtier::policies
