#include "sim/simulator.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "policies/belady/belady.h"

namespace kvtier::sim {
namespace {

using policies::AdmissionPolicy;
using policies::BeladyPolicy;
using policies::EvictionPolicy;
using policies::ObjectId;
using policies::ObjectInfo;

struct UnitKey {
  uint64_t id;
  uint32_t part;
  bool operator==(const UnitKey& o) const { return id == o.id && part == o.part; }
};
struct UnitKeyHash {
  size_t operator()(const UnitKey& k) const {
    uint64_t h = k.id * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(k.part) << 1);
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

class Builder {
 public:
  Builder(UnitTrace* out) : out_(out) {}
  // Appends one reference; parent is the dense index + 1 of the previous unit (0 = root).
  uint32_t Add(UnitKey key, uint32_t tokens, uint32_t whole_tokens, uint64_t size_bytes,
               uint32_t parent) {
    auto [it, inserted] = index_.emplace(key, static_cast<uint32_t>(out_->parent.size()));
    if (inserted) {
      out_->parent.push_back(parent);
      out_->size_bytes.push_back(size_bytes);
      out_->unit_tokens.push_back(whole_tokens);
    } else if (out_->size_bytes[it->second] == 0) {
      out_->size_bytes[it->second] = size_bytes;  // first named by a record that knew no size
    }
    out_->unit.push_back(it->second);
    out_->tokens.push_back(tokens);
    return it->second;
  }

 private:
  UnitTrace* out_;
  std::unordered_map<UnitKey, uint32_t, UnitKeyHash> index_;
};

Status ExpandMooncake(const Trace& trace, const UnitMapping& m, UnitTrace* out) {
  Builder b(out);
  for (const TraceRequest& r : trace.requests) {
    const uint32_t block = r.unit_tokens;
    const uint32_t unit = m.unit_tokens == 0 ? block : m.unit_tokens;
    if (block == 0 || (block % unit != 0 && unit % block != 0)) {
      return Status::InvalidArgument("unit_tokens " + std::to_string(unit) +
                                     " must divide or be a multiple of the block size " +
                                     std::to_string(block));
    }
    UnitTrace::Request ur{r.ts_ms, TraceOp::kGet, static_cast<uint32_t>(out->unit.size()), 0};
    uint32_t parent = 0;
    auto block_tokens = [&](uint32_t i) -> uint32_t {
      uint64_t before = static_cast<uint64_t>(i) * block;
      if (r.input_tokens <= before) return block;  // inconsistent length: count whole
      return static_cast<uint32_t>(std::min<uint64_t>(block, r.input_tokens - before));
    };
    const uint64_t size = static_cast<uint64_t>(unit) * m.bytes_per_token;
    if (unit <= block) {
      const uint32_t parts = block / unit;
      for (uint32_t i = 0; i < r.num_ids; ++i) {
        uint32_t t = block_tokens(i);
        for (uint32_t p = 0; p < parts && p * unit < t; ++p) {
          uint32_t tokens = std::min(unit, t - p * unit);
          UnitKey key{trace.ids[r.first_id + i], parts == 1 ? 0u : p + 1};
          parent = b.Add(key, tokens, unit, size, parent) + 1;
          ++ur.num_refs;
        }
      }
    } else {
      const uint32_t group = unit / block;  // blocks per unit; the last block names the unit
      for (uint32_t i = 0; i < r.num_ids; i += group) {
        uint32_t last = std::min(i + group, r.num_ids) - 1;
        uint32_t tokens = 0;
        for (uint32_t k = i; k <= last; ++k) tokens += block_tokens(k);
        UnitKey key{trace.ids[r.first_id + last], group};
        parent = b.Add(key, tokens, unit, size, parent) + 1;
        ++ur.num_refs;
      }
    }
    out->requests.push_back(ur);
  }
  return Status::Ok();
}

Status ExpandKvtier(const Trace& trace, const UnitMapping& m, UnitTrace* out) {
  if (m.unit_tokens != 0) {
    return Status::InvalidArgument(
        "kvtier traces are recorded in storage units; --unit-tokens "
        "applies to Mooncake traces only");
  }
  Builder b(out);
  // Per request id: its first record's ts, and the last unit (index + 1) its records named, the
  // parent of the next record's first unit (a turn's PUT continues the chain its GET read).
  struct Turn {
    uint64_t ts_ms;
    uint32_t last_unit;
  };
  std::unordered_map<uint64_t, Turn> turns;
  for (const TraceRequest& r : trace.requests) {
    UnitTrace::Request ur{r.ts_ms, r.op, static_cast<uint32_t>(out->unit.size()), r.num_ids,
                          r.request};
    const uint64_t size = r.num_ids == 0 ? 0 : r.bytes / r.num_ids;
    uint32_t parent = 0;
    Turn* turn = nullptr;
    if (r.request != 0) {
      turn = &turns.try_emplace(r.request, Turn{r.ts_ms, 0}).first->second;
      ur.ts_ms = turn->ts_ms;
      if (r.op != TraceOp::kDelete) parent = turn->last_unit;
    }
    for (uint32_t i = 0; i < r.num_ids; ++i) {
      // Chain ids are tenant-bound storage-key digests, so the tenant needs no extra key bits.
      parent = b.Add({trace.ids[r.first_id + i], 0}, r.unit_tokens, r.unit_tokens, size,
                     r.op == TraceOp::kDelete ? 0 : parent) +
               1;
    }
    if (turn != nullptr && r.op != TraceOp::kDelete && r.num_ids > 0) turn->last_unit = parent;
    out->requests.push_back(ur);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<UnitTrace> BuildUnitTrace(const Trace& trace, const UnitMapping& mapping) {
  UnitTrace out;
  if (trace.format == TraceFormat::kKvtier) {
    KVTIER_RETURN_IF_ERROR(ExpandKvtier(trace, mapping, &out));
  } else {
    KVTIER_RETURN_IF_ERROR(ExpandMooncake(trace, mapping, &out));
  }
  if (out.unit.size() >= UnitTrace::kNoNext) {
    return Status::InvalidArgument("trace has too many unit references");
  }
  // Next read of the same unit, scanning backwards; and unique units among reads.
  out.next_ref.assign(out.unit.size(), UnitTrace::kNoNext);
  std::vector<uint32_t> next_seen(out.parent.size(), UnitTrace::kNoNext);
  std::vector<bool> read(out.parent.size(), false);
  for (size_t q = out.requests.size(); q-- > 0;) {
    const auto& r = out.requests[q];
    const bool is_read = r.op == TraceOp::kGet || r.op == TraceOp::kLookup;
    for (uint32_t k = r.num_refs; k-- > 0;) {
      uint32_t t = r.first_ref + k;
      out.next_ref[t] = next_seen[out.unit[t]];
      if (is_read) {
        next_seen[out.unit[t]] = t;
        read[out.unit[t]] = true;
        ++out.read_refs;
      }
    }
  }
  // Recompute cost: units are numbered in first-reference order, so a parent precedes its
  // children and one forward pass gives every unit its prefix length.
  std::vector<uint64_t> prefix_tokens(out.parent.size(), 0);
  out.recompute_tokens.resize(out.parent.size());
  for (size_t u = 0; u < out.parent.size(); ++u) {
    const uint32_t p = out.parent[u];
    if (p != 0 && p - 1 < u) prefix_tokens[u] = prefix_tokens[p - 1] + out.unit_tokens[p - 1];
    const double cost =
        static_cast<double>(out.unit_tokens[u]) *
        (1.0 + static_cast<double>(prefix_tokens[u]) / static_cast<double>(kAttentionTokens));
    out.recompute_tokens[u] = static_cast<uint32_t>(std::min<double>(cost, UINT32_MAX));
  }
  uint64_t bytes = 0;
  for (size_t u = 0; u < read.size(); ++u) {
    if (read[u]) ++out.unique_units;
    bytes += out.size_bytes[u];
  }
  out.unit_bytes = out.parent.empty() ? 0 : bytes / out.parent.size();
  return out;
}

namespace {

// One tier: an eviction policy (under the prefix layer with kPrefix), a capacity, and the
// Belady hook when the policy is Belady.
struct Tier {
  std::unique_ptr<EvictionPolicy> policy;
  BeladyPolicy* belady = nullptr;
  policies::PrefixLayer* layer = nullptr;  // kPrefix: `policy` itself
  uint64_t capacity = 0;
};

StatusOr<Tier> MakeTier(const std::string& name, const policies::PolicyParams& params,
                        uint64_t capacity, Structure structure,
                        const std::function<std::unique_ptr<EvictionPolicy>()>& factory = {}) {
  Tier t;
  t.capacity = capacity;
  if (factory) {
    t.policy = factory();
  } else if (name == "belady") {
    if (!params.values.empty()) return Status::InvalidArgument("belady takes no parameters");
    auto b = std::make_unique<BeladyPolicy>();
    t.belady = b.get();
    t.policy = std::move(b);
  } else {
    KVTIER_ASSIGN_OR_RETURN(t.policy, policies::MakeEvictionPolicy(name, params));
  }
  t.policy = policies::WithStructure(std::move(t.policy), structure, &t.layer);
  t.policy->OnCapacity(capacity);
  return t;
}

class Replay {
 public:
  Replay(const UnitTrace& trace, const SimOptions& options, Tier dram, Tier ssd,
         std::unique_ptr<AdmissionPolicy> admission)
      : trace_(trace),
        options_(options),
        dram_(std::move(dram)),
        ssd_(std::move(ssd)),
        admission_(std::move(admission)) {}

  SimResult Run();

 private:
  ObjectInfo Info(uint32_t u) const {
    uint32_t p = trace_.parent[u];
    return ObjectInfo{.id = u + 1ull,
                      .size_bytes = trace_.size_bytes[u],
                      .parent_id = p == 0 ? policies::kNoParent : static_cast<ObjectId>(p),
                      .recompute_tokens = trace_.recompute_tokens[u],
                      .kind = policies::ObjectKind::kGlobalKv};
  }
  // The SSD policy is told of a request when the request first reaches it (as the live SSD
  // tier does: storage::RequestTag), not at every request.
  EvictionPolicy* Ssd() {
    if (ssd_request_ != request_key_) {
      Begin(ssd_);
      ssd_request_ = request_key_;
    }
    return ssd_.policy.get();
  }
  // The running request begins (or resumes) for the tier's policy. A Mooncake request (one
  // record, no request id) names its units up front, and the layer may give back as many.
  void Begin(Tier& tier) {
    if (tier.layer != nullptr) {
      tier.layer->BeginRequest(request_key_, now_us_, request_units_);
    } else {
      tier.policy->OnRequest(now_us_);
    }
  }
  // A reference to unit u whose next read is `next`: Belady (either tier) takes it at the
  // unit's next OnInsert / OnAccess, whenever that comes (the prefix layer may hold an access
  // back or give a victim back later).
  void Refer(uint32_t u, uint32_t next) {
    if (dram_.belady != nullptr) dram_.belady->SetNextAccess(u + 1ull, next);
    if (ssd_.belady != nullptr) ssd_.belady->SetNextAccess(u + 1ull, next);
  }
  void InsertInto(Tier& tier, uint32_t u, bool demote_victims);
  void Demote(ObjectId victim);
  void RunPrefixRequest(const UnitTrace::Request& r);
  // A kvtier "lookup": its references are counted (hits, misses, prefix tokens) from what the
  // tiers hold, and no policy is told anything, as the live Lookup touches no policy.
  void CountLookup(const UnitTrace::Request& r);
  // A "get" of a request whose lookup already counted the references: only the policies hear
  // of it (hits, SSD hits promoted); a miss does nothing (the request's put inserts it).
  void TouchLookedUp(const UnitTrace::Request& r);

  const UnitTrace& trace_;
  const SimOptions& options_;
  Tier dram_, ssd_;
  std::unique_ptr<AdmissionPolicy> admission_;
  std::vector<uint8_t> outcome_;  // kPrefix: per ref of a request
  uint64_t now_us_ = 0;
  // The running request (its trace id, or a fresh key for a record without one, never 0) and
  // the last one the DRAM policy (Run) and the SSD policy (Ssd()) were told of; 0: none yet.
  uint64_t request_key_ = 0, dram_request_ = 0, ssd_request_ = 0;
  size_t request_units_ = 0;       // a request without an id: its units (PrefixLayer's units_hint)
  std::vector<uint32_t> promote_;  // kPlain: SSD hits of the record, promoted at its end
  // Requests (ids) that had a lookup record, the newest kLookedUpMax: a record of one of them
  // may come after other requests' records (concurrent clients), not only right after it.
  static constexpr size_t kLookedUpMax = 65536;
  std::unordered_set<uint64_t> looked_up_;
  std::deque<uint64_t> looked_up_order_;
  SimResult res_;
};

void Replay::CountLookup(const UnitTrace::Request& r) {
  bool prefix_alive = true;
  for (uint32_t k = 0; k < r.num_refs; ++k) {
    const uint32_t t = r.first_ref + k;
    const ObjectId id = trace_.unit[t] + 1ull;
    ++res_.read_refs;
    admission_->OnLookup(id, now_us_);
    res_.input_tokens += trace_.tokens[t];
    // The live Lookup answers the leading hits only: from the first miss on, every unit is a
    // miss to the engine (it recomputes and puts them), cached or not.
    if (prefix_alive && dram_.policy->Contains(id)) {
      ++res_.dram_hits;
    } else if (prefix_alive && ssd_.capacity > 0 && ssd_.policy->Contains(id)) {
      ++res_.ssd_hits;
    } else {
      prefix_alive = false;
      ++res_.misses;
      continue;
    }
    res_.prefix_hit_tokens += trace_.tokens[t];
  }
}

void Replay::TouchLookedUp(const UnitTrace::Request& r) {
  for (uint32_t k = 0; k < r.num_refs; ++k) {
    const uint32_t t = r.first_ref + k;
    const uint32_t u = trace_.unit[t];
    Refer(u, trace_.next_ref[t]);
    if (dram_.policy->Contains(u + 1ull)) {
      dram_.policy->OnAccess(u + 1ull, now_us_);
    } else if (ssd_.capacity > 0 && ssd_.policy->Contains(u + 1ull)) {
      Ssd()->OnAccess(u + 1ull, now_us_);
      promote_.push_back(u);
    }
  }
  // Promoted after the record's hits, as the live tiers promote a batch GET's SSD hits (under
  // the prefix layer deepest first, as it inserts).
  if (options_.structure == Structure::kPrefix) std::reverse(promote_.begin(), promote_.end());
  for (uint32_t u : promote_) {
    if (ssd_.policy->Contains(u + 1ull) && !dram_.policy->Contains(u + 1ull)) {
      InsertInto(dram_, u, true);
    }
  }
  promote_.clear();
}

void Replay::InsertInto(Tier& tier, uint32_t u, bool demote_victims) {
  if (tier.capacity == 0) return;
  if (&tier == &ssd_) (void)Ssd();
  tier.policy->OnMiss(u + 1ull, now_us_);
  // Bounded: each Evict removes one tracked object (kPrefix: the layer's held units and
  // leaf-first swaps happen inside Evict).
  while (tier.policy->Size() >= tier.capacity) {
    std::optional<ObjectId> victim = tier.policy->Evict(now_us_);
    if (!victim) break;
    if (demote_victims) Demote(*victim);
  }
  tier.policy->OnInsert(Info(u), now_us_);
}

void Replay::Demote(ObjectId victim) {
  if (ssd_.capacity == 0 || ssd_.policy->Contains(victim)) return;
  uint32_t u = static_cast<uint32_t>(victim - 1);
  if (!admission_->Admit(Info(u), now_us_)) {
    ++res_.ssd_rejected;
    return;
  }
  ++res_.ssd_admitted;
  res_.ssd_bytes_written += trace_.size_bytes[u];
  InsertInto(ssd_, u, /*demote_victims=*/false);
}

SimResult Replay::Run() {
  const uint64_t total = trace_.unit.size();
  const uint64_t progress_step = std::max<uint64_t>(total / 100, 1);
  uint64_t done = 0;
  uint64_t last_request = 0;
  for (const auto& r : trace_.requests) {
    now_us_ = r.ts_ms * 1000;
    if (r.request == 0 || r.request != last_request) {
      ++res_.requests;
      request_key_ = r.request != 0 ? r.request : (uint64_t{1} << 63) + res_.requests;
      const bool read = r.op == TraceOp::kGet || r.op == TraceOp::kLookup;
      request_units_ = r.request == 0 && read ? r.num_refs : 0;
    }
    last_request = r.request;
    // A lookup record touches no policy (CountLookup), as the live Lookup touches none: the
    // DRAM policy is told of a request at a record that is not a lookup whenever the last
    // request it was told of is another, as a live memory tier tells its policy whenever the
    // request of a call that reaches it differs from the previous one's. (Told at lookups, a
    // turn whose LOOKUP ran between another turn's GET and PUT made that PUT a new request.)
    if (r.op != TraceOp::kLookup && dram_request_ != request_key_) {
      Begin(dram_);
      dram_request_ = request_key_;
    }
    if (r.op == TraceOp::kLookup ||
        (r.op == TraceOp::kGet && r.request != 0 && looked_up_.count(r.request) != 0)) {
      if (options_.progress) {
        for (uint32_t k = 0; k < r.num_refs; ++k) {
          if (++done % progress_step == 0) {
            options_.progress(static_cast<double>(done) / static_cast<double>(total));
          }
        }
      }
      if (r.op == TraceOp::kLookup) {
        CountLookup(r);
        if (r.request != 0 && looked_up_.insert(r.request).second) {
          looked_up_order_.push_back(r.request);
          if (looked_up_order_.size() > kLookedUpMax) {
            looked_up_.erase(looked_up_order_.front());
            looked_up_order_.pop_front();
          }
        }
      } else {
        TouchLookedUp(r);
      }
      continue;
    }
    if (options_.structure == Structure::kPrefix && r.op != TraceOp::kDelete &&
        r.op != TraceOp::kPut) {
      if (options_.progress) {
        for (uint32_t k = 0; k < r.num_refs; ++k) {
          if (++done % progress_step == 0) {
            options_.progress(static_cast<double>(done) / static_cast<double>(total));
          }
        }
      }
      RunPrefixRequest(r);
      continue;
    }
    bool prefix_alive = true;
    for (uint32_t k = 0; k < r.num_refs; ++k) {
      const uint32_t t = r.first_ref + k;
      const uint32_t u = trace_.unit[t];
      const ObjectId id = u + 1ull;
      if (options_.progress && ++done % progress_step == 0) {
        options_.progress(static_cast<double>(done) / static_cast<double>(total));
      }
      if (r.op == TraceOp::kDelete) {
        dram_.policy->OnRemove(id);
        if (ssd_.capacity > 0) ssd_.policy->OnRemove(id);
        continue;
      }
      Refer(u, trace_.next_ref[t]);
      if (r.op == TraceOp::kPut) {
        if (dram_.policy->Contains(id)) {
          dram_.policy->OnRemove(id);  // the put replaces it
          InsertInto(dram_, u, true);
        } else if (!(ssd_.capacity > 0 && ssd_.policy->Contains(id))) {
          InsertInto(dram_, u, true);
        } else {
          // A new version of a unit on SSD: it goes to DRAM and the old SSD copy is removed.
          InsertInto(dram_, u, true);
          if (ssd_.policy->Contains(id)) {  // not evicted by the insert's own demotions
            ssd_.policy->OnRemove(id);
          }
        }
        continue;
      }
      ++res_.read_refs;
      admission_->OnLookup(id, now_us_);
      bool hit = true;
      if (dram_.policy->Contains(id)) {
        ++res_.dram_hits;
        dram_.policy->OnAccess(id, now_us_);
      } else if (ssd_.capacity > 0 && ssd_.policy->Contains(id)) {
        ++res_.ssd_hits;
        Ssd()->OnAccess(id, now_us_);
        promote_.push_back(u);  // promoted at the end of the record (below)
      } else {
        hit = false;
        ++res_.misses;
        InsertInto(dram_, u, true);
      }
      res_.input_tokens += trace_.tokens[t];
      if (hit && prefix_alive) {
        res_.prefix_hit_tokens += trace_.tokens[t];
      } else {
        if (hit) ++res_.unusable_hits;
        prefix_alive = false;
      }
    }
    // SSD hits move to DRAM after the record's hits were all counted, as the live tiers
    // promote a batch GET's SSD hits; one the SSD evicted meanwhile stays out.
    for (uint32_t u : promote_) {
      if (ssd_.policy->Contains(u + 1ull) && !dram_.policy->Contains(u + 1ull)) {
        InsertInto(dram_, u, true);
      }
    }
    promote_.clear();
  }
  if (options_.progress) options_.progress(1.0);
  for (const Tier* tier : {&dram_, &ssd_}) {
    if (tier->layer != nullptr) res_.leaf_swaps += tier->layer->leaf_swaps();
  }
  return res_;
}

void Replay::RunPrefixRequest(const UnitTrace::Request& r) {
  enum : uint8_t { kPartial, kDramHit, kSsdHit, kMiss };
  outcome_.assign(r.num_refs, kMiss);
  bool prefix_alive = true;
  // Lookups in prefix order: what the engine finds cached when the request arrives.
  for (uint32_t k = 0; k < r.num_refs; ++k) {
    const uint32_t t = r.first_ref + k;
    const uint32_t u = trace_.unit[t];
    const ObjectId id = u + 1ull;
    Refer(u, trace_.next_ref[t]);
    ++res_.read_refs;
    admission_->OnLookup(id, now_us_);
    uint8_t o = kMiss;
    if (trace_.tokens[t] < trace_.unit_tokens[u]) {
      o = kPartial;
      ++res_.partial_refs;
    } else if (dram_.policy->Contains(id)) {
      o = kDramHit;
      ++res_.dram_hits;
    } else if (ssd_.capacity > 0 && ssd_.policy->Contains(id)) {
      o = kSsdHit;
      ++res_.ssd_hits;
    }
    if (o == kMiss || o == kPartial) ++res_.misses;
    outcome_[k] = o;
    res_.input_tokens += trace_.tokens[t];
    const bool hit = o == kDramHit || o == kSsdHit;
    if (hit && prefix_alive) {
      res_.prefix_hit_tokens += trace_.tokens[t];
    } else {
      if (hit) ++res_.unusable_hits;
      prefix_alive = false;
    }
  }
  // Hits first, in prefix order: the layer delivers them deepest first, so the request's root
  // is its most recently touched hit. Then the misses are inserted, deepest first; the layer
  // holds this request's units meanwhile.
  for (uint32_t k = 0; k < r.num_refs; ++k) {
    const uint32_t u = trace_.unit[r.first_ref + k];
    if (outcome_[k] == kDramHit) {
      dram_.policy->OnAccess(u + 1ull, now_us_);
    } else if (outcome_[k] == kSsdHit) {
      Ssd()->OnAccess(u + 1ull, now_us_);
    }
  }
  for (uint32_t k = r.num_refs; k-- > 0;) {
    const uint32_t u = trace_.unit[r.first_ref + k];
    if (outcome_[k] == kPartial || outcome_[k] == kDramHit) continue;
    if (!dram_.policy->Contains(u + 1ull)) InsertInto(dram_, u, true);
  }
  // A unit of this request may have been evicted after all (the request outgrew what could be
  // given back): its cached descendants in the request are then of no use and are dropped.
  for (uint32_t k = 1; k < r.num_refs; ++k) {
    const uint32_t u = trace_.unit[r.first_ref + k];
    const uint32_t above = trace_.unit[r.first_ref + k - 1];
    if (dram_.policy->Contains(u + 1ull) && !dram_.policy->Contains(above + 1ull)) {
      dram_.policy->OnRemove(u + 1ull);
      ++res_.orphans_dropped;
    }
  }
}

}  // namespace

StatusOr<SimResult> Simulate(const UnitTrace& trace, const SimOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(
      Tier dram, MakeTier(options.policy, options.policy_params, options.dram_capacity_units,
                          options.structure, options.dram_policy_factory));
  KVTIER_ASSIGN_OR_RETURN(
      Tier ssd, MakeTier(options.ssd_policy, options.ssd_policy_params, options.ssd_capacity_units,
                         options.structure, options.ssd_policy_factory));
  KVTIER_ASSIGN_OR_RETURN(
      auto admission, policies::MakeAdmissionPolicy(options.admission, options.admission_params));
  if (options.price_uncached_per_mtok < 0) {
    return Status::InvalidArgument("uncached price must be >= 0");
  }
  Replay replay(trace, options, std::move(dram), std::move(ssd), std::move(admission));
  SimResult r = replay.Run();
  r.policy = options.policy;
  r.structure = options.structure;
  r.ssd_policy = options.ssd_capacity_units > 0 ? options.ssd_policy : "";
  r.admission = options.ssd_capacity_units > 0 ? options.admission : "";
  r.capacity_units = options.dram_capacity_units;
  r.ssd_capacity_units = options.ssd_capacity_units;
  r.unique_units = trace.unique_units;
  r.block_miss_ratio =
      r.read_refs == 0 ? 0.0 : static_cast<double>(r.misses) / static_cast<double>(r.read_refs);
  r.prefix_token_hit_ratio = r.input_tokens == 0 ? 0.0
                                                 : static_cast<double>(r.prefix_hit_tokens) /
                                                       static_cast<double>(r.input_tokens);
  const double uncached = options.price_uncached_per_mtok;
  const double cached =
      options.price_cached_per_mtok < 0 ? 0.02 * uncached : options.price_cached_per_mtok;
  const double miss_tokens = static_cast<double>(r.input_tokens - r.prefix_hit_tokens);
  r.cost_no_cache_usd = static_cast<double>(r.input_tokens) * uncached / 1e6;
  r.cost_with_cache_usd =
      (miss_tokens * uncached + static_cast<double>(r.prefix_hit_tokens) * cached) / 1e6;
  r.money_saved_usd = r.cost_no_cache_usd - r.cost_with_cache_usd;
  return r;
}

}  // namespace kvtier::sim
