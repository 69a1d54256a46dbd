// Pacing for an accept loop after accept(2) fails.
//
// A listening socket stays readable while connections wait in its backlog, so a loop that
// retries at once after accept fails for want of a resource (EMFILE: the process has no file
// descriptor left; ENFILE, ENOBUFS, ENOMEM) spins its threads at full speed until something
// frees one, and logs nothing. The connections stay in the backlog meanwhile and are accepted
// once a descriptor is free; an accept loop therefore waits before its next accept:
//
//   if (fd < 0) {
//     const auto wait = backoff.Failed(errno);   // 0 for a failure of that one connection
//     sleep or arm a timer for `wait`, then accept again
//   } else {
//     backoff.Succeeded();
//   }
//
// The wait doubles from kFirstWait up to kWaitMax while failures go on and starts again
// after an accept succeeds. A run of failures logs a warning when it starts, unless one was
// logged less than kWarnIntervalMs before, and then an info line when an accept succeeds
// again: at most two lines per interval, however often a full descriptor table frees one
// descriptor and fills again, so it neither spins nor floods the log.
//
// Not thread-safe: one AcceptBackoff per accept loop (an asio acceptor with one accept
// outstanding at a time is one loop).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/clock.h"
#include "common/logging.h"

namespace kvtier {

class AcceptBackoff {
 public:
  static constexpr std::chrono::milliseconds kFirstWait{5};
  static constexpr std::chrono::milliseconds kWaitMax{100};
  static constexpr uint64_t kWarnIntervalMs = 10000;

  // `what` names the listener in log lines ("kvtierd RESP front"). `clock` (not owned; null:
  // the steady clock) spaces the warnings.
  explicit AcceptBackoff(std::string what, const Clock* clock = nullptr);

  // Records a failed accept with errno `err`; returns how long to wait before the next one.
  // Zero for errors that concern only the connection that failed (ECONNABORTED, EPROTO, the
  // network errors accept(2) passes on, EINTR, EAGAIN): accept again at once.
  std::chrono::milliseconds Failed(int err);

  // Records that `step` of taking a connection failed for want of a resource (errno `err`),
  // e.g. starting its thread: always a pause, returned as by Failed().
  std::chrono::milliseconds Pause(int err, const char* step);

  // Records a connection accepted and started: ends a run of failures.
  void Succeeded();

  // True for the errors Failed() answers with zero.
  static bool OnlyThatConnection(int err);

  // Failures that paused (Failed() or Pause()), since construction.
  uint64_t waits_total() const { return waits_total_; }

 private:
  std::string what_;
  const Clock* clock_;
  std::chrono::milliseconds wait_{0};      // the last wait of the current run; 0 outside a run
  uint64_t run_failures_ = 0;              // failures in the current run
  bool run_warned_ = false;                // the current run logged its warning
  LogThrottle warnings_{kWarnIntervalMs};  // spaces the runs' warnings
  uint64_t unwarned_failures_ = 0;         // failures since the last warning
  uint64_t waits_total_ = 0;
};

}  // namespace kvtier
