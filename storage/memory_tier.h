// MemoryTier: a bounded arena with slab classes and a sharded concurrent index. One class
// serves both the DRAM tier (host arena: cudaHostAlloc-pinned when CUDA is compiled in and a
// GPU is present, otherwise mmap, optionally mlock'd) and the HBM tier (cudaMalloc device
// arena when a GPU is present, otherwise a host-emulated arena with the same interface).
//
// Allocation: the arena is cut into pages (slab_page_bytes); a page is given to one slab class
// (chunk sizes grow by ~1.25x from 64 B to the page size) on demand, and returns to the free
// page pool when its last chunk is freed. Values larger than a page do not fit this tier.
// A host (mmap) arena's page is populated (prefaulted writable, one madvise) the first time
// it is handed out, so inserts into it take no page fault each: the arena's resident memory
// grows a page at a time. The host arena is 2 MiB-aligned and advised for transparent huge
// pages (MADV_HUGEPAGE; effective where THP is "madvise" or "always"), so that population
// maps 2 MiB pages rather than 4 KiB ones.
// Insert never evicts: when no chunk is free it returns Rejected, and the caller (TierManager)
// asks PickVictim for a victim, demotes it and removes it, then retries.
//
// Thread safety: all methods may be called concurrently. Reads copy out under their shard's
// lock, so a concurrent Remove never frees memory that is being read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "policies/policy.h"
#include "policies/prefix_layer/prefix_layer.h"
#include "storage/tier_manager.h"

namespace kvtier::storage {

struct MemoryTierOptions {
  Tier tier = Tier::kDram;  // kDram or kHbm
  uint64_t capacity_bytes = 1ull << 30;
  uint64_t slab_page_bytes = 4ull << 20;
  // DRAM: mlock the arena (failure is logged, not fatal). HBM: ignored.
  bool mlock = false;
  // Host arenas: populate the whole arena at open instead of each slab page on its first use,
  // so that inserts never pay the first touch (on a VM whose host backs freed memory again on
  // the next touch, ~0.3 GB/s: docs/performance/daemon.md, "Native PUT: two speeds").
  bool prefault = false;
  // Use CUDA memory (pinned host for DRAM, device for HBM) when compiled with CUDA and a GPU
  // is present; otherwise, or when false, host memory from mmap.
  bool use_cuda = true;
  uint32_t shards = 16;  // clamped to [1, 256]
  // Objects the tier may hold (0: no limit): an insert of a new key beyond it is Rejected as
  // a full arena's is (the caller evicts and retries). Bounds the host memory of the
  // bookkeeping (index, policy) that tiny values would grow past the arena's own size.
  uint64_t objects_max = 0;
  std::string eviction_policy = "lru";
  policies::PolicyParams policy_params;
  // kPrefix: the policy runs under policies::PrefixLayer (also after SetPolicy), told of each
  // request by BeginRequest(RequestTag::id).
  policies::Structure structure = policies::Structure::kPlain;
  // Tests: when set, makes this tier's policy instead of eviction_policy (SetPolicy still
  // switches to a named one).
  std::function<std::unique_ptr<policies::EvictionPolicy>()> eviction_policy_factory;
  const Clock* clock = nullptr;  // nullptr: DefaultSteadyClock()
};

// What the tier keeps with each value.
struct MemMeta {
  TenantId tenant = 0;
  uint64_t version = 0;
  policies::ObjectKind kind = policies::ObjectKind::kGlobalKv;
  uint64_t expires_ms = 0;  // in the options clock's ms; 0 = never
  policies::ObjectId parent_id = 0;
  uint32_t recompute_tokens = 0;
  bool allow_ssd = true;
  uint32_t size_bytes = 0;  // filled by the tier
};

struct MemoryTierStats {
  uint64_t capacity_bytes = 0, used_bytes = 0, chunk_bytes = 0, objects = 0, objects_max = 0;
  uint64_t hits = 0, evictions = 0, bytes_read = 0, bytes_written = 0;
};

class MemoryTier {
 public:
  static StatusOr<std::unique_ptr<MemoryTier>> Create(const MemoryTierOptions& options);
  ~MemoryTier();

  // Largest value this tier can hold.
  uint64_t max_value_bytes() const;
  // Stores (or replaces) the value. Rejected: no free chunk of its class, or a new key while
  // the tier holds objects_max objects (evict and retry).
  // tracked=false keeps it out of the eviction policy (pinned).
  // Every call that reaches the policy takes a RequestTag (tier_manager.h): OnRequest is called
  // when its id differs from the previous call's, and its now_us is the time of every hook;
  // a null tag or id 0 uses the clock and tells no request.
  Status Insert(const Key& key, std::span<const uint8_t> value, const MemMeta& meta, bool tracked,
                const RequestTag* request = nullptr);
  // Copies the value into *out (cleared first). NotFound on a miss. With count, a hit is
  // counted and reported to the policy; without (demotion, promotion checks) it is not.
  Status Read(const Key& key, std::vector<uint8_t>* out, MemMeta* meta = nullptr, bool count = true,
              const RequestTag* request = nullptr);
  // Before making room for a new unit of value_bytes: tells the policy its capacity in units
  // of that size the first time (OnCapacity: pages x chunks per page of the value's slab
  // class), then OnMiss(id). The caller then inserts, evicting with PickVictim while Rejected.
  void NoteMiss(const Key& key, uint64_t value_bytes, const RequestTag* request);
  bool Contains(const Key& key, MemMeta* meta = nullptr) const;
  // NotFound if absent.
  Status Remove(const Key& key, const RequestTag* request = nullptr);
  // The policy's victim, no longer tracked but still resident (the caller demotes, then
  // Removes it). nullopt when nothing is evictable.
  std::optional<Key> PickVictim(const RequestTag* request = nullptr);
  void SetTracked(const Key& key, bool tracked);
  // Replaces the eviction policy; the new one is told of every tracked unit in the order the
  // old one last heard of it (an insert or a hit), with that hook's time. InvalidArgument for
  // an unknown name or parameter (nothing changes).
  Status SetPolicy(const std::string& eviction, const policies::PolicyParams& params);
  // Calls fn for each object (a snapshot taken shard by shard).
  void ForEach(const std::function<void(const Key&, const MemMeta&)>& fn) const;
  MemoryTierStats GetStats() const;
  // "cuda-device", "cuda-pinned", "mmap" or "mmap+mlock".
  std::string arena_kind() const;

 private:
  class Impl;
  explicit MemoryTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::storage
