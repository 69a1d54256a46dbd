// HotRowCache: a small LRU cache of Engram rows, bounded by bytes.
//
// Keys are global row numbers of one table; values are whole rows (row_stride_bytes each).
// Engram lookups are Zipfian (frequent n-grams repeat), so a few MiB absorb a large share
// of reads.
//
// Thread safety: not thread-safe; RowFetcher guards it with its mutex.
#pragma once

#include <cstdint>
#include <cstring>
#include <list>
#include <unordered_map>
#include <vector>

namespace kvtier::rdma {

class HotRowCache {
 public:
  // Holds at most capacity_bytes / row_bytes rows (0 disables the cache).
  HotRowCache(uint64_t capacity_bytes, uint32_t row_bytes)
      : rows_max_(row_bytes == 0 ? 0 : capacity_bytes / row_bytes), row_bytes_(row_bytes) {}

  // On a hit copies the row to `out` (row_bytes), marks it most recent and returns true;
  // on a miss leaves `out` untouched and returns false.
  bool Lookup(uint64_t row, uint8_t* out) {
    auto it = index_.find(row);
    if (it == index_.end()) return false;
    lru_.splice(lru_.begin(), lru_, it->second);
    std::memcpy(out, it->second->bytes.data(), row_bytes_);
    return true;
  }

  // Inserts or refreshes `row` from `data` (row_bytes), evicting the least recent rows.
  void Insert(uint64_t row, const uint8_t* data) {
    if (rows_max_ == 0) return;
    auto it = index_.find(row);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return;  // rows are immutable: the cached bytes are already right
    }
    if (index_.size() >= rows_max_) {
      Entry& victim = lru_.back();
      index_.erase(victim.row);
      victim.row = row;  // reuse the victim's storage
      std::memcpy(victim.bytes.data(), data, row_bytes_);
      lru_.splice(lru_.begin(), lru_, std::prev(lru_.end()));
    } else {
      lru_.push_front(Entry{row, std::vector<uint8_t>(data, data + row_bytes_)});
    }
    index_[row] = lru_.begin();
  }

  size_t size() const { return index_.size(); }
  uint64_t bytes() const { return index_.size() * uint64_t{row_bytes_}; }
  uint64_t rows_max() const { return rows_max_; }

 private:
  struct Entry {
    uint64_t row;
    std::vector<uint8_t> bytes;
  };
  uint64_t rows_max_;
  uint32_t row_bytes_;
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<uint64_t, std::list<Entry>::iterator> index_;
};

}  // namespace kvtier::rdma
