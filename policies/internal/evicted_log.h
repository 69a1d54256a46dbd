// EvictedLog: what a policy's consecutive Evict calls recorded about their victims, so that
// OnGiveBack (policy.h) can put a victim back as it was. Evict adds a record; the policy's calls
// that touch objects (OnInsert, OnAccess, OnRemove, OnMiss) clear the log, since a give-back
// only ever follows the Evict calls it undoes; OnGiveBack takes its record.
//
// Bounded: at most kMax records, more than one prefix-layer Evict gives back
// (PrefixLayer::kHeldUnitsMax + 1); past that the oldest half is dropped, and a give-back of one
// of those finds no record (the policy then takes the object back as a new insert).
// Thread safety: none (owned by one policy instance).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "policies/policy.h"

namespace kvtier::policies::internal {

template <typename Record>
class EvictedLog {
 public:
  static constexpr size_t kMax = 16384;

  void Add(ObjectId id, const Record& record) {
    if (entries_.size() >= kMax) {
      entries_.erase(entries_.begin(), entries_.begin() + kMax / 2);
      first_ = 0;
    }
    entries_.push_back(Entry{id, false, record});
  }
  // The record of id's eviction, taken (a second Take of it finds none); nullopt when none.
  // Give-backs come in eviction order, so the search starts at the first record not taken.
  std::optional<Record> Take(ObjectId id) {
    for (size_t i = first_; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (e.taken || e.id != id) continue;
      e.taken = true;
      while (first_ < entries_.size() && entries_[first_].taken) ++first_;
      return e.record;
    }
    return std::nullopt;
  }
  void Clear() {
    entries_.clear();
    first_ = 0;
  }

 private:
  struct Entry {
    ObjectId id = 0;
    bool taken = false;
    Record record{};
  };
  std::vector<Entry> entries_;
  size_t first_ = 0;  // entries before it are all taken
};

}  // namespace kvtier::policies::internal
