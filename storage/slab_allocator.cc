#include "storage/slab_allocator.h"

#include <algorithm>

namespace kvtier::storage {

SlabAllocator::SlabAllocator(uint64_t capacity_bytes, uint64_t page_bytes, uint64_t min_chunk_bytes)
    : page_(page_bytes) {
  uint64_t size = min_chunk_bytes;
  while (size < page_bytes) {
    classes_.push_back({size, static_cast<uint32_t>(page_bytes / size), {}});
    size = std::max(size + min_chunk_bytes,
                    (size * 5 / 4 + min_chunk_bytes - 1) / min_chunk_bytes * min_chunk_bytes);
  }
  classes_.push_back({page_bytes, 1, {}});
  const uint64_t pages = capacity_bytes / page_bytes;
  pages_.resize(pages);
  populated_.assign(pages, false);
  free_pages_.reserve(pages);
  for (uint64_t i = pages; i > 0; --i) free_pages_.push_back(static_cast<uint32_t>(i - 1));
}

int SlabAllocator::ClassFor(uint64_t size) const {
  for (size_t i = 0; i < classes_.size(); ++i) {
    if (classes_[i].chunk >= size) return static_cast<int>(i);
  }
  return -1;
}

void SlabAllocator::MarkPopulated(uint64_t p) {
  if (p < populated_.size()) populated_[p] = true;
}

void SlabAllocator::AddPartial(Class& cls, uint32_t p) {
  pages_[p].partial_at = static_cast<uint32_t>(cls.partial.size());
  cls.partial.push_back(p);
}

void SlabAllocator::RemovePartial(Class& cls, uint32_t p) {
  const uint32_t at = pages_[p].partial_at;
  const uint32_t moved = cls.partial.back();
  cls.partial[at] = moved;
  pages_[moved].partial_at = at;
  cls.partial.pop_back();
  pages_[p].partial_at = kNotPartial;
}

std::optional<uint64_t> SlabAllocator::Allocate(int c, uint64_t* first_use) {
  Class& cls = classes_[c];
  if (first_use != nullptr) *first_use = UINT64_MAX;
  if (cls.partial.empty()) {
    if (free_pages_.empty()) return std::nullopt;
    const uint32_t p = free_pages_.back();
    free_pages_.pop_back();
    Page& page = pages_[p];
    page.cls = c;
    page.live = 0;
    page.carved = 0;
    page.free.clear();
    if (!populated_[p] && first_use != nullptr) *first_use = p * page_;
    populated_[p] = true;
    AddPartial(cls, p);
  }
  // The newest partial page: a page that just went partial is reused first, so that a key
  // replaced again and again keeps to one page.
  const uint32_t p = cls.partial.back();
  Page& page = pages_[p];
  uint32_t chunk;
  if (!page.free.empty()) {
    chunk = page.free.back();
    page.free.pop_back();
  } else {
    chunk = page.carved++;
  }
  ++page.live;
  if (page.free.empty() && page.carved == cls.per_page) RemovePartial(cls, p);
  used_ += cls.chunk;
  return p * page_ + chunk * cls.chunk;
}

void SlabAllocator::Free(int c, uint64_t offset) {
  Class& cls = classes_[c];
  const auto p = static_cast<uint32_t>(offset / page_);
  Page& page = pages_[p];
  used_ -= cls.chunk;
  if (--page.live == 0) {
    // The page is empty: give it back so that any class can use it.
    if (page.partial_at != kNotPartial) RemovePartial(cls, p);
    page.cls = -1;
    page.carved = 0;
    // A page's free list holds at most a page's chunks; an empty page keeps a small one.
    page.free.clear();
    if (page.free.capacity() > kFreeKeptMax) std::vector<uint32_t>().swap(page.free);
    free_pages_.push_back(p);
    return;
  }
  page.free.push_back(static_cast<uint32_t>((offset - p * page_) / cls.chunk));
  if (page.partial_at == kNotPartial) AddPartial(cls, p);
}

}  // namespace kvtier::storage
