// Scratch<T>: a buffer that one call site reuses from call to call on its thread, so that a
// steady-state decode step does not go to the allocator for its temporaries (a few hundred
// vectors per step otherwise: about 3 % of a step of the trained miniature, and heap growth
// on the pool's threads).
//
//   thread_local std::vector<float> logits_slot;
//   Scratch<float> logits(logits_slot, n * E);   // n * E elements, values unspecified
//
// Contract: on construction the slot holds exactly n elements whose values are whatever the
// slot last held (callers write every element they read, or call fill()); while a Scratch
// lives, nothing else may use its slot (one Scratch per slot at a time: no recursion through
// the same call site). A slot whose capacity grew past kScratchKeepBytes (a long prefill) is
// released when the Scratch is destroyed, so that a thread keeps at most that much per slot.
//
// A thread_local named inside a lambda denotes the instance of the thread that runs the lambda:
// a pool worker running `[&] { slot[i]; }` reads its own (empty) slot, not the caller's. Hand
// other threads a Scratch or a local reference bound on the owning thread, never the slot's
// name.
//
// Thread safety: a slot is thread_local; a Scratch is used by the thread that made it (its
// elements may be read and written by other threads while it lives, as any buffer's).
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace kvtier::engine {

inline constexpr size_t kScratchKeepBytes = size_t{1} << 20;

template <typename T>
class Scratch {
 public:
  Scratch(std::vector<T>& slot, size_t n) : slot_(slot) { slot_.resize(n); }
  ~Scratch() {
    if (slot_.capacity() * sizeof(T) > kScratchKeepBytes) std::vector<T>().swap(slot_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  T* data() { return slot_.data(); }
  const T* data() const { return slot_.data(); }
  size_t size() const { return slot_.size(); }
  T& operator[](size_t i) { return slot_[i]; }
  const T& operator[](size_t i) const { return slot_[i]; }
  T* begin() { return slot_.data(); }
  T* end() { return slot_.data() + slot_.size(); }
  void fill(const T& value) { std::fill(slot_.begin(), slot_.end(), value); }

 private:
  std::vector<T>& slot_;
};

// For a thread_local buffer used without a Scratch (one that several calls fill in turn):
// releases it when it grew past kScratchKeepBytes.
template <typename T>
void TrimScratch(std::vector<T>& slot) {
  if (slot.capacity() * sizeof(T) > kScratchKeepBytes) std::vector<T>().swap(slot);
}

// Resizes v to n elements (new ones value-initialised), growing its capacity at least
// geometrically. resize() grows from the current size and assign() to exactly n, so a buffer
// that callers size alternately smaller and larger, or clear and refill, one element longer
// each time (a sequence's visible entries), would otherwise go to the allocator at every step.
template <typename T>
void ResizeGeometric(std::vector<T>& v, size_t n) {
  if (v.capacity() < n) v.reserve(std::max(n, 2 * v.capacity()));
  v.resize(n);
}

// Runs f when the scope ends (every return path): for trimming thread_local buffers that a
// function grows piece by piece.
//
//   ScopeExit trim([&] { TrimScratch(latents), TrimScratch(entry_ids); });
template <typename F>
class ScopeExit {
 public:
  explicit ScopeExit(F f) : f_(std::move(f)) {}
  ~ScopeExit() { f_(); }
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;

 private:
  F f_;
};

}  // namespace kvtier::engine
