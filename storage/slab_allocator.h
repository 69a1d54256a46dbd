// Slab allocator over a memory tier's arena: fixed-size pages, each carved into the chunks of
// one size class while it holds a live chunk, and given back to every class when its last
// chunk is freed.
//
// Every operation costs O(1) (amortised over a vector's growth), whatever the arena's size.
// Before, a class kept one free list of all its chunks and a page going empty was removed from
// it by a scan: a RESP SET replacing a key whose page then emptied scanned every free chunk of
// the class (about half of kvtierd's CPU under `redis-benchmark -t set -d 1024`), and a large
// tier of small chunks would scan millions per free. Now each page keeps its own free chunks
// and a class the pages that have one.
//
// Not thread-safe: MemoryTier guards it with its allocation mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace kvtier::storage {

class SlabAllocator {
 public:
  // capacity_bytes / page_bytes pages; size classes from min_chunk_bytes up to page_bytes,
  // each about 5/4 of the one before, rounded up to a multiple of min_chunk_bytes.
  SlabAllocator(uint64_t capacity_bytes, uint64_t page_bytes, uint64_t min_chunk_bytes = 64);

  // The smallest class whose chunks hold size bytes; -1 when size is over a page.
  int ClassFor(uint64_t size) const;
  uint64_t chunk_size(int c) const { return classes_[c].chunk; }
  int classes() const { return static_cast<int>(classes_.size()); }

  // Arena offset of a free chunk of class c, or nullopt when the class has no free chunk and
  // no page is free. *first_use (may be null) is set to the offset of the chunk's page when
  // the page is used for the first time (for the caller to populate it, outside its lock),
  // else to UINT64_MAX.
  std::optional<uint64_t> Allocate(int c, uint64_t* first_use = nullptr);
  // Returns a chunk Allocate(c) handed out. A page whose last chunk this was goes back to the
  // free pages, for any class.
  void Free(int c, uint64_t offset);
  // Records that page p is populated already (its first use then populates nothing).
  void MarkPopulated(uint64_t p);

  uint64_t used() const { return used_; }  // bytes of the chunks handed out
  uint64_t free_pages() const { return free_pages_.size(); }

 private:
  static constexpr uint32_t kNotPartial = UINT32_MAX;
  static constexpr size_t kFreeKeptMax = 1024;  // free-list entries an empty page keeps room for
  struct Class {
    uint64_t chunk;
    uint32_t per_page;
    std::vector<uint32_t> partial;  // pages of this class with a free chunk
  };
  struct Page {
    int cls = -1;
    uint32_t live = 0;
    // Chunks [0, carved) have been handed out since the page joined its class; those of them
    // that are free again are in `free`. A page joins a class with nothing carved, in O(1).
    uint32_t carved = 0;
    uint32_t partial_at = kNotPartial;  // index in its class's `partial`
    std::vector<uint32_t> free;
  };
  void AddPartial(Class& cls, uint32_t p);
  void RemovePartial(Class& cls, uint32_t p);

  uint64_t page_;
  std::vector<Class> classes_;
  std::vector<Page> pages_;
  std::vector<bool> populated_;  // per page: handed out before (populated by then)
  std::vector<uint32_t> free_pages_;
  uint64_t used_ = 0;
};

}  // namespace kvtier::storage
