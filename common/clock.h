// Clock: the injectable source of time. Policies, TTLs, leases and group commit read time
// only through a Clock so that tests can drive it deterministically.
//
// Thread safety: NowMs()/NowUs() may be called from any thread. ManualClock's setters are
// thread-safe too (atomic).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvtier {

class Clock {
 public:
  virtual ~Clock() = default;
  // Microseconds since an arbitrary, fixed epoch; never goes backwards.
  virtual uint64_t NowUs() const = 0;
  uint64_t NowMs() const { return NowUs() / 1000; }
};

// Steady (monotonic) wall time. Use for timeouts, latencies and leases.
class SteadyClock final : public Clock {
 public:
  uint64_t NowUs() const override {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }
};

// Unix time in microseconds (system clock). Use for timestamps persisted on disk.
class SystemClock final : public Clock {
 public:
  uint64_t NowUs() const override {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  }
};

// A clock that moves only when told to. For tests and for the trace simulator.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(uint64_t start_us = 0) : now_us_(start_us) {}
  uint64_t NowUs() const override { return now_us_.load(std::memory_order_relaxed); }
  void SetUs(uint64_t now_us) { now_us_.store(now_us, std::memory_order_relaxed); }
  void AdvanceUs(uint64_t delta_us) { now_us_.fetch_add(delta_us, std::memory_order_relaxed); }
  void AdvanceMs(uint64_t delta_ms) { AdvanceUs(delta_ms * 1000); }

 private:
  std::atomic<uint64_t> now_us_;
};

// Process-wide default clocks (never destroyed).
const Clock& DefaultSteadyClock();
const Clock& DefaultSystemClock();

}  // namespace kvtier
