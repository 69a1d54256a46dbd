// Test helpers shared by the live-vs-simulator tests: a policy wrapper that records every
// hook call, and the simulator's side of a comparison.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "policies/policy.h"
#include "sim/simulator.h"
#include "sim/trace.h"

namespace kvtier::sim::live_test {

using policies::EvictionPolicy;
using policies::ObjectId;
using policies::ObjectInfo;

// Forwards every call to `inner` and appends one line per hook to *log, ids translated by
// `map` (live storage ids -> the simulator's dense ids; null: unchanged). With assign_new, an
// id not in `map` gets the next dense id (1, 2, ...) when the policy first sees it, which is
// the simulator's numbering (first use) when the live run meets units in trace order.
// `mu` (may be null): held for every use of *map and *log, for a map and logs that other
// threads use too (kvtierd's tiers call their policies under locks of their own, and the test
// numbers units as it runs).
class RecordingPolicy final : public EvictionPolicy {
 public:
  RecordingPolicy(std::unique_ptr<EvictionPolicy> inner, std::vector<std::string>* log,
                  std::unordered_map<ObjectId, ObjectId>* map, bool assign_new = false,
                  std::mutex* mu = nullptr)
      : inner_(std::move(inner)), log_(log), map_(map), assign_new_(assign_new), mu_(mu) {}
  std::string_view Name() const override { return "recording"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override {
    Log("insert " + Id(info.id) + " parent " + Id(info.parent_id) + " t " + T(now_us));
    ObjectInfo i = info;
    i.id = Map(info.id);
    i.parent_id = Map(info.parent_id);
    i.recompute_tokens = 0;  // the simulator's cost model is not the engine's
    i.size_bytes = 4096;
    inner_->OnInsert(i, now_us);
  }
  void OnAccess(ObjectId id, uint64_t now_us) override {
    Log("access " + Id(id) + " t " + T(now_us));
    inner_->OnAccess(Map(id), now_us);
  }
  void OnRemove(ObjectId id) override {
    Log("remove " + Id(id));
    inner_->OnRemove(Map(id));
  }
  void OnGiveBack(const ObjectInfo& info, uint64_t now_us) override {
    Log("giveback " + Id(info.id) + " t " + T(now_us));
    ObjectInfo i = info;
    i.id = Map(info.id);
    i.parent_id = Map(info.parent_id);
    i.recompute_tokens = 0;
    i.size_bytes = 4096;
    inner_->OnGiveBack(i, now_us);
  }
  void OnMiss(ObjectId id, uint64_t now_us) override {
    Log("miss " + Id(id) + " t " + T(now_us));
    inner_->OnMiss(Map(id), now_us);
  }
  void OnCapacity(uint64_t capacity_objects) override {
    Log("capacity " + std::to_string(capacity_objects));
    inner_->OnCapacity(capacity_objects);
  }
  void OnRequest(uint64_t now_us) override {
    Log("request t " + T(now_us));
    inner_->OnRequest(now_us);
  }
  std::optional<ObjectId> Evict(uint64_t now_us) override {
    std::optional<ObjectId> v = inner_->Evict(now_us);
    Log("evict t " + T(now_us) + " -> " + (v ? std::to_string(*v) : "none"));
    if (v && map_ != nullptr) {
      std::unique_lock<std::mutex> lock = Lock();
      for (const auto& [live, dense] : *map_) {
        if (dense == *v) return live;
      }
    }
    return v;
  }
  size_t Size() const override { return inner_->Size(); }
  bool Contains(ObjectId id) const override { return inner_->Contains(Map(id)); }

 private:
  std::unique_lock<std::mutex> Lock() const {
    return mu_ != nullptr ? std::unique_lock<std::mutex>(*mu_) : std::unique_lock<std::mutex>();
  }
  ObjectId Map(ObjectId id) const {
    if (map_ == nullptr || id == policies::kNoParent) return id;
    std::unique_lock<std::mutex> lock = Lock();
    auto it = map_->find(id);
    if (it != map_->end()) return it->second;
    if (!assign_new_) return id;
    return map_->emplace(id, map_->size() + 1).first->second;
  }
  std::string Id(ObjectId id) const { return std::to_string(Map(id)); }
  static std::string T(uint64_t us) { return std::to_string(us); }
  void Log(std::string line) {
    std::unique_lock<std::mutex> lock = Lock();
    log_->push_back(std::move(line));
  }

  std::unique_ptr<EvictionPolicy> inner_;
  std::vector<std::string>* log_;
  std::unordered_map<ObjectId, ObjectId>* map_;
  bool assign_new_;
  std::mutex* mu_;
};

using MakeInner = std::function<std::unique_ptr<EvictionPolicy>()>;

// The hook log of `trace` replayed by the simulator (plain structure, or `structure`: the
// recording policy is then the prefix layer's inner policy) with a DRAM tier of
// capacity_units and a recording policy around make(); with ssd_units > 0 also an SSD tier
// of that many units, admitted by the policy `admission`, whose policy's calls go to *ssd_log.
inline std::vector<std::string> SimRun(const MakeInner& make, uint64_t capacity_units,
                                       const Trace& trace, uint64_t ssd_units = 0,
                                       std::vector<std::string>* ssd_log = nullptr,
                                       Structure structure = Structure::kPlain,
                                       const std::string& admission = "admit-all") {
  std::vector<std::string> log;
  auto units = BuildUnitTrace(trace);
  EXPECT_TRUE(units.ok()) << units.status().ToString();
  SimOptions o;
  o.structure = structure;
  o.dram_capacity_units = capacity_units;
  o.dram_policy_factory = [&]() -> std::unique_ptr<EvictionPolicy> {
    return std::make_unique<RecordingPolicy>(make(), &log, nullptr);
  };
  if (ssd_units > 0) {
    o.ssd_capacity_units = ssd_units;
    o.admission = admission;
    o.ssd_policy_factory = [&]() -> std::unique_ptr<EvictionPolicy> {
      return std::make_unique<RecordingPolicy>(make(), ssd_log, nullptr);
    };
  }
  auto r = Simulate(*units, o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return log;
}

// The units a tier holds after the calls in `log` reached its (inner) policy: inserts and
// give-backs add, removals and Evict's answers take away. *victims (when not null) gets every
// unit that left the tier by eviction, in order: an Evict answer not given back, or the leaf a
// layer evicted instead. A prefix layer's Evict is inner Evicts, then the give-backs of the held
// victims it set aside, in the order chosen; a leaf swap gives the victim back last and removes
// the leaf right after ("evict v ... giveback v, remove leaf").
inline std::set<std::string> Cached(const std::vector<std::string>& log,
                                    std::vector<std::string>* victims = nullptr) {
  std::set<std::string> cached;
  auto word = [](const std::string& line, size_t n) {
    size_t b = 0;
    for (size_t i = 0; i < n; ++i) b = line.find(' ', b) + 1;
    return line.substr(b, line.find(' ', b) - b);
  };
  for (size_t i = 0; i < log.size(); ++i) {
    const std::string& l = log[i];
    if (l.starts_with("insert ") || l.starts_with("giveback ")) {
      cached.insert(word(l, 1));
    } else if (l.starts_with("remove ")) {
      cached.erase(word(l, 1));
    } else if (l.starts_with("evict ") && !l.ends_with("none")) {
      const std::string v = l.substr(l.rfind(' ') + 1);
      cached.erase(v);
      if (victims == nullptr) continue;
      // Its give-back, if any, follows among the same Evict's evicts and give-backs.
      size_t j = i + 1;
      while (j < log.size() && log[j].starts_with("evict ") && !log[j].ends_with(" " + v)) ++j;
      while (j < log.size() && log[j].starts_with("giveback ") &&
             !log[j].starts_with("giveback " + v + " ")) {
        ++j;
      }
      if (j == log.size() || !log[j].starts_with("giveback " + v + " ")) {
        victims->push_back(v);
      } else if (j + 1 < log.size() && log[j + 1].starts_with("remove ")) {
        victims->push_back(word(log[j + 1], 1));  // the leaf below v
      }
    }
  }
  return cached;
}

inline MakeInner Named(const std::string& name) {
  return [name]() {
    auto p = policies::MakeEvictionPolicy(name);
    EXPECT_TRUE(p.ok());
    return std::move(*p);
  };
}

}  // namespace kvtier::sim::live_test
