// RecentDeletes: the deletes a node applied in the last window_ms, so that a repair copy
// of a unit that was deleted while the copy was on its way is refused instead of bringing
// the unit back (docs/CLUSTER.md, "Deletes and repair").
//
// A node notes a delete (of keys, or of a whole tenant) before it applies it, from every
// path: its own clients, a peer's fan-out, and the tombstone catch-up. A repair PUT
// (PeerPut::repair) for a key or tenant noted within window_ms is refused; the sender keeps
// the work and retries after its back-off, by which time the delete has reached it too (or
// the unit was written again, and the copy is then taken). Client PUTs are never refused:
// writing a key again after deleting it is normal.
//
// Memory is bounded by keys_max entries (about 80 bytes each). Past it, every repair PUT
// is refused until window_ms after the last overflow: safe (the copies wait), never wrong.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

#include "cluster/peer_wire.h"
#include "storage/key_util.h"

namespace kvtier::cluster {

struct RecentDeletesOptions {
  uint64_t window_ms = 10'000;  // 1..3'600'000
  size_t keys_max = 65'536;     // 1..16'777'216
};

class RecentDeletes {
 public:
  explicit RecentDeletes(RecentDeletesOptions options);

  void NoteKeys(std::span<const PeerKey> keys);
  void NoteTenant(std::string_view tenant);
  // True when a repair copy of `key` of `tenant` must be refused now.
  bool RefusesRepair(const PeerKey& key, std::string_view tenant);
  uint64_t refused() const;
  // RefusesRepair without counting: true when key or tenant was noted within window_ms (or
  // the set overflowed within it). The GET copies' fence (docs/CLUSTER.md, "Copies").
  bool Noted(const PeerKey& key, std::string_view tenant);
  // True when key or tenant was noted at or after since_ms (the clock's ms), or the set
  // overflowed within the window. For GET copies' overwrite fence.
  bool NotedSince(const PeerKey& key, std::string_view tenant, uint64_t since_ms);

  // Tests: the clock in ms (steady by default).
  void SetClockForTest(uint64_t (*now_ms)());

 private:
  void ExpireLocked(uint64_t now);
  bool NotedLocked(const PeerKey& key, std::string_view tenant);

  RecentDeletesOptions options_;
  uint64_t (*now_ms_)();
  mutable std::mutex mu_;
  std::unordered_map<PeerKey, uint64_t, storage::KeyHash> keys_;  // key -> noted at
  std::deque<std::pair<uint64_t, PeerKey>> order_;                // (noted at, key), oldest first
  std::map<std::string, uint64_t, std::less<>> tenants_;          // tenant -> noted at
  uint64_t refuse_all_until_ = 0;
  uint64_t refused_ = 0;
};

}  // namespace kvtier::cluster
