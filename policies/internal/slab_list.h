// SlabList: intrusive doubly-linked lists over one slab of nodes, indexed by 32-bit slot.
// Private mechanics shared by the queue-based policies (FIFO, ARC, S3-FIFO, SIEVE, TTL): one
// allocation per slab growth instead of one heap node per object, and O(1) id -> slot lookup.
//
// Thread safety: none (owned by one policy instance).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "policies/policy.h"

namespace kvtier::policies::internal {

inline constexpr uint32_t kNil = UINT32_MAX;

// A node payload must be default-constructible; `Node` adds the links.
template <typename Payload>
class Slab {
 public:
  struct Node {
    ObjectId id = 0;
    uint32_t prev = kNil;
    uint32_t next = kNil;
    uint8_t list = 0;  // which list of the owner holds it (owner-defined)
    Payload data{};
  };

  // Allocates a node for `id` (the caller guarantees id is not yet present).
  uint32_t Alloc(ObjectId id) {
    uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
      nodes_[slot] = Node{};
    } else {
      slot = static_cast<uint32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    nodes_[slot].id = id;
    index_.emplace(id, slot);
    return slot;
  }
  void Free(uint32_t slot) {
    index_.erase(nodes_[slot].id);
    free_.push_back(slot);
  }
  // kNil when absent.
  uint32_t Find(ObjectId id) const {
    auto it = index_.find(id);
    return it == index_.end() ? kNil : it->second;
  }
  Node& operator[](uint32_t slot) { return nodes_[slot]; }
  const Node& operator[](uint32_t slot) const { return nodes_[slot]; }
  size_t Live() const { return index_.size(); }

 private:
  std::vector<Node> nodes_;
  std::vector<uint32_t> free_;
  std::unordered_map<ObjectId, uint32_t> index_;
};

// One list threaded through a Slab. head = most recently pushed.
struct ListHead {
  uint32_t head = kNil;
  uint32_t tail = kNil;
  uint64_t size = 0;

  template <typename S>
  void PushFront(S& slab, uint32_t slot) {
    auto& n = slab[slot];
    n.prev = kNil;
    n.next = head;
    if (head != kNil) slab[head].prev = slot;
    head = slot;
    if (tail == kNil) tail = slot;
    ++size;
  }
  template <typename S>
  void Unlink(S& slab, uint32_t slot) {
    auto& n = slab[slot];
    if (n.prev != kNil) {
      slab[n.prev].next = n.next;
    } else {
      head = n.next;
    }
    if (n.next != kNil) {
      slab[n.next].prev = n.prev;
    } else {
      tail = n.prev;
    }
    n.prev = n.next = kNil;
    --size;
  }
  template <typename S>
  void MoveToFront(S& slab, uint32_t slot) {
    if (head == slot) return;
    Unlink(slab, slot);
    PushFront(slab, slot);
  }
  bool empty() const { return size == 0; }
};

}  // namespace kvtier::policies::internal
