#include "storage/memory_tier.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#ifdef KVTIER_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/logging.h"
#include "storage/key_util.h"
#include "storage/slab_allocator.h"

namespace kvtier::storage {
namespace {

constexpr uint32_t kMaxShards = 256;
constexpr uint64_t kMinChunkBytes = 64;
// Bytes of slab pages a host arena populates at open (MemoryTier::Impl::Init): two pages of
// the default 4 MiB; none when a page is larger.
constexpr uint64_t kWarmSlabBytes = 8ull << 20;
constexpr uintptr_t kHugePageBytes = 2u << 20;  // x86-64 PMD size: a host arena's alignment

// The backing memory of a tier. Copies go through CopyIn/CopyOut so a device arena can use
// cudaMemcpy.
class Arena {
 public:
  static StatusOr<std::unique_ptr<Arena>> Create(Tier tier, uint64_t bytes, bool use_cuda,
                                                 bool lock) {
    auto a = std::unique_ptr<Arena>(new Arena());
    a->bytes_ = bytes;
#ifdef KVTIER_WITH_CUDA
    int devices = 0;
    if (use_cuda && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
      void* p = nullptr;
      cudaError_t err = tier == Tier::kHbm ? cudaMalloc(&p, bytes)
                                           : cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
      if (err == cudaSuccess) {
        a->base_ = static_cast<uint8_t*>(p);
        a->kind_ = tier == Tier::kHbm ? Kind::kCudaDevice : Kind::kCudaPinned;
        return a;
      }
      KVTIER_LOG(kWarn) << "CUDA arena of " << bytes << " bytes failed (" << cudaGetErrorString(err)
                        << "); using host memory";
    }
#else
    (void)tier;
    (void)use_cuda;
#endif
    // Mapped 2 MiB-aligned and advised for transparent huge pages (where THP is "madvise" or
    // "always"): a slab page's first use then maps 2 MiB pages instead of 4 KiB ones. The
    // first touch of each 4 KiB page costs about 10 us of CPU in a virtual machine with
    // shadow page tables (this project's paravirtualised guest); within a huge page it is
    // one fault per 2 MiB
    // (docs/performance/resume.md, "Resume fetch: per-unit CPU"). Advisory: 4 KiB pages where THP
    // is off or no huge page is free. The slack around the aligned range is unmapped.
    const uint64_t len = (bytes + 4095) & ~uint64_t{4095};
    void* p = ::mmap(nullptr, len + kHugePageBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return Status::Rejected("cannot map a memory arena");
    uint8_t* const raw = static_cast<uint8_t*>(p);
    uint8_t* const base = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(raw) + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
    if (base > raw) (void)::munmap(raw, base - raw);
    if (raw + len + kHugePageBytes > base + len) {
      (void)::munmap(base + len, raw + len + kHugePageBytes - (base + len));
    }
    (void)::madvise(base, len, MADV_HUGEPAGE);
    a->base_ = base;
    a->bytes_ = len;
    a->kind_ = Kind::kMmap;
    if (lock) {
      if (::mlock(base, len) == 0) {
        a->locked_ = true;
      } else {
        KVTIER_LOG(kWarn) << "mlock of the DRAM arena failed; continuing unlocked";
      }
    }
    return a;
  }
  ~Arena() {
#ifdef KVTIER_WITH_CUDA
    if (kind_ == Kind::kCudaDevice) {
      cudaFree(base_);
      return;
    }
    if (kind_ == Kind::kCudaPinned) {
      cudaFreeHost(base_);
      return;
    }
#endif
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }
  void CopyIn(uint64_t offset, const uint8_t* src, size_t n) {
#ifdef KVTIER_WITH_CUDA
    if (kind_ == Kind::kCudaDevice) {
      cudaMemcpy(base_ + offset, src, n, cudaMemcpyHostToDevice);
      return;
    }
#endif
    std::memcpy(base_ + offset, src, n);
  }
  // Prefaults [offset, offset + n) writable in one call (host mmap arenas; the CUDA ones are
  // resident already), so the copies into it take no page fault per 4 KiB page. Advisory:
  // where the kernel lacks MADV_POPULATE_WRITE (before Linux 5.14) pages fault in on use.
  void Populate(uint64_t offset, uint64_t n) {
#ifdef MADV_POPULATE_WRITE
    if (kind_ == Kind::kMmap) (void)::madvise(base_ + offset, n, MADV_POPULATE_WRITE);
#else
    (void)offset;
    (void)n;
#endif
  }
  void CopyOut(uint64_t offset, uint8_t* dst, size_t n) const {
#ifdef KVTIER_WITH_CUDA
    if (kind_ == Kind::kCudaDevice) {
      cudaMemcpy(dst, base_ + offset, n, cudaMemcpyDeviceToHost);
      return;
    }
#endif
    std::memcpy(dst, base_ + offset, n);
  }
  std::string kind() const {
    switch (kind_) {
      case Kind::kCudaDevice:
        return "cuda-device";
      case Kind::kCudaPinned:
        return "cuda-pinned";
      case Kind::kMmap:
        break;
    }
    return locked_ ? "mmap+mlock" : "mmap";
  }

 private:
  enum class Kind { kMmap, kCudaPinned, kCudaDevice };
  Arena() = default;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  Kind kind_ = Kind::kMmap;
  bool locked_ = false;
};

struct Slot {
  uint64_t offset = 0;
  int cls = 0;
  MemMeta meta;
};

}  // namespace

class MemoryTier::Impl {
 public:
  explicit Impl(const MemoryTierOptions& o) : o_(o) {}

  Status Init() {
    clock_ = o_.clock != nullptr ? o_.clock : &DefaultSteadyClock();
    if (o_.slab_page_bytes < 4096) return Status::InvalidArgument("slab_page_bytes < 4096");
    if (o_.capacity_bytes < o_.slab_page_bytes) {
      return Status::InvalidArgument("memory tier capacity smaller than one slab page");
    }
    o_.shards = std::clamp<uint32_t>(o_.shards, 1, kMaxShards);
    KVTIER_ASSIGN_OR_RETURN(arena_, Arena::Create(o_.tier, o_.capacity_bytes, o_.use_cuda,
                                                  o_.mlock && o_.tier == Tier::kDram));
    alloc_ = std::make_unique<SlabAllocator>(o_.capacity_bytes, o_.slab_page_bytes, kMinChunkBytes);
    // The first slab pages handed out (pages go in arena order) are populated now, at open,
    // rather than by the first inserts: after a restart the first resume's promotions then
    // copy into pages the kernel has already zeroed (19% of kvtierd's CPU in the first
    // 256-unit GET after a restart; docs/performance/resume.md, "one write per GET").
    const uint64_t pages = o_.capacity_bytes / o_.slab_page_bytes;
    const uint64_t warm_pages =
        o_.prefault ? pages : std::min<uint64_t>(kWarmSlabBytes / o_.slab_page_bytes, pages);
    const uint64_t populate_start_us = clock_->NowUs();
    if (warm_pages > 0) {
      arena_->Populate(0, warm_pages * o_.slab_page_bytes);
      for (uint64_t p = 0; p < warm_pages; ++p) alloc_->MarkPopulated(p);
    }
    if (o_.prefault) {
      KVTIER_LOG(kInfo) << TierName(o_.tier)
                        << " tier: " << ((warm_pages * o_.slab_page_bytes) >> 20)
                        << " MiB populated at open in "
                        << (clock_->NowUs() - populate_start_us) / 1000 << " ms";
    }
    shards_ = std::vector<Shard>(o_.shards);
    if (o_.eviction_policy_factory) {
      policy_ = o_.eviction_policy_factory();
    } else {
      KVTIER_ASSIGN_OR_RETURN(policy_,
                              policies::MakeEvictionPolicy(o_.eviction_policy, o_.policy_params));
    }
    policy_ = policies::WithStructure(std::move(policy_), o_.structure, &layer_);
    return Status::Ok();
  }

  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<Key, Slot, KeyHash> map;
  };
  Shard& ShardOf(const Key& k) { return shards_[(ObjectIdOf(k) >> 56) % shards_.size()]; }
  const Shard& ShardOf(const Key& k) const {
    return shards_[(ObjectIdOf(k) >> 56) % shards_.size()];
  }

  Status Insert(const Key& key, std::span<const uint8_t> value, const MemMeta& meta, bool tracked,
                const RequestTag* request) {
    if (value.size() > o_.slab_page_bytes)
      return Status::InvalidArgument("value larger than a slab");
    if (o_.objects_max > 0 && objects_.load(std::memory_order_relaxed) >= o_.objects_max &&
        !Contains(key, nullptr)) {
      return Status::Rejected("memory tier holds objects_max objects");
    }
    int c = alloc_->ClassFor(std::max<uint64_t>(value.size(), 1));
    uint64_t off, first_use;
    {
      std::lock_guard lock(alloc_mu_);
      auto o = alloc_->Allocate(c, &first_use);
      if (!o) return Status::Rejected("memory tier full");
      off = *o;
    }
    // A slab page's first use populates all of it at once (a page fault per 4 KiB otherwise,
    // on every promotion into it); another insert may copy into the page meanwhile: harmless.
    if (first_use != UINT64_MAX) arena_->Populate(first_use, o_.slab_page_bytes);
    arena_->CopyIn(off, value.data(), value.size());
    Slot slot{off, c, meta};
    slot.meta.size_bytes = static_cast<uint32_t>(value.size());
    std::optional<Slot> old;
    {
      Shard& s = ShardOf(key);
      std::lock_guard lock(s.mu);
      auto [it, inserted] = s.map.try_emplace(key, slot);
      if (inserted) objects_.fetch_add(1, std::memory_order_relaxed);
      if (!inserted) {
        old = it->second;
        it->second = slot;
      }
    }
    {
      std::lock_guard lock(alloc_mu_);
      if (old) {
        alloc_->Free(old->cls, old->offset);
        used_bytes_ -= old->meta.size_bytes;
      }
      used_bytes_ += value.size();
    }
    {
      std::lock_guard lock(policy_mu_);
      const uint64_t now_us = Enter(request);
      if (old) Untrack(key);
      if (tracked) {
        Track(key, slot.meta, now_us);
        untracked_.erase(key);
      } else {
        untracked_.insert(key);
      }
    }
    bytes_written_.fetch_add(value.size(), std::memory_order_relaxed);
    return Status::Ok();
  }

  Status Read(const Key& key, std::vector<uint8_t>* out, MemMeta* meta, bool count,
              const RequestTag* request) {
    {
      const Shard& s = ShardOf(key);
      std::lock_guard lock(s.mu);
      auto it = s.map.find(key);
      if (it == s.map.end()) return Status::NotFound("not in memory tier");
      out->resize(it->second.meta.size_bytes);
      arena_->CopyOut(it->second.offset, out->data(), out->size());
      if (meta != nullptr) *meta = it->second.meta;
    }
    if (!count) return Status::Ok();
    hits_.fetch_add(1, std::memory_order_relaxed);
    bytes_read_.fetch_add(out->size(), std::memory_order_relaxed);
    {
      std::lock_guard lock(policy_mu_);
      auto it = id_to_key_.find(ObjectIdOf(key));
      if (it != id_to_key_.end() && it->second.key == key) {
        const uint64_t now_us = Enter(request);
        policy_->OnAccess(it->first, now_us);
        it->second.touch_us = now_us;
        it->second.touch_seq = ++touch_seq_;
      }
    }
    return Status::Ok();
  }

  bool Contains(const Key& key, MemMeta* meta) const {
    const Shard& s = ShardOf(key);
    std::lock_guard lock(s.mu);
    auto it = s.map.find(key);
    if (it == s.map.end()) return false;
    if (meta != nullptr) *meta = it->second.meta;
    return true;
  }

  Status Remove(const Key& key, const RequestTag* request) {
    Slot slot;
    {
      Shard& s = ShardOf(key);
      std::lock_guard lock(s.mu);
      auto it = s.map.find(key);
      if (it == s.map.end()) return Status::NotFound("not in memory tier");
      slot = it->second;
      s.map.erase(it);
      objects_.fetch_sub(1, std::memory_order_relaxed);
    }
    {
      std::lock_guard lock(alloc_mu_);
      alloc_->Free(slot.cls, slot.offset);
      used_bytes_ -= slot.meta.size_bytes;
    }
    std::lock_guard lock(policy_mu_);
    if (request != nullptr) (void)Enter(request);
    Untrack(key);
    untracked_.erase(key);
    return Status::Ok();
  }

  void NoteMiss(const Key& key, uint64_t value_bytes, const RequestTag* request) {
    const int c = alloc_->ClassFor(std::max<uint64_t>(value_bytes, 1));
    std::lock_guard lock(policy_mu_);
    if (!capacity_told_ && c >= 0) {
      const uint64_t chunk = alloc_->chunk_size(c);
      policy_->OnCapacity((o_.capacity_bytes / o_.slab_page_bytes) * (o_.slab_page_bytes / chunk));
      capacity_told_ = true;
    }
    const uint64_t now_us = Enter(request);
    policy_->OnMiss(ObjectIdOf(key), now_us);
  }

  std::optional<Key> PickVictim(const RequestTag* request) {
    std::lock_guard lock(policy_mu_);
    const uint64_t now_us = Enter(request);
    while (true) {
      auto id = policy_->Evict(now_us);
      if (!id) return std::nullopt;
      auto it = id_to_key_.find(*id);
      if (it == id_to_key_.end()) continue;
      Key k = it->second.key;
      id_to_key_.erase(it);
      evictions_.fetch_add(1, std::memory_order_relaxed);
      return k;
    }
  }

  void SetTracked(const Key& key, bool tracked) {
    MemMeta meta;
    bool present = Contains(key, &meta);
    std::lock_guard lock(policy_mu_);
    if (tracked) {
      if (untracked_.erase(key) == 0 || !present) return;
      Track(key, meta, clock_->NowUs());
    } else {
      if (!present || !untracked_.insert(key).second) return;
      Untrack(key);
    }
  }

  Status SetPolicy(const std::string& eviction, const policies::PolicyParams& params) {
    KVTIER_ASSIGN_OR_RETURN(auto policy, policies::MakeEvictionPolicy(eviction, params));
    std::vector<std::pair<Key, MemMeta>> all;
    ForEach([&](const Key& k, const MemMeta& m) { all.emplace_back(k, m); });
    std::lock_guard lock(policy_mu_);
    // The new policy learns the units in the order the old one last heard of each (an insert
    // or a hit), each at that time: a recency order carries over (it used to be the shards'
    // hash order, all at one time). A unit the old policy did not track (inserted since the
    // snapshot's shard was read) comes first, at now.
    struct Entry {
      uint64_t touch_seq, touch_us;
      const Key* key;
      const MemMeta* meta;
    };
    std::vector<Entry> order;
    order.reserve(all.size());
    const uint64_t now_us = clock_->NowUs();
    for (const auto& [k, m] : all) {
      if (untracked_.count(k)) continue;
      auto it = id_to_key_.find(ObjectIdOf(k));
      const bool known = it != id_to_key_.end() && it->second.key == k;
      order.push_back(
          {known ? it->second.touch_seq : 0, known ? it->second.touch_us : now_us, &k, &m});
    }
    std::sort(order.begin(), order.end(),
              [](const Entry& a, const Entry& b) { return a.touch_seq < b.touch_seq; });
    policy_ = policies::WithStructure(std::move(policy), o_.structure, &layer_);
    capacity_told_ = false;
    current_request_ = 0;
    id_to_key_.clear();
    for (const Entry& e : order) Track(*e.key, *e.meta, e.touch_us);
    return Status::Ok();
  }

  void ForEach(const std::function<void(const Key&, const MemMeta&)>& fn) const {
    for (const Shard& s : shards_) {
      std::vector<std::pair<Key, MemMeta>> snap;
      {
        std::lock_guard lock(s.mu);
        for (const auto& [k, slot] : s.map) snap.emplace_back(k, slot.meta);
      }
      for (const auto& [k, m] : snap) fn(k, m);
    }
  }

  MemoryTierStats GetStats() const {
    MemoryTierStats st;
    st.capacity_bytes = o_.capacity_bytes;
    st.objects_max = o_.objects_max;
    {
      std::lock_guard lock(alloc_mu_);
      st.used_bytes = used_bytes_;
      st.chunk_bytes = alloc_->used();
    }
    st.objects = objects_.load(std::memory_order_relaxed);
    st.hits = hits_.load();
    st.evictions = evictions_.load();
    st.bytes_read = bytes_read_.load();
    st.bytes_written = bytes_written_.load();
    return st;
  }

  MemoryTierOptions o_;
  const Clock* clock_ = nullptr;
  std::unique_ptr<Arena> arena_;

 private:
  // Under policy_mu_: the time of this call's hooks; tells the policy when a request begins
  // or resumes (RequestTag).
  uint64_t Enter(const RequestTag* request) {
    if (request == nullptr || request->id == 0) return clock_->NowUs();
    if (request->id != current_request_) {
      if (layer_ != nullptr) {
        layer_->BeginRequest(request->id, request->now_us);
      } else {
        policy_->OnRequest(request->now_us);
      }
      current_request_ = request->id;
    }
    return request->now_us;
  }
  void Track(const Key& k, const MemMeta& m, uint64_t now_us) {
    auto [it, inserted] = id_to_key_.emplace(ObjectIdOf(k), Tracked{k, now_us, ++touch_seq_});
    if (!inserted && it->second.key != k) return;  // id collision: leave untracked
    policies::ObjectInfo info;
    info.id = ObjectIdOf(k);
    info.size_bytes = m.size_bytes;
    info.parent_id = m.parent_id;
    info.recompute_tokens = m.recompute_tokens;
    info.kind = m.kind;
    if (inserted) policy_->OnInsert(info, now_us);
  }
  void Untrack(const Key& k) {
    auto it = id_to_key_.find(ObjectIdOf(k));
    if (it == id_to_key_.end() || it->second.key != k) return;
    policy_->OnRemove(it->first);
    id_to_key_.erase(it);
  }

  mutable std::mutex alloc_mu_;
  std::unique_ptr<SlabAllocator> alloc_;
  uint64_t used_bytes_ = 0;
  // Objects in the shards' maps (checked against objects_max before an insert allocates;
  // GetStats reports it).
  std::atomic<uint64_t> objects_{0};
  std::vector<Shard> shards_;
  std::mutex policy_mu_;
  std::unique_ptr<policies::EvictionPolicy> policy_;
  policies::PrefixLayer* layer_ = nullptr;  // policy_ itself under Structure::kPrefix
  // A tracked unit: its key, and when the policy last heard of it (an insert or a hit; the time
  // its hook got, and a sequence number), for SetPolicy to re-track in that order.
  struct Tracked {
    Key key;
    uint64_t touch_us = 0;
    uint64_t touch_seq = 0;
  };
  std::unordered_map<policies::ObjectId, Tracked> id_to_key_;
  uint64_t touch_seq_ = 0;
  std::unordered_set<Key, KeyHash> untracked_;
  bool capacity_told_ = false;    // OnCapacity given to this policy instance
  uint64_t current_request_ = 0;  // id of the request the policy was last told of
  std::atomic<uint64_t> hits_{0}, evictions_{0}, bytes_read_{0}, bytes_written_{0};
};

MemoryTier::MemoryTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MemoryTier::~MemoryTier() = default;

StatusOr<std::unique_ptr<MemoryTier>> MemoryTier::Create(const MemoryTierOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVTIER_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<MemoryTier>(new MemoryTier(std::move(impl)));
}

uint64_t MemoryTier::max_value_bytes() const { return impl_->o_.slab_page_bytes; }
Status MemoryTier::Insert(const Key& key, std::span<const uint8_t> value, const MemMeta& meta,
                          bool tracked, const RequestTag* request) {
  return impl_->Insert(key, value, meta, tracked, request);
}
Status MemoryTier::Read(const Key& key, std::vector<uint8_t>* out, MemMeta* meta, bool count,
                        const RequestTag* request) {
  return impl_->Read(key, out, meta, count, request);
}
void MemoryTier::NoteMiss(const Key& key, uint64_t value_bytes, const RequestTag* request) {
  impl_->NoteMiss(key, value_bytes, request);
}
bool MemoryTier::Contains(const Key& key, MemMeta* meta) const {
  return impl_->Contains(key, meta);
}
Status MemoryTier::Remove(const Key& key, const RequestTag* request) {
  return impl_->Remove(key, request);
}
std::optional<Key> MemoryTier::PickVictim(const RequestTag* request) {
  return impl_->PickVictim(request);
}
void MemoryTier::SetTracked(const Key& key, bool tracked) { impl_->SetTracked(key, tracked); }
Status MemoryTier::SetPolicy(const std::string& eviction, const policies::PolicyParams& params) {
  return impl_->SetPolicy(eviction, params);
}
void MemoryTier::ForEach(const std::function<void(const Key&, const MemMeta&)>& fn) const {
  impl_->ForEach(fn);
}
MemoryTierStats MemoryTier::GetStats() const { return impl_->GetStats(); }
std::string MemoryTier::arena_kind() const { return impl_->arena_->kind(); }

}  // namespace kvtier::storage
