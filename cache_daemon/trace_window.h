// The newest recorded trace lines, kept in memory for the what-if curves (whatif.h).
//
// TraceWriter appends every line it writes to the trace file (same text, same order), so a
// window that never dropped a line holds exactly the file's contents. The window is bounded
// by a record count and a byte count ([trace] whatif_window_records_max and
// whatif_window_bytes_max); past either, the oldest lines are dropped and counted.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

namespace kvtier::daemon {

struct TraceWindowLimits {
  uint32_t records_max = 100000;   // lines kept
  uint64_t bytes_max = 16u << 20;  // bytes of those lines (newlines included)
};

class TraceWindow {
 public:
  explicit TraceWindow(TraceWindowLimits limits) : limits_(limits) {}

  // Appends one JSON line (without its newline). A line longer than bytes_max is counted
  // in dropped() and not kept.
  void Append(std::string line);

  struct Snapshot {
    std::string text;       // the kept lines, each ending in '\n', oldest first
    uint64_t records = 0;   // lines in text
    uint64_t appended = 0;  // lines ever appended (kept or not)
    uint64_t dropped = 0;   // lines no longer (or never) in the window
  };
  // A copy of the window (costs up to bytes_max of memory while held).
  Snapshot Take() const;
  // Lines ever appended; cheap, for "has anything changed".
  uint64_t appended() const;
  const TraceWindowLimits& limits() const { return limits_; }

 private:
  const TraceWindowLimits limits_;
  mutable std::mutex mu_;
  std::deque<std::string> lines_;  // protected by mu_
  uint64_t bytes_ = 0;             // protected by mu_: sum of line sizes + 1 each
  uint64_t appended_ = 0;          // protected by mu_
  uint64_t dropped_ = 0;           // protected by mu_
};

}  // namespace kvtier::daemon
